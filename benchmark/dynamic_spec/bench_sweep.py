"""Throughput and latency vs concurrency, side by side: no speculation, EAGLE-3 always on,
the fork's load-aware speculation, and upstream's adaptive speculation (on the fork, and
on pristine upstream: the upstream-* configs' servers import the pristine tree that
`tools/fork sync` extracts, python/.fork/pristine/, instead of the fork).

One fresh server process per config (the previous one killed and the GPU checked idle);
concurrency is swept inside it, then the ramp changes it in phases without draining in
between. Every request has a new prompt (none is in the radix cache). Writes raw JSON, a
markdown table, a PNG plot and summary.json into OUT_DIR/<date>-<model>/.

Runs may be split: each config's record is merged into the results already in
OUT_DIR/<date>-<model>/ after every point (a config measured again replaces its old record,
unless the old one is finished and the new one was cut off before its ramp), so configs
can be measured over several invocations (--results-date adds to an earlier day's
results), or at once on separate GPUs (CUDA_VISIBLE_DEVICES and --url per invocation), and
a run cut off keeps its points.

With --tp-size N every server is tensor-parallel over the visible GPUs and the results go
to OUT_DIR/<date>-<model>-tpN/.

Usage:
  python benchmark/dynamic_spec/bench_sweep.py --preset llama8b --draft-accept 0.95
      --configs nospec,eagle3-topk4,loadaware-topk4 --concurrency 1,2,4,8,16,32,64,128,256
      --disable-threshold-for loadaware-topk4=suggested

(`suggested`: the load-aware config gets the threshold from which no speculation stays as
fast as its always-on reference, from the records of the two configs run before it.)

--bench-serving also runs upstream's own client (python -m sglang.benchmark.serving, the
old sglang.bench_serving) at each point's C against the same server, offline.

The decode rate at a steady running batch, instead of the sweep and the ramp (into the
same records):
  python benchmark/dynamic_spec/bench_sweep.py --preset llama8b --draft-accept 0.95
      --configs nospec,upstream-steps0-topk1,plain-topk1,plain-topk4
      --decode-rate 64,128,256 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime
import fcntl
import json
import math
import multiprocessing
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import aiohttp
import requests
from sglang.test.spec_engine_utils import (
    EAGLE3_CHAIN,
    EAGLE3_TREE,
    acceptance_label,
    cli_args,
    eagle3_args,
    running_server,
    synthetic_pair,
)
from sglang.test.synthetic_spec_models import (
    load_spec,
    parse_draft_accept,
    region_prompt,
)
from tqdm import tqdm

# --speculative-adaptive-config of upstream-steps0-topk1 (0.5.17's
# speculative/adaptive_spec_params.py): the "1" tier covers every batch size (a batch
# goes to the largest tier key <= it, smaller ones to the smallest), candidate steps
# [0] only, so the controller never leaves 0.
STEPS0_ADAPTIVE_CONFIG = {"1": {"candidate_steps": [0]}}
# eagle3_args' step counts at steps 0: upstream takes the initial step count from
# --speculative-num-steps, which must be a candidate, and one draft token (the root).
UPSTREAM_STEPS0 = dict(num_steps=0, topk=1, num_draft_tokens=1)
# --disable-threshold-for CONFIG=suggested: the threshold the static configs' records suggest.
SUGGESTED = "suggested"
# Warm-up requests are short, whatever output length is measured.
WARMUP_OUTPUT_LEN = 32
# The per-point keys of summary.json (the machine-readable results), and
# bench_serving_output_tok_s where --bench-serving ran.
SUMMARY_POINT_KEYS = (
    "config",
    "concurrency",
    "output_tok_s",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "ttft_p50_ms",
    "accept_length",
    "spec_step_share",
)
# The per-batch keys of summary.json's decode rates.
DECODE_RATE_KEYS = (
    "config",
    "batch",
    "output_tok_s",
    "output_tok_s_min",
    "output_tok_s_max",
)


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    spec: Optional[Dict[str, int]]  # eagle3_args' step counts; None: no speculation
    extra_args: List[str]
    env: Dict[str, str]
    # Load-aware configs only: the same speculation always on, which they are judged against.
    always_on: Optional[str] = None
    # The server imports pristine upstream (tools/fork's extraction of the pinned
    # wheel, PRISTINE_DIR) instead of the fork.
    pristine: bool = False
    # Written to a file passed as --speculative-adaptive-config.
    adaptive_config: Optional[Dict[str, dict]] = None

    @property
    def load_aware(self) -> bool:
        return self.always_on is not None


def build_configs(
    disable_threshold: int, per_config: Optional[Dict[str, int]] = None
) -> Dict[str, Config]:
    """per_config: disable thresholds of named load-aware configs (the others get
    disable_threshold, the plain-* configs 2)."""

    def load_aware(
        name: str,
        spec: Dict[str, int],
        env: Dict[str, str],
        always_on: str,
        extra_args: Sequence[str] = (),
        threshold: Union[int, str, None] = None,
    ) -> Config:
        threshold = (per_config or {}).get(name, threshold or disable_threshold)
        flags = ["--speculative-disable-batch-threshold", str(threshold), *extra_args]
        return Config(name, spec, flags, env, always_on=always_on)

    adaptive = ["--speculative-adaptive"]
    # Every speculative config runs on the spec-v2 overlap worker (EAGLEWorkerV2, the
    # only one 0.5.17 has; trees at page size 1).
    return {
        c.name: c
        for c in [
            # The reference: no speculation.
            Config("nospec", None, [], {}),
            # EAGLE-3 chain (topk 1) always on: the topk 1 configs' reference.
            Config("eagle3-topk1", EAGLE3_CHAIN, [], {}),
            # EAGLE-3 draft tree (topk 4) always on: the topk 4 configs' reference.
            Config("eagle3-topk4", EAGLE3_TREE, [], {}),
            # Load-aware chain: speculates below the threshold, plain steps from it.
            load_aware("loadaware-topk1", EAGLE3_CHAIN, {}, "eagle3-topk1"),
            # The same with the full draft forward on every plain step (drafts that
            # cannot write their KV alone): what the KV-only catch-up saves.
            load_aware(
                "loadaware-topk1-full-catch-up",
                EAGLE3_CHAIN,
                {"SGLANG_LOAD_AWARE_FULL_DRAFT_CATCH_UP": "1"},
                "eagle3-topk1",
            ),
            # Load-aware draft tree.
            load_aware("loadaware-topk4", EAGLE3_TREE, {}, "eagle3-topk4"),
            # No threshold: each decode step runs the mode with the better expected
            # throughput, from the step times and acceptance the server measures.
            load_aware(
                "auto-topk1", EAGLE3_CHAIN, {}, "eagle3-topk1", threshold="auto"
            ),
            load_aware("auto-topk4", EAGLE3_TREE, {}, "eagle3-topk4", threshold="auto"),
            # The fork's plain step at every running batch >= 2 (a lone request
            # speculates), chain: its decode rate against nospec's and upstream's
            # steps-0 step's (upstream-steps0-topk1).
            load_aware("plain-topk1", EAGLE3_CHAIN, {}, "eagle3-topk1", threshold=2),
            # The same for the draft tree.
            load_aware("plain-topk4", EAGLE3_TREE, {}, "eagle3-topk4", threshold=2),
            # Upstream's adaptive step count on the fork: its steps-0 tiers (a
            # candidate from batch 8, the only one from 64 in upstream's default
            # config) run the fork's plain step instead of upstream's steps-0 step.
            Config("adaptive-topk1", EAGLE3_CHAIN, adaptive, {}),
            # Upstream's adaptive step count while speculating, plain steps under load.
            load_aware(
                "loadaware-adaptive-topk1",
                EAGLE3_CHAIN,
                {},
                "adaptive-topk1",
                adaptive,
            ),
            # Pristine upstream 0.5.17 (not the fork) with its adaptive mode and
            # default config: what upstream gives, steps-0 tiers included.
            Config(
                "upstream-adaptive-topk1", EAGLE3_CHAIN, adaptive, {}, pristine=True
            ),
            # Pristine upstream with steps 0 at every batch size: upstream's own
            # steps-0 step (a one-node TARGET_VERIFY and the full draft extend)
            # always, against the fork's plain-topk1 and nospec. Upstream refuses an
            # initial step count outside the candidates: it starts at 0.
            Config(
                "upstream-steps0-topk1",
                UPSTREAM_STEPS0,
                adaptive,
                {},
                pristine=True,
                adaptive_config=STEPS0_ADAPTIVE_CONFIG,
            ),
            # The same without its draft extend (upstream's switch for it): its best
            # case where steps 0 is the only candidate, never resuming speculation.
            Config(
                "upstream-steps0-no-extend-topk1",
                UPSTREAM_STEPS0,
                adaptive,
                {"SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND": "1"},
                pristine=True,
                adaptive_config=STEPS0_ADAPTIVE_CONFIG,
            ),
        ]
    }


# Names, order and references of the configs (the threshold does not matter here).
KNOWN_CONFIGS = build_configs(disable_threshold=2)


@dataclasses.dataclass
class RequestResult:
    ttft: float
    latency: float
    output_tokens: int
    verify_ct: int
    correct_drafts: int
    finished_at: float


def client_session() -> aiohttp.ClientSession:
    """A session that opens as many connections as there are clients (aiohttp's default
    of 100 would cap every point above C=100) and lets idle ones go before the server
    does (its keep-alive is SGLANG_TIMEOUT_KEEP_ALIVE, 5 s): a connection the server
    closes just as a request reuses it fails that request."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2)
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=3600)
    )


# A streamed chunk's output token count, found from the end (its output_ids, before
# meta_info, grow with every chunk).
COMPLETION_TOKENS_KEY = b'"completion_tokens":'
COMPLETION_TOKENS_VALUE = re.compile(rb"\s*(\d+)")


def streamed_tokens(chunk: bytes) -> Optional[int]:
    """completion_tokens of a streamed chunk (None: it has none, e.g. an error)."""
    at = chunk.rfind(COMPLETION_TOKENS_KEY)
    if at < 0:
        return None
    match = COMPLETION_TOKENS_VALUE.match(chunk, at + len(COMPLETION_TOKENS_KEY))
    return int(match.group(1)) if match else None


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    input_ids: List[int],
    output_len: int,
    timeline: Optional[List[Tuple[float, int]]] = None,
) -> RequestResult:
    """timeline: gets (time, output tokens so far) of every streamed chunk."""
    payload = {
        "input_ids": input_ids,
        "sampling_params": {
            "temperature": 0.0,
            "max_new_tokens": output_len,
            "ignore_eos": True,
        },
        "stream": True,
    }
    start = time.perf_counter()
    ttft, last = None, b""
    async with session.post(f"{url}/generate", json=payload) as response:
        response.raise_for_status()
        # The last chunk's meta_info holds the request's totals: parse only that one.
        async for line in response.content:
            if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            if timeline is not None:
                tokens = streamed_tokens(line)
                if tokens is not None:
                    timeline.append((time.perf_counter(), tokens))
            last = line
    end = time.perf_counter()
    if not last:
        raise RuntimeError(f"{url}/generate streamed no output")
    chunk = json.loads(last[5:])
    if "error" in chunk:
        raise RuntimeError(f"{url}/generate: {chunk['error']['message']}")
    meta = chunk["meta_info"]
    return RequestResult(
        ttft=ttft,
        latency=end - start,
        output_tokens=meta["completion_tokens"],
        verify_ct=meta.get("spec_verify_ct", 0),
        correct_drafts=meta.get("spec_num_correct_drafts", 0),
        finished_at=end,
    )


class PromptSource:
    """Random prompts of input_len tokens, a new one each time: no request finds its
    prompt in the radix cache, so every request prefills its whole input. Sources of
    the same seed give the same prompts in the same order."""

    def __init__(self, input_len: int, seed: int = 0) -> None:
        self.input_len = input_len
        self.rng = random.Random(seed)

    def __iter__(self) -> "PromptSource":
        return self

    def __next__(self) -> List[int]:
        return [self.rng.randrange(3, 1000) for _ in range(self.input_len)]

    def take(self, num: int) -> List[List[int]]:
        return [next(self) for _ in range(num)]


class ContentShiftPrompts(PromptSource):
    """Prompts of a content-shift pair: for ``shift_after`` seconds from the first
    one, prompts whose continuations the draft predicts well (region 0), then
    ones it predicts badly (region 1)."""

    def __init__(self, input_len: int, spec: dict, shift_after: float, seed: int = 0):
        super().__init__(input_len, seed)
        self.spec = spec
        self.shift_after = shift_after
        self.started: Optional[float] = None

    def __next__(self) -> List[int]:
        now = time.perf_counter()
        self.started = self.started if self.started is not None else now
        region = 0 if now - self.started < self.shift_after else 1
        return region_prompt(self.spec, region, self.input_len, self.rng)


async def closed_loop(
    url: str,
    prompts: Iterable[List[int]],
    output_len: int,
    concurrency: int,
) -> List[RequestResult]:
    """concurrency workers issue the prompts back to back until they run out."""
    queue = iter(prompts)
    results: List[RequestResult] = []
    async with client_session() as session:

        async def worker():
            for prompt in queue:
                results.append(await one_request(session, url, prompt, output_len))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return (
        ordered[min(len(ordered) - 1, int(q * len(ordered)))]
        if ordered
        else float("nan")
    )


@dataclasses.dataclass
class Run:
    """One measurement of a point: the requests whose latencies it reports, and the
    output tokens it counted over its wall-clock seconds."""

    results: List[RequestResult]
    tokens: float
    wall: float
    client_cpu: float  # the benchmark's CPU seconds meanwhile


def median_with_spread(rates: Iterable[float]) -> Dict[str, float]:
    """The median of repeated output tok/s measurements, with their min and max."""
    ordered = sorted(rates)
    return {
        "output_tok_s": statistics.median(ordered),
        "output_tok_s_min": ordered[0],
        "output_tok_s_max": ordered[-1],
    }


def summarize(runs: List[Run]) -> Dict[str, Any]:
    """Statistics of one point measured len(runs) times. Throughput is the median run
    (with the min and max); latencies and acceptance pool all requests."""
    results = [r for run in runs for r in run.results]
    tpots = [
        (r.latency - r.ttft) / (r.output_tokens - 1)
        for r in results
        if r.output_tokens > 1
    ]
    verify = sum(r.verify_ct for r in results)
    return {
        "num_requests": len(results),
        **median_with_spread(run.tokens / run.wall for run in runs),
        "tpot_p50_ms": 1000 * percentile(tpots, 0.5),
        "tpot_p99_ms": 1000 * percentile(tpots, 0.99),
        "ttft_p50_ms": 1000 * percentile([r.ttft for r in results], 0.5),
        "accept_length": (
            (verify + sum(r.correct_drafts for r in results)) / verify
            if verify
            else None
        ),
    }


def server_state(url: str) -> dict:
    return requests.get(f"{url}/server_info", timeout=30).json()["internal_states"][0]


def spec_step_share(config: Config, before: dict, after: dict) -> float:
    if not config.load_aware:
        return 0.0 if config.spec is None else 1.0
    b, a = before["load_aware_speculation"], after["load_aware_speculation"]
    spec = a["num_spec_steps"] - b["num_spec_steps"]
    plain = a["num_plain_steps"] - b["num_plain_steps"]
    return spec / (spec + plain) if spec + plain else 0.0


def visible_gpu_query(field: str) -> List[str]:
    """One nvidia-smi field per GPU this process may use (CUDA_VISIBLE_DEVICES)."""
    query = ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        query.append(f"--id={visible}")
    try:
        result = subprocess.run(query, capture_output=True, text=True)
    except FileNotFoundError:
        return []
    return result.stdout.strip().splitlines() if result.returncode == 0 else []


def wait_gpu_idle(max_used_mib: int = 2048, timeout: float = 120) -> None:
    """Wait until the GPUs this process may use hold no other server."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        used = visible_gpu_query("memory.used")
        if used and max(int(u) for u in used) <= max_used_mib:
            return
        time.sleep(2)
    raise RuntimeError("GPU still busy: the previous server did not exit")


def backend_env(args) -> Dict[str, str]:
    """flashinfer's default workspace (384 MiB) is too small for verify graphs at large
    batches and for draft trees; every config gets the same, larger one. (Upstream resets
    it to 512 MiB for Qwen2/Qwen3 architectures: use triton for the dense32b preset.)"""
    if args.attention_backend != "flashinfer":
        return {}
    return {
        "SGLANG_FLASHINFER_WORKSPACE_SIZE": str(args.flashinfer_workspace_mib << 20)
    }


def config_server_args(args, config: Config, draft: str) -> List[str]:
    """launch_server flags of a config: shared serving flags, then its speculation."""
    max_bs = max([*args.concurrency, *(getattr(args, "decode_rate", None) or [])])
    server_args = cli_args(
        dict(
            attention_backend=args.attention_backend,
            tp_size=args.tp_size,
            cuda_graph_max_bs=max_bs,
            max_running_requests=max_bs,
            mem_fraction_static=args.mem_fraction_static,
            # bench_serving's sglang client counts and times only streamed text.
            skip_tokenizer_init=not getattr(args, "bench_serving", False),
            enable_metrics=True,
        )
    )
    if config.spec is not None:
        server_args += cli_args(eagle3_args(draft, **config.spec))
    server_args += config.extra_args
    if config.adaptive_config is not None:
        server_args += ["--speculative-adaptive-config", adaptive_config_file(config)]
    return server_args


def adaptive_config_file(config: Config) -> str:
    """config.adaptive_config, written to a JSON file in the temp directory."""
    path = os.path.join(tempfile.gettempdir(), f"bench_sweep-{config.name}.json")
    with open(path, "w") as f:
        json.dump(config.adaptive_config, f, indent=1)
    return path


# Where `tools/fork sync` extracts the pinned upstream wheel, relative to the
# repository root (tools/forklib/wheel.py: pristine_package): one directory per
# wheel, PRISTINE_DIR/<its sha256[:16]>/sglang/, with a .complete file naming it.
PRISTINE_DIR = os.path.join("python", ".fork", "pristine")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pristine_upstream(root: str = REPO_ROOT) -> Dict[str, str]:
    """The pristine upstream tree of the pristine configs: {"pythonpath": the
    directory holding its sglang/ package, "wheel": the wheel it came from}. Of
    several extractions, the one of this interpreter's wheel. Exits when there is
    none."""
    base = os.path.join(root, PRISTINE_DIR)
    extracted = {}  # wheel file name -> directory
    if os.path.isdir(base):
        for name in sorted(os.listdir(base)):
            complete = os.path.join(base, name, ".complete")
            package = os.path.join(base, name, "sglang", "__init__.py")
            if os.path.isfile(complete) and os.path.isfile(package):
                with open(complete) as f:
                    extracted[f.read().strip()] = os.path.join(base, name)
    python_tag = f"-cp{sys.version_info.major}{sys.version_info.minor}-"
    ours = [wheel for wheel in extracted if python_tag in wheel]
    if len(extracted) == 1 or len(ours) == 1:
        wheel = ours[0] if ours else next(iter(extracted))
        return {"pythonpath": extracted[wheel], "wheel": wheel}
    found = f"found {sorted(extracted)}" if extracted else "found none"
    sys.exit(
        f"pristine upstream: no single extracted upstream package under {base} "
        f"({found}); the pristine configs need one: run `python3 tools/fork sync` "
        f"in {root} (offline: SGLANG_FORK_UPSTREAM_WHEEL=<the pinned wheel>)"
    )


def server_env(args, config: Config) -> Dict[str, str]:
    """The environment a config's server gets on top of ours. A pristine config's
    PYTHONPATH starts with pristine upstream, which then shadows the fork."""
    env = {**config.env, **backend_env(args)}
    if config.pristine:
        paths = [pristine_upstream()["pythonpath"], os.environ.get("PYTHONPATH")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def code_that_runs(config: Config, env: Dict[str, str]) -> Dict[str, str]:
    """Which sglang a server with env imports: "fork" or "pristine upstream", the
    package's __init__.py (found, not imported) and, for pristine, its wheel."""
    find = "import importlib.util; print(importlib.util.find_spec('sglang').origin)"
    origin = subprocess.run(
        [sys.executable, "-c", find],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not config.pristine:
        return {"sglang": "fork", "origin": origin}
    pristine = pristine_upstream()
    if not origin.startswith(pristine["pythonpath"] + os.sep):
        raise RuntimeError(
            f"{config.name}: the server would import sglang from {origin}, "
            f"not from pristine upstream in {pristine['pythonpath']}"
        )
    return {"sglang": "pristine upstream", "origin": origin, "wheel": pristine["wheel"]}


def warm_up(url: str, prompts: PromptSource, concurrencies: Iterable[int]) -> None:
    """One short closed loop at each concurrency the measurements will reach, smallest
    first, so that their batch sizes have run once before any is measured: some eager
    triton kernels are specialized on the next power of two of the batch and compile
    on their first launch with a new one."""
    for concurrency in sorted(set(concurrencies)):
        asyncio.run(
            closed_loop(url, prompts.take(concurrency), WARMUP_OUTPUT_LEN, concurrency)
        )


@contextlib.contextmanager
def serving(
    args,
    config: Config,
    target: str,
    draft: str,
    prompts: PromptSource,
    warmup_concurrencies: Iterable[int],
    log_path: Optional[str] = None,
) -> Iterator[Dict[str, Any]]:
    """A fresh server of a config (the previous one gone, the GPU idle), warmed up at
    warmup_concurrencies; yields how it was launched. log_path: the server's output
    (default: ours)."""
    env = server_env(args, config)
    launch = {"code": code_that_runs(config, env), "env": env}
    if config.adaptive_config is not None:
        launch["adaptive_config"] = config.adaptive_config
    wait_gpu_idle()
    server_args = config_server_args(args, config, draft)
    with running_server(
        target, server_args, env=env, base_url=args.url, log_path=log_path
    ):
        warm_up(args.url, prompts, warmup_concurrencies)
        yield {"server_args": server_args, **launch}


def run_config(
    args,
    config: Config,
    target: str,
    draft: str,
    log_dir: str,
    save: Callable[[dict], None],
) -> None:
    """Measure a config in a fresh server; save() gets its record after every point
    and after the ramp, so a run cut off keeps the points it finished."""
    prompts = PromptSource(args.input_len)
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"{config.name}.log")

    def save_with_decode_throughput(record: dict) -> None:
        with open(log_path, errors="replace") as log:
            record["decode_tok_s"] = decode_throughput(log, config.spec is not None)
        save(record)

    warmup_concurrencies = [*args.concurrency, *args.ramp]
    with serving(
        args, config, target, draft, prompts, warmup_concurrencies, log_path
    ) as launch:
        record = {"config": config.name, **launch, "unique_prompts": True, "points": []}
        state = server_state(args.url)
        record["kv_capacity_tokens"] = state["memory_usage"]["token_capacity"]
        for concurrency in tqdm(args.concurrency, desc=config.name):
            point = measure_point(args, config, prompts, concurrency)
            if getattr(args, "bench_serving", False):
                point["bench_serving"] = run_bench_serving(
                    args, config, target, concurrency, log_dir
                )
            record["points"].append(point)
            save_with_decode_throughput(record)
        record["ramp"] = run_ramp(args, config, prompts)
        save_with_decode_throughput(record)
        if args.content_shift:
            record["content_shift"] = run_content_shift(args, config, target)
            save_with_decode_throughput(record)


def run_decode_rate(
    args,
    config: Config,
    target: str,
    draft: str,
    log_dir: str,
    save: Callable[[dict], None],
) -> None:
    """--decode-rate: a config's decode rate at each steady running batch, in a fresh
    server; save() gets the record's decode_rate section after every batch size."""
    prompts = PromptSource(args.input_len)
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"{config.name}-decode-rate.log")
    with serving(
        args, config, target, draft, prompts, args.decode_rate, log_path
    ) as launch:
        capacity = server_state(args.url)["memory_usage"]["token_capacity"]
        section = {
            **launch,
            "kv_capacity_tokens": capacity,
            "input_len": args.input_len,
            "output_len": args.decode_output_len,
            "points": [],
        }
        for batch in tqdm(args.decode_rate, desc=f"{config.name} decode rate"):
            if batch * (args.input_len + args.decode_output_len) > capacity:
                raise RuntimeError(
                    f"{config.name}: {batch} requests of {args.input_len} + "
                    f"{args.decode_output_len} tokens do not fit in its KV cache "
                    f"({capacity} tokens); lower --decode-output-len"
                )
            section["points"].append(measure_decode_rate(args, config, prompts, batch))
            with open(log_path, errors="replace") as log:
                section["decode_tok_s"] = decode_throughput(
                    log, config.spec is not None
                )
            save({"config": config.name, "decode_rate": section})


def finished(record: Optional[dict]) -> bool:
    """Whether a record holds all of its config's measurements (the ramp runs last)."""
    return record is not None and "ramp" in record


DECODE_LOG_LINE = re.compile(
    r"Decode batch, #running-req: (\d+),.*gen throughput \(token/s\): ([\d.]+)"
)
SPEC_MODE_FIELD = re.compile(r"spec: (on|off)")


def decode_throughput(log_lines: Iterable[str], speculative: bool) -> List[dict]:
    """The decode throughput a server logged, per mode ("spec" or "plain") and
    running batch size: the median over its steady log windows (--decode-log-interval
    steps without a prefill, the same batch at both ends). Load-aware servers log
    each window's mode."""
    samples: Dict[Tuple[str, int], List[float]] = collections.defaultdict(list)
    window_batch = None  # at the window's start; None: it started with a prefill
    for line in log_lines:
        if "Prefill batch" in line:
            window_batch = None
            continue
        match = DECODE_LOG_LINE.search(line)
        if match is None:
            continue
        batch = int(match.group(1))
        if batch == window_batch:
            field = SPEC_MODE_FIELD.search(line)
            spec = field.group(1) == "on" if field else speculative
            samples["spec" if spec else "plain", batch].append(float(match.group(2)))
        window_batch = batch
    return [
        {"mode": mode, "batch": bs, "tok_s": statistics.median(v), "windows": len(v)}
        for (mode, bs), v in sorted(samples.items())
    ]


# The benchmark client is one asyncio thread that reads every streamed chunk: near a
# whole core, it, not the server, sets the pace of the closed loop.
CLIENT_CPU_SHARE_WARNING = 0.8


def closed_loops_for(
    min_seconds: float,
    url: str,
    prompts: PromptSource,
    num_requests: int,
    output_len: int,
    concurrency: int,
) -> Run:
    """Whole closed loops of num_requests new prompts each, repeated until min_seconds
    have passed. The clocks run only while a loop's requests do: drawing the next
    loop's prompts leaves the server idle."""
    results: List[RequestResult] = []
    wall = cpu = 0.0
    while True:
        loop_prompts = prompts.take(num_requests)
        start, cpu_start = time.perf_counter(), time.process_time()
        results += asyncio.run(closed_loop(url, loop_prompts, output_len, concurrency))
        wall += time.perf_counter() - start
        cpu += time.process_time() - cpu_start
        if wall >= min_seconds:
            return Run(results, sum(r.output_tokens for r in results), wall, cpu)


async def steady_loop(
    url: str,
    prompts: Iterable[List[int]],
    output_len: int,
    concurrency: int,
    window_seconds: float,
) -> Run:
    """A closed loop that does not run in waves: client i of C first generates
    ceil(output_len * (i + 1) / C) tokens, so its later requests, all of output_len,
    finish spread over a request's duration instead of together, and the loop never
    drains until the end. The window opens once every client has finished its first
    request and lasts window_seconds; it counts the output tokens generated inside it
    and the latencies of the requests that finished inside it."""
    prompts = iter(prompts)
    timed: List[RequestResult] = []
    staggered, closing = 0, False
    async with client_session() as session:

        async def client(slot: int) -> None:
            nonlocal staggered
            first_len = math.ceil(output_len * (slot + 1) / concurrency)
            await one_request(session, url, next(prompts), first_len)
            staggered += 1
            if staggered == concurrency:
                window_open.set()
            while not closing:
                timed.append(await one_request(session, url, next(prompts), output_len))

        window_open = asyncio.Event()
        clients = [asyncio.create_task(client(slot)) for slot in range(concurrency)]
        opened = asyncio.create_task(window_open.wait())
        await asyncio.wait([opened, *clients], return_when=asyncio.FIRST_COMPLETED)
        if not opened.done():
            await asyncio.gather(*clients)  # a client failed: raise its error
        start, cpu_start = time.perf_counter(), time.process_time()
        await asyncio.sleep(window_seconds)
        end, cpu = time.perf_counter(), time.process_time() - cpu_start
        closing = True
        await asyncio.gather(*clients)
    return Run(
        [r for r in timed if start <= r.finished_at < end],
        sum(tokens_in_window(r, start, end) for r in timed),
        end - start,
        cpu,
    )


def tokens_in_window(result: RequestResult, start: float, end: float) -> float:
    """The output tokens of a request generated in [start, end): its first at its first
    token, the others spread evenly until it finished."""
    first = result.finished_at - result.latency + result.ttft
    tokens = float(start <= first < end)
    if result.output_tokens > 1 and result.finished_at > first:
        overlap = max(0.0, min(end, result.finished_at) - max(start, first))
        tokens += (result.output_tokens - 1) * overlap / (result.finished_at - first)
    return tokens


def measure_run(args, prompts: PromptSource, num: int, concurrency: int) -> Run:
    if args.steady:
        return asyncio.run(
            steady_loop(
                args.url, prompts, args.output_len, concurrency, args.min_point_seconds
            )
        )
    return closed_loops_for(
        args.min_point_seconds, args.url, prompts, num, args.output_len, concurrency
    )


def point_requests(args, concurrency: int) -> int:
    """The requests of one closed loop at a concurrency."""
    return max(args.min_requests, args.requests_per_concurrency * concurrency)


def measure_point(
    args, config: Config, prompts: PromptSource, concurrency: int
) -> dict:
    num = point_requests(args, concurrency)
    before = server_state(args.url)
    runs = [measure_run(args, prompts, num, concurrency) for _ in range(args.repeats)]
    point = summarize(runs)
    point.update(
        config=config.name,
        concurrency=concurrency,
        spec_step_share=spec_step_share(config, before, server_state(args.url)),
        client_cpu_share=busy_client_share(runs, f"{config.name} C={concurrency}"),
    )
    return point


def busy_client_share(runs: List[Run], point: str) -> float:
    """The share of a core the client kept busy over the runs, with a warning when
    it may have set the pace."""
    share = sum(r.client_cpu for r in runs) / sum(r.wall for r in runs)
    if share > CLIENT_CPU_SHARE_WARNING:
        tqdm.write(
            f"{point}: the client kept {share:.0%} of a core busy; it may have "
            "limited this point, not the server"
        )
    return share


async def decode_rate_loop(url: str, prompts: List[List[int]], output_len: int) -> Run:
    """len(prompts) requests at once, output_len tokens each: the output tokens they
    streamed between the moment the last of them streamed its first token (all
    prefilled, every one decoding) and the first one's last token (none finished),
    over that window. In it the server runs decode steps of exactly len(prompts)
    requests, with no prefill and no finish; tokens are counted from the chunks
    each request streamed by either end."""
    timelines: List[List[Tuple[float, int]]] = [[] for _ in prompts]
    began, cpu_began = time.perf_counter(), time.process_time()
    async with client_session() as session:
        results = await asyncio.gather(
            *(
                one_request(session, url, prompt, output_len, timeline)
                for prompt, timeline in zip(prompts, timelines)
            )
        )
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu_began
    start = max(timeline[0][0] for timeline in timelines)
    end = min(timeline[-1][0] for timeline in timelines)
    if end <= start:
        raise RuntimeError(
            f"batch {len(prompts)}: a request finished before the last one started "
            "decoding; raise --decode-output-len (or the server did not run them all "
            "at once)"
        )
    tokens = sum(tokens_by(t, end) - tokens_by(t, start) for t in timelines)
    # The client's CPU share over the whole run, for the window.
    return Run(results, tokens, end - start, cpu * (end - start) / wall)


def tokens_by(timeline: List[Tuple[float, int]], moment: float) -> int:
    """The output tokens a request had streamed by moment."""
    return next((tokens for at, tokens in reversed(timeline) if at <= moment), 0)


def measure_decode_rate(
    args, config: Config, prompts: PromptSource, batch: int
) -> dict:
    """The output tok/s of a running batch of `batch` decoding requests, args.repeats
    times (median and spread), each time new prompts."""
    before = server_state(args.url)
    runs = [
        asyncio.run(
            decode_rate_loop(args.url, prompts.take(batch), args.decode_output_len)
        )
        for _ in range(args.repeats)
    ]
    return {
        "config": config.name,
        "batch": batch,
        **median_with_spread(run.tokens / run.wall for run in runs),
        "window_s": statistics.median(run.wall for run in runs),
        "spec_step_share": spec_step_share(config, before, server_state(args.url)),
        "client_cpu_share": busy_client_share(runs, f"{config.name} batch {batch}"),
    }


# Upstream's serving benchmark (0.5.17 moved `python -m sglang.bench_serving`, now a
# deprecated alias, here).
BENCH_SERVING_MODULE = "sglang.benchmark.serving"
# Nothing to download: the tokenizer is a local path, random-ids needs no dataset.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def bench_serving_command(
    args, target: str, concurrency: int, num_prompts: int, output_file: str
) -> List[str]:
    """Upstream's bench_serving at one concurrency, with our point's workload:
    num_prompts prompts of exactly --input-len random token ids (random-ids: no
    dataset to download; sent as ids, as ours are), --output-len tokens each with
    ignore_eos (its default), at most `concurrency` in flight, all issued at once;
    the radix cache flushed after its warm-up request. It appends its results as
    one JSON line to output_file."""
    return [
        sys.executable,
        "-m",
        BENCH_SERVING_MODULE,
        "--backend",
        "sglang",
        "--base-url",
        args.url,
        "--model",
        target,
        "--tokenizer",
        target,
        "--dataset-name",
        "random-ids",
        "--tokenize-prompt",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--random-range-ratio",
        "1.0",
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--flush-cache",
        "--disable-tqdm",
        "--output-file",
        output_file,
    ]


def run_bench_serving(
    args, config: Config, target: str, concurrency: int, log_dir: str
) -> dict:
    """--bench-serving: upstream's bench_serving at a point's concurrency against
    the config's server, --repeats times; its output tok/s (median, spread), TTFT
    and TPOT, from its --output-file. Its output goes to the log directory."""
    num = point_requests(args, concurrency)
    output_file = os.path.join(
        log_dir, f"{config.name}-bench-serving-c{concurrency}.jsonl"
    )
    if os.path.exists(output_file):
        os.remove(output_file)  # it appends
    command = bench_serving_command(args, target, concurrency, num, output_file)
    log_path = os.path.join(log_dir, f"{config.name}-bench-serving.log")
    with open(log_path, "a") as log:
        for _ in range(args.repeats):
            done = subprocess.run(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **OFFLINE_ENV},
            )
            if done.returncode != 0:
                raise RuntimeError(
                    f"{config.name} C={concurrency}: bench_serving exited with "
                    f"{done.returncode}; see {log_path}"
                )
    return {**bench_serving_result(output_file, num), "command": command}


def bench_serving_result(output_file: str, num_prompts: int) -> dict:
    """The runs bench_serving appended to output_file, summarized."""
    with open(output_file) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    if not runs or any(run["completed"] != num_prompts for run in runs):
        raise RuntimeError(
            f"{output_file}: bench_serving completed "
            f"{[run['completed'] for run in runs]} of {num_prompts} requests per run"
        )
    return {
        "num_requests": sum(run["completed"] for run in runs),
        **median_with_spread(run["output_throughput"] for run in runs),
        "ttft_p50_ms": statistics.median(run["median_ttft_ms"] for run in runs),
        "tpot_p50_ms": statistics.median(run["median_tpot_ms"] for run in runs),
    }


async def ramp_loop(
    url: str,
    prompts: Iterable[List[int]],
    output_len: int,
    phases: Iterable[int],
    phase_seconds: float,
) -> Tuple[List[RequestResult], List[float]]:
    """A closed loop whose concurrency steps through phases without draining between
    them: at a phase's start, clients are added up to its concurrency, or those above
    it stop after the request they have in flight. prompts: an endless source.
    Returns (results, the phases' start times followed by the time the last request
    finished)."""
    prompts = iter(prompts)
    results: List[RequestResult] = []
    concurrency = 0
    async with client_session() as session:

        async def client(slot: int) -> None:
            while slot < concurrency:
                prompt = next(prompts)
                results.append(await one_request(session, url, prompt, output_len))

        clients: Dict[int, asyncio.Task] = {}
        starts: List[float] = []
        for phase_concurrency in phases:
            starts.append(time.perf_counter())
            concurrency = phase_concurrency
            for slot in range(concurrency):
                if slot not in clients or clients[slot].done():
                    clients[slot] = asyncio.create_task(client(slot))
            await asyncio.sleep(starts[0] + len(starts) * phase_seconds - starts[-1])
        concurrency = 0
        await asyncio.gather(*clients.values())
    return results, starts + [time.perf_counter()]


def run_ramp(args, config: Config, prompts: PromptSource) -> dict:
    """Concurrency rising then falling in phases of fixed duration, with no drain
    between phases, args.repeats times: the median total and per-phase tok/s over
    the runs, and the spread of the total."""
    phases = args.ramp + args.ramp[-2::-1]
    before = server_state(args.url)
    runs = [
        ramp_rates(args, config, prompts, phases, run) for run in range(args.repeats)
    ]
    return {
        "config": config.name,
        **median_with_spread(total for total, _ in runs),
        "phases": [
            {
                "concurrency": concurrency,
                "output_tok_s": statistics.median(rates[i] for _, rates in runs),
            }
            for i, concurrency in enumerate(phases)
        ],
        "spec_step_share": spec_step_share(config, before, server_state(args.url)),
    }


def run_content_shift(args, config: Config, target: str) -> dict:
    """--content-shift C: C clients, easy prompts for a phase, then hard ones for
    another (a content-shift pair, --draft-accept P_easy,P_hard), args.repeats
    times: the median total and per-phase tok/s, and the spread of the total."""
    spec = load_spec(os.path.dirname(target))
    phases = [args.content_shift] * 2
    runs = [
        ramp_rates(
            args,
            config,
            ContentShiftPrompts(args.input_len, spec, args.ramp_phase_seconds, run),
            phases,
            run,
        )
        for run in range(args.repeats)
    ]
    return {
        "config": config.name,
        "concurrency": args.content_shift,
        **median_with_spread(total for total, _ in runs),
        "phases": [
            {
                "prompts": prompts,
                "output_tok_s": statistics.median(r[i] for _, r in runs),
            }
            for i, prompts in enumerate(("easy", "hard"))
        ],
    }


def ramp_rates(
    args, config: Config, prompts: PromptSource, phases: List[int], run: int
) -> Tuple[float, List[float]]:
    """One ramp: total and per-phase output tok/s (each request counted in the phase it
    finished in; the last phase includes the final drain)."""
    results, bounds = asyncio.run(
        ramp_loop(
            args.url,
            prompts,
            args.output_len,
            tqdm(phases, desc=f"{config.name} ramp {run + 1}/{args.repeats}"),
            args.ramp_phase_seconds,
        )
    )
    per_phase = []
    for i in range(len(phases)):
        start, end = bounds[i], bounds[i + 1]
        last = i == len(phases) - 1
        tokens = sum(
            r.output_tokens
            for r in results
            if start <= r.finished_at and (last or r.finished_at < end)
        )
        per_phase.append(tokens / (end - start))
    total = sum(r.output_tokens for r in results) / (bounds[-1] - bounds[0])
    return total, per_phase


def rate_with_spread(measured: dict) -> str:
    """Median output tok/s, with [min-max] where repeats differed."""
    low, high = measured.get("output_tok_s_min"), measured.get("output_tok_s_max")
    spread = f" [{low:.0f}-{high:.0f}]" if low is not None and high > low else ""
    return f"{measured['output_tok_s']:.0f}{spread}"


def markdown_cell(point: dict) -> str:
    return f"{rate_with_spread(point)} ({point['spec_step_share']:.0%} spec)"


def markdown_table(records: List[dict]) -> str:
    concurrency = sorted({p["concurrency"] for r in records for p in r["points"]})
    lines = [
        "| config | KV tokens | ramp tok/s | "
        + " | ".join(f"C={c}" for c in concurrency)
        + " |"
    ]
    lines.append("|---" * (3 + len(concurrency)) + "|")
    for record in records:
        by_c = {p["concurrency"]: p for p in record["points"]}
        cells = [markdown_cell(by_c[c]) if c in by_c else "-" for c in concurrency]
        ramp = rate_with_spread(record["ramp"]) if finished(record) else "-"
        lines.append(
            f"| {record['config']} | {record['kv_capacity_tokens']} | {ramp} | "
            + " | ".join(cells)
            + " |"
        )
    return (
        "\n".join(lines)
        + "\n\nCells: output tok/s, median of the repeats [min-max] (share of decode"
        + " steps that speculated); -: not measured (a run cut off).\n"
        + repeated_prompts_note(records)
        + content_shift_table(records)
    )


def content_shift_table(records: List[dict]) -> str:
    shifted = [r for r in records if "content_shift" in r]
    if not shifted:
        return ""
    lines = [
        "\nContent shift (--content-shift): output tok/s of C clients, easy prompts "
        "then hard ones, one phase each; median of the repeats [min-max]:\n",
        "| config | C | total | easy phase | hard phase |",
        "|---|---|---|---|---|",
    ]
    for record in shifted:
        shift = record["content_shift"]
        easy, hard = (p["output_tok_s"] for p in shift["phases"])
        lines.append(
            f"| {record['config']} | {shift['concurrency']} | "
            f"{rate_with_spread(shift)} | {easy:.0f} | {hard:.0f} |"
        )
    return "\n".join(lines) + "\n"


def repeated_prompts_note(records: List[dict]) -> str:
    """Names the records measured before every request got a new prompt: theirs
    repeated, and the radix cache spared many of their requests the prefill (their
    ramp also drained every phase, and their client kept at most 100 requests in
    flight)."""
    repeated = [r["config"] for r in records if not r.get("unique_prompts")]
    if not repeated:
        return ""
    return (
        "Measured over repeated prompts (many requests found theirs in the radix cache"
        " and skipped the prefill), with a ramp that drained every phase and at most"
        " 100 requests in flight at C=128 and 256:"
        f" {', '.join(repeated)}. Their output tok/s does not compare with that of rows"
        " where every request had a new prompt.\n"
    )


# Fewer steady log windows at a batch size are too noisy to show or compare.
MIN_DECODE_WINDOWS = 3


def steady_decode(record: dict) -> List[dict]:
    return [
        d for d in record.get("decode_tok_s", []) if d["windows"] >= MIN_DECODE_WINDOWS
    ]


def decode_table(records: List[dict]) -> str:
    """Server-logged decode tok/s at running batch sizes equal to the points' C."""
    logged = [r for r in records if steady_decode(r)]
    if not logged:
        return ""
    batches = sorted({p["concurrency"] for r in records for p in r["points"]})
    lines = [
        "| config | " + " | ".join(f"batch {bs}" for bs in batches) + " |",
        "|---" * (1 + len(batches)) + "|",
    ]
    for record in logged:
        by_batch: Dict[int, List[str]] = collections.defaultdict(list)
        for d in steady_decode(record):
            suffix = " spec" if d["mode"] == "spec" else ""
            by_batch[d["batch"]].append(f"{d['tok_s']:.0f}{suffix}")
        cells = [" / ".join(by_batch[bs]) or "-" for bs in batches]
        lines.append(f"| {record['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# Issue targets for a load-aware config: (what, minimum ratio).
TARGETS = (
    ("every C: vs max(nospec, always on)", 0.97),
    ("C >= N: vs nospec", 0.98),
    ("ramp: vs the better static config", 1.05),
    ("KV tokens: vs always on", 0.97),
    # The server-logged decode throughput of plain steps, at a running batch >= N.
    ("plain step: vs nospec at the same batch", 0.98),
)
# A ratio, and where it was lowest ("C=16", "batch 64"; None: a single value).
Ratio = Tuple[float, Optional[str]]


def disable_threshold_of(record: dict) -> int:
    """The smallest running batch that may run plain steps (1 for auto)."""
    flags = record["server_args"]
    value = flags[flags.index("--speculative-disable-batch-threshold") + 1]
    return 1 if value == "auto" else int(value)


def lowest_ratio(
    mine: Dict[int, float], reference: Dict[int, float], min_key: int
) -> Optional[Tuple[float, int]]:
    """(the lowest mine / reference over the keys >= min_key both have, its key)."""
    ratios = [
        (v / reference[k], k)
        for k, v in mine.items()
        if k >= min_key and k in reference
    ]
    return min(ratios) if ratios else None


def labelled(ratio: Optional[Tuple[float, int]], label: str) -> Optional[Ratio]:
    return None if ratio is None else (ratio[0], f"{label}{ratio[1]}")


def output_tok_s_by_c(record: dict) -> Dict[int, float]:
    return {p["concurrency"]: p["output_tok_s"] for p in record["points"]}


def worst_ratio(
    record: dict, references: List[dict], min_concurrency: int = 0
) -> Optional[Ratio]:
    """The lowest tok/s ratio to the best of references over the concurrencies
    every record measured."""
    by_c = [output_tok_s_by_c(r) for r in references]
    best = {c: max(ref[c] for ref in by_c) for c in set.intersection(*map(set, by_c))}
    return labelled(
        lowest_ratio(output_tok_s_by_c(record), best, min_concurrency), "C="
    )


def plain_decode_by_batch(record: dict) -> Dict[int, float]:
    return {
        d["batch"]: d["tok_s"] for d in steady_decode(record) if d["mode"] == "plain"
    }


def worst_plain_step_ratio(record: dict, nospec: dict) -> Optional[Ratio]:
    """The lowest ratio of the record's plain-step decode throughput to nospec's,
    at the running batch sizes >= N that both logged."""
    return labelled(
        lowest_ratio(
            plain_decode_by_batch(record),
            plain_decode_by_batch(nospec),
            disable_threshold_of(record),
        ),
        "batch ",
    )


def target_ratios(record: dict, by_name: Dict[str, dict]) -> List[Optional[Ratio]]:
    """The load-aware record's ratio for each of TARGETS (None: a reference is missing)."""
    nospec = by_name.get("nospec")
    always_on = by_name.get(KNOWN_CONFIGS[record["config"]].always_on)
    statics = [r for r in (nospec, always_on) if r is not None]

    def ramp(r: dict) -> float:
        return r["ramp"]["output_tok_s"]

    return [
        worst_ratio(record, statics) if len(statics) == 2 else None,
        worst_ratio(record, [nospec], disable_threshold_of(record)) if nospec else None,
        (
            (ramp(record) / max(ramp(r) for r in statics), None)
            if len(statics) == 2 and all(map(finished, [record, *statics]))
            else None
        ),
        (
            (record["kv_capacity_tokens"] / always_on["kv_capacity_tokens"], None)
            if always_on
            else None
        ),
        worst_plain_step_ratio(record, nospec) if nospec else None,
    ]


def targets_table(records: List[dict]) -> str:
    by_name = {r["config"]: r for r in records}
    lines = [
        "| config | " + " | ".join(f"{what} >= {low}" for what, low in TARGETS) + " |",
        "|---" * (1 + len(TARGETS)) + "|",
    ]
    for record in records:
        config = KNOWN_CONFIGS.get(record["config"])
        if config is None or not config.load_aware:
            continue  # not load-aware, or no longer known
        cells = []
        for (_, low), ratio in zip(TARGETS, target_ratios(record, by_name)):
            if ratio is None:
                cells.append("-")
                continue
            value, where = ratio
            at = f" at {where}" if where is not None else ""
            cells.append(f"{value:.2f}{at} {'met' if value >= low else 'missed'}")
        lines.append(f"| {record['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def crossover_concurrency(nospec: dict, always_on: dict) -> Optional[int]:
    """The lowest C from which no speculation stays at least as fast as always_on
    (at every larger C both measured): the disable threshold this data suggests.
    None: speculation was faster at the largest C."""
    nospec_by_c, spec_by_c = output_tok_s_by_c(nospec), output_tok_s_by_c(always_on)
    crossover = None
    for c in sorted(set(nospec_by_c) & set(spec_by_c), reverse=True):
        if nospec_by_c[c] < spec_by_c[c]:
            break
        crossover = c
    return crossover


def suggested_threshold(nospec: dict, always_on: dict) -> Tuple[Optional[int], str]:
    """The disable threshold the two static configs' points suggest (None: none
    does), and why."""
    c = crossover_concurrency(nospec, always_on)
    if c is None:
        return None, "speculation was faster at the largest C measured"
    if c == min(p["concurrency"] for p in always_on["points"]):
        return None, "no speculation was as fast at every C: speculation does not pay"
    return c, f"no speculation is as fast from C={c} on: disable threshold {c}"


def suggested_thresholds(records: List[dict]) -> str:
    by_name = {r["config"]: r for r in records}
    if "nospec" not in by_name:
        return ""
    lines = []
    for name in sorted({c.always_on for c in KNOWN_CONFIGS.values() if c.load_aware}):
        if name not in by_name:
            continue
        _, advice = suggested_threshold(by_name["nospec"], by_name[name])
        gain = ramp_gain_of_switching(by_name["nospec"], by_name[name])
        if gain is not None:
            advice += (
                f"; the faster of the two in each ramp phase would give {gain:.2f}x"
                " the better of them on the ramp"
            )
        lines.append(f"- {name}: {advice}\n")
    return "".join(lines)


def ramp_gain_of_switching(nospec: dict, always_on: dict) -> Optional[float]:
    """What a server running the faster of the two configs in every ramp phase would
    gain over the better of them on the whole ramp, estimated from their points at the
    phases' concurrencies (phases last equally long); an estimate, since a ramp phase
    is not a steady closed loop at its C. None: no ramp, or a phase's concurrency was
    not measured."""
    if not finished(nospec):
        return None
    phases = [phase["concurrency"] for phase in nospec["ramp"]["phases"]]
    by_c = [output_tok_s_by_c(nospec), output_tok_s_by_c(always_on)]
    if not phases or any(c not in r for r in by_c for c in phases):
        return None
    faster_each_phase = sum(max(r[c] for r in by_c) for c in phases)
    better_static = max(sum(r[c] for c in phases) for r in by_c)
    return faster_each_phase / better_static if better_static else None


def plot(records: List[dict], path: str, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no plot; render it elsewhere with --render")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for record in records:
        points = sorted(record["points"], key=lambda p: p["concurrency"])
        ax.plot(
            [p["concurrency"] for p in points],
            [p["output_tok_s"] for p in points],
            marker="o",
            label=record["config"],
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tok/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def git_commit() -> str:
    """HEAD, marked "-dirty" when tracked files differ from it: the code that ran is not HEAD's."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"]).returncode != 0
    return head.stdout.strip() + ("-dirty" if dirty else "")


def describe_run(model: str) -> Dict[str, str]:
    gpus = visible_gpu_query("name")
    return {
        "model": model,
        "gpu": f"{len(gpus)} x {gpus[0]}" if len(set(gpus)) == 1 else ", ".join(gpus),
        "commit": git_commit(),
        "command": " ".join([sys.executable] + sys.argv),
    }


def results_dir(args) -> str:
    return os.path.join(args.out_dir, f"{args.results_date}-{model_name(args)}")


def merge_record(out_dir: str, record: dict, header: Dict[str, str]) -> List[dict]:
    """Add a config's record to raw.json, replacing an older record of it unless
    that one is finished and this one is not; returns all records, in config order.
    A record of --decode-rate (its decode_rate section only, no points) replaces
    only the older record's section; a sweep's record keeps it."""
    name = record["config"]
    with results_lock(out_dir):
        records = records_by_config(out_dir)
        older = records.get(name)
        if "points" not in record:
            base = older or {"config": name, **header}
            records[name] = {**base, "decode_rate": {**record["decode_rate"], **header}}
        elif finished(record) or not finished(older):
            kept = {k: v for k, v in (older or {}).items() if k == "decode_rate"}
            records[name] = {**kept, **record, **header}
        merged = sorted(records.values(), key=config_order)
        with open(os.path.join(out_dir, "raw.json"), "w") as f:
            json.dump({"model": header["model"], "records": merged}, f, indent=1)
    return merged


def config_order(record: dict) -> int:
    """A record's place: KNOWN_CONFIGS' order, then the configs that no longer exist
    (in earlier results: the v1 worker's)."""
    order = list(KNOWN_CONFIGS)
    name = record["config"]
    return order.index(name) if name in order else len(order)


@contextlib.contextmanager
def results_lock(out_dir: str) -> Iterator[None]:
    """Held while reading or writing raw.json: invocations on other GPUs may write it."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "raw.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def records_by_config(out_dir: str) -> Dict[str, dict]:
    """The records in out_dir's raw.json by config name ({} before the first);
    under results_lock."""
    raw_path = os.path.join(out_dir, "raw.json")
    if not os.path.exists(raw_path):
        return {}
    with open(raw_path) as f:
        return {r["config"]: r for r in json.load(f)["records"]}


def record_saver(out_dir: str, header: Dict[str, str]) -> Callable[[dict], None]:
    """save(record) for run_config: merged into raw.json, the results rewritten."""

    def save(record: dict) -> None:
        write_results(out_dir, merge_record(out_dir, record, header))

    return save


def results_markdown(records: List[dict], title: str) -> str:
    swept = swept_records(records)
    sections = [f"# {title}\n\n"]
    if swept:
        sections.append(markdown_table(swept))
    decode = decode_table(swept)
    if decode:
        sections += [
            "\nDecode tok/s the servers logged at a steady running batch (median over"
            " log windows without prefill; plain steps unless marked):\n\n",
            decode,
        ]
    second_client = bench_serving_table(swept)
    if second_client:
        sections += [
            "\nOutput tok/s of upstream's bench_serving (--bench-serving) at the same C"
            " against the same servers, median [min-max], and its ratio to ours:\n\n",
            second_client,
        ]
    rates = decode_rate_table(records)
    if rates:
        sections += [
            "\nDecode rate at a steady running batch (--decode-rate): output tok/s of"
            " B requests decoding at once, from the moment the last of them streamed"
            " its first token to the first finish (no prefill, no finish in between);"
            " median of the repeats [min-max], the ratio to nospec's, and the decode"
            " tok/s the server logged at that batch:\n\n",
            rates,
        ]
    if swept:
        sections += [
            "\nTargets (output tok/s ratios; N: the config's disable threshold):\n\n",
            targets_table(swept),
            "\nThresholds suggested by these points (against nospec):\n\n",
            suggested_thresholds(swept),
        ]
    sections.append("\nCommands (commit):\n\n")
    sections += [
        f"- {r['config']}: `{r['command']}` ({r['commit']}{code_note(r)})\n"
        for r in swept
    ]
    sections += [
        f"- {r['config']} decode rate: `{d['command']}` ({d['commit']}{code_note(d)})\n"
        for r in records
        for d in [r.get("decode_rate")]
        if d
    ]
    return "".join(sections)


def swept_records(records: List[dict]) -> List[dict]:
    """The records of sweeps (not only a --decode-rate section)."""
    return [r for r in records if "points" in r]


def bench_serving_table(records: List[dict]) -> str:
    measured = [r for r in records if any("bench_serving" in p for p in r["points"])]
    if not measured:
        return ""
    concurrency = sorted({p["concurrency"] for r in measured for p in r["points"]})
    lines = [
        "| config | " + " | ".join(f"C={c}" for c in concurrency) + " |",
        "|---" * (1 + len(concurrency)) + "|",
    ]
    for record in measured:
        by_c = {p["concurrency"]: p for p in record["points"] if "bench_serving" in p}
        cells = [
            (
                f"{rate_with_spread(by_c[c]['bench_serving'])}, "
                f"{by_c[c]['bench_serving']['output_tok_s'] / by_c[c]['output_tok_s']:.2f}x"
                if c in by_c
                else "-"
            )
            for c in concurrency
        ]
        lines.append(f"| {record['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary_point(point: dict) -> dict:
    summary = {k: point[k] for k in SUMMARY_POINT_KEYS}
    if "bench_serving" in point:
        summary["bench_serving_output_tok_s"] = point["bench_serving"]["output_tok_s"]
    return summary


def decode_rate_table(records: List[dict]) -> str:
    measured = [r for r in records if "decode_rate" in r]
    if not measured:
        return ""
    rate = {
        (r["config"], p["batch"]): p["output_tok_s"]
        for r in measured
        for p in r["decode_rate"]["points"]
    }
    batches = sorted({b for _, b in rate})
    lines = [
        "| config | " + " | ".join(f"batch {b}" for b in batches) + " |",
        "|---" * (1 + len(batches)) + "|",
    ]
    for record in measured:
        section = record["decode_rate"]
        by_batch = {p["batch"]: p for p in section["points"]}
        # Both modes at a batch: the one logged in more windows.
        logged = {
            d["batch"]: d["tok_s"]
            for d in sorted(steady_decode(section), key=lambda d: d["windows"])
        }
        cells = []
        for b in batches:
            if b not in by_batch:
                cells.append("-")
                continue
            cell = rate_with_spread(by_batch[b])
            if ("nospec", b) in rate:
                cell += f", {by_batch[b]['output_tok_s'] / rate['nospec', b]:.3f}x"
            if b in logged:
                cell += f" (log {logged[b]:.0f})"
            cells.append(cell)
        lines.append(f"| {record['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def code_note(record: dict) -> str:
    """Names the records whose server ran pristine upstream instead of the fork."""
    code = record.get("code", {})
    if code.get("sglang") != "pristine upstream":
        return ""
    return f"; the server ran pristine upstream, {code['wheel']}"


def write_results(out_dir: str, records: List[dict]) -> None:
    """summary.json, results.md and throughput.png of the records of one model."""
    model = records[0]["model"]
    swept = swept_records(records)
    sections = [r["decode_rate"] for r in records if "decode_rate" in r]
    gpus = sorted({r["gpu"] for r in swept + sections})
    commits = sorted({r["commit"] for r in swept + sections})
    summary = {
        "model": model,
        "gpu": ", ".join(gpus),
        "commit": ", ".join(commits),
        "points": [summary_point(p) for r in swept for p in r["points"]],
        "ramp": [
            {"config": r["ramp"]["config"], "output_tok_s": r["ramp"]["output_tok_s"]}
            for r in swept
            if finished(r)
        ],
        "kv_capacity_tokens": {r["config"]: r["kv_capacity_tokens"] for r in swept},
        "decode_rate": [
            {k: p[k] for k in DECODE_RATE_KEYS} for d in sections for p in d["points"]
        ],
    }
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    title = f"{model} on {summary['gpu']}"
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(results_markdown(records, title))
    if swept:
        plot(swept, os.path.join(out_dir, "throughput.png"), title)


def config_threshold(text: str) -> Tuple[str, Union[int, str]]:
    name, _, value = text.partition("=")
    if value == SUGGESTED:
        return name, value
    try:
        return name, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected CONFIG=N or CONFIG={SUGGESTED}, got {text!r}"
        )


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the model, the configs and their servers (shared with profile_decode.py)."""
    parser.add_argument(
        "--preset",
        default="tiny",
        help="synthetic model preset (sglang.test.synthetic_spec_models)",
    )
    parser.add_argument(
        "--draft-accept",
        type=parse_draft_accept,
        default=0.8,
        help="the pair's draft acceptance P, or P_easy,P_hard: a content-shift pair",
    )
    parser.add_argument(
        "--configs",
        default="nospec,eagle3-topk1,eagle3-topk4,loadaware-topk1,loadaware-topk4,upstream-adaptive-topk1",
    )
    parser.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
    )
    parser.add_argument(
        "--disable-threshold",
        type=int,
        default=16,
        help="--speculative-disable-batch-threshold of the load-aware configs",
    )
    parser.add_argument(
        "--disable-threshold-for",
        type=config_threshold,
        action="append",
        default=[],
        metavar="CONFIG=N",
        help="the threshold of one load-aware config (repeatable), e.g. loadaware-topk1=48; "
        f"N={SUGGESTED}: where no speculation catches up with the config's always-on "
        "reference, from their finished records in the results directory (measure them "
        "first, e.g. earlier in --configs)",
    )
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--attention-backend", default="triton")
    parser.add_argument(
        "--tp-size", type=int, default=1, help="tensor parallelism of every server"
    )
    parser.add_argument("--flashinfer-workspace-mib", type=int, default=1024)
    parser.add_argument("--mem-fraction-static", type=float, default=0.8)
    parser.add_argument("--url", default="http://127.0.0.1:31000")
    parser.add_argument(
        "--out-dir",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
    )
    parser.add_argument(
        "--results-date",
        default=datetime.date.today().isoformat(),
        help="the date in the results directory's name (default today; an earlier "
        "run's date adds configs to its results)",
    )


def selected_configs(args) -> List[Config]:
    """The configs to run; those with a suggested threshold get theirs from
    with_suggested_threshold, right before they run."""
    per_config = dict(args.disable_threshold_for)
    configs = build_configs(
        args.disable_threshold,
        {name: n for name, n in per_config.items() if n != SUGGESTED},
    )
    not_load_aware = [
        n for n in per_config if n not in configs or not configs[n].load_aware
    ]
    if not_load_aware:
        sys.exit(f"--disable-threshold-for: not load-aware configs: {not_load_aware}")
    names = args.configs.split(",")
    unknown = set(names) - set(configs)
    if unknown:
        sys.exit(f"unknown configs {sorted(unknown)}; known: {list(configs)}")
    if any(configs[name].pristine for name in names):
        pristine_upstream()  # exits now, not after the configs before it, if missing
    return [configs[name] for name in names]


def with_suggested_threshold(args, config: Config) -> Config:
    """config, with the disable threshold that the records of no speculation and of
    its always-on reference suggest if it was given as CONFIG=suggested; exits when
    they are not measured yet or suggest none."""
    if dict(args.disable_threshold_for).get(config.name) != SUGGESTED:
        return config
    flag = f"--disable-threshold-for {config.name}={SUGGESTED}"
    out_dir = results_dir(args)
    with results_lock(out_dir):
        records = records_by_config(out_dir)
    references = ["nospec", config.always_on]
    missing = [n for n in references if not finished(records.get(n))]
    if missing:
        sys.exit(
            f"{flag}: no finished record of {missing} in {out_dir}; measure them first"
        )
    threshold, why = suggested_threshold(*(records[n] for n in references))
    if threshold is None:
        sys.exit(f"{flag}: {why}")
    print(f"{config.name}: {why}", flush=True)
    return build_configs(args.disable_threshold, {config.name: threshold})[config.name]


def generated_pair(
    preset: str, draft_accept: Union[float, Tuple[float, ...]]
) -> Tuple[str, str]:
    """synthetic_pair, generated in a child process where missing: generating on the
    GPU leaves a CUDA context (~0.5 GB) in the process that did it, which the servers
    started next would then lose from their KV pool."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as child:
        return child.submit(synthetic_pair, preset, draft_accept).result()


def model_name(args) -> str:
    tp = f"-tp{args.tp_size}" if args.tp_size > 1 else ""
    return f"{args.preset}-p{acceptance_label(args.draft_accept)}{tp}"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_server_args(parser)
    parser.add_argument("--requests-per-concurrency", type=int, default=4)
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument(
        "--min-point-seconds",
        type=float,
        default=10.0,
        help="repeat a point's requests until it has run this long (short points are noisy)",
    )
    parser.add_argument(
        "--steady",
        action="store_true",
        help="measure each point in one closed loop whose requests finish spread out "
        "rather than in waves (staggered first requests, no drain), counting the "
        "tokens generated in a window of --min-point-seconds",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measurements per point and of the ramp (median, spread)",
    )
    parser.add_argument(
        "--bench-serving",
        action="store_true",
        help="after each point, also run upstream's bench_serving at its C against "
        f"the same server (python -m {BENCH_SERVING_MODULE}: random-ids prompts of "
        "--input-len token ids, --output-len tokens, as many prompts as one of the "
        "point's closed loops, --repeats times) and record its output tok/s beside "
        "ours; the servers then run with their tokenizer (no --skip-tokenizer-init), "
        "since its client times the streamed text",
    )
    parser.add_argument(
        "--decode-rate",
        type=lambda s: [int(x) for x in s.split(",")],
        metavar="B1,B2,...",
        help="instead of the sweep and the ramp: the decode rate at each steady "
        "running batch B (B requests of --decode-output-len tokens at once; output "
        "tok/s from the moment all B stream to the first finish), --repeats times",
    )
    parser.add_argument("--decode-output-len", type=int, default=1024)
    parser.add_argument(
        "--ramp",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 4, 16, 64, 128],
    )
    parser.add_argument("--ramp-phase-seconds", type=float, default=10.0)
    parser.add_argument(
        "--content-shift",
        type=int,
        metavar="C",
        help="after the ramp: C clients on easy prompts for a ramp phase, then on "
        "hard ones (needs --draft-accept P_easy,P_hard)",
    )
    parser.add_argument(
        "--render",
        metavar="RESULTS_DIR",
        help="only rewrite summary.json, results.md and the plot from RESULTS_DIR/raw.json",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.render:
        with open(os.path.join(args.render, "raw.json")) as f:
            write_results(args.render, json.load(f)["records"])
        return
    configs = selected_configs(args)
    if args.content_shift and not isinstance(args.draft_accept, tuple):
        sys.exit(
            "--content-shift needs a content-shift pair: --draft-accept P_easy,P_hard"
        )
    target, draft = generated_pair(args.preset, args.draft_accept)
    header = describe_run(model_name(args))
    out_dir = results_dir(args)
    save = record_saver(out_dir, header)
    run = run_decode_rate if args.decode_rate else run_config
    for config in configs:
        config = with_suggested_threshold(args, config)
        run(args, config, target, draft, os.path.join(out_dir, "logs"), save)
        print(f"{config.name}: results in {out_dir}", flush=True)


if __name__ == "__main__":
    main()
