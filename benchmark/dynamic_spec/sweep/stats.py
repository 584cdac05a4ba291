"""Statistics of a measured point: its runs' throughput, latencies and acceptance."""

from __future__ import annotations

import bisect
import dataclasses
import statistics
from typing import Any, Dict, Iterable, List, Optional, Tuple

from sweep.client import RequestResult

# quiet_share: a bin of a steady window is quiet below this share of the mean rate.
QUIET_BIN_SECONDS = 0.25
QUIET_RATE_FRACTION = 0.25


def percentile(values: List[float], q: float) -> float:
    """The q-quantile, interpolated between the nearest ranks as numpy.percentile
    (and so bench_serving) computes it; nan without values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = q * (len(ordered) - 1)
    lower = int(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (position - lower) * (ordered[upper] - ordered[lower])


def mean(values: List[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


@dataclasses.dataclass
class Run:
    """One measurement of a point: the requests whose latencies it reports, and the
    output tokens it counted over its wall-clock seconds."""

    results: List[RequestResult]
    tokens: float
    wall: float
    client_cpu: float  # the benchmark's CPU seconds meanwhile
    # Steady loops: the mean requests in flight, the client's worst event-loop lag and
    # the share of the window that streamed almost nothing (quiet_share).
    in_flight: Optional[float] = None
    loop_lag_max: Optional[float] = None
    quiet_share: Optional[float] = None
    # Decode-rate windows: the server front end's CPU seconds in the window, and the
    # output tok/s in each of its tenths.
    front_end_cpu: Optional[float] = None
    tenths_tok_s: Optional[List[float]] = None


def quiet_share(
    timelines: Iterable[List[Tuple[float, int]]], start: float, end: float
) -> float:
    """The share of [start, end), in bins of QUIET_BIN_SECONDS, whose streamed
    tokens fell under QUIET_RATE_FRACTION of the window's mean: the time the server
    streamed (almost) nothing. A closed loop whose requests started together (a stall
    lined them up) spends the prefill of each such wave there, and with one output
    length the waves come back every request lifetime."""
    num_bins = max(1, round((end - start) / QUIET_BIN_SECONDS))
    width = (end - start) / num_bins
    streamed = [0] * num_bins
    for timeline in timelines:
        before = 0
        for at, tokens in timeline:
            if start <= at < end:
                bin_index = min(int((at - start) / width), num_bins - 1)
                streamed[bin_index] += tokens - before
            before = tokens
    if not any(streamed):
        return 1.0
    quiet = QUIET_RATE_FRACTION * sum(streamed) / num_bins
    return sum(tokens < quiet for tokens in streamed) / num_bins


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
    ttfts = [r.ttft for r in results]
    verify = sum(r.verify_ct for r in results)
    return {
        "num_requests": len(results),
        **median_with_spread(run.tokens / run.wall for run in runs),
        "tpot_p50_ms": 1000 * percentile(tpots, 0.5),
        "tpot_p99_ms": 1000 * percentile(tpots, 0.99),
        "ttft_p50_ms": 1000 * percentile(ttfts, 0.5),
        "ttft_p99_ms": 1000 * percentile(ttfts, 0.99),
        # A closed loop's throughput is its concurrency over the mean latency: these
        # tell whether a config lost time before the first token or after it.
        "ttft_mean_ms": 1000 * mean(ttfts),
        "latency_mean_ms": 1000 * mean([r.latency for r in results]),
        "accept_length": (
            (verify + sum(r.correct_drafts for r in results)) / verify
            if verify
            else None
        ),
        **client_pace(runs),
    }


def client_pace(runs: List[Run]) -> Dict[str, float]:
    """Whether the client kept its concurrency (steady loops): the requests in flight
    (mean over the runs) and the client's worst event-loop lag; and whether the
    tokens streamed at an even pace (the quiet share's mean over the runs)."""
    if any(run.in_flight is None for run in runs):
        return {}
    return {
        "requests_in_flight": mean([run.in_flight for run in runs]),
        "client_loop_lag_max_ms": 1000 * max(run.loop_lag_max for run in runs),
        "quiet_share": mean([run.quiet_share for run in runs]),
    }


def rate_at_same_kv_tokens(
    windows: List[dict], reference: List[dict], batch: int
) -> Optional[float]:
    """A config's plain decode rate over the reference's at the same running batch
    and the same KV tokens in use, from steady server log windows (decode_windows):
    the median, over the config's windows inside the reference's span, of the
    reference's step time interpolated at their KV tokens over theirs. Medians over
    whole runs compare windows at different sequence lengths (the two servers'
    windows start at different offsets), and a step's time grows with them."""
    ref = sorted(
        (w["tokens"], batch / w["tok_s"])
        for w in reference
        if (w["mode"], w["batch"]) == ("plain", batch)
    )
    ratios = []
    for w in windows:
        if (w["mode"], w["batch"]) != ("plain", batch):
            continue
        i = bisect.bisect_left(ref, (w["tokens"],))
        if not ref or i == len(ref) or (i == 0 and ref[0][0] != w["tokens"]):
            continue
        (t0, s0), (t1, s1) = ref[max(i - 1, 0)], ref[i]
        ref_step = s1 if t1 == t0 else s0 + (s1 - s0) * (w["tokens"] - t0) / (t1 - t0)
        ratios.append(ref_step / (batch / w["tok_s"]))
    return statistics.median(ratios) if ratios else None
