"""The draft half of a load-aware plain decode step (v1 and v2 EAGLE workers).

A plain step decodes one token per request on the target; the draft model must
then write its KV for that position, so that speculation can resume at any step
with undiminished acceptance. ``DraftCatchUp`` runs that as a one-token draft
extend per request and returns the next draft input (top-k and hidden state of
the draft at the new token).

A one-layer EAGLE-3 head writes that KV alone (``write_kv_cache_only``: embedding,
fc, norms and the K/V projections, no attention, MLP or LM head). Its top-k and
hidden state are only needed by a speculative step, so plain steps then leave the
next draft input pending (top-k probability -1) and ``DraftCatchUp.resume`` runs
the full one-token forward once, before the first speculative step after them.

A draft extend of one token per request is a decode: its attention runs through
``DecodeAttentionForOneTokenExtend``, which hands the extend to the decode
kernels of a separate attention-backend instance. The extend kernels would
otherwise tile a single query row per request over the whole prefix (measured on
an H200, llama8b draft layer, 64 requests of ~800 tokens, triton: 0.63 ms per
step for the extend kernel against ~0.08 ms for the decode kernels).
"""

from __future__ import annotations

import copy
import logging
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, ContextManager, Iterator, Optional, Tuple

import torch
from sglang.srt.environ import envs
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.moe.utils import (
    speculative_moe_a2a_backend_context,
    speculative_moe_backend_context,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.utils import get_available_gpu_memory, log_info_on_rank0
from sglang.srt.utils.common import fast_topk

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ModelWorkerBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def fresh_attention_backend(
    model_runner: ModelRunner, init_new_workspace: bool
) -> AttentionBackend:
    """A separate instance of the model runner's attention backend.

    A second ``init_cuda_graph_state`` on a backend in use would reallocate the
    buffers its captured graphs point to (the way upstream's adaptive runtime
    states build theirs).
    """
    backup_init_new_workspace = model_runner.init_new_workspace
    try:
        return model_runner._get_attention_backend(
            init_new_workspace=init_new_workspace
        )
    finally:
        model_runner.init_new_workspace = backup_init_new_workspace


class DecodeAttentionForOneTokenExtend(AttentionBackend):
    """Runs the attention of a draft extend with one token per request as a decode.

    The decode metadata (``seq_lens`` counting the new token, its KV slot in
    ``out_cache_loc``) is what such an extend carries; the decode backend sees
    forward mode DECODE and no spec_info (the draft model still reads its
    hidden-state input from the forward batch's spec_info).
    """

    def __init__(self, decode_backend: AttentionBackend):
        super().__init__()
        self.decode_backend = decode_backend

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        as_decode = copy.copy(forward_batch)
        as_decode.forward_mode = ForwardMode.DECODE
        as_decode.spec_info = None
        self.decode_backend.init_forward_metadata(as_decode)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.decode_backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs,
        num_tokens,
        req_pool_indices,
        seq_lens,
        encoder_lens,
        forward_mode,
        spec_info,
    ):
        assert num_tokens == bs, "one token per request"
        self.decode_backend.init_forward_metadata_capture_cuda_graph(
            bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
            ForwardMode.DECODE, None,
        )  # fmt: skip

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs,
        req_pool_indices,
        seq_lens,
        seq_lens_sum,
        encoder_lens,
        forward_mode,
        spec_info,
        seq_lens_cpu,
    ):
        self.decode_backend.init_forward_metadata_replay_cuda_graph(
            bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
            ForwardMode.DECODE, None, seq_lens_cpu,
        )  # fmt: skip

    def get_cuda_graph_seq_len_fill_value(self):
        return self.decode_backend.get_cuda_graph_seq_len_fill_value()

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self.decode_backend.forward_decode(
            q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs
        )


def plain_steps_write_kv_only(draft_model: torch.nn.Module) -> bool:
    if envs.SGLANG_LOAD_AWARE_FULL_DRAFT_CATCH_UP.get():
        return False
    can_write = getattr(draft_model, "can_write_kv_cache_only", None)
    return can_write is not None and can_write()


class DraftCatchUp:
    """One draft-extend token per request after a plain step, with its own CUDA
    graphs (one token per request, every captured batch size); or, where the
    draft model can (module docstring), its KV write only, completed by
    ``resume`` when speculation resumes.

    draft_worker: what the draft-extend graph runner of this worker type is
    built from (the v1 EAGLEWorker, or the v2 EagleDraftWorker);
    spec_graph_runner: that worker's speculative draft-extend graph runner, whose
    class is reused (None: the backend has none, the catch-up runs eagerly);
    draft_tp_context: the worker's draft TP context (DP attention).
    """

    def __init__(
        self,
        draft_worker,
        draft_runner: ModelRunner,
        spec_graph_runner,
        topk: int,
        draft_tp_context: Callable[..., ContextManager],
    ):
        self.draft_runner = draft_runner
        self.topk = topk
        self.draft_tp_context = draft_tp_context
        # (num_correct_drafts = 0, num_accept_tokens = 1) per request: allocated
        # once, sliced per step, never modified in place.
        max_bs = draft_runner.req_to_token_pool.size
        device = draft_runner.device
        self.num_correct_drafts = torch.zeros(
            (max_bs,), dtype=torch.int32, device=device
        )
        self.num_accept_tokens = torch.ones((max_bs,), dtype=torch.int32, device=device)
        self.kv_only = plain_steps_write_kv_only(draft_runner.model)
        # Whether a KV-only step may have left draft inputs pending.
        self.resume_pending = False
        self.attn_backend = DecodeAttentionForOneTokenExtend(
            # Shares the flashinfer workspace: plain steps run their forwards in
            # sequence on one stream, each planning right before it runs.
            fresh_attention_backend(draft_runner, init_new_workspace=False)
        )
        self.graph_runner = None
        if self.kv_only:
            # The top-k a KV-only step leaves pending: allocated once, sliced per
            # step, never modified in place.
            self.pending_topk_p = torch.full((max_bs, topk), -1.0, device=device)
            self.pending_topk_index = torch.zeros(
                (max_bs, topk), dtype=torch.int64, device=device
            )
            log_info_on_rank0(
                logger,
                "Load-aware speculation: plain steps write the draft KV only; the "
                "full draft forward runs once when speculation resumes.",
            )
            return
        if draft_runner.server_args.disable_cuda_graph:
            return
        if spec_graph_runner is None:
            logger.warning(
                "Load-aware speculation: no draft-extend cuda graph for this "
                "attention backend; the draft catch-up of plain steps runs eagerly."
            )
            return
        with self.draft_context():
            self.graph_runner = self._capture(draft_worker, type(spec_graph_runner))

    @contextmanager
    def draft_context(self) -> Iterator[None]:
        """What the draft model's forwards run under (as in the EAGLE workers)."""
        with (
            self.draft_tp_context(self.draft_runner.tp_group),
            speculative_moe_backend_context(),
            speculative_moe_a2a_backend_context(),
        ):
            yield

    def _capture(self, draft_worker, graph_runner_cls):
        device, gpu_id = self.draft_runner.device, self.draft_runner.gpu_id
        tic = time.perf_counter()
        before_mem = get_available_gpu_memory(device, gpu_id)
        graph_runner = graph_runner_cls(
            draft_worker,
            draft_extend_attn_backend=self.attn_backend,
            speculative_num_steps=0,  # 1 token per request
        )
        after_mem = get_available_gpu_memory(device, gpu_id)
        log_info_on_rank0(
            logger,
            "Capture draft catch-up cuda graphs for plain steps (1 token per "
            f"request, decode attention) end. Time elapsed: "
            f"{time.perf_counter() - tic:.2f} s. bs={graph_runner.capture_bs}. "
            f"mem usage={(before_mem - after_mem):.2f} GB.",
        )
        return graph_runner

    def run(
        self,
        batch: ModelWorkerBatch,
        hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Write the draft KV of the position the target just decoded.

        batch: the plain step's batch (``seq_lens`` counting the decoded token,
        ``out_cache_loc`` its slots); modified. At p = seq_len - 1 the draft
        consumes (token at p + 1 = the sampled one, target hidden state at p).
        hidden_states: [bs, target hidden size (x aux layers for EAGLE-3)];
        next_token_ids: [bs].
        Returns the draft's (topk_p, topk_index, hidden_states) at the new token;
        KV-only: the pending top-k and the draft's hidden-state input there.
        """
        if not self.kv_only:
            return self._forward(batch, hidden_states, next_token_ids)
        bs = len(batch.seq_lens)
        with self.draft_context():
            hidden_states = self.draft_runner.model.write_kv_cache_only(
                next_token_ids,
                (batch.seq_lens - 1).to(torch.int64),
                hidden_states,
                batch.out_cache_loc,
                self.draft_runner.token_to_kv_pool,
            )
        self.resume_pending = True
        return self.pending_topk_p[:bs], self.pending_topk_index[:bs], hidden_states

    def resume(self, batch: ModelWorkerBatch, draft_input: EagleDraftInput) -> bool:
        """Complete the draft input of a speculative step after KV-only plain steps.

        The rows a plain step left pending get the draft's top-k and hidden state
        from the full one-token forward at their last position (its KV write
        repeats the plain step's); the other rows (prefilled since) keep theirs
        and write to the padding slot 0.
        batch: the speculative step's batch (not modified); draft_input: its
        spec_info (updated). Returns whether the forward ran.
        """
        if not self.resume_pending:
            return False
        self.resume_pending = False
        pending = draft_input.topk_p[:, 0] < 0  # [bs]
        positions = (batch.seq_lens - 1).to(torch.int64)
        slots = self.draft_runner.req_to_token_pool.req_to_token[
            batch.req_pool_indices, positions
        ]
        catch_up_batch = copy.copy(batch)
        catch_up_batch.out_cache_loc = torch.where(pending, slots, 0).to(torch.int64)
        topk_p, topk_index, hidden_states = self._forward(
            catch_up_batch, draft_input.hidden_states, draft_input.bonus_tokens
        )
        rows = pending[:, None]
        draft_input.topk_p = torch.where(rows, topk_p, draft_input.topk_p)
        draft_input.topk_index = torch.where(rows, topk_index, draft_input.topk_index)
        draft_input.hidden_states = torch.where(
            rows, hidden_states, draft_input.hidden_states
        )
        return True

    def _forward(
        self,
        batch: ModelWorkerBatch,
        hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The full one-token draft forward of ``run``: (topk_p, topk_index, hidden)."""
        bs = len(batch.seq_lens)
        # prepare_for_extend_to_fill_draft_kvcache extends from seq_lens.
        batch.seq_lens = batch.seq_lens - 1
        batch.seq_lens_cpu = batch.seq_lens_cpu - 1
        batch.seq_lens_sum -= bs
        # The draft's logprobs are never used (as in _draft_extend_for_prefill).
        batch.return_logprob = False
        extend_input = EagleDraftInput(
            hidden_states=hidden_states,
            num_tokens_per_req=1,
            num_tokens_for_logprob_per_req=1,
        )
        forward_batch = extend_input.prepare_for_extend_to_fill_draft_kvcache(
            batch, next_token_ids, 1, self.draft_runner, self.graph_runner
        )
        forward_batch.spec_info.num_correct_drafts = self.num_correct_drafts[:bs]
        forward_batch.spec_info.num_accept_tokens = self.num_accept_tokens[:bs]

        with self.draft_context():
            if self.graph_runner is not None and self.graph_runner.can_run(
                forward_batch
            ):
                out = self.graph_runner.replay(forward_batch)
                return out.topk_p, out.topk_index, out.hidden_states

            # (Eagerly, prepare_for_extend_to_fill_draft_kvcache has also planned
            # an extend on the runner's own backend; it is not used.)
            self.attn_backend.init_forward_metadata(forward_batch)
            forward_batch.attn_backend = self.attn_backend
            logits_output = self.draft_runner.forward(
                forward_batch, skip_attn_backend_init=True
            ).logits_output
        probs = torch.softmax(logits_output.next_token_logits, dim=-1)
        topk_p, topk_index = fast_topk(probs, self.topk, dim=-1)
        return topk_p, topk_index, logits_output.hidden_states
