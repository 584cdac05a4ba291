"""A config's run in a fresh server: the sweep (points, ramp, content shift) or the
decode rates, its record saved after every measurement."""

from __future__ import annotations

import argparse
import os
from typing import Callable, List

from sweep.bench_serving import (
    bench_serving_at,
    bench_serving_enabled,
    run_bench_serving,
    run_content_shift_bench_serving,
)
from sweep.client import PromptSource
from sweep.configs import Config
from sweep.server import decode_throughput, decode_windows, server_state, serving
from sweep.workloads import (
    measure_decode_rate,
    measure_point,
    run_content_shift,
    run_ramp,
    sweep_workload,
)
from tqdm import tqdm


def server_log_path(log_dir: str, name: str) -> str:
    os.makedirs(log_dir, exist_ok=True)
    return os.path.join(log_dir, f"{name}.log")


def run_name(config: Config, server: int = 0, decode_rate: bool = False) -> str:
    """The name of a config's run (its server's log): its decode rates, or its sweep
    in the server-th fresh server of --servers."""
    if decode_rate:
        return f"{config.name}-decode-rate"
    return f"{config.name}-server{server}" if server else config.name


def logged_decode_windows(log_path: str, config: Config) -> List[dict]:
    """The steady decode windows the config's server logged so far (decode_windows)."""
    with open(log_path, errors="replace") as log:
        return decode_windows(log, config.spec is not None)


def run_config(
    args: argparse.Namespace,
    config: Config,
    target: str,
    draft: str,
    log_dir: str,
    save: Callable[[dict], None],
    server: int = 0,
) -> None:
    """Measure a config in a fresh server (the server-th of --servers); save() gets
    its record after every point (before its bench_serving runs, and again after),
    after the ramp and after the content shift, so a run cut off keeps the points
    it finished."""
    prompts = PromptSource(args.input_len, seed=server)
    server_name = run_name(config, server)
    log_path = server_log_path(log_dir, server_name)

    def save_with_decode_throughput(record: dict) -> None:
        record["decode_tok_s"] = decode_throughput(
            logged_decode_windows(log_path, config)
        )
        save(record)

    warmup_concurrencies = [*args.concurrency, *args.ramp]
    with serving(
        args, config, target, draft, prompts, warmup_concurrencies, log_path
    ) as launched:
        record = {
            "config": config.name,
            **launched.record,
            "workload": sweep_workload(args),
            "unique_prompts": True,
            "points": [],
        }
        if server:
            record["server"] = server
        state = server_state(args.url)
        record["kv_capacity_tokens"] = state["memory_usage"]["token_capacity"]
        for concurrency in tqdm(args.concurrency, desc=config.name):
            point = measure_point(
                args, config, prompts, concurrency, launched.front_end_pid
            )
            record["points"].append(point)
            save_with_decode_throughput(record)
            if bench_serving_at(args, concurrency):
                point["bench_serving"] = run_bench_serving(
                    args, server_name, target, point, log_dir
                )
                save_with_decode_throughput(record)
        record["ramp"] = run_ramp(args, config, prompts)
        save_with_decode_throughput(record)
        if args.content_shift:
            record["content_shift"] = run_content_shift(args, config, target)
            save_with_decode_throughput(record)
            if bench_serving_enabled(args):
                shift = record["content_shift"]
                shift["bench_serving"] = run_content_shift_bench_serving(
                    args, server_name, target, log_dir, shift
                )
                save_with_decode_throughput(record)


def run_decode_rate(
    args: argparse.Namespace,
    config: Config,
    target: str,
    draft: str,
    log_dir: str,
    save: Callable[[dict], None],
) -> None:
    """--decode-rate: a config's decode rate at each steady running batch, in a fresh
    server; save() gets the record's decode_rate section after every batch size."""
    prompts = PromptSource(args.input_len)
    log_path = server_log_path(log_dir, run_name(config, decode_rate=True))
    with serving(
        args, config, target, draft, prompts, args.decode_rate, log_path
    ) as launched:
        capacity = server_state(args.url)["memory_usage"]["token_capacity"]
        section = {
            **launched.record,
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
            section["points"].append(
                measure_decode_rate(
                    args, config, prompts, batch, launched.front_end_pid
                )
            )
            windows = logged_decode_windows(log_path, config)
            section["decode_tok_s"] = decode_throughput(windows)
            section["decode_windows"] = windows
            save({"config": config.name, "decode_rate": section})
