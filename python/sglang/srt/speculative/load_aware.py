"""Plain decode steps of a load-aware speculative EAGLE worker (v1).

When the SpecPolicy (spec_policy.py) decides that a decode step does not
speculate, ``ScheduleBatch.prepare_for_decode`` prepares it exactly like a
decode step of a server without speculation (one new KV slot per request,
``seq_lens`` already counting the step's token, input = each request's pending
token, ``spec_info`` cleared) and ``EAGLEWorker.forward_batch_generation``
hands it to ``LoadAwarePlainDecode.forward``, which

1. runs the target exactly like a server without speculation: ForwardMode.DECODE,
   decode attention kernels, the DECODE CUDA graphs captured here, sampling
   through the target worker's normal ``forward_batch_generation`` (penalties,
   grammar masks, logprobs, sampling params); it also captures the target
   hidden state of the new token (FULL == LAST at one token per request; for
   EAGLE-3 the concatenated aux hidden states);
2. keeps the draft KV cache valid for the token just decoded: one draft-extend
   token per request (input = the sampled token, hidden = the target hidden
   state, written at the KV slot allocated for this step), through the same
   ``forward_draft_extend_after_decode`` / draft-extend CUDA graph a verify
   step uses with 0 accepted drafts (num_accept_tokens = 1, ragged padding);
3. installs the resulting fresh ``EagleDraftInput`` (bonus token = the sampled
   token, draft top-k and hidden state) for *all* requests of the batch, so
   speculation can resume at any step with undiminished acceptance.

The sampled tokens go through the scheduler's normal decode output path
(``batch.spec_step`` is False).

State after a plain step (what the next speculative step's draft
preprocessing assumes): per request ``seq_len = L + 1``, target and draft KV
valid for positions ``[0, L + 1)``, ``kv_committed_len == kv_allocated_len ==
seq_len`` (set by prepare_for_decode), the partial last page owned by the
request (``alloc_for_decode`` is page-aware), ``bonus_tokens`` = the sampled
token, whose KV is not written yet. This is the invariant a verify step
leaves, so page_size > 1 and topk > 1 (which copies the draft KV of the
prefix's partial page) work unchanged.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Optional, Tuple

import torch
from sglang.srt.layers.moe.utils import (
    speculative_moe_a2a_backend_context,
    speculative_moe_backend_context,
)
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.eagle_info import EagleDraftExtendInput
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.utils import get_available_gpu_memory, log_info_on_rank0

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.speculative.eagle_worker import EAGLEWorker

logger = logging.getLogger(__name__)


def check_load_aware_worker(worker: EAGLEWorker) -> None:
    """Refuse at startup what the plain step cannot serve (v1 and v2 workers)."""
    reason = load_aware_worker_unsupported_reason(worker)
    if reason is not None:
        raise ValueError(f"--speculative-disable-batch-threshold: {reason}.")


def one_token_accept_counts(
    max_bs: int, device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(num_correct_drafts = 0, num_accept_tokens = 1) per request of a plain
    step's draft extend, each [max_bs] int32: allocated once, sliced per step
    (no hot-path allocations), never modified in place."""
    return (
        torch.zeros((max_bs,), dtype=torch.int32, device=device),
        torch.ones((max_bs,), dtype=torch.int32, device=device),
    )


def load_aware_worker_unsupported_reason(worker: EAGLEWorker) -> Optional[str]:
    """Worker-level limits that server args cannot see (model architecture)."""
    target_model_runner = worker.target_worker.model_runner
    if getattr(target_model_runner, "mambaish_config", None) is not None:
        return (
            "hybrid (mamba / linear-attention) target models are not supported "
            "yet: plain steps would not update the mamba prefix-cache tracking"
        )
    if worker.speculative_algorithm not in (
        SpeculativeAlgorithm.EAGLE,
        SpeculativeAlgorithm.EAGLE3,
    ):
        return f"{worker.speculative_algorithm} is not supported yet"
    return None


class TargetDecodeGraphs:
    """The DECODE CUDA-graph family of a speculative target (v1 and v2 workers).

    Captured at startup with its own attention backend; ``active()`` routes one
    target forward to it. None-valued ``graph_runner`` (--disable-cuda-graph)
    makes that forward run eagerly.
    """

    def __init__(self, worker):
        # worker: EAGLEWorker or EAGLEWorkerV2 (target_worker, server_args,
        # device, gpu_id).
        self.worker = worker
        self.model_runner = worker.target_worker.model_runner
        self.graph_runner: Optional[CudaGraphRunner] = None
        if not worker.server_args.disable_cuda_graph:
            self.graph_runner = self._capture()

    def _capture(self) -> CudaGraphRunner:
        model_runner = self.model_runner
        tic = time.perf_counter()
        before_mem = get_available_gpu_memory(self.worker.device, self.worker.gpu_id)
        log_info_on_rank0(
            logger,
            "Capture target plain-decode cuda graphs (load-aware speculation) "
            f"begin. avail mem={before_mem:.2f} GB",
        )
        # A second init_cuda_graph_state on the shared backend would reallocate
        # buffers the verify graphs point to: build a separate backend instance
        # (the way upstream's adaptive runtime states do).
        backup_init_new_workspace = model_runner.init_new_workspace
        try:
            attn_backend = model_runner._get_attention_backend(init_new_workspace=True)
        finally:
            model_runner.init_new_workspace = backup_init_new_workspace
        graph_runner = CudaGraphRunner(
            model_runner, attn_backend=attn_backend, plain_decode=True
        )
        after_mem = get_available_gpu_memory(self.worker.device, self.worker.gpu_id)
        log_info_on_rank0(
            logger,
            "Capture target plain-decode cuda graphs end. "
            f"Time elapsed: {time.perf_counter() - tic:.2f} s. "
            f"bs={graph_runner.capture_bs}. "
            f"mem usage={(before_mem - after_mem):.2f} GB. "
            f"avail mem={after_mem:.2f} GB.",
        )
        return graph_runner

    @contextmanager
    def active(self) -> Iterator[None]:
        """Route the target forward to the DECODE graph family for one step.

        ModelRunner replays ``graph_runner`` whenever its ``can_run`` accepts
        the batch, which does not check the forward mode: the verify runner
        must not see a DECODE batch.
        """
        model_runner = self.model_runner
        verify_graph_runner = model_runner.graph_runner
        model_runner.graph_runner = self.graph_runner
        try:
            yield
        finally:
            model_runner.graph_runner = verify_graph_runner


class LoadAwarePlainDecode:
    """The plain-step path of an EAGLEWorker with load-aware speculation."""

    def __init__(self, worker: EAGLEWorker):
        check_load_aware_worker(worker)
        self.worker = worker
        self.target_decode_graphs = TargetDecodeGraphs(worker)
        self.target_graph_runner = self.target_decode_graphs.graph_runner
        if self.target_graph_runner is not None:
            self._check_draft_extend_graph_coverage()

        self._num_correct_drafts, self._num_accept_tokens = one_token_accept_counts(
            worker.req_to_token_pool.size, worker.device
        )

    def _check_draft_extend_graph_coverage(self) -> None:
        """Plain steps run at every batch size; so does their draft catch-up."""
        draft_extend_runner = self.worker.cuda_graph_runner_for_draft_extend
        if draft_extend_runner is None:
            logger.warning(
                "Load-aware speculation: no draft-extend cuda graph; the draft "
                "catch-up of plain steps runs eagerly."
            )
            return
        if draft_extend_runner.max_bs < self.target_graph_runner.max_bs:
            logger.warning(
                "Load-aware speculation: draft-extend cuda graphs cover bs <= "
                f"{draft_extend_runner.max_bs} only, target plain-decode graphs "
                f"bs <= {self.target_graph_runner.max_bs}; the draft catch-up "
                "runs eagerly above."
            )

    def forward(self, batch: ScheduleBatch) -> GenerationBatchResult:
        """Run one plain decode step; installs the next draft input on batch."""
        assert batch.forward_mode.is_decode() and not batch.spec_step
        assert batch.spec_info is None, "prepare_for_decode clears spec_info"
        worker = self.worker

        # 1. Target: the decode forward and sampling of a server without
        # speculation, plus the hidden state of the new token for the draft.
        model_worker_batch = batch.get_model_worker_batch()
        model_worker_batch.capture_hidden_mode = CaptureHiddenMode.FULL
        with self.target_decode_graphs.active():
            result = worker.target_worker.forward_batch_generation(model_worker_batch)
        result.num_correct_drafts = 0

        # 2. Draft KV catch-up at the slots allocated for this step, and the
        # next draft input (for all requests, finished ones included).
        with (
            worker.draft_tp_context(worker.draft_model_runner.tp_group),
            speculative_moe_backend_context(),
            speculative_moe_a2a_backend_context(),
        ):
            batch.spec_info = self.draft_extend_input(
                batch,
                hidden_states=result.logits_output.hidden_states,
                next_token_ids=result.next_token_ids,
            )
            batch.spec_info = worker.forward_draft_extend_after_decode(batch)
        return result

    def draft_extend_input(
        self,
        batch: ScheduleBatch,
        hidden_states: Optional[torch.Tensor],
        next_token_ids: torch.Tensor,
    ) -> EagleDraftExtendInput:
        """Draft-extend input of a plain step: one accepted token per request.

        The draft model at position p consumes (token at p + 1, target hidden
        state at p): here p = seq_len - 1, the position the target just
        decoded, and the token at p + 1 is the one it sampled.
        """
        bs = batch.batch_size()
        return EagleDraftExtendInput(
            # [bs, target hidden size (x num aux layers for EAGLE-3)]
            hidden_states=hidden_states,
            num_correct_drafts=self._num_correct_drafts[:bs],  # [bs], all 0
            num_accept_tokens=self._num_accept_tokens[:bs],  # [bs], all 1
            num_accept_tokens_cpu=[1] * bs,
            input_ids=next_token_ids,  # [bs]
            seq_lens=batch.seq_lens,  # [bs], counts the decoded token
            seq_lens_cpu=batch.seq_lens_cpu,
            req_pool_indices=batch.req_pool_indices,
        )
