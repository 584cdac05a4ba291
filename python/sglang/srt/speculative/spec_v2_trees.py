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

Pure helpers (torch, any device) so the index logic runs in CPU tests.
"""

from __future__ import annotations

from typing import Optional

import torch


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


def accept_path_kv_moves(
    accept_index: torch.Tensor,
    accept_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_to_token_rows: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (torch) of the KV move of the accepted paths; the worker runs
    the same with triton kernels (``move_accept_tokens_to_target_kvcache``).

    Returns (tgt, src) slot lists, accepted entries only, request-major:
    ``src = out_cache_loc[accept_index[b, j]]``,
    ``tgt = req_to_token_rows[b, seq_lens[b] + j]`` for ``j < accept_lens[b]``.
    """
    bs, path_len = accept_index.shape
    j = torch.arange(path_len, device=accept_index.device).view(1, path_len)
    valid = j < accept_lens.view(bs, 1)
    src = out_cache_loc[accept_index.to(torch.int64).clamp(min=0)]
    positions = (seq_lens.view(bs, 1).to(torch.int64) + j).clamp(
        max=req_to_token_rows.shape[1] - 1
    )
    tgt = torch.gather(req_to_token_rows.to(torch.int64), 1, positions)
    return tgt[valid], src[valid].to(torch.int64)


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
