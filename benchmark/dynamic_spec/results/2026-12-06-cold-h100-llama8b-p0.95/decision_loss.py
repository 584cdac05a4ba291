"""How much `auto`'s recorded decisions lose against the better mode, with step times
taken per power-of-two batch bucket (as the policy prices them) and per 8-wide batch bin.

For each decision of a step trace: every mode's expected output rate at the decision's batch
size (batch x the mean accept length of the mode's last 64 verifies / the median time of the
mode's steps in the bucket or bin), and the chosen mode's shortfall against the best. Only
decisions where every mode has at least MIN (default 3) timed steps in both the bin and the
bucket are judged. Prints the mean shortfall per trace and over the traces.

Usage: python decision_loss.py TRACE.jsonl.gz ...
"""

import collections
import gzip
import json
import os
import statistics
import sys

MIN_STEPS = int(os.environ.get("MIN", "3"))
ACCEPT_WINDOW = 64


def power_of_two_bucket(batch_size):
    bucket = 1
    while bucket < batch_size:
        bucket *= 2
    return bucket


def bin_of_eight(batch_size):
    return (batch_size + 7) // 8


def median_times(records, key):
    times = collections.defaultdict(list)
    for r in records:
        if "seconds" in r:
            times[(r["num_steps"], key(r["batch_size"]))].append(r["seconds"])
    return {k: statistics.median(v) for k, v in times.items() if len(v) >= MIN_STEPS}


def mean_shortfalls(records):
    """{grouping: mean shortfall} over the judged decisions, and their number."""
    groupings = {
        "bins": (median_times(records, bin_of_eight), bin_of_eight),
        "buckets": (median_times(records, power_of_two_bucket), power_of_two_bucket),
    }
    modes = sorted({m for m, _ in groupings["buckets"][0]})
    accepts = {m: collections.deque(maxlen=ACCEPT_WINDOW) for m in modes}
    shortfall = dict.fromkeys(groupings, 0.0)
    judged = 0
    for r in records:
        if "num_tokens" in r:
            if r["num_steps"] in accepts:
                accepts[r["num_steps"]].append(r["num_tokens"] / r["num_requests"])
            continue
        if "decision" not in r or any(m and not accepts[m] for m in modes):
            continue
        batch = r["batch_size"]
        accept = {m: statistics.mean(accepts[m]) if m else 1.0 for m in modes}
        rates = {}
        for name, (medians, key) in groupings.items():
            rates[name] = {
                m: batch * accept[m] / medians[(m, key(batch))]
                for m in modes
                if (m, key(batch)) in medians
            }
        if any(len(by_mode) < len(modes) for by_mode in rates.values()):
            continue
        judged += 1
        for name, by_mode in rates.items():
            shortfall[name] += 1 - by_mode[r["decision"]] / max(by_mode.values())
    if not judged:
        return None, 0
    return {name: total / judged for name, total in shortfall.items()}, judged


def main(paths):
    per_trace = []
    for path in paths:
        with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
            records = [json.loads(line) for line in f]
        shortfalls, judged = mean_shortfalls(records)
        if shortfalls is None:
            continue
        per_trace.append(shortfalls)
        name = "/".join(path.split("/")[-3:-1])[-45:]
        print(
            f"{name:45s} judged {judged:5d}  loss by 8-bins {100 * shortfalls['bins']:.2f}%"
            f"  by pow2 buckets {100 * shortfalls['buckets']:.2f}%"
        )
    means = {name: statistics.mean(s[name] for s in per_trace) for name in per_trace[0]}
    print(
        f"mean over {len(per_trace)} traces: by 8-bins {100 * means['bins']:.2f}%,"
        f" by buckets {100 * means['buckets']:.2f}%"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
