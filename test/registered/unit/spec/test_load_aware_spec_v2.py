"""Load-aware speculation on the spec-v2 overlap worker: scheduler-side bookkeeping, on CPU.

Real ServerArgs (spec v2: overlap on, topk 1), real ReqToTokenPool /
TokenToKVPoolAllocator / ChunkCache and a real prefill; no model, no worker, no
GPU. The triton kernel that writes new slots into req_to_token runs as a
reference implementation, and as itself in triton's interpreter
(TestInTritonInterpreter, a second process). Overlap is emulated: the result of
step n (accepted lengths, kv_committed_len correction) is applied after step n+1
is prepared.
Checks what prepare_for_decode leaves for the worker on plain steps, that a
plain step allocates one slot per request and reuses slots a speculative step
over-allocated, the KV reservation across mode switches, filter/merge with
future indices, and the routing of plain steps in the output processor.
"""

import random
import unittest
from types import SimpleNamespace
from unittest import mock

import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.environ import envs
from sglang.srt.managers.overlap_utils import FutureIndices
from sglang.srt.managers.scheduler_output_processor_mixin import (
    SchedulerOutputProcessorMixin,
)
from sglang.srt.managers.utils import GenerationBatchResult, get_alloc_len_per_decode
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from sglang.srt.speculative import load_aware_v2, spec_utils
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.load_aware_v2 import plain_decode_kv_lens
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_policy import SpecDecision
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
from sglang.test.triton_interpreter import (
    IN_TRITON_INTERPRETER,
    run_in_triton_interpreter,
)

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

PROMPT_LENS = [3, 5, 2, 4]
NUM_STEPS, NUM_DRAFT_TOKENS = 3, 4
POOL_SIZE = 1024


def reference_assign_req_to_token_pool(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size
):
    """CPU reference of spec_utils.assign_req_to_token_pool (a triton kernel)."""
    pt = 0
    for i in range(batch_size):
        start, end = int(start_offset[i]), int(end_offset[i])
        req_to_token[int(req_pool_indices[i]), start:end] = out_cache_loc[
            pt : pt + end - start
        ].to(req_to_token.dtype)
        pt += end - start
    assert pt == len(out_cache_loc)


class FixedPolicy:
    """A stand-in SpecPolicy whose decisions are given in advance."""

    def __init__(self, modes):
        self.modes = list(modes)
        self.decided_batch_sizes = []

    def decide(self, batch_size):
        self.decided_batch_sizes.append(batch_size)
        speculate = self.modes.pop(0)
        return SpecDecision(speculate=speculate, reason="fixed", toggled=False)


class SpecV2BatchTestBase(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmpdir = tiny_llama_config_dir()
        with envs.SGLANG_ENABLE_SPEC_V2.override(True):
            cls.server_args = ServerArgs(
                model_path=cls.tmpdir.name,
                device="cpu",
                skip_tokenizer_init=True,
                speculative_algorithm="EAGLE",
                speculative_draft_model_path=cls.tmpdir.name,
                speculative_num_steps=NUM_STEPS,
                speculative_eagle_topk=1,
                speculative_num_draft_tokens=NUM_DRAFT_TOKENS,
                speculative_disable_batch_threshold=3,
                speculative_enable_batch_threshold=2,
                speculative_load_aware_min_dwell_steps=0,
            )
        assert not cls.server_args.disable_overlap_schedule
        set_global_server_args_for_scheduler(cls.server_args)
        cls.model_config = ModelConfig.from_server_args(cls.server_args)
        cls.alloc_len = get_alloc_len_per_decode(cls.server_args)

    @classmethod
    def tearDownClass(cls):
        cls.tmpdir.cleanup()

    def setUp(self):
        if not IN_TRITON_INTERPRETER:
            patcher = mock.patch.object(
                spec_utils,
                "assign_req_to_token_pool_func",
                reference_assign_req_to_token_pool,
            )
            patcher.start()
            self.addCleanup(patcher.stop)
        pools = cpu_kv_pools(max_context_len=256, num_kv_tokens=POOL_SIZE)
        self.req_to_token_pool = pools.req_to_token_pool
        self.allocator = pools.allocator
        self.tree_cache = pools.tree_cache
        self.pools = pools
        self.future_ct = 0

    def future_draft_input(self, bs):
        """What run_batch installs after a step: a draft input of future indices."""
        indices = torch.arange(self.future_ct + 1, self.future_ct + 1 + bs)
        self.future_ct += bs
        return EagleDraftInput(future_indices=FutureIndices(indices=indices))

    def prefilled_batch(self, prompt_lens=PROMPT_LENS, prefix="r"):
        batch = prefilled_batch(
            self.pools,
            self.model_config,
            SpeculativeAlgorithm.EAGLE,
            prompt_lens,
            max_new_tokens=128,
            enable_overlap=True,
            rid_prefix=prefix,
        )
        self.assertTrue(batch.is_spec_v2)
        batch.spec_info = self.future_draft_input(len(batch.reqs))
        batch.filter_batch()
        return batch

    def owned_slots(self, batch):
        """All KV slots owned by the batch's requests; checks they are unique."""
        slots = []
        for req in batch.reqs:
            row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
            slots += row[: req.kv_allocated_len].tolist()
        self.assertEqual(len(slots), len(set(slots)), "a KV slot is owned twice")
        return slots


class TestPlainDecodeKvLens(CustomTestCase):
    def test_one_slot_past_seq_len_unless_owned(self):
        self.assertEqual(plain_decode_kv_lens([5, 5], [5, 4]), [6, 5])
        self.assertEqual(plain_decode_kv_lens([13, 9], [7, 9]), [13, 10])
        self.assertEqual(plain_decode_kv_lens([], []), [])


class TestPlainStepPreparation(SpecV2BatchTestBase):
    def test_plain_step_allocates_one_slot_per_request(self):
        batch = self.prefilled_batch()
        spec_info = batch.spec_info
        old_seq_lens = batch.seq_lens.clone()
        free_before = self.allocator.available_size()
        policy = FixedPolicy([False])

        self.assertTrue(batch.check_decode_mem())
        batch.prepare_for_decode(policy)

        self.assertEqual(policy.decided_batch_sizes, [4])
        self.assertFalse(batch.spec_step)
        # The future indices deliver the pending tokens to the worker.
        self.assertIs(batch.spec_info, spec_info)
        self.assertEqual(self.allocator.available_size(), free_before - 4)
        self.assertEqual(batch.out_cache_loc.dtype, torch.int64)
        written = self.req_to_token_pool.req_to_token[
            batch.req_pool_indices, old_seq_lens.long()
        ]
        self.assertEqual(written.tolist(), batch.out_cache_loc.tolist())
        self.assertEqual(batch.seq_lens.tolist(), (old_seq_lens + 1).tolist())
        self.assertEqual(batch.seq_lens_cpu.tolist(), (old_seq_lens + 1).tolist())
        self.assertEqual(batch.seq_lens_sum, int(old_seq_lens.sum()) + 4)
        for req, n in zip(batch.reqs, PROMPT_LENS):
            self.assertEqual(
                (req.kv_committed_len, req.kv_allocated_len), (n + 1, n + 1)
            )
        self.owned_slots(batch)

        mwb = batch.get_model_worker_batch()
        self.assertTrue(mwb.forward_mode.is_decode())
        self.assertFalse(mwb.spec_step)
        self.assertIs(mwb.spec_info, spec_info)
        self.assertFalse(batch.copy().spec_step)

    def test_speculative_step_is_unchanged(self):
        batch = self.prefilled_batch()
        seq_lens = batch.seq_lens.tolist()
        free_before = self.allocator.available_size()
        batch.prepare_for_decode(FixedPolicy([True]))
        self.assertTrue(batch.spec_step)
        self.assertTrue(batch.get_model_worker_batch().spec_step)
        # seq_lens is not advanced; 2 * alloc_len slots reserved beyond committed.
        self.assertEqual(batch.seq_lens.tolist(), seq_lens)
        self.assertEqual(
            self.allocator.available_size(), free_before - 4 * 2 * self.alloc_len
        )
        for req, n in zip(batch.reqs, PROMPT_LENS):
            self.assertEqual(req.kv_committed_len, n + 1)  # pre-claimed bonus slot
            self.assertEqual(req.kv_allocated_len, n + 2 * self.alloc_len)

    def test_plain_step_after_a_speculative_one_reuses_overallocated_slots(self):
        batch = self.prefilled_batch()
        batch.prepare_for_decode(FixedPolicy([True]))
        # Step n (speculative) ran: verify accepted these tokens (incl. bonus).
        accept_lens = [4, 1, 2, 3]
        batch.seq_lens = batch.seq_lens + torch.tensor(accept_lens)
        batch.spec_info = self.future_draft_input(4)
        true_lens = batch.seq_lens.tolist()
        allocated = [r.kv_allocated_len for r in batch.reqs]
        free_before = self.allocator.available_size()

        # Step n+1 (plain) is prepared before step n's result is processed.
        batch.prepare_for_decode(FixedPolicy([False]))
        self.assertFalse(batch.spec_step)
        self.assertEqual(self.allocator.available_size(), free_before)
        self.assertEqual([r.kv_allocated_len for r in batch.reqs], allocated)
        expected_loc = self.req_to_token_pool.req_to_token[
            batch.req_pool_indices, torch.tensor(true_lens)
        ]
        self.assertEqual(batch.out_cache_loc.tolist(), expected_loc.tolist())
        self.assertEqual(batch.seq_lens_cpu.tolist(), [n + 1 for n in true_lens])

        # Step n's result: the spec-v2 correction of kv_committed_len.
        for req, a in zip(batch.reqs, accept_lens):
            req.kv_committed_len += a - 1
        for req, n in zip(batch.reqs, batch.seq_lens_cpu.tolist()):
            self.assertEqual(req.kv_committed_len, n)
        self.owned_slots(batch)


class TestReservationAcrossModes(SpecV2BatchTestBase):
    def run_schedule(self, modes, seed):
        rng = random.Random(seed)
        batch = self.prefilled_batch()
        pending_accept = None  # the previous step's result, applied after prepare
        total = self.allocator.available_size() + sum(PROMPT_LENS)
        for speculate in modes:
            reserved = batch.new_tokens_required_next_decode()
            free_before = self.allocator.available_size()
            true_lens = batch.seq_lens.tolist()
            batch.prepare_for_decode(FixedPolicy([speculate]))
            used = free_before - self.allocator.available_size()
            self.assertLessEqual(used, reserved, (modes, speculate))
            if not speculate:
                self.assertLessEqual(used, len(batch.reqs))

            # Overlap: the previous step's result is processed now.
            if pending_accept is not None:
                for req, a in zip(batch.reqs, pending_accept):
                    req.kv_committed_len += a - 1
            for req, n in zip(batch.reqs, true_lens):
                # The slots this step writes are owned.
                need = n + (NUM_DRAFT_TOKENS if speculate else 1)
                self.assertGreaterEqual(req.kv_allocated_len, need)
                self.assertLessEqual(req.kv_committed_len, req.kv_allocated_len)
            self.owned_slots(batch)

            # The worker + run_batch of this step.
            if speculate:
                accept = [rng.randint(1, NUM_DRAFT_TOKENS) for _ in batch.reqs]
                batch.seq_lens = batch.seq_lens + torch.tensor(accept)
                pending_accept = accept
            else:
                pending_accept = None
            batch.spec_info = self.future_draft_input(len(batch.reqs))

        if pending_accept is not None:
            for req, a in zip(batch.reqs, pending_accept):
                req.kv_committed_len += a - 1
        for req, n in zip(batch.reqs, batch.seq_lens.tolist()):
            self.assertEqual(req.kv_committed_len, n)
        # No leak: owned + free == everything.
        self.assertEqual(
            len(self.owned_slots(batch)) + self.allocator.available_size(), total
        )

    def test_random_mode_sequences(self):
        for seed in range(20):
            rng = random.Random(1000 + seed)
            modes = [rng.random() < 0.5 for _ in range(12)]
            with self.subTest(seed=seed, modes=modes):
                self.setUp()
                self.run_schedule(modes, seed)

    def test_alternating_and_long_runs(self):
        for modes in (
            [True, False] * 6,
            [False] * 6 + [True] * 6,
            [True] * 6 + [False] * 6,
        ):
            with self.subTest(modes=modes):
                self.setUp()
                self.run_schedule(modes, seed=7)


class TestFilterMergeAfterPlainStep(SpecV2BatchTestBase):
    def test_filter_then_merge_keeps_future_indices_aligned(self):
        batch = self.prefilled_batch()
        batch.prepare_for_decode(FixedPolicy([False]))
        batch.spec_info = self.future_draft_input(4)  # run_batch of the plain step
        indices = batch.spec_info.future_indices.indices.tolist()
        batch.reqs[1].finished_reason = object()
        batch.filter_batch()
        self.assertEqual([r.rid for r in batch.reqs], ["r0", "r2", "r3"])
        self.assertEqual(
            batch.spec_info.future_indices.indices.tolist(),
            [indices[0], indices[2], indices[3]],
        )
        new = self.prefilled_batch([3], prefix="n")
        new_indices = new.spec_info.future_indices.indices.tolist()
        batch.merge_batch(new)
        self.assertEqual(
            batch.spec_info.future_indices.indices.tolist(),
            [indices[0], indices[2], indices[3]] + new_indices,
        )
        batch.prepare_for_decode(FixedPolicy([False]))
        self.assertEqual(len(batch.out_cache_loc), 4)
        self.owned_slots(batch)


class TestOutputProcessorRouting(SpecV2BatchTestBase):
    def process(self, batch, result):
        scheduler = mock.MagicMock()
        scheduler.enable_overlap = True
        scheduler.enable_overlap_mlx = False
        scheduler.enable_metrics = False
        scheduler.num_generated_tokens = 0
        scheduler.forward_ct_decode = 0
        scheduler._resolve_spec_overlap_tokens.side_effect = lambda result, batch: SchedulerOutputProcessorMixin._resolve_spec_overlap_tokens(
            scheduler, result, batch
        )
        SchedulerOutputProcessorMixin.process_batch_result_decode(
            scheduler, batch, result
        )
        return scheduler

    def test_plain_step_takes_the_non_speculative_path(self):
        batch = self.prefilled_batch()
        batch.prepare_for_decode(FixedPolicy([False]))
        committed = [r.kv_committed_len for r in batch.reqs]
        result = GenerationBatchResult(
            logits_output=SimpleNamespace(hidden_states=None),
            next_token_ids=torch.tensor([7, 8, 9, 10]),
        )
        scheduler = self.process(batch.copy(), result)
        scheduler._resolve_spec_overlap_tokens.assert_not_called()
        scheduler.update_spec_metrics.assert_not_called()
        self.assertEqual([r.output_ids[-1] for r in batch.reqs], [7, 8, 9, 10])
        self.assertEqual([r.kv_committed_len for r in batch.reqs], committed)
        self.assertEqual([r.spec_verify_ct for r in batch.reqs], [0] * 4)

    def test_speculative_step_resolves_accepted_tokens(self):
        batch = self.prefilled_batch()
        batch.prepare_for_decode(FixedPolicy([True]))
        committed = [r.kv_committed_len for r in batch.reqs]
        next_token_ids = torch.arange(16) + 50
        result = GenerationBatchResult(
            logits_output=SimpleNamespace(hidden_states=None),
            next_token_ids=next_token_ids,
            accept_lens=torch.tensor([4, 1, 2, 3]),
            speculative_num_draft_tokens=NUM_DRAFT_TOKENS,
        )
        scheduler = self.process(batch.copy(), result)
        scheduler._resolve_spec_overlap_tokens.assert_called_once()
        scheduler.update_spec_metrics.assert_called_once()
        self.assertEqual(batch.reqs[0].output_ids[-4:], [50, 51, 52, 53])
        self.assertEqual(batch.reqs[1].output_ids[-1], 54)
        self.assertEqual(
            [r.kv_committed_len for r in batch.reqs],
            [c + a - 1 for c, a in zip(committed, [4, 1, 2, 3])],
        )
        self.assertEqual([r.spec_verify_ct for r in batch.reqs], [1] * 4)


class TestPlainStepWorkerDataflow(SpecV2BatchTestBase):
    """LoadAwarePlainDecodeV2.forward with stand-in target and draft models.

    Checks what the target and the draft catch-up receive and the next draft
    input handed to the future map; the kernels themselves need a GPU.
    """

    HIDDEN = 12

    def make_plain_decode(self, kv_only: bool = False):
        self.target = RecordingTarget(self.HIDDEN)
        self.draft = RecordingDraft(
            self, self.req_to_token_pool, len(PROMPT_LENS), kv_only=kv_only
        )
        draft_worker = SimpleNamespace(
            draft_tp_context=no_tp_context,
            draft_runner=self.draft.runner,
            topk=1,
            cuda_graph_runner_for_draft_extend=None,
        )
        worker = SimpleNamespace(
            target_worker=self.target,
            draft_worker=draft_worker,
            speculative_algorithm=SpeculativeAlgorithm.EAGLE,
            topk=1,
            server_args=SimpleNamespace(disable_cuda_graph=True),
            device="cpu",
            gpu_id=0,
            plan_stream=None,
        )
        return load_aware_v2.LoadAwarePlainDecodeV2(worker)

    def plain_step(self, plain, batch):
        """Prepare and run a plain step as the overlap scheduler does."""
        batch.prepare_for_decode(FixedPolicy([False]))
        mwb = batch.get_model_worker_batch()
        # What FutureMap.resolve_future leaves on the draft input.
        mwb.spec_info.bonus_tokens = torch.tensor(
            [100, 101, 102, 103], dtype=torch.int32
        )
        out_cache_loc = mwb.out_cache_loc.tolist()
        return plain.forward(mwb), out_cache_loc

    def test_forward(self):
        plain = self.make_plain_decode()
        batch = self.prefilled_batch()
        seq_lens = batch.seq_lens.tolist()

        result, out_cache_loc = self.plain_step(plain, batch)

        # Target: a plain DECODE forward of the pending tokens, DECODE graphs.
        (call,) = self.target.calls
        self.assertTrue(call["forward_mode"].is_decode())
        self.assertEqual(call["input_ids"].tolist(), [100, 101, 102, 103])
        self.assertEqual(call["input_ids"].dtype, torch.int64)
        self.assertIsNone(call["spec_info"])
        self.assertEqual(call["capture_hidden_mode"], CaptureHiddenMode.FULL)
        self.assertEqual(call["seq_lens"], [n + 1 for n in seq_lens])
        self.assertIsNone(call["graph_runner"])  # --disable-cuda-graph: eager
        self.assertEqual(self.target.model_runner.graph_runner, "verify-graphs")

        # Draft catch-up: one token per request from the pre-step length, at
        # the slot the target wrote.
        (call,) = self.draft.extend_calls
        self.assertEqual(call["num_draft_tokens"], 1)
        self.assertEqual(call["predict"], [40, 41, 42, 43])
        self.assertEqual(call["seq_lens"], seq_lens)
        self.assertEqual(call["seq_lens_cpu"], seq_lens)
        self.assertEqual(call["seq_lens_sum"], sum(seq_lens))
        self.assertEqual(call["out_cache_loc"], out_cache_loc)
        self.assertEqual(call["hidden_states"][:, 0].tolist(), [0, 1, 2, 3])
        # ... whose attention is planned as a decode (eager here).
        self.assertEqual(self.draft.metadata_calls, [(ForwardMode.DECODE, None)])

        # The next draft input, for every request, as the future map stores it.
        nxt = result.next_draft_input
        self.assertEqual(nxt.bonus_tokens.tolist(), [40, 41, 42, 43])
        self.assertEqual(nxt.new_seq_lens.tolist(), [n + 1 for n in seq_lens])
        self.assertEqual(nxt.topk_index[:, 0].tolist(), [3, 4, 5, 6])
        self.assertEqual(tuple(nxt.topk_p.shape), (4, 1))
        self.assertEqual(tuple(nxt.hidden_states.shape), (4, DRAFT_HIDDEN_SIZE))
        self.assertIsNone(nxt.verify_done)
        self.assertIsNone(result.accept_lens)
        self.assertEqual(result.num_correct_drafts, 0)

    def test_kv_only_plain_step_then_resume(self):
        plain = self.make_plain_decode(kv_only=True)
        batch = self.prefilled_batch()
        seq_lens = batch.seq_lens.tolist()

        result, out_cache_loc = self.plain_step(plain, batch)

        (call,) = self.draft.model.calls
        self.assertEqual(call["positions"], seq_lens)
        self.assertEqual(call["out_cache_loc"], out_cache_loc)
        self.assertEqual(self.draft.extend_calls, [])
        nxt = result.next_draft_input
        self.assertTrue((nxt.topk_p == -1).all())
        self.assertEqual(nxt.hidden_states[:, 0].tolist(), [0.5, 1.5, 2.5, 3.5])

        # The next (speculative) step's batch, its draft input from the future map.
        batch.seq_lens, batch.spec_info = nxt.new_seq_lens, nxt
        batch.seq_lens_cpu = nxt.new_seq_lens.cpu()
        mwb = batch.get_model_worker_batch()
        spec_step_out_cache_loc = mwb.out_cache_loc
        waits = []
        plain.worker.plan_stream = SimpleNamespace(wait_stream=waits.append)

        plain.resume_speculation(mwb)

        (call,) = self.draft.extend_calls
        self.assertEqual(call["predict"], [40, 41, 42, 43])
        self.assertEqual(call["seq_lens"], seq_lens)
        self.assertEqual(call["out_cache_loc"], out_cache_loc)
        self.assertEqual(mwb.spec_info.topk_index[:, 0].tolist(), [3, 4, 5, 6])
        self.assertEqual(mwb.spec_info.hidden_states[:, 0].tolist(), [1] * 4)
        self.assertIs(mwb.out_cache_loc, spec_step_out_cache_loc)
        # Later plan-stream work of the step waits for the resume's forward.
        self.assertEqual(len(waits), 1)
        plain.resume_speculation(mwb)  # nothing pending any more
        self.assertEqual((len(self.draft.extend_calls), len(waits)), (1, 1))


@unittest.skipIf(IN_TRITON_INTERPRETER, "this process already is the second one")
class TestInTritonInterpreter(CustomTestCase):
    """The tests above with spec_utils.assign_req_to_token_pool itself."""

    def test_module_passes_with_the_real_kernel(self):
        run_in_triton_interpreter(self, __file__)


if __name__ == "__main__":
    unittest.main()
