"""Measurements against a running server: a point (closed loops or a steady loop at a
concurrency), the decode rate of a steady batch, the ramp and the content shift."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import List, Tuple

from sglang.test.synthetic_spec_models import load_spec
from sweep.client import ContentShiftPrompts, PromptSource, RequestResult
from sweep.configs import Config
from sweep.loops import (
    closed_loop,
    decode_rate_loop,
    ramp_loop,
    run_load,
    steady_loop,
)
from sweep.server import process_cpu_seconds, server_state, spec_step_share
from sweep.stats import Run, median_with_spread, summarize
from tqdm import tqdm

# The benchmark client, and the server's front end, are each one asyncio thread that
# handles every streamed chunk: near a whole core, it sets the pace of the closed loop.
BUSY_SHARE_WARNING = 0.8


def sweep_workload(args: argparse.Namespace) -> dict:
    """What a sweep's clients send, kept in its records: records of another
    workload do not compare."""
    return {
        "input_len": args.input_len,
        "output_len": args.output_len,
        "steady": args.steady,
        "output_len_spread": args.output_len_spread,
    }


def point_requests(args: argparse.Namespace, concurrency: int) -> int:
    """The requests of one closed loop at a concurrency."""
    return max(args.min_requests, args.requests_per_concurrency * concurrency)


def measure_point(
    args: argparse.Namespace,
    config: Config,
    prompts: PromptSource,
    concurrency: int,
    front_end_pid: int,
) -> dict:
    """A point's runs, with how busy the client (over its runs) and the server's
    front end (over the whole point) kept a core."""
    num = point_requests(args, concurrency)
    name = f"{config.name} C={concurrency}"
    before = server_state(args.url)
    start, front_end_start = time.perf_counter(), process_cpu_seconds(front_end_pid)
    runs = [measure_run(args, prompts, num, concurrency) for _ in range(args.repeats)]
    front_end_cpu = process_cpu_seconds(front_end_pid) - front_end_start
    point = summarize(runs)
    point.update(
        config=config.name,
        concurrency=concurrency,
        spec_step_share=spec_step_share(config, before, server_state(args.url)),
        client_cpu_share=busy_client_share(runs, name),
        front_end_cpu_share=busy_share(
            front_end_cpu, time.perf_counter() - start, "the server's front end", name
        ),
    )
    return point


def measure_run(
    args: argparse.Namespace, prompts: PromptSource, num: int, concurrency: int
) -> Run:
    if args.steady:
        return run_load(
            steady_loop(
                args.url,
                prompts,
                args.output_len,
                concurrency,
                args.min_point_seconds,
                args.output_len_spread,
            )
        )
    return closed_loops_for(
        args.min_point_seconds, args.url, prompts, num, args.output_len, concurrency
    )


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
        results += run_load(closed_loop(url, loop_prompts, output_len, concurrency))
        wall += time.perf_counter() - start
        cpu += time.process_time() - cpu_start
        if wall >= min_seconds:
            return Run(results, sum(r.output_tokens for r in results), wall, cpu)


def busy_client_share(runs: List[Run], point: str) -> float:
    """The share of a core the client kept busy over the runs."""
    cpu = sum(r.client_cpu for r in runs)
    return busy_share(cpu, sum(r.wall for r in runs), "the client", point)


def busy_share(cpu_seconds: float, wall: float, whose: str, point: str) -> float:
    """The share of a core a process kept busy, with a warning when it may have set
    the pace of the point."""
    share = cpu_seconds / wall
    if share > BUSY_SHARE_WARNING:
        tqdm.write(
            f"{point}: {whose} kept {share:.0%} of a core busy; it may have "
            "limited this point"
        )
    return share


def measure_decode_rate(
    args: argparse.Namespace,
    config: Config,
    prompts: PromptSource,
    batch: int,
    front_end_pid: int,
) -> dict:
    """The output tok/s of a running batch of `batch` decoding requests, args.repeats
    times (median and spread), each time new prompts, with how busy the client and
    the server's front end (over the runs' windows) kept a core."""
    name = f"{config.name} batch {batch}"
    before = server_state(args.url)
    runs = [
        run_load(
            decode_rate_loop(
                args.url,
                prompts.take(batch),
                args.decode_output_len,
                lambda: process_cpu_seconds(front_end_pid),
            )
        )
        for _ in range(args.repeats)
    ]
    point = {
        "config": config.name,
        "batch": batch,
        **median_with_spread(run.tokens / run.wall for run in runs),
        "window_s": statistics.median(run.wall for run in runs),
        "spec_step_share": spec_step_share(config, before, server_state(args.url)),
        "client_cpu_share": busy_client_share(runs, name),
        "tenths_tok_s": [[round(r, 1) for r in run.tenths_tok_s] for run in runs],
    }
    front_end_cpu = [run.front_end_cpu for run in runs]
    if None not in front_end_cpu:  # else a run could not read it
        point["front_end_cpu_share"] = busy_share(
            sum(front_end_cpu),
            sum(run.wall for run in runs),
            "the server's front end",
            name,
        )
    return point


def run_ramp(args: argparse.Namespace, config: Config, prompts: PromptSource) -> dict:
    """Concurrency rising then falling in phases of fixed duration, with no drain
    between phases, args.repeats times: the median total and per-phase tok/s over
    the runs, and the spread of the total."""
    phases = args.ramp + args.ramp[-2::-1]
    before = server_state(args.url)
    runs = [
        ramp_rates(args, config, prompts, phases, run) for run in range(args.repeats)
    ]
    return {
        **phased_summary(config, runs, [{"concurrency": c} for c in phases]),
        "spec_step_share": spec_step_share(config, before, server_state(args.url)),
    }


def run_content_shift(args: argparse.Namespace, config: Config, target: str) -> dict:
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
        "concurrency": args.content_shift,
        **phased_summary(config, runs, [{"prompts": p} for p in ("easy", "hard")]),
    }


def phased_summary(
    config: Config, runs: List[Tuple[float, List[float]]], phases: List[dict]
) -> dict:
    """Runs of a phased load ((total tok/s, tok/s per phase) each): the median
    total with its spread, and per phase (described by ``phases``) the median."""
    return {
        "config": config.name,
        **median_with_spread(total for total, _ in runs),
        "phases": [
            {**phase, "output_tok_s": statistics.median(r[i] for _, r in runs)}
            for i, phase in enumerate(phases)
        ],
    }


def ramp_rates(
    args: argparse.Namespace,
    config: Config,
    prompts: PromptSource,
    phases: List[int],
    run: int,
) -> Tuple[float, List[float]]:
    """One ramp: total and per-phase output tok/s (each request counted in the phase it
    finished in; the last phase includes the final drain)."""
    results, bounds = run_load(
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
