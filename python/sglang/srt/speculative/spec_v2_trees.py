"""Draft trees (``--speculative-eagle-topk > 1``) on the spec-v2 overlap worker.

Backported from upstream 0.5.13 at page size 1. A verify step of a tree scores
``num_draft_tokens`` nodes per request, written to the KV slots
``[seq_len, seq_len + num_draft_tokens)`` in tree-node order; the accepted path
(``accept_index``: ``[bs, num_steps + 1]`` global node indices, -1 padded) is in
general not a prefix of it. Everything after verify (bonus token, draft extend,
the scheduler's output slicing, the next step's KV reads) assumes the chain
layout of topk 1, where it is. So after verify the worker moves the accepted
path's target KV to ``[seq_len, seq_len + accept_len)`` and gathers the
node-indexed tensors (``predict``, target hidden states) of the accepted path to
the front of each request's block (``compact_accept_to_front``).

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


def compact_accept_to_front(
    x: torch.Tensor, accept_index: torch.Tensor, num_draft_tokens: int
) -> torch.Tensor:
    """Gather the accepted tree path to the front of each request's block.

    x: node-indexed over the whole tree, ``[bs * num_draft_tokens, ...]``;
    accept_index: ``[bs, num_steps + 1]`` global node indices, -1 padded.
    Returns a new tensor: row ``b * num_draft_tokens + j`` holds
    ``x[accept_index[b, j]]`` for every unpadded ``j``; padded entries read
    node 0 (they lie past the accept length and are never read), the remaining
    rows keep ``x``.
    """
    bs, path_len = accept_index.shape
    assert path_len <= num_draft_tokens, (path_len, num_draft_tokens)
    assert x.shape[0] == bs * num_draft_tokens, (x.shape, bs, num_draft_tokens)
    gathered = x[accept_index.to(torch.int64).clamp(min=0).reshape(-1)]
    out = x.clone()
    out.view(bs, num_draft_tokens, *x.shape[1:])[:, :path_len] = gathered.view(
        bs, path_len, *x.shape[1:]
    )
    return out


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
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """After the verify step of a tree: the accepted path's target KV, predicted
    tokens and hidden states in the chain layout. Returns (predict,
    hidden_states), compacted."""
    move_accept_path_kv_to_front(
        req_to_token, kv_cache, batch, accept_index, accept_lens
    )
    num_draft_tokens = predict.shape[0] // accept_index.shape[0]
    if hidden_states is not None:
        hidden_states = compact_accept_to_front(
            hidden_states, accept_index, num_draft_tokens
        )
    return (
        compact_accept_to_front(predict, accept_index, num_draft_tokens),
        hidden_states,
    )


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
