"""Draft trees (``--speculative-eagle-topk > 1``) on the spec-v2 overlap worker.

Backported from upstream 0.5.13 at page size 1. A verify step of a tree scores
``num_draft_tokens`` nodes per request, written to the KV slots
``[seq_len, seq_len + num_draft_tokens)`` in tree-node order; the accepted path
(``accept_index``: ``[bs, num_steps + 1]`` global node indices, -1 padded) is in
general not a prefix of it. Everything after verify (bonus token, draft extend,
the scheduler's output slicing, the next step's KV reads) assumes the chain
layout of topk 1: ``num_steps + 1`` tokens per request, the accepted ones first,
at positions ``[seq_len, seq_len + accept_len)``. So after verify the worker moves
the accepted path's target KV to those positions and gathers the node-indexed
tensors (``predict``, target hidden states) of the path into that layout
(``gather_accept_path``). The draft extend then runs over ``num_steps + 1``
tokens per request, as for topk 1, not over the whole tree: upstream 0.5.13
extends all ``num_draft_tokens``; at topk 4 with 16 draft tokens its draft-extend
CUDA graphs took 6.4 GB (Llama-3.1-8B shapes, batch up to 256) and the server
ran out of memory at batch 64 with ``--mem-fraction-static 0.8``.

Torch and triton on any device: the CPU tests run the kernels in triton's
interpreter.
"""

from __future__ import annotations

from typing import Optional, Protocol, Tuple

import torch

from sglang.srt.utils.common import next_power_of_2


class KVCache(Protocol):
    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None: ...


class VerifiedBatch(Protocol):
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    out_cache_loc: torch.Tensor  # the verify step's slots, node-indexed


def gather_accept_path(x: torch.Tensor, accept_index: torch.Tensor) -> torch.Tensor:
    """The rows of the accepted tree paths in the chain layout.

    x: node-indexed over the whole tree, ``[bs * num_draft_tokens, ...]``;
    accept_index: ``[bs, num_steps + 1]`` global node indices, -1 padded.
    Returns ``[bs * (num_steps + 1), ...]`` whose row ``b * (num_steps + 1) + j``
    is ``x[accept_index[b, j]]``; padded entries read node 0 (they lie past the
    accept length: their results are never used).
    """
    return x[accept_index.to(torch.int64).clamp(min=0).reshape(-1)]


def move_accept_path_kv_to_front(
    req_to_token: torch.Tensor,
    kv_cache: KVCache,
    batch: VerifiedBatch,
    accept_index: torch.Tensor,
    accept_lens: torch.Tensor,
) -> None:
    """Move the target KV of each request's accepted path to the slots of
    ``[seq_len, seq_len + accept_len)``, in place (the copy reads all sources
    before it writes: a path node never lies before its position)."""
    # Imported here: ServerArgs imports this module for spec_v2_tree_v1_reason.
    from sglang.srt.speculative.eagle_info_v2 import (
        assign_extend_cache_locs,
        fill_accepted_out_cache_loc,
    )

    bs, path_len = accept_index.shape
    size = bs * path_len
    device = accept_index.device
    tgt_cache_loc = torch.zeros(size, dtype=torch.int64, device=device)
    src_cache_loc = torch.zeros(size, dtype=torch.int64, device=device)
    assign_extend_cache_locs[(bs,)](
        batch.req_pool_indices,
        req_to_token,
        batch.seq_lens,
        batch.seq_lens + accept_lens,
        tgt_cache_loc,
        req_to_token.shape[1],
        next_power_of_2(bs),
    )
    fill_accepted_out_cache_loc[(size,)](
        accept_index,
        batch.out_cache_loc,
        src_cache_loc,
        next_power_of_2(size),
    )
    kv_cache.move_kv_cache(tgt_cache_loc, src_cache_loc)


def finalize_accept_tree_path(
    req_to_token: torch.Tensor,
    kv_cache: KVCache,
    batch: VerifiedBatch,
    accept_index: torch.Tensor,
    accept_lens: torch.Tensor,
    predict: torch.Tensor,
    hidden_states: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """After the verify step of a tree: the accepted path's target KV, predicted
    tokens, hidden states and KV slots in the chain layout. Returns (predict,
    hidden_states, out_cache_loc), each ``num_steps + 1`` rows per request."""
    move_accept_path_kv_to_front(
        req_to_token, kv_cache, batch, accept_index, accept_lens
    )
    bs, path_len = accept_index.shape
    # The slots of positions [seq_len, seq_len + path_len): the draft extend's.
    out_cache_loc = batch.out_cache_loc.view(bs, -1)[:, :path_len].reshape(-1)
    if hidden_states is not None:
        hidden_states = gather_accept_path(hidden_states, accept_index)
    return gather_accept_path(predict, accept_index), hidden_states, out_cache_loc


def spec_v2_tree_v1_reason(
    topk: Optional[int], page_size: int, hybrid_linear_attention: bool
) -> Optional[str]:
    """Why a draft tree must run on the v1 worker rather than on spec v2, or
    None (chains, and trees at page size 1 on attention-only models). Pure."""
    if (topk or 1) == 1:
        return None
    if page_size > 1:
        return f"spec v2 runs draft trees (topk {topk}) at page size 1 only"
    if hybrid_linear_attention:
        return "spec v2 updates hybrid linear-attention states for topk 1 only"
    return None
