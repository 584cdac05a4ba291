"""The plain decode step of a load-aware EAGLEWorkerV2 (speculative/load_aware.py),
on CPU.

LoadAwarePlainStep.forward runs on a real ScheduleBatch (real pools, a real
prefill and eagle_prepare_for_decode's allocation) with stand-in target and
draft models: the target worker builds the real ForwardBatch it would run and
records it; the draft runner records the real ForwardBatch that upstream's
prepare_for_draft_extend builds, or the KV-only write. Checked: the slot the
step writes, what the target sees (a DECODE forward on the plain DECODE
backend, restored afterwards), the publish order, the spec-shaped result, the
draft KV catch-up in both modes and the resume before a speculative step.

The pools' bookkeeping is made of triton kernels, which run on CPU tensors in
triton's interpreter: TestInTritonInterpreter runs this module in a second
process that has it.
"""

import contextlib
import copy
import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from sglang.srt.environ import envs
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    compute_position_torch,
)
from sglang.srt.speculative import load_aware
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.load_aware import (
    DecodeAttentionForOneTokenExtend,
    DraftCatchUp,
    LoadAwarePlainStep,
    build_plain_step,
    fresh_attention_backend,
    prefill_positions_and_last_rows,
)
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_policy import SpecPolicy
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.cpu_schedule_batch import (
    TinyEagleTestCase,
    cpu_kv_pools,
    extend_batch,
    prefilled_batch,
    publish_server_args,
    single_rank,
)
from sglang.test.test_utils import CustomTestCase
from sglang.test.triton_interpreter import (
    IN_TRITON_INTERPRETER,
    run_in_triton_interpreter,
)

register_cpu_ci(est_time=40, suite="base-a-test-cpu")

NEEDS_INTERPRETER = "runs in triton's interpreter (TestInTritonInterpreter)"

PROMPT_LENS = [3, 5, 2, 4]
BS = len(PROMPT_LENS)
TOPK = 2
TARGET_HIDDEN = 12  # the target hidden state the draft consumes
DRAFT_HIDDEN = 4
VOCAB = 32
FIRST_TARGET_TOKEN = 40  # the target samples 40 + i for request i
FIRST_DRAFT_TOKEN = 3  # the draft's top-1 for request i is 3 + i


class FakeModelRunner:
    """What ForwardBatch.init_new and the plain step read of a model runner."""

    def __init__(self, model_config, is_draft_worker: bool):
        self.model_config = model_config
        self.is_draft_worker = is_draft_worker
        self.device = "cpu"
        self.spec_algorithm = SpeculativeAlgorithm.EAGLE
        self.server_args = SimpleNamespace(
            attention_backend="torch_native", enable_lora=False
        )
        self.ngram_embedding_manager = SimpleNamespace(enabled=False)
        self.init_new_workspace = False
        self.forward_batches = []
        # Set by a forward that is done reading shared buffers (the WAR barrier's).
        self.war_fastpath_read_done_event = None

    def record(self, forward_batch: ForwardBatch, **extra):
        self.forward_batches.append(
            dict(
                forward_mode=forward_batch.forward_mode,
                input_ids=forward_batch.input_ids.tolist(),
                positions=forward_batch.positions.tolist(),
                seq_lens=forward_batch.seq_lens.tolist(),
                seq_lens_cpu=forward_batch.seq_lens_cpu.tolist(),
                seq_lens_sum=forward_batch.seq_lens_sum,
                out_cache_loc=forward_batch.out_cache_loc.tolist(),
                spec_info=forward_batch.spec_info,
                capture_hidden_mode=forward_batch.capture_hidden_mode,
                **extra,
            )
        )


class TargetModelRunner(FakeModelRunner):
    def __init__(self, model_config):
        super().__init__(model_config, is_draft_worker=False)
        # What the worker installs for its verify steps (an adaptive state swaps them).
        self.attn_backend = "verify-backend"
        self.decode_cuda_graph_runner = None  # --disable-cuda-graph
        self.num_backends = 0

    def _get_attention_backend(self, init_new_workspace: bool = False):
        self.init_new_workspace = init_new_workspace  # as backends' init may
        self.num_backends += 1
        return f"decode-backend-{self.num_backends}"


class RecordingTargetWorker:
    """Request i: hidden state i + 1 (every dim), next token FIRST_TARGET_TOKEN + i,
    logprob -(i + 1) / 10. Records the ForwardBatch of each forward and what the
    model runner has installed during it; publishes a read-done event, as a DECODE
    graph replay does."""

    def __init__(self, model_config, events):
        self.model_runner = TargetModelRunner(model_config)
        self.events = events
        self.fail = False
        self.read_done_events = []

    def forward_batch_generation(self, batch, capture_hidden_mode=None):
        runner = self.model_runner
        forward_batch = ForwardBatch.init_new(
            batch,
            runner,
            capture_hidden_mode=capture_hidden_mode,
            return_hidden_states_before_norm=False,
        )
        runner.record(
            forward_batch,
            attn_backend=runner.attn_backend,
            graph_runner=runner.decode_cuda_graph_runner,
        )
        self.events.append("target")
        runner.war_fastpath_read_done_event = object()
        self.read_done_events.append(runner.war_fastpath_read_done_event)
        if self.fail:
            raise RuntimeError("target forward failed")
        bs = len(batch.seq_lens)
        rows = torch.arange(bs, dtype=torch.float32)[:, None]
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(
                next_token_logits=torch.zeros(bs, VOCAB),
                hidden_states=(rows + 1).repeat(1, TARGET_HIDDEN),
                next_token_logprobs=-(rows[:, 0] + 1) / 10,
            ),
            next_token_ids=torch.arange(bs) + FIRST_TARGET_TOKEN,
        )


class KVOnlyDraftModel:
    """A one-layer draft that writes its KV alone."""

    def __init__(self, events):
        self.calls = []
        self.events = events

    def can_write_kv_cache_only(self) -> bool:
        return True

    def write_kv_cache_only(
        self, input_ids, positions, hidden_states, out_cache_loc, token_to_kv_pool
    ):
        self.calls.append(
            dict(
                input_ids=input_ids.tolist(),
                positions=positions.tolist(),
                positions_dtype=positions.dtype,
                hidden_states=hidden_states.clone(),
                out_cache_loc=out_cache_loc.tolist(),
                token_to_kv_pool=token_to_kv_pool,
            )
        )
        self.events.append("draft-kv")


def draft_logits(bs: int) -> torch.Tensor:
    """Request i's top-1 is FIRST_DRAFT_TOKEN + i, its top-2 the token after."""
    logits = torch.zeros(bs, VOCAB)
    logits[torch.arange(bs), torch.arange(bs) + FIRST_DRAFT_TOKEN] = 10.0
    logits[torch.arange(bs), torch.arange(bs) + FIRST_DRAFT_TOKEN + 1] = 5.0
    return logits


DRAFT_HIDDEN_VALUE = 7.0


class DraftModelRunner(FakeModelRunner):
    """Runs the draft extend eagerly: draft_logits, hidden state
    DRAFT_HIDDEN_VALUE (every dim)."""

    def __init__(self, model_config, req_to_token_pool, model, events):
        # The draft's widths: its own hidden state, and the target's it consumes.
        model_config = copy.copy(model_config)
        model_config.hidden_size = DRAFT_HIDDEN
        model_config.spec_hidden_size = TARGET_HIDDEN
        model_config.dtype = torch.float32
        super().__init__(model_config, is_draft_worker=True)
        self.model = model
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = "draft-kv-pool"
        self.tp_group = None
        self.events = events
        # (backend, forward mode) of each init_forward_metadata.
        self.planned = []
        # init_new_workspace of each fresh backend.
        self.fresh_backend_workspaces = []
        self.draft_extend_backend = self.planning_backend("draft-extend-backend")
        self.attn_backend = self.draft_extend_backend

    def planning_backend(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(
            init_forward_metadata=lambda fb: self.planned.append(
                (name, fb.forward_mode)
            )
        )

    def _get_attention_backend(self, init_new_workspace: bool = False):
        self.init_new_workspace = init_new_workspace
        self.fresh_backend_workspaces.append(init_new_workspace)
        return self.planning_backend("fresh-backend")

    def forward(self, forward_batch):
        self.record(forward_batch, attn_backend=self.attn_backend)
        self.events.append("draft")
        bs = forward_batch.batch_size
        return SimpleNamespace(
            logits_output=LogitsProcessorOutput(
                next_token_logits=draft_logits(bs),
                hidden_states=torch.full((bs, DRAFT_HIDDEN), DRAFT_HIDDEN_VALUE),
            )
        )


class RecordingDraftExtendGraphs:
    """Stands in for EAGLEDraftExtendCudaGraphRunner: records how it was built
    and each forward batch it replays, whose outputs are DraftModelRunner's, in
    buffers of its own that the next replay overwrites. Publishes a read-done
    event, as a replay does."""

    def __init__(
        self, eagle_worker, *, draft_extend_attn_backend, num_tokens_per_req, capture_bs
    ):
        self.model_runner = eagle_worker.draft_runner
        self.attn_backend = draft_extend_attn_backend
        self.num_tokens_per_req = num_tokens_per_req
        self.capture_bs = capture_bs
        self.hidden_states = torch.zeros(max(capture_bs), DRAFT_HIDDEN)
        self.read_done_events = []

    def can_run_graph(self, forward_batch: ForwardBatch) -> bool:
        return forward_batch.batch_size <= max(self.capture_bs)

    def execute(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        runner = self.model_runner
        runner.record(forward_batch, attn_backend=runner.attn_backend)
        runner.events.append("draft-graph")
        runner.war_fastpath_read_done_event = object()
        self.read_done_events.append(runner.war_fastpath_read_done_event)
        bs = forward_batch.batch_size
        self.hidden_states[:bs] = DRAFT_HIDDEN_VALUE
        return LogitsProcessorOutput(
            next_token_logits=draft_logits(bs), hidden_states=self.hidden_states[:bs]
        )


class RecordingAdaptiveController:
    def __init__(self):
        self.feeds = []

    def on_verify_complete(self, num_correct_drafts_per_req, batch_size):
        self.feeds.append((list(num_correct_drafts_per_req), batch_size))


@unittest.skipUnless(IN_TRITON_INTERPRETER, NEEDS_INTERPRETER)
class PlainStepTestBase(TinyEagleTestCase):
    kv_only = False

    def setUp(self):
        self.publish_eagle_args(
            3,
            TOPK,
            6,
            speculative_disable_batch_threshold=2,
            page_size=1,
        )
        single_rank(self)
        self.pools = cpu_kv_pools(max_context_len=64, num_kv_tokens=512)
        self.events = []
        self.target = RecordingTargetWorker(self.model_config, self.events)
        self.draft_model = (
            KVOnlyDraftModel(self.events) if self.kv_only else SimpleNamespace()
        )
        self.draft_runner = DraftModelRunner(
            self.model_config,
            self.pools.req_to_token_pool,
            self.draft_model,
            self.events,
        )
        self.worker = SimpleNamespace(
            target_worker=self.target,
            draft_worker=SimpleNamespace(
                draft_runner=self.draft_runner,
                topk=TOPK,
                draft_tp_context=lambda group: contextlib.nullcontext(),
            ),
            speculative_algorithm=SpeculativeAlgorithm.EAGLE,
            req_to_token_pool=self.pools.req_to_token_pool,
            device="cpu",
            adaptive_controller=None,
            speculative_num_steps=3,
            war_fastpath_runner=self.draft_runner,
        )

    def plain_step(self) -> LoadAwarePlainStep:
        plain = LoadAwarePlainStep(self.worker)
        # What the worker's verify steps run under when the plain step starts.
        self.target.model_runner.decode_cuda_graph_runner = "verify-graphs"
        return plain

    def decode_batch(self):
        """The running batch of the first decode step after prefill, planned
        plain and prepared (KV allocated) by the scheduler."""
        batch = prefilled_batch(
            self.pools,
            self.model_config,
            SpeculativeAlgorithm.EAGLE,
            PROMPT_LENS,
            max_new_tokens=64,
            enable_overlap=False,
        )
        bonus = torch.tensor([req.output_ids[-1] for req in batch.reqs])
        batch.spec_info = EagleDraftInput(
            topk_p=torch.full((BS, TOPK), 0.5),
            topk_index=torch.ones((BS, TOPK), dtype=torch.int64),
            hidden_states=torch.zeros((BS, DRAFT_HIDDEN)),
            bonus_tokens=bonus,
        )
        batch.filter_batch()
        SpecPolicy(2).plan_decode_step(batch)
        self.assertTrue(batch.spec_plain_step)
        batch.prepare_for_decode()
        return batch

    def run_forward(self, plain, batch, **kwargs):
        published = []

        def on_publish(new_seq_lens):
            published.append(new_seq_lens.tolist())
            self.events.append("publish")

        result = plain.forward(batch, on_publish=on_publish, **kwargs)
        return result, published

    def check_plain_step(self, plain, result, published, seq_lens, slots):
        """What every plain step does, whatever the draft catch-up."""
        new_seq_lens = [n + 1 for n in seq_lens]
        target_call = self.target.model_runner.forward_batches[-1]
        self.assertTrue(target_call["forward_mode"].is_decode())
        self.assertEqual(target_call["input_ids"], [100, 101, 102, 103])
        self.assertEqual(target_call["positions"], seq_lens)
        self.assertEqual(target_call["seq_lens"], new_seq_lens)
        self.assertEqual(target_call["seq_lens_cpu"], new_seq_lens)
        self.assertEqual(target_call["seq_lens_sum"], sum(new_seq_lens))
        self.assertEqual(target_call["out_cache_loc"], slots)
        self.assertIsNone(target_call["spec_info"])
        self.assertEqual(target_call["capture_hidden_mode"], CaptureHiddenMode.FULL)
        # On the plain DECODE backend, eager (no DECODE graphs captured), then
        # back to what was installed.
        self.assertEqual(target_call["attn_backend"], "decode-backend-1")
        self.assertEqual(plain.target_decode_graphs.attn_backend, "decode-backend-1")
        self.assertIsNone(target_call["graph_runner"])
        self.assertEqual(self.target.model_runner.attn_backend, "verify-backend")
        self.assertEqual(
            self.target.model_runner.decode_cuda_graph_runner, "verify-graphs"
        )
        # Published once, before the target: the next step's scheduling waits on it.
        self.assertEqual(published, [new_seq_lens])
        self.assertEqual(self.events[:2], ["publish", "target"])
        self.assertEqual(len(self.events), 3)
        # The scheduler's WAR barrier reads the draft runner's event; the target's
        # is consumed.
        self.assertIsNone(self.target.model_runner.war_fastpath_read_done_event)

        # A verify that accepted no draft.
        self.assertTrue(result.spec_plain_step)
        self.assertEqual(result.accept_lens.tolist(), [1] * BS)
        self.assertEqual(result.accept_lens.dtype, torch.int32)
        self.assertEqual(result.speculative_num_draft_tokens, 1)
        self.assertEqual(result.new_seq_lens.tolist(), new_seq_lens)
        self.assertEqual(result.next_token_ids.tolist(), [40, 41, 42, 43])
        self.assertEqual(
            result.logits_output.next_token_logprobs.shape, torch.Size([BS, 1])
        )
        self.assertTrue(
            torch.allclose(
                result.logits_output.next_token_logprobs[:, 0],
                torch.tensor([-0.1, -0.2, -0.3, -0.4]),
            )
        )
        nxt = result.next_draft_input
        self.assertIsInstance(nxt, EagleDraftInput)
        self.assertIs(nxt.bonus_tokens, result.next_token_ids)
        self.assertEqual(tuple(nxt.topk_p.shape), (BS, TOPK))
        self.assertEqual(tuple(nxt.topk_index.shape), (BS, TOPK))
        self.assertEqual(tuple(nxt.hidden_states.shape), (BS, DRAFT_HIDDEN))
        self.assertEqual(
            (nxt.num_tokens_per_req, nxt.num_tokens_for_logprob_per_req), (1, 1)
        )

    def step(self, plain=None, **kwargs):
        plain = plain or self.plain_step()
        batch = self.decode_batch()
        seq_lens = batch.seq_lens.tolist()
        slots = self.pools.req_to_token_pool.req_to_token[
            batch.req_pool_indices, batch.seq_lens.long()
        ].tolist()
        # Each request writes at position seq_len, a slot the scheduler allocated.
        for req, n in zip(batch.reqs, seq_lens):
            self.assertLess(n, req.kv.kv_allocated_len)
        self.assertTrue(all(slot > 0 for slot in slots))
        result, published = self.run_forward(plain, batch, **kwargs)
        self.assertEqual(batch.out_cache_loc.tolist(), slots)
        self.check_plain_step(plain, result, published, seq_lens, slots)
        return plain, batch, result, seq_lens, slots


class TestPlainStepFullDraftCatchUp(PlainStepTestBase):
    """Drafts that cannot write their KV alone run the one-token draft extend."""

    def check_one_token_draft_extend(self, plain, batch, result, seq_lens, slots):
        """What the one-token draft extend does, eager or replayed."""
        self.assertFalse(plain.draft_catch_up.kv_only)
        (draft_call,) = self.draft_runner.forward_batches
        self.assertEqual(draft_call["forward_mode"], ForwardMode.DRAFT_EXTEND_V2)
        self.assertEqual(draft_call["input_ids"], [40, 41, 42, 43])
        self.assertEqual(draft_call["positions"], seq_lens)
        self.assertEqual(draft_call["seq_lens"], [n + 1 for n in seq_lens])
        self.assertEqual(draft_call["out_cache_loc"], slots)
        self.assertEqual(draft_call["spec_info"].num_tokens_per_req, 1)
        # The target hidden state of the new token, FULL capture.
        self.assertEqual(
            draft_call["spec_info"].hidden_states[:, 0].tolist(), [1, 2, 3, 4]
        )
        # Its attention runs as a decode, on a backend instance of its own.
        self.assertIs(
            draft_call["attn_backend"], plain.draft_catch_up.one_token_attention
        )
        self.assertIs(
            self.draft_runner.attn_backend, self.draft_runner.draft_extend_backend
        )
        nxt = result.next_draft_input
        self.assertEqual(nxt.topk_index[:, 0].tolist(), [3, 4, 5, 6])
        self.assertEqual(nxt.topk_index[:, 1].tolist(), [4, 5, 6, 7])
        self.assertTrue(bool((nxt.topk_p > 0).all()))
        self.assertEqual(
            nxt.hidden_states.tolist(), [[DRAFT_HIDDEN_VALUE] * DRAFT_HIDDEN] * BS
        )
        # Nothing pending: a speculative step needs no resume.
        self.assertFalse(plain.draft_catch_up.resume_pending)
        batch.spec_info = nxt
        plain.resume_speculation(batch)
        self.assertEqual(len(self.draft_runner.forward_batches), 1)

    def plain_step_with_graphs(self, graph_bs):
        """A plain step whose target captured its plain-decode graphs at
        ``graph_bs``: the catch-up captures its graphs there too."""
        plain = self.plain_step()
        self.worker.gpu_id = 0
        self.worker._additional_graph_memory_usage = {}
        self.worker._additional_graph_time_usage = {}
        with mock.patch.object(
            load_aware, "EAGLEDraftExtendCudaGraphRunner", RecordingDraftExtendGraphs
        ):
            plain.draft_catch_up = DraftCatchUp(self.worker, graph_bs)
        return plain

    def test_forward(self):
        plain, batch, result, seq_lens, slots = self.step()
        self.check_one_token_draft_extend(plain, batch, result, seq_lens, slots)
        self.assertIsNone(plain.draft_catch_up.one_token_graphs)
        self.assertEqual(self.events, ["publish", "target", "draft"])
        # The draft forward reads req_to_token after the target's replay: the
        # barrier must not take the target's event for the step's.
        self.assertIsNone(self.draft_runner.war_fastpath_read_done_event)
        self.assertEqual(
            self.draft_runner.planned, [("fresh-backend", ForwardMode.DECODE)]
        )
        # It plans right before it runs: the flashinfer workspace is shared.
        self.assertEqual(self.draft_runner.fresh_backend_workspaces, [False])

    def test_forward_replays_the_one_token_graphs(self):
        plain = self.plain_step_with_graphs([1, 2, 4])
        graphs = plain.draft_catch_up.one_token_graphs
        self.assertIs(graphs.attn_backend, plain.draft_catch_up.one_token_attention)
        self.assertEqual(graphs.num_tokens_per_req, 1)
        self.assertEqual(graphs.capture_bs, [1, 2, 4])
        self.assertIn(
            "load_aware_draft_catch_up", self.worker._additional_graph_memory_usage
        )

        plain, batch, result, seq_lens, slots = self.step(plain)
        self.check_one_token_draft_extend(plain, batch, result, seq_lens, slots)
        self.assertEqual(self.events, ["publish", "target", "draft-graph"])
        # The replay plans its own metadata: no eager planning.
        self.assertEqual(self.draft_runner.planned, [])
        # The replay is the step's last reader of shared buffers.
        self.assertIs(
            self.draft_runner.war_fastpath_read_done_event,
            graphs.read_done_events[-1],
        )
        # The next replay overwrites the graphs' output, not the draft input.
        hidden = result.next_draft_input.hidden_states
        self.assertNotEqual(hidden.data_ptr(), graphs.hidden_states.data_ptr())

    def test_a_batch_beyond_the_graphs_runs_eagerly(self):
        plain = self.plain_step_with_graphs([1, 2])
        plain, batch, result, seq_lens, slots = self.step(plain)
        self.check_one_token_draft_extend(plain, batch, result, seq_lens, slots)
        self.assertEqual(self.events, ["publish", "target", "draft"])
        self.assertEqual(
            self.draft_runner.planned, [("fresh-backend", ForwardMode.DECODE)]
        )
        self.assertIsNone(self.draft_runner.war_fastpath_read_done_event)

    def test_no_graphs_where_draft_extend_graphs_are_disabled(self):
        with envs.SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH.override(True):
            plain = self.plain_step_with_graphs([1, 2, 4])
        self.assertIsNone(plain.draft_catch_up.one_token_graphs)

    def test_grammar_barrier_runs_before_the_target(self):
        plain = self.plain_step()
        batch = self.decode_batch()
        batch.has_grammar = True
        barriers = []
        self.run_forward(
            plain, batch, grammar_barrier=lambda: barriers.append(list(self.events))
        )
        self.assertEqual(barriers, [["publish"]])
        batch = self.decode_batch()
        self.run_forward(plain, batch, grammar_barrier=lambda: barriers.append(None))
        self.assertEqual(len(barriers), 1)  # no grammar in the batch

    def test_target_failure_restores_the_verify_backend(self):
        plain = self.plain_step()
        self.target.fail = True
        with self.assertRaises(RuntimeError):
            plain.forward(self.decode_batch())
        self.assertEqual(self.target.model_runner.attn_backend, "verify-backend")
        self.assertEqual(
            self.target.model_runner.decode_cuda_graph_runner, "verify-graphs"
        )

    def test_decode_graphs_replace_the_verify_graphs(self):
        plain = self.plain_step()
        plain.target_decode_graphs.graph_runner = "decode-graphs"  # captured
        self.run_forward(plain, self.decode_batch())
        call = self.target.model_runner.forward_batches[-1]
        self.assertEqual(call["graph_runner"], "decode-graphs")
        self.assertEqual(
            self.target.model_runner.decode_cuda_graph_runner, "verify-graphs"
        )

    def test_zero_step_adaptive_tier_feeds_its_controller(self):
        controller = RecordingAdaptiveController()
        self.worker.adaptive_controller = controller
        self.worker.speculative_num_steps = 0
        self.step()
        self.assertEqual(controller.feeds, [([0] * BS, BS)])

    def test_threshold_plain_step_does_not_feed_the_controller(self):
        controller = RecordingAdaptiveController()
        self.worker.adaptive_controller = controller
        self.worker.speculative_num_steps = 3
        self.step()
        self.assertEqual(controller.feeds, [])

    def test_fresh_attention_backend_keeps_the_workspace_flag(self):
        runner = self.target.model_runner
        self.assertEqual(
            fresh_attention_backend(runner, init_new_workspace=True),
            "decode-backend-1",
        )
        self.assertFalse(runner.init_new_workspace)

    def publish(self, **spec_args):
        spec_args.setdefault("speculative_algorithm", "EAGLE")
        self.worker.server_args = publish_server_args(self, **spec_args)

    def test_unsupported_algorithm_refused_with_a_threshold(self):
        self.publish(
            speculative_algorithm="STANDALONE", speculative_disable_batch_threshold=8
        )
        with self.assertRaises(ValueError) as ctx:
            build_plain_step(self.worker)
        self.assertIn("STANDALONE", str(ctx.exception))
        self.assertIn("--speculative-disable-batch-threshold", str(ctx.exception))

    def test_zero_step_tiers_keep_upstreams_verify_where_unsupported(self):
        self.worker.adaptive_controller = SimpleNamespace(candidate_steps=[0, 1, 3])
        self.publish(speculative_disable_batch_threshold=None)
        self.assertIsNotNone(build_plain_step(self.worker))
        for unsupported in (
            dict(speculative_algorithm="STANDALONE"),
            dict(enable_lora=True),
            dict(speculative_use_rejection_sampling=True),
        ):
            with self.subTest(**unsupported):
                self.publish(speculative_disable_batch_threshold=None, **unsupported)
                self.assertIsNone(build_plain_step(self.worker))

    def test_no_plain_step_without_a_threshold_or_zero_step_tier(self):
        self.publish(speculative_disable_batch_threshold=None)
        self.worker.adaptive_controller = SimpleNamespace(candidate_steps=[1, 3, 7])
        self.assertIsNone(build_plain_step(self.worker))


class TestPlainStepKVOnlyDraftCatchUp(PlainStepTestBase):
    """A one-layer draft writes its KV alone on plain steps, and runs the
    full draft forward once, before the next speculative step."""

    kv_only = True

    def test_forward_writes_the_draft_kv_only(self):
        plain, batch, result, seq_lens, slots = self.step()
        self.assertTrue(plain.draft_catch_up.kv_only)
        self.assertEqual(self.events, ["publish", "target", "draft-kv"])
        # Nothing after the target's replay reads shared buffers.
        self.assertIs(
            self.draft_runner.war_fastpath_read_done_event,
            self.target.read_done_events[-1],
        )
        self.assertEqual(self.draft_runner.forward_batches, [])
        (call,) = self.draft_model.calls
        self.assertEqual(call["input_ids"], [40, 41, 42, 43])
        self.assertEqual(call["positions"], seq_lens)
        self.assertEqual(call["positions_dtype"], torch.int64)
        self.assertEqual(call["hidden_states"][:, 0].tolist(), [1, 2, 3, 4])
        self.assertEqual(call["out_cache_loc"], slots)
        self.assertEqual(call["token_to_kv_pool"], "draft-kv-pool")
        # The next draft input is pending: no top-k yet, a placeholder hidden;
        # the target hidden states are kept by request for the resume.
        nxt = result.next_draft_input
        self.assertTrue(bool((nxt.topk_p == -1).all()))
        self.assertEqual(tuple(nxt.hidden_states.shape), (BS, DRAFT_HIDDEN))
        kept = plain.draft_catch_up.hidden_by_req[batch.req_pool_indices]
        self.assertEqual(kept[:, 0].tolist(), [1, 2, 3, 4])
        self.assertTrue(plain.draft_catch_up.resume_pending)

    def test_resume_fills_only_the_pending_rows(self):
        plain, batch, result, seq_lens, _ = self.step()
        # What the scheduler leaves for the next step (the sync path).
        batch.spec_info = result.next_draft_input
        batch.seq_lens = result.new_seq_lens
        batch.seq_lens_cpu = result.new_seq_lens.cpu()
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        batch.forward_mode = ForwardMode.DECODE
        batch.out_cache_loc = None
        new_seq_lens = batch.seq_lens.tolist()
        # Request 2 was prefilled since: its draft input is complete.
        nxt = batch.spec_info
        nxt.topk_p[2] = 0.25
        nxt.topk_index[2] = 9
        nxt.hidden_states[2] = 5.0

        plain.resume_speculation(batch)

        # One full draft forward at each request's last position; it writes its KV
        # to the padding slot 0: the plain step's KV of that position stays.
        (call,) = self.draft_runner.forward_batches
        self.assertEqual(call["forward_mode"], ForwardMode.DRAFT_EXTEND_V2)
        self.assertEqual(call["input_ids"], [40, 41, 42, 43])
        self.assertEqual(call["positions"], seq_lens)
        self.assertEqual(call["out_cache_loc"], [0] * BS)
        # The target hidden states the plain step kept by request.
        self.assertEqual(call["spec_info"].hidden_states[:, 0].tolist(), [1, 2, 3, 4])
        done = batch.spec_info
        self.assertEqual(done.topk_index[:, 0].tolist(), [3, 4, 9, 6])
        self.assertEqual(done.topk_p[2].tolist(), [0.25] * TOPK)
        self.assertTrue(bool((done.topk_p[[0, 1, 3]] > 0).all()))
        self.assertTrue(bool((done.topk_p[[0, 1, 3], 0] > 0.9).all()))
        self.assertEqual(done.hidden_states[:, 0].tolist(), [7.0, 7.0, 5.0, 7.0])
        # The speculative step's own batch is untouched.
        self.assertEqual(batch.seq_lens.tolist(), new_seq_lens)
        self.assertTrue(batch.forward_mode.is_decode())
        self.assertIsNone(batch.out_cache_loc)
        self.assertFalse(plain.draft_catch_up.resume_pending)
        plain.resume_speculation(batch)  # nothing pending any more
        self.assertEqual(len(self.draft_runner.forward_batches), 1)

    def prefill(self, prompt_lens):
        """A prefill's batch and the target's output for it: token t of the
        batch's hidden state t (every dim), request i's next token 60 + i."""
        batch = extend_batch(
            self.pools,
            self.model_config,
            SpeculativeAlgorithm.EAGLE,
            prompt_lens,
            max_new_tokens=64,
            enable_overlap=False,
            rid_prefix="p",
        )
        # As the scheduler resolves it before the forward.
        batch.input_ids, batch.prefill_input_ids_cpu = batch.prefill_input_ids_cpu, None
        num_tokens = sum(prompt_lens)
        output = GenerationBatchResult(
            logits_output=LogitsProcessorOutput(
                next_token_logits=None,
                hidden_states=torch.arange(num_tokens, dtype=torch.float32)[
                    :, None
                ].repeat(1, TARGET_HIDDEN),
            ),
            next_token_ids=torch.arange(len(prompt_lens)) + 60,
        )
        return batch, output

    def test_a_prefill_while_plain_steps_run_writes_the_draft_kv_only(self):
        plain, *_ = self.step()
        batch, output = self.prefill([3, 2])
        slots = batch.out_cache_loc.tolist()
        self.assertTrue(plain.prefills_kv_only(batch, output))

        draft_input = plain.draft_prefill(batch, output)

        self.assertEqual(self.draft_runner.forward_batches, [])
        _, call = self.draft_model.calls
        # The draft's input ids: the prompts 1 2 3 and 1 2 shifted by one, then each
        # request's next token.
        self.assertEqual(call["input_ids"], [2, 3, 60, 2, 61])
        self.assertEqual(call["positions"], [0, 1, 2, 0, 1])
        self.assertEqual(call["positions_dtype"], torch.int64)
        self.assertEqual(call["out_cache_loc"], slots)
        self.assertEqual(call["hidden_states"][:, 0].tolist(), [0, 1, 2, 3, 4])
        # Each request's last position pending, its target hidden state kept.
        self.assertTrue(bool((draft_input.topk_p == -1).all()))
        self.assertEqual(tuple(draft_input.topk_index.shape), (2, TOPK))
        self.assertEqual(tuple(draft_input.hidden_states.shape), (2, DRAFT_HIDDEN))
        kept = plain.draft_catch_up.hidden_by_req[batch.req_pool_indices]
        self.assertEqual(kept[:, 0].tolist(), [2, 4])
        self.assertIs(draft_input.bonus_tokens, output.next_token_ids)
        self.assertTrue(plain.draft_catch_up.resume_pending)
        self.assertEqual(plain.get_state(), {"draft_prefills_kv_only": 1})

    def test_a_chunk_ends_its_draft_input_ids_with_the_next_prompt_token(self):
        plain, *_ = self.step()
        batch, output = self.prefill([3, 2])
        batch.chunked_req, batch.chunked_req_next_prompt_token = batch.reqs[0], 4
        plain.draft_prefill(batch, output)
        _, call = self.draft_model.calls
        self.assertEqual(call["input_ids"], [2, 3, 4, 2, 61])

    def test_a_prefill_while_speculating_proposes_at_each_prompts_end(self):
        plain = self.plain_step()  # speculating: nothing pending
        batch, output = self.prefill([3, 2])
        slots = batch.out_cache_loc.tolist()
        self.assertTrue(plain.prefills_kv_only(batch, output))

        draft_input = plain.draft_prefill(batch, output)

        # The KV of every prompt position, as while plain steps run.
        (call,) = self.draft_model.calls
        self.assertEqual(call["input_ids"], [2, 3, 60, 2, 61])
        self.assertEqual(call["positions"], [0, 1, 2, 0, 1])
        self.assertEqual(call["out_cache_loc"], slots)
        # Then one full draft forward at each prompt's last position, on the
        # request's next token and the target hidden state there; it writes its KV
        # to the padding slot 0: the KV just written at that position stays.
        (forward,) = self.draft_runner.forward_batches
        self.assertEqual(forward["forward_mode"], ForwardMode.DRAFT_EXTEND_V2)
        self.assertEqual(forward["input_ids"], [60, 61])
        self.assertEqual(forward["positions"], [2, 1])
        self.assertEqual(forward["out_cache_loc"], [0, 0])
        self.assertEqual(forward["spec_info"].hidden_states[:, 0].tolist(), [2, 4])
        # Its proposal is the next step's draft input: nothing left pending.
        self.assertEqual(draft_input.topk_index[:, 0].tolist(), [3, 4])
        self.assertTrue(bool((draft_input.topk_p[:, 0] > 0.9).all()))
        self.assertEqual(draft_input.hidden_states[:, 0].tolist(), [7.0, 7.0])
        self.assertIs(draft_input.bonus_tokens, output.next_token_ids)
        self.assertFalse(plain.draft_catch_up.resume_pending)
        self.assertEqual(plain.get_state(), {"draft_prefills_kv_only": 1})
        # The prefill's own batch is untouched.
        self.assertEqual(batch.seq_lens.tolist(), [3, 2])
        self.assertTrue(batch.forward_mode.is_extend())
        self.assertEqual(batch.out_cache_loc.tolist(), slots)

    def test_a_multimodal_prefill_runs_the_draft_extend_after_the_kv_writes(self):
        plain, *_ = self.step()
        draft_calls = len(self.draft_model.calls)
        order = []
        # Upstream's draft extend reads and writes the draft KV that the last plain
        # step's KV-write replay (on a stream of its own on GPUs) may still write.
        plain.draft_catch_up.kv_write_graphs = SimpleNamespace(
            wait=lambda: order.append("wait")
        )
        batch, output = self.prefill([3, 2])
        output.logits_output.mm_input_embeds = torch.zeros(5, DRAFT_HIDDEN)

        self.assertIsNone(plain.draft_prefill(batch, output))

        self.assertEqual(order, ["wait"])
        self.assertEqual(len(self.draft_model.calls), draft_calls)
        self.assertEqual(self.draft_runner.forward_batches, [])

    def test_full_draft_catch_up_on_request(self):
        with envs.SGLANG_LOAD_AWARE_FULL_DRAFT_CATCH_UP.override(True):
            plain = self.plain_step()
        self.assertFalse(plain.draft_catch_up.kv_only)
        self.step(plain)
        self.assertEqual(self.draft_model.calls, [])
        self.assertEqual(len(self.draft_runner.forward_batches), 1)
        self.assertFalse(plain.draft_catch_up.resume_pending)
        self.assertFalse(plain.prefills_kv_only(*self.prefill([3, 2])))


class TestPrefillPositionsAndLastRows(CustomTestCase):
    def test_as_upstreams_extend_positions(self):
        # Prefixes from a radix cache hit and an earlier chunk, and a one-token extend.
        prefix_lens, extend_lens = [0, 7, 3, 0], [3, 2, 5, 1]
        positions, last_rows = prefill_positions_and_last_rows(
            prefix_lens, extend_lens, torch.device("cpu")
        )
        expected, start_loc = compute_position_torch(
            torch.tensor(prefix_lens), torch.tensor(extend_lens)
        )
        self.assertEqual(positions.dtype, torch.int64)
        self.assertEqual(positions.tolist(), expected.tolist())
        self.assertEqual(
            last_rows.tolist(), (start_loc + torch.tensor(extend_lens) - 1).tolist()
        )


class TestDecodeAttentionForOneTokenExtend(CustomTestCase):
    def test_the_decode_backend_sees_a_decode_without_spec_info(self):
        seen = []

        class RecordingDecodeBackend:
            def init_forward_metadata(self, forward_batch):
                seen.append(("plan", forward_batch))

            def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache):
                seen.append(("decode", forward_batch))
                return q

        spec_info = object()
        extend = SimpleNamespace(
            forward_mode=ForwardMode.DRAFT_EXTEND_V2, spec_info=spec_info
        )
        attention = DecodeAttentionForOneTokenExtend(RecordingDecodeBackend())
        attention.init_forward_metadata(extend)
        q = torch.ones(2, 4)
        self.assertIs(attention.forward(q, q, q, None, extend), q)
        self.assertEqual([call for call, _ in seen], ["plan", "decode"])
        for _, forward_batch in seen:
            self.assertEqual(forward_batch.forward_mode, ForwardMode.DECODE)
            self.assertIsNone(forward_batch.spec_info)
        # The model keeps reading its hidden-state input from the extend's.
        self.assertEqual(extend.forward_mode, ForwardMode.DRAFT_EXTEND_V2)
        self.assertIs(extend.spec_info, spec_info)

    def test_cuda_graph_hooks_reach_the_decode_backend_as_a_decode(self):
        seen = []

        class RecordingDecodeBackend:
            def init_cuda_graph_state(self, max_bs, max_num_tokens):
                seen.append(("state", max_bs, max_num_tokens))

            def get_cuda_graph_seq_len_fill_value(self):
                return 1

            def init_forward_metadata_out_graph(self, forward_batch, in_capture):
                seen.append(("out", forward_batch, in_capture))

            def init_forward_metadata_in_graph(self, forward_batch):
                seen.append(("in", forward_batch))

            def on_after_cuda_graph_warmup(self):
                seen.append(("warmed",))

        extend = SimpleNamespace(
            forward_mode=ForwardMode.DRAFT_EXTEND_V2, spec_info=object()
        )
        attention = DecodeAttentionForOneTokenExtend(RecordingDecodeBackend())
        attention.init_cuda_graph_state(8, 8)
        self.assertEqual(attention.get_cuda_graph_seq_len_fill_value(), 1)
        attention.init_forward_metadata_out_graph(extend, in_capture=True)
        attention.init_forward_metadata_in_graph(extend)
        attention.on_after_cuda_graph_warmup()
        attention.init_forward_metadata_out_graph(extend)
        self.assertEqual(seen[0], ("state", 8, 8))
        self.assertEqual([call[0] for call in seen[1:]], ["out", "in", "warmed", "out"])
        self.assertEqual([seen[1][2], seen[4][2]], [True, False])
        for call in (seen[1], seen[2], seen[4]):
            self.assertEqual(call[1].forward_mode, ForwardMode.DECODE)
            self.assertIsNone(call[1].spec_info)

    def test_an_idle_batch_stays_idle(self):
        idle = SimpleNamespace(forward_mode=ForwardMode.IDLE, spec_info=object())
        as_decode = DecodeAttentionForOneTokenExtend.as_decode(idle)
        self.assertEqual(as_decode.forward_mode, ForwardMode.IDLE)
        self.assertIsNone(as_decode.spec_info)


@unittest.skipIf(IN_TRITON_INTERPRETER, "this process already is the second one")
class TestInTritonInterpreter(CustomTestCase):
    def test_module_passes_in_the_interpreter(self):
        run_in_triton_interpreter(self, __file__)


if __name__ == "__main__":
    unittest.main()
