"""Synthetic target + EAGLE-3 draft checkpoints with controlled draft acceptance.

No weights can be downloaded in CI, and random-weight checkpoints are useless
for speculative decoding tests (near-tied logits, accept length ~1.0). This
module writes, in seconds and without materializing the model in RAM, a target
checkpoint (``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3MoeForCausalLM``)
and an EAGLE-3 draft (``LlamaForCausalLMEagle3``) with these properties:

(a) the target's greedy next token is a fixed function ``pi`` of the last token,
    decided by a large logit margin (bf16-safe);
(b) the draft proposes ``s(y)`` for its current input token ``y``, where ``s`` is
    a fixed "successor" function, and ``pi(x) == s(x)`` holds for a fraction
    ``P`` (``--draft-accept``) of the tokens, so acceptance is a parameter;
(c) the bytes written are a deterministic function of (preset, P, seed, device,
    draft vocab size, layer count, ``--draft-kv-check``).

The default draft's proposal depends only on its current input token, so it
works the same with a stale draft KV cache. ``--draft-kv-check`` writes a draft
(same target, same proposals) that is right only if the draft KV cache holds,
at the previous position, what the draft extend writes there (see below).
``--draft-arch eagle`` writes an EAGLE draft (``LlamaForCausalLMEagle``, or
``Qwen2ForCausalLMEagle`` for a Qwen2 target; one layer) instead, which proposes
what the target decodes: acceptance 1 (``_write_eagle_draft``).

Token map
---------
Ids 0, 1, 2 are ``<unk>``, ``<s>``, ``</s>``; they are never generated. The hot
set ``H`` (the draft vocabulary, ``d2t``/``t2d``) is a seeded random subset of
the other ids. Its members, sorted, form a cycle ``c_0 < c_1 < ... < c_{n-1}``
and ``s(c_j) = c_{j+1 mod n}``. Exactly ``round((1 - P) n)`` cycle edges are
cut (positions drawn without replacement); the resulting segments are shuffled
into one big cycle, so ``pi(x) = s(x)`` inside a segment and ``pi(x)`` is the
start of a random segment at a cut. ``pi`` is thus a single cycle over ``H``
(generation never revisits a token within ``n`` steps), and every other token
(cold or special) maps to a random hot token.

A content-shift pair (``--draft-accept P1,P2,...``) splits the sorted cycle into
equal consecutive regions, each cut and shuffled into a cycle of its own with its
own ``P``: a continuation stays in the region its prompt's last token belongs to
(``region_prompt``), so the acceptance of a request is set by its prompt, and a
workload can move from easy to hard prompts mid-run. The spec file lists the
regions' tokens (``region_tokens``).

Weights
-------
Every token ``x`` gets a code ``u_x``: a unit vector in the first
``c = num_kv_heads * head_dim`` hidden dims (the "code dims"), made of
``2 * num_kv_heads`` independently normalized random chunks of ``head_dim / 2``
dims. The embedding is ``sqrt(c) * u_x`` padded with zeros; distinct codes are
near-orthogonal (|<u_x, u_y>| ~ 1/sqrt(c)).

* Target: decoder layers are small random (each layer writes ~``0.05 /
  sqrt(2L)`` of the embedding norm into the residual stream), so the final
  hidden state stays dominated by ``e_x``. ``lm_head`` row ``y`` is
  ``TARGET_LOGIT_SCALE / sqrt(hidden) * sum_{x: pi(x) = y} u_x``, hence the logit
  of ``pi(x)`` is ~``TARGET_LOGIT_SCALE`` (40) and every other logit is a sum of
  a few cross terms (< ~0.75 of it even for the tiny preset's 256 code dims).
* Draft (one EAGLE-3 layer): in ``llama_eagle3.py`` the layer input is
  ``cat(input_layernorm(embed), hidden_norm(h))`` and the residual is ``h``
  (``fc`` of the target's aux hidden states at the first step, the draft's own
  pre-norm output afterwards). Attention routes the *current* token's code to
  the output: each kv head ``g`` has q = k = a scaled copy of code chunk
  ``(g, 0)`` placed only in the slowest-rotating neox RoPE pairs
  (``head_dim/4 .. head_dim/2``) with ``rope_theta = 1e12``, so a query attends
  (score ``DRAFT_ATTN_SHARPNESS`` = 64 vs. < ~0.7 of that) to positions holding
  the same token; value = code slice ``g`` of the embedding minus code slice
  ``g`` of ``hidden_norm(h)``, and ``o_proj`` maps it back onto the code dims.
  The minus term cancels the previous step's output carried in the residual.
  ``fc`` and the MLP are small random and write only outside the code dims.
  The draft ``lm_head`` row of hot token ``t`` is
  ``DRAFT_LOGIT_SCALE / sqrt(hidden) * u_{s^{-1}(t)}``, so the draft's top-1 is
  ``s(y)`` with margin ~0.7 * ``DRAFT_LOGIT_SCALE``. If ``y`` also occurs
  earlier in the context, attention splits between those positions and the
  cancellation is partial, which roughly halves that margin (the top-1 is
  unchanged). Draft inputs are always hot tokens (generated or drafted), so
  ``s(y)`` is always in the draft vocab.

Measured on the tiny preset (CPU tests): target top1 - top2 logit gap >= ~9
(fp32 and bf16; ``TARGET_MIN_MARGIN`` = 6 is asserted), draft gap >= ~8.7 in
a bf16 emulation of the SGLang draft forward.

KV-checked draft (``--draft-kv-check``)
---------------------------------------
Let ``y`` be the draft input at position ``t`` and ``y'`` the one at ``t - 1``
(in the extend, ``y'`` is the target's input token at ``t``; in a chain step,
the previous step's input). Only the draft's fc, attention and RoPE base
differ from the default draft:

* ``fc`` also maps the code dims of the 3 aux states (~ ``e_{y'}``) to
  ``sqrt(d / c) e_{y'}`` = the code part of ``input_layernorm(embed(y'))``, so
  the residual ``h`` holds ``code(y')`` in every draft forward (the chain's
  ``h`` is the previous step's output, which holds it too, see below).
* Each kv head ``g``: k = scaled code slice ``g`` of ``input_layernorm(embed)``
  over all head dims, v = the same slice unscaled. Half of its query heads
  ("copy") attend to their own position (q = k direction, score
  ``DRAFT_ATTN_SHARPNESS``) and add v; the others ("check") have q =
  ``KV_CHECK_SELF_SCORE`` * own code + ``KV_CHECK_PREV_SCORE`` * R (code slice
  ``g`` of ``hidden_norm(h)``, i.e. of ``y'``) and subtract v. R undoes
  the RoPE rotation of a one-position offset, so a check head scores
  ``64 + 32 x`` on position ``t - 1`` if its key holds ``y'`` and ``32 + 64 x``
  on its own position (``x``: overlap of the slices of ``y`` and ``y'``, |x| <
  ~0.4); measured on the tiny preset, ``t - 1`` wins by >= ~19 over the own
  position and >= ~20 over every other position.
* Valid KV: residual code = ``code(y') + code(y) - code(y') = code(y)``; the
  unchanged lm_head proposes ``s(y)`` as the default draft does (same chains,
  same acceptance law, draft gap ~21 in the bf16 emulation). Stale KV at
  ``t - 1``: the check heads fall back to their own position (or, for ~16%
  of heads, to random ones), so they subtract ``code(y)`` (or a random code)
  instead, the residual keeps ``code(y')`` and the draft proposes ``s(y')``
  (= ``y`` itself unless ``y' -> y`` is a cut), which is not ``pi(y)`` (up
  to ~1/n coincidences after a cut).
* ``rope_theta`` is ``KV_CHECK_ROPE_THETA`` = 10 (the heads only need offsets
  0 and 1, where R makes RoPE exact), so all RoPE pairs rotate: a key holding
  ``y'`` that was written at another position (a slot last used by another
  request on the same arc of ``pi``) scores far lower, unless it is only 1-2
  positions off (RoPE turns by at most 1 rad per position).

Only the token held at ``t - 1`` is checked (k and v ignore ``h``), not the
hidden state it was written with, nor positions before ``t - 1``. Measured on
the tiny preset (bf16 emulation, 3 chain steps, every position of a
600-token sequence): previous-position draft KV zeroed or taken from another
request -> first-token accept <= 0.002 and accept length <= 1.002 (P = 0.6
and 0.9); zeroed at every other position -> first-token accept P / 2.

Expected accept length
----------------------
With verified last token ``x`` the draft chain is ``s(x), s(s(x)), ...`` and
draft token ``i`` is accepted iff the ``i`` tokens starting at ``x`` all satisfy
``pi = s``, i.e. with probability ``P^i`` (cut positions are drawn without
replacement, so up to O(1/n) corrections). Counting the bonus token, the
expected accept length for a chain of ``k`` steps with topk=1 is
``1 + P + P^2 + ... + P^k``. With topk > 1 the top-1 chain is still the
highest-scoring path of the tree (draft top-1 probability ~1), so it is always
verified; the 2nd..topk-th candidates are pseudo-random hot tokens and only
add acceptance when they hit the random segment start after a cut, which has
probability ~``(topk - 1) / n`` (< 1e-3 here), so the same formula applies.
The first-drafted-token acceptance rate is ``P``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import random
import re
import shutil
import zlib
from typing import (
    Callable,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import torch
from safetensors.torch import save_file

# The draft acceptance P, or one P per region of a content-shift pair.
DraftAccept = Union[float, Sequence[float]]

NUM_SPECIAL_TOKENS = 3
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
TARGET_LOGIT_SCALE = 40.0
DRAFT_LOGIT_SCALE = 30.0
DRAFT_ATTN_SHARPNESS = 64.0
DRAFT_ROPE_THETA = 1e12
# --draft-kv-check: attention score of a "check" head at the previous position
# (holding its expected token) and at its own position (the fallback).
KV_CHECK_PREV_SCORE = 64.0
KV_CHECK_SELF_SCORE = 32.0
# Its RoPE base: all pairs rotate, so a key holding that token at another
# position (e.g. a stale slot of another request) scores much lower.
KV_CHECK_ROPE_THETA = 10.0
TARGET_LAYER_NOISE = 0.05
DRAFT_FILLER_NOISE = 0.05
MAX_SHARD_BYTES = 4 * 1024**3
SPEC_FILE = "synthetic_spec.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TOKEN_NAME = re.compile(r"w(\d+)")
# Token strings of write_json_object_tokenizer.
JSON_OBJECT_OPENER = '{"a":"'
JSON_OBJECT_CLOSER = '"}'
# Lower bound of the target's top1 - top2 logit gap that the CPU tests assert.
TARGET_MIN_MARGIN = 6.0
DTYPE = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Preset:
    architecture: str  # "llama", "qwen2" or "qwen3_moe"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    draft_intermediate_size: int
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0


PRESETS: Dict[str, Preset] = {
    "tiny": Preset(
        "llama", 384, 8, 8, 4, 64, 768, 4096, 2048, 768, 10000.0, 8192, 1e-5
    ),
    "llama8b": Preset(
        "llama",
        4096,
        32,
        32,
        8,
        128,
        14336,
        128256,
        32000,
        14336,
        500000.0,
        131072,
        1e-5,
    ),
    "dense32b": Preset(
        "qwen2", 5120, 64, 40, 8, 128, 27648, 152064, 32000, 27648, 1e6, 32768, 1e-6
    ),
    # Qwen3-30B-A3B has 48 layers (~60 GB in bf16); 24 keep it within one H200
    # host's disk.
    "qwen3moe": Preset(
        "qwen3_moe",
        2048,
        24,
        32,
        4,
        128,
        6144,
        151936,
        32000,
        6144,
        1e6,
        40960,
        1e-6,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
}
# dense32b is ~64 GB in bf16, more than one H200 host's disk; 32 of its 64 layers
# (~34 GB) keep it there, as qwen3moe's 24 of 48 do. Serve a qwen2 target with
# --tokenizer-path tokenizer_dir(target) (see there).
PRESETS["dense32b-32l"] = dataclasses.replace(PRESETS["dense32b"], num_layers=32)
# The tiny shapes in the other architectures (CPU tests of the dense32b / qwen3moe
# paths). The Qwen2 one has as many hidden units as its heads' (as dense32b does):
# on a CPU, SGLang's Qwen2 layers take their head size from the two.
PRESETS["tiny-qwen2"] = dataclasses.replace(
    PRESETS["tiny"], architecture="qwen2", hidden_size=512
)
PRESETS["tiny-qwen3moe"] = dataclasses.replace(
    PRESETS["tiny"],
    architecture="qwen3_moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=192,
)

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# The EAGLE draft of a target, by the target's architecture.
EAGLE_DRAFT_ARCHITECTURES = {
    "llama": "LlamaForCausalLMEagle",
    "qwen2": "Qwen2ForCausalLMEagle",
}


@dataclasses.dataclass
class TokenMap:
    """pi (target greedy map), s (draft successor, -1 off the cycle), hot ids, and
    the cycle tokens of each acceptance region."""

    next_token: torch.Tensor
    successor: torch.Tensor
    hot_token_ids: torch.Tensor
    region_tokens: List[torch.Tensor]


def expected_accept_length(p: float, num_steps: int, topk: int = 1) -> float:
    """E[accepted draft tokens + 1 bonus] = sum_{i=0..num_steps} p^i (any topk, see
    the module doc)."""
    del topk  # Extra tree candidates add only ~(topk - 1) / draft_vocab_size.
    return sum(p**i for i in range(num_steps + 1))


def parse_draft_accept(text: str) -> DraftAccept:
    """``--draft-accept``: P, or P1,P2,... (a content-shift pair, one P per region)."""
    acceptances = tuple(float(p) for p in text.split(","))
    return acceptances[0] if len(acceptances) == 1 else acceptances


def region_acceptances(draft_accept: DraftAccept) -> List[float]:
    """The acceptance of each region: one, or one per region of a content-shift pair."""
    if isinstance(draft_accept, (int, float)):
        return [float(draft_accept)]
    return [float(p) for p in draft_accept]


def build_token_map(
    vocab_size: int, draft_vocab_size: int, draft_accept: DraftAccept, seed: int
) -> TokenMap:
    acceptances = region_acceptances(draft_accept)
    for p in acceptances:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"draft_accept must be in [0, 1], got {p}")
    if not NUM_SPECIAL_TOKENS < draft_vocab_size <= vocab_size:
        raise ValueError(f"bad draft_vocab_size {draft_vocab_size}")
    gen = torch.Generator().manual_seed(seed)
    hot = _choose_hot_tokens(vocab_size, draft_vocab_size, gen)
    cycle = hot[hot >= NUM_SPECIAL_TOKENS]
    n = cycle.numel()
    regions = list(cycle.tensor_split(len(acceptances)))
    starts = itertools.accumulate((len(r) for r in regions[:-1]), initial=0)
    next_pos = torch.cat(
        [
            start + _cut_and_shuffle_cycle(len(region), p, gen)
            for start, region, p in zip(starts, regions, acceptances)
        ]
    )
    next_token = cycle[torch.randint(0, n, (vocab_size,), generator=gen)]
    next_token[cycle] = cycle[next_pos]
    successor = torch.full((vocab_size,), -1, dtype=torch.long)
    for region in regions:
        successor[region] = region.roll(-1)
    return TokenMap(next_token, successor, hot, regions)


def _choose_hot_tokens(
    vocab_size: int, draft_vocab_size: int, gen: torch.Generator
) -> torch.Tensor:
    if draft_vocab_size == vocab_size:
        return torch.arange(vocab_size)
    regular = torch.randperm(vocab_size - NUM_SPECIAL_TOKENS, generator=gen)
    return (regular[:draft_vocab_size] + NUM_SPECIAL_TOKENS).sort().values


def _cut_and_shuffle_cycle(n: int, p: float, gen: torch.Generator) -> torch.Tensor:
    """Next cycle position for each position: +1 except after the cut edges."""
    next_pos = (torch.arange(n) + 1) % n
    num_cuts = round((1.0 - p) * n)
    if num_cuts == 0:
        return next_pos
    ends = torch.randperm(n, generator=gen)[:num_cuts].sort().values
    starts = (ends.roll(1) + 1) % n  # segment i runs from starts[i] to ends[i]
    order = torch.randperm(num_cuts, generator=gen)
    next_pos[ends[order]] = starts[order.roll(-1)]
    return next_pos


def token_codes(
    vocab_size: int, num_kv_heads: int, head_dim: int, seed: int
) -> torch.Tensor:
    """Unit codes [vocab, num_kv_heads * head_dim] of equal-norm half-head chunks."""
    gen = torch.Generator().manual_seed(seed + 1)
    num_chunks = 2 * num_kv_heads
    codes = torch.randn(vocab_size, num_chunks, head_dim // 2, generator=gen)
    codes = codes / codes.norm(dim=-1, keepdim=True) / math.sqrt(num_chunks)
    return codes.reshape(vocab_size, num_kv_heads * head_dim)


def greedy_continuation(
    next_token: Sequence[int], prompt_ids: Sequence[int], num_tokens: int
) -> List[int]:
    """Intended greedy output of the target for a prompt."""
    out: List[int] = []
    last = prompt_ids[-1]
    for _ in range(num_tokens):
        last = next_token[last]
        out.append(last)
    return out


def detoured_continuation(
    next_token: Sequence[int], prompt_ids: Sequence[int], num_tokens: int, at: int
) -> List[int]:
    """A continuation a grammar can force on the target: the greedy one up to
    ``at`` tokens, then a token it would not emit there, then the greedy
    continuation of that token. The forced token has a one-digit id: no other
    token's string ("w<id>") is a prefix of its, so a mask by string prefix
    (xgrammar's) leaves it alone at that step. Its regex: ``token_regex``."""
    head = greedy_continuation(next_token, prompt_ids, at)
    previous = head[-1] if head else prompt_ids[-1]
    forced = next(t for t in range(3, 10) if t != next_token[previous])
    return (
        head + [forced] + greedy_continuation(next_token, [forced], num_tokens - at - 1)
    )


def region_prompt(
    spec: dict, region: int, prompt_len: int, rng: random.Random
) -> List[int]:
    """A prompt of random hot tokens whose continuation stays in ``region`` of a
    content-shift pair (its last token is one of the region's)."""
    regions = spec["region_tokens"]
    body = [rng.choice(rng.choice(regions)) for _ in range(prompt_len - 1)]
    return body + [rng.choice(regions[region])]


def load_spec(out_dir: str) -> dict:
    with open(os.path.join(out_dir, SPEC_FILE)) as f:
        return json.load(f)


def next_token_map(out_dir: str) -> List[int]:
    """pi as a list (index = last token id, value = target's greedy next token)."""
    return load_spec(out_dir)["next_token"]


class ShardWriter:
    """Writes tensors in <= max_bytes safetensors shards plus an index."""

    def __init__(self, out_dir: str, max_bytes: int = MAX_SHARD_BYTES) -> None:
        self.out_dir = out_dir
        self.max_bytes = max_bytes
        self.pending: Dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shard_keys: List[List[str]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.detach().to("cpu").contiguous()
        self.pending_bytes += nbytes

    def _flush(self) -> None:
        path = os.path.join(self.out_dir, f"shard-{len(self.shard_keys)}.tmp")
        save_file(self.pending, path, metadata={"format": "pt"})
        self.shard_keys.append(sorted(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending:
            self._flush()
        total = len(self.shard_keys)
        if total == 1:
            os.replace(self._tmp(0), os.path.join(self.out_dir, "model.safetensors"))
            return
        weight_map: Dict[str, str] = {}
        for i, keys in enumerate(self.shard_keys):
            name = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            os.replace(self._tmp(i), os.path.join(self.out_dir, name))
            weight_map.update({k: name for k in keys})
        size = sum(
            os.path.getsize(os.path.join(self.out_dir, f))
            for f in set(weight_map.values())
        )
        _write_json(
            os.path.join(self.out_dir, "model.safetensors.index.json"),
            {
                "metadata": {"total_size": size},
                "weight_map": dict(sorted(weight_map.items())),
            },
        )

    def _tmp(self, i: int) -> str:
        return os.path.join(self.out_dir, f"shard-{i}.tmp")


class _Filler:
    """Small random tensors, seeded per tensor name (order independent)."""

    def __init__(self, seed: int, device: str) -> None:
        self.seed = seed
        self.device = device

    def randn(self, name: str, shape: Tuple[int, ...], std: float) -> torch.Tensor:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(zlib.crc32(name.encode()) ^ (self.seed * 0x9E3779B1 % 2**31))
        out = torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32)
        return (out * std).to(DTYPE)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _ones(n: int, device: str) -> torch.Tensor:
    return torch.ones(n, dtype=DTYPE, device=device)


def _zeros(shape: Tuple[int, ...], device: str) -> torch.Tensor:
    return torch.zeros(shape, dtype=DTYPE, device=device)


def _padded(rows: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.zeros(rows.shape[0], width, dtype=DTYPE, device=rows.device)
    out[:, : rows.shape[1]] = rows.to(DTYPE)
    return out


def _target_layer_tensors(
    p: Preset, layer: int, filler: _Filler, device: str
) -> Iterator[Tuple[str, torch.Tensor]]:
    d, q_dim, kv_dim = (
        p.hidden_size,
        p.num_heads * p.head_dim,
        p.num_kv_heads * p.head_dim,
    )
    code_dims = kv_dim
    out_std = TARGET_LAYER_NOISE * math.sqrt(code_dims / (2 * p.num_layers * d))
    prefix = f"model.layers.{layer}."
    rnd: Callable[[str, Tuple[int, ...], float], torch.Tensor] = (
        lambda n, s, std: filler.randn(prefix + n, s, std)
    )
    yield prefix + "input_layernorm.weight", _ones(d, device)
    yield prefix + "post_attention_layernorm.weight", _ones(d, device)
    for name, rows in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
        yield prefix + f"self_attn.{name}.weight", rnd(
            f"self_attn.{name}.weight", (rows, d), d**-0.5
        )
        if p.architecture == "qwen2":
            yield prefix + f"self_attn.{name}.bias", rnd(
                f"self_attn.{name}.bias", (rows,), 0.1
            )
    yield prefix + "self_attn.o_proj.weight", rnd(
        "self_attn.o_proj.weight", (d, q_dim), out_std * q_dim**-0.5
    )
    if p.architecture == "qwen3_moe":
        yield prefix + "self_attn.q_norm.weight", _ones(p.head_dim, device)
        yield prefix + "self_attn.k_norm.weight", _ones(p.head_dim, device)
        yield prefix + "mlp.gate.weight", rnd(
            "mlp.gate.weight", (p.num_experts, d), d**-0.5
        )
        for e in range(p.num_experts):
            yield from _mlp_tensors(
                rnd, f"mlp.experts.{e}.", prefix, d, p.moe_intermediate_size, out_std
            )
    else:
        yield from _mlp_tensors(rnd, "mlp.", prefix, d, p.intermediate_size, out_std)


def _mlp_tensors(
    rnd: Callable[[str, Tuple[int, ...], float], torch.Tensor],
    name: str,
    prefix: str,
    d: int,
    inter: int,
    out_std: float,
) -> Iterator[Tuple[str, torch.Tensor]]:
    yield prefix + name + "gate_proj.weight", rnd(
        name + "gate_proj.weight", (inter, d), d**-0.5
    )
    yield prefix + name + "up_proj.weight", rnd(
        name + "up_proj.weight", (inter, d), d**-0.5
    )
    yield prefix + name + "down_proj.weight", rnd(
        name + "down_proj.weight", (d, inter), 2 * out_std * inter**-0.5
    )


def _target_lm_head(codes: torch.Tensor, tmap: TokenMap, d: int) -> torch.Tensor:
    rows = torch.zeros_like(codes).index_add_(
        0, tmap.next_token.to(codes.device), codes
    )
    return _padded(rows * (TARGET_LOGIT_SCALE / math.sqrt(d)), d)


def _target_config(p: Preset, num_layers: int) -> dict:
    cfg = {
        "architectures": [ARCHITECTURES[p.architecture]],
        "model_type": p.architecture,
        "hidden_size": p.hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim,
        "intermediate_size": p.intermediate_size,
        "vocab_size": p.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": p.rms_norm_eps,
        "rope_theta": p.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": p.rope_theta},
        "max_position_embeddings": p.max_position_embeddings,
        "tie_word_embeddings": False,
        "attention_bias": p.architecture == "qwen2",
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if p.architecture == "qwen2":
        cfg.update(
            use_sliding_window=False, sliding_window=None, max_window_layers=num_layers
        )
    if p.architecture == "qwen3_moe":
        cfg.update(
            num_experts=p.num_experts,
            num_experts_per_tok=p.num_experts_per_tok,
            moe_intermediate_size=p.moe_intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
            use_sliding_window=False,
            sliding_window=None,
        )
    return cfg


def _write_target(
    target_dir: str,
    p: Preset,
    num_layers: int,
    codes: torch.Tensor,
    tmap: TokenMap,
    filler: _Filler,
    device: str,
) -> None:
    d = p.hidden_size
    writer = ShardWriter(target_dir)
    writer.add("model.embed_tokens.weight", _embedding(codes, d))
    for layer in range(num_layers):
        for name, tensor in _target_layer_tensors(p, layer, filler, device):
            writer.add(name, tensor)
    writer.add("model.norm.weight", _ones(d, device))
    writer.add("lm_head.weight", _target_lm_head(codes, tmap, d))
    writer.close()
    _write_json(os.path.join(target_dir, "config.json"), _target_config(p, num_layers))
    _write_json(
        os.path.join(target_dir, "generation_config.json"),
        {
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            "do_sample": False,
        },
    )
    _write_tokenizer(target_dir, p.vocab_size, p.max_position_embeddings)


def _embedding(codes: torch.Tensor, d: int) -> torch.Tensor:
    return _padded(codes * math.sqrt(codes.shape[1]), d)


def _low_freq_dims(head_dim: int, device: str) -> torch.Tensor:
    """Head dims of the slowest-rotating neox RoPE pairs (both halves)."""
    quarter = head_dim // 4
    low = torch.arange(quarter, 2 * quarter, device=device)
    return torch.cat([low, low + head_dim // 2])


def _draft_attention(p: Preset, device: str) -> Dict[str, torch.Tensor]:
    d, hd, n_kv = p.hidden_size, p.head_dim, p.num_kv_heads
    heads_per_group = p.num_heads // n_kv
    scale = math.sqrt(DRAFT_ATTN_SHARPNESS * math.sqrt(hd) * 2 * n_kv / d)
    low = _low_freq_dims(hd, device)
    half = torch.arange(hd // 2, device=device)
    q = torch.zeros(p.num_heads * hd, 2 * d, device=device)
    k = torch.zeros(n_kv * hd, 2 * d, device=device)
    v = torch.zeros(n_kv * hd, 2 * d, device=device)
    o = torch.zeros(d, p.num_heads * hd, device=device)
    full = torch.arange(hd, device=device)
    for g in range(n_kv):
        k[g * hd + low, g * hd + half] = scale
        v[g * hd + full, g * hd + full] = 1.0
        v[g * hd + full, d + g * hd + full] = -1.0
        for h in range(g * heads_per_group, (g + 1) * heads_per_group):
            q[h * hd + low, g * hd + half] = scale
            o[g * hd + full, h * hd + full] = 1.0 / heads_per_group
    return {"q_proj": q, "k_proj": k, "v_proj": v, "o_proj": o}


def _rope_shift_back(head_dim: int, device: str) -> torch.Tensor:
    """Map R with rope(R q, t) . rope(k, t - 1) == q . k (neox, KV_CHECK_ROPE_THETA)."""
    half = head_dim // 2
    exponent = torch.arange(half, dtype=torch.float64) * 2 / head_dim
    angle = KV_CHECK_ROPE_THETA**-exponent
    cos, sin = angle.cos().float(), angle.sin().float()
    i = torch.arange(half)
    rot = torch.zeros(head_dim, head_dim)
    rot[i, i], rot[i, i + half] = cos, sin
    rot[i + half, i + half], rot[i + half, i] = cos, -sin
    return rot.to(device)


def _draft_attention_kv_check(p: Preset, device: str) -> Dict[str, torch.Tensor]:
    """Copy heads add the own code; check heads subtract the code at t - 1."""
    d, hd, n_kv = p.hidden_size, p.head_dim, p.num_kv_heads
    heads_per_group = p.num_heads // n_kv
    if heads_per_group < 2:
        raise ValueError("--draft-kv-check needs >= 2 query heads per kv head")
    num_copy = heads_per_group // 2
    # q = s * unit * code_g(x), k = unit * code_g(x') give score s if x == x'.
    unit = math.sqrt(math.sqrt(hd) * n_kv / d)
    eye = torch.eye(hd, device=device)
    shift = _rope_shift_back(hd, device)
    q = torch.zeros(p.num_heads * hd, 2 * d, device=device)
    k = torch.zeros(n_kv * hd, 2 * d, device=device)
    v = torch.zeros(n_kv * hd, 2 * d, device=device)
    o = torch.zeros(d, p.num_heads * hd, device=device)
    for g in range(n_kv):
        own = slice(g * hd, (g + 1) * hd)
        prev = slice(d + g * hd, d + (g + 1) * hd)
        k[own, own] = unit * eye
        v[own, own] = eye
        for i in range(heads_per_group):
            head = g * heads_per_group + i
            rows = slice(head * hd, (head + 1) * hd)
            if i < num_copy:
                q[rows, own] = DRAFT_ATTN_SHARPNESS * unit * eye
                o[own, rows] = eye / num_copy
            else:
                q[rows, own] = KV_CHECK_SELF_SCORE * unit * eye
                q[rows, prev] = KV_CHECK_PREV_SCORE * unit * shift
                o[own, rows] = -eye / (heads_per_group - num_copy)
    return {"q_proj": q, "k_proj": k, "v_proj": v, "o_proj": o}


def _draft_lm_head(codes: torch.Tensor, tmap: TokenMap, d: int) -> torch.Tensor:
    """Row of hot token t = code of s^{-1}(t); zero for hot tokens off the cycle."""
    on_cycle = torch.nonzero(tmap.successor >= 0).squeeze(1)
    predecessor = torch.full_like(tmap.successor, -1)
    predecessor[tmap.successor[on_cycle]] = on_cycle
    pred = predecessor[tmap.hot_token_ids].to(codes.device)
    rows = codes[pred.clamp(min=0)] * (pred >= 0).unsqueeze(1)
    return _padded(rows * (DRAFT_LOGIT_SCALE / math.sqrt(d)), d)


def _draft_filler(
    p: Preset, filler: _Filler, num_code_dims: int, kv_check: bool
) -> Dict[str, torch.Tensor]:
    """fc and MLP: small random, writing only outside the code dims.

    With ``kv_check`` fc also maps the code dims of the 3 aux states (~ e_x of
    the target's input token x) to ``norm(embed(x))``'s code dims.
    """
    d, inter = p.hidden_size, p.draft_intermediate_size
    free = d - num_code_dims
    fc_std = DRAFT_FILLER_NOISE * math.sqrt(d / free) / math.sqrt(3 * num_code_dims)
    fc = filler.randn("fc.weight", (d, 3 * d), fc_std)
    down = filler.randn(
        "midlayer.mlp.down_proj.weight",
        (d, inter),
        2 * DRAFT_FILLER_NOISE * inter**-0.5,
    )
    fc[:num_code_dims] = 0
    down[:num_code_dims] = 0
    if kv_check:
        _copy_aux_codes(fc, num_code_dims)
    return {
        "fc.weight": fc,
        "midlayer.mlp.gate_proj.weight": filler.randn(
            "midlayer.mlp.gate_proj.weight", (inter, d), d**-0.5
        ),
        "midlayer.mlp.up_proj.weight": filler.randn(
            "midlayer.mlp.up_proj.weight", (inter, d), d**-0.5
        ),
        "midlayer.mlp.down_proj.weight": down,
    }


def _copy_aux_codes(fc: torch.Tensor, num_code_dims: int) -> None:
    """fc(aux) code dims = mean of the 3 aux code parts * sqrt(d / c) (in place)."""
    d = fc.shape[0]
    scale = math.sqrt(d / num_code_dims) / 3
    copy = torch.eye(num_code_dims, device=fc.device) * scale
    for i in range(3):
        fc[:num_code_dims, i * d : i * d + num_code_dims] = copy.to(DTYPE)


def _draft_config(
    p: Preset, num_layers: int, draft_vocab_size: int, rope_theta: float
) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": p.hidden_size,
        "target_hidden_size": p.hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim,
        "intermediate_size": p.draft_intermediate_size,
        "vocab_size": p.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": p.rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": p.max_position_embeddings,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "torch_dtype": "bfloat16",
        "eagle_config": {
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": [
                1,
                num_layers // 2 - 1,
                num_layers - 4,
            ],
        },
    }


def _write_draft(
    draft_dir: str,
    p: Preset,
    num_layers: int,
    codes: torch.Tensor,
    tmap: TokenMap,
    filler: _Filler,
    device: str,
    kv_check: bool,
) -> None:
    d = p.hidden_size
    writer = ShardWriter(draft_dir)
    writer.add("embed_tokens.weight", _embedding(codes, d))
    attention = _draft_attention_kv_check if kv_check else _draft_attention
    for name, tensor in attention(p, device).items():
        writer.add(f"midlayer.self_attn.{name}.weight", tensor.to(DTYPE))
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        writer.add(f"midlayer.{name}.weight", _ones(d, device))
    for name, tensor in _draft_filler(p, filler, codes.shape[1], kv_check).items():
        writer.add(name, tensor)
    writer.add("norm.weight", _ones(d, device))
    writer.add("lm_head.weight", _draft_lm_head(codes, tmap, d))
    hot = tmap.hot_token_ids
    writer.add("d2t", hot - torch.arange(hot.numel()))
    t2d = torch.zeros(p.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    writer.add("t2d", t2d)
    writer.close()
    _write_json(
        os.path.join(draft_dir, "config.json"),
        _draft_config(
            p,
            num_layers,
            hot.numel(),
            KV_CHECK_ROPE_THETA if kv_check else DRAFT_ROPE_THETA,
        ),
    )


def _write_eagle_draft(
    draft_dir: str, p: Preset, codes: torch.Tensor, filler: _Filler, device: str
) -> None:
    """A one-layer EAGLE draft of the target's architecture
    (``EAGLE_DRAFT_ARCHITECTURES``) that proposes what the target decodes: its
    output is ``fc``'s copy of the input token's embedding at the scale of the
    target's final norm, which the target's lm_head (an EAGLE draft shares it) maps
    to ``pi`` of that token. Attention and MLP add nothing (zero o_proj and
    down_proj) but read and write the draft KV like any draft; a Qwen2 draft's
    q/k/v projections have biases, as Qwen2's do."""
    d, q_dim, kv_dim = (
        p.hidden_size,
        p.num_heads * p.head_dim,
        p.num_kv_heads * p.head_dim,
    )
    num_code_dims = codes.shape[1]
    fc = torch.zeros(d, 2 * d, device=device)
    fc[:num_code_dims, :num_code_dims] = math.sqrt(d / num_code_dims) * torch.eye(
        num_code_dims, device=device
    )
    writer = ShardWriter(draft_dir)
    writer.add("embed_tokens.weight", _embedding(codes, d))
    writer.add("fc.weight", fc.to(DTYPE))
    writer.add("fc.bias", _zeros((d,), device))
    prefix = "layers.0."
    for name, rows in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
        name = f"{prefix}self_attn.{name}"
        writer.add(f"{name}.weight", filler.randn(f"{name}.weight", (rows, d), d**-0.5))
        if p.architecture == "qwen2":
            writer.add(f"{name}.bias", filler.randn(f"{name}.bias", (rows,), 1.0))
    writer.add(f"{prefix}self_attn.o_proj.weight", _zeros((d, q_dim), device))
    writer.add(f"{prefix}post_attention_layernorm.weight", _ones(d, device))
    inter = p.draft_intermediate_size
    for name in ("gate_proj", "up_proj"):
        name = f"{prefix}mlp.{name}.weight"
        writer.add(name, filler.randn(name, (inter, d), d**-0.5))
    writer.add(f"{prefix}mlp.down_proj.weight", _zeros((d, inter), device))
    writer.close()
    config = _target_config(dataclasses.replace(p, intermediate_size=inter), 1)
    config["architectures"] = [EAGLE_DRAFT_ARCHITECTURES[p.architecture]]
    _write_json(os.path.join(draft_dir, "config.json"), config)


def token_name(token_id: int) -> str:
    """The synthetic tokenizer's string for a token that is not special."""
    return f"w{token_id}"


def prompt_text(token_ids: Sequence[int]) -> str:
    """Text that the synthetic tokenizer encodes to ``token_ids`` (it adds no
    special tokens)."""
    return " ".join(map(token_name, token_ids))


def token_regex(token_ids: Sequence[int]) -> str:
    """A regex (with no special characters) that a grammar matches only by
    emitting ``token_ids``: their strings joined."""
    return "".join(map(token_name, token_ids))


def token_ids_in(text: str) -> List[int]:
    """The ids of the synthetic tokens whose strings ``text`` holds, in order."""
    return [int(t) for t in TOKEN_NAME.findall(text)]


def _write_tokenizer(
    out_dir: str,
    vocab_size: int,
    max_length: int,
    renamed: Optional[Mapping[int, str]] = None,
) -> None:
    """Token ``i`` is ``"w<i>"`` (after the special tokens), or ``renamed[i]``."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    names = {i: token_name(i) for i in range(NUM_SPECIAL_TOKENS, vocab_size)}
    names.update(renamed or {})
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({name: i for i, name in names.items()})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    unk, bos, eos = SPECIAL_TOKENS
    _write_json(
        os.path.join(out_dir, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": unk,
            "bos_token": bos,
            "eos_token": eos,
            "pad_token": unk,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": max_length,
        },
    )


def tokenizer_dir(target_dir: str) -> str:
    """The directory beside ``target_dir`` with only its tokenizer, for
    ``--tokenizer-path`` (written by ``generate``).

    transformers 5 loads the tokenizer of a ``qwen2`` config as ``Qwen2Tokenizer``,
    whatever tokenizer_config.json names, and that class rebuilds a BPE model from
    the vocabulary: the synthetic word-level vocabulary then encodes every text to
    no token at all (the server's warm-up prompt included). Without a config beside
    it, the tokenizer loads as written, for every architecture.
    """
    return os.path.join(os.path.dirname(os.path.abspath(target_dir)), "tokenizer")


def write_tokenizer_dir(target_dir: str) -> None:
    """Copy the target's tokenizer files to ``tokenizer_dir`` (those missing)."""
    out_dir = tokenizer_dir(target_dir)
    os.makedirs(out_dir, exist_ok=True)
    for name in TOKENIZER_FILES:
        if not os.path.isfile(os.path.join(out_dir, name)):
            shutil.copyfile(os.path.join(target_dir, name), os.path.join(out_dir, name))


def write_json_object_tokenizer(target_dir: str, out_dir: str) -> Tuple[int, int]:
    """Write to ``out_dir`` the tokenizer of the synthetic target ``target_dir`` with
    two tokens renamed to ``{"a":"`` and ``"}``, so that its vocab can spell the JSON
    object ``{"a":"w<id>w<id>..."}``. The two are the highest ids the target's
    greedy map never emits (a random prompt may still hold them). Returns their
    ids: (opener, closer)."""
    with open(os.path.join(target_dir, "config.json")) as f:
        config = json.load(f)
    emitted = set(next_token_map(os.path.dirname(target_dir)))
    never_emitted = (
        i for i in reversed(range(config["vocab_size"])) if i not in emitted
    )
    opener, closer = next(never_emitted), next(never_emitted)
    os.makedirs(out_dir, exist_ok=True)
    _write_tokenizer(
        out_dir,
        config["vocab_size"],
        config["max_position_embeddings"],
        renamed={opener: JSON_OBJECT_OPENER, closer: JSON_OBJECT_CLOSER},
    )
    return opener, closer


def _write_spec(
    out_dir: str,
    preset: str,
    p: Preset,
    num_layers: int,
    draft_accept: DraftAccept,
    seed: int,
    tmap: TokenMap,
    kv_check: bool,
    draft_arch: str,
) -> None:
    # The keys are absent by default so that default outputs keep their bytes.
    extra = {"draft_kv_check": True} if kv_check else {}
    if draft_arch != "eagle3":
        extra["draft_arch"] = draft_arch
    acceptances = region_acceptances(draft_accept)
    if len(acceptances) > 1:
        extra["region_tokens"] = [r.tolist() for r in tmap.region_tokens]
        draft_accept = acceptances
    first = acceptances[0]
    _write_json(
        os.path.join(out_dir, SPEC_FILE),
        {
            **extra,
            "preset": preset,
            "num_layers": num_layers,
            "seed": seed,
            "draft_accept": draft_accept,
            "vocab_size": p.vocab_size,
            "draft_vocab_size": tmap.hot_token_ids.numel(),
            "target_logit_scale": TARGET_LOGIT_SCALE,
            "target_min_margin": TARGET_MIN_MARGIN,
            "expected_accept_length": {  # of the first region
                "topk1_steps3": expected_accept_length(first, 3, 1),
                "topk4_steps2": expected_accept_length(first, 2, 4),
            },
            "next_token": tmap.next_token.tolist(),
            "draft_successor": tmap.successor.tolist(),
        },
    )


def generate(
    preset: str,
    out_dir: str,
    draft_accept: DraftAccept,
    seed: int = 0,
    device: str = "cpu",
    draft_vocab_size: Optional[int] = None,
    num_layers: Optional[int] = None,
    draft_kv_check: bool = False,
    draft_arch: str = "eagle3",
) -> Tuple[str, str]:
    """Write ``out_dir/target``, ``out_dir/draft``, ``out_dir/tokenizer`` (the
    target's tokenizer alone: ``tokenizer_dir``) and ``out_dir/synthetic_spec.json``.

    ``draft_kv_check`` selects the draft variant whose proposals need a valid
    draft KV cache at the previous position (see the module docstring).
    ``draft_accept`` as a sequence makes a content-shift pair (module docstring).
    ``draft_arch`` "eagle" writes an EAGLE draft that proposes what the target
    decodes (``_write_eagle_draft``): its acceptance is 1.
    """
    if draft_arch == "eagle" and (draft_kv_check or draft_accept != 1.0):
        raise ValueError("the EAGLE draft accepts all: draft_accept 1, no KV check")
    p = PRESETS[preset]
    if draft_arch == "eagle" and p.architecture not in EAGLE_DRAFT_ARCHITECTURES:
        raise ValueError(
            f"no EAGLE draft for a {p.architecture} target; "
            f"one for {sorted(EAGLE_DRAFT_ARCHITECTURES)}"
        )
    num_layers = num_layers or p.num_layers
    if num_layers < 7:
        raise ValueError("EAGLE-3 taps layers 2, L/2 and L-3: need at least 7 layers")
    tmap = build_token_map(
        p.vocab_size, draft_vocab_size or p.draft_vocab_size, draft_accept, seed
    )
    codes = token_codes(p.vocab_size, p.num_kv_heads, p.head_dim, seed).to(device)
    filler = _Filler(seed, device)
    target_dir, draft_dir = os.path.join(out_dir, "target"), os.path.join(
        out_dir, "draft"
    )
    os.makedirs(target_dir, exist_ok=True)
    os.makedirs(draft_dir, exist_ok=True)
    with torch.no_grad():
        _write_target(target_dir, p, num_layers, codes, tmap, filler, device)
        if draft_arch == "eagle":
            _write_eagle_draft(draft_dir, p, codes, filler, device)
        else:
            _write_draft(
                draft_dir, p, num_layers, codes, tmap, filler, device, draft_kv_check
            )
    write_tokenizer_dir(target_dir)
    _write_spec(
        out_dir,
        preset,
        p,
        num_layers,
        draft_accept,
        seed,
        tmap,
        draft_kv_check,
        draft_arch,
    )
    return target_dir, draft_dir


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument(
        "--draft-accept",
        type=parse_draft_accept,
        required=True,
        help="P, or P1,P2,... for a content-shift pair: one region of the token "
        "cycle per P, a continuation stays in the region its prompt ends in",
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--draft-vocab-size", type=int, default=None)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument(
        "--draft-kv-check",
        action="store_true",
        help="draft whose proposals are right only with a valid draft KV cache",
    )
    parser.add_argument(
        "--draft-arch",
        choices=["eagle3", "eagle"],
        default="eagle3",
        help="eagle: an EAGLE draft (LlamaForCausalLMEagle, or Qwen2ForCausalLMEagle "
        "for a Qwen2 target; serve with --speculative-algorithm EAGLE) proposing "
        "what the target decodes; needs --draft-accept 1",
    )
    return parser.parse_args()


def main() -> None:
    args = _parse_args()
    target_dir, draft_dir = generate(
        args.preset,
        args.out,
        args.draft_accept,
        args.seed,
        args.device,
        args.draft_vocab_size,
        args.num_layers,
        args.draft_kv_check,
        args.draft_arch,
    )
    print(f"target: {target_dir}")
    print(f"draft: {draft_dir}")
    print(f"tokenizer: {tokenizer_dir(target_dir)} (serve with --tokenizer-path)")
    for p in region_acceptances(args.draft_accept):
        print(
            f"P={p}: expected accept length "
            f"{expected_accept_length(p, 3, 1):.4f} (topk 1, 3 steps), "
            f"{expected_accept_length(p, 2, 4):.4f} (topk 4, 2 steps)"
        )


if __name__ == "__main__":
    main()
