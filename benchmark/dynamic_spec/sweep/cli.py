"""bench_sweep.py's command line: its flags, the configs they select, and main."""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import functools
import json
import multiprocessing
import os
import sys
import traceback
from typing import List, Optional, Tuple, Union

from sglang.test.spec_engine_utils import (
    SPECULATIVE_ALGORITHMS,
    synthetic_pair,
    synthetic_pair_dir,
    synthetic_pair_is_current,
)
from sglang.test.synthetic_spec_models import parse_draft_accept
from sweep.bench_serving import BENCH_SERVING_MODULE
from sweep.configs import Config, build_configs, pristine_upstream
from sweep.records import (
    finished,
    incomparable_records,
    records_by_config,
    results_lock,
)
from sweep.results import (
    describe_run,
    model_name,
    record_saver,
    results_dir,
    write_results,
)
from sweep.runs import run_config, run_decode_rate, run_name, server_log_path
from sweep.server import config_server_args, last_error_line
from sweep.targets import suggested_threshold
from sweep.workloads import sweep_workload

# --disable-threshold-for CONFIG=suggested: the threshold the static configs' records suggest.
SUGGESTED = "suggested"
# benchmark/dynamic_spec/, whose results/ is the default --out-dir.
BENCHMARK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
        "--draft-arch",
        choices=list(SPECULATIVE_ALGORITHMS),
        default="eagle3",
        help="the pair's draft: EAGLE-3, or an EAGLE draft (--speculative-algorithm "
        "EAGLE) that proposes what the target decodes (needs --draft-accept 1)",
    )
    parser.add_argument(
        "--configs",
        default=(
            "nospec,eagle3-topk1,eagle3-topk4,loadaware-topk1,loadaware-topk4,"
            "upstream-adaptive-topk1"
        ),
    )
    parser.add_argument(
        "--concurrency",
        type=positive_ints,
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
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the servers' --stream-interval (upstream's default: a streamed chunk per "
        "token of every request; a larger one lightens the server's front end, which "
        "at a few hundred running requests can fall behind the decode steps)",
    )
    parser.add_argument(
        "--no-step-trace",
        dest="step_trace",
        action="store_false",
        help="run the auto servers without their step trace "
        "(SGLANG_LOAD_AWARE_STEP_TRACE, which policy_sim.py replays): it writes three "
        "lines per decode step on the server's critical path",
    )
    parser.add_argument("--url", default="http://127.0.0.1:31000")
    parser.add_argument(
        "--out-dir",
        default=os.path.join(BENCHMARK_DIR, "results"),
    )
    parser.add_argument(
        "--results-date",
        default=datetime.date.today().isoformat(),
        help="the date in the results directory's name (default today; an earlier "
        "run's date adds configs to its results)",
    )


def selected_configs(args: argparse.Namespace) -> List[Config]:
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


def with_suggested_threshold(args: argparse.Namespace, config: Config) -> Config:
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
    preset: str,
    draft_accept: Union[float, Tuple[float, ...]],
    draft_arch: str = "eagle3",
) -> Tuple[str, str]:
    """synthetic_pair, generated in a child process where missing: generating on the
    GPU leaves a CUDA context in the process that did it, which the servers
    started next would then lose from their KV pool."""
    pair = functools.partial(
        synthetic_pair, preset, draft_accept, draft_arch=draft_arch
    )
    pair_dir = synthetic_pair_dir(preset, draft_accept, draft_arch=draft_arch)
    if synthetic_pair_is_current(pair_dir):
        return pair()
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as child:
        return child.submit(pair).result()


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"needs 1 or more, got {text}")
    return value


def positive_ints(text: str) -> List[int]:
    """A comma-separated list of positive integers: concurrencies, batch sizes."""
    return [positive_int(x) for x in text.split(",")]


def positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"needs more than 0, got {text}")
    return value


def spread_fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"needs 0 <= S < 1, got {text}")
    return value


def parse_args(description: Optional[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_server_args(parser)
    parser.add_argument("--requests-per-concurrency", type=int, default=4)
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument(
        "--min-point-seconds",
        type=positive_float,
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
        "--output-len-spread",
        type=spread_fraction,
        default=0.0,
        metavar="S",
        help="--steady: draw each request's output length uniformly from --output-len "
        "x [1 - S, 1 + S] (0 <= S < 1), so that requests a stall lined up do not stay "
        "in step (with one length they finish, and prefill, together every request "
        "lifetime after it)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="measurements per point and of the ramp (median, spread)",
    )
    parser.add_argument(
        "--bench-serving",
        nargs="?",
        const=[],
        type=positive_ints,
        metavar="C,...",
        help="after each point (only those at the C listed, if any), also run "
        "upstream's bench_serving at its C against "
        f"the same server (python -m {BENCH_SERVING_MODULE}: random-ids prompts of "
        "--input-len token ids, --output-len tokens (with --output-len-spread, both "
        "spread by S), as many prompts as one of the point's closed loops or as the "
        "point's rate finishes in --min-point-seconds, whichever is more, --repeats "
        "times) and record its output tok/s beside ours; with --content-shift, also "
        "run it on that shift (each phase as long as ours at its rate)",
    )
    parser.add_argument(
        "--decode-rate",
        type=positive_ints,
        metavar="B1,B2,...",
        help="instead of the sweep and the ramp: the decode rate at each steady "
        "running batch B (B requests of --decode-output-len tokens at once; output "
        "tok/s from the moment all B stream to the first finish), --repeats times",
    )
    parser.add_argument("--decode-output-len", type=int, default=1024)
    parser.add_argument(
        "--ramp",
        type=positive_ints,
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
        "--servers",
        type=positive_int,
        default=1,
        metavar="N",
        help="measure each config in N fresh servers, the configs taking turns "
        "(server 1 of every config, then server 2, ...): its points and ramp are "
        "then the median over the servers, with their min and max as the spread "
        "(repeats within one server vary less than servers do)",
    )
    parser.add_argument(
        "--render",
        metavar="RESULTS_DIR",
        help="only rewrite summary.json, results.md and the plot from RESULTS_DIR/raw.json",
    )
    args = parser.parse_args()
    if args.output_len_spread and not args.steady:
        parser.error("--output-len-spread: only with --steady")
    return args


def refuse_incomparable_records(
    out_dir: str, server_args: List[str], workload: Optional[dict]
) -> None:
    others = incomparable_records(out_dir, server_args, workload)
    if others:
        sys.exit(
            f"{out_dir} holds records ({', '.join(others)}) of another front end "
            "(--skip-tokenizer-init, --stream-interval) or workload (--input-len, "
            "--output-len, --steady, --output-len-spread), which would not compare "
            "with this run's; use another --out-dir or --results-date"
        )


def main(description: Optional[str] = None) -> None:
    """description: of --help (bench_sweep.py's docstring)."""
    args = parse_args(description)
    if args.render:
        with open(os.path.join(args.render, "raw.json")) as f:
            write_results(args.render, json.load(f)["records"])
        return
    configs = selected_configs(args)
    if args.servers > 1 and args.decode_rate:
        sys.exit("--servers: not with --decode-rate")
    if args.content_shift and not isinstance(args.draft_accept, tuple):
        sys.exit(
            "--content-shift needs a content-shift pair: --draft-accept P_easy,P_hard"
        )
    target, draft = generated_pair(args.preset, args.draft_accept, args.draft_arch)
    header = describe_run(model_name(args))
    out_dir = results_dir(args)
    refuse_incomparable_records(
        out_dir,
        config_server_args(args, configs[0], draft),
        None if args.decode_rate else sweep_workload(args),
    )
    save = record_saver(out_dir, header)
    log_dir = os.path.join(out_dir, "logs")
    failed = []
    for server in range(args.servers):
        for config in configs:
            try:
                config = with_suggested_threshold(args, config)
                if args.decode_rate:
                    run_decode_rate(args, config, target, draft, log_dir, save)
                else:
                    run_config(args, config, target, draft, log_dir, save, server)
            except Exception:
                # A server that does not start or dies (out of GPU memory) costs its
                # config only: the next config gets a fresh server.
                name = run_name(config, server, bool(args.decode_rate))
                report_failure(name, server_log_path(log_dir, name))
                failed.append(name)
                continue
            print(f"{config.name}: results in {out_dir}", flush=True)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}; the others' results are in {out_dir}")


def report_failure(name: str, log_path: str) -> None:
    """Print the exception being handled, and the server log's last error line."""
    traceback.print_exc()
    error = last_error_line(log_path) if os.path.exists(log_path) else None
    print(
        f"{name}: failed: {error or 'see the traceback above'} (server log: {log_path})",
        file=sys.stderr,
        flush=True,
    )
