"""Where the stalls of the recorded step traces fall: in the first timed step after a
break (a prefill, a change of mode or of bucket: the decision before it timed nothing)
or in a run of timed steps. A stall: over 3x the median of its mode's power-of-two
bucket in that trace.

Usage (from the repository root): python benchmark/dynamic_spec/results/2026-12-06-sim-first-step/stall_position.py
"""

import collections
import glob
import gzip
import json
import statistics


def power_of_two_bucket(batch_size: int) -> int:
    bucket = 1
    while bucket < batch_size:
        bucket *= 2
    return bucket


def timed_steps(path: str):
    """(mode, bucket, seconds, first after a break) of each timed step."""
    steps = []
    previous_timed = current_timed = False
    for line in gzip.open(path, "rt"):
        record = json.loads(line)
        if "decision" in record:
            previous_timed, current_timed = current_timed, False
        elif "seconds" in record:
            bucket = power_of_two_bucket(record["batch_size"])
            steps.append(
                (record["num_steps"], bucket, record["seconds"], not previous_timed)
            )
            current_timed = True
    return steps


total = collections.Counter()
for path in sorted(
    glob.glob("benchmark/dynamic_spec/results/**/*.jsonl.gz", recursive=True)
):
    steps = timed_steps(path)
    by_bucket = collections.defaultdict(list)
    for mode, bucket, seconds, _ in steps:
        by_bucket[mode, bucket].append(seconds)
    medians = {key: statistics.median(v) for key, v in by_bucket.items()}
    for mode, bucket, seconds, first in steps:
        total[first, seconds > 3 * medians[mode, bucket]] += 1
for first, name in ((True, "first after a break"), (False, "in a run")):
    stalls, steps = total[first, True], total[first, True] + total[first, False]
    print(
        f"{name}: {stalls} stalls in {steps} timed steps ({100 * stalls / steps:.2f}%)"
    )
