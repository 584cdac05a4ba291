"""Upstream's own client (python -m sglang.benchmark.serving) against the same server,
beside ours (--bench-serving): at a point's concurrency, and on the content shift."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
from typing import List, Tuple

from sglang.test.synthetic_spec_models import (
    load_spec,
    prompt_text,
    region_prompt,
    tokenizer_dir,
)
from sweep.stats import median_with_spread
from sweep.workloads import point_requests

# Upstream's serving benchmark (0.5.17 moved `python -m sglang.bench_serving`, now a
# deprecated alias, here).
BENCH_SERVING_MODULE = "sglang.benchmark.serving"
# Nothing to download: the tokenizer is a local path, random-ids needs no dataset.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# The content shift's phases, by region of the content-shift pair.
CONTENT_SHIFT_PHASES = ("easy", "hard")


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
    workload: List[str],
) -> List[str]:
    """Upstream's bench_serving at one concurrency: num_prompts prompts of the
    workload's dataset, at most `concurrency` in flight, all issued at once; the
    radix cache flushed after its warm-up request. It appends its results as one
    JSON line to output_file."""
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
        tokenizer_dir(target),
        *workload,
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


def random_ids_workload(args: argparse.Namespace) -> List[str]:
    """Our points' workload: prompts of --input-len random token ids (random-ids: no
    dataset to download; sent as ids, as ours are), --output-len tokens each with
    ignore_eos (its default), both exact or spread as bench_serving_lengths says."""
    input_len, output_len, range_ratio = bench_serving_lengths(args)
    return [
        "--dataset-name",
        "random-ids",
        "--tokenize-prompt",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--random-range-ratio",
        str(range_ratio),
    ]


def prompts_file_workload(path: str, output_len: int) -> List[str]:
    """The prompts of a file that write_prompts_file wrote, output_len tokens each
    with ignore_eos."""
    return [
        "--dataset-name",
        "custom",
        "--dataset-path",
        path,
        "--sharegpt-output-len",
        str(output_len),
    ]


def write_prompts_file(prompts: List[List[int]], path: str) -> None:
    """Prompts (token ids of the synthetic pair) as bench_serving's custom dataset
    reads them: one conversation per line, the prompt as the text the pair's
    tokenizer encodes to its ids, then an empty reply."""
    with open(path, "w") as f:
        for prompt in prompts:
            turns = [
                {"role": "user", "content": prompt_text(prompt)},
                {"role": "assistant", "content": ""},
            ]
            f.write(json.dumps({"conversations": turns}) + "\n")


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
    server_name: str,
    target: str,
    point: dict,
    log_dir: str,
) -> dict:
    """--bench-serving: upstream's bench_serving at a point's concurrency against
    the server named ``server_name`` (its log's name), bench_serving_prompts of
    them, --repeats times; its output tok/s (median, spread), TTFT and TPOT, from
    its --output-file. Its files go to the log directory under the server's name."""
    concurrency = point["concurrency"]
    num = bench_serving_prompts(
        args, concurrency, point["output_tok_s"], args.min_point_seconds
    )
    output_file = fresh_output_file(
        log_dir, f"{server_name}-bench-serving-c{concurrency}"
    )
    command = bench_serving_command(
        args, target, concurrency, num, output_file, random_ids_workload(args)
    )
    for _ in range(args.repeats):
        run_once(command, log_dir, server_name, f"C={concurrency}")
    return {**bench_serving_result(output_file, num), "command": command}


def bench_serving_prompts(
    args: argparse.Namespace, concurrency: int, output_tok_s: float, seconds: float
) -> int:
    """As many prompts as one closed loop at this concurrency, and at least as many
    as our measured rate there finishes in as many seconds as ours ran: a run of a
    few seconds moves by several percent with one slow first request."""
    requests_per_second = output_tok_s / args.output_len
    return max(
        point_requests(args, concurrency),
        math.ceil(requests_per_second * seconds),
    )


def run_content_shift_bench_serving(
    args: argparse.Namespace,
    server_name: str,
    target: str,
    log_dir: str,
    shift: dict,
) -> dict:
    """--bench-serving with --content-shift C: upstream's bench_serving at C on easy
    prompts, then at once on hard ones (each phase as long as ours, ``shift``, at
    its rate: bench_serving_prompts), --repeats times: the median total output
    tok/s (both phases' tokens over both phases' durations) with its spread, and
    each phase's median."""
    concurrency = args.content_shift
    nums = [
        bench_serving_prompts(
            args, concurrency, phase["output_tok_s"], args.ramp_phase_seconds
        )
        for phase in shift["phases"]
    ]
    phases = content_shift_phases(args, server_name, target, nums, log_dir)
    for _ in range(args.repeats):
        for name, command, _ in phases:
            run_once(command, log_dir, server_name, f"content shift, {name} prompts")
    runs = [
        bench_serving_runs(output_file, num)
        for (_, _, output_file), num in zip(phases, nums)
    ]
    totals = [
        sum(run["total_output_tokens"] for run in repeat)
        / sum(run["duration"] for run in repeat)
        for repeat in zip(*runs)
    ]
    return {
        "concurrency": concurrency,
        **median_with_spread(totals),
        "phases": [
            {
                "prompts": name,
                "output_tok_s": statistics.median(
                    run["output_throughput"] for run in phase_runs
                ),
            }
            for (name, _, _), phase_runs in zip(phases, runs)
        ],
        "commands": [command for _, command, _ in phases],
    }


def content_shift_phases(
    args: argparse.Namespace,
    server_name: str,
    target: str,
    nums: List[int],
    log_dir: str,
) -> List[Tuple[str, List[str], str]]:
    """Per phase of the content shift: its name, the bench_serving command at C on
    a file of its number of prompts (``nums``) of its region of the pair, and its
    output file."""
    spec = load_spec(os.path.dirname(target))
    phases = []
    for region, (name, num) in enumerate(zip(CONTENT_SHIFT_PHASES, nums)):
        rng = random.Random(region)
        # One per server: servers measured by other invocations share log_dir.
        prompts_file = os.path.join(
            log_dir, f"{server_name}-content-shift-{name}-prompts.jsonl"
        )
        write_prompts_file(
            [region_prompt(spec, region, args.input_len, rng) for _ in range(num)],
            prompts_file,
        )
        output_file = fresh_output_file(
            log_dir, f"{server_name}-bench-serving-shift-{name}"
        )
        workload = prompts_file_workload(prompts_file, args.output_len)
        command = bench_serving_command(
            args, target, args.content_shift, num, output_file, workload
        )
        phases.append((name, command, output_file))
    return phases


def fresh_output_file(log_dir: str, name: str) -> str:
    output_file = os.path.join(log_dir, f"{name}.jsonl")
    if os.path.exists(output_file):
        os.remove(output_file)  # bench_serving appends
    return output_file


def run_once(command: List[str], log_dir: str, server_name: str, what: str) -> None:
    """One bench_serving run, its output appended to the server's log."""
    log_path = os.path.join(log_dir, f"{server_name}-bench-serving.log")
    with open(log_path, "a") as log:
        done = subprocess.run(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **OFFLINE_ENV},
        )
    if done.returncode != 0:
        raise RuntimeError(
            f"{server_name} {what}: bench_serving exited with "
            f"{done.returncode}; see {log_path}"
        )


def bench_serving_runs(output_file: str, num_prompts: int) -> List[dict]:
    """The runs bench_serving appended to output_file, each of which completed
    every prompt."""
    with open(output_file) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    if not runs or any(run["completed"] != num_prompts for run in runs):
        raise RuntimeError(
            f"{output_file}: bench_serving completed "
            f"{[run['completed'] for run in runs]} of {num_prompts} requests per run"
        )
    return runs


def bench_serving_result(output_file: str, num_prompts: int) -> dict:
    """The runs bench_serving appended to output_file, summarized."""
    runs = bench_serving_runs(output_file, num_prompts)
    return {
        "num_requests": sum(run["completed"] for run in runs),
        **median_with_spread(run["output_throughput"] for run in runs),
        "ttft_p50_ms": statistics.median(run["median_ttft_ms"] for run in runs),
        "tpot_p50_ms": statistics.median(run["median_tpot_ms"] for run in runs),
    }
