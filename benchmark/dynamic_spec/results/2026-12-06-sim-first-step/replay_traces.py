"""auto / max(nospec, always) per recorded trace, mean over 8 start offsets, with median
step costs and replayed: the same as policy_sim.py --trace T --policies nospec,always,auto
--start-offsets 8 [--replay-step-times] for every trace of the repository.

Usage (from the repository root):
  python benchmark/dynamic_spec/results/2026-12-06-sim-first-step/replay_traces.py [--repeat N] [TRACE_SUBSTRING ...]
--repeat N serves each workload N times back to back (one policy throughout), so that what
a policy pays once weighs as it would in a longer run.
"""

import argparse
import glob
import statistics
import sys

sys.path.insert(0, "benchmark/dynamic_spec")
import policy_sim as ps  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--repeat", type=int, default=1)
parser.add_argument("only", nargs="*", help="replay only traces whose path has one")
args = parser.parse_args()
traces = sorted(
    glob.glob("benchmark/dynamic_spec/results/**/*.jsonl.gz", recursive=True)
    + glob.glob("test/**/*.jsonl.gz", recursive=True)
)
for trace in traces:
    if args.only and not any(part in trace for part in args.only):
        continue
    records = ps.load_trace(trace)
    phases = ps.phases_of_trace(records)
    if ps.trace_buckets(records)[-1] < max(bs for bs, _ in phases):
        continue
    try:
        env = ps.environment_from_trace(records, ps.trace_buckets(records))
    except ValueError:
        continue
    ratios = []
    for replay in (False, True):
        per_offset = []
        for workload in ps.offset_workloads(phases, 8):
            workload = list(workload) * args.repeat
            tok_s = {
                p: ps.simulate(ps.make_policy(p, env), env, workload, replay)[
                    "tokens_per_second"
                ]
                for p in ("nospec", "always", "auto")
            }
            per_offset.append(tok_s["auto"] / max(tok_s["nospec"], tok_s["always"]))
        ratios.append("%.4f" % statistics.mean(per_offset))
    print(trace, *ratios, flush=True)
