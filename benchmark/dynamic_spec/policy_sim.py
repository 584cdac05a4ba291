"""Replay a decode workload through load-aware policies offline; report output tokens/s.

The environment is what a GPU measured: the seconds of one decode step per mode (0:
plain, s: s draft steps) and captured batch size, and the acceptance over time. It comes
from a trace of a real run (``--trace``: the JSON lines an ``auto`` server writes with
``SGLANG_LOAD_AWARE_STEP_TRACE=PATH``, its timed decode steps ``{"batch_size",
"num_steps", "seconds"}``, its verifies ``{"num_steps", "num_tokens", "num_requests"}``
and its decisions ``{"decision", "reason", "batch_size", "t"}``), whose steps give the
cost table (median per mode and batch bucket), whose verifies the acceptance timeline
and whose decisions what a switch costs beyond the steps' usual time (charged to every
policy's switches) and the wall time (printed), or from a cost table and an acceptance
schedule given directly (``--costs``, ``--accept``). The workload is a sequence of
phases of a running batch size held for a time, as a closed loop at a concurrency
holds it (``--phases 1x2,32x4,...``: batch 1 for 2 s, then 32 for 4 s; or the trace's
own timeline): every policy runs each phase for the same time, so the tokens/s compare
like the phases of a benchmark's ramp.

Policies: ``nospec``, ``always`` (the largest step count), ``threshold:N`` (the fixed
thresholds, spec_policy.SpecPolicy) and ``auto`` (the server's
throughput_policy.ThroughputSpecPolicy on a single GPU, its step timer included: step
times and acceptance learned only from the steps it runs, a step timed only after
three launches of one mode in one batch bucket with no prefill between them; before a
step a prefill runs at the rate the trace's decisions show for its bucket, where the
running batch grew). ``auto:profiled`` is ``auto`` with every mode timed at every batch
bucket before its first step, at what the simulator charges there: the most a profile
of the step costs taken at startup could give it.

    python benchmark/dynamic_spec/policy_sim.py --trace run.jsonl \\
        --policies nospec,always,threshold:32,threshold:64,auto
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, Sequence, Set, Tuple

from sglang.srt.speculative.spec_policy import DEFAULT_MIN_DWELL_STEPS, SpecPolicy
from sglang.srt.speculative.throughput_policy import (
    PLAIN,
    StepCosts,
    ThroughputSpecPolicy,
    chain_accept_length,
    fit_chain_acceptance,
    power_of_two_buckets,
)


@dataclass
class Environment:
    """What each mode costs and yields: the cost table, and over time the per-token
    acceptance of a chain (speculative steps yield its accept length).

    acceptance: (from second, p) pairs in time order, the first from 0.
    prefill_rate: per power-of-two batch bucket, the share of decode steps a prefill
    runs before (none where absent).
    switch_seconds: what a switch between plain and speculative steps costs beyond
    the steps' own costs.
    step_times: per (mode, batch bucket), the times its steps were recorded at and
    their seconds, in time order (``step_seconds`` replays them).
    """

    costs: Dict[int, Dict[int, float]]
    acceptance: List[Tuple[float, float]]
    prefill_rate: Dict[int, float] = field(default_factory=dict)
    switch_seconds: float = 0.0
    step_times: Dict[Tuple[int, int], Tuple[List[float], List[float]]] = field(
        default_factory=dict
    )

    def charged_costs(self) -> StepCosts:
        """The cost table as the simulator charges a step: a batch costs what the
        smallest bucket of the table >= its size costs."""
        return StepCosts({m: dict(by_bs) for m, by_bs in self.costs.items()})

    @property
    def speculative_steps(self) -> List[int]:
        return sorted(m for m in self.costs if m != PLAIN)

    def accept_length(self, num_steps: int, at_seconds: float) -> float:
        if num_steps == PLAIN:
            return 1.0
        starts = [start for start, _ in self.acceptance]
        p = self.acceptance[max(0, bisect.bisect_right(starts, at_seconds) - 1)][1]
        return chain_accept_length(p, num_steps)

    def step_seconds(
        self, num_steps: int, bucket: int, at_seconds: float, first: bool = False
    ) -> float:
        """A step's seconds as recorded around this time: the median of the
        ``REPLAYED_NEIGHBOURS`` steps of this mode and bucket recorded nearest it
        (the cost table's time where none were). The ``first`` step of a mode at
        a bucket costs at least what the first one timed there took: first steps at
        a new batch size can stall."""
        if (num_steps, bucket) not in self.step_times:
            return self.costs[num_steps][bucket]
        times, seconds = self.step_times[(num_steps, bucket)]
        i = bisect.bisect_left(times, at_seconds)
        start = max(
            0, min(i - REPLAYED_NEIGHBOURS // 2, len(times) - REPLAYED_NEIGHBOURS)
        )
        around = statistics.median(seconds[start : start + REPLAYED_NEIGHBOURS])
        return max(around, seconds[0]) if first else around


# Enough recorded steps that one outlier does not set a step's time, few enough that
# a slow stretch of a dozen steps shows.
REPLAYED_NEIGHBOURS = 5


def parse_acceptance(text: str) -> List[Tuple[float, float]]:
    """``0.9`` (all along), or ``0.9x10,0.5x10``: p = 0.9 for 10 s, then 0.5."""
    timeline, start = [], 0.0
    for part in text.split(","):
        p, _, seconds = part.partition("x")
        timeline.append((start, float(p)))
        start += float(seconds or 0)
    return timeline


Phases = List[Tuple[int, float]]  # (running batch size, seconds)


def parse_phases(text: str) -> Phases:
    """``1x2,32x4`` -> batch 1 for 2 s, then batch 32 for 4 s."""
    phases = []
    for part in text.split(","):
        bs, _, seconds = part.partition("x")
        phases.append((int(bs), float(seconds)))
    return phases


def load_trace(path: str) -> List[dict]:
    """A step trace's records (JSON lines; gzip-compressed if the name ends in .gz,
    as committed traces are)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def bucket_of(batch_size: int) -> int:
    """The power-of-two batch bucket the server files a batch of this size under."""
    return power_of_two_buckets(batch_size)[-1]


def step_records(records: Sequence[dict]) -> List[dict]:
    """The trace's timed decode steps (its other records are verifies and
    decisions)."""
    return [r for r in records if "seconds" in r]


def decision_records(records: Sequence[dict]) -> List[dict]:
    """The trace's decisions, one per decode step."""
    return [r for r in records if "decision" in r]


def _decision_gaps(
    records: Sequence[dict], with_prefills: bool = True
) -> Tuple[Dict[Tuple[str, int, bool], List[float]], Dict[Tuple[str, int], float]]:
    """The wall seconds from each decode step's decision to the next one's, by
    (mode, batch bucket, right after a switch), and each (mode, bucket)'s usual
    step: the median of its steps not after a switch (steps of different sizes are
    not compared). Without prefills: leaving out the steps after which the running
    batch grew (a prefill ran before the next one)."""
    decisions = decision_records(records)
    steps: Dict[Tuple[str, int, bool], List[float]] = {}
    previous = None
    for this, following in zip(decisions, decisions[1:]):
        mode = "plain" if this["decision"] == PLAIN else "spec"
        switched = previous is not None and mode != previous
        previous = mode
        if not with_prefills and following["batch_size"] > this["batch_size"]:
            continue
        bucket = bucket_of(this["batch_size"])
        steps.setdefault((mode, bucket, switched), []).append(
            following["t"] - this["t"]
        )
    usual = {
        (mode, bucket): statistics.median(gaps)
        for (mode, bucket, switched), gaps in steps.items()
        if not switched
    }
    return steps, usual


def step_wall_times(records: Sequence[dict]) -> Dict[str, object]:
    """From the trace's decisions (``_decision_gaps``): the wall seconds of a decode
    step, median by mode for the first step after a switch and for the others; the
    share of the wall time that the steps right after a switch took beyond their
    mode's usual step; and the gaps between two steps of one mode longer than twice
    its usual step (a prefill ran between them, or the server idled): how many,
    their median excess and its share. Under the overlap scheduler a gap is an
    earlier step's time, so a mode's first steps after a switch show the other
    mode's step; ``switch_seconds`` measures what a switch costs."""
    steps, usual = _decision_gaps(records)
    if not steps:
        return {}
    decisions = decision_records(records)
    wall = decisions[-1]["t"] - decisions[0]["t"]
    excess = sum(
        sum(after) - len(after) * usual.get((mode, bucket), statistics.median(after))
        for (mode, bucket, switched), after in steps.items()
        if switched
    )
    gap_excess = [
        gap - usual[(mode, bucket)]
        for (mode, bucket, switched), gaps in steps.items()
        if not switched
        for gap in gaps
        if gap > 2 * usual[(mode, bucket)]
    ]
    pooled: Dict[Tuple[str, bool], List[float]] = {}
    for (mode, _, switched), gaps in steps.items():
        pooled.setdefault((mode, switched), []).extend(gaps)
    return {
        "decode_steps": len(decisions) - 1,
        "switches": sum(len(v) for (_, _, switched), v in steps.items() if switched),
        "wall_seconds": wall,
        "median_ms": {
            f"{mode}{' after a switch' if switched else ''}": 1e3
            * statistics.median(pooled[(mode, switched)])
            for (mode, switched) in sorted(pooled)
        },
        "switch_excess_share": excess / wall if wall > 0 else 0.0,
        "long_gaps": len(gap_excess),
        "long_gap_excess_median_ms": (
            1e3 * statistics.median(gap_excess) if gap_excess else 0.0
        ),
        "long_gap_excess_share": sum(gap_excess) / wall if wall > 0 else 0.0,
    }


# A round trip: a switch and the switch back within this many decisions (a probe, a
# calibration, a dwell), timed until this many decisions after the return.
MAX_ROUND_TRIP = 16
ROUND_TRIP_TAIL = 2
# A gap between two of its decisions this many times the modes' usual step: the
# server idled in between (a request finished and the next one came at the same
# batch size), which is not the switch's cost. Slow steps stay under it.
ROUND_TRIP_IDLE_GAP = 32


def switch_seconds(records: Sequence[dict]) -> float:
    """What one switch between plain and speculative steps costs beyond the usual
    steps of the modes decided, from the trace's round trips at one batch size (no
    prefill, finish or idle time in them): half the median round trip's excess,
    none below 0.

    Under the overlap scheduler the gap from a decision to the next is the time of an
    earlier step, so a single switch's excess cannot be told from the other mode's
    step time; over a round trip both modes' steps are counted as often as decided."""
    decisions = decision_records(records)
    _, usual = _decision_gaps(records, with_prefills=False)
    speculative = [r["decision"] != PLAIN for r in decisions]
    excess = []
    for k in range(1, len(decisions)):
        if speculative[k] == speculative[k - 1]:
            continue
        back = next(
            (
                j
                for j in range(k + 1, min(k + MAX_ROUND_TRIP, len(decisions)))
                if speculative[j] != speculative[k]
            ),
            None,
        )
        if back is None or back + ROUND_TRIP_TAIL >= len(decisions):
            continue
        end = back + ROUND_TRIP_TAIL
        if len({r["batch_size"] for r in decisions[k - 1 : end + 1]}) > 1:
            continue
        bucket = bucket_of(decisions[k]["batch_size"])
        keys = [("spec" if speculative[i] else "plain", bucket) for i in range(k, end)]
        if not all(key in usual for key in keys):
            continue
        gaps = [decisions[i + 1]["t"] - decisions[i]["t"] for i in range(k, end)]
        if max(gaps) > ROUND_TRIP_IDLE_GAP * max(usual[key] for key in keys):
            continue
        excess.append(sum(gaps) - sum(usual[key] for key in keys))
    return max(0.0, statistics.median(excess)) / 2 if excess else 0.0


def phases_of_trace(records: Sequence[dict]) -> Phases:
    """The trace's timeline: each timed step's batch size for that step's seconds."""
    return [(r["batch_size"], r["seconds"]) for r in step_records(records)]


def trace_buckets(records: Sequence[dict]) -> List[int]:
    """The server's batch buckets (powers of two) at which the trace timed every
    mode it ran; a step of a batch in another bucket costs what the policy's step
    costs price it at from these (StepCosts.estimate)."""
    steps = step_records(records)
    buckets = power_of_two_buckets(max(r["batch_size"] for r in steps))
    timed: Dict[int, set] = {}
    for r in steps:
        timed.setdefault(bucket_of(r["batch_size"]), set()).add(r["num_steps"])
    modes = {r["num_steps"] for r in steps}
    both = [b for b in buckets if timed.get(b) == modes]
    if not both:
        raise ValueError(
            f"no batch bucket of the trace timed every mode {sorted(modes)}"
        )
    return both


def environment_from_trace(
    records: Sequence[dict], batch_sizes: Sequence[int]
) -> Environment:
    """Median seconds per (mode, batch bucket) of the timed steps in
    ``batch_sizes`` (the others' steps price no bucket); the acceptance timeline
    from the verifies (their per-token acceptance, forward-filled), each at the
    time of the timed steps before it; and each timed step at that time."""
    samples: Dict[Tuple[int, int], List[float]] = {}
    times: Dict[Tuple[int, int], List[float]] = {}
    acceptance: List[Tuple[float, float]] = []
    now = 0.0
    for record in records:
        if "decision" in record:
            continue
        mode = record["num_steps"]
        if "seconds" in record:
            bucket = bucket_of(record["batch_size"])
            if bucket in batch_sizes:
                samples.setdefault((mode, bucket), []).append(record["seconds"])
                times.setdefault((mode, bucket), []).append(now)
            now += record["seconds"]
        else:
            per_request = record["num_tokens"] / record["num_requests"]
            p = fit_chain_acceptance(per_request, mode)
            acceptance.append((now if acceptance else 0.0, p))
    if not acceptance:
        raise ValueError("the trace has no verify: its acceptance is unknown")
    modes = sorted({mode for mode, _ in samples})
    costs = {
        mode: {
            b: statistics.median(samples[(mode, b)])
            for b in batch_sizes
            if (mode, b) in samples
        }
        for mode in modes
    }
    missing = [(m, b) for m in modes for b in batch_sizes if b not in costs[m]]
    if missing:
        raise ValueError(f"the trace has no step of (mode, batch bucket) {missing[:5]}")
    step_times = {key: (times[key], samples[key]) for key in samples}
    return Environment(
        costs, acceptance, prefill_rates(records), switch_seconds(records), step_times
    )


def prefill_rates(records: Sequence[dict]) -> Dict[int, float]:
    """Per power-of-two batch bucket, the share of the trace's decode steps before
    which the running batch grew (a prefill had joined it)."""
    sizes = [r["batch_size"] for r in decision_records(records)]
    steps: Counter = Counter()
    grown: Counter = Counter()
    for before, size in zip(sizes, sizes[1:]):
        bucket = bucket_of(size)
        steps[bucket] += 1
        grown[bucket] += size > before
    return {bucket: grown[bucket] / n for bucket, n in steps.items()}


class SimPolicy(Protocol):
    """What the simulator drives: a mode per step, then what that step did."""

    def decide(self, batch_size: int) -> int: ...

    def observe(
        self, num_steps: int, batch_size: int, num_tokens: float, seconds: float
    ) -> None: ...


class _Static:
    """A policy that learns nothing from the steps it runs."""

    def observe(
        self, num_steps: int, batch_size: int, num_tokens: float, seconds: float
    ) -> None:
        pass


class _Fixed(_Static):
    def __init__(self, num_steps: int):
        self.num_steps = num_steps

    def decide(self, batch_size: int) -> int:
        return self.num_steps


class _Threshold(_Static):
    def __init__(self, n: int, num_steps: int):
        self.policy = SpecPolicy(n)
        self.num_steps = num_steps

    def decide(self, batch_size: int) -> int:
        return self.num_steps if self.policy.decide(batch_size).speculate else PLAIN


class _DecodeMode:
    @staticmethod
    def is_decode() -> bool:
        return True


@dataclass
class _RunningBatch:
    """What ThroughputSpecPolicy reads and writes of the scheduler's running batch."""

    size: int = 1
    forward_iter: Optional[int] = None
    launch_ts: Optional[float] = None
    spec_plain_step: bool = False
    spec_prev_plain_step: bool = False
    spec_num_steps: Optional[int] = None
    forward_mode: _DecodeMode = field(default_factory=_DecodeMode)

    def batch_size(self) -> int:
        return self.size


class _Auto:
    """The server's policy object on a batch the simulator launches: each step's
    launch is recorded as the overlap scheduler records it, a forward number apart
    (two where a prefill ran before it), when the step two before it ends."""

    def __init__(self, env: Environment, profiled: bool = False):
        steps = env.speculative_steps
        self.policy = ThroughputSpecPolicy(
            speculative_steps=steps,
            sets_step_count=len(steps) > 1,
            max_batch_size=max(next(iter(env.costs.values()))),
            min_dwell_steps=DEFAULT_MIN_DWELL_STEPS,
            reduce=None,
            fold_interval=1,
        )
        self.prefill_rate = env.prefill_rate
        self.batch = _RunningBatch()
        self._clock = 0.0
        self._last_step_start = 0.0
        self._forward_iter = 0
        self._prefill_credit: Dict[int, float] = {}
        if profiled:
            self._time_every_bucket(env)

    def _time_every_bucket(self, env: Environment) -> None:
        """Give the policy the charged costs as a profile (a bucket timed once
        would be capped by a larger one's cost, not priced at what it is charged)."""
        charged = env.charged_costs()
        costs = self.policy.policy.costs
        self.policy.policy.costs = StepCosts(
            {
                mode: {bs: charged.estimate(mode, bs) for bs in costs.batch_sizes}
                for mode in costs.modes
            }
        )

    def decide(self, batch_size: int) -> int:
        self.batch.size = batch_size
        self.policy.plan_decode_step(self.batch)
        return self.policy.planned_num_steps

    def observe(
        self, num_steps: int, batch_size: int, num_tokens: float, seconds: float
    ) -> None:
        self._forward_iter += 1 + self._prefill_before(batch_size)
        self.batch.forward_iter = self._forward_iter
        self.batch.launch_ts = self._last_step_start
        self._last_step_start = self._clock
        self._clock += seconds
        if num_steps != PLAIN:
            self.policy.pending.add_verify(num_steps, num_tokens, batch_size)

    def _prefill_before(self, batch_size: int) -> int:
        """1 if a prefill runs before this step: at its bucket's rate, evenly."""
        bucket = bucket_of(batch_size)
        credit = self._prefill_credit.get(bucket, 0.0)
        credit += self.prefill_rate.get(bucket, 0.0)
        due = credit >= 1.0
        self._prefill_credit[bucket] = credit - due
        return int(due)


STATIC = ("nospec", "always")


def make_policy(spec: str, env: Environment) -> SimPolicy:
    longest = max(env.speculative_steps)
    name, _, arg = spec.partition(":")
    if name == "nospec":
        return _Fixed(PLAIN)
    if name == "always":
        return _Fixed(int(arg) if arg else longest)
    if name == "threshold":
        return _Threshold(int(arg), longest)
    if name == "auto" and arg in ("", "profiled"):
        return _Auto(env, profiled=arg == "profiled")
    raise ValueError(f"unknown policy {spec!r}")


# How much later each of --start-offsets' runs starts than the one before.
START_OFFSET_SECONDS = 0.05


def offset_workloads(phases: Phases, num: int) -> List[Phases]:
    """The workload, then ``num - 1`` copies of it led by i x START_OFFSET_SECONDS
    more of its first phase's batch size (the i-th)."""
    if num < 1:
        raise ValueError(f"need at least one workload, got {num}")
    first = phases[0][0]
    return [phases] + [
        [(first, i * START_OFFSET_SECONDS)] + phases for i in range(1, num)
    ]


def simulate(
    policy: SimPolicy,
    env: Environment,
    phases: Phases,
    replay_step_times: bool = False,
) -> Dict[str, float]:
    """Run each phase for its time; every step costs and yields what the
    environment says (the acceptance of the environment's step at that time), and a
    switch between plain and speculative steps its cost on top. A step costs its
    bucket's time in the cost table, or with ``replay_step_times`` its time as
    recorded then (``Environment.step_seconds``), scaled from its bucket to its
    batch as the table would."""
    tokens = seconds = 0.0
    spec_steps = num_steps = 0
    step_costs = env.charged_costs()
    run_at: Set[Tuple[int, int]] = set()  # (mode, bucket)
    largest = step_costs.batch_sizes[-1]
    if any(bs > largest for bs, _ in phases):
        # As in a server, whose running batch never outgrows its policy's buckets.
        raise ValueError(
            f"a phase's batch is beyond the step costs' largest, {largest}"
        )
    phase_end = 0.0
    speculated = None
    for bs, duration in phases:
        phase_end += duration
        while seconds < phase_end:
            mode = policy.decide(bs)
            step_seconds = step_costs.estimate(mode, bs)
            if replay_step_times:
                bucket = step_costs.bucket(bs)
                first = (mode, bucket) not in run_at
                run_at.add((mode, bucket))
                step_seconds *= (
                    env.step_seconds(mode, bucket, seconds, first)
                    / env.costs[mode][bucket]
                )
            if speculated is not None and (mode != PLAIN) != speculated:
                step_seconds += env.switch_seconds
            speculated = mode != PLAIN
            step_tokens = bs * env.accept_length(mode, seconds)
            policy.observe(mode, bs, step_tokens, step_seconds)
            tokens += step_tokens
            seconds += step_seconds
            spec_steps += mode != PLAIN
            num_steps += 1
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "spec_step_share": spec_steps / max(1, num_steps),
    }


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", help="JSONL, one decode step per line")
    parser.add_argument("--costs", help="JSON {mode: {batch size: seconds}}")
    parser.add_argument(
        "--accept",
        help="per-token acceptance of the draft over time (with --costs): 0.9, or "
        "0.9x10,0.5x10 (p for seconds)",
    )
    parser.add_argument(
        "--phases", help="the workload, e.g. 1x2,64x4 (batch x seconds)"
    )
    parser.add_argument("--policies", default="nospec,always,auto")
    parser.add_argument(
        "--start-offsets",
        type=int,
        default=1,
        metavar="N",
        help="run each policy N times, the i-th after i x 50 ms more of the first "
        "phase, and print the means (and the ratio's range): where a policy's probes "
        "fall in the workload can move a single run by a few percent",
    )
    parser.add_argument(
        "--replay-step-times",
        action="store_true",
        help="with --trace: each step costs what the trace's steps of its mode and "
        "batch bucket took around that time (slow stretches included), not their "
        "median; a mode's first step at a bucket at least what the first one timed "
        "there took",
    )
    args = parser.parse_args(argv)

    if args.trace:
        records = load_trace(args.trace)
        env = environment_from_trace(records, trace_buckets(records))
        workload = phases_of_trace(records)
        wall_times = step_wall_times(records)
        if wall_times:
            print(f"the trace's decode steps, wall time: {json.dumps(wall_times)}")
        print(f"each switch is charged {1e3 * env.switch_seconds:.2f} ms")
    else:
        if not (args.costs and args.accept and args.phases):
            parser.error("give --trace, or --costs, --accept and --phases")
        with open(args.costs) as f:
            costs = {
                int(m): {int(bs): t for bs, t in by_bs.items()}
                for m, by_bs in json.load(f).items()
            }
        env = Environment(costs=costs, acceptance=parse_acceptance(args.accept))
    if args.phases:
        workload = parse_phases(args.phases)

    if args.replay_step_times and not args.trace:
        parser.error("--replay-step-times needs --trace")
    policies = args.policies.split(",")
    if not any(spec in STATIC for spec in policies):
        parser.error("--policies needs nospec or always (the reference)")
    workloads = offset_workloads(workload, args.start_offsets)
    runs = {
        spec: [
            simulate(make_policy(spec, env), env, w, args.replay_step_times)
            for w in workloads
        ]
        for spec in policies
    }
    best_static = [
        max(runs[spec][i]["tokens_per_second"] for spec in policies if spec in STATIC)
        for i in range(len(workloads))
    ]
    print(f"{'policy':<16} {'tok/s':>10} {'x best static':>14} {'spec steps':>11}")
    for spec, results in runs.items():
        rates = [r["tokens_per_second"] for r in results]
        ratios = [rate / best for rate, best in zip(rates, best_static)]
        spread = f"  [{min(ratios):.3f}-{max(ratios):.3f}]" if len(ratios) > 1 else ""
        share = statistics.mean(r["spec_step_share"] for r in results)
        print(
            f"{spec:<16} {statistics.mean(rates):>10.1f} "
            f"{statistics.mean(ratios):>14.3f} {share:>11.2f}{spread}"
        )


if __name__ == "__main__":
    main()
