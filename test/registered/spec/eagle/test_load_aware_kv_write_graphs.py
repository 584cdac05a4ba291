"""DraftKVWriteGraphs (load_aware.py) replays LlamaForCausalLMEagle3.write_kv_cache_only.

A tiny one-layer EAGLE-3 head on the GPU writes the same tokens into two KV pools:
eagerly into one, through the captured graphs into the other, both cleared before
each batch. Every slot but the padding slot 0 must end up the same in both, at a
captured batch size and at one that replays the next larger graph after a larger
batch left its slots in the static buffers. The graphs replay on their own stream,
as beside a target forward.
Runs in a child process (it initializes torch.distributed).
"""

import functools
import sys
import unittest

import pytest
from sglang.test.ci.ci_register import register_cuda_ci
from sglang.test.spec_engine_utils import (
    init_single_rank_model_parallel,
    run_check_in_child,
)
from sglang.test.test_utils import CustomTestCase

register_cuda_ci(est_time=60, suite="base-b-test-1-gpu-large")
pytestmark = pytest.mark.gpu

CHILD_ARG = "--on-gpu"
CAPTURE_BS = [1, 2, 4, 8]
# 3 and 5 replay the graphs of 4 and 8 with padding rows, after 8 filled every row.
BATCHES = [8, 3, 8, 5, 1]
NUM_SLOTS = 256
NUM_REQS = 16
TARGET_HIDDEN = 128


def check_on_gpu(port: int) -> None:
    import torch
    from transformers import LlamaConfig

    from sglang.srt.distributed.parallel_state import graph_capture
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.speculative.load_aware import DraftKVWriteGraphs

    init_single_rank_model_parallel(port, "cuda")

    dtype = torch.bfloat16
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=1,
        vocab_size=1000,
        max_position_embeddings=1024,
    )
    config.draft_vocab_size = 500
    config.target_hidden_size = TARGET_HIDDEN
    torch.manual_seed(0)
    # Built as the model loader builds it: default dtype and device set.
    torch.set_default_dtype(dtype)
    with torch.device("cuda"):
        model = LlamaForCausalLMEagle3(config)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.2)
    assert model.can_write_kv_cache_only()

    def new_pool():
        return MHATokenToKVPool(
            size=NUM_SLOTS,
            page_size=1,
            dtype=dtype,
            head_num=2,
            head_dim=64,
            layer_num=1,
            device="cuda",
            enable_memory_saver=False,
        )

    def pool_kv(pool):
        return pool.get_key_buffer(0).clone(), pool.get_value_buffer(0).clone()

    def clear(pool):
        pool.get_key_buffer(0).zero_()
        pool.get_value_buffer(0).zero_()

    eager_pool, graph_pool = new_pool(), new_pool()
    hidden_by_req = torch.zeros((NUM_REQS, 3 * TARGET_HIDDEN), device="cuda")
    graphs = DraftKVWriteGraphs(
        functools.partial(model.write_kv_cache_only, token_to_kv_pool=graph_pool),
        CAPTURE_BS,
        hidden_by_req,
        overlap=True,
    )
    with torch.no_grad():
        with graph_capture() as capture_context:
            graphs.capture(capture_context.stream)
        for buffer in pool_kv(graph_pool):
            assert not buffer[1:].any(), "capture wrote outside the padding slot"

        generator = torch.Generator(device="cuda").manual_seed(1)
        for bs in BATCHES:
            # Cleared, so that a padding row writing the slot its previous batch
            # left in the static buffers would show there.
            clear(eager_pool)
            clear(graph_pool)
            slots = 1 + torch.randperm(
                NUM_SLOTS - 1, device="cuda", generator=generator
            )
            out_cache_loc = slots[:bs]
            input_ids = torch.randint(
                0, config.vocab_size, (bs,), device="cuda", generator=generator
            )
            positions = torch.randint(
                0, 512, (bs,), dtype=torch.int32, device="cuda", generator=generator
            )
            hidden_states = torch.randn(
                (bs, 3 * TARGET_HIDDEN), dtype=dtype, device="cuda", generator=generator
            )
            req_pool_indices = torch.randperm(
                NUM_REQS, device="cuda", generator=generator
            )[:bs]
            model.write_kv_cache_only(
                input_ids,
                positions.to(torch.int64),
                hidden_states,
                out_cache_loc,
                eager_pool,
            )
            hidden_by_req[req_pool_indices] = hidden_states
            graphs(input_ids, positions, req_pool_indices, out_cache_loc)
            # The next batch's inputs, written once the replay has read them.
            graphs.wait()
            hidden_by_req.normal_(generator=generator)
            torch.cuda.synchronize()
            for what, a, b in zip("KV", pool_kv(eager_pool), pool_kv(graph_pool)):
                assert a[out_cache_loc].abs().sum() > 0, f"bs {bs}: no {what} written"
                # Slot 0 takes the padding rows' writes; every other slot must match.
                torch.testing.assert_close(
                    b[1:], a[1:], atol=2e-2, rtol=2e-2, msg=f"bs {bs}: {what}"
                )
    print("ok", flush=True)


class TestDraftKVWriteGraphs(CustomTestCase):
    def test_replays_write_what_the_eager_write_writes(self):
        child = run_check_in_child(__file__, CHILD_ARG)
        self.assertEqual(child.returncode, 0, child.stderr[-3000:])
        self.assertIn("ok", child.stdout)


if __name__ == "__main__":
    if sys.argv[1:2] == [CHILD_ARG]:
        check_on_gpu(int(sys.argv[2]))
    else:
        unittest.main()
