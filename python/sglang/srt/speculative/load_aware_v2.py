"""Plain decode steps of a load-aware speculative EAGLE worker, spec v2 (overlap).

The same capability as load_aware.py (v1), for EAGLEWorkerV2 under the overlap
scheduler, chains and draft trees (topk > 1, page size 1: spec_v2_trees.py):
the SpecPolicy (spec_policy.py) decides once per decode step,
in ``ScheduleBatch.prepare_for_decode``, whether the step speculates
(``batch.spec_step``); a plain step runs the target exactly like a decode step
of a non-speculative overlap server and keeps the draft KV valid with a
one-token draft extend (``DraftCatchUp``, load_aware_draft.py).

What overlap changes, and how it is handled:

* **When the decision is taken.** The scheduler prepares step n+1 while step n
  runs. The decision is a pure function of the running batch size at
  preparation time (rank-identical: every TP rank holds the same batch) and is
  taken exactly once per decode step (``prepare_for_decode`` is the only
  caller of ``SpecPolicy.decide``). The worker only reads
  ``ModelWorkerBatch.spec_step``.

* **Inputs come from the future map.** The pending token of each request
  (``bonus_tokens``) is produced by step n on the forward stream and reaches
  step n+1 only through ``FutureMap.resolve_future`` (forward stream). A plain
  step therefore keeps ``batch.spec_info`` (the EagleDraftInput carrying the
  future indices) through preparation; the worker reads the resolved
  ``bonus_tokens`` as input ids and clears ``spec_info`` only for the target
  forward (attention backends must not take their draft paths in DECODE).
  The worker returns a full next EagleDraftInput (bonus token = sampled token,
  draft top-k and hidden state, ``new_seq_lens``) for every request, which
  ``FutureMap.store_to_map`` stores exactly like a verify step's: the future
  map is the same for both modes, and any step may follow any other.

* **KV allocation** (``prepare_plain_decode_v2``): one slot per request, at
  position ``seq_len`` (the exact length after waiting for step n's verify),
  added to the request's allocation only when it does not own that slot yet
  (a speculative step over-allocates ``2 * get_alloc_len_per_decode()``
  beyond ``kv_committed_len``, so after one the slot is usually owned
  already). Grows the allocation through the same page-aware
  ``alloc_decode_kv_v2`` as a speculative step (``alloc_for_decode`` would
  overwrite and leak over-allocated slots). ``kv_committed_len += 1`` as in a
  non-speculative overlap server; the reservation check
  (``new_tokens_required_next_decode``) is unchanged and keeps covering a
  speculative step, which needs at least as much.

* **Streams.** All plain-step GPU work runs on the forward stream; the plan
  stream is not used. Speculative steps order their plan-stream work after
  the forward stream through ``_draft_done_event`` (recorded after each
  draft) and make the forward stream wait for the plan stream before using
  its results, so work of a plain step before or after a speculative step is
  ordered by the forward stream itself. A plain step still records a fresh
  ``_draft_done_event`` at its end, so that the event the plan stream may
  wait on is never older than the latest forward-stream work.

* **Output path.** A plain step returns one sampled token per request without
  ``accept_lens``; the scheduler's output processor takes the
  non-speculative path for it (``batch.spec_step`` is False): no
  ``_resolve_spec_overlap_tokens``, no accept-length statistics, no bonus-slot
  correction of ``kv_committed_len``.

State after a plain step: ``seq_len = L + 1``, target and draft KV valid for
``[0, L + 1)``, the pending token = the sampled one, whose KV is not written
yet, and the draft's ``topk`` proposals for the token after it (``[bs, topk]``,
as a draft extend after verify hands them): the invariant a verify step leaves
(for trees, after moving the accepted path's KV to the front), so the next
step may speculate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List

import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.eagle_info_v2 import (
    accumulate_delayed_penalties,
    alloc_decode_kv_v2,
)
from sglang.srt.speculative.load_aware import (
    TargetDecodeGraphs,
    check_load_aware_worker,
)
from sglang.srt.speculative.load_aware_draft import DraftCatchUp

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ModelWorkerBatch, ScheduleBatch
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2


# ---------------------------------------------------------------------------
# Scheduler side: preparation of a plain step (called by
# ScheduleBatch.prepare_for_decode once the policy has decided).
# ---------------------------------------------------------------------------


def plain_decode_kv_lens(
    kv_allocated_lens: List[int], seq_lens: List[int]
) -> List[int]:
    """Per-request KV allocation after preparing a plain step. Pure.

    The step writes the KV of position ``seq_len``: a request must own at
    least ``seq_len + 1`` slots; slots it already owns (over-allocated by a
    speculative step) are kept.
    """
    return [max(cur, n + 1) for cur, n in zip(kv_allocated_lens, seq_lens)]


def prepare_plain_decode_v2(batch: ScheduleBatch) -> None:
    """Prepare a plain decode step of a spec-v2 batch (runs on the schedule stream).

    Leaves ``batch.spec_info`` in place (its future indices deliver the pending
    tokens to the worker); ``batch.input_ids`` is set by the worker.
    """
    batch.maybe_evict_swa()
    # seq_lens is the previous step's future value: wait for its verify.
    batch.maybe_wait_verify_done()
    seq_lens_cpu = batch.seq_lens.cpu()
    bs = batch.batch_size()

    accumulate_delayed_penalties(batch)  # as in a speculative v2 step

    cur_kv_lens = [req.kv_allocated_len for req in batch.reqs]
    nxt_kv_lens = plain_decode_kv_lens(cur_kv_lens, seq_lens_cpu.tolist())
    for req, nxt in zip(batch.reqs, nxt_kv_lens):
        req.kv_allocated_len = nxt
        req.decode_batch_idx += 1
        # Like a non-speculative decode step: the step's token is committed
        # here, and its result does not correct it.
        req.kv_committed_len += 1
    alloc_decode_kv_v2(
        batch,
        cur_kv_lens,
        nxt_kv_lens,
        sum(nxt - cur for cur, nxt in zip(cur_kv_lens, nxt_kv_lens)),
    )

    # The KV slot of each request's position seq_len, written by this step.
    batch.out_cache_loc = batch.req_to_token_pool.req_to_token[
        batch.req_pool_indices, batch.seq_lens.to(torch.int64)
    ].to(torch.int64)

    # Overlap: no in-place updates (the previous step may still read them).
    batch.seq_lens = batch.seq_lens + 1
    batch.seq_lens_cpu = seq_lens_cpu + 1
    batch.orig_seq_lens = batch.orig_seq_lens + 1
    batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
    assert len(batch.seq_lens_cpu) == bs


# ---------------------------------------------------------------------------
# Worker side.
# ---------------------------------------------------------------------------


class LoadAwarePlainDecodeV2:
    """The plain-step path of an EAGLEWorkerV2 with load-aware speculation."""

    def __init__(self, worker: EAGLEWorkerV2):
        check_load_aware_worker(worker)
        self.worker = worker
        self.target_decode_graphs = TargetDecodeGraphs(worker)
        draft_worker = worker.draft_worker
        self.draft_catch_up = DraftCatchUp(
            draft_worker,
            draft_worker.draft_runner,
            draft_worker.cuda_graph_runner_for_draft_extend,
            draft_worker.topk,
            draft_worker.draft_tp_context,
        )

    def forward(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        """Run one plain decode step (forward stream); returns the target result
        with ``next_draft_input`` set for the future map."""
        assert batch.forward_mode.is_decode() and not batch.spec_step
        worker = self.worker
        device_module = torch.get_device_module(worker.device)
        draft_input: EagleDraftInput = batch.spec_info  # resolved by the future map
        # Allocated on the schedule stream, used on this one (as in verify()).
        batch.seq_lens.record_stream(device_module.current_stream())
        new_seq_lens = batch.seq_lens  # [bs], counts this step's token

        # 1. Target: the decode forward and sampling of a server without
        # speculation, plus the hidden state of the new token for the draft.
        batch.input_ids = draft_input.bonus_tokens.to(torch.int64)  # [bs]
        batch.spec_info = None
        batch.capture_hidden_mode = CaptureHiddenMode.FULL
        with self.target_decode_graphs.active():
            result = worker.target_worker.forward_batch_generation(batch)
        assert result.delay_sample_func is None

        # 2. Draft KV catch-up at the slot of this step, and the next draft input.
        topk_p, topk_index, hidden_states = self.draft_catch_up.run(
            batch, result.logits_output.hidden_states, result.next_token_ids
        )
        result.next_draft_input = EagleDraftInput(
            topk_p=topk_p,  # [bs, topk]
            topk_index=topk_index,  # [bs, topk]
            hidden_states=hidden_states,  # [bs, draft hidden size]
            bonus_tokens=result.next_token_ids,  # [bs]
            new_seq_lens=new_seq_lens,  # [bs]
        )

        # Keep the event the plan stream may wait on current (module docstring).
        if worker.plan_stream:
            worker._draft_done_event = device_module.Event()
            worker._draft_done_event.record()
        return result

    def resume_speculation(self, batch: ModelWorkerBatch) -> None:
        """Before a speculative step (forward stream): complete the draft input
        that KV-only plain steps left pending (DraftCatchUp.resume).

        Its forward shares the flashinfer workspace with the draft's backends:
        plan-stream work of this step waits for it.
        """
        worker = self.worker
        if self.draft_catch_up.resume(batch, batch.spec_info) and worker.plan_stream:
            device_module = torch.get_device_module(worker.device)
            worker.plan_stream.wait_stream(device_module.current_stream())
