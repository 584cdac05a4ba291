"""benchmark/dynamic_spec/trace_summary.py: the summary of a torch profiler trace
(GPU busy share, GPU time per CUDA graph, CPU waits, idle gaps). No GPU."""

import gzip
import json
import os
import tempfile
import threading
import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.spec_engine_utils import load_benchmark_script
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")


def event(cat, name, ts, dur, correlation=None, tid=1):
    args = {} if correlation is None else {"correlation": correlation}
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": ts,
        "dur": dur,
        "args": args,
        "tid": tid,
    }


RUN_BATCH = "sglang/srt/managers/scheduler.py(1): run_batch"
CATCH_UP = "sglang/srt/speculative/load_aware_draft.py(2): run"
PREPARE = "sglang/srt/managers/schedule_batch.py(3): prepare_for_decode"


# Two steps of 100 us: a 3-kernel graph (the target) and a 1-kernel graph (the draft)
# per step, an eager kernel, and a 20 us gap in step 2 while the CPU synchronizes.
# Python frames: thread 1 runs the scheduler, thread 2 something else meanwhile.
TRACE = [
    event("python_function", RUN_BATCH, 0, 200),
    event("python_function", "sglang/srt/utils.py(4): ended_before_launch", 10, 10),
    event("python_function", CATCH_UP, 80, 15),
    event("python_function", "torch/nn/modules/module.py(5): _call_impl", 84, 4),
    event(
        "python_function", "sglang/srt/managers/tokenizer.py(6): loop", 0, 200, tid=2
    ),
    event("cuda_runtime", "cudaGraphLaunch", 0, 5, correlation=1),
    event("kernel", "gemm", 5, 30, correlation=1),
    event("kernel", "attn", 35, 20, correlation=1),
    event("kernel", "gemm", 55, 10, correlation=1),
    event("cuda_runtime", "cudaGraphLaunch", 60, 5, correlation=2),
    event("kernel", "draft_gemm", 65, 25, correlation=2),
    event("cuda_runtime", "cudaLaunchKernel", 85, 3, correlation=3),
    event("kernel", "softmax", 90, 10, correlation=3),
    event("cuda_runtime", "cudaGraphLaunch", 100, 5, correlation=4),
    event("kernel", "gemm", 100, 30, correlation=4),
    event("kernel", "attn", 130, 20, correlation=4),
    event("kernel", "gemm", 150, 10, correlation=4),
    event("python_function", PREPARE, 155, 30),
    event("cuda_runtime", "cudaStreamSynchronize", 162, 18),
    event("cuda_runtime", "cudaGraphLaunch", 180, 2, correlation=5),
    event("kernel", "draft_gemm", 180, 20, correlation=5),
    {"ph": "i", "name": "marker", "ts": 0},
]


class TestTraceSummary(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.ts = load_benchmark_script("trace_summary")

    def test_busy_share_graphs_and_eager_kernels(self):
        summary = self.ts.summarize_trace(
            [e for e in TRACE if e.get("ph") == "X"], steps=2
        )
        self.assertAlmostEqual(summary["window_ms"], 0.195)
        self.assertAlmostEqual(summary["gpu_busy_ms"], 0.175)
        self.assertAlmostEqual(summary["ms_per_step"], 0.0975)
        self.assertEqual(
            [(g["kernels_per_graph"], g["launches"]) for g in summary["graphs"]],
            [(3, 2), (1, 2)],
        )
        self.assertAlmostEqual(summary["graphs"][0]["gpu_ms_per_launch"], 0.06)
        self.assertAlmostEqual(summary["graphs"][1]["gpu_ms_per_launch"], 0.0225)
        self.assertEqual(summary["eager_kernels"], {"count": 1, "gpu_ms": 0.01})
        self.assertEqual(summary["top_kernels"][0]["name"], "gemm")
        self.assertEqual(summary["cpu_waits"][0]["name"], "cudaStreamSynchronize")

    def test_eager_kernels_and_waits_name_the_sglang_function_that_issued_them(self):
        summary = self.ts.summarize_trace(TRACE[:-1], steps=2)
        self.assertEqual(
            summary["eager_kernel_sites"], [{"site": CATCH_UP, "count": 1, "ms": 0.01}]
        )
        self.assertEqual(
            summary["cpu_wait_sites"], [{"site": PREPARE, "count": 1, "ms": 0.018}]
        )

    def test_idle_time_is_filed_under_what_the_launching_thread_ran(self):
        summary = self.ts.summarize_trace(TRACE[:-1], steps=2)
        self.assertEqual(len(summary["gpu_idle_sites"]), 1)
        (site,) = summary["gpu_idle_sites"]
        self.assertEqual((site["site"], site["count"]), (PREPARE, 1))
        self.assertAlmostEqual(
            site["ms"], summary["window_ms"] - summary["gpu_busy_ms"]
        )

    def test_longest_gap_names_what_the_cpu_did(self):
        summary = self.ts.summarize_trace(TRACE[:-1], steps=2)
        gap = summary["longest_gpu_gaps"][0]
        self.assertAlmostEqual(gap["ms"], 0.02)
        self.assertAlmostEqual(gap["at_ms"], 0.155)
        self.assertEqual(gap["cpu"][0], PREPARE)

    def test_reads_gzipped_traces_and_prints(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "x-TP-0.trace.json.gz")
            with gzip.open(path, "wt") as f:
                json.dump({"traceEvents": TRACE}, f)
            events = self.ts.load_events(path)
        self.assertEqual(len(events), len(TRACE) - 1)
        text = self.ts.format_summary(self.ts.summarize_trace(events, steps=2))
        self.assertIn("GPU busy 0.17 ms (89.7%)", text)
        self.assertIn(f"        1     0.01  {CATCH_UP}", text)
        self.assertIn(
            f"GPU idle, by what the launching thread ran (gaps, ms):\n"
            f"        1     0.02  {PREPARE}",
            text,
        )

    def test_a_trace_still_being_written_is_read_once_complete(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "x-TP-0.trace.json.gz")
            data = gzip.compress(json.dumps({"traceEvents": TRACE}).encode())

            def write(content):
                with open(path, "wb") as f:
                    f.write(content)

            write(data[: len(data) // 2])
            with self.assertRaises(EOFError):
                self.ts.load_written_events(path, timeout=0.2, poll=0.1)
            writer = threading.Timer(0.3, write, args=(data,))
            writer.start()
            events = self.ts.load_written_events(path, timeout=10, poll=0.1)
            writer.join()
        self.assertEqual(len(events), len(TRACE) - 1)

    def test_a_trace_without_gpu_activity_is_refused(self):
        with self.assertRaisesRegex(ValueError, "no GPU activity"):
            self.ts.summarize_trace([event("cpu_op", "aten::add", 0, 1)], steps=1)


if __name__ == "__main__":
    unittest.main()
