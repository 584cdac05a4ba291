"""ScheduleBatch bookkeeping of load-aware speculation, on CPU.

Real ServerArgs (tiny local config, device="cpu"), real ReqToTokenPool /
TokenToKVPoolAllocator / ChunkCache and a real prefill (prepare_for_extend);
no model, no GPU. Checks what prepare_for_decode leaves for the worker on
plain and speculative steps, the KV reservation, filter_batch after each kind
of step, and the v1 worker's plain step with stand-in target and draft models. page_size > 1 needs triton kernels: GPU tests cover it.
"""

import unittest
from types import SimpleNamespace

import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.environ import envs
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.load_aware import LoadAwarePlainDecode
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_policy import SpecPolicy
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.cpu_schedule_batch import cpu_kv_pools, prefilled_batch
from sglang.test.load_aware_worker_fakes import (
    DRAFT_HIDDEN_SIZE,
    RecordingDraft,
    RecordingTarget,
    no_tp_context,
)
from sglang.test.spec_engine_utils import tiny_llama_config_dir
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

PROMPT_LENS = [3, 5, 2, 4]
HIDDEN = 64
TOPK = 2


def draft_input(bonus):
    """An EagleDraftInput as the draft extend leaves it (rows tagged by bonus)."""
    bonus = torch.tensor(bonus, dtype=torch.int32)
    return EagleDraftInput(
        bonus_tokens=bonus,
        topk_p=bonus[:, None].float().repeat(1, TOPK),
        topk_index=bonus[:, None].long().repeat(1, TOPK),
        hidden_states=bonus[:, None].float().repeat(1, HIDDEN),
    )


class LoadAwareBatchTestBase(CustomTestCase):
    speculative_algorithm = "EAGLE"

    @classmethod
    def setUpClass(cls):
        cls.tmpdir = tiny_llama_config_dir()
        spec_kwargs = {}
        if cls.speculative_algorithm is not None:
            spec_kwargs = dict(
                speculative_algorithm=cls.speculative_algorithm,
                speculative_draft_model_path=cls.tmpdir.name,
                speculative_num_steps=3,
                speculative_eagle_topk=TOPK,
                speculative_num_draft_tokens=5,
                speculative_disable_batch_threshold=3,
                speculative_enable_batch_threshold=2,
                speculative_load_aware_min_dwell_steps=0,
            )
        with envs.SGLANG_ENABLE_SPEC_V2.override(False):
            cls.server_args = ServerArgs(
                model_path=cls.tmpdir.name,
                device="cpu",
                skip_tokenizer_init=True,
                **spec_kwargs,
            )
        set_global_server_args_for_scheduler(cls.server_args)
        cls.model_config = ModelConfig.from_server_args(cls.server_args)

    @classmethod
    def tearDownClass(cls):
        cls.tmpdir.cleanup()

    def setUp(self):
        pools = cpu_kv_pools(max_context_len=64, num_kv_tokens=512)
        self.req_to_token_pool = pools.req_to_token_pool
        self.allocator = pools.allocator
        self.tree_cache = pools.tree_cache
        self.pools = pools

    def prefilled_batch(self):
        """A batch right after prefill + draft extend: one output token each."""
        batch = prefilled_batch(
            self.pools,
            self.model_config,
            SpeculativeAlgorithm.from_string(self.speculative_algorithm),
            PROMPT_LENS,
            max_new_tokens=64,
            enable_overlap=False,
        )
        first = [req.output_ids[-1] for req in batch.reqs]
        batch.output_ids = torch.tensor(first, dtype=torch.int64)
        if self.speculative_algorithm is not None:
            batch.spec_info = draft_input(first)
        batch.filter_batch()
        return batch

    def prefilled_batch_of_one(self, rid="new"):
        req = Req(rid, "", [1, 2, 3], SamplingParams(max_new_tokens=8))
        req.init_next_round_input(self.tree_cache)
        batch = ScheduleBatch.init_new(
            [req],
            self.req_to_token_pool,
            self.allocator,
            self.tree_cache,
            self.model_config,
            False,
            SpeculativeAlgorithm.EAGLE,
        )
        batch.prepare_for_extend()
        req.output_ids.append(150)
        batch.output_ids = torch.tensor([150])
        batch.spec_info = draft_input([150])
        return batch


class TestLoadAwarePrepareForDecode(LoadAwareBatchTestBase):
    def test_plain_step_is_a_plain_decode_step(self):
        batch = self.prefilled_batch()
        policy = SpecPolicy(3, 2, min_dwell_steps=0)
        old_seq_lens = batch.seq_lens.clone()
        old_sum = batch.seq_lens_sum
        free_before = self.allocator.available_size()

        self.assertTrue(batch.check_decode_mem())
        batch.prepare_for_decode(policy)  # bs = 4 >= 3: plain

        self.assertFalse(batch.spec_step)
        self.assertFalse(policy.speculating)
        self.assertIsNone(batch.spec_info)
        self.assertEqual(batch.input_ids.dtype, torch.int64)
        self.assertEqual(batch.input_ids.tolist(), [100, 101, 102, 103])
        self.assertEqual(batch.seq_lens.tolist(), (old_seq_lens + 1).tolist())
        self.assertEqual(batch.seq_lens_cpu.tolist(), (old_seq_lens + 1).tolist())
        self.assertEqual(batch.seq_lens_sum, old_sum + 4)
        # One new KV slot per request, at position old seq_len.
        self.assertEqual(batch.out_cache_loc.shape, (4,))
        self.assertEqual(self.allocator.available_size(), free_before - 4)
        written = self.req_to_token_pool.req_to_token[
            batch.req_pool_indices, old_seq_lens.long()
        ]
        self.assertEqual(written.tolist(), batch.out_cache_loc.tolist())
        for req, n in zip(batch.reqs, PROMPT_LENS):
            self.assertEqual(req.kv_committed_len, n + 1)
            self.assertEqual(req.kv_allocated_len, n + 1)
        # The worker runs the batch through a model worker batch in DECODE.
        mwb = batch.get_model_worker_batch()
        self.assertTrue(mwb.forward_mode.is_decode())
        self.assertIsNone(mwb.spec_info)

    def test_plain_step_after_verify_recomputes_seq_lens_sum(self):
        batch = self.prefilled_batch()
        policy = SpecPolicy(3, 2, min_dwell_steps=0)
        batch.filter_batch(keep_indices=[0, 1])
        batch.prepare_for_decode(policy)  # bs = 2: speculate
        self.assertTrue(batch.spec_step)
        # What verify() leaves: seq_lens advanced by the accepted tokens,
        # seq_lens_sum not updated, a fresh draft input.
        accepted = torch.tensor([3, 1])
        batch.seq_lens.add_(accepted)
        batch.seq_lens_cpu.add_(accepted)
        for req, n in zip(batch.reqs, accepted.tolist()):
            req.kv_committed_len += n
            req.kv_allocated_len += n
        batch.spec_info = draft_input([300, 301])
        # Two requests join: bs = 4, plain step.
        batch.merge_batch(self.prefilled_batch_of_one("a"))
        batch.merge_batch(self.prefilled_batch_of_one("b"))
        batch.filter_batch(v1_spec_info_filtered=True)
        batch.prepare_for_decode(policy)
        self.assertFalse(batch.spec_step)
        self.assertEqual(batch.seq_lens_sum, int(batch.seq_lens.sum()))
        self.assertEqual(batch.input_ids.tolist(), [300, 301, 150, 150])

    def test_speculative_step_is_unchanged(self):
        batch = self.prefilled_batch()
        batch.filter_batch(keep_indices=[0, 1])
        policy = SpecPolicy(3, 2, min_dwell_steps=0)
        seq_lens = batch.seq_lens.tolist()
        spec_info = batch.spec_info
        free_before = self.allocator.available_size()

        batch.prepare_for_decode(policy)  # bs = 2 < 3: speculate

        self.assertTrue(batch.spec_step)
        self.assertIs(batch.spec_info, spec_info)
        self.assertEqual(batch.seq_lens.tolist(), seq_lens)
        self.assertEqual(self.allocator.available_size(), free_before)
        self.assertEqual(policy.num_spec_steps, 1)

    def test_no_policy_always_speculates(self):
        batch = self.prefilled_batch()
        batch.prepare_for_decode()
        self.assertTrue(batch.spec_step)
        self.assertIsNotNone(batch.spec_info)

    def test_reservation_covers_a_speculative_step_after_a_plain_one(self):
        batch = self.prefilled_batch()
        batch.prepare_for_decode(SpecPolicy(disable_batch_threshold=2))
        self.assertFalse(batch.spec_step)
        # The next step may speculate: steps * topk = 6 > draft tokens = 5, per request.
        self.assertEqual(batch.new_tokens_required_next_decode(), 6 * 4)
        self.assertEqual(batch.new_tokens_required_next_decode([0, 2]), 6 * 2)

    def test_copy_keeps_predicate(self):
        batch = self.prefilled_batch()
        batch.prepare_for_decode(SpecPolicy(3, 2, min_dwell_steps=0))
        self.assertFalse(batch.copy().spec_step)


class TestLoadAwareFilterBatch(LoadAwareBatchTestBase):
    def test_filter_after_plain_step_index_selects(self):
        batch = self.prefilled_batch()
        batch.prepare_for_decode(SpecPolicy(3, 2, min_dwell_steps=0))
        self.assertFalse(batch.spec_step)
        # The worker installs a draft input for every request of the batch.
        batch.spec_info = draft_input([200, 201, 202, 203])
        batch.reqs[1].finished_reason = object()  # request 1 finished
        batch.filter_batch(v1_spec_info_filtered=True)
        self.assertEqual([r.rid for r in batch.reqs], ["r0", "r2", "r3"])
        self.assertEqual(batch.spec_info.bonus_tokens.tolist(), [200, 202, 203])
        self.assertEqual(batch.spec_info.topk_index[:, 0].tolist(), [200, 202, 203])
        self.assertEqual(batch.spec_info.hidden_states[:, 0].tolist(), [200, 202, 203])

    def test_filter_after_speculative_step_prefix_slices(self):
        batch = self.prefilled_batch()
        batch.prepare_for_decode()  # speculative
        self.assertTrue(batch.spec_step)
        # verify() already restricted spec_info to the unfinished requests.
        batch.spec_info = draft_input([200, 202, 203])
        batch.reqs[1].finished_reason = object()
        batch.filter_batch(v1_spec_info_filtered=True)
        self.assertEqual(batch.spec_info.bonus_tokens.tolist(), [200, 202, 203])

    def test_merge_after_plain_step_then_filter(self):
        batch = self.prefilled_batch()
        batch.prepare_for_decode(SpecPolicy(3, 2, min_dwell_steps=0))
        batch.spec_info = draft_input([200, 201, 202, 203])
        batch.reqs[3].finished_reason = object()
        # A prefill batch joins before the next decode step.
        new = self.prefilled_batch_of_one()
        batch.merge_batch(new)
        batch.filter_batch(v1_spec_info_filtered=True)
        self.assertEqual(batch.spec_info.bonus_tokens.tolist(), [200, 201, 202, 150])


class TestPlainStepWorkerDataflow(LoadAwareBatchTestBase):
    """LoadAwarePlainDecode.forward (v1 worker) with stand-in target and draft
    models: what each receives, and the draft input installed for the next step."""

    def make_plain_decode(self, kv_only: bool = False):
        target = RecordingTarget(HIDDEN)
        draft = RecordingDraft(
            self, self.req_to_token_pool, len(PROMPT_LENS), kv_only=kv_only
        )
        worker = SimpleNamespace(
            target_worker=target,
            draft_model_runner=draft.runner,
            cuda_graph_runner_for_draft_extend=None,
            draft_tp_context=no_tp_context,
            topk=TOPK,
            speculative_algorithm=SpeculativeAlgorithm.EAGLE,
            server_args=SimpleNamespace(disable_cuda_graph=True),
            device="cpu",
            gpu_id=0,
        )
        return target, draft, LoadAwarePlainDecode(worker)

    def test_forward(self):
        target, draft, plain = self.make_plain_decode()
        batch = self.prefilled_batch()
        seq_lens = batch.seq_lens.tolist()
        batch.prepare_for_decode(SpecPolicy(3, 2, min_dwell_steps=0))
        out_cache_loc = batch.out_cache_loc.tolist()

        result = plain.forward(batch)

        # Target: a plain DECODE forward of the pending tokens, DECODE graphs.
        (call,) = target.calls
        self.assertTrue(call["forward_mode"].is_decode())
        self.assertEqual(call["input_ids"].tolist(), [100, 101, 102, 103])
        self.assertIsNone(call["spec_info"])
        self.assertEqual(call["capture_hidden_mode"], CaptureHiddenMode.FULL)
        self.assertEqual(call["seq_lens"], [n + 1 for n in seq_lens])
        self.assertIsNone(call["graph_runner"])  # --disable-cuda-graph: eager
        self.assertEqual(target.model_runner.graph_runner, "verify-graphs")
        self.assertEqual(result.num_correct_drafts, 0)

        # Draft catch-up: one token per request from the pre-step length, at
        # the slot the target wrote, its attention planned as a decode.
        (call,) = draft.extend_calls
        self.assertEqual(call["num_draft_tokens"], 1)
        self.assertEqual(call["predict"], [40, 41, 42, 43])
        self.assertEqual(call["seq_lens"], seq_lens)
        self.assertEqual(call["seq_lens_sum"], sum(seq_lens))
        self.assertEqual(call["out_cache_loc"], out_cache_loc)
        self.assertEqual(call["hidden_states"][:, 0].tolist(), [0, 1, 2, 3])
        self.assertEqual(draft.metadata_calls, [(ForwardMode.DECODE, None)])

        # The next draft input, for every request: what a verify step leaves.
        nxt = batch.spec_info
        self.assertEqual(nxt.bonus_tokens.tolist(), [40, 41, 42, 43])
        self.assertEqual(nxt.topk_index[:, 0].tolist(), [3, 4, 5, 6])
        self.assertEqual(tuple(nxt.topk_p.shape), (4, TOPK))
        self.assertEqual(tuple(nxt.hidden_states.shape), (4, DRAFT_HIDDEN_SIZE))
        self.assertEqual(nxt.capture_hidden_mode, CaptureHiddenMode.LAST)
        self.assertFalse(plain.draft_catch_up.resume_pending)

    def test_kv_only_plain_step_then_resume(self):
        _, draft, plain = self.make_plain_decode(kv_only=True)
        batch = self.prefilled_batch()
        seq_lens = batch.seq_lens.tolist()
        batch.prepare_for_decode(SpecPolicy(3, 2, min_dwell_steps=0))
        out_cache_loc = batch.out_cache_loc.tolist()

        plain.forward(batch)

        # The draft writes its KV at the slot the target wrote, nothing else.
        (call,) = draft.model.calls
        self.assertEqual(call["input_ids"], [40, 41, 42, 43])
        self.assertEqual(call["positions"], seq_lens)
        self.assertEqual(call["out_cache_loc"], out_cache_loc)
        self.assertEqual(call["hidden_states"][:, 0].tolist(), [0, 1, 2, 3])
        self.assertEqual(call["token_to_kv_pool"], "draft-kv-pool")
        self.assertEqual(draft.extend_calls, [])
        # The next draft input is pending: no top-k, the projected hidden state.
        nxt = batch.spec_info
        self.assertEqual(nxt.bonus_tokens.tolist(), [40, 41, 42, 43])
        self.assertTrue((nxt.topk_p == -1).all())
        self.assertEqual(nxt.hidden_states[:, 0].tolist(), [0.5, 1.5, 2.5, 3.5])
        self.assertTrue(plain.draft_catch_up.resume_pending)

        # Request 2 was prefilled since: its draft input is complete.
        prefilled = torch.arange(4)[:, None] == 2
        nxt.topk_p = torch.where(prefilled, 0.25, nxt.topk_p)
        nxt.topk_index = torch.where(prefilled, 9, nxt.topk_index)

        plain.resume_speculation(batch)

        # One full draft forward at the last position: the pending rows write
        # their KV slot again, request 2 writes to the padding slot.
        (call,) = draft.extend_calls
        self.assertEqual(call["predict"], [40, 41, 42, 43])
        self.assertEqual(call["seq_lens"], seq_lens)
        self.assertEqual(
            call["out_cache_loc"], out_cache_loc[:2] + [0] + out_cache_loc[3:]
        )
        self.assertEqual(call["hidden_states"][:, 0].tolist(), [0.5, 1.5, 2.5, 3.5])
        done = batch.spec_info
        self.assertEqual(done.topk_index[:, 0].tolist(), [3, 4, 9, 6])
        self.assertEqual(done.topk_p[2].tolist(), [0.25] * TOPK)
        self.assertTrue((done.topk_p[[0, 1, 3]] > 0).all())
        self.assertEqual(done.hidden_states[:, 0].tolist(), [1, 1, 2.5, 1])
        self.assertEqual(batch.out_cache_loc.tolist(), out_cache_loc)

        plain.resume_speculation(batch)  # nothing pending any more
        self.assertEqual(len(draft.extend_calls), 1)

    def test_full_draft_catch_up_on_request(self):
        with envs.SGLANG_LOAD_AWARE_FULL_DRAFT_CATCH_UP.override(True):
            _, draft, plain = self.make_plain_decode(kv_only=True)
        batch = self.prefilled_batch()
        batch.prepare_for_decode(SpecPolicy(3, 2, min_dwell_steps=0))
        plain.forward(batch)
        self.assertEqual(draft.model.calls, [])
        self.assertEqual(len(draft.extend_calls), 1)
        self.assertFalse(plain.draft_catch_up.resume_pending)


class TestNonSpeculativeServerUnchanged(LoadAwareBatchTestBase):
    speculative_algorithm = None

    def test_plain_decode(self):
        batch = self.prefilled_batch()
        seq_lens = batch.seq_lens.tolist()
        batch.prepare_for_decode()
        self.assertFalse(batch.spec_step)
        self.assertEqual(batch.input_ids.tolist(), [100, 101, 102, 103])
        self.assertEqual(batch.seq_lens.tolist(), [n + 1 for n in seq_lens])
        self.assertEqual(batch.new_tokens_required_next_decode(), 4)


if __name__ == "__main__":
    unittest.main()
