"""Where the time of the profiled decode steps went, from a torch profiler Chrome trace.

Reports the GPU busy share over the profiled window, the time per step, GPU time per CUDA
graph (grouped by graph size, so the target's and the draft's graphs show apart), kernels
launched outside graphs, the CPU's blocking waits on the GPU, and the longest GPU idle gaps
with what the CPU was doing meanwhile.

Usage:
  python benchmark/dynamic_spec/trace_summary.py TRACE.json.gz [--steps N]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from typing import Any, Dict, Iterable, List, Tuple

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
CPU_CONTEXT_CATEGORIES = {"python_function", "user_annotation"}
Interval = Tuple[float, float]  # (start, end), microseconds


def load_events(path: str) -> List[Dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def merge_intervals(intervals: Iterable[Interval]) -> List[Interval]:
    merged: List[List[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def idle_gaps(busy: List[Interval]) -> List[Interval]:
    """The gaps between merged busy intervals, longest first."""
    gaps = [(a_end, b_start) for (_, a_end), (b_start, _) in zip(busy, busy[1:])]
    return sorted(gaps, key=lambda gap: gap[0] - gap[1])


def graph_launch_groups(
    events: List[Dict[str, Any]], gpu: List[Dict[str, Any]]
) -> Tuple[List[Dict[str, Any]], float, int]:
    """GPU time of each cudaGraphLaunch (its kernels share the launch's correlation id),
    grouped by the number of kernels in the graph; plus the GPU time and number of the
    kernels launched outside graphs."""
    graph_correlations = {
        e["args"]["correlation"]
        for e in events
        if e.get("cat") == "cuda_runtime" and e["name"] == "cudaGraphLaunch"
    }
    per_launch: Dict[int, List[float]] = collections.defaultdict(list)
    eager_us, eager_count = 0.0, 0
    for e in gpu:
        correlation = e.get("args", {}).get("correlation")
        if correlation in graph_correlations:
            per_launch[correlation].append(e["dur"])
        else:
            eager_us, eager_count = eager_us + e["dur"], eager_count + 1
    groups: Dict[int, List[float]] = collections.defaultdict(list)
    for durations in per_launch.values():
        groups[len(durations)].append(sum(durations))
    summary = [
        {
            "kernels_per_graph": size,
            "launches": len(times),
            "gpu_ms_per_launch": sum(times) / len(times) / 1000,
        }
        for size, times in sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    ]
    return summary, eager_us / 1000, eager_count


def cpu_context(events: List[Dict[str, Any]], at: float, limit: int = 4) -> List[str]:
    """The innermost Python functions / annotations running on the CPU at time ``at``."""
    covering = [
        e
        for e in events
        if e.get("cat") in CPU_CONTEXT_CATEGORIES
        and e["ts"] <= at <= e["ts"] + e["dur"]
    ]
    covering.sort(key=lambda e: e["dur"])
    return [e["name"] for e in covering[:limit]]


def summarize_trace(
    events: List[Dict[str, Any]], steps: int, top: int = 8
) -> Dict[str, Any]:
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        raise ValueError("no GPU activity in the trace (profiled without GPU?)")
    busy = merge_intervals((e["ts"], e["ts"] + e["dur"]) for e in gpu)
    window_us = busy[-1][1] - busy[0][0]
    busy_us = sum(end - start for start, end in busy)

    kernel_time: Dict[str, List[float]] = collections.defaultdict(list)
    for e in gpu:
        kernel_time[e["name"]].append(e["dur"])
    top_kernels = sorted(kernel_time.items(), key=lambda kv: -sum(kv[1]))[:top]

    waits: Dict[str, List[float]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "cuda_runtime" and "Synchronize" in e["name"]:
            waits[e["name"]].append(e["dur"])

    graphs, eager_ms, eager_count = graph_launch_groups(events, gpu)
    return {
        "window_ms": window_us / 1000,
        "gpu_busy_ms": busy_us / 1000,
        "gpu_busy_share": busy_us / window_us if window_us else 1.0,
        "steps": steps,
        "ms_per_step": window_us / 1000 / steps,
        "graphs": graphs,
        "eager_kernels": {"count": eager_count, "gpu_ms": eager_ms},
        "top_kernels": [
            {"name": name[:90], "count": len(d), "gpu_ms": sum(d) / 1000}
            for name, d in top_kernels
        ],
        "cpu_waits": [
            {"name": name, "count": len(d), "ms": sum(d) / 1000}
            for name, d in sorted(waits.items(), key=lambda kv: -sum(kv[1]))
        ],
        "longest_gpu_gaps": [
            {
                "ms": (end - start) / 1000,
                "at_ms": (start - busy[0][0]) / 1000,
                "cpu": cpu_context(events, (start + end) / 2),
            }
            for start, end in idle_gaps(busy)[:top]
        ],
    }


def format_summary(summary: Dict[str, Any]) -> str:
    lines = [
        f"window {summary['window_ms']:.2f} ms over {summary['steps']} steps "
        f"({summary['ms_per_step']:.3f} ms/step), GPU busy {summary['gpu_busy_ms']:.2f} ms "
        f"({summary['gpu_busy_share']:.1%})",
        "graphs (kernels per graph: launches x GPU ms):",
    ]
    lines += [
        f"  {g['kernels_per_graph']}: {g['launches']} x {g['gpu_ms_per_launch']:.3f}"
        for g in summary["graphs"]
    ]
    eager = summary["eager_kernels"]
    lines.append(f"kernels outside graphs: {eager['count']}, {eager['gpu_ms']:.2f} ms")
    lines.append("top kernels (count, GPU ms):")
    lines += [
        f"  {k['count']:5d} {k['gpu_ms']:8.2f}  {k['name']}"
        for k in summary["top_kernels"]
    ]
    lines.append("CPU waits on the GPU (count, ms):")
    lines += [
        f"  {w['count']:5d} {w['ms']:8.2f}  {w['name']}" for w in summary["cpu_waits"]
    ]
    lines.append("longest GPU idle gaps (ms at ms: CPU meanwhile):")
    lines += [
        f"  {g['ms']:.3f} at {g['at_ms']:.1f}: {' < '.join(g['cpu'])}"
        for g in summary["longest_gpu_gaps"]
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace")
    parser.add_argument("--steps", type=int, default=1, help="decode steps profiled")
    args = parser.parse_args()
    print(format_summary(summarize_trace(load_events(args.trace), args.steps)))


if __name__ == "__main__":
    main()
