"""The results directory of a model: where it is, the header of its records, and its
files (raw.json merged, then summary.json, results.md and throughput.png rewritten)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Callable, Dict, List

from sglang.test.spec_engine_utils import acceptance_label
from sweep.records import finished, merge_record, pooled_records, swept_records
from sweep.server import visible_gpu_query
from sweep.tables import results_markdown


def model_name(args: argparse.Namespace) -> str:
    tp = f"-tp{args.tp_size}" if args.tp_size > 1 else ""
    return f"{args.preset}-p{acceptance_label(args.draft_accept)}{tp}"


def results_dir(args: argparse.Namespace) -> str:
    return os.path.join(args.out_dir, f"{args.results_date}-{model_name(args)}")


def describe_run(model: str) -> Dict[str, str]:
    gpus = visible_gpu_query("name")
    return {
        "model": model,
        "gpu": f"{len(gpus)} x {gpus[0]}" if len(set(gpus)) == 1 else ", ".join(gpus),
        "commit": git_commit(),
        "command": " ".join([sys.executable] + sys.argv),
    }


def git_commit() -> str:
    """HEAD, marked "-dirty" when tracked files differ from it: the code that ran is not HEAD's."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"]).returncode != 0
    return head.stdout.strip() + ("-dirty" if dirty else "")


def record_saver(out_dir: str, header: Dict[str, str]) -> Callable[[dict], None]:
    """save(record) for run_config: merged into raw.json, the results rewritten."""

    def save(record: dict) -> None:
        write_results(out_dir, merge_record(out_dir, record, header))

    return save


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


def write_results(out_dir: str, records: List[dict]) -> None:
    """summary.json, results.md and throughput.png of the records of one model
    (those of one config's servers pooled)."""
    records = pooled_records(records)
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


def summary_point(point: dict) -> dict:
    summary = {k: point[k] for k in SUMMARY_POINT_KEYS}
    if "bench_serving" in point:
        summary["bench_serving_output_tok_s"] = point["bench_serving"]["output_tok_s"]
    return summary


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
