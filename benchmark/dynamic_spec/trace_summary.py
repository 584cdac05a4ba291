"""Where the time of the profiled decode steps went, from a torch profiler Chrome trace.

Reports the GPU busy share over the profiled window, the time per step, GPU time per CUDA
graph (grouped by graph size, so the target's and the draft's graphs show apart), kernels
launched outside graphs and the CPU's blocking waits on the GPU (each with the sglang
function that issued it), the GPU's idle time by the sglang function that the launching
thread ran meanwhile, and the longest GPU idle gaps with what the CPU was doing
meanwhile.

Usage:
  python benchmark/dynamic_spec/trace_summary.py TRACE.json.gz [--steps N]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import time
from typing import Any, Dict, Iterable, List, Tuple

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
CPU_CONTEXT_CATEGORIES = {"python_function", "user_annotation"}
# Where an eager kernel or a CPU wait is attributed: the innermost frame of this code.
SITE_PATTERN = "sglang/"
Interval = Tuple[float, float]  # (start, end), microseconds


def load_events(path: str) -> List[Dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def load_written_events(
    path: str, timeout: float = 120, poll: float = 2
) -> List[Dict[str, Any]]:
    """load_events of a trace the profiler may still be writing: the file appears
    before its last bytes do, so a truncated read is retried until timeout."""
    deadline = time.time() + timeout
    while True:
        try:
            return load_events(path)
        except (EOFError, json.JSONDecodeError):
            if time.time() >= deadline:
                raise
            time.sleep(poll)


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
) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """GPU time of each cudaGraphLaunch (its kernels share the launch's correlation id),
    grouped by the number of kernels in the graph; plus the GPU events outside graphs.
    """
    graph_correlations = {
        e["args"]["correlation"]
        for e in events
        if e.get("cat") == "cuda_runtime" and e["name"] == "cudaGraphLaunch"
    }
    per_launch: Dict[int, List[float]] = collections.defaultdict(list)
    eager = []
    for e in gpu:
        correlation = e.get("args", {}).get("correlation")
        if correlation in graph_correlations:
            per_launch[correlation].append(e["dur"])
        else:
            eager.append(e)
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
    return summary, eager


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


def innermost_frames(
    events: List[Dict[str, Any]], queries: List[Tuple[Any, float]]
) -> List[str]:
    """For each (thread id, time): the innermost Python frame of SITE_PATTERN running
    on that thread at that time ("-" when none). One sweep per thread over its
    (properly nested) Python frames."""
    frames_by_tid: Dict[Any, List[Dict[str, Any]]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function" and SITE_PATTERN in e["name"]:
            frames_by_tid[e.get("tid")].append(e)
    for frames in frames_by_tid.values():
        frames.sort(key=lambda e: (e["ts"], -e["dur"]))  # outer frame first

    def ended_before(frame: Dict[str, Any], t: float) -> bool:
        return frame["ts"] + frame["dur"] < t

    next_frame: Dict[Any, int] = collections.defaultdict(int)
    stacks: Dict[Any, List[Dict[str, Any]]] = collections.defaultdict(list)
    sites = ["-"] * len(queries)
    for i in sorted(range(len(queries)), key=lambda i: queries[i][1]):
        tid, t = queries[i]
        frames, stack = frames_by_tid.get(tid, []), stacks[tid]
        while next_frame[tid] < len(frames) and frames[next_frame[tid]]["ts"] <= t:
            frame = frames[next_frame[tid]]
            while stack and ended_before(stack[-1], frame["ts"]):
                stack.pop()
            stack.append(frame)
            next_frame[tid] += 1
        while stack and ended_before(stack[-1], t):
            stack.pop()
        if stack:
            sites[i] = stack[-1]["name"]
    return sites


def sites_of(
    events: List[Dict[str, Any]],
    issued: List[Tuple[Dict[str, Any], float]],
    top: int,
    by_cost: bool = False,
) -> List[Dict[str, Any]]:
    """issued: (CPU event, its cost); count and cost per issuing frame, the most
    frequent (by_cost: the costliest) first."""
    sites = innermost_frames(events, [(e.get("tid"), e["ts"]) for e, _ in issued])
    per_site: Dict[str, List[float]] = collections.defaultdict(list)
    for site, (_, cost) in zip(sites, issued):
        per_site[site].append(cost)

    def rank(kv: Tuple[str, List[float]]) -> Tuple[float, str]:
        return (-sum(kv[1]) if by_cost else -len(kv[1]), kv[0])

    ranked = sorted(per_site.items(), key=rank)[:top]
    return [{"site": s, "count": len(c), "ms": sum(c) / 1000} for s, c in ranked]


def gpu_idle_sites(
    events: List[Dict[str, Any]],
    runtime: List[Dict[str, Any]],
    gaps: List[Interval],
    top: int,
) -> List[Dict[str, Any]]:
    """All GPU idle time, per innermost sglang frame that the launching thread (the
    one issuing most CUDA runtime calls) ran at each gap's midpoint: where the host,
    not the GPU, set the pace."""
    if not runtime:
        return []
    launcher = collections.Counter(e.get("tid") for e in runtime).most_common(1)[0][0]
    midpoints = [
        ({"tid": launcher, "ts": (start + end) / 2}, end - start) for start, end in gaps
    ]
    return sites_of(events, midpoints, top, by_cost=True)


def summarize_trace(
    events: List[Dict[str, Any]], steps: int, top: int = 8
) -> Dict[str, Any]:
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        raise ValueError("no GPU activity in the trace (profiled without GPU?)")
    busy = merge_intervals((e["ts"], e["ts"] + e["dur"]) for e in gpu)
    window_us = busy[-1][1] - busy[0][0]
    busy_us = sum(end - start for start, end in busy)
    gaps = idle_gaps(busy)

    kernel_time: Dict[str, List[float]] = collections.defaultdict(list)
    for e in gpu:
        kernel_time[e["name"]].append(e["dur"])
    top_kernels = sorted(kernel_time.items(), key=lambda kv: -sum(kv[1]))[:top]

    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    syncs = [e for e in runtime if "Synchronize" in e["name"]]
    waits: Dict[str, List[float]] = collections.defaultdict(list)
    for e in syncs:
        waits[e["name"]].append(e["dur"])

    graphs, eager = graph_launch_groups(events, gpu)
    launch_of = {
        e["args"]["correlation"]: e
        for e in runtime
        if "correlation" in e.get("args", {})
    }
    eager_launched = [
        (launch_of[correlation], e["dur"])
        for e in eager
        if (correlation := e.get("args", {}).get("correlation")) in launch_of
    ]
    return {
        "window_ms": window_us / 1000,
        "gpu_busy_ms": busy_us / 1000,
        "gpu_busy_share": busy_us / window_us if window_us else 1.0,
        "steps": steps,
        "ms_per_step": window_us / 1000 / steps,
        "graphs": graphs,
        "eager_kernels": {
            "count": len(eager),
            "gpu_ms": sum(e["dur"] for e in eager) / 1000,
        },
        "eager_kernel_sites": sites_of(events, eager_launched, top),
        "top_kernels": [
            {"name": name[:90], "count": len(d), "gpu_ms": sum(d) / 1000}
            for name, d in top_kernels
        ],
        "cpu_waits": [
            {"name": name, "count": len(d), "ms": sum(d) / 1000}
            for name, d in sorted(waits.items(), key=lambda kv: -sum(kv[1]))
        ],
        "cpu_wait_sites": sites_of(events, [(e, e["dur"]) for e in syncs], top),
        "gpu_idle_sites": gpu_idle_sites(events, runtime, gaps, top),
        "longest_gpu_gaps": [
            {
                "ms": (end - start) / 1000,
                "at_ms": (start - busy[0][0]) / 1000,
                "cpu": cpu_context(events, (start + end) / 2),
            }
            for start, end in gaps[:top]
        ],
    }


def format_sites(sites: List[Dict[str, Any]], header: str) -> List[str]:
    return [header] + [
        f"    {s['count']:5d} {s['ms']:8.2f}  {s['site']}" for s in sites
    ]


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
    lines += format_sites(summary["eager_kernel_sites"], "  issued by (count, GPU ms):")
    lines.append("top kernels (count, GPU ms):")
    lines += [
        f"  {k['count']:5d} {k['gpu_ms']:8.2f}  {k['name']}"
        for k in summary["top_kernels"]
    ]
    lines.append("CPU waits on the GPU (count, ms):")
    lines += [
        f"  {w['count']:5d} {w['ms']:8.2f}  {w['name']}" for w in summary["cpu_waits"]
    ]
    lines += format_sites(summary["cpu_wait_sites"], "  issued by (count, ms):")
    lines += format_sites(
        summary["gpu_idle_sites"],
        "GPU idle, by what the launching thread ran (gaps, ms):",
    )
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
    if args.steps < 1:
        parser.error("--steps needs 1 or more")
    print(format_summary(summarize_trace(load_events(args.trace), args.steps)))


if __name__ == "__main__":
    main()
