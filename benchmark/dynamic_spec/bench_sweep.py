"""Throughput and latency vs concurrency, side by side: no speculation, EAGLE-3 always on,
the fork's load-aware speculation, and upstream's adaptive speculation (on the fork, and
on pristine upstream: the upstream-* configs' servers import the pristine tree that
`tools/fork sync` extracts, python/.fork/pristine/, instead of the fork).

One fresh server process per config (the previous one killed and the GPU checked idle);
concurrency is swept inside it, then the ramp changes it in phases without draining in
between. Every request has a new prompt (none is in the radix cache). Writes raw JSON, a
markdown table, a PNG plot and summary.json into OUT_DIR/<date>-<model>/.

Runs may be split: each config's record is merged into the results already in
OUT_DIR/<date>-<model>/ after every point (a config measured again replaces its old record,
unless the old one is finished and the new one was cut off before its ramp), so configs
can be measured over several invocations (--results-date adds to an earlier day's
results), or at once on separate GPUs (CUDA_VISIBLE_DEVICES and --url per invocation), and
a run cut off keeps its points.

With --tp-size N every server is tensor-parallel over the visible GPUs and the results go
to OUT_DIR/<date>-<model>-tpN/.

Usage:
  python benchmark/dynamic_spec/bench_sweep.py --preset llama8b --draft-accept 0.95
      --configs nospec,eagle3-topk4,loadaware-topk4 --concurrency 1,2,4,8,16,32,64,128,256
      --disable-threshold-for loadaware-topk4=suggested

(`suggested`: the load-aware config gets the threshold from which no speculation stays as
fast as its always-on reference, from the records of the two configs run before it.)

--bench-serving also runs upstream's own client (python -m sglang.benchmark.serving, the
old sglang.bench_serving) at each point's C against the same server, offline;
--bench-serving 16,128 only at those C.

The decode rate at a steady running batch, instead of the sweep and the ramp (into the
same records):
  python benchmark/dynamic_spec/bench_sweep.py --preset llama8b --draft-accept 0.95
      --configs nospec,upstream-steps0-topk1,plain-topk1,plain-topk4
      --decode-rate 64,128,256 --repeats 3
"""

from sweep.cli import main

if __name__ == "__main__":
    main(description=__doc__)
