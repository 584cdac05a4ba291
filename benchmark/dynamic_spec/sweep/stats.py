"""Statistics of a measured point: its runs' throughput, latencies and acceptance."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Dict, Iterable, List

from sweep.client import RequestResult


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return (
        ordered[min(len(ordered) - 1, int(q * len(ordered)))]
        if ordered
        else float("nan")
    )


@dataclasses.dataclass
class Run:
    """One measurement of a point: the requests whose latencies it reports, and the
    output tokens it counted over its wall-clock seconds."""

    results: List[RequestResult]
    tokens: float
    wall: float
    client_cpu: float  # the benchmark's CPU seconds meanwhile


def median_with_spread(rates: Iterable[float]) -> Dict[str, float]:
    """The median of repeated output tok/s measurements, with their min and max."""
    ordered = sorted(rates)
    return {
        "output_tok_s": statistics.median(ordered),
        "output_tok_s_min": ordered[0],
        "output_tok_s_max": ordered[-1],
    }


def summarize(runs: List[Run]) -> Dict[str, Any]:
    """Statistics of one point measured len(runs) times. Throughput is the median run
    (with the min and max); latencies and acceptance pool all requests."""
    results = [r for run in runs for r in run.results]
    tpots = [
        (r.latency - r.ttft) / (r.output_tokens - 1)
        for r in results
        if r.output_tokens > 1
    ]
    verify = sum(r.verify_ct for r in results)
    return {
        "num_requests": len(results),
        **median_with_spread(run.tokens / run.wall for run in runs),
        "tpot_p50_ms": 1000 * percentile(tpots, 0.5),
        "tpot_p99_ms": 1000 * percentile(tpots, 0.99),
        "ttft_p50_ms": 1000 * percentile([r.ttft for r in results], 0.5),
        "accept_length": (
            (verify + sum(r.correct_drafts for r in results)) / verify
            if verify
            else None
        ),
    }
