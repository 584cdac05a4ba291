"""Upstream's own client (python -m sglang.benchmark.serving) at a point's concurrency,
against the same server, beside ours (--bench-serving)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import List, Tuple

from sweep.configs import Config
from sweep.stats import median_with_spread
from sweep.workloads import point_requests

# Upstream's serving benchmark (0.5.17 moved `python -m sglang.bench_serving`, now a
# deprecated alias, here).
BENCH_SERVING_MODULE = "sglang.benchmark.serving"
# Nothing to download: the tokenizer is a local path, random-ids needs no dataset.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def bench_serving_enabled(args: argparse.Namespace) -> bool:
    return getattr(args, "bench_serving", None) is not None


def bench_serving_at(args: argparse.Namespace, concurrency: int) -> bool:
    """Whether the point at `concurrency` also runs bench_serving: every point
    when --bench-serving lists no C."""
    return bench_serving_enabled(args) and (
        not args.bench_serving or concurrency in args.bench_serving
    )


def bench_serving_command(
    args: argparse.Namespace,
    target: str,
    concurrency: int,
    num_prompts: int,
    output_file: str,
) -> List[str]:
    """Upstream's bench_serving at one concurrency, with our point's workload:
    num_prompts prompts of --input-len random token ids (random-ids: no dataset to
    download; sent as ids, as ours are), --output-len tokens each with ignore_eos
    (its default), both exact or spread as bench_serving_lengths says, at most
    `concurrency` in flight, all issued at once; the radix cache flushed after its
    warm-up request. It appends its results as one JSON line to output_file."""
    input_len, output_len, range_ratio = bench_serving_lengths(args)
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
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--random-range-ratio",
        str(range_ratio),
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


def bench_serving_lengths(args: argparse.Namespace) -> Tuple[int, int, float]:
    """bench_serving's --random-input-len, --random-output-len and
    --random-range-ratio. It draws each length uniformly from len x [ratio, 1] and
    applies one ratio to both, so --output-len-spread S spreads the prompts too:
    both then come from their mean x [1 - S, 1 + S], the output lengths as ours."""
    spread = args.output_len_spread
    if not spread:
        return args.input_len, args.output_len, 1.0
    widest = 1.0 + spread
    return (
        round(args.input_len * widest),
        round(args.output_len * widest),
        round((1.0 - spread) / widest, 6),
    )


def run_bench_serving(
    args: argparse.Namespace,
    config: Config,
    target: str,
    concurrency: int,
    log_dir: str,
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
