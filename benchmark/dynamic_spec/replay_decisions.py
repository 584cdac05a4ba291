"""Replay an ``auto`` server's step trace through the policy of this checkout.

The trace (``SGLANG_LOAD_AWARE_STEP_TRACE``, one GPU) holds the server's decisions and,
in the order they came, the decode steps it timed and the verifies it counted. The
policy is built as the server builds it (``ThroughputSpecPolicy``: the trace's step
counts, power-of-two buckets up to the server's largest running batch), and the
trace's timed steps and verifies are folded in before each decision, as
``plan_decode_step`` folds them on one GPU. Prints how many decisions match the
recorded ones, and the first that does not, with what the policy expected of each mode
there: at the code that recorded the trace every decision matches, so at another code
the differences are what the change would have decided on the same observations (the
observations after a difference are still the recorded run's).

Usage:
  python benchmark/dynamic_spec/replay_decisions.py TRACE.jsonl[.gz] [--max-running-requests N]
"""

from __future__ import annotations

import argparse
from typing import NamedTuple, Optional, Sequence

from policy_sim import load_trace

from sglang.srt.speculative.spec_policy import DEFAULT_MIN_DWELL_STEPS
from sglang.srt.speculative.throughput_policy import PLAIN, ThroughputSpecPolicy


class Replay(NamedTuple):
    decided: int
    matched: int
    first_difference: Optional[str]


def replay(
    records: Sequence[dict],
    max_running_requests: int,
    min_dwell_steps: int = DEFAULT_MIN_DWELL_STEPS,
) -> Replay:
    steps = sorted({r["num_steps"] for r in records if "num_steps" in r} - {PLAIN})
    server = ThroughputSpecPolicy(
        speculative_steps=steps,
        sets_step_count=len(steps) > 1,
        max_batch_size=max_running_requests,
        min_dwell_steps=min_dwell_steps,
        reduce=None,
        fold_interval=1,
    )
    policy, pending = server.policy, server.pending
    t0 = next((r["t"] for r in records if "t" in r), 0.0)
    decided = matched = 0
    first_difference = None
    for r in records:
        if "seconds" in r:
            bucket = policy.costs.bucket(r["batch_size"])
            pending.add_step_time(r["num_steps"], bucket, r["seconds"])
        elif "num_tokens" in r:
            pending.add_verify(r["num_steps"], r["num_tokens"], r["num_requests"])
        else:
            pending.fold_into(policy)
            decision = policy.decide(r["batch_size"])
            decided += 1
            if decision.num_steps == r["decision"]:
                matched += 1
            elif first_difference is None:
                costs_ms = {
                    m: round(1000 * seconds, 2)
                    for m in policy.modes
                    if (seconds := policy.costs.estimate(m, r["batch_size"]))
                    is not None
                }
                first_difference = (
                    f"at {r['t'] - t0:.2f} s, batch {r['batch_size']}: recorded "
                    f"{r['decision']} steps, replayed {decision.num_steps} "
                    f"({decision.reason}, expected gain "
                    f"{decision.expected_gain:+.1%}); step costs (ms) {costs_ms}"
                )
    return Replay(decided, matched, first_difference)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument(
        "--max-running-requests",
        type=int,
        help="the server's, from its startup log (default: the trace's largest "
        "batch: a bucket above it was never timed and prices nothing)",
    )
    parser.add_argument("--min-dwell-steps", type=int, default=DEFAULT_MIN_DWELL_STEPS)
    args = parser.parse_args(argv)
    records = load_trace(args.trace)
    max_running_requests = args.max_running_requests or max(
        r["batch_size"] for r in records if "batch_size" in r
    )
    result = replay(records, max_running_requests, args.min_dwell_steps)
    print(f"{result.matched} of {result.decided} decisions as recorded")
    if result.first_difference is not None:
        print(f"first difference {result.first_difference}")


if __name__ == "__main__":
    main()
