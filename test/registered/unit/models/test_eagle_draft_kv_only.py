"""write_kv_cache_only of the EAGLE drafts (Llama, Qwen2 and Mistral EAGLE, Llama
EAGLE-3) writes the KV the full forward writes.

Runs tiny one-layer drafts on the CPU engine (SGLANG_USE_CPU_ENGINE=1, which must
be set before sglang is imported, hence a child process): the forward through the
torch-native attention backend into one MHA KV pool, against write_kv_cache_only
into another; for EAGLE-3 heads, for each normalization the forward can apply to
the target's hidden states before fc (none, fc_norm, norm_before_fc, both).
"""

import sys
import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.spec_engine_utils import (
    init_single_rank_model_parallel,
    run_check_in_child,
)
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

CHILD_ARG = "--in-cpu-engine"

# (name, config attributes, whether fc_norm and input_norm exist); the model
# reads norm_before_fc from eagle_config first, then from the config itself.
NORM_CONFIGS = [
    ("no norm before fc", {}, False, False),
    ("fc_norm", {"fc_norm": True}, True, False),
    ("norm_before_fc", {"eagle_config": {"norm_before_fc": True}}, False, True),
    ("both", {"fc_norm": True, "norm_before_fc": True}, True, True),
]


def check_in_cpu_engine(port: int) -> None:
    from sglang.test.test_utils import maybe_stub_sgl_kernel

    # A CUDA build of sgl_kernel does not import without a GPU; nothing here
    # calls it (no AMX: the CPU engine runs the native ops).
    maybe_stub_sgl_kernel()

    from types import SimpleNamespace

    import torch
    from transformers import LlamaConfig, Qwen2Config

    from sglang.srt.layers.attention.torch_native_backend import (
        TorchNativeAttnBackend,
    )
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import (
        ForwardContext,
        forward_context,
    )
    from sglang.srt.models.llama_eagle import LlamaForCausalLMEagle
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.models.mistral_eagle import MistralForCausalLMEagle
    from sglang.srt.models.qwen2_eagle import Qwen2ForCausalLMEagle

    init_single_rank_model_parallel(port, "cpu")

    def build_model(
        model_class, num_hidden_layers=1, config_class=LlamaConfig, **attrs
    ):
        config = config_class(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=num_hidden_layers,
            vocab_size=100,
            max_position_embeddings=256,
        )
        config.draft_vocab_size = 50
        config.target_hidden_size = 48
        for key, value in attrs.items():
            setattr(config, key, value)
        torch.manual_seed(0)
        model = model_class(config)
        for param in model.parameters():
            torch.nn.init.normal_(param, std=0.2)
        return model

    def new_attn_backend():
        runner = SimpleNamespace(
            device="cpu",
            req_to_token_pool=ReqToTokenPool(
                size=4, max_context_len=64, device="cpu", enable_memory_saver=False
            ),
            token_to_kv_pool=MHATokenToKVPool(
                size=256,
                page_size=1,
                dtype=torch.float32,
                head_num=2,
                head_dim=16,
                layer_num=1,
                device="cpu",
                enable_memory_saver=False,
            ),
        )
        return TorchNativeAttnBackend(runner)

    # Three decoding requests, each at its own slots of the pool.
    req_pool_indices = torch.tensor([1, 2, 3])
    positions = torch.tensor([10, 20, 30])
    seq_lens = positions + 1
    input_ids = torch.tensor([5, 7, 9])

    def place_requests(attn_backend):
        req_to_token = attn_backend.req_to_token_pool.req_to_token
        for i, req in enumerate(req_pool_indices.tolist()):
            req_to_token[req, : seq_lens[i]] = 1 + 64 * i + torch.arange(seq_lens[i])
        return req_to_token[req_pool_indices, positions].to(torch.int64)

    out_cache_loc = place_requests(new_attn_backend())

    def forward_kv(model, hidden_states, ids=input_ids):
        """The pool's K/V after the model's forward."""
        attn_backend = new_attn_backend()
        place_requests(attn_backend)
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=len(ids),
            input_ids=ids,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            out_cache_loc=out_cache_loc,
            seq_lens_sum=int(seq_lens.sum()),
            positions=positions,
        )
        forward_batch.spec_info = SimpleNamespace(hidden_states=hidden_states)
        with forward_context(ForwardContext(attn_backend=attn_backend)):
            attn_backend.init_forward_metadata(forward_batch)
            model.model(ids, positions, forward_batch)
        return pool_kv(attn_backend.token_to_kv_pool)

    def pool_kv(token_to_kv_pool):
        return (
            token_to_kv_pool.get_key_buffer(0).clone(),
            token_to_kv_pool.get_value_buffer(0).clone(),
        )

    def check_writes_what_the_forward_writes(name, model, target_hidden):
        assert model.can_write_kv_cache_only(), name
        with torch.no_grad():
            full = forward_kv(model, target_hidden)
            token_to_kv_pool = new_attn_backend().token_to_kv_pool
            model.write_kv_cache_only(
                input_ids, positions, target_hidden, out_cache_loc, token_to_kv_pool
            )
            kv_only = pool_kv(token_to_kv_pool)
            other_tokens = forward_kv(model, target_hidden, ids=torch.tensor([6, 7, 9]))

        for what, full_buffer in zip(("K", "V"), full):
            assert full_buffer[out_cache_loc].abs().sum() > 0, f"{name}: no {what}"
        for what, a, b in zip(("K", "V"), full, kv_only):
            assert torch.equal(a, b), f"{name}: {what} differs"
        full_k, other_k = full[0][out_cache_loc], other_tokens[0][out_cache_loc]
        assert not torch.equal(full_k[0], other_k[0]), f"{name}: K ignores the token"
        assert torch.equal(full_k[1:], other_k[1:]), name

    for model_class, config_class in (
        (LlamaForCausalLMEagle3, LlamaConfig),
        (LlamaForCausalLMEagle, LlamaConfig),
        (Qwen2ForCausalLMEagle, Qwen2Config),
        (MistralForCausalLMEagle, LlamaConfig),
    ):
        two_layers = build_model(
            model_class, num_hidden_layers=2, config_class=config_class
        )
        assert not two_layers.can_write_kv_cache_only(), model_class.__name__

    for name, attrs, has_fc_norm, has_input_norm in NORM_CONFIGS:
        model = build_model(LlamaForCausalLMEagle3, **attrs)
        assert (model.model.fc_norm is not None) == has_fc_norm, name
        assert (model.model.input_norm is not None) == has_input_norm, name
        target_hidden = torch.randn(3, 3 * model.config.target_hidden_size)
        check_writes_what_the_forward_writes(f"EAGLE-3, {name}", model, target_hidden)

    # The Qwen2 EAGLE draft's K/V projections have a bias; the Mistral EAGLE
    # draft's body has a norm before its first attention.
    for name, model_class, config_class in (
        ("EAGLE", LlamaForCausalLMEagle, LlamaConfig),
        ("Qwen2 EAGLE", Qwen2ForCausalLMEagle, Qwen2Config),
        ("Mistral EAGLE", MistralForCausalLMEagle, LlamaConfig),
    ):
        model = build_model(model_class, config_class=config_class)
        target_hidden = torch.randn(3, model.config.hidden_size)
        check_writes_what_the_forward_writes(name, model, target_hidden)


class TestWriteKVCacheOnly(CustomTestCase):
    def test_writes_what_the_forward_writes(self):
        child = run_check_in_child(
            __file__, CHILD_ARG, env={"SGLANG_USE_CPU_ENGINE": "1"}
        )
        self.assertEqual(child.returncode, 0, child.stderr[-3000:])


if __name__ == "__main__":
    if sys.argv[1:2] == [CHILD_ARG]:
        check_in_cpu_engine(int(sys.argv[2]))
    else:
        unittest.main()
