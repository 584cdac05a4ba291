"""Where a decode step's time goes, per config: a torch profile (CPU and GPU) of --steps
decode steps at a steady batch of C requests, summarized by trace_summary.py.

Each config gets a fresh server (as in bench_sweep.py). Per concurrency C, exactly C
requests are submitted at once, with outputs long enough that none finishes (and no
prefill runs) while the profile records; they are cancelled once the trace is written.
With --closed-loop, C clients instead issue new prompts back to back (as in
bench_sweep.py's points; pass a short --output-len), so requests finish and new ones
are prefilled while the profile records.
Writes the traces into OUT_DIR/<date>-<model>/profiles/<config>-c<C>[-closed-loop]/ and
the summaries into OUT_DIR/<date>-<model>/profiles[-closed-loop].json and .md.

Usage:
  python benchmark/dynamic_spec/profile_decode.py --preset llama8b --draft-accept 0.95
      --configs nospec,loadaware-topk1,loadaware-topk4 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import time
from typing import Any, Dict, List, Set

import aiohttp
from sweep.cli import (
    add_server_args,
    generated_pair,
    selected_configs,
    spread_fraction,
    with_suggested_threshold,
)
from sweep.client import PromptSource
from sweep.configs import Config
from sweep.loops import closed_loop, run_load
from sweep.results import results_dir
from sweep.server import serving
from trace_summary import format_summary, load_written_events, summarize_trace


def workload_suffix(args: argparse.Namespace) -> str:
    """Names the traces and summaries of --closed-loop runs apart."""
    return "-closed-loop" if args.closed_loop else ""


async def profile_at(
    args: argparse.Namespace,
    config: Config,
    prompts: PromptSource,
    concurrency: int,
    out_dir: str,
) -> str:
    """Profile --steps decode steps of `concurrency` running requests; returns the trace."""
    profile_dir = os.path.join(
        os.path.abspath(out_dir),
        "profiles",
        f"{config.name}-c{concurrency}{workload_suffix(args)}",
    )
    earlier_traces = set(rank0_traces(profile_dir))
    # The closed loop draws from the endless source until the profile is written.
    load_prompts = prompts if args.closed_loop else prompts.take(concurrency)
    load = asyncio.create_task(
        closed_loop(
            args.url,
            load_prompts,
            args.output_len,
            concurrency,
            args.output_len_spread,
        )
    )
    await asyncio.sleep(args.warmup_seconds)  # all prefilled, decoding
    async with aiohttp.ClientSession() as session:
        request = {
            "output_dir": profile_dir,
            "num_steps": args.steps,
            "activities": ["CPU", "GPU"],
            "profile_prefix": config.name,
        }
        async with session.post(f"{args.url}/start_profile", json=request) as response:
            response.raise_for_status()
    try:
        return await wait_for_trace(profile_dir, earlier_traces, load)
    finally:
        load.cancel()  # the server aborts requests whose client went away
        await asyncio.gather(load, return_exceptions=True)


def rank0_traces(profile_dir: str) -> List[str]:
    return glob.glob(os.path.join(profile_dir, "*TP-0*.trace.json.gz"))


async def wait_for_trace(
    profile_dir: str, earlier: Set[str], load: asyncio.Task, timeout: float = 120
) -> str:
    """The rank-0 trace the server writes next (not one of ``earlier``, an earlier
    run's); the load must still run."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        traces = [t for t in rank0_traces(profile_dir) if t not in earlier]
        if traces:
            return traces[0]
        if load.done():
            raise RuntimeError(
                "the requests finished before the profile did: raise --output-len"
            )
        await asyncio.sleep(0.5)
    raise RuntimeError(f"no trace written into {profile_dir}")


def profile_config(
    args: argparse.Namespace, config: Config, target: str, draft: str, out_dir: str
) -> List[dict]:
    prompts = PromptSource(args.input_len)
    with serving(args, config, target, draft, prompts, args.concurrency) as launched:
        profiles = []
        for concurrency in args.concurrency:
            trace = run_load(profile_at(args, config, prompts, concurrency, out_dir))
            profiles.append(
                {
                    "config": config.name,
                    "concurrency": concurrency,
                    "trace": trace,
                    "summary": summarize_trace(load_written_events(trace), args.steps),
                    **launched.record,
                }
            )
        return profiles


def write_profiles(out_dir: str, name: str, profiles: List[Dict[str, Any]]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(profiles, f, indent=1)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        for p in profiles:
            f.write(f"## {p['config']}, {p['concurrency']} running requests\n\n")
            f.write(f"```\n{format_summary(p['summary'])}\n```\n\n")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_server_args(parser)
    parser.set_defaults(concurrency=[64], output_len=4096)
    parser.add_argument("--steps", type=int, default=16, help="decode steps profiled")
    parser.add_argument(
        "--warmup-seconds",
        type=float,
        default=2.0,
        help="from submitting the requests to starting the profile",
    )
    parser.add_argument(
        "--closed-loop",
        action="store_true",
        help="keep C requests in flight, each new one with a new prompt",
    )
    parser.add_argument(
        "--output-len-spread",
        type=spread_fraction,
        default=0.0,
        metavar="S",
        help="--closed-loop: draw each request's output length uniformly from "
        "--output-len x [1 - S, 1 + S] (0 <= S < 1), so that requests do not finish "
        "in waves",
    )
    args = parser.parse_args()
    if args.output_len_spread and not args.closed_loop:
        parser.error("--output-len-spread: only with --closed-loop")
    return args


def main() -> None:
    args = parse_args()
    configs = selected_configs(args)
    target, draft = generated_pair(args.preset, args.draft_accept, args.draft_arch)
    out_dir = results_dir(args)
    profiles = []
    for config in configs:
        config = with_suggested_threshold(args, config)
        profiles += profile_config(args, config, target, draft, out_dir)
        write_profiles(out_dir, f"profiles{workload_suffix(args)}", profiles)
        print(f"{config.name}: profiles in {out_dir}", flush=True)
    for p in profiles:
        print(f"== {p['config']} c{p['concurrency']}\n{format_summary(p['summary'])}")


if __name__ == "__main__":
    main()
