"""Real scheduler-side objects on CPU for unit tests of ScheduleBatch bookkeeping:
ReqToTokenPool, TokenToKVPoolAllocator and ChunkCache, and a batch right after
prefill. No model, no worker, no GPU."""

from __future__ import annotations

import dataclasses
from typing import List, Sequence

import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm


@dataclasses.dataclass
class CpuKVPools:
    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    tree_cache: ChunkCache


def cpu_kv_pools(
    max_context_len: int, num_kv_tokens: int, num_reqs: int = 8
) -> CpuKVPools:
    """Page size 1, no prefix caching."""
    req_to_token_pool = ReqToTokenPool(
        size=num_reqs,
        max_context_len=max_context_len,
        device="cpu",
        enable_memory_saver=False,
    )
    allocator = TokenToKVPoolAllocator(
        size=num_kv_tokens,
        dtype=torch.bfloat16,
        device="cpu",
        kvcache=None,
        need_sort=False,
    )
    tree_cache = ChunkCache(
        CacheInitParams(
            disable=True,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=allocator,
            page_size=1,
        )
    )
    return CpuKVPools(req_to_token_pool, allocator, tree_cache)


def prefilled_batch(
    pools: CpuKVPools,
    model_config: ModelConfig,
    spec_algorithm: SpeculativeAlgorithm,
    prompt_lens: Sequence[int],
    max_new_tokens: int,
    enable_overlap: bool,
    rid_prefix: str = "r",
) -> ScheduleBatch:
    """Requests with prompts 1..n, prepared for extend, and each request's first
    output token (100 + its index) appended, as the prefill result leaves them.
    The caller installs the batch's spec_info and filters it."""
    reqs: List[Req] = []
    for i, n in enumerate(prompt_lens):
        sampling_params = SamplingParams(max_new_tokens=max_new_tokens)
        sampling_params.normalize(None)
        req = Req(
            f"{rid_prefix}{i}",
            "",
            list(range(1, n + 1)),
            sampling_params,
            vocab_size=model_config.vocab_size,
        )
        req.init_next_round_input(pools.tree_cache)
        reqs.append(req)
    batch = ScheduleBatch.init_new(
        reqs,
        pools.req_to_token_pool,
        pools.allocator,
        pools.tree_cache,
        model_config,
        enable_overlap,
        spec_algorithm,
    )
    batch.prepare_for_extend()
    for i, req in enumerate(reqs):
        req.output_ids.append(100 + i)
    return batch
