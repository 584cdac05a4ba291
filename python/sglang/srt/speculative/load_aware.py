"""Plain decode steps of a load-aware speculative EAGLEWorkerV2.

When a decode step does not speculate (``ScheduleBatch.spec_plain_step``, set by
the load-aware policy of spec_policy.py, or an adaptive tier at 0 draft steps),
``EAGLEWorkerV2.forward_batch_generation`` hands it to ``LoadAwarePlainStep``,
which

1. runs the target exactly like a decode step of a server without speculation:
   ForwardMode.DECODE, decode attention kernels, the DECODE CUDA graphs captured
   here (``TargetDecodeGraphs``), sampling through the target worker's normal
   ``forward_batch_generation`` (penalties, grammar masks, logprobs); it also
   captures the target hidden state of the new token for the draft;
2. keeps the draft KV cache valid for the token just decoded (``DraftCatchUp``;
   a one-layer EAGLE or EAGLE-3 draft writes that KV alone, in
   ``DraftKVWriteGraphs``), so that speculation can resume at any step with
   undiminished acceptance;
3. returns a result shaped like a verify step's that accepted no draft (one
   token per request, ``accept_lens`` 1, ``new_seq_lens``, the next draft input,
   which a KV-only catch-up leaves pending for ``DraftCatchUp.resume`` to
   complete before the next speculative step), flagged ``spec_plain_step`` so
   that the output path skips the speculative statistics. The overlap future
   map, the output processing and the next step (speculative or plain) see the
   state a verify step leaves: ``seq_len = L + 1``, target and draft KV valid
   for ``[0, L + 1)``, the sampled token pending.

The scheduler allocates the step's KV slot before the step
(``spec_policy.decode_kv_reserve``); its position, ``seq_len``, is only known
here, once the overlap future map has resolved the previous step.

A prefill writes its draft KV the same way (``prefills_kv_only``): no draft
attention, MLP or LM head over the prompt. Its last position is left pending like
a plain step's while plain steps run; while speculating, the one-token draft
forward runs there at once.
"""

from __future__ import annotations

import bisect
import collections
import copy
import functools
import logging
import time
from contextlib import contextmanager
from typing import (
    TYPE_CHECKING,
    Callable,
    Deque,
    Dict,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
)

import numpy as np
import torch

from sglang.srt.configs.hybrid_arch import mambaish_config
from sglang.srt.distributed.parallel_state import graph_capture
from sglang.srt.environ import envs
from sglang.srt.layers.moe.utils import (
    speculative_moe_a2a_backend_context,
    speculative_moe_backend_context,
)
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.runner.base_cuda_graph_runner import freeze_gc
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import (
    DecodeCudaGraphRunner,
)
from sglang.srt.runtime_context import get_spec
from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState
from sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner import (
    EAGLEDraftExtendCudaGraphRunner,
)
from sglang.srt.speculative.eagle_info import EagleDraftExtendInput, EagleDraftInput
from sglang.srt.speculative.eagle_utils import (
    _eagle_prefill_tail_tokens,
    get_draft_input_from_target_hidden_dim,
)
from sglang.srt.speculative.eagle_worker_common import prepare_for_draft_extend
from sglang.srt.speculative.spec_policy import (
    has_zero_step_tiers,
    load_aware_unsupported_reason,
)
from sglang.srt.utils import get_available_gpu_memory, log_info_on_rank0
from sglang.srt.utils.common import fast_topk, temp_attr_context

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

logger = logging.getLogger(__name__)

G = TypeVar("G")
# write_kv_cache_only of a draft model, bound to its KV pool: (input_ids,
# positions, target hidden states, out_cache_loc).
KVWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def build_plain_step(worker: EAGLEWorkerV2) -> Optional[LoadAwarePlainStep]:
    """The plain step of a worker whose decode steps can run plain, or None.

    Adaptive tiers at 0 draft steps on a model the plain step cannot serve keep
    upstream's one-node verify; the load-aware thresholds refuse it.
    """
    threshold = get_spec().speculative_disable_batch_threshold
    if threshold is None and not has_zero_step_tiers(worker.adaptive_controller):
        return None
    reason = load_aware_worker_unsupported_reason(worker)
    if reason is None:
        return LoadAwarePlainStep(worker)
    if threshold is not None:
        raise ValueError(f"--speculative-disable-batch-threshold: {reason}.")
    log_info_on_rank0(
        logger,
        f"Adaptive tiers at 0 draft steps run upstream's one-node verify: {reason}.",
    )
    return None


def load_aware_worker_unsupported_reason(worker: EAGLEWorkerV2) -> Optional[str]:
    """Limits of the worker as it was built: the model architecture, and those of
    its server args (the algorithm, the attention backends chosen, other
    features)."""
    if mambaish_config(worker.target_worker.model_runner.model_config) is not None:
        return (
            "hybrid (mamba / linear-attention) target models are not supported "
            "yet: plain steps would not update the mamba state tracking"
        )
    return load_aware_unsupported_reason(worker.server_args)


def fresh_attention_backend(
    model_runner: ModelRunner, init_new_workspace: bool
) -> AttentionBackend:
    """A separate instance of the model runner's attention backend: a second
    ``init_cuda_graph_state`` on the backend in use would reallocate the buffers
    its captured graphs point to. ``init_new_workspace`` gives it a flashinfer
    workspace of its own (as upstream's adaptive runtime states build theirs)."""
    backup_init_new_workspace = model_runner.init_new_workspace
    try:
        return model_runner._get_attention_backend(
            init_new_workspace=init_new_workspace
        )
    finally:
        model_runner.init_new_workspace = backup_init_new_workspace


def capture_accounted(
    worker: EAGLEWorkerV2, name: str, description: str, capture: Callable[[], G]
) -> G:
    """Run ``capture`` (it returns graphs with their ``capture_bs``), counting its
    GPU memory and time among the worker's additional graphs (the startup log's
    ``name=``)."""
    tic = time.perf_counter()
    before_mem = get_available_gpu_memory(worker.device, worker.gpu_id)
    graphs = capture()
    after_mem = get_available_gpu_memory(worker.device, worker.gpu_id)
    seconds = time.perf_counter() - tic
    worker._additional_graph_memory_usage[name] = before_mem - after_mem
    worker._additional_graph_time_usage[name] = seconds
    log_info_on_rank0(
        logger,
        f"Captured {description} cuda graphs (load-aware speculation): "
        f"bs={graphs.capture_bs}, {seconds:.2f} s, "
        f"mem={before_mem - after_mem:.2f} GB, avail mem={after_mem:.2f} GB",
    )
    return graphs


class DecodeAttentionForOneTokenExtend(AttentionBackend):
    """Runs the attention of a draft extend of one token per request through the
    decode kernels of another backend instance: the extend kernels would tile a
    single query row per request over the whole prefix.

    Such an extend carries what a decode needs (``seq_lens`` counting the new
    token, its KV slot in ``out_cache_loc``). The decode backend sees forward
    mode DECODE (IDLE stays IDLE) and no spec_info (with spec_info, FA3 would
    run the cascade attention of a draft tree); the draft model keeps reading
    its hidden-state input from the forward batch's spec_info. The CUDA-graph
    hooks map to the decode backend's the same way, so that a draft-extend graph
    runner captures and replays the extend with decode kernels.
    """

    def __init__(self, decode_backend: AttentionBackend):
        super().__init__()
        self.decode_backend = decode_backend

    @staticmethod
    def as_decode(forward_batch: ForwardBatch) -> ForwardBatch:
        as_decode = copy.copy(forward_batch)
        if not forward_batch.forward_mode.is_idle():
            as_decode.forward_mode = ForwardMode.DECODE
        as_decode.spec_info = None
        return as_decode

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.decode_backend.init_forward_metadata(self.as_decode(forward_batch))

    def init_forward_metadata_out_graph(
        self, forward_batch: ForwardBatch, in_capture: bool = False
    ) -> None:
        self.decode_backend.init_forward_metadata_out_graph(
            self.as_decode(forward_batch), in_capture=in_capture
        )

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        self.decode_backend.init_forward_metadata_in_graph(
            self.as_decode(forward_batch)
        )

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.decode_backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.decode_backend.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self) -> None:
        self.decode_backend.on_after_cuda_graph_warmup()

    def forward_extend(
        self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs
    ):
        return self.decode_backend.forward_decode(
            q,
            k,
            v,
            layer,
            self.as_decode(forward_batch),
            save_kv_cache=save_kv_cache,
            **kwargs,
        )


class TargetDecodeGraphs:
    """The DECODE attention backend and CUDA-graph family of a speculative target.

    ``active()`` routes one target forward to them; without CUDA graphs
    (``graph_runner`` None) that forward runs eagerly on the DECODE backend.
    """

    def __init__(self, worker: EAGLEWorkerV2):
        self.model_runner = worker.target_worker.model_runner
        self.attn_backend = fresh_attention_backend(
            self.model_runner, init_new_workspace=True
        )
        self.graph_runner: Optional[DecodeCudaGraphRunner] = None
        if worker.target_worker.model_runner.decode_cuda_graph_runner is not None:
            self.graph_runner = capture_accounted(
                worker,
                "load_aware_decode",
                "target plain-decode",
                lambda: DecodeCudaGraphRunner(
                    self.model_runner, attn_backend=self.attn_backend, plain_decode=True
                ),
            )

    @contextmanager
    def active(self) -> Iterator[None]:
        """The model runner replays ``decode_cuda_graph_runner`` whenever it
        accepts the batch, whatever the forward mode: the verify runner must not
        see a DECODE batch. Restores what is installed (adaptive states swap it)."""
        model_runner = self.model_runner
        with (
            temp_attr_context(model_runner, "attn_backend", self.attn_backend),
            temp_attr_context(
                model_runner, "decode_cuda_graph_runner", self.graph_runner
            ),
        ):
            yield


def plain_steps_write_kv_only(draft_model: torch.nn.Module) -> bool:
    if envs.SGLANG_LOAD_AWARE_FULL_DRAFT_CATCH_UP.get():
        return False
    can_write = getattr(draft_model, "can_write_kv_cache_only", None)
    return can_write is not None and can_write()


def prefill_positions_and_last_rows(
    prefix_lens: Sequence[int], extend_lens: Sequence[int], device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each prefilled token's position (int64) and the row of each request's last
    prefilled token, built on the host from the prefill's lengths and moved in one
    copy: the KV-only draft prefill needs no second ForwardBatch for them."""
    extend_lens = np.asarray(extend_lens, dtype=np.int64)
    ends = np.cumsum(extend_lens)
    num_tokens = int(ends[-1])
    offsets = np.asarray(prefix_lens, dtype=np.int64) - (ends - extend_lens)
    positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(offsets, extend_lens)
    both = torch.from_numpy(np.concatenate((positions, ends - 1)))
    both = both.to(device, non_blocking=True)
    return both[:num_tokens], both[num_tokens:]


class DraftKVWriteGraphs:
    """CUDA graphs of a KV-only draft write, one per batch size.

    Eager, the write's ~10 small kernels cost more host time than GPU time, and
    at large batches a plain step is host-bound like a decode step without
    speculation. A batch between captured sizes replays the next larger graph;
    its padding rows write the KV pool's padding slot 0. A write takes the target
    hidden states of its requests from ``hidden_by_req`` (rows by request pool
    index, filled by the caller). With ``overlap``, the replays run on a stream
    of their own, beside the next target forward: nothing that step returns
    depends on them. ``wait`` orders the current stream after the last replay; the
    caller calls it before it refills ``hidden_by_req`` or replays again.
    The graphs have a memory pool of their own, which no concurrent graph uses.
    """

    def __init__(
        self,
        write: KVWrite,
        capture_bs: Sequence[int],
        hidden_by_req: torch.Tensor,
        overlap: bool,
    ):
        self.write = write
        self.capture_bs = sorted(capture_bs)
        self.hidden_by_req = hidden_by_req
        max_bs = self.capture_bs[-1]
        device = hidden_by_req.device
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.stream = torch.cuda.Stream(device) if overlap else None
        self.replayed = torch.cuda.Event() if overlap else None
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}

    def capture(self, stream: torch.cuda.Stream) -> None:
        """Warm up and capture every batch size (while ``out_cache_loc`` is all
        padding slots), the largest first so that the others reuse its memory."""
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.capture_bs):
            for _ in range(2):
                self._write(bs)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._write(bs)
            self.graphs[bs] = graph

    def can_run(self, bs: int) -> bool:
        return bs <= self.capture_bs[-1]

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        req_pool_indices: torch.Tensor,
        out_cache_loc: torch.Tensor,
    ) -> None:
        bs = len(input_ids)
        graph_bs = self.capture_bs[bisect.bisect_left(self.capture_bs, bs)]
        self.input_ids[:bs].copy_(input_ids)
        self.positions[:bs].copy_(positions)
        self.req_pool_indices[:bs].copy_(req_pool_indices)
        self.out_cache_loc[:bs].copy_(out_cache_loc)
        if graph_bs > bs:
            self.out_cache_loc[bs:graph_bs].zero_()
        if self.stream is None:
            self.graphs[graph_bs].replay()
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.graphs[graph_bs].replay()
            self.replayed.record()

    def wait(self) -> None:
        """Order the current stream after the last replay: before anything reads
        the draft KV or refills the graphs' inputs."""
        if self.stream is not None:
            torch.cuda.current_stream().wait_event(self.replayed)

    def _write(self, bs: int) -> None:
        self.write(
            self.input_ids[:bs],
            self.positions[:bs],
            self.hidden_by_req[self.req_pool_indices[:bs]],
            self.out_cache_loc[:bs],
        )


def at_last_positions(batch: ScheduleBatch) -> ScheduleBatch:
    """A copy of ``batch`` for a one-token draft forward at each request's last
    position with KV (``seq_lens - 1``): its KV goes to the padding slot 0, so
    that the KV written there before stays."""
    last = copy.copy(batch)
    last.seq_lens = batch.seq_lens - 1
    last.seq_lens_sum = None
    if batch.seq_lens_cpu is not None:
        last.seq_lens_cpu = batch.seq_lens_cpu - 1
        last.seq_lens_sum = int(last.seq_lens_cpu.sum())
    last.out_cache_loc = torch.zeros_like(batch.req_pool_indices, dtype=torch.int64)
    # The draft's proposal needs no logprobs (a prefill's would be per prompt token).
    last.return_logprob = False
    return last


class DraftCatchUp:
    """Writes the draft KV of the token a plain step decoded.

    A one-layer EAGLE or EAGLE-3 draft writes that KV alone
    (``write_kv_cache_only``: embedding, fc, norms and the K/V projections, no
    attention, MLP or LM head).
    Its top-k and hidden state are only needed by a speculative step, so plain
    steps then leave the next draft input pending (top-k probability -1) and
    ``resume`` runs the full one-token draft forward once, before the first
    speculative step after them. Other drafts run that forward on every plain
    step: a one-token draft extend, the one upstream's 0-step adaptive tier runs,
    with decode attention (``DecodeAttentionForOneTokenExtend``), replayed from
    draft-extend CUDA graphs of its own where they were captured.
    """

    def __init__(self, worker: EAGLEWorkerV2, graph_bs: Optional[Sequence[int]]):
        """graph_bs: the batch sizes to capture the catch-up at (the target's
        plain-decode graphs'), or None to run it eagerly. With one TP rank the
        captured KV-only writes run beside the next target forward (with more,
        the draft embedding's all-reduce must keep the ranks' stream order)."""
        draft_worker = worker.draft_worker
        self.draft_worker = draft_worker
        draft_runner = draft_worker.draft_runner
        self.draft_runner = draft_runner
        self.topk = draft_worker.topk
        max_bs = draft_runner.req_to_token_pool.size
        device = draft_runner.device
        # Allocated once, sliced per step, never modified in place.
        self.num_correct_drafts = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.num_accept_tokens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.kv_only = plain_steps_write_kv_only(draft_runner.model)
        self.one_token_attention = DecodeAttentionForOneTokenExtend(
            # Shares the flashinfer workspace: it plans right before it runs, in
            # sequence with the draft's other forwards on one stream.
            fresh_attention_backend(draft_runner, init_new_workspace=False)
        )
        # Whether a KV-only step may have left draft inputs pending.
        self.resume_pending = False
        self.num_prefills_kv_only = 0
        self.kv_write_graphs: Optional[DraftKVWriteGraphs] = None
        self.one_token_graphs: Optional[EAGLEDraftExtendCudaGraphRunner] = None
        if (
            not self.kv_only
            and graph_bs
            and not envs.SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH.get()
        ):
            self.one_token_graphs = capture_accounted(
                worker,
                "load_aware_draft_catch_up",
                "one-token draft catch-up",
                lambda: self._capture_one_token_graphs(graph_bs),
            )
        if self.kv_only:
            self.write_kv: KVWrite = functools.partial(
                draft_runner.model.write_kv_cache_only,
                token_to_kv_pool=draft_runner.token_to_kv_pool,
            )
            self.pending_topk_p = torch.full((max_bs, self.topk), -1.0, device=device)
            self.pending_topk_index = torch.zeros(
                (max_bs, self.topk), dtype=torch.int64, device=device
            )
            model_config = draft_runner.model_config
            # The target hidden states of each request's last token written KV
            # only, by request pool index: ``resume`` runs the draft there. The
            # draft input of such a token holds a placeholder hidden state.
            self.hidden_by_req = torch.zeros(
                (
                    len(draft_runner.req_to_token_pool.req_to_token),
                    get_draft_input_from_target_hidden_dim(draft_runner),
                ),
                dtype=model_config.dtype,
                device=device,
            )
            self.pending_hidden = torch.zeros(
                (max_bs, model_config.hidden_size),
                dtype=model_config.dtype,
                device=device,
            )
            log_info_on_rank0(
                logger,
                "Load-aware speculation: plain steps, and prefills while they run, "
                "write the draft KV only; the full draft forward runs once when "
                "speculation resumes.",
            )
            if graph_bs:
                self.kv_write_graphs = capture_accounted(
                    worker,
                    "load_aware_draft_kv_write",
                    "draft KV-write",
                    lambda: self._capture_kv_write_graphs(graph_bs),
                )

    def _capture_kv_write_graphs(self, graph_bs: Sequence[int]) -> DraftKVWriteGraphs:
        draft_runner = self.draft_runner
        graphs = DraftKVWriteGraphs(
            self.write_kv,
            graph_bs,
            self.hidden_by_req,
            overlap=draft_runner.server_args.tp_size == 1,
        )
        with (
            freeze_gc(draft_runner.server_args.enable_cudagraph_gc),
            self.draft_context(),
            graph_capture() as capture_context,
        ):
            graphs.capture(capture_context.stream)
        return graphs

    def _capture_one_token_graphs(
        self, graph_bs: Sequence[int]
    ) -> EAGLEDraftExtendCudaGraphRunner:
        with self.draft_context():
            return EAGLEDraftExtendCudaGraphRunner(
                self.draft_worker,
                draft_extend_attn_backend=self.one_token_attention,
                num_tokens_per_req=1,
                capture_bs=list(graph_bs),
            )

    @contextmanager
    def draft_context(self) -> Iterator[None]:
        """What the draft model's forwards run under (as in EAGLEWorkerV2)."""
        with (
            self.draft_worker.draft_tp_context(self.draft_runner.tp_group),
            speculative_moe_backend_context(),
            speculative_moe_a2a_backend_context(),
        ):
            yield

    def run(
        self,
        batch: ScheduleBatch,
        hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write the draft KV at position p = ``batch.seq_lens`` (before the step),
        slot ``batch.out_cache_loc``: the draft consumes (the token at p + 1, the
        one just sampled; the target hidden state at p).

        hidden_states: [bs, target hidden size (x aux layers for EAGLE-3)];
        next_token_ids: [bs]. Returns the draft's (topk_p, topk_index,
        hidden_states) at the new token; KV-only: the pending top-k and the
        placeholder hidden state.
        """
        if not self.kv_only:
            return self._forward(batch, hidden_states, next_token_ids)
        bs = len(batch.seq_lens)
        with self.draft_context():
            self._write_kv_only(
                next_token_ids,
                batch.seq_lens,
                hidden_states,
                batch.req_pool_indices,
                batch.out_cache_loc,
            )
        self.resume_pending = True
        return (
            self.pending_topk_p[:bs],
            self.pending_topk_index[:bs],
            self.pending_hidden[:bs],
        )

    def prefill(
        self,
        batch: ScheduleBatch,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        propose: bool,
    ) -> EagleDraftInput:
        """The draft prefill of ``batch`` by its KV: the KV of every position, as
        the draft extend writes it. The draft's proposal at each request's last
        position is either computed at once by the one-token forward there
        (``propose``: the next step may speculate), or left pending (as a plain
        step leaves it) for ``resume``.

        target_hidden_states: [tokens, target hidden size x aux layers]."""
        positions, last_rows = prefill_positions_and_last_rows(
            batch.prefix_lens, batch.extend_lens, batch.input_ids.device
        )
        # The draft's input ids, as the draft extend shifts them: each request's
        # prompt tokens one ahead, then its tail token.
        input_ids = batch.input_ids.roll(-1)
        input_ids[last_rows] = _eagle_prefill_tail_tokens(batch, next_token_ids)
        # Eagerly, after the last KV-write replay (which reads hidden_by_req).
        self.wait_for_kv_writes()
        self.write_kv(input_ids, positions, target_hidden_states, batch.out_cache_loc)
        self.num_prefills_kv_only += 1
        last_hidden_states = target_hidden_states[last_rows]
        if propose:
            topk_p, topk_index, hidden_states = self._forward(
                at_last_positions(batch), last_hidden_states, next_token_ids
            )
        else:
            self.hidden_by_req[batch.req_pool_indices] = last_hidden_states
            self.resume_pending = True
            bs = len(batch.seq_lens)
            topk_p = self.pending_topk_p[:bs]
            topk_index = self.pending_topk_index[:bs]
            hidden_states = self.pending_hidden[:bs]
        return EagleDraftInput(
            topk_p=topk_p,
            topk_index=topk_index,
            hidden_states=hidden_states,
            bonus_tokens=next_token_ids,
            num_tokens_per_req=1,
            num_tokens_for_logprob_per_req=1,
        )

    def _write_kv_only(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        req_pool_indices: torch.Tensor,
        out_cache_loc: torch.Tensor,
    ) -> None:
        self.wait_for_kv_writes()
        self.hidden_by_req[req_pool_indices] = hidden_states
        graphs = self.kv_write_graphs
        if graphs is not None and graphs.can_run(len(input_ids)):
            graphs(input_ids, positions, req_pool_indices, out_cache_loc)
        else:
            self.write_kv(
                input_ids, positions.to(torch.int64), hidden_states, out_cache_loc
            )

    def wait_for_kv_writes(self) -> None:
        if self.kv_write_graphs is not None:
            self.kv_write_graphs.wait()

    def resume(self, batch: ScheduleBatch) -> None:
        """Complete the draft input of a speculative step after KV-only plain steps.

        The rows a plain step left pending get the draft's top-k and hidden state
        from the full one-token forward at their last position; the other rows
        (prefilled since) keep theirs. The forward writes its KV to the padding
        slot 0: the KV of that position stays the one the plain step wrote.
        """
        if not self.resume_pending:
            return
        self.resume_pending = False
        self.wait_for_kv_writes()
        draft_input: EagleDraftInput = batch.spec_info
        pending = draft_input.topk_p[:, 0] < 0  # [bs]
        topk_p, topk_index, hidden_states = self._forward(
            at_last_positions(batch),
            self.hidden_by_req[batch.req_pool_indices],
            draft_input.bonus_tokens,
        )
        rows = pending[:, None]
        draft_input.topk_p = torch.where(rows, topk_p, draft_input.topk_p)
        draft_input.topk_index = torch.where(rows, topk_index, draft_input.topk_index)
        draft_input.hidden_states = torch.where(
            rows, hidden_states, draft_input.hidden_states
        )

    def _forward(
        self,
        batch: ScheduleBatch,
        hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The full one-token draft extend of ``run``: (topk_p, topk_index, hidden).
        Modifies ``batch`` (as ``prepare_for_draft_extend`` does)."""
        bs = len(batch.seq_lens)
        extend_input = EagleDraftExtendInput(
            hidden_states=hidden_states,
            num_correct_drafts=self.num_correct_drafts[:bs],
            num_accept_tokens=self.num_accept_tokens[:bs],
            num_tokens_per_req=1,
            num_tokens_for_logprob_per_req=1,
        )
        graphs = self.one_token_graphs
        with (
            self.draft_context(),
            temp_attr_context(
                self.draft_runner, "attn_backend", self.one_token_attention
            ),
        ):
            forward_batch = prepare_for_draft_extend(
                extend_input,
                batch,
                next_token_ids.to(torch.int64),
                1,
                self.draft_runner,
                graphs,
                return_hidden_states_before_norm=False,
            )
            if graphs is not None and graphs.can_run_graph(forward_batch):
                logits_output = graphs.execute(forward_batch)
                # The graphs' outputs are overwritten by their next replay; the
                # hidden state stays in the draft input until the next step.
                hidden_states = logits_output.hidden_states.clone()
            else:
                logits_output = self.draft_runner.forward(forward_batch).logits_output
                hidden_states = logits_output.hidden_states
        probs = torch.softmax(logits_output.next_token_logits, dim=-1)
        topk_p, topk_index = fast_topk(probs, self.topk, dim=-1)
        return topk_p, topk_index, hidden_states


class LoadAwarePlainStep:
    """The plain decode step of an EAGLEWorkerV2 (module docstring)."""

    def __init__(self, worker: EAGLEWorkerV2):
        self.worker = worker
        self.target_decode_graphs = TargetDecodeGraphs(worker)
        graph_runner = self.target_decode_graphs.graph_runner
        self.draft_catch_up = DraftCatchUp(
            worker, graph_runner.capture_bs if graph_runner is not None else None
        )
        # Called after every verify step with its draft step count and the drafts
        # each request accepted.
        self.verify_listeners: List[Callable[[int, List[int]], None]] = []
        # The draft step counts of the speculative steps launched and not yet
        # verified, in launch order (under the overlap scheduler the worker may
        # have switched step counts by the time a verify's result is processed).
        self._unverified_steps: Deque[int] = collections.deque()

    def forward(
        self,
        batch: ScheduleBatch,
        on_publish: Optional[Callable[[torch.Tensor], None]] = None,
        grammar_barrier: Optional[Callable[[], None]] = None,
    ) -> GenerationBatchResult:
        """Run one plain decode step; ``batch.spec_info`` is the resolved draft
        input."""
        worker = self.worker
        draft_input: EagleDraftInput = batch.spec_info
        seq_lens = batch.seq_lens  # [bs], before this step's token
        bs = len(seq_lens)
        batch.out_cache_loc = worker.req_to_token_pool.req_to_token[
            batch.req_pool_indices, seq_lens.to(torch.int64)
        ].to(torch.int64)
        new_seq_lens = seq_lens + 1
        if on_publish is not None:
            # Before the forward: the next step's scheduling waits on this publish
            # (its seq_lens D2H), and a plain step's lengths do not depend on it.
            on_publish(new_seq_lens)

        # 1. Target: the decode forward and sampling of a server without
        # speculation, plus the hidden state of the new token for the draft.
        batch.input_ids = draft_input.bonus_tokens.to(torch.int64)
        batch.spec_info = None  # attention backends must not take draft paths
        batch.seq_lens = new_seq_lens
        seq_lens_cpu = batch.seq_lens_cpu
        if seq_lens_cpu is not None:
            batch.seq_lens_cpu = seq_lens_cpu + 1
            batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        if grammar_barrier is not None and batch.has_grammar:
            grammar_barrier()
        with self.target_decode_graphs.active():
            result = worker.target_worker.forward_batch_generation(
                batch, capture_hidden_mode=CaptureHiddenMode.FULL
            )
        self._hand_over_read_done_event()

        # 2. Draft KV catch-up at the same slots, and the next draft input.
        batch.seq_lens, batch.seq_lens_cpu = seq_lens, seq_lens_cpu
        batch.seq_lens_sum = None
        topk_p, topk_index, hidden_states = self.draft_catch_up.run(
            batch, result.logits_output.hidden_states, result.next_token_ids
        )
        result.next_draft_input = EagleDraftInput(
            topk_p=topk_p,  # [bs, topk]
            topk_index=topk_index,  # [bs, topk]
            hidden_states=hidden_states,  # [bs, draft hidden size]
            bonus_tokens=result.next_token_ids,  # [bs]
            num_tokens_per_req=1,
            num_tokens_for_logprob_per_req=1,
        )

        # 3. A verify step's result that accepted no draft.
        result.spec_plain_step = True
        result.accept_lens = self.draft_catch_up.num_accept_tokens[:bs]
        result.new_seq_lens = new_seq_lens
        result.speculative_num_draft_tokens = 1
        logits_output = result.logits_output
        if logits_output.next_token_logprobs is not None:
            logits_output.next_token_logprobs = logits_output.next_token_logprobs.view(
                bs, 1
            )
        self._feed_zero_step_tier(bs)
        return result

    def zero_step_runtime_state(self) -> SpecRuntimeState:
        """The adaptive runtime state at 0 draft steps, whose decode steps this
        plain step runs. Plain steps run on whichever state is installed, so this
        one shares the installed (launch) state's attention backends; it builds
        no verify or draft graphs of its own, which would never replay."""
        draft_worker = self.worker.draft_worker
        target_runner = self.worker.target_worker.model_runner
        log_info_on_rank0(
            logger,
            "Adaptive runtime state steps=0: run by the load-aware plain step, "
            "no graphs of its own.",
        )
        return SpecRuntimeState(
            speculative_num_steps=0,
            speculative_num_draft_tokens=1,
            draft_attn_backend=draft_worker.draft_attn_backend,
            cuda_graph_runner=None,
            target_attn_backend=target_runner.attn_backend,
            target_graph_runner=target_runner.decode_cuda_graph_runner,
            draft_extend_attn_backend=draft_worker.draft_extend_attn_backend,
            cuda_graph_runner_for_draft_extend=None,
        )

    def get_state(self) -> Dict[str, int]:
        """For /server_info, beside the policy's state."""
        return {"draft_prefills_kv_only": self.draft_catch_up.num_prefills_kv_only}

    def prefills_kv_only(
        self, batch: ScheduleBatch, batch_output: GenerationBatchResult
    ) -> bool:
        """Whether this prefill writes its draft KV alone (DraftCatchUp.prefill),
        as KV-only plain steps do, instead of upstream's draft extend, which runs
        the draft's attention, MLP and LM head over every prompt token for a
        proposal needed only at the prompt's end. Not for multimodal inputs,
        whose draft embeddings the target hands over."""
        return (
            self.draft_catch_up.kv_only
            and not batch.forward_mode.is_idle()
            and batch_output.logits_output.mm_input_embeds is None
        )

    def draft_prefill(
        self, batch: ScheduleBatch, batch_output: GenerationBatchResult
    ) -> Optional[EagleDraftInput]:
        """The draft prefill where ``prefills_kv_only``: while plain steps run (a
        KV-only one ran since the last speculative step) the proposal at each
        prompt's end is left to ``resume``, which runs once for the whole batch if
        speculation resumes; while speculating the next step needs it at once, from
        the one-token forward over the prefill's requests. Else None, for upstream's
        draft extend to run, which reads and writes the draft KV: ordered after the
        last KV-write replay."""
        if self.prefills_kv_only(batch, batch_output):
            return self.draft_catch_up.prefill(
                batch,
                batch_output.logits_output.hidden_states,
                batch_output.next_token_ids,
                propose=not self.draft_catch_up.resume_pending,
            )
        self.draft_catch_up.wait_for_kv_writes()
        return None

    def _hand_over_read_done_event(self) -> None:
        """The scheduler's WAR barrier waits on the read-done event of the worker's
        ``war_fastpath_runner`` (the draft runner, whose draft extend is the last
        phase of a speculative step to read shared buffers), or else on the whole
        forward. In a plain step with a KV-only catch-up that phase is the target's
        DECODE replay, whose event is handed over; a full draft forward replayed
        from its graphs publishes its own, and one run eagerly none: the barrier
        then waits on the whole forward."""
        target_runner = self.worker.target_worker.model_runner
        event = target_runner.war_fastpath_read_done_event
        target_runner.war_fastpath_read_done_event = None
        if self.draft_catch_up.kv_only:
            self.worker.war_fastpath_runner.war_fastpath_read_done_event = event

    def _feed_zero_step_tier(self, bs: int) -> None:
        """An adaptive tier at 0 draft steps counts the step as a verify of no
        drafts, as upstream's 0-step verify does (its EMA holds; it probes up)."""
        worker = self.worker
        if worker.adaptive_controller is not None and worker.speculative_num_steps == 0:
            worker.adaptive_controller.on_verify_complete([0] * bs, batch_size=bs)

    def on_verify_complete_cpu(self, num_correct_drafts_per_req: List[int]) -> None:
        num_steps = self._unverified_steps.popleft()
        for listener in self.verify_listeners:
            listener(num_steps, num_correct_drafts_per_req)

    def resume_speculation(self, batch: ScheduleBatch) -> None:
        """Before a speculative step: complete the draft input that KV-only plain
        steps left pending (DraftCatchUp.resume), and note the step's draft step
        count for its verify."""
        self.draft_catch_up.resume(batch)
        self._unverified_steps.append(self.worker.speculative_num_steps)
