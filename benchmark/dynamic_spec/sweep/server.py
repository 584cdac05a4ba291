"""A config's server: its flags and environment, a fresh launch on an idle GPU, warmed
up, and what it reports (its state, the decode throughput it logged)."""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import psutil
import requests
from sglang.test.spec_engine_utils import (
    cli_args,
    eagle3_args,
    running_server,
    with_synthetic_tokenizer,
)
from sweep.client import PromptSource
from sweep.configs import Config, pristine_upstream
from sweep.loops import closed_loop, run_load

# Warm-up requests are short, whatever output length is measured.
WARMUP_OUTPUT_LEN = 32


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


# A GPU holding more is still serving (a previous server not gone yet).
IDLE_GPU_MAX_USED_MIB = 2048


def wait_gpu_idle(timeout: float = 120) -> None:
    """Wait until the GPUs this process may use hold no other server."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        used = visible_gpu_query("memory.used")
        if used and max(int(u) for u in used) <= IDLE_GPU_MAX_USED_MIB:
            return
        time.sleep(2)
    raise RuntimeError("GPU still busy: the previous server did not exit")


def backend_env(args: argparse.Namespace) -> Dict[str, str]:
    """flashinfer's default workspace (384 MiB) is too small for verify graphs at large
    batches and for draft trees; every config gets the same, larger one. (Upstream resets
    it to 512 MiB for Qwen2/Qwen3 architectures: use triton for the dense32b preset.)"""
    if args.attention_backend != "flashinfer":
        return {}
    return {
        "SGLANG_FLASHINFER_WORKSPACE_SIZE": str(args.flashinfer_workspace_mib << 20)
    }


def largest_load(args: argparse.Namespace) -> int:
    """The most requests any load of the run keeps in flight: its points, ramp,
    content shift or steady decode batches."""
    loads = [
        *args.concurrency,
        *(getattr(args, "ramp", None) or []),
        getattr(args, "content_shift", None) or 0,
        *(getattr(args, "decode_rate", None) or []),
    ]
    return max(loads)


def config_server_args(
    args: argparse.Namespace, config: Config, draft: str
) -> List[str]:
    """launch_server flags of a config: shared serving flags, then its speculation.
    The servers keep their tokenizer, as deployments do: upstream's bench_serving
    counts and times only streamed text, and every call of a sweep, with
    --bench-serving or without, then runs the same front end."""
    max_bs = largest_load(args)
    server_args = cli_args(
        dict(
            attention_backend=args.attention_backend,
            tp_size=args.tp_size,
            cuda_graph_max_bs=max_bs,
            # One more: 0.5.17's scheduler counts the request row of a prefill that
            # continues in a new chunk twice, so it runs one request fewer than
            # --max-running-requests (upstream counts it once by 0.5.23).
            max_running_requests=max_bs + 1,
            mem_fraction_static=args.mem_fraction_static,
            enable_metrics=True,
            stream_interval=args.stream_interval,
        )
    )
    if config.spec is not None:
        server_args += cli_args(
            eagle3_args(draft, **config.spec, draft_arch=args.draft_arch)
        )
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


def server_env(args: argparse.Namespace, config: Config) -> Dict[str, str]:
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
        run_load(
            closed_loop(url, prompts.take(concurrency), WARMUP_OUTPUT_LEN, concurrency)
        )


@dataclasses.dataclass
class Launched:
    """A running server: how it was launched (for its record), and the pid of its
    front end, launch_server's own process (HTTP server and tokenizer manager),
    through which every request and streamed chunk passes."""

    record: Dict[str, Any]
    front_end_pid: int


def process_cpu_seconds(pid: int) -> float:
    """The CPU seconds (user and system, all threads) a process has used so far."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


@contextlib.contextmanager
def serving(
    args: argparse.Namespace,
    config: Config,
    target: str,
    draft: str,
    prompts: PromptSource,
    warmup_concurrencies: Iterable[int],
    log_path: Optional[str] = None,
) -> Iterator[Launched]:
    """A fresh server of a config (the previous one gone, the GPU idle), warmed up at
    warmup_concurrencies. log_path: the server's output (default: ours); an auto
    config's step trace goes beside it (unless --no-step-trace)."""
    env = server_env(args, config)
    if config.auto and log_path is not None and args.step_trace:
        env["SGLANG_LOAD_AWARE_STEP_TRACE"] = step_trace_path(log_path)
        if os.path.exists(env["SGLANG_LOAD_AWARE_STEP_TRACE"]):
            os.remove(env["SGLANG_LOAD_AWARE_STEP_TRACE"])  # the server appends
    launch = {"code": code_that_runs(config, env), "env": env}
    if config.adaptive_config is not None:
        launch["adaptive_config"] = config.adaptive_config
    wait_gpu_idle()
    # Here as well as in running_server, so that the record shows the flag.
    server_args = with_synthetic_tokenizer(
        target, config_server_args(args, config, draft)
    )
    with running_server(
        target, server_args, env=env, base_url=args.url, log_path=log_path
    ) as (_, process):
        warm_up(args.url, prompts, warmup_concurrencies)
        yield Launched({"server_args": server_args, **launch}, process.pid)


def step_trace_path(log_path: str) -> str:
    """Where an auto server beside log_path writes its step trace (policy_sim.py
    --trace replays it)."""
    return f"{os.path.splitext(log_path)[0]}-steps.jsonl"


def server_state(url: str) -> dict:
    return requests.get(f"{url}/server_info", timeout=30).json()["internal_states"][0]


def spec_step_share(config: Config, before: dict, after: dict) -> Optional[float]:
    """The share of decode steps that speculated; None where the server does not
    count them (--speculative-adaptive without a load-aware policy: its tiers may
    choose 0 draft steps)."""
    if not config.load_aware:
        if config.spec is None:
            return 0.0
        return None if "--speculative-adaptive" in config.extra_args else 1.0
    b, a = before["load_aware_speculation"], after["load_aware_speculation"]
    spec = a["num_spec_steps"] - b["num_spec_steps"]
    plain = a["num_plain_steps"] - b["num_plain_steps"]
    return spec / (spec + plain) if spec + plain else 0.0


DECODE_LOG_LINE = re.compile(
    # Hybrid pools log "#full token: N" (and the SWA / host pools after it).
    r"Decode batch(?: \[\d+\])?, #running-req: (\d+), #(?:\w+ )?token: (\d+),.*"
    r"gen throughput \(token/s\): ([\d.]+)"
)
SPEC_MODE_FIELD = re.compile(r"spec: (on|off)")
ACCEPT_LENGTH_FIELD = re.compile(r"accept len: ([\d.]+)")


def verified_drafts(line: str) -> bool:
    """Whether a decode log line's window ran speculative steps (a load-aware
    server's plain window with probes in it logs their accept length)."""
    field = ACCEPT_LENGTH_FIELD.search(line)
    return field is not None and float(field.group(1)) > 0


def last_error_line(log_path: str) -> Optional[str]:
    """The last line of a server log that names an error or exception (what killed
    the server, where it died), or None."""
    found = None
    with open(log_path, errors="replace") as log:
        for line in log:
            if re.search(r"(Error|Exception)\b", line):
                found = line.strip()
    return found


def decode_windows(log_lines: Iterable[str], speculative: bool) -> List[dict]:
    """The steady decode windows a server logged (--decode-log-interval steps without
    a prefill, the same running batch at both ends, and, where plain, no speculative
    step), in log order: each one's mode ("spec" or "plain"; load-aware servers log
    it), running batch, KV tokens in use and decode tok/s."""
    windows = []
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
            if spec or not verified_drafts(line):
                windows.append(
                    {
                        "mode": "spec" if spec else "plain",
                        "batch": batch,
                        "tokens": int(match.group(2)),
                        "tok_s": float(match.group(3)),
                    }
                )
        window_batch = batch
    return windows


def decode_throughput(windows: Iterable[dict]) -> List[dict]:
    """The median decode tok/s of steady windows (decode_windows), per mode and
    running batch."""
    samples: Dict[Tuple[str, int], List[float]] = collections.defaultdict(list)
    for window in windows:
        samples[window["mode"], window["batch"]].append(window["tok_s"])
    return [
        {"mode": mode, "batch": bs, "tok_s": statistics.median(v), "windows": len(v)}
        for (mode, bs), v in sorted(samples.items())
    ]
