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
from sweep.configs import KNOWN_CONFIGS, REPO_ROOT
from sweep.records import finished, merge_record, pooled_records, swept_records
from sweep.server import visible_gpu_query
from sweep.tables import results_markdown
from sweep.targets import (
    TARGETS,
    best_by_c,
    load_aware_records,
    output_tok_s_by_c,
    static_references,
)


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
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT
    )
    if head.returncode != 0:
        return "unknown"
    dirty = (
        subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO_ROOT).returncode
        != 0
    )
    return head.stdout.strip() + ("-dirty" if dirty else "")


def record_saver(out_dir: str, header: Dict[str, str]) -> Callable[[dict], None]:
    """save(record) for the runs of a config: merged into raw.json, the results
    rewritten from the merged records."""

    def save(record: dict) -> None:
        merge_record(
            out_dir, record, header, then=lambda merged: write_results(out_dir, merged)
        )

    return save


# The ratio to max(no speculation, always on) that a load-aware config must keep.
ENVELOPE_TARGET = TARGETS[0][1]
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


def envelopes(records: List[dict]) -> Dict[str, Dict[int, float]]:
    """By always-on config of the load-aware records: the best of no speculation
    and it at each C (where both were measured)."""
    by_name = {r["config"]: r for r in records}
    return {
        KNOWN_CONFIGS[r["config"]].always_on: best_by_c(statics)
        for r in load_aware_records(records)
        if (statics := static_references(r, by_name))
    }


def plot(records: List[dict], path: str, title: str) -> None:
    """Output tok/s against concurrency; with load-aware records, the envelope
    max(no speculation, always on) and, below, each one's ratio to it."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no plot; render it elsewhere with --render")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_always_on = envelopes(records)
    fig, axes = plt.subplots(
        2 if by_always_on else 1,
        sharex=True,
        squeeze=False,
        figsize=(8, 7 if by_always_on else 5),
        gridspec_kw={"height_ratios": [2, 1]} if by_always_on else None,
    )
    ax = axes[0][0]
    colors = {}
    for record in records:
        by_c = sorted(output_tok_s_by_c(record).items())
        (line,) = ax.plot(*zip(*by_c), marker="o", label=record["config"])
        colors[record["config"]] = line.get_color()
    for always_on, envelope in by_always_on.items():
        ax.plot(
            *zip(*sorted(envelope.items())),
            color="black",
            alpha=0.2,
            linewidth=8,
            zorder=0,
            label=f"max(nospec, {always_on})",
        )
    ax.set_ylabel("output tok/s")
    ax.set_title(title)
    if by_always_on:
        ratio_ax = axes[1][0]
        for record in load_aware_records(records):
            envelope = by_always_on.get(KNOWN_CONFIGS[record["config"]].always_on)
            if envelope is None:
                continue
            mine = output_tok_s_by_c(record)
            ratios = sorted((c, mine[c] / envelope[c]) for c in envelope if c in mine)
            ratio_ax.plot(
                *zip(*ratios),
                marker="o",
                color=colors[record["config"]],
                label=record["config"],
            )
        ratio_ax.axhline(ENVELOPE_TARGET, color="black", linestyle="--", linewidth=1)
        ratio_ax.set_ylabel("x envelope")
        ratio_ax.legend(fontsize="small")
    for ax in axes[:, 0]:
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend()
    axes[-1][0].set_xlabel("concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
