"""Attention for speculative decoding on the torch-native backend (CPU engines of
:mod:`sglang.test.cpu_spec_engine`, which imports this module once the sgl_kernel
stub is in place).

Upstream's TorchNativeAttnBackend runs prefill, decode and the draft extend; the
rest of speculative decoding runs only on its GPU backends and on intel_amx (AMX
kernels). Added here, with SDPA per request:

* TARGET_VERIFY: the committed prefix plus the draft tokens, a chain causally, a
  tree through its QLEN_ONLY mask (``spec_info.custom_mask``, the CPU layout);
* the multi-step draft decode: per draft step, each (request, branch) row attends
  to the KV slots that upstream's ``generate_draft_decode_kv_indices`` lists for
  the Triton backend (that kernel, in Triton's interpreter);
* DraftBackendFactory entries for torch_native (it has none upstream).

Every other mode and layer kind is upstream's TorchNativeAttnBackend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Tuple

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang.srt.layers.attention.attention_registry import register_attention_backend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.speculative import draft_utils
from sglang.srt.utils import next_power_of_2

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.model_runner import ModelRunner


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """q [T, H, D], k and v [L, KH, D], mask [T, L] (True: attend) -> [T, H, Dv]."""
    out = scaled_dot_product_attention(
        q.movedim(0, 1).unsqueeze(0),
        k.movedim(0, 1).unsqueeze(0).to(q.dtype),
        v.movedim(0, 1).unsqueeze(0).to(q.dtype),
        attn_mask=mask,
        enable_gqa=q.shape[1] != k.shape[1],
        scale=scale,
    )
    return out.squeeze(0).movedim(0, 1)


def is_causal_self_attention(
    layer: RadixAttention, forward_batch: ForwardBatch
) -> bool:
    """The layers the speculative modes here handle (upstream's cover the rest)."""
    sliding = layer.sliding_window_size is not None and layer.sliding_window_size > -1
    return not (
        layer.is_cross_attention
        or forward_batch.encoder_lens is not None
        or sliding
        or layer.logit_cap
    )


class CpuSpecAttnBackend(TorchNativeAttnBackend):
    def __init__(self, model_runner: ModelRunner):
        super().__init__(model_runner)
        # Set by CpuMultiStepDraftBackend on its per-step backends: the KV slots
        # of each (request, branch) row of a draft decode step.
        self.draft_kv_rows: Optional[List[torch.Tensor]] = None

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        verify = forward_batch.forward_mode.is_target_verify()
        if not verify or not is_causal_self_attention(layer, forward_batch):
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        self._save_kv(layer, forward_batch, k, v, save_kv_cache)
        k_cache, v_cache = self._kv_cache(layer)
        heads, head_dim = layer.tp_q_head_num, layer.qk_head_dim
        q = q.reshape(-1, heads, head_dim)
        if k is None:
            k, v = (
                k_cache[forward_batch.out_cache_loc],
                v_cache[forward_batch.out_cache_loc],
            )
        k = k.reshape(q.shape[0], layer.tp_k_head_num, head_dim)
        v = v.reshape(q.shape[0], layer.tp_v_head_num, layer.v_head_dim)
        out = q.new_empty((q.shape[0], heads, layer.v_head_dim))

        n = int(forward_batch.spec_info.draft_token_num)
        tree_masks = self._tree_masks(forward_batch, n)
        req_to_token = self.req_to_token_pool.req_to_token
        prefix_lens = forward_batch.seq_lens.tolist()
        start = 0
        for i, req in enumerate(forward_batch.req_pool_indices.tolist()):
            prefix_len, end = prefix_lens[i], start + n
            prefix = req_to_token[req, :prefix_len]
            mask = torch.ones((n, prefix_len + n), dtype=torch.bool)
            mask[:, prefix_len:] = (
                tree_masks[i] if tree_masks is not None else mask[:, prefix_len:].tril()
            )
            out[start:end] = attend(
                q[start:end],
                torch.cat([k_cache[prefix], k[start:end]]),
                torch.cat([v_cache[prefix], v[start:end]]),
                mask,
                layer.scaling,
            )
            start = end
        return out.reshape(q.shape[0], heads * layer.v_head_dim)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        rows = self.draft_kv_rows
        if rows is None or not is_causal_self_attention(layer, forward_batch):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        self._save_kv(layer, forward_batch, k, v, save_kv_cache)
        k_cache, v_cache = self._kv_cache(layer)
        heads = layer.tp_q_head_num
        q = q.reshape(-1, heads, layer.qk_head_dim)
        assert q.shape[0] == len(rows), (q.shape, len(rows))
        out = q.new_empty((q.shape[0], heads, layer.v_head_dim))
        for r, slots in enumerate(rows):
            out[r : r + 1] = attend(
                q[r : r + 1], k_cache[slots], v_cache[slots], None, layer.scaling
            )
        return out.reshape(q.shape[0], heads * layer.v_head_dim)

    def _save_kv(self, layer, forward_batch, k, v, save_kv_cache: bool) -> None:
        if save_kv_cache and k is not None and v is not None:
            loc = KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc)
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)

    def _kv_cache(self, layer) -> Tuple[torch.Tensor, torch.Tensor]:
        pool = self.token_to_kv_pool
        return pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(
            layer.layer_id
        )

    @staticmethod
    def _tree_masks(forward_batch: ForwardBatch, n: int) -> Optional[torch.Tensor]:
        """[bs, n, n]: which draft tokens of a tree each one attends to (None: a
        chain, causal)."""
        spec_info = forward_batch.spec_info
        if spec_info.tree_topk == 1 or spec_info.custom_mask is None:
            return None
        # QLEN_ONLY (default_tree_mask_mode on CPU): n x n per request.
        bs = forward_batch.batch_size
        return spec_info.custom_mask[: bs * n * n].view(bs, n, n).bool()


class CpuMultiStepDraftBackend:
    """The multi-step draft decode (one CpuSpecAttnBackend per step but the last),
    laid out as TritonMultiStepDraftBackend lays it out."""

    needs_cpu_seq_lens = False

    def __init__(
        self, model_runner: ModelRunner, topk: int, speculative_num_steps: int
    ):
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.page_size = model_runner.server_args.page_size
        self.attn_backends = [
            CpuSpecAttnBackend(model_runner) for _ in range(speculative_num_steps - 1)
        ]

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        rows_per_step = self._draft_kv_rows(forward_batch)
        for backend, rows in zip(self.attn_backends, rows_per_step):
            backend.init_forward_metadata(forward_batch)
            backend.draft_kv_rows = rows

    def _draft_kv_rows(self, forward_batch: ForwardBatch) -> List[List[torch.Tensor]]:
        """Per step, the KV slots of each (request, branch) row, from upstream's
        generate_draft_decode_kv_indices (interpreted in the engine)."""
        from sglang.kernels.ops.speculative.cache_locs import (
            generate_draft_decode_kv_indices,
        )

        topk, num_steps = self.topk, self.speculative_num_steps
        num_seqs = forward_batch.batch_size
        num_rows = num_seqs * topk
        seq_lens_sum = int(forward_batch.seq_lens.sum())
        kv_indices = torch.empty(
            (num_steps, topk * (seq_lens_sum + num_seqs * num_steps)), dtype=torch.int64
        )
        kv_indptr = torch.zeros((num_steps, num_rows + 1), dtype=torch.int32)
        generate_draft_decode_kv_indices[(num_steps, num_seqs, topk)](
            forward_batch.req_pool_indices,
            self.req_to_token,
            forward_batch.seq_lens,
            kv_indices,
            kv_indptr,
            forward_batch.positions,
            self.req_to_token.shape[1],
            kv_indices.shape[1],
            kv_indptr.shape[1],
            next_power_of_2(num_seqs),
            next_power_of_2(num_steps),
            next_power_of_2(num_rows),
            self.page_size,
        )
        bounds = kv_indptr.tolist()
        return [
            [
                kv_indices[step, bounds[step][r] : bounds[step][r + 1]]
                for r in range(num_rows)
            ]
            for step in range(num_steps - 1)
        ]


def _draft_backend_name(factory: draft_utils.DraftBackendFactory, phase: str) -> str:
    """The backend DraftBackendFactory._create_backend would pick."""
    server_args = factory.server_args
    return (
        factory.draft_attn_backend
        or getattr(server_args, f"{phase}_attention_backend")
        or server_args.attention_backend
    )


def register() -> None:
    """torch_native serves the speculative modes, in this process."""
    register_attention_backend("torch_native")(CpuSpecAttnBackend)

    factory = draft_utils.DraftBackendFactory
    create_decode_backend = factory.create_decode_backend
    create_draft_extend_backend = factory.create_draft_extend_backend

    def create_cpu_decode_backend(self):
        if (
            self.speculative_num_steps <= 1
            or _draft_backend_name(self, "decode") != "torch_native"
        ):
            return create_decode_backend(self)
        return CpuMultiStepDraftBackend(
            self.draft_model_runner, self.topk, self.speculative_num_steps
        )

    def create_cpu_draft_extend_backend(self):
        if _draft_backend_name(self, "prefill") != "torch_native":
            return create_draft_extend_backend(self)
        from sglang.srt.layers.attention.attention_registry import (
            attn_backend_wrapper_for_draft_extend,
        )

        backend = CpuSpecAttnBackend(self.draft_model_runner)
        return attn_backend_wrapper_for_draft_extend(self.draft_model_runner, backend)

    factory.create_decode_backend = create_cpu_decode_backend
    factory.create_draft_extend_backend = create_cpu_draft_extend_backend
