"""CPU tests for sglang.test.synthetic_spec_models (synthetic target + EAGLE-3 draft)."""

import hashlib
import json
import os
import random
import tempfile
import unittest
from pathlib import Path
from typing import Dict, List, Optional, Tuple
from unittest import mock

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from sglang.test import synthetic_spec_models as ssm
from sglang.test import spec_engine_utils
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

SEQ_LEN = 600
NUM_STEPS = 3
# Draft logit gap (top1 - top2) the emulation must keep at every drafted token.
DRAFT_MIN_MARGIN = 6.0
# Tolerances of the measured acceptance against P and against the formula.
FIRST_TOKEN_TOL = 0.06
ACCEPT_LENGTH_REL_TOL = 0.08
PROMPT = [9, 40, 1234]
# Prompt of "another request" whose draft KV replaces ours in the stale-KV tests;
# at P = 0.6 its continuation runs on the same arc of pi, 79 tokens ahead of ours.
OTHER_PROMPT = [17, 5, 3000]
# --draft-kv-check with a stale draft KV cache (measured: <= 0.002 and <= 1.002).
STALE_KV_MAX_FIRST_ACCEPT = 0.03
STALE_KV_MAX_ACCEPT_LENGTH = 1.05
# sha256 of ssm.generate("tiny", out, draft_accept=0.9, seed=1) (see _digest),
# computed before --draft-kv-check was added: default outputs must keep their bytes.
DEFAULT_TINY_DIGEST = "84c794581cf647cebf0a4858c04a7595e44c7d4d24c162ef2d9ca159f46170e2"


def _rope_neox(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; neox-style rotary (SGLang/HF Llama)."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    )
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Eagle3DraftEmulator:
    """Plain-torch copy of the 0.5.12 LlamaForCausalLMEagle3 forward (one layer).

    Weights and every activation are rounded to ``dtype``; matmuls accumulate in fp32.
    """

    def __init__(self, draft_dir: str, dtype: torch.dtype) -> None:
        with open(os.path.join(draft_dir, "config.json")) as f:
            self.cfg = json.load(f)
        w = load_file(os.path.join(draft_dir, "model.safetensors"))
        self.hot_token_id = w.pop("d2t") + torch.arange(self.cfg["draft_vocab_size"])
        w.pop("t2d")
        self.w = {k: v.to(dtype).float() for k, v in w.items()}
        self.dtype = dtype
        self.eps = self.cfg["rms_norm_eps"]
        self.theta = self.cfg["rope_parameters"]["rope_theta"]

    def _round(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype).float()

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self._round(x @ self.w[name].t())

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self._round(out * self.w[name])

    def fc(self, aux: torch.Tensor) -> torch.Tensor:
        return self._linear(self._round(aux.float()), "fc.weight")

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        past_kv: Tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
    ) -> Tuple[torch.Tensor, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """mask: [new, past + new] bool. Returns (draft-vocab logits, pre-norm aux, kv)."""
        cfg, p = self.cfg, "midlayer."
        heads, kv_heads, hd = (
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
            cfg["head_dim"],
        )
        n = input_ids.shape[0]
        embeds = self.w["embed_tokens.weight"][input_ids]
        # Input layer: residual is the incoming hidden state, not the embedding.
        residual = hidden
        x = torch.cat(
            [
                self._norm(embeds, p + "input_layernorm.weight"),
                self._norm(hidden, p + "hidden_norm.weight"),
            ],
            dim=-1,
        )
        q = self._round(
            _rope_neox(
                self._linear(x, p + "self_attn.q_proj.weight").view(n, heads, hd),
                positions,
                self.theta,
            )
        )
        k = self._round(
            _rope_neox(
                self._linear(x, p + "self_attn.k_proj.weight").view(n, kv_heads, hd),
                positions,
                self.theta,
            )
        )
        v = self._linear(x, p + "self_attn.v_proj.weight").view(n, kv_heads, hd)
        k_all, v_all = torch.cat([past_kv[0], k]), torch.cat([past_kv[1], v])
        group = heads // kv_heads
        scores = (
            torch.einsum("qhd,khd->hqk", q, k_all.repeat_interleave(group, dim=1))
            * hd**-0.5
        )
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        attn = self._round(
            torch.einsum("hqk,khd->qhd", probs, v_all.repeat_interleave(group, dim=1))
        )
        attn = self._linear(attn.reshape(n, heads * hd), p + "self_attn.o_proj.weight")
        residual = self._round(attn + residual)
        mlp_in = self._norm(residual, p + "post_attention_layernorm.weight")
        gate = self._linear(mlp_in, p + "mlp.gate_proj.weight")
        up = self._linear(mlp_in, p + "mlp.up_proj.weight")
        mlp_out = self._linear(
            self._round(torch.nn.functional.silu(gate) * up), p + "mlp.down_proj.weight"
        )
        aux = self._round(mlp_out + residual)
        logits = self._linear(self._norm(aux, "norm.weight"), "lm_head.weight")
        return logits, aux, (k_all, v_all)

    def empty_kv(self) -> Tuple[torch.Tensor, torch.Tensor]:
        shape = (0, self.cfg["num_key_value_heads"], self.cfg["head_dim"])
        return torch.zeros(shape), torch.zeros(shape)


def _target_aux(target: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Concat of the residual stream entering layers 2, L/2, L-3 (SGLang's aux)."""
    num_layers = target.config.num_hidden_layers
    with torch.no_grad():
        out = target(ids[None], output_hidden_states=True)
    return torch.cat(
        [out.hidden_states[i][0] for i in (2, num_layers // 2, num_layers - 3)], -1
    )


KV = Tuple[torch.Tensor, torch.Tensor]


def _draft_extend_kv(
    draft: Eagle3DraftEmulator, seq: List[int], aux: torch.Tensor
) -> KV:
    """Draft KV that the draft extends write for seq (position t: seq[t + 1], aux[t])."""
    n_ext = len(seq) - 1
    causal = torch.ones(n_ext, n_ext, dtype=torch.bool).tril()
    with torch.no_grad():
        _, _, kv = draft.forward(
            torch.tensor(seq[1:]),
            draft.fc(aux[:-1]),
            torch.arange(n_ext),
            draft.empty_kv(),
            causal,
        )
    return kv


def _simulate_chain(
    draft: Eagle3DraftEmulator,
    seq: List[int],
    aux: torch.Tensor,
    start: int,
    num_steps: int,
    cache: KV,
) -> Tuple[List[Tuple[int, List[int]]], float]:
    """EAGLE-3 chain drafting (topk=1) at every verification point t >= start.

    Draft extend of t: token seq[t + 1] and the target aux of t, reading the
    draft KV of positions < t from cache (positions of seq; pass
    _draft_extend_kv(draft, seq, aux) for a valid cache). Then num_steps - 1
    decode steps feed back the draft's token and pre-norm hidden; all
    verification points run as one batch whose mask lets point t see cache
    positions < t, its own extend and its own earlier chain tokens.
    Returns ([(t, drafted target ids)], min top1 - top2 draft logit gap).
    """
    ids = torch.tensor(seq)
    n_ext = len(seq) - 1
    points = torch.arange(start, n_ext - num_steps)
    earlier = torch.arange(n_ext)[None, :] < points[:, None]
    own = torch.eye(points.numel(), dtype=torch.bool)
    chains, margins = [], []
    with torch.no_grad():
        logits, hidden, kv = draft.forward(
            ids[points + 1],
            draft.fc(aux[points]),
            points,
            cache,
            torch.cat([earlier, own], dim=1),
        )
        for step in range(num_steps):
            top2 = logits.topk(2, dim=-1)
            margins.append((top2.values[:, 0] - top2.values[:, 1]).min().item())
            chains.append(draft.hot_token_id[top2.indices[:, 0]])
            if step + 1 < num_steps:
                mask = torch.cat([earlier] + [own] * (step + 2), dim=1)
                logits, hidden, kv = draft.forward(
                    chains[-1], hidden, points + step + 1, kv, mask
                )
    drafted = torch.stack(chains, dim=1).tolist()
    return list(zip(points.tolist(), drafted)), min(margins)


class TestSyntheticSpecModels(CustomTestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        cls.dirs, cls.kv_check_dirs = {}, {}
        for p in (0.6, 0.9):
            out = os.path.join(cls._tmp.name, f"p{p}")
            cls.dirs[p] = (out,) + ssm.generate("tiny", out, draft_accept=p, seed=1)
            out = os.path.join(cls._tmp.name, f"kv_check_p{p}")
            cls.kv_check_dirs[p] = (out,) + ssm.generate(
                "tiny", out, draft_accept=p, seed=1, draft_kv_check=True
            )
        cls.out, cls.target_dir, cls.draft_dir = cls.dirs[0.9]
        cls.spec = ssm.load_spec(cls.out)

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def _prompt_and_continuation(
        self, out: str, prompt: List[int], n: int
    ) -> List[int]:
        return prompt + ssm.greedy_continuation(ssm.next_token_map(out), prompt, n)

    def test_target_greedy_follows_map_with_margin(self) -> None:
        vocab = self.spec["vocab_size"]
        # A greedy rollout in both dtypes; every token id once as "last token" in fp32
        # (bf16 CPU matmuls are too slow for 4096 tokens).
        rollout = torch.tensor(
            [self._prompt_and_continuation(self.out, [7, 300, 11], SEQ_LEN)]
        )
        every_token = torch.randperm(
            vocab, generator=torch.Generator().manual_seed(0)
        ).view(-1, 512)
        nt = torch.tensor(ssm.next_token_map(self.out))
        for dtype, batches in (
            (torch.float32, (rollout, every_token)),
            (torch.bfloat16, (rollout,)),
        ):
            model = AutoModelForCausalLM.from_pretrained(self.target_dir, dtype=dtype)
            for ids in batches:
                with torch.no_grad():
                    top2 = model(ids).logits.float().topk(2, dim=-1)
                gap = (top2.values[..., 0] - top2.values[..., 1]).min().item()
                print(
                    f"target {dtype} {tuple(ids.shape)}: min top1-top2 logit gap {gap:.2f}"
                )
                with self.subTest(dtype=dtype, shape=tuple(ids.shape)):
                    self.assertTrue(torch.equal(top2.indices[..., 0], nt[ids]))
                    self.assertGreater(gap, ssm.TARGET_MIN_MARGIN)

    def test_map_structure(self) -> None:
        for p, (out, _, _) in self.dirs.items():
            spec = ssm.load_spec(out)
            nt, succ = torch.tensor(spec["next_token"]), torch.tensor(
                spec["draft_successor"]
            )
            cycle = torch.nonzero(succ >= 0).squeeze(1)
            # pi is one cycle over the draft's hot tokens and never emits specials.
            x, seen = cycle[0].item(), set()
            for _ in range(cycle.numel()):
                seen.add(x)
                x = nt[x].item()
            self.assertEqual(seen, set(cycle.tolist()))
            self.assertGreaterEqual(nt.min().item(), ssm.NUM_SPECIAL_TOKENS)
            agree = (nt[cycle] == succ[cycle]).float().mean().item()
            self.assertAlmostEqual(agree, p, delta=0.01)

    def _measure_acceptance(
        self, p: float, kv_check: bool = False, stale_kv: Optional[str] = None
    ) -> Tuple[float, float, float]:
        """(first-token accept rate, accept length, min draft logit gap).

        stale_kv: None (valid draft KV cache) or a kind of _stale_draft_kv.
        """
        out, target_dir, draft_dir = (self.kv_check_dirs if kv_check else self.dirs)[p]
        succ = ssm.load_spec(out)["draft_successor"]
        seq = self._prompt_and_continuation(out, PROMPT, SEQ_LEN)
        # The aux states only feed fc; the draft itself runs in bf16.
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        draft = Eagle3DraftEmulator(draft_dir, torch.bfloat16)
        aux = _target_aux(target, torch.tensor(seq))
        cache = _draft_extend_kv(draft, seq, aux)
        if stale_kv is not None:
            other = self._prompt_and_continuation(
                out, OTHER_PROMPT, len(seq) - len(OTHER_PROMPT)
            )
            other_kv = _draft_extend_kv(
                draft, other, _target_aux(target, torch.tensor(other))
            )
            cache = _stale_draft_kv(stale_kv, cache, other_kv)
        drafts, margin = _simulate_chain(draft, seq, aux, 3, NUM_STEPS, cache)
        first_hits, lengths = [], []
        for t, chain in drafts:
            if stale_kv is None:
                intended = [succ[seq[t + 1]]]
                for _ in range(NUM_STEPS - 1):
                    intended.append(succ[intended[-1]])
                self.assertEqual(chain, intended, f"draft chain at position {t}")
            accepted = 0
            while accepted < NUM_STEPS and chain[accepted] == seq[t + 2 + accepted]:
                accepted += 1
            first_hits.append(float(accepted > 0))
            lengths.append(1.0 + accepted)
        return sum(first_hits) / len(first_hits), sum(lengths) / len(lengths), margin

    def _check_valid_kv_acceptance(self, kv_check: bool) -> None:
        for p in (0.6, 0.9):
            first, length, margin = self._measure_acceptance(p, kv_check)
            expected = ssm.expected_accept_length(p, NUM_STEPS)
            print(
                f"kv_check={kv_check} P={p}: first-token accept {first:.3f}, "
                f"accept length {length:.3f} (expected {expected:.3f}), "
                f"draft margin {margin:.2f}"
            )
            with self.subTest(p=p):
                self.assertGreater(margin, DRAFT_MIN_MARGIN)
                self.assertAlmostEqual(first, p, delta=FIRST_TOKEN_TOL)
                self.assertLess(
                    abs(length - expected) / expected, ACCEPT_LENGTH_REL_TOL
                )

    def test_draft_emulation_acceptance(self) -> None:
        self._check_valid_kv_acceptance(kv_check=False)

    def test_kv_check_draft_emulation_acceptance(self) -> None:
        """With a valid draft KV cache the variant drafts exactly like the default."""
        self._check_valid_kv_acceptance(kv_check=True)

    def test_kv_check_draft_needs_valid_previous_kv(self) -> None:
        for p in (0.6, 0.9):
            for stale_kv in ("zero", "other_request"):
                first, length, _ = self._measure_acceptance(p, True, stale_kv)
                print(
                    f"kv_check P={p} stale {stale_kv}: first-token accept "
                    f"{first:.3f}, accept length {length:.3f}"
                )
                with self.subTest(p=p, stale_kv=stale_kv):
                    self.assertLess(first, STALE_KV_MAX_FIRST_ACCEPT)
                    self.assertLess(length, STALE_KV_MAX_ACCEPT_LENGTH)
            # Only the previous position counts: it is zeroed for half the points.
            first, _, _ = self._measure_acceptance(p, True, "odd_positions_zero")
            print(f"kv_check P={p} stale odd positions: first-token accept {first:.3f}")
            self.assertAlmostEqual(first, p / 2, delta=FIRST_TOKEN_TOL)
        # The gap closed by the variant: the default draft ignores earlier draft KV.
        first, _, _ = self._measure_acceptance(0.9, stale_kv="zero")
        self.assertAlmostEqual(first, 0.9, delta=FIRST_TOKEN_TOL)

    def test_kv_check_keeps_target_and_draft_layout(self) -> None:
        for p, (out, target_dir, draft_dir) in self.kv_check_dirs.items():
            default_out, default_target, default_draft = self.dirs[p]
            for rel in ("model.safetensors", "config.json"):
                self.assertEqual(
                    _read(target_dir, rel), _read(default_target, rel), rel
                )
            spec = ssm.load_spec(out)
            self.assertTrue(spec["draft_kv_check"])
            self.assertEqual(spec["next_token"], ssm.next_token_map(default_out))
            self.assertEqual(_tensor_shapes(draft_dir), _tensor_shapes(default_draft))
            cfg, default_cfg = (
                json.loads(_read(d, "config.json")) for d in (draft_dir, default_draft)
            )
            self.assertEqual(cfg.keys(), default_cfg.keys())
            differs = {k for k in cfg if cfg[k] != default_cfg[k]}
            self.assertEqual(differs, {"rope_theta", "rope_parameters"})
        with tempfile.TemporaryDirectory() as tmp:
            ssm.generate("tiny", tmp, draft_accept=0.9, seed=1, draft_kv_check=True)
            for rel in _relative_files(tmp):
                self.assertEqual(
                    _read(tmp, rel), _read(self.kv_check_dirs[0.9][0], rel), rel
                )

    def test_kv_check_rope_shift_back(self) -> None:
        gen = torch.Generator().manual_seed(0)
        for head_dim in (64, 128):
            q, k = torch.randn(2, 1, 1, head_dim, generator=gen)
            shift = ssm._rope_shift_back(head_dim, "cpu")
            for t in (1, 7, 4000):
                rotated = [
                    _rope_neox(x, torch.tensor([pos]), ssm.KV_CHECK_ROPE_THETA)
                    for x, pos in ((q @ shift.t(), t), (k, t - 1))
                ]
                self.assertAlmostEqual(
                    (rotated[0] * rotated[1]).sum().item(),
                    (q * k).sum().item(),
                    delta=1e-3 * head_dim,
                )

    def test_content_shift_pair_keeps_each_continuation_in_its_region(self) -> None:
        acceptances = (0.95, 0.3)
        tmap = ssm.build_token_map(4096, 1024, acceptances, seed=3)
        regions = [set(r.tolist()) for r in tmap.region_tokens]
        self.assertEqual(len(regions), 2)
        self.assertFalse(regions[0] & regions[1])
        nt, succ = tmap.next_token, tmap.successor
        for region, p in zip(tmap.region_tokens, acceptances):
            inside = set(region.tolist())
            self.assertTrue(set(nt[region].tolist()) <= inside)
            self.assertTrue(set(succ[region].tolist()) <= inside)
            agree = (nt[region] == succ[region]).float().mean().item()
            self.assertAlmostEqual(agree, p, delta=0.01)
        out = os.path.join(self._tmp.name, "shift")
        ssm.generate("tiny", out, draft_accept=acceptances, seed=1)
        spec = ssm.load_spec(out)
        self.assertEqual(spec["draft_accept"], list(acceptances))
        rng = random.Random(0)
        for region in (0, 1):
            prompt = ssm.region_prompt(spec, region, 16, rng)
            continuation = ssm.greedy_continuation(spec["next_token"], prompt, 64)
            self.assertTrue(set(continuation) <= set(spec["region_tokens"][region]))
        # One P: the map of a single region, as before.
        single = ssm.build_token_map(4096, 1024, 0.95, seed=3)
        self.assertEqual(len(single.region_tokens), 1)
        self.assertNotIn("region_tokens", self.spec)

    def test_default_bytes_unchanged(self) -> None:
        """Default outputs are pinned (digest taken before --draft-kv-check existed)."""
        self.assertEqual(_digest(self.dirs[0.9][0]), DEFAULT_TINY_DIGEST)

    def test_expected_accept_length(self) -> None:
        self.assertAlmostEqual(ssm.expected_accept_length(0.5, 3), 1.875)
        self.assertAlmostEqual(ssm.expected_accept_length(0.9, 2, topk=4), 2.71)
        self.assertAlmostEqual(ssm.expected_accept_length(1.0, 5), 6.0)
        self.assertAlmostEqual(ssm.expected_accept_length(0.0, 5), 1.0)

    def test_draft_checkpoint_matches_sglang_eagle3_loader(self) -> None:
        cfg = AutoConfig.from_pretrained(self.draft_dir)
        target_cfg = AutoConfig.from_pretrained(self.target_dir)
        d, vocab, draft_vocab = cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size
        hd, heads, kv_heads = (
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
        )
        inter = cfg.intermediate_size
        self.assertEqual(cfg.architectures, ["LlamaForCausalLMEagle3"])
        self.assertEqual(cfg.num_hidden_layers, 1)
        self.assertFalse(cfg.tie_word_embeddings)
        self.assertEqual((d, vocab), (target_cfg.hidden_size, target_cfg.vocab_size))
        self.assertLess(draft_vocab, vocab)
        # llama.py: layers_to_capture = [i + 1 for i in eagle_aux_hidden_state_layer_ids].
        layer_ids = cfg.eagle_config["eagle_aux_hidden_state_layer_ids"]
        num_layers = target_cfg.num_hidden_layers
        self.assertEqual(
            [i + 1 for i in layer_ids], [2, num_layers // 2, num_layers - 3]
        )
        expected = {
            "embed_tokens.weight": (vocab, d),
            "fc.weight": (d, 3 * d),
            "midlayer.input_layernorm.weight": (d,),
            "midlayer.hidden_norm.weight": (d,),
            "midlayer.post_attention_layernorm.weight": (d,),
            "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * d),
            "midlayer.self_attn.k_proj.weight": (kv_heads * hd, 2 * d),
            "midlayer.self_attn.v_proj.weight": (kv_heads * hd, 2 * d),
            "midlayer.self_attn.o_proj.weight": (d, heads * hd),
            "midlayer.mlp.gate_proj.weight": (inter, d),
            "midlayer.mlp.up_proj.weight": (inter, d),
            "midlayer.mlp.down_proj.weight": (d, inter),
            "norm.weight": (d,),
            "lm_head.weight": (draft_vocab, d),
            "d2t": (draft_vocab,),
            "t2d": (vocab,),
        }
        with safe_open(os.path.join(self.draft_dir, "model.safetensors"), "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        self.assertEqual(shapes, expected)
        self.assertEqual(d2t.dtype, torch.int64)
        self.assertEqual(t2d.dtype, torch.bool)
        hot = d2t + torch.arange(draft_vocab)
        self.assertTrue(torch.all(hot[1:] > hot[:-1]))
        self.assertFalse(torch.equal(hot, torch.arange(draft_vocab)))
        self.assertTrue(torch.equal(torch.nonzero(t2d).squeeze(1), hot))

    def test_target_checkpoint_loads_without_missing_keys(self) -> None:
        model, info = AutoModelForCausalLM.from_pretrained(
            self.target_dir, output_loading_info=True
        )
        self.assertEqual(type(model).__name__, "LlamaForCausalLM")
        for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
            self.assertEqual(list(info[key]), [], key)
        cfg = model.config
        self.assertGreaterEqual(cfg.num_hidden_layers, 7)
        self.assertFalse(cfg.tie_word_embeddings)
        self.assertNotEqual(
            model.lm_head.weight.data_ptr(), model.model.embed_tokens.weight.data_ptr()
        )

    def test_sharded_writer_index(self) -> None:
        tensors = {
            f"t{i}": torch.full((256,), float(i), dtype=torch.bfloat16)
            for i in range(5)
        }
        with tempfile.TemporaryDirectory() as out:
            writer = ssm.ShardWriter(out, max_bytes=1100)
            for name, tensor in tensors.items():
                writer.add(name, tensor)
            writer.close()
            with open(os.path.join(out, "model.safetensors.index.json")) as f:
                weight_map = json.load(f)["weight_map"]
            self.assertEqual(sorted(weight_map), sorted(tensors))
            self.assertEqual(len(set(weight_map.values())), 3)
            expected_files = set(weight_map.values()) | {"model.safetensors.index.json"}
            self.assertEqual(set(os.listdir(out)), expected_files)
            for name, shard in weight_map.items():
                self.assertTrue(
                    torch.equal(
                        load_file(os.path.join(out, shard))[name], tensors[name]
                    )
                )

    def test_deterministic_bytes(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            dirs = [os.path.join(tmp, name) for name in ("a", "b", "c")]
            for out, seed in zip(dirs, (3, 3, 4)):
                ssm.generate(
                    "tiny", out, draft_accept=0.7, seed=seed, draft_vocab_size=1024
                )
            files = _relative_files(dirs[0])
            self.assertIn("target/model.safetensors", files)
            self.assertEqual(files, _relative_files(dirs[1]))
            for rel in files:
                self.assertEqual(_read(dirs[0], rel), _read(dirs[1], rel), rel)
            for rel in (
                "target/model.safetensors",
                "draft/model.safetensors",
                ssm.SPEC_FILE,
            ):
                self.assertNotEqual(_read(dirs[0], rel), _read(dirs[2], rel), rel)

    def test_tokenizer_round_trip(self) -> None:
        tok = AutoTokenizer.from_pretrained(self.target_dir)
        vocab = self.spec["vocab_size"]
        self.assertEqual(len(tok), vocab)
        self.assertEqual(tok.eos_token_id, ssm.EOS_TOKEN_ID)
        ids = torch.randint(
            ssm.NUM_SPECIAL_TOKENS,
            vocab,
            (200,),
            generator=torch.Generator().manual_seed(0),
        ).tolist()
        ids = ids + [vocab - 1, ssm.NUM_SPECIAL_TOKENS]
        text = tok.decode(ids)
        self.assertEqual(tok(text, add_special_tokens=True)["input_ids"], ids)
        self.assertEqual(tok("w5 </s> w17")["input_ids"], [5, ssm.EOS_TOKEN_ID, 17])
        self.assertEqual(tok(ssm.prompt_text(ids))["input_ids"], ids)
        self.assertEqual(ssm.token_ids_in(text), ids)
        self.assertEqual(ssm.token_ids_in(ssm.token_regex(ids)), ids)
        self.assertEqual(tok.decode([17]), ssm.token_name(17))


def _relative_files(root: str) -> List[str]:
    return sorted(
        os.path.relpath(os.path.join(dirpath, name), root)
        for dirpath, _, names in os.walk(root)
        for name in names
    )


def _read(root: str, rel: str) -> bytes:
    with open(os.path.join(root, rel), "rb") as f:
        return f.read()


def _digest(root: str) -> str:
    """sha256 over (path, bytes) of every file but the tokenizers-library output and
    the copy of the target's tokenizer (tokenizer_dir)."""
    h = hashlib.sha256()
    for rel in _relative_files(root):
        if rel != os.path.join("target", "tokenizer.json") and not rel.startswith(
            "tokenizer" + os.sep
        ):
            h.update(rel.encode() + b"\0" + _read(root, rel))
    return h.hexdigest()


def _tensor_shapes(model_dir: str) -> Dict[str, Tuple[int, ...]]:
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _stale_draft_kv(kind: str, kv: KV, other_kv: KV) -> KV:
    """Draft KV cache left by a bug that skipped the writes of kv (valid)."""
    if kind == "zero":
        return torch.zeros_like(kv[0]), torch.zeros_like(kv[1])
    if kind == "other_request":  # slots last written by another request
        return other_kv
    if kind == "odd_positions_zero":
        odd = (torch.arange(kv[0].shape[0]) % 2 == 1)[:, None, None]
        return kv[0].masked_fill(odd, 0), kv[1].masked_fill(odd, 0)
    raise ValueError(kind)


class TestOtherArchitectures(CustomTestCase):
    """The Qwen2 (dense32b) and Qwen3-MoE (qwen3moe) targets, at the tiny shapes: they
    load into transformers and their greedy continuation follows the map."""

    def test_target_loads_and_follows_the_map(self) -> None:
        for preset, architecture in (
            ("tiny-qwen2", "Qwen2ForCausalLM"),
            ("tiny-qwen3moe", "Qwen3MoeForCausalLM"),
        ):
            with self.subTest(preset=preset), tempfile.TemporaryDirectory() as out:
                target_dir, _ = ssm.generate(preset, out, draft_accept=0.9, seed=1)
                model, info = AutoModelForCausalLM.from_pretrained(
                    target_dir, output_loading_info=True, dtype=torch.float32
                )
                self.assertEqual(type(model).__name__, architecture)
                for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
                    self.assertEqual(list(info[key]), [], key)
                prompt = [7, 300, 11]
                nt = ssm.next_token_map(out)
                ids = torch.tensor(
                    [prompt + ssm.greedy_continuation(nt, prompt, SEQ_LEN)]
                )
                with torch.no_grad():
                    top2 = model(ids).logits.topk(2, dim=-1)
                gap = (top2.values[..., 0] - top2.values[..., 1]).min().item()
                print(f"{preset} target fp32: min top1-top2 logit gap {gap:.2f}")
                self.assertTrue(
                    torch.equal(top2.indices[..., 0], torch.tensor(nt)[ids])
                )
                self.assertGreater(gap, ssm.TARGET_MIN_MARGIN)

    def test_tokenizer_dir_encodes_text_for_every_architecture(self) -> None:
        # transformers 5 rebuilds a qwen2 config's tokenizer as BPE, which encodes
        # the synthetic words of the target's own directory to nothing.
        from sglang.srt.utils.hf_transformers_utils import get_tokenizer

        ids = [7, 300, 11]
        for preset in ("tiny-qwen2", "tiny-qwen3moe", "tiny"):
            with self.subTest(preset=preset), tempfile.TemporaryDirectory() as out:
                target_dir, _ = ssm.generate(preset, out, draft_accept=0.9, seed=1)
                tokenizer = get_tokenizer(ssm.tokenizer_dir(target_dir))
                self.assertEqual(tokenizer.encode(ssm.prompt_text(ids)), ids)
                self.assertEqual(tokenizer.decode(ids), ssm.prompt_text(ids))
                # The server's warm-up prompt: unknown words, one <unk> each.
                self.assertEqual(
                    tokenizer.encode("The capital city of France is"), [0] * 6
                )

    def test_servers_of_a_synthetic_target_get_its_tokenizer_dir(self) -> None:
        from sglang.test.spec_engine_utils import with_synthetic_tokenizer

        with tempfile.TemporaryDirectory() as out:
            target_dir, _ = ssm.generate("tiny", out, draft_accept=0.9, seed=1)
            self.assertEqual(
                with_synthetic_tokenizer(target_dir, ["--tp", "1"]),
                ["--tp", "1", "--tokenizer-path", ssm.tokenizer_dir(target_dir)],
            )
            for named in (["--tokenizer-path", "/mine"], ["--tokenizer-path=/mine"]):
                self.assertEqual(with_synthetic_tokenizer(target_dir, named), named)
            # A model directory outside a synthetic pair keeps its own tokenizer.
            os.remove(os.path.join(out, ssm.SPEC_FILE))
            self.assertEqual(with_synthetic_tokenizer(target_dir, []), [])


class TestEagleDraft(CustomTestCase):
    """The EAGLE draft (draft_arch "eagle"): a LlamaForCausalLMEagle checkpoint whose
    output the target's lm_head, which an EAGLE draft shares, maps to what the
    target decodes."""

    preset = "tiny"
    architecture = "LlamaForCausalLMEagle"

    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        cls.out = cls._tmp.name
        cls.target_dir, cls.draft_dir = ssm.generate(
            cls.preset, cls.out, draft_accept=1.0, seed=1, draft_arch="eagle"
        )

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def test_checkpoint_layout(self) -> None:
        cfg = AutoConfig.from_pretrained(self.draft_dir)
        self.assertEqual(cfg.architectures, [self.architecture])
        self.assertEqual(cfg.num_hidden_layers, 1)
        d, hd = cfg.hidden_size, cfg.head_dim
        q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        inter = ssm.PRESETS[self.preset].draft_intermediate_size
        self.assertEqual(cfg.intermediate_size, inter)
        # llama_eagle.py: fc over cat(embedding, target hidden state); no
        # input_layernorm in the first layer, no final norm, the target's lm_head.
        self.assertEqual(
            _tensor_shapes(self.draft_dir),
            {
                **self.attention_biases(q, kv),
                "embed_tokens.weight": (cfg.vocab_size, d),
                "fc.weight": (d, 2 * d),
                "fc.bias": (d,),
                "layers.0.self_attn.q_proj.weight": (q, d),
                "layers.0.self_attn.k_proj.weight": (kv, d),
                "layers.0.self_attn.v_proj.weight": (kv, d),
                "layers.0.self_attn.o_proj.weight": (d, q),
                "layers.0.post_attention_layernorm.weight": (d,),
                "layers.0.mlp.gate_proj.weight": (inter, d),
                "layers.0.mlp.up_proj.weight": (inter, d),
                "layers.0.mlp.down_proj.weight": (d, inter),
            },
        )
        self.assertEqual(ssm.load_spec(self.out)["draft_arch"], "eagle")

    def attention_biases(self, q: int, kv: int) -> dict:
        return {}

    def test_proposes_what_the_target_decodes(self) -> None:
        draft = load_file(os.path.join(self.draft_dir, "model.safetensors"))
        target = load_file(os.path.join(self.target_dir, "model.safetensors"))
        # The layer adds nothing to its input: the output is fc's.
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            self.assertFalse(draft[f"layers.0.{name}"].any(), name)
        embed = draft["embed_tokens.weight"]
        self.assertTrue(torch.equal(embed, target["model.embed_tokens.weight"]))
        target_hidden = torch.randn(embed.shape).to(embed.dtype)  # fc ignores it
        fc_input = torch.cat([embed, target_hidden], dim=-1).float()
        out = fc_input @ draft["fc.weight"].float().T + draft["fc.bias"].float()
        logits = out.to(torch.bfloat16).float() @ target["lm_head.weight"].float().T
        top2 = logits.topk(2, dim=-1)
        gap = (top2.values[:, 0] - top2.values[:, 1]).min().item()
        print(f"EAGLE draft, every token: min top1-top2 logit gap {gap:.2f}")
        next_token = torch.tensor(ssm.next_token_map(self.out))
        self.assertTrue(torch.equal(top2.indices[:, 0], next_token))
        self.assertGreater(gap, ssm.TARGET_MIN_MARGIN)


class TestQwen2EagleDraft(TestEagleDraft):
    """The EAGLE draft of a Qwen2 target: a Qwen2ForCausalLMEagle checkpoint, whose
    q/k/v projections have biases."""

    preset = "tiny-qwen2"
    architecture = "Qwen2ForCausalLMEagle"

    def attention_biases(self, q: int, kv: int) -> dict:
        return {
            f"layers.0.self_attn.{name}.bias": (rows,)
            for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))
        }


class TestEagleDraftRefusals(CustomTestCase):
    def test_needs_full_acceptance(self) -> None:
        with tempfile.TemporaryDirectory() as out, self.assertRaises(ValueError):
            ssm.generate("tiny", out, draft_accept=0.9, draft_arch="eagle")

    def test_is_refused_for_a_target_without_one(self) -> None:
        with tempfile.TemporaryDirectory() as out, self.assertRaisesRegex(
            ValueError, "no EAGLE draft for a qwen3_moe target"
        ):
            ssm.generate("tiny-qwen3moe", out, draft_accept=1.0, draft_arch="eagle")


class TestSyntheticPairCache(CustomTestCase):
    def test_a_pair_written_by_other_generator_code_is_written_again(self) -> None:
        with tempfile.TemporaryDirectory() as root, mock.patch.dict(
            os.environ, {spec_engine_utils.SYNTHETIC_MODELS_DIR_ENV: root}
        ):
            target, _ = spec_engine_utils.synthetic_pair("tiny", 0.8)
            pair_dir = Path(target).parent
            with mock.patch.object(
                ssm, "generate", side_effect=AssertionError("generated again")
            ):
                self.assertEqual(
                    spec_engine_utils.synthetic_pair("tiny", 0.8)[0], target
                )
            # As left by an older generator: another digest, a shard it wrote.
            digest = pair_dir / spec_engine_utils.GENERATOR_DIGEST_FILE
            digest.write_text("older")
            (pair_dir / "draft" / "model-00002-of-00002.safetensors").write_text("")
            self.assertFalse(spec_engine_utils.synthetic_pair_is_current(pair_dir))
            spec_engine_utils.synthetic_pair("tiny", 0.8)
            self.assertTrue(spec_engine_utils.synthetic_pair_is_current(pair_dir))
            self.assertEqual(digest.read_text(), spec_engine_utils.generator_digest())
            self.assertEqual(
                sorted(os.listdir(pair_dir / "draft")),
                ["config.json", "model.safetensors"],
            )


if __name__ == "__main__":
    unittest.main()
