"""Real scheduler-side objects on CPU for unit tests of ScheduleBatch bookkeeping:
ReqToTokenPool, a token or paged TokenToKVPoolAllocator and ChunkCache, and a
batch right after prefill. No model, no worker, no GPU.

The KV bookkeeping they run (writing req_to_token, the paged allocator) is made
of triton kernels: on CPU tensors these need triton's interpreter, which must be
chosen before sglang is imported (``sglang.test.triton_interpreter``).
"""

from __future__ import annotations

import dataclasses
from array import array
from typing import List, Sequence
from unittest import TestCase

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.allocator import (
    BaseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.runtime_context import get_context, get_parallel
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.test.spec_engine_utils import tiny_llama_config_dir
from sglang.test.test_utils import CustomTestCase


def publish_server_args(test_case: TestCase, **fields) -> ServerArgs:
    """Publish server args carrying ``fields`` in the runtime context for the
    rest of the test (restored at cleanup), as upstream's test kits do."""
    override = get_context().override_server_args(**fields)
    server_args = override.install()
    test_case.addCleanup(override.restore)
    return server_args


class TinyEagleTestCase(CustomTestCase):
    """Tests of an EAGLE server's CPU-side objects: the tiny llama config of the
    class (``model_config``), and server args published per test."""

    @classmethod
    def setUpClass(cls):
        cls.tmpdir = tiny_llama_config_dir()
        cls.model_config = ModelConfig(cls.tmpdir.name)

    @classmethod
    def tearDownClass(cls):
        cls.tmpdir.cleanup()

    def publish_eagle_args(
        self, num_steps: int, topk: int, num_draft_tokens: int, **fields
    ) -> ServerArgs:
        return publish_server_args(
            self,
            device="cpu",
            speculative_algorithm="EAGLE",
            speculative_num_steps=num_steps,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=num_draft_tokens,
            **fields,
        )


def single_rank(test_case: TestCase) -> None:
    """The parallel topology of a single-GPU server, for the rest of the test
    (no process group is initialized)."""
    test_case.enterContext(
        get_parallel().override(
            world_size=1,
            world_rank=0,
            tp_size=1,
            tp_rank=0,
            pp_size=1,
            pp_rank=0,
            moe_ep_size=1,
            moe_ep_rank=0,
        )
    )


@dataclasses.dataclass
class CpuKVPools:
    req_to_token_pool: ReqToTokenPool
    allocator: BaseTokenToKVPoolAllocator
    tree_cache: ChunkCache


def cpu_kv_pools(
    max_context_len: int, num_kv_tokens: int, num_reqs: int = 8, page_size: int = 1
) -> CpuKVPools:
    """No prefix caching; ``num_kv_tokens`` slots (a multiple of page_size)."""
    req_to_token_pool = ReqToTokenPool(
        size=num_reqs,
        max_context_len=max_context_len,
        device="cpu",
        enable_memory_saver=False,
    )
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(
            size=num_kv_tokens,
            dtype=torch.bfloat16,
            device="cpu",
            kvcache=None,
            need_sort=False,
        )
    else:
        allocator = PagedTokenToKVPoolAllocator(
            size=num_kv_tokens,
            page_size=page_size,
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
            page_size=page_size,
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
    first_token: int = 100,
) -> ScheduleBatch:
    """An ``extend_batch`` with each request's first output token (``first_token``
    + its index) appended, as the prefill result leaves them. The caller installs
    the batch's spec_info."""
    batch = extend_batch(
        pools,
        model_config,
        spec_algorithm,
        prompt_lens,
        max_new_tokens,
        enable_overlap,
        rid_prefix,
    )
    for i, req in enumerate(batch.reqs):
        req.output_ids.append(first_token + i)
    return batch


def extend_batch(
    pools: CpuKVPools,
    model_config: ModelConfig,
    spec_algorithm: SpeculativeAlgorithm,
    prompt_lens: Sequence[int],
    max_new_tokens: int,
    enable_overlap: bool,
    rid_prefix: str = "r",
) -> ScheduleBatch:
    """Requests with prompts 1..n, each scheduled whole (the extend range the
    prefill adder sets), prepared for extend: the batch a prefill runs."""
    reqs: List[Req] = []
    for i, n in enumerate(prompt_lens):
        sampling_params = SamplingParams(max_new_tokens=max_new_tokens)
        sampling_params.normalize(None)
        req = Req(
            f"{rid_prefix}{i}",
            "",
            array("q", range(1, n + 1)),
            sampling_params,
            vocab_size=model_config.vocab_size,
        )
        req.init_next_round_input(pools.tree_cache)
        req.set_extend_range(
            len(req.prefix_indices), len(req.full_untruncated_fill_ids)
        )
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
    return batch
