"""Draft trees on the spec-v2 worker: the index logic after verify, on CPU.

A verify step of a tree writes its nodes to the KV slots
``[seq_len, seq_len + num_draft_tokens)``; the worker then moves the accepted
path's KV to the front and gathers predict / hidden states / KV slots of the
path into the chain layout (speculative/spec_v2_trees.py). These tests run the worker's own code after
verify, its triton kernels in triton's interpreter, over random trees and
accepted paths, and check the chain layout that the bonus tokens, draft extend,
the scheduler's output slicing and the next step's KV reads assume.
"""

import random
import unittest
from types import SimpleNamespace

import torch
from sglang.srt.mem_cache.memory_pool import move_kv_cache_native
from sglang.srt.speculative import eagle_info_v2
from sglang.srt.speculative.spec_v2_trees import (
    finalize_accept_tree_path,
    gather_accept_path,
    spec_v2_tree_v1_reason,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang.test.triton_interpreter import (
    IN_TRITON_INTERPRETER,
    run_in_triton_interpreter,
)

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

NUM_STEPS, TOPK, NUM_DRAFT_TOKENS = 2, 4, 16
PATH_LEN = NUM_STEPS + 1  # the chain layout after verify, per request


def random_tree_paths(rng: random.Random, bs: int, ndt: int, num_steps: int):
    """Per request: an accepted path of increasing node indices starting at the
    root (node 0), as verify_tree_greedy returns it (global indices, -1 padded),
    and its length incl. the bonus token."""
    accept_index = torch.full((bs, num_steps + 1), -1, dtype=torch.int32)
    accept_lens = torch.zeros(bs, dtype=torch.int32)
    for b in range(bs):
        n = rng.randint(1, num_steps + 1)
        nodes = [0] + sorted(rng.sample(range(1, ndt), n - 1))
        accept_index[b, :n] = torch.tensor(nodes) + b * ndt
        accept_lens[b] = n
    return accept_index, accept_lens


class KVPool:
    """One layer of K and V; moves KV as the pool does without its GPU kernel."""

    def __init__(self, size: int):
        self.k_buffer = [torch.full((size,), -1, dtype=torch.int64)]
        self.v_buffer = [torch.full((size,), -1, dtype=torch.int64)]

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        move_kv_cache_native(self.k_buffer, self.v_buffer, tgt_loc, src_loc)


class TestGatherAcceptPath(CustomTestCase):
    def test_small_example(self):
        x = torch.arange(8) * 10  # bs 2, 4 nodes each
        accept_index = torch.tensor([[0, 2, 3], [4, 7, -1]])
        out = gather_accept_path(x, accept_index)
        self.assertEqual(out.tolist(), [0, 20, 30, 40, 70, 0])

    def test_hidden_states_rows_follow_the_path(self):
        rng = random.Random(0)
        bs, hidden = 5, 7
        x = torch.randn(bs * NUM_DRAFT_TOKENS, hidden)
        accept_index, accept_lens = random_tree_paths(
            rng, bs, NUM_DRAFT_TOKENS, NUM_STEPS
        )
        out = gather_accept_path(x, accept_index)
        self.assertEqual(out.shape, (bs * PATH_LEN, hidden))
        for b in range(bs):
            for j in range(int(accept_lens[b])):
                row = out[b * PATH_LEN + j]
                self.assertTrue(torch.equal(row, x[int(accept_index[b, j])]))


@unittest.skipUnless(IN_TRITON_INTERPRETER, "TestVerifyToNextStepLayoutOnCPU runs it")
class TestVerifyToNextStepLayout(CustomTestCase):
    """verify -> accept -> bonus tokens -> KV move -> gather -> scheduler
    slicing -> draft extend inputs, over random trees, through the code the
    worker runs after verify (finalize_accept_tree_path, fill_bonus_tokens)."""

    def run_case(self, seed: int, bs: int):
        rng = random.Random(seed)
        ndt, pool_len = NUM_DRAFT_TOKENS, 64
        # req_to_token rows: distinct slots per request (slot 0 is the padding slot).
        perm = torch.randperm(
            bs * pool_len, generator=torch.Generator().manual_seed(seed)
        )
        req_to_token = (perm.view(bs, pool_len) + 1).to(torch.int32)
        seq_lens = torch.tensor([rng.randint(3, 20) for _ in range(bs)])
        # Verify: node k of request b is written at req_to_token[b, seq_len + k].
        out_cache_loc = torch.cat(
            [req_to_token[b, seq_lens[b] : seq_lens[b] + ndt] for b in range(bs)]
        ).long()
        pool = KVPool(bs * pool_len + 1)
        node_id = torch.arange(bs * ndt)  # global node index as the KV payload
        pool.k_buffer[0][out_cache_loc] = node_id
        predict = (torch.arange(bs * ndt) * 7 + 1000).to(torch.int32)
        hidden = torch.randn(bs * ndt, 3)
        accept_index, accept_lens = random_tree_paths(rng, bs, ndt, NUM_STEPS)

        accept_tokens = predict[accept_index]
        bonus = torch.empty_like(accept_lens)
        batch = SimpleNamespace(
            seq_lens=seq_lens,
            req_pool_indices=torch.arange(bs),
            out_cache_loc=out_cache_loc,
        )
        eagle_info_v2.fill_bonus_tokens[(bs,)](
            accept_tokens, accept_lens, bonus, accept_index.shape[1]
        )
        path_predict, path_hidden, path_cache_loc = finalize_accept_tree_path(
            req_to_token, pool, batch, accept_index, accept_lens, predict, hidden
        )
        self.assertEqual(path_predict.shape, (bs * PATH_LEN,))
        self.assertEqual(path_hidden.shape, (bs * PATH_LEN, 3))

        for b in range(bs):
            n, base = int(accept_lens[b]), int(seq_lens[b])
            path = accept_index[b, :n].long()
            rows = slice(b * PATH_LEN, b * PATH_LEN + n)
            # The bonus token: the last accepted prediction.
            self.assertEqual(int(bonus[b]), int(predict[path[-1]]))
            # Target KV of positions [seq_len, seq_len + n): the accepted nodes.
            slots = req_to_token[b, base : base + n].long()
            self.assertEqual(pool.k_buffer[0][slots].tolist(), path.tolist())
            # Scheduler slicing (stride num_steps + 1): the accepted tokens.
            self.assertEqual(path_predict[rows].tolist(), predict[path].tolist())
            self.assertEqual(int(path_predict[rows][-1]), int(bonus[b]))
            # Draft extend over num_steps + 1 tokens per request: its KV slots
            # are those of positions [seq_len, seq_len + num_steps + 1), its
            # rows j < n the path's, select_index b * PATH_LEN + n - 1 the last.
            self.assertEqual(
                path_cache_loc[b * PATH_LEN : (b + 1) * PATH_LEN].tolist(),
                req_to_token[b, base : base + PATH_LEN].long().tolist(),
            )
            self.assertTrue(torch.equal(path_hidden[rows], hidden[path]))
            select = b * PATH_LEN + n - 1
            self.assertTrue(torch.equal(path_hidden[select], hidden[path[-1]]))

    def test_random_trees(self):
        for seed in range(12):
            with self.subTest(seed=seed):
                self.run_case(seed, bs=1 + seed % 7)


@unittest.skipIf(IN_TRITON_INTERPRETER, "this process already is the second one")
class TestVerifyToNextStepLayoutOnCPU(CustomTestCase):
    """Runs TestVerifyToNextStepLayout in triton's interpreter."""

    def test_in_triton_interpreter(self):
        run_in_triton_interpreter(self, f"{__file__}::TestVerifyToNextStepLayout")


class TestV1Reason(CustomTestCase):
    def test_trees_at_page_size_one_stay_on_v2(self):
        for topk in (None, 1, 4, 8):
            self.assertIsNone(spec_v2_tree_v1_reason(topk, 1, False))

    def test_chains_stay_on_v2(self):
        self.assertIsNone(spec_v2_tree_v1_reason(1, 16, True))

    def test_trees_with_pages_or_linear_attention_go_to_v1(self):
        self.assertIn("page size 1", spec_v2_tree_v1_reason(4, 16, False))
        self.assertIn("linear-attention", spec_v2_tree_v1_reason(4, 1, True))


if __name__ == "__main__":
    unittest.main()
