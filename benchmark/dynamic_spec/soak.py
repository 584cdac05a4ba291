"""Soak a load-aware server with what production sends it, and check every output.

For --minutes, clients whose number moves between 1 and --max-concurrency (a new
level every --phase-seconds) send requests of mixed prompt and output lengths to a
server of a synthetic target (``python -m sglang.test.synthetic_spec_models``),
whose greedy output is known: plain requests, some with logprobs, some stopped by a
stop string, some held to a regex by the grammar backend, and a share cancelled
mid-stream by their client. Every request that finishes must be token-identical to
its intended continuation. Writes a JSON summary: requests, errors, mismatches,
aborts, retractions and switches (from the server's metrics), whether the server
is healthy once idle (its scheduler checks the KV pool then), and the GPU memory in
use over time.

The server must serve the target with its tokenizer (no --skip-tokenizer-init),
xgrammar as its grammar backend and --enable-metrics:

    python -m sglang.launch_server --model-path /tmp/synth/tiny-p0.8-s0/target \\
        --speculative-algorithm EAGLE3 ... --speculative-disable-batch-threshold auto \\
        --enable-metrics
    python benchmark/dynamic_spec/soak.py --url http://127.0.0.1:30000 \\
        --model-dir /tmp/synth/tiny-p0.8-s0 --minutes 10 --out soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import subprocess
import time
from typing import Dict, List, Optional, Sequence, Tuple

import aiohttp
import psutil
import requests

from sglang.test.spec_engine_utils import greedy_params, metric_total, scrape_metrics
from sglang.test.synthetic_spec_models import (
    detoured_continuation,
    greedy_continuation,
    next_token_map,
    token_ids_in,
    token_name,
    token_regex,
)

CONCURRENCY_LEVELS = (1, 2, 8, 32, 64, 128, 256)
GPU_SAMPLE_SECONDS = 10.0
CONTEXT_MARGIN = 64
KINDS = ("plain", "logprob", "stop", "grammar")


@dataclasses.dataclass
class SoakRequest:
    kind: str
    input_ids: List[int]
    params: Dict[str, object]
    # The output tokens it must produce (from the text for stop requests).
    intended: List[int]
    # Cancel after this many streamed chunks (None: let it finish).
    abort_after: Optional[int] = None


class RequestMaker:
    """Random requests of every kind, with their intended output."""

    def __init__(
        self,
        token_map: Sequence[int],
        rng: random.Random,
        kind_weights: Dict[str, float],
        abort_share: float,
        max_prompt_len: int,
        max_output_len: int,
        context_len: int,
    ) -> None:
        self.token_map = token_map
        self.rng = rng
        self.kinds, self.weights = zip(*kind_weights.items())
        self.abort_share = abort_share
        self.max_prompt_len = max_prompt_len
        self.max_output_len = max_output_len
        self.context_len = context_len
        # A stop string must be no prefix of another token's text: the longest ids.
        self.stop_tokens = {
            t
            for t in range(len(token_map))
            if len(str(t)) == len(str(len(token_map) - 1))
        }

    def __call__(self) -> SoakRequest:
        rng = self.rng
        prompt = [
            rng.randrange(3, len(self.token_map))
            for _ in range(rng.randint(4, self.max_prompt_len))
        ]
        # Room left in the context for the draft tokens of a speculative step.
        room = self.context_len - len(prompt) - CONTEXT_MARGIN
        n = rng.randint(4, max(4, min(self.max_output_len, room)))
        kind = rng.choices(self.kinds, self.weights)[0]
        request = getattr(self, f"_{kind}")(prompt, n)
        if rng.random() < self.abort_share:
            request.abort_after = rng.randint(1, max(1, n // 2))
        return request

    def _plain(self, prompt: List[int], n: int) -> SoakRequest:
        intended = greedy_continuation(self.token_map, prompt, n)
        return SoakRequest("plain", prompt, greedy_params(n), intended)

    def _logprob(self, prompt: List[int], n: int) -> SoakRequest:
        request = self._plain(prompt, n)
        request.kind = "logprob"
        return request

    def _stop(self, prompt: List[int], n: int) -> SoakRequest:
        continuation = greedy_continuation(self.token_map, prompt, n)
        # Not at the last token: a request that reaches max_new_tokens finishes by
        # length before its stop strings are checked, and keeps the stop string.
        at = next(
            (k for k, t in enumerate(continuation[:-1]) if t in self.stop_tokens),
            None,
        )
        if at is None:
            return self._plain(prompt, n)
        params = greedy_params(n, stop=[token_name(continuation[at])])
        return SoakRequest("stop", prompt, params, continuation[:at])

    def _grammar(self, prompt: List[int], n: int) -> SoakRequest:
        wanted = detoured_continuation(self.token_map, prompt, n, self.rng.randrange(n))
        params = greedy_params(n, regex=token_regex(wanted))
        return SoakRequest("grammar", prompt, params, wanted)


def outcome_of(request: SoakRequest, body: dict) -> Tuple[str, Optional[str]]:
    """("ok" | "mismatch" | "error", what differed) of a finished request."""
    if "error" in body:
        return "error", str(body["error"])
    meta = body["meta_info"]
    if request.kind == "stop":
        got = token_ids_in(body["text"])
        expected_finish = "stop"
    else:
        got, expected_finish = body["output_ids"], "length"
    if got != request.intended:
        return (
            "mismatch",
            f"{request.kind}: got {got[:16]}..., intended {request.intended[:16]}... "
            f"(max_new_tokens {request.params['max_new_tokens']}, "
            f"finish {meta['finish_reason']})",
        )
    if meta["finish_reason"]["type"] != expected_finish:
        return "mismatch", f"{request.kind}: finish {meta['finish_reason']}"
    if request.kind == "logprob" and len(meta["output_token_logprobs"]) != len(got):
        return "mismatch", "logprob: one logprob per output token expected"
    return "ok", None


async def send(
    session: aiohttp.ClientSession, url: str, request: SoakRequest
) -> Tuple[str, Optional[str]]:
    payload = {
        "input_ids": request.input_ids,
        "sampling_params": request.params,
        "return_logprob": request.kind == "logprob",
        "stream": request.abort_after is not None,
    }
    try:
        async with session.post(f"{url}/generate", json=payload) as response:
            if response.status != 200:
                return "error", f"HTTP {response.status}: {await response.text()}"
            if request.abort_after is None:
                return outcome_of(request, await response.json())
            chunks = 0
            async for line in response.content:
                if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                    chunks += 1
                    if chunks >= request.abort_after:
                        return "aborted", None  # leaving the block disconnects
            return "finished_before_abort", None
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return "error", f"{type(e).__name__}: {e}"


def concurrency_schedule(
    rng: random.Random, seconds: float, phase_seconds: float, max_concurrency: int
) -> List[int]:
    """One level per phase, each different from the last; the first and the last 1,
    the maximum at least once (in the middle unless drawn)."""
    if max_concurrency < 2:
        raise ValueError("a soak moves between 1 and --max-concurrency: give 2 or more")
    levels = [c for c in CONCURRENCY_LEVELS if c < max_concurrency] + [max_concurrency]
    middle: List[int] = []
    for _ in range(max(1, round(seconds / phase_seconds) - 2)):
        middle.append(rng.choice([c for c in levels if c != (middle or [1])[-1]]))
    if middle[-1] == 1:
        middle.pop()  # the last phase is one client anyway
    if max_concurrency not in middle:
        middle[len(middle) // 2] = max_concurrency
    return [1, *middle, 1]


def nvidia_smi_numbers(query: str) -> List[List[int]]:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[int(x) for x in line.split(",")] for line in out.splitlines() if line]


def gpu_memory_used_mib(server_pid: Optional[int]) -> Optional[List[int]]:
    """MiB in use on every GPU, or (server_pid) by that process and its children
    on each GPU they use: other processes on the GPU do not count then."""
    if server_pid is None:
        return [row[0] for row in nvidia_smi_numbers("gpu=memory.used")] or None
    try:
        server = psutil.Process(server_pid)
        pids = {server_pid, *(p.pid for p in server.children(recursive=True))}
    except psutil.NoSuchProcess:
        return None  # the server died: its requests' errors tell
    apps = nvidia_smi_numbers("compute-apps=pid,used_memory")
    return [mib for pid, mib in apps if pid in pids] or None


class Soak:
    def __init__(
        self,
        url: str,
        make_request: RequestMaker,
        schedule: List[int],
        server_pid: Optional[int] = None,
    ) -> None:
        self.url = url
        self.server_pid = server_pid
        self.make_request = make_request
        self.schedule = schedule
        self.level = schedule[0]
        self.done = False
        self.counts: Dict[str, Dict[str, int]] = {}
        self.problems: List[str] = []

    async def run(self, phase_seconds: float) -> List[dict]:
        gpu: List[dict] = []
        began = time.monotonic()
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2)
        timeout = aiohttp.ClientTimeout(total=3600)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:
            clients = [
                asyncio.create_task(self.client(s, i))
                for i in range(max(self.schedule))
            ]
            for level in self.schedule:
                self.level = level
                phase_end = time.monotonic() + phase_seconds
                while (left := phase_end - time.monotonic()) > 0:
                    used = await asyncio.to_thread(gpu_memory_used_mib, self.server_pid)
                    if used is not None:
                        gpu.append({"t": round(time.monotonic() - began), "mib": used})
                    await asyncio.sleep(min(GPU_SAMPLE_SECONDS, left))
            self.done = True
            await asyncio.gather(*clients)
        return gpu

    async def client(self, session: aiohttp.ClientSession, index: int) -> None:
        while not self.done:
            if index >= self.level:
                await asyncio.sleep(0.05)
                continue
            request = self.make_request()
            outcome, problem = await send(session, self.url, request)
            by_kind = self.counts.setdefault(request.kind, {})
            by_kind[outcome] = by_kind.get(outcome, 0) + 1
            if problem is not None and len(self.problems) < 20:
                self.problems.append(problem)


def total(counts: Dict[str, Dict[str, int]], outcome: str) -> int:
    return sum(by_kind.get(outcome, 0) for by_kind in counts.values())


def server_metrics(url: str) -> Dict[str, float]:
    samples = scrape_metrics(url)
    return {
        "retractions": metric_total(samples, "sglang:num_retracted_requests_total"),
        "switches": metric_total(samples, "sglang:spec_toggles_total"),
        "spec_steps": metric_total(
            samples, "sglang:spec_decode_steps_total", mode="spec"
        ),
        "plain_steps": metric_total(
            samples, "sglang:spec_decode_steps_total", mode="plain"
        ),
    }


def healthy_after_idle(url: str, wait_seconds: float) -> bool:
    """Whether the server still answers /health once idle: its scheduler checks
    that every KV slot is free or cached when it idles, and dies on a leak."""
    time.sleep(wait_seconds)
    try:
        return requests.get(f"{url}/health", timeout=30).status_code == 200
    except requests.RequestException:
        return False


def memory_growth_after_warmup(gpu: List[dict], warmup_seconds: float) -> Optional[int]:
    after = [sum(s["mib"]) for s in gpu if s["t"] >= warmup_seconds]
    return max(after) - after[0] if len(after) > 1 else None


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument(
        "--model-dir", required=True, help="the synthetic pair's directory"
    )
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--phase-seconds", type=float, default=30.0)
    parser.add_argument("--max-concurrency", type=int, default=256)
    parser.add_argument("--abort-share", type=float, default=0.05)
    parser.add_argument(
        "--kinds",
        default="plain=0.7,logprob=0.1,stop=0.1,grammar=0.1",
        help="request kinds and their shares",
    )
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument(
        "--warmup-seconds",
        type=float,
        default=60.0,
        help="GPU memory growth is counted from then on",
    )
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=10.0,
        help="how long the server idles before the closing health check",
    )
    parser.add_argument(
        "--server-pid",
        type=int,
        help="count the GPU memory of this process and its children only",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="the JSON summary (default: printed only)")
    args = parser.parse_args(argv)

    kinds = {k: float(w) for k, w in (p.split("=") for p in args.kinds.split(","))}
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown request kinds {sorted(unknown)}; known: {KINDS}")
    if args.max_concurrency < 2:
        parser.error(
            "--max-concurrency: the soak moves between 1 and it, give 2 or more"
        )
    rng = random.Random(args.seed)
    with open(os.path.join(args.model_dir, "target", "config.json")) as f:
        context_len = json.load(f)["max_position_embeddings"]
    make_request = RequestMaker(
        next_token_map(args.model_dir),
        rng,
        kinds,
        args.abort_share,
        min(args.max_prompt_len, context_len // 2),
        args.max_output_len,
        context_len,
    )
    schedule = concurrency_schedule(
        rng, args.minutes * 60, args.phase_seconds, args.max_concurrency
    )
    before = server_metrics(args.url)
    soak = Soak(args.url, make_request, schedule, args.server_pid)
    gpu = asyncio.run(soak.run(args.phase_seconds))
    after = server_metrics(args.url)
    summary = {
        "minutes": args.minutes,
        "concurrency_schedule": schedule,
        "requests": sum(sum(c.values()) for c in soak.counts.values()),
        "finished": total(soak.counts, "ok") + total(soak.counts, "mismatch"),
        "aborted": total(soak.counts, "aborted"),
        "errors": total(soak.counts, "error"),
        "mismatches": total(soak.counts, "mismatch"),
        "by_kind": soak.counts,
        "problems": soak.problems,
        **{k: after[k] - before[k] for k in after},
        "healthy_after_idle": healthy_after_idle(args.url, args.idle_seconds),
        "gpu_memory_scope": "device" if args.server_pid is None else "server",
        "gpu_memory_growth_after_warmup_mib": memory_growth_after_warmup(
            gpu, args.warmup_seconds
        ),
        "gpu_memory_mib": gpu,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "gpu_memory_mib"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
