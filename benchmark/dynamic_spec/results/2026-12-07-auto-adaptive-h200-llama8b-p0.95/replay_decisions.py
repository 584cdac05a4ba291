"""Replay an ``auto`` server's step trace through its policy and compare the decisions.

The policy is built as ThroughputSpecPolicy builds it on one GPU (the trace's step
counts, power-of-two buckets up to the server's 257 running requests, the default
dwell); the trace's timed steps and verifies are folded in before each decision, as
``plan_decode_step`` folds them. Prints how many decisions match the recorded ones,
and the first that does not, with what the policy expected of each mode there.

Usage (from the repository root, ``python`` on the path):
  python benchmark/dynamic_spec/results/2026-12-07-auto-adaptive-h200-llama8b-p0.95/replay_decisions.py
"""

import gzip
import json
import os
import sys

from sglang.srt.speculative.spec_policy import DEFAULT_MIN_DWELL_STEPS
from sglang.srt.speculative.throughput_policy import (
    PLAIN,
    AcceptanceEstimate,
    PendingObservations,
    StepCosts,
    ThroughputPolicy,
    power_of_two_buckets,
)

MAX_RUNNING_REQUESTS = 257
here = os.path.dirname(os.path.abspath(__file__))
path = (
    sys.argv[1]
    if len(sys.argv) > 1
    else os.path.join(here, "auto-adaptive-topk1-steps.jsonl.gz")
)
with gzip.open(path, "rt") as f:
    records = [json.loads(line) for line in f]

steps = sorted({r["num_steps"] for r in records if "num_steps" in r} - {PLAIN})
modes = [PLAIN, *steps]
buckets = power_of_two_buckets(MAX_RUNNING_REQUESTS)
policy = ThroughputPolicy(
    StepCosts.unmeasured(modes, buckets),
    AcceptanceEstimate(steps, {max(steps): 1.0}),
    min_dwell_steps=DEFAULT_MIN_DWELL_STEPS,
)
pending = PendingObservations(modes, buckets)
t0 = next(r["t"] for r in records if "t" in r)
matched = decided = 0
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
                m: round(1000 * policy.costs.estimate(m, r["batch_size"]), 2)
                for m in modes
                if policy.costs.estimate(m, r["batch_size"]) is not None
            }
            first_difference = (
                f"at {r['t'] - t0:.2f} s, batch {r['batch_size']}: recorded "
                f"{r['decision']} steps, replayed {decision.num_steps} "
                f"({decision.reason}, expected gain {decision.expected_gain:+.1%}); "
                f"step costs (ms) {costs_ms}"
            )
print(f"{matched} of {decided} decisions as recorded")
if first_difference is not None:
    print("first difference", first_difference)
