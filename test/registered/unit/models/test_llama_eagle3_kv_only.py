"""LlamaForCausalLMEagle3.write_kv_cache_only writes the KV the full forward writes.

Runs a tiny one-layer EAGLE-3 head on the CPU engine (SGLANG_USE_CPU_ENGINE=1,
which must be set before sglang is imported, hence a child process): the forward
with an attention backend that only stores K/V, against write_kv_cache_only.
"""

import os
import socket
import subprocess
import sys
import unittest
from types import SimpleNamespace

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

CHILD_ARG = "--in-cpu-engine"


class KVRecorder:
    """A token-to-KV pool that records each write."""

    def __init__(self):
        self.writes = []

    def set_kv_buffer(self, layer, loc, k, v, k_scale=None, v_scale=None):
        self.writes.append((loc.clone(), k.clone(), v.clone()))


def check_in_cpu_engine(port: int) -> None:
    import torch
    from sglang.srt.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from transformers import LlamaConfig

    class StoreKVOnly(AttentionBackend):
        def init_forward_metadata(self, forward_batch):
            pass

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            forward_batch.token_to_kv_pool.set_kv_buffer(
                layer, forward_batch.out_cache_loc, k, v, layer.k_scale, layer.v_scale
            )
            return torch.zeros_like(q)

    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
    )
    initialize_model_parallel(1)
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=1,
        vocab_size=100,
        max_position_embeddings=256,
    )
    config.draft_vocab_size = 50
    config.target_hidden_size = 48
    torch.manual_seed(0)
    model = LlamaForCausalLMEagle3(config)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.2)
    assert model.can_write_kv_cache_only()

    input_ids = torch.tensor([5, 7, 9])
    positions = torch.tensor([10, 20, 30])
    out_cache_loc = torch.tensor([4, 8, 12])
    target_hidden = torch.randn(3, 3 * config.target_hidden_size)

    def forward_writes(hidden_states, ids=input_ids):
        pool = KVRecorder()
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=3,
            input_ids=ids,
            req_pool_indices=torch.arange(3),
            seq_lens=positions + 1,
            out_cache_loc=out_cache_loc,
            seq_lens_sum=int((positions + 1).sum()),
            positions=positions,
        )
        forward_batch.spec_info = SimpleNamespace(hidden_states=hidden_states)
        forward_batch.attn_backend = StoreKVOnly()
        forward_batch.token_to_kv_pool = pool
        model.model(ids, positions, forward_batch)
        (write,) = pool.writes
        return write

    with torch.no_grad():
        full = forward_writes(target_hidden)
        pool = KVRecorder()
        projected = model.write_kv_cache_only(
            input_ids, positions, target_hidden, out_cache_loc, pool
        )
        (kv_only,) = pool.writes
        # Fed back in place of the target's hidden states, the projected ones
        # give the same KV (the resume forward after KV-only steps).
        again = forward_writes(projected)
        other_tokens = forward_writes(target_hidden, ids=torch.tensor([6, 7, 9]))

    assert projected.shape == (3, config.hidden_size)
    for name, write in (("write_kv_cache_only", kv_only), ("projected", again)):
        for what, a, b in zip(("loc", "k", "v"), full, write):
            assert torch.equal(a, b), f"{name}: {what} differs from the forward's"
    assert not torch.equal(full[1][0], other_tokens[1][0]), "K ignores the token"
    assert torch.equal(full[1][1:], other_tokens[1][1:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TestWriteKVCacheOnly(CustomTestCase):
    def test_writes_what_the_forward_writes(self):
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
        child = subprocess.run(
            [sys.executable, __file__, CHILD_ARG, str(free_port())],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        self.assertEqual(child.returncode, 0, child.stderr[-3000:])


if __name__ == "__main__":
    if sys.argv[1:2] == [CHILD_ARG]:
        check_in_cpu_engine(int(sys.argv[2]))
    else:
        unittest.main()
