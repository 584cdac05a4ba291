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
   state, written at the KV slot allocated for this step), run by
   ``DraftCatchUp`` (load_aware_draft.py) with decode attention and its own
   CUDA graphs;
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
from typing import TYPE_CHECKING, Iterator, Optional

from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.load_aware_draft import (
    DraftCatchUp,
    fresh_attention_backend,
)
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
        attn_backend = fresh_attention_backend(model_runner, init_new_workspace=True)
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
        self.draft_catch_up = DraftCatchUp(
            worker,
            worker.draft_model_runner,
            worker.cuda_graph_runner_for_draft_extend,
            worker.topk,
            worker.draft_tp_context,
        )

    def forward(self, batch: ScheduleBatch) -> GenerationBatchResult:
        """Run one plain decode step; installs the next draft input on batch."""
        assert batch.forward_mode.is_decode() and not batch.spec_step
        assert batch.spec_info is None, "prepare_for_decode clears spec_info"

        # 1. Target: the decode forward and sampling of a server without
        # speculation, plus the hidden state of the new token for the draft.
        model_worker_batch = batch.get_model_worker_batch()
        model_worker_batch.capture_hidden_mode = CaptureHiddenMode.FULL
        with self.target_decode_graphs.active():
            result = self.worker.target_worker.forward_batch_generation(
                model_worker_batch
            )
        result.num_correct_drafts = 0

        # 2. Draft KV catch-up at the slots allocated for this step, and the
        # next draft input (for all requests, finished ones included).
        topk_p, topk_index, hidden_states = self.draft_catch_up.run(
            model_worker_batch,
            result.logits_output.hidden_states,
            result.next_token_ids,
        )
        batch.spec_info = EagleDraftInput(
            bonus_tokens=result.next_token_ids,  # [bs]
            hidden_states=hidden_states,  # [bs, draft hidden size]
            topk_p=topk_p,  # [bs, topk]
            topk_index=topk_index,  # [bs, topk]
            capture_hidden_mode=CaptureHiddenMode.LAST,
        )
        return result

    def resume_speculation(self, batch: ScheduleBatch) -> None:
        """Before a speculative step: complete the draft input that KV-only plain
        steps left pending (DraftCatchUp.resume)."""
        if self.draft_catch_up.resume_pending:
            self.draft_catch_up.resume(batch.get_model_worker_batch(), batch.spec_info)
