"""KV sizing of load-aware decode steps on a real ScheduleBatch, on CPU.

A speculative server's decode step allocates in eagle_prepare_for_decode
``max(cur, pageceil(kv_committed_len + reserve))`` per request, and the decode
memory check (new_tokens_required_next_decode) estimates the same amount, with
``reserve = spec_policy.decode_kv_reserve(batch)``: upstream's double buffer on
a speculative step, the previous step's uncommitted tokens plus one on a plain
step. Real ReqToTokenPool, token / paged allocators and ChunkCache, a real
prefill (prepare_for_extend) and prepare_for_decode; no model, no worker.

The pools' bookkeeping is made of triton kernels, which run on CPU tensors in
triton's interpreter: TestInTritonInterpreter runs this module in a second
process that has it.
"""

import unittest

import torch

from sglang.srt.mem_cache.allocation_sizing import (
    get_alloc_len_per_decode,
    get_alloc_reserve_per_decode,
)
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_policy import SpecPolicy
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.cpu_schedule_batch import (
    TinyEagleTestCase,
    cpu_kv_pools,
    prefilled_batch,
)
from sglang.test.test_utils import CustomTestCase
from sglang.test.triton_interpreter import (
    IN_TRITON_INTERPRETER,
    run_in_triton_interpreter,
)

register_cpu_ci(est_time=40, suite="base-a-test-cpu")

NEEDS_INTERPRETER = "runs in triton's interpreter (TestInTritonInterpreter)"


def page_ceil(n: int, page_size: int) -> int:
    return (n + page_size - 1) // page_size * page_size


@unittest.skipUnless(IN_TRITON_INTERPRETER, NEEDS_INTERPRETER)
class KVSizingTestBase(TinyEagleTestCase):
    page_size = 1
    num_steps, topk, num_draft_tokens = 3, 1, 4
    alloc_len = 4  # one speculative step's KV per request (allocation_sizing)
    prompt_lens = [3, 5, 2, 4]
    max_context_len = 128
    attention_backend = None

    def setUp(self):
        self.publish_eagle_args(
            self.num_steps,
            self.topk,
            self.num_draft_tokens,
            page_size=self.page_size,
            attention_backend=self.attention_backend,
        )
        self.pools = cpu_kv_pools(
            max_context_len=self.max_context_len,
            num_kv_tokens=4096,
            page_size=self.page_size,
        )
        self.allocator = self.pools.allocator

    def decode_batch(self):
        """A batch right after prefill and the draft extend, before its first
        decode step."""
        batch = prefilled_batch(
            self.pools,
            self.model_config,
            SpeculativeAlgorithm.EAGLE,
            self.prompt_lens,
            max_new_tokens=64,
            enable_overlap=True,
        )
        bs = len(self.prompt_lens)
        bonus = torch.tensor([req.output_ids[-1] for req in batch.reqs])
        batch.spec_info = EagleDraftInput(
            topk_p=torch.full((bs, self.topk), 0.5),
            topk_index=torch.zeros((bs, self.topk), dtype=torch.int64),
            hidden_states=torch.zeros((bs, 16)),
            bonus_tokens=bonus,
        )
        batch.filter_batch()
        return batch

    def set_mode(self, batch, plain: bool, prev_plain: bool):
        batch.spec_plain_step = plain
        batch.spec_prev_plain_step = prev_plain

    def prepare(self, batch, reserve: int):
        """prepare_for_decode, checked against the formula with ``reserve``:
        what it allocates, what the memory check estimated, and the rows."""
        committed = [req.kv_committed_len for req in batch.reqs]
        cur = [req.kv.kv_allocated_len for req in batch.reqs]
        estimate = batch.new_tokens_required_next_decode()
        free_before = self.allocator.available_size()

        batch.prepare_for_decode()

        expected = [
            max(c, page_ceil(k + reserve, self.page_size))
            for c, k in zip(cur, committed)
        ]
        self.assertEqual([req.kv.kv_allocated_len for req in batch.reqs], expected)
        self.assertEqual(free_before - self.allocator.available_size(), estimate)
        # Nothing is committed at prepare time.
        self.assertEqual([req.kv_committed_len for req in batch.reqs], committed)
        self.check_rows(batch)
        return estimate

    def check_rows(self, batch):
        """Every allocated position has its own slot (0 is the padding slot);
        paged: position p sits at offset p % page_size of the page of the
        positions before it."""
        slots = []
        for req in batch.reqs:
            row = self.pools.req_to_token_pool.req_to_token[
                req.req_pool_idx, : req.kv.kv_allocated_len
            ].tolist()
            self.assertTrue(all(slot > 0 for slot in row), req.rid)
            for pos, slot in enumerate(row):
                self.assertEqual(slot % self.page_size, pos % self.page_size)
                if pos % self.page_size:
                    self.assertEqual(slot, row[pos - 1] + 1, (req.rid, pos))
            slots += row
        self.assertEqual(len(slots), len(set(slots)))

    def test_alloc_len(self):
        self.assertEqual(get_alloc_len_per_decode(), self.alloc_len)

    def test_speculative_step_unchanged(self):
        batch = self.decode_batch()
        self.set_mode(batch, plain=False, prev_plain=False)
        spec_info = batch.spec_info
        seq_lens = batch.seq_lens.tolist()
        self.assertEqual(get_alloc_reserve_per_decode(), 2 * self.alloc_len)
        self.prepare(batch, reserve=get_alloc_reserve_per_decode())
        # The worker gets the draft input and the pre-step lengths.
        self.assertIs(batch.spec_info, spec_info)
        self.assertEqual(batch.seq_lens.tolist(), seq_lens)
        self.assertTrue(batch.forward_mode.is_decode())

    def test_speculative_step_after_a_plain_one_unchanged(self):
        batch = self.decode_batch()
        self.set_mode(batch, plain=False, prev_plain=True)
        self.prepare(batch, reserve=2 * self.alloc_len)

    def test_plain_step_after_a_speculative_one(self):
        batch = self.decode_batch()
        self.set_mode(batch, plain=True, prev_plain=False)
        self.prepare(batch, reserve=self.alloc_len + 1)

    def test_plain_step_after_a_plain_one(self):
        batch = self.decode_batch()
        self.set_mode(batch, plain=True, prev_plain=True)
        self.prepare(batch, reserve=2)

    def test_estimate_of_selected_requests(self):
        """The retraction loop asks for subsets of the batch."""
        batch = self.decode_batch()
        for plain, prev_plain, reserve in [
            (False, False, 2 * self.alloc_len),
            (True, False, self.alloc_len + 1),
            (True, True, 2),
        ]:
            self.set_mode(batch, plain, prev_plain)
            per_req = [
                page_ceil(req.kv_committed_len + reserve, self.page_size)
                - page_ceil(req.kv.kv_allocated_len, self.page_size)
                for req in batch.reqs
            ]
            self.assertEqual(batch.new_tokens_required_next_decode(), sum(per_req))
            self.assertEqual(
                batch.new_tokens_required_next_decode([0, 2]),
                per_req[0] + per_req[2],
            )

    def test_plain_step_fits_where_a_speculative_one_does_not(self):
        batch = self.decode_batch()
        self.set_mode(batch, plain=False, prev_plain=False)
        need_spec = batch.new_tokens_required_next_decode()
        self.set_mode(batch, plain=True, prev_plain=False)
        need_plain = batch.new_tokens_required_next_decode()
        self.assertLess(need_plain, need_spec)
        # Leave exactly what the plain step needs.
        self.allocator.alloc(self.allocator.available_size() - need_plain)
        self.assertEqual(self.allocator.available_size(), need_plain)
        self.assertTrue(batch.check_decode_mem())
        self.set_mode(batch, plain=False, prev_plain=False)
        self.assertFalse(batch.check_decode_mem())
        self.set_mode(batch, plain=True, prev_plain=False)
        self.prepare(batch, reserve=self.alloc_len + 1)
        self.assertEqual(self.allocator.available_size(), 0)

    def test_slots_allocated_under_the_overlap_lag(self):
        """Under overlap a step is prepared before the previous one is committed:
        the position each step writes at must be allocated anyway. Worst case:
        the speculative step accepted all its tokens."""
        batch = self.decode_batch()
        policy = SpecPolicy(None, zero_draft_steps=lambda bs: plain_next)
        committed_seq = batch.seq_lens.clone()  # what has been committed
        device_seq = batch.seq_lens.clone()  # what the worker will see
        pending = 0  # tokens of the last step, not committed yet
        max_accept = self.num_steps + 1
        for plain_next in [False, True, True, False, True, False, False, True]:
            policy.plan_decode_step(batch)
            self.assertEqual(batch.spec_plain_step, plain_next)
            batch.prepare_for_decode()
            self.check_rows(batch)
            # The step writes at [seq, seq + tokens) with the resolved seq_lens.
            tokens = 1 if plain_next else self.alloc_len
            for req, seq in zip(batch.reqs, device_seq.tolist()):
                self.assertLessEqual(seq + tokens, req.kv.kv_allocated_len, req.rid)
            # The previous step's result is processed only now.
            for req in batch.reqs:
                req.kv_committed_len += pending
            committed_seq += pending
            pending = 1 if plain_next else max_accept
            device_seq += pending
            self.assertTrue(
                all(
                    req.kv_committed_len == seq
                    for req, seq in zip(batch.reqs, committed_seq.tolist())
                )
            )


class TestChainPageSize1(KVSizingTestBase):
    pass


class TestChainPageSize16(KVSizingTestBase):
    page_size = 16
    # Lengths near page ends: the reserves differ in pages.
    prompt_lens = [11, 3, 14, 9]


class TestTreePageSize1(KVSizingTestBase):
    num_steps, topk, num_draft_tokens = 3, 4, 8
    alloc_len = 12  # steps * topk


class TestTreePageSize16(KVSizingTestBase):
    page_size = 16
    num_steps, topk, num_draft_tokens = 3, 4, 8
    alloc_len = 128  # two pages per branch
    prompt_lens = [11, 3, 14, 9]
    max_context_len = 1024
    attention_backend = "triton"


@unittest.skipIf(IN_TRITON_INTERPRETER, "needs no interpreter")
class TestPlanDecodeStepOnAScheduleBatch(CustomTestCase):
    def test_marks_this_and_the_previous_step(self):
        batch = ScheduleBatch(reqs=[object()] * 5)
        self.assertFalse(batch.spec_plain_step)
        self.assertFalse(batch.spec_prev_plain_step)
        policy = SpecPolicy(5, 4, min_dwell_steps=0)
        policy.plan_decode_step(batch)
        self.assertTrue(batch.spec_plain_step)
        self.assertFalse(batch.spec_prev_plain_step)
        batch.reqs = batch.reqs[:4]
        policy.plan_decode_step(batch)
        self.assertFalse(batch.spec_plain_step)
        self.assertTrue(batch.spec_prev_plain_step)


@unittest.skipIf(IN_TRITON_INTERPRETER, "this process already is the second one")
class TestInTritonInterpreter(CustomTestCase):
    def test_module_passes_in_the_interpreter(self):
        run_in_triton_interpreter(self, __file__)


if __name__ == "__main__":
    unittest.main()
