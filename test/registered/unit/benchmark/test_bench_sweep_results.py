"""benchmark/dynamic_spec/bench_sweep.py (its package, sweep/): the client, the
workloads, per-point statistics, the servers' flags and the result files (summary.json
for machines, markdown and PNG for people). No server, no GPU."""

import argparse
import asyncio
import contextlib
import gc
import io
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from typing import Callable, List
from unittest import mock

from aiohttp import web
from transformers import AutoTokenizer

from sglang.srt.speculative.adaptive_spec_params import (
    resolve_candidate_steps_from_config,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.spec_engine_utils import (
    EAGLE3_CHAIN,
    EAGLE3_TREE,
    cli_args,
    load_benchmark_package,
    load_benchmark_script,
    synthetic_pair,
)
from sglang.test.synthetic_spec_models import load_spec, parse_draft_accept
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

sweep = load_benchmark_package("sweep")


def sweep_args(*flags: str, **fields) -> argparse.Namespace:
    """bench_sweep.py's arguments parsed from flags, then fields set over them."""
    with mock.patch.object(sys, "argv", ["bench_sweep.py", *flags]):
        args = sweep.cli.parse_args(None)
    return argparse.Namespace(**{**vars(args), **fields})


SUMMARY_POINT_KEYS = {
    "config",
    "concurrency",
    "output_tok_s",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "ttft_p50_ms",
    "accept_length",
    "spec_step_share",
}


class TestBenchSweepResults(CustomTestCase):
    def result(self, ttft, latency, tokens, verify=0, correct=0):
        return sweep.client.RequestResult(
            ttft, latency, tokens, verify, correct, latency
        )

    def closed_run(self, results, wall, client_cpu=0.0):
        tokens = sum(r.output_tokens for r in results)
        return sweep.stats.Run(results, tokens, wall, client_cpu)

    def test_summarize_counts_speculative_steps_only(self):
        results = [
            self.result(0.1, 1.1, 11, verify=4, correct=4),
            self.result(0.2, 2.2, 21),
        ]
        point = sweep.stats.summarize([self.closed_run(results, 2.0)])
        self.assertAlmostEqual(point["output_tok_s"], 16.0)
        self.assertAlmostEqual(point["tpot_p50_ms"], 100.0)
        self.assertAlmostEqual(point["ttft_p99_ms"], 199.0)  # interpolated
        self.assertAlmostEqual(point["ttft_mean_ms"], 150.0)
        self.assertAlmostEqual(point["latency_mean_ms"], 1650.0)
        self.assertAlmostEqual(point["accept_length"], 2.0)
        no_spec = sweep.stats.summarize(
            [self.closed_run([self.result(0.1, 1.1, 11)], 1.0)]
        )
        self.assertIsNone(no_spec["accept_length"])

    def test_repeats_give_the_median_and_spread_of_throughput(self):
        run = [self.result(0.1, 1.1, 10)]
        point = sweep.stats.summarize(
            [self.closed_run(run, wall) for wall in (1.0, 2.0, 0.5)]
        )
        self.assertEqual(point["num_requests"], 3)
        self.assertAlmostEqual(point["output_tok_s"], 10.0)
        self.assertAlmostEqual(point["output_tok_s_min"], 5.0)
        self.assertAlmostEqual(point["output_tok_s_max"], 20.0)
        cell = sweep.tables.markdown_cell({**point, "spec_step_share": 1.0})
        self.assertEqual(cell, "10 [5-20] (100% spec)")

    def test_a_point_repeats_whole_closed_loops_until_its_minimum_duration(self):
        calls, clock = [], [0.0]

        async def closed_loop(url, prompts, output_len, concurrency):
            calls.append((url, len(prompts), output_len, concurrency))
            clock[0] += 0.02  # each loop takes 20 ms
            return [self.result(0.1, 0.2, output_len) for _ in prompts]

        fake_time = mock.Mock(perf_counter=lambda: clock[0], process_time=lambda: 0.0)
        prompts = sweep.client.PromptSource(input_len=4)
        with mock.patch.multiple(
            sweep.workloads, closed_loop=closed_loop, time=fake_time
        ):
            run = sweep.workloads.closed_loops_for(0.05, "u", prompts, 2, 8, 2)
            self.assertEqual(len(calls), 3)
            self.assertAlmostEqual(run.wall, 0.06)
            self.assertEqual(set(calls), {("u", 2, 8, 2)})
            self.assertEqual(len(run.results), 2 * len(calls))
            self.assertEqual(run.tokens, 8 * len(run.results))
            calls.clear()
            sweep.workloads.closed_loops_for(0, "u", prompts, 1, 8, 1)
            self.assertEqual(len(calls), 1)  # always one whole loop

    def test_drawing_prompts_is_not_timed(self):
        clock, cpu = [0.0], [0.0]

        async def closed_loop(url, prompts, output_len, concurrency):
            clock[0] += 0.02
            cpu[0] += 0.01
            return [self.result(0.1, 0.2, output_len) for _ in prompts]

        class SlowPrompts(sweep.client.PromptSource):
            def take(self, num):
                clock[0] += 1.0
                cpu[0] += 1.0
                return super().take(num)

        fake_time = mock.Mock(
            perf_counter=lambda: clock[0], process_time=lambda: cpu[0]
        )
        with mock.patch.multiple(
            sweep.workloads, closed_loop=closed_loop, time=fake_time
        ):
            run = sweep.workloads.closed_loops_for(
                0.05, "u", SlowPrompts(input_len=4), 2, 8, 2
            )
        self.assertEqual(len(run.results), 6)
        self.assertAlmostEqual(run.wall, 0.06)
        self.assertAlmostEqual(run.client_cpu, 0.03)

    def test_a_point_records_how_busy_the_client_was(self):
        client_cpu, warnings = [1.8, 1.8], []  # CPU seconds of each 2 s run

        def closed_loops_for(min_seconds, url, prompts, num, output_len, c):
            return self.closed_run(
                [self.result(0.1, 0.2, output_len)], 2.0, client_cpu.pop()
            )

        args = argparse.Namespace(
            url="u",
            min_requests=1,
            requests_per_concurrency=1,
            min_point_seconds=1,
            output_len=8,
            repeats=2,
            steady=False,
        )
        nospec = sweep.configs.KNOWN_CONFIGS["nospec"]
        # The server's front end: 1 then 3.6 CPU seconds over the 4 s of a point.
        front_end_cpu = iter([10.0, 11.0, 20.0, 23.6])
        clock = mock.Mock(perf_counter=mock.Mock(side_effect=[0.0, 4.0] * 2))
        with mock.patch.multiple(
            sweep.workloads,
            closed_loops_for=closed_loops_for,
            server_state=lambda url: {},
            process_cpu_seconds=lambda pid: next(front_end_cpu),
            time=clock,
            tqdm=mock.Mock(write=warnings.append),
        ):
            point = sweep.workloads.measure_point(args, nospec, None, 4, 7)
            self.assertAlmostEqual(point["client_cpu_share"], 0.9)
            self.assertAlmostEqual(point["front_end_cpu_share"], 0.25)
            self.assertEqual(len(warnings), 1)
            self.assertIn("nospec C=4: the client kept 90% of a core busy", warnings[0])
            client_cpu[:] = [1.0, 1.0]
            point = sweep.workloads.measure_point(args, nospec, None, 4, 7)
            self.assertAlmostEqual(point["client_cpu_share"], 0.5)
            self.assertAlmostEqual(point["front_end_cpu_share"], 0.9)
            self.assertEqual(len(warnings), 2)
            self.assertIn("the server's front end kept 90% of a core", warnings[1])

    def test_a_process_cpu_time_counts_its_busy_seconds(self):
        deadline = time.process_time() + 0.2
        while time.process_time() < deadline:
            pass
        self.assertAlmostEqual(
            sweep.server.process_cpu_seconds(os.getpid()),
            time.process_time(),
            delta=0.05,
        )

    def test_every_request_of_a_run_gets_a_new_prompt(self):
        loops = []

        async def closed_loop(url, prompts, output_len, concurrency):
            loops.append(prompts)
            return [self.result(0.1, 0.2, output_len) for _ in prompts]

        prompts = sweep.client.PromptSource(input_len=16)
        with mock.patch.object(sweep.workloads, "closed_loop", closed_loop):
            sweep.workloads.closed_loops_for(0, "u", prompts, 4, 8, 2)
            sweep.workloads.closed_loops_for(0, "u", prompts, 4, 8, 2)
        issued = [tuple(p) for loop in loops for p in loop]
        self.assertEqual(len(issued), 8)
        self.assertEqual(len(set(issued)), 8)
        self.assertEqual({len(p) for p in issued}, {16})
        same_seed = sweep.client.PromptSource(input_len=16).take(8)
        self.assertEqual([tuple(p) for p in same_seed], issued)

    def test_warm_up_runs_each_concurrency_once_smallest_first(self):
        loops = []

        async def closed_loop(url, prompts, output_len, concurrency):
            loops.append((len(prompts), output_len, concurrency))
            return [self.result(0.1, 0.2, output_len) for _ in prompts]

        with mock.patch.object(sweep.server, "closed_loop", closed_loop):
            sweep.server.warm_up("u", sweep.client.PromptSource(4), [64, 1, 256, 64, 8])
        short = sweep.server.WARMUP_OUTPUT_LEN
        self.assertEqual(
            loops, [(c, short, c) for c in (1, 8, 64, 256)], "one full batch per C"
        )

    def test_a_closed_loop_issues_each_prompt_once_at_its_concurrency(self):
        in_flight, issued = [0], []

        async def one_request(session, url, prompt, output_len):
            in_flight[0] += 1
            issued.append((prompt[0], in_flight[0]))
            await asyncio.sleep(0.01)
            in_flight[0] -= 1
            return self.result(0.01, 0.02, output_len)

        with mock.patch.object(sweep.loops, "one_request", one_request):
            results = asyncio.run(
                sweep.loops.closed_loop("u", [[i] for i in range(5)], 8, 2)
            )
        self.assertEqual(len(results), 5)
        self.assertEqual(sorted(p for p, _ in issued), list(range(5)))
        self.assertEqual(max(n for _, n in issued), 2)
        self.assertEqual({r.output_tokens for r in results}, {8})

    def test_a_load_runs_with_the_garbage_collector_paused(self):
        async def load(fail: bool) -> bool:
            await asyncio.sleep(0)
            if fail:
                raise RuntimeError("load failed")
            return gc.isenabled()

        self.assertTrue(gc.isenabled())
        self.assertFalse(sweep.loops.run_load(load(False)))
        self.assertTrue(gc.isenabled())
        with self.assertRaisesRegex(RuntimeError, "load failed"):
            sweep.loops.run_load(load(True))
        self.assertTrue(gc.isenabled())
        gc.disable()
        try:
            sweep.loops.run_load(load(False))
            self.assertFalse(gc.isenabled(), "a caller's paused collector stays so")
        finally:
            gc.enable()

    def test_a_closed_loop_spreads_its_output_lengths_when_asked(self):
        async def one_request(session, url, prompt, output_len):
            return self.result(0.0, 0.0, output_len)

        with mock.patch.object(sweep.loops, "one_request", one_request):
            results = asyncio.run(
                sweep.loops.closed_loop("u", [[i] for i in range(200)], 100, 4, 0.5)
            )
        lengths = [r.output_tokens for r in results]
        self.assertTrue(all(50 <= n <= 150 for n in lengths), lengths)
        self.assertGreater(len(set(lengths)), 50)

    def test_profile_decode_spreads_the_lengths_of_a_closed_loop_only(self):
        profile_decode = load_benchmark_script("profile_decode")

        def parse(*flags: str) -> argparse.Namespace:
            with mock.patch.object(sys, "argv", ["profile_decode.py", *flags]):
                return profile_decode.parse_args()

        spread = parse("--closed-loop", "--output-len-spread", "0.5")
        self.assertEqual(spread.output_len_spread, 0.5)
        self.assertEqual(parse("--closed-loop").output_len_spread, 0.0)
        for flags in (
            ["--output-len-spread", "0.5"],
            ["--closed-loop", "--output-len-spread", "1"],
        ):
            with self.assertRaises(SystemExit), contextlib.redirect_stderr(
                io.StringIO()
            ):
                parse(*flags)

    def test_profile_decode_waits_for_a_trace_of_its_own(self):
        profile_decode = load_benchmark_script("profile_decode")

        async def profile(profile_dir: str) -> str:
            earlier = set(profile_decode.rank0_traces(profile_dir))
            load = asyncio.create_task(asyncio.sleep(30))

            async def server_writes_trace():
                await asyncio.sleep(0.6)
                Path(profile_dir, "auto-2-TP-0.trace.json.gz").write_bytes(b"")

            writing = asyncio.create_task(server_writes_trace())
            try:
                return await profile_decode.wait_for_trace(profile_dir, earlier, load)
            finally:
                load.cancel()
                await writing

        with tempfile.TemporaryDirectory() as profile_dir:
            Path(profile_dir, "auto-1-TP-0.trace.json.gz").write_bytes(b"")
            trace = asyncio.run(profile(profile_dir))
        self.assertEqual(os.path.basename(trace), "auto-2-TP-0.trace.json.gz")

    def against_server(self, generate, load, routes=None):
        """Runs load(url) against a local server whose /generate is generate (or
        whose routes are routes)."""

        async def serve_and_load():
            app = web.Application()
            app.add_routes(routes or [web.post("/generate", generate)])
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0, backlog=1024).start()
            try:
                return await load(f"http://127.0.0.1:{runner.addresses[0][1]}")
            finally:
                await runner.cleanup()

        return asyncio.run(serve_and_load())

    def test_a_closed_loop_keeps_more_than_a_hundred_requests_in_flight(self):
        concurrency, in_flight, peak = 150, [0], [0]

        async def generate(request):
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            response = web.StreamResponse()
            await response.prepare(request)
            await asyncio.sleep(0.2)
            meta = {"meta_info": {"completion_tokens": 8}}
            await response.write(f"data: {json.dumps(meta)}\n\n".encode())
            in_flight[0] -= 1
            return response

        prompts = [[i] for i in range(concurrency)]
        results = self.against_server(
            generate,
            lambda url: sweep.loops.closed_loop(url, prompts, 8, concurrency),
        )
        self.assertEqual(len(results), concurrency)
        self.assertEqual(peak[0], concurrency)

    def stream_one_request(self, chunks: List[dict], gap: float):
        """one_request against a server streaming chunks gap seconds apart."""

        async def generate(request):
            response = web.StreamResponse()
            await response.prepare(request)
            for chunk in chunks:
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(gap)
            await response.write(b"data: [DONE]\n\n")
            return response

        async def request(url):
            async with sweep.client.client_session() as session:
                return await sweep.client.one_request(session, url, [1, 2], 3)

        return self.against_server(generate, request)

    def test_a_request_times_its_first_chunk_and_counts_from_its_last(self):
        gap = 0.1
        chunks = [
            {
                "output_ids": list(range(n)),
                "meta_info": {"completion_tokens": n, "spec_verify_ct": n - 1},
            }
            for n in (1, 2, 3)
        ]
        result = self.stream_one_request(chunks, gap)
        self.assertEqual((result.output_tokens, result.verify_ct), (3, 2))
        self.assertGreaterEqual(result.latency - result.ttft, 3 * gap - 0.01)

    def test_a_request_without_output_fails_clearly(self):
        with self.assertRaisesRegex(RuntimeError, "streamed no output"):
            self.stream_one_request([], 0)
        error = {"error": {"message": "prompt too long"}}
        with self.assertRaisesRegex(RuntimeError, "/generate: prompt too long"):
            self.stream_one_request([error], 0)

    def test_the_ramp_changes_concurrency_without_draining_between_phases(self):
        in_flight, events = [0], []  # (time, "start" | "end", requests in flight)

        async def one_request(session, url, prompt, output_len):
            in_flight[0] += 1
            events.append((time.perf_counter(), "start", in_flight[0]))
            await asyncio.sleep(request_seconds)
            in_flight[0] -= 1
            events.append((time.perf_counter(), "end", in_flight[0]))
            return self.result(0.01, 0.02, output_len)

        phases, phase_seconds, request_seconds = [2, 4, 2], 0.3, 0.03
        prompts = sweep.client.PromptSource(input_len=4)
        with mock.patch.object(sweep.loops, "one_request", one_request):
            results, bounds = asyncio.run(
                sweep.loops.ramp_loop("u", prompts, 8, phases, phase_seconds)
            )
        self.assertEqual(len(bounds), len(phases) + 1)
        stop = bounds[0] + len(phases) * phase_seconds
        # The requests in flight at the stop drain once, at the end.
        self.assertLess(bounds[-1] - stop, request_seconds + 0.1)
        self.assertEqual(max(n for _, kind, n in events if kind == "start"), 4)
        starts = [(t, n) for t, kind, n in events if kind == "start"]
        self.assertTrue(any(n == 4 for t, n in starts if t < bounds[2]))
        late = [n for t, n in starts if t > bounds[2] + request_seconds + 0.05]
        self.assertTrue(late and max(late) <= 2)
        # Until the loop stops, a request that ends leaves the others running.
        ends = [n for t, kind, n in events if kind == "end" and t < stop]
        self.assertGreaterEqual(min(ends), 1)
        self.assertEqual(len(results), sum(kind == "end" for _, kind, _ in events))

    def test_a_request_records_the_tokens_it_streamed_by_each_chunk(self):
        timeline = []

        async def generate(request):
            response = web.StreamResponse()
            await response.prepare(request)
            for n in (1, 3, 4):
                chunk = {
                    "output_ids": list(range(n)),
                    "meta_info": {"completion_tokens": n},
                }
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(0.01)
            await response.write(b"data: [DONE]\n\n")
            return response

        async def request(url):
            async with sweep.client.client_session() as session:
                return await sweep.client.one_request(session, url, [1], 4, timeline)

        result = self.against_server(generate, request)
        self.assertEqual([tokens for _, tokens in timeline], [1, 3, 4])
        times = [at for at, _ in timeline]
        self.assertEqual(times, sorted(times))
        self.assertLessEqual(times[-1], result.finished_at)
        compact = b'data: {"output_ids":[9,9],"meta_info":{"completion_tokens":12}}'
        self.assertEqual(sweep.client.streamed_tokens(compact), 12)
        self.assertIsNone(sweep.client.streamed_tokens(b'data: {"error": {}}'))

    def staggered_decode(
        self, stagger: float, step: float = 0.1, slow_until: float = 0.0
    ):
        """one_request of a server that decodes every request at 2 tokens per step of
        `step` seconds (3 x `step` for steps that start before `slow_until`),
        request i streaming its first token at i * stagger (fake times in the
        timeline)."""
        started = []

        async def one_request(session, url, prompt, output_len, timeline):
            i = len(started)
            started.append(output_len)
            tokens, at = 1, i * stagger
            while True:
                timeline.append((at, tokens))
                if tokens == output_len:
                    return sweep.client.RequestResult(0.0, at, tokens, 0, 0, at)
                seconds = 3 * step if at < slow_until else step
                tokens, at = min(tokens + 2, output_len), at + seconds

        return one_request, started

    def test_the_decode_rate_window_shows_where_it_was_slow(self):
        one_request, _ = self.staggered_decode(stagger=0.01, step=0.01, slow_until=0.3)
        with mock.patch.object(sweep.loops, "one_request", one_request):
            run = asyncio.run(sweep.loops.decode_rate_loop("u", [[1]] * 4, 201))
        # 2 tokens per request per 0.03 s, then per 0.01 s: ~267, then 800 tok/s
        first, *_, last = run.tenths_tok_s
        self.assertLess(first, 300)
        self.assertGreater(last, 700)

    def test_the_decode_rate_counts_only_while_every_request_decodes(self):
        one_request, started = self.staggered_decode(stagger=0.01)
        with mock.patch.object(sweep.loops, "one_request", one_request):
            run = asyncio.run(sweep.loops.decode_rate_loop("u", [[1]] * 4, 21))
        self.assertEqual(started, [21] * 4)
        # From 0.03 (request 3's first token) to 1.0 (request 0's last): request 0
        # streams 20 more tokens, the others 18 each (their last chunk is after 1.0).
        self.assertAlmostEqual(run.wall, 0.97)
        self.assertEqual(run.tokens, 20 + 3 * 18)
        self.assertEqual(len(run.results), 4)
        # its tenths count the same tokens
        self.assertEqual(len(run.tenths_tok_s), 10)
        self.assertAlmostEqual(sum(run.tenths_tok_s) * run.wall / 10, run.tokens)
        one_request, _ = self.staggered_decode(stagger=0.5)  # 3 starts after 0 ends
        with mock.patch.object(sweep.loops, "one_request", one_request):
            with self.assertRaisesRegex(RuntimeError, "raise --decode-output-len"):
                asyncio.run(sweep.loops.decode_rate_loop("u", [[1]] * 4, 20))
        one_request, _ = self.staggered_decode(stagger=0.4)
        with mock.patch.object(sweep.loops, "one_request", one_request):
            # Request 0 ends at 1.0 s, when requests 0, 1 (0.4 s) and 2 (0.8 s) run.
            with self.assertRaisesRegex(
                RuntimeError, "first request finished with 20 tokens, when 3 of 4 "
            ):
                asyncio.run(sweep.loops.decode_rate_loop("u", [[1]] * 4, 20))

    def test_the_decode_rate_reads_the_front_ends_cpu_over_its_window(self):
        one_request, _ = self.staggered_decode(stagger=0.01)
        clock = [0.0]

        async def timed_request(session, url, prompt, output_len, timeline):
            await asyncio.sleep(0)  # the sampler reads the counter at fake time 0
            result = await one_request(session, url, prompt, output_len, timeline)
            clock[0] = max(clock[0], result.finished_at)
            return result

        fake_time = mock.Mock(perf_counter=lambda: clock[0], process_time=lambda: 0.0)
        with mock.patch.multiple(
            sweep.loops, one_request=timed_request, time=fake_time
        ):
            # The front end used 0.5 s of CPU per second: 0.485 s in [0.03, 1.0].
            run = asyncio.run(
                sweep.loops.decode_rate_loop("u", [[1]] * 4, 21, lambda: 0.5 * clock[0])
            )
        self.assertAlmostEqual(run.wall, 0.97)
        self.assertAlmostEqual(run.front_end_cpu, 0.485)

        def unreadable():
            raise ProcessLookupError("front end gone")

        with mock.patch.multiple(
            sweep.loops, one_request=timed_request, time=fake_time
        ), contextlib.redirect_stdout(io.StringIO()):
            run = asyncio.run(
                sweep.loops.decode_rate_loop("u", [[1]] * 4, 21, unreadable)
            )
        self.assertIsNone(run.front_end_cpu)  # no reading rather than 0
        with mock.patch.object(sweep.loops, "one_request", one_request):
            run = asyncio.run(sweep.loops.decode_rate_loop("u", [[1]] * 4, 21))
        self.assertIsNone(run.front_end_cpu)

    def test_a_requests_tokens_by_a_moment(self):
        timeline = [(1.0, 1), (2.0, 3), (2.0, 5), (4.0, 9)]
        by = sweep.loops.tokens_by
        self.assertEqual(
            [by(timeline, t) for t in (0.5, 1.0, 2.0, 3.9, 9.0)], [0, 1, 5, 5, 9]
        )

    def test_a_sampled_counter_is_read_between_its_samples(self):
        samples = [(1.0, 10.0), (2.0, 20.0), (4.0, 22.0)]
        self.assertEqual(sweep.loops.value_at(samples, 0.5), 10.0)
        self.assertEqual(sweep.loops.value_at(samples, 1.5), 15.0)
        self.assertEqual(sweep.loops.value_at(samples, 3.0), 21.0)
        self.assertEqual(sweep.loops.value_at(samples, 9.0), 22.0)

    def test_a_decode_rate_repeats_with_new_prompts(self):
        loops = []

        async def decode_rate_loop(url, prompts, output_len, front_end_cpu_seconds):
            loops.append((tuple(map(tuple, prompts)), output_len))
            return sweep.stats.Run(
                [],
                100.0 * len(loops),
                1.0,
                0.5,
                front_end_cpu=front_end_cpu_seconds(),
                tenths_tok_s=[100.0 * len(loops) + 0.04] * 10,
            )

        args = argparse.Namespace(url="u", repeats=3, decode_output_len=64)
        config = sweep.configs.KNOWN_CONFIGS["plain-topk1"]
        state = {"load_aware_speculation": {"num_spec_steps": 0, "num_plain_steps": 9}}
        with mock.patch.multiple(
            sweep.workloads,
            decode_rate_loop=decode_rate_loop,
            server_state=lambda u: state,
            process_cpu_seconds={7: 0.25}.get,
        ):
            point = sweep.workloads.measure_decode_rate(
                args, config, sweep.client.PromptSource(4), 8, front_end_pid=7
            )
        self.assertEqual(
            point,
            {
                "config": "plain-topk1",
                "batch": 8,
                "output_tok_s": 200.0,
                "output_tok_s_min": 100.0,
                "output_tok_s_max": 300.0,
                "window_s": 1.0,
                "spec_step_share": 0.0,
                "client_cpu_share": 0.5,
                "tenths_tok_s": [[100.0] * 10, [200.0] * 10, [300.0] * 10],
                "front_end_cpu_share": 0.25,
            },
        )
        self.assertEqual({len(prompts) for prompts, _ in loops}, {8})
        self.assertEqual({n for _, n in loops}, {64})
        self.assertEqual(len({p for prompts, _ in loops for p in prompts}), 24)
        # A run that could not read the front end's CPU (decode_rate_loop: None).
        with mock.patch.multiple(
            sweep.workloads,
            decode_rate_loop=decode_rate_loop,
            server_state=lambda u: state,
            process_cpu_seconds=lambda pid: None,
        ):
            point = sweep.workloads.measure_decode_rate(
                args, config, sweep.client.PromptSource(4), 8, front_end_pid=7
            )
        self.assertNotIn("front_end_cpu_share", point)
        self.assertEqual(point["client_cpu_share"], 0.5)

    def decode_rate_section(self, name: str, speed: float) -> dict:
        points = [
            {
                "config": name,
                "batch": b,
                "output_tok_s": speed * b,
                "output_tok_s_min": speed * b - 1,
                "output_tok_s_max": speed * b + 1,
                "window_s": 5.0,
                "spec_step_share": 0.0,
                "client_cpu_share": 0.1,
            }
            for b in (64, 128)
        ]
        decode = [{"mode": "plain", "batch": 64, "tok_s": speed * 63, "windows": 9}]
        windows = [
            {"mode": "plain", "batch": 64, "tokens": t, "tok_s": speed * 63}
            for t in (1000, 2000, 3000)
        ]
        return {
            "server_args": [],
            "env": {},
            "points": points,
            "decode_tok_s": decode,
            "decode_windows": windows,
        }

    def test_a_decode_rate_run_saves_its_section_of_the_record(self):
        saved, states = [], iter([{"memory_usage": {"token_capacity": 10**6}}])

        @contextlib.contextmanager
        def serving(args, config, target, draft, prompts, warmup, log_path):
            self.assertEqual(warmup, [64, 128])
            Path(log_path).write_text("")
            yield sweep.server.Launched(
                {"server_args": ["--x"], "env": {}, "code": {"sglang": "fork"}}, 7
            )

        def measure_decode_rate(args, config, prompts, batch, front_end_pid):
            self.assertEqual(front_end_pid, 7)
            return {"config": config.name, "batch": batch, "output_tok_s": 1.0}

        args = argparse.Namespace(
            url="u", input_len=512, decode_output_len=1024, decode_rate=[64, 128]
        )
        config = sweep.configs.KNOWN_CONFIGS["nospec"]
        with tempfile.TemporaryDirectory() as log_dir, mock.patch.multiple(
            sweep.runs,
            serving=serving,
            server_state=lambda url: next(states),
            measure_decode_rate=measure_decode_rate,
            tqdm=lambda items, desc: items,
        ):
            sweep.runs.run_decode_rate(args, config, "t", "d", log_dir, saved.append)
            self.assertTrue(Path(log_dir, "nospec-decode-rate.log").is_file())
            self.assertEqual(len(saved), 2)
            self.assertEqual(set(saved[-1]), {"config", "decode_rate"})
            section = saved[-1]["decode_rate"]
            self.assertEqual([p["batch"] for p in section["points"]], [64, 128])
            self.assertEqual(section["server_args"], ["--x"])
            self.assertEqual(section["code"], {"sglang": "fork"})
            self.assertEqual((section["input_len"], section["output_len"]), (512, 1024))
            self.assertEqual(section["decode_tok_s"], [])
            self.assertEqual(section["decode_windows"], [])
            states = iter([{"memory_usage": {"token_capacity": 64 * 1536 - 1}}])
            with self.assertRaisesRegex(RuntimeError, "do not fit in its KV cache"):
                sweep.runs.run_decode_rate(
                    args, config, "t", "d", log_dir, saved.append
                )

    def test_decode_rates_and_sweeps_of_a_config_share_its_record(self):
        with tempfile.TemporaryDirectory() as out_dir:
            self.merge(out_dir, self.record("nospec", 100.0), "sweep")
            rates = {
                "config": "nospec",
                "decode_rate": self.decode_rate_section("nospec", 100.0),
            }
            # plain-topk1's middle eight tenths below run at 0.8x these
            rates["decode_rate"]["points"][1]["tenths_tok_s"] = [[125.0] * 10] * 2
            records = self.merge(out_dir, rates, "rates")
            (nospec,) = records
            self.assertEqual(nospec["commit"], "sweep")  # the sweep's record, kept
            self.assertEqual(nospec["decode_rate"]["commit"], "rates")
            self.assertTrue(sweep.records.finished(nospec))
            # A sweep measured again keeps the decode rates; a config measured only
            # for them gets a record of its own.
            records = self.merge(out_dir, self.record("nospec", 120.0), "sweep2")
            self.assertEqual(records[0]["decode_rate"]["commit"], "rates")
            plain = {
                "config": "plain-topk1",
                "decode_rate": self.decode_rate_section("plain-topk1", 98.0),
            }
            # two repeats: a slow first tenth in one, a slow last one in both
            plain["decode_rate"]["points"][1]["tenths_tok_s"] = [
                [90.0, *[100.0] * 8, 80.0],
                [100.0, *[100.0] * 8, 90.0],
            ]
            records = self.merge(out_dir, plain, "rates")
            self.assertEqual([r["config"] for r in records], ["nospec", "plain-topk1"])
            self.assertNotIn("points", records[1])
            sweep.results.write_results(out_dir, records)
            summary = json.loads(Path(out_dir, "summary.json").read_text())
            self.assertEqual([p["config"] for p in summary["points"]], ["nospec"] * 2)
            self.assertEqual(summary["kv_capacity_tokens"], {"nospec": 1000})
            self.assertEqual(
                summary["decode_rate"][-1],
                {
                    "config": "plain-topk1",
                    "batch": 128,
                    "output_tok_s": 98.0 * 128,
                    "output_tok_s_min": 98.0 * 128 - 1,
                    "output_tok_s_max": 98.0 * 128 + 1,
                },
            )
            results = Path(out_dir, "results.md").read_text()
            self.assertIn("| config | batch 64 | batch 128 |", results)
            self.assertIn(
                "| plain-topk1 | 6272 [6271-6273], 0.980x (log 6174, 0.980x at "
                "nospec's KV tokens) "
                "| 12544 [12543-12545], 0.980x, edges 0.95x / 0.85x, "
                "middle eight 0.800x |",
                results,
            )
            self.assertIn(
                "| nospec | 6400 [6399-6401], 1.000x (log 6300) "
                "| 12800 [12799-12801], 1.000x, edges 1.00x / 1.00x |",
                results,
            )
            self.assertNotIn("| plain-topk1 | 1000 |", results)  # no sweep row
            self.assertIn("- plain-topk1 decode rate: `b` (rates)", results)
            self.assertIn("- nospec: `b` (sweep2)", results)

    def test_requests_in_flight_count_only_the_window(self):
        # In flight over [0, 5), [2, 6) and [7, 9); the window is [1, 5).
        results = [
            sweep.client.RequestResult(0.1, latency, 4, 0, 0, finished_at)
            for latency, finished_at in ((5.0, 5.0), (4.0, 6.0), (2.0, 9.0))
        ]
        self.assertAlmostEqual(sweep.loops.requests_in_flight(results, 1.0, 5.0), 1.75)

    def test_a_steady_loop_varies_lengths_and_reports_a_client_that_stalled(self):
        step, output_len, concurrency, stall = 0.05, 4, 4, 0.3
        began = time.perf_counter()
        stalled, lengths = [], []

        async def one_request(session, url, prompt, output_len, timeline):
            lengths.append(output_len)
            start = time.perf_counter()
            await asyncio.sleep(step * output_len)
            end = time.perf_counter()
            timeline.append((end, output_len))
            if not stalled and end - began > 1.0:
                stalled.append(end)
                time.sleep(stall)  # the event loop runs nothing meanwhile
            return sweep.client.RequestResult(step, end - start, output_len, 0, 0, end)

        prompts = sweep.client.PromptSource(input_len=4)
        with mock.patch.object(sweep.loops, "one_request", one_request):
            run = asyncio.run(
                sweep.loops.steady_loop(
                    "u", prompts, output_len, concurrency, 2.0, length_spread=0.5
                )
            )
        later = set(lengths[concurrency:])
        self.assertTrue(later <= {2, 3, 4, 5, 6} and len(later) > 1, later)
        self.assertEqual(len(stalled), 1)
        self.assertGreater(run.loop_lag_max, stall - 0.05)
        point = sweep.stats.summarize([run])
        self.assertGreater(point["client_loop_lag_max_ms"], 1000 * (stall - 0.05))

    def test_output_lengths_spread_about_the_output_len(self):
        fixed = itertools.islice(sweep.loops.output_lengths(128, 0.0), 100)
        self.assertEqual(set(fixed), {128})
        spread = list(itertools.islice(sweep.loops.output_lengths(128, 0.25), 2000))
        self.assertGreaterEqual(min(spread), 96)
        self.assertLessEqual(max(spread), 160)
        self.assertAlmostEqual(statistics.fmean(spread), 128, delta=2)
        self.assertGreater(len(set(spread)), 50)

        self.assertEqual(sweep_args().output_len_spread, 0.0)
        self.assertEqual(
            sweep_args("--steady", "--output-len-spread", "0.25").output_len_spread,
            0.25,
        )
        for flags in (
            ["--steady", "--output-len-spread", "1"],
            ["--output-len-spread", "0.25"],
        ):
            with self.assertRaises(SystemExit), contextlib.redirect_stderr(
                io.StringIO()
            ):
                sweep_args(*flags)

    def streaming_server(self, token_seconds: Callable[[int], float]):
        """one_request of a stand-in server that streams each token of a request
        token_seconds(requests in flight) after the one before, and the output
        lengths it was asked for."""
        lengths, in_flight = [], [0]

        async def one_request(session, url, prompt, output_len, timeline):
            lengths.append(output_len)
            in_flight[0] += 1
            start = time.perf_counter()
            for tokens in range(1, output_len + 1):
                await asyncio.sleep(token_seconds(in_flight[0]))
                timeline.append((time.perf_counter(), tokens))
            in_flight[0] -= 1
            end = time.perf_counter()
            return sweep.client.RequestResult(0.0, end - start, output_len, 0, 0, end)

        return one_request, lengths

    def run_steady_loop(self, one_request, output_len: int, concurrency: int):
        prompts = sweep.client.PromptSource(input_len=4)
        with mock.patch.object(sweep.loops, "one_request", one_request):
            return asyncio.run(
                sweep.loops.steady_loop("u", prompts, output_len, concurrency, 2.0)
            )

    def test_a_steady_loop_spreads_its_requests_instead_of_running_in_waves(self):
        # A stand-in server decoding every request at one token per `step` seconds.
        # Steps long enough that the host's scheduling jitter (tens of ms on a
        # loaded 2-core CI machine) stays well under the gaps compared below.
        step, output_len, concurrency = 0.05, 8, 4
        one_request, lengths = self.streaming_server(lambda in_flight: step)
        run = self.run_steady_loop(one_request, output_len, concurrency)
        self.assertEqual(sorted(lengths[:concurrency]), [2, 4, 6, 8])
        self.assertTrue(all(r.output_tokens == output_len for r in run.results))
        # Each client delivers a token per step; waves would deliver the same rate.
        self.assertAlmostEqual(run.tokens / run.wall, concurrency / step, delta=12)
        # A wave would finish all four together, every 8 steps; spread out, one
        # finishes about every 2.
        finishes = sorted(r.finished_at for r in run.results)
        gaps = [b - a for a, b in zip(finishes, finishes[1:])]
        self.assertGreater(len(finishes), 12)
        self.assertLess(max(gaps), 5 * step)
        self.assertAlmostEqual(run.in_flight, concurrency, delta=0.3)
        self.assertLess(run.loop_lag_max, step)
        self.assertLess(run.quiet_share, 0.25)

    def test_a_steady_loop_counts_the_tokens_streamed_inside_its_window(self):
        # A stand-in server whose requests each stream a token every
        # step * (requests in flight) ** 2 seconds: 1 / (step * C) tokens per second in
        # all at C. Once the window closes, the clients send nothing more and the
        # requests still in flight speed up; spreading their tokens evenly over their
        # lifetimes would count part of that faster tail inside the window (+9% here).
        step, output_len, concurrency = 0.0025, 40, 4
        one_request, _ = self.streaming_server(lambda in_flight: step * in_flight**2)
        run = self.run_steady_loop(one_request, output_len, concurrency)
        # A loaded host's late wake-ups lower the rate; only an overcount raises it.
        steady_rate = 1 / (step * concurrency)
        self.assertLess(run.tokens / run.wall, 1.03 * steady_rate)
        self.assertGreater(run.tokens / run.wall, 0.85 * steady_rate)

    def test_the_quiet_share_is_the_time_a_window_streamed_almost_nothing(self):
        # Four requests streaming a token every 10 ms over [0, 4) s, but for a
        # server silent over [1, 2) (a wave's prefill).
        def streamed(silent: Callable[[float], bool]):
            moments = [t / 100 for t in range(400)]
            heard = [t for t in moments if not silent(t)]
            return [[(t, n) for n, t in enumerate(heard, 1)] for _ in range(4)]

        steady = streamed(lambda t: False)
        waves = streamed(lambda t: 1 <= t < 2)
        self.assertEqual(sweep.stats.quiet_share(steady, 0.0, 4.0), 0.0)
        self.assertAlmostEqual(sweep.stats.quiet_share(waves, 0.0, 4.0), 1 / 4)
        # Only the window counts.
        self.assertAlmostEqual(sweep.stats.quiet_share(waves, 0.5, 3.5), 1 / 3)
        self.assertEqual(sweep.stats.quiet_share(waves, 2.0, 4.0), 0.0)
        # A window in which nothing streamed was quiet all along.
        self.assertEqual(sweep.stats.quiet_share(waves, 1.0, 2.0), 1.0)

    def test_percentiles_are_interpolated_as_numpy_and_bench_serving_do(self):
        self.assertEqual(sweep.stats.percentile([2, 1], 0.5), 1.5)
        self.assertAlmostEqual(sweep.stats.percentile(list(range(1, 101)), 0.99), 99.01)
        self.assertEqual(sweep.stats.percentile([7], 0.99), 7)

    def test_a_repeated_ramp_reports_medians_and_the_spread_of_its_total(self):
        # Phases 1 -> 4 -> 1 of 1 s; run k finishes 10k / 20k / 30k tokens in them.
        scales = iter([1, 3, 2])

        async def ramp_loop(url, prompts, output_len, phases, phase_seconds):
            k = next(scales)
            results = [
                sweep.client.RequestResult(0.1, 0.2, tokens * k, 0, 0, finished_at)
                for tokens, finished_at in ((10, 0.5), (20, 1.5), (30, 2.5))
            ]
            return results, [0.0, 1.0, 2.0, 3.0]

        args = argparse.Namespace(
            url="u", ramp=[1, 4], repeats=3, output_len=8, ramp_phase_seconds=1.0
        )
        config = sweep.configs.KNOWN_CONFIGS["nospec"]
        with mock.patch.multiple(
            sweep.workloads,
            ramp_loop=ramp_loop,
            server_state=lambda url: {},
            spec_step_share=lambda config, before, after: 0.0,
            tqdm=lambda items, desc: items,
        ):
            ramp = sweep.workloads.run_ramp(args, config, prompts=None)
        self.assertEqual(
            (ramp["output_tok_s"], ramp["output_tok_s_min"], ramp["output_tok_s_max"]),
            (40.0, 20.0, 60.0),
        )
        self.assertEqual(
            [(p["concurrency"], p["output_tok_s"]) for p in ramp["phases"]],
            [(1, 20.0), (4, 40.0), (1, 60.0)],
        )
        self.assertIn(
            " | 40 [20-60] | ",
            sweep.tables.markdown_table(
                [{**self.record("nospec", 100.0), "ramp": ramp}]
            ),
        )

    def test_the_benchmark_generates_its_pair_in_a_child_process_once(self):
        with tempfile.TemporaryDirectory() as root, mock.patch.dict(
            os.environ, {"SGLANG_SYNTHETIC_MODELS_DIR": root}
        ):
            with mock.patch(
                "sglang.test.synthetic_spec_models.generate",
                side_effect=AssertionError("generated in the benchmark's process"),
            ):
                pair = sweep.cli.generated_pair("tiny", 0.8)
            for path in pair:
                self.assertTrue(os.path.isfile(os.path.join(path, "config.json")))
            self.assertEqual(pair, synthetic_pair("tiny", 0.8))
            with mock.patch.object(
                sweep.cli.concurrent.futures,
                "ProcessPoolExecutor",
                side_effect=AssertionError("a child process for a generated pair"),
            ):
                self.assertEqual(sweep.cli.generated_pair("tiny", 0.8), pair)

    def test_the_recorded_commit_says_when_the_code_that_ran_is_not_heads(self):
        # The repository of the benchmark, wherever it is run from.
        with tempfile.TemporaryDirectory() as repo, contextlib.chdir(
            repo
        ), mock.patch.object(sweep.results, "REPO_ROOT", repo):
            git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
            subprocess.run(git + ["init", "-q"], check=True)
            Path("bench.py").write_text("a")
            subprocess.run(git + ["add", "bench.py"], check=True)
            subprocess.run(git + ["commit", "-qm", "a"], check=True)
            head = sweep.results.git_commit()
            Path("bench.py").write_text("b")
            self.assertRegex(head, "^[0-9a-f]{40}$")
            self.assertEqual(sweep.results.git_commit(), head + "-dirty")

    def test_records_of_repeated_prompts_are_named(self):
        old, new = self.record("nospec", 100.0), self.record("eagle3-topk1", 90.0)
        new["unique_prompts"] = True
        table = sweep.tables.markdown_table([old, new])
        self.assertIn("in flight at C=128 and 256: nospec. Their", table)
        self.assertNotIn("repeated prompts", sweep.tables.markdown_table([new]))

    def test_server_args_as_flags(self):
        flags = cli_args(dict(page_size=16, enable_metrics=True, a=False, b=None))
        self.assertEqual(flags, ["--page-size", "16", "--enable-metrics"])

    def test_config_server_flags(self):
        configs = sweep.configs.build_configs(disable_threshold=16)
        # without the ramp, whose largest load would size the servers
        args = sweep_args("--tp-size", "2", "--concurrency", "1,64", ramp=[])
        flags = " ".join(
            sweep.server.config_server_args(args, configs["loadaware-topk4"], "/d")
        )
        self.assertIn("--tp-size 2 --cuda-graph-max-bs 64 ", flags)
        self.assertIn("--max-running-requests 65 ", flags)
        # the ramp and the content shift run on the same servers
        for load in (dict(ramp=[1, 128]), dict(content_shift=96)):
            sized = argparse.Namespace(**{**vars(args), **load})
            top = max(load.get("ramp", [load.get("content_shift")]))
            self.assertIn(
                f"--cuda-graph-max-bs {top} ",
                " ".join(
                    sweep.server.config_server_args(sized, configs["nospec"], "/d")
                ),
            )
        self.assertIn("--enable-metrics --stream-interval 1", flags)
        self.assertNotIn("--skip-tokenizer-init", flags)
        args.stream_interval = 8
        nospec = " ".join(
            sweep.server.config_server_args(args, configs["nospec"], "/d")
        )
        self.assertIn("--stream-interval 8", nospec)
        self.assertIn(
            "--speculative-algorithm EAGLE3 --speculative-draft-model-path /d "
            "--speculative-num-steps 2 --speculative-eagle-topk 4 "
            "--speculative-num-draft-tokens 16 "
            "--speculative-disable-batch-threshold 16",
            flags,
        )
        kv_only = configs["loadaware-topk1"]
        full = configs["loadaware-topk1-full-catch-up"]
        self.assertEqual(full.env, {"SGLANG_LOAD_AWARE_FULL_DRAFT_CATCH_UP": "1"})
        same = ("spec", "extra_args", "always_on")
        self.assertEqual(
            [getattr(full, f) for f in same], [getattr(kv_only, f) for f in same]
        )
        per_config = sweep.configs.build_configs(16, {"loadaware-topk1": 48})
        self.assertIn(
            "--speculative-disable-batch-threshold 48",
            " ".join(
                sweep.server.config_server_args(
                    args, per_config["loadaware-topk1"], "/d"
                )
            ),
        )
        adaptive = configs["loadaware-adaptive-topk1"]
        self.assertEqual(adaptive.always_on, "adaptive-topk1")
        self.assertEqual(
            adaptive.extra_args,
            ["--speculative-disable-batch-threshold", "16", "--speculative-adaptive"],
        )
        nospec = sweep.server.config_server_args(args, configs["nospec"], "/d")
        self.assertFalse(any(f.startswith("--speculative") for f in nospec))

    def test_the_configs_of_0_5_17(self):
        configs = sweep.configs.build_configs(disable_threshold=16)
        self.assertEqual(
            list(configs),
            [
                "nospec",
                "eagle3-topk1",
                "eagle3-topk4",
                "loadaware-topk1",
                "loadaware-topk1-full-catch-up",
                "loadaware-topk4",
                "auto-topk1",
                "auto-topk4",
                "plain-topk1",
                "plain-topk4",
                "adaptive-topk1",
                "loadaware-adaptive-topk1",
                "auto-adaptive-topk1",
                "upstream-adaptive-topk1",
                "upstream-steps0-topk1",
                "upstream-steps0-no-extend-topk1",
            ],
        )
        self.assertFalse(
            any("SGLANG_ENABLE_SPEC_V2" in c.env for c in configs.values())
        )
        # No threshold at all for auto, chain, tree and with adaptive.
        self.assertIn(
            "--speculative-adaptive", configs["auto-adaptive-topk1"].extra_args
        )
        for name in ("auto-topk1", "auto-topk4", "auto-adaptive-topk1"):
            self.assertTrue(configs[name].auto)
            flags = configs[name].extra_args
            self.assertEqual(
                flags[flags.index("--speculative-disable-batch-threshold") + 1], "auto"
            )
            self.assertEqual(
                sweep.targets.disable_threshold_of({"server_args": flags}), 1
            )
        # Plain steps from batch 2 whatever --disable-threshold says, chain and tree.
        for name, spec in [
            ("plain-topk1", EAGLE3_CHAIN),
            ("plain-topk4", EAGLE3_TREE),
        ]:
            plain = configs[name]
            self.assertEqual(plain.spec, spec)
            self.assertEqual(
                plain.extra_args, ["--speculative-disable-batch-threshold", "2"]
            )
            self.assertEqual(plain.always_on, f"eagle3-{name[len('plain-'):]}")
        self.assertEqual(
            [n for n, c in configs.items() if c.pristine],
            [
                "upstream-adaptive-topk1",
                "upstream-steps0-topk1",
                "upstream-steps0-no-extend-topk1",
            ],
        )
        steps0, no_extend = (
            configs["upstream-steps0-topk1"],
            configs["upstream-steps0-no-extend-topk1"],
        )
        self.assertEqual(
            (no_extend.spec, no_extend.extra_args, no_extend.adaptive_config),
            (steps0.spec, steps0.extra_args, steps0.adaptive_config),
        )
        self.assertEqual(
            no_extend.env, {"SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND": "1"}
        )
        upstream, fork = configs["upstream-adaptive-topk1"], configs["adaptive-topk1"]
        self.assertEqual(
            (upstream.spec, upstream.extra_args, upstream.adaptive_config),
            (fork.spec, ["--speculative-adaptive"], None),
        )
        self.assertFalse(fork.pristine)
        # Every adaptive config launches at the default config's largest candidate
        # (pristine 0.5.17 crashes capturing one above its launch step count).
        largest = max(resolve_candidate_steps_from_config(None))
        for name in ("loadaware-adaptive-topk1", "auto-adaptive-topk1"):
            self.assertEqual(configs[name].spec, fork.spec)
        self.assertEqual(
            fork.spec, dict(num_steps=largest, topk=1, num_draft_tokens=largest + 1)
        )

    def test_upstream_steps0_runs_steps_0_at_every_batch(self):
        from sglang.srt.arg_groups.speculative_hook import (
            _init_adaptive_speculative_params,
        )
        from sglang.srt.speculative.adaptive_spec_params import (
            AdaptiveSpeculativeParams,
        )

        config = sweep.configs.KNOWN_CONFIGS["upstream-steps0-topk1"]
        args = sweep_args("--concurrency", "1,256")
        flags = sweep.server.config_server_args(args, config, "/d")
        joined = " ".join(flags)
        self.assertIn(
            "--speculative-num-steps 0 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 1 --speculative-adaptive "
            "--speculative-adaptive-config ",
            joined,
        )
        path = flags[flags.index("--speculative-adaptive-config") + 1]
        self.assertEqual(
            json.loads(Path(path).read_text()), {"1": {"candidate_steps": [0]}}
        )
        # What 0.5.17 makes of it: steps 0 at every batch, even after its updates.
        params = AdaptiveSpeculativeParams(initial_steps=0, cfg_path=path)
        params.set_cuda_graph_bs([1, 2, 4, 8, 64, 256])
        for bs in (1, 3, 8, 64, 200, 256, 512):
            for _ in range(50):
                params.on_verify_complete([0] * bs, batch_size=bs)
            self.assertEqual(params.get_steps_for_batch(bs), 0)
        # It starts at the --speculative-num-steps given, which must be a candidate.
        server_args = argparse.Namespace(
            speculative_adaptive_config=path,
            speculative_eagle_topk=1,
            speculative_num_steps=0,
            speculative_num_draft_tokens=None,
        )
        _init_adaptive_speculative_params(server_args)
        self.assertEqual(server_args.speculative_num_draft_tokens, 1)
        server_args.speculative_num_steps = 3  # the chain's
        with self.assertRaisesRegex(ValueError, "not in the adaptive config"):
            _init_adaptive_speculative_params(server_args)

    def fake_pristine(self, root: str, wheel: str) -> str:
        """A tools/fork extraction of wheel under root; returns its directory."""
        extraction = Path(root, sweep.configs.PRISTINE_DIR, wheel[-12:])
        (extraction / "sglang").mkdir(parents=True)
        (extraction / "sglang" / "__init__.py").write_text("")
        (extraction / ".complete").write_text(wheel + "\n")
        return str(extraction)

    def test_pristine_upstream_is_found_from_the_repo_root(self):
        ours = f"cp{sys.version_info.major}{sys.version_info.minor}"
        with tempfile.TemporaryDirectory() as root:
            with self.assertRaisesRegex(SystemExit, "found none.*tools/fork sync"):
                sweep.configs.pristine_upstream(root)
            other = self.fake_pristine(root, "sglang-0.5.17-cp399-cp399-x.whl")
            self.assertEqual(
                sweep.configs.pristine_upstream(root),
                {"pythonpath": other, "wheel": "sglang-0.5.17-cp399-cp399-x.whl"},
            )
            wheel = f"sglang-0.5.17-{ours}-{ours}-x.whl"
            mine = self.fake_pristine(root, wheel)
            self.assertEqual(sweep.configs.pristine_upstream(root)["pythonpath"], mine)
            os.remove(os.path.join(mine, "sglang", "__init__.py"))  # incomplete
            self.assertEqual(sweep.configs.pristine_upstream(root)["pythonpath"], other)
        self.assertTrue(
            Path(sweep.configs.REPO_ROOT, "benchmark", "dynamic_spec").is_dir()
        )

    def test_a_pristine_server_imports_pristine_upstream(self):
        configs = sweep.configs.KNOWN_CONFIGS
        args = argparse.Namespace(attention_backend="triton")
        with tempfile.TemporaryDirectory() as root:
            wheel = "sglang-0.5.17-cp311-cp311-x.whl"
            tree = self.fake_pristine(root, wheel)
            pristine = {"pythonpath": tree, "wheel": wheel}
            with mock.patch.object(
                sweep.server, "pristine_upstream", lambda: pristine
            ), mock.patch.dict(os.environ, {"PYTHONPATH": "/elsewhere"}):
                upstream = configs["upstream-adaptive-topk1"]
                env = sweep.server.server_env(args, upstream)
                self.assertEqual(env["PYTHONPATH"], tree + os.pathsep + "/elsewhere")
                code = sweep.server.code_that_runs(upstream, env)
                self.assertEqual(
                    code,
                    {
                        "sglang": "pristine upstream",
                        "origin": os.path.join(tree, "sglang", "__init__.py"),
                        "wheel": wheel,
                    },
                )
                fork_env = sweep.server.server_env(args, configs["adaptive-topk1"])
                self.assertNotIn("PYTHONPATH", fork_env)
                fork = sweep.server.code_that_runs(configs["adaptive-topk1"], fork_env)
                self.assertEqual(fork["sglang"], "fork")
                self.assertFalse(fork["origin"].startswith(tree))
                # A PYTHONPATH that does not reach the pristine tree is refused.
                with self.assertRaisesRegex(RuntimeError, "not from pristine upstream"):
                    sweep.server.code_that_runs(upstream, fork_env)

    def test_a_launch_records_the_code_that_ran(self):
        launched = []

        @contextlib.contextmanager
        def running_server(target, server_args, env, base_url, log_path):
            launched.append(env)
            yield base_url, mock.Mock(pid=7)

        code = {"sglang": "pristine upstream", "origin": "/p/sglang/__init__.py"}
        args = sweep_args("--concurrency", "1,8", "--url", "u")
        config = sweep.configs.KNOWN_CONFIGS["upstream-steps0-topk1"]
        with mock.patch.multiple(
            sweep.server,
            running_server=running_server,
            wait_gpu_idle=lambda: None,
            warm_up=lambda *a: None,
            server_env=lambda args, config: {"PYTHONPATH": "/p"},
            code_that_runs=lambda config, env: code,
        ):
            with sweep.server.serving(args, config, "/t", "/d", None, [1]) as server:
                pass
        self.assertEqual(server.front_end_pid, 7)
        launch = server.record
        self.assertEqual(launched, [{"PYTHONPATH": "/p"}])
        self.assertEqual(launch["code"], code)
        self.assertEqual(launch["env"], {"PYTHONPATH": "/p"})
        self.assertEqual(launch["adaptive_config"], {"1": {"candidate_steps": [0]}})
        self.assertIn("--speculative-adaptive-config", launch["server_args"])
        record = {**self.record("upstream-steps0-topk1", 1.0), **self.header("abc")}
        record["code"] = {**code, "wheel": "sglang-0.5.17-x.whl"}
        self.assertIn(
            "(abc; the server ran pristine upstream, sglang-0.5.17-x.whl)",
            sweep.tables.results_markdown([record], "t"),
        )

    def test_auto_servers_trace_their_steps_beside_their_log_unless_told_not_to(self):
        launched = []

        @contextlib.contextmanager
        def running_server(target, server_args, env, base_url, log_path):
            launched.append(env)
            yield base_url, mock.Mock(pid=7)

        args = sweep_args("--concurrency", "1", "--url", "u")
        with tempfile.TemporaryDirectory() as logs, mock.patch.multiple(
            sweep.server,
            running_server=running_server,
            wait_gpu_idle=lambda: None,
            warm_up=lambda *a: None,
        ):
            trace = os.path.join(logs, "auto-topk1-steps.jsonl")
            with open(trace, "w") as f:
                f.write("{}\n")  # an earlier run's: the server appends
            for name in ("auto-topk1", "loadaware-topk1"):
                config = sweep.configs.KNOWN_CONFIGS[name]
                log = os.path.join(logs, f"{name}.log")
                with sweep.server.serving(args, config, "/t", "/d", None, [1], log):
                    pass
            self.assertFalse(os.path.exists(trace))
            args.step_trace = False  # --no-step-trace
            config = sweep.configs.KNOWN_CONFIGS["auto-topk1"]
            log = os.path.join(logs, "auto-topk1.log")
            with sweep.server.serving(args, config, "/t", "/d", None, [1], log):
                pass
        self.assertEqual(launched[0]["SGLANG_LOAD_AWARE_STEP_TRACE"], trace)
        self.assertNotIn("SGLANG_LOAD_AWARE_STEP_TRACE", launched[1])
        self.assertNotIn("SGLANG_LOAD_AWARE_STEP_TRACE", launched[2])

    def test_records_of_configs_that_no_longer_exist_still_render(self):
        with tempfile.TemporaryDirectory() as out_dir:
            self.merge(out_dir, self.record("loadaware-topk4-v1", 90.0))
            records = self.merge(out_dir, self.record("nospec", 100.0))
            self.assertEqual(
                [r["config"] for r in records], ["nospec", "loadaware-topk4-v1"]
            )
            sweep.results.write_results(out_dir, records)
            self.assertIn(
                "| loadaware-topk4-v1 | 1000 |", Path(out_dir, "results.md").read_text()
            )

    def test_servers_fit_the_largest_decode_rate_batch(self):
        args = sweep_args("--concurrency", "1,64", "--decode-rate", "128,256")
        nospec = sweep.configs.KNOWN_CONFIGS["nospec"]
        flags = " ".join(sweep.server.config_server_args(args, nospec, "/d"))
        self.assertIn("--cuda-graph-max-bs 256 --max-running-requests 257 ", flags)

    def test_decode_rate_runs_instead_of_the_sweep(self):
        ran = []

        def runner(kind):
            def run(args, config, target, draft, log_dir, save):
                ran.append((kind, config.name, args.decode_rate))

            return run

        with tempfile.TemporaryDirectory() as out_dir, contextlib.ExitStack() as stack:
            argv = ["bench_sweep.py", "--out-dir", out_dir, "--results-date", "d"]
            argv += ["--configs", "nospec,plain-topk1", "--decode-rate", "64,128"]
            for name, value in [
                ("generated_pair", lambda *_: ("/t", "/d")),
                ("describe_run", lambda model: self.header("abc")),
                ("run_config", runner("sweep")),
                ("run_decode_rate", runner("decode rate")),
            ]:
                stack.enter_context(mock.patch.object(sweep.cli, name, value))
            stack.enter_context(mock.patch.object(sys, "argv", argv))
            sweep.cli.main()
        self.assertEqual(
            ran,
            [
                ("decode rate", "nospec", [64, 128]),
                ("decode rate", "plain-topk1", [64, 128]),
            ],
        )

    def bench_serving_args(self, url: str = "http://127.0.0.1:1") -> argparse.Namespace:
        return argparse.Namespace(
            url=url,
            input_len=16,
            output_len=8,
            min_requests=4,
            requests_per_concurrency=2,
            repeats=1,
            output_len_spread=0.0,
            min_point_seconds=2.0,
        )

    def test_bench_serving_runs_for_about_a_points_time(self):
        args = self.bench_serving_args()  # 8 output tokens
        prompts = sweep.bench_serving.bench_serving_prompts
        # One closed loop of C=2 (4 requests) takes longer than 2 s at 8 tok/s.
        self.assertEqual(prompts(args, 2, 8.0, 2.0), 4)
        # At 100 tok/s, 12.5 requests finish per second.
        self.assertEqual(prompts(args, 2, 100.0, 2.0), 25)

    def random_ids_command(self, args: argparse.Namespace) -> List[str]:
        return sweep.bench_serving.bench_serving_command(
            args,
            "/models/t",
            8,
            32,
            "/o.jsonl",
            sweep.bench_serving.random_ids_workload(args),
        )

    def test_bench_serving_gets_our_workload_offline(self):
        args = self.bench_serving_args()
        command = self.random_ids_command(args)
        self.assertEqual(
            command[:3], [sys.executable, "-m", "sglang.benchmark.serving"]
        )
        flags = dict(zip(command[3::2], command[4::2]))
        self.assertEqual(
            {
                k: flags[k]
                for k in ("--backend", "--base-url", "--model", "--tokenizer")
            },
            {
                "--backend": "sglang",
                "--base-url": "http://127.0.0.1:1",
                "--model": "/models/t",
                "--tokenizer": "/models/tokenizer",
            },
        )
        # random-ids, not random: "random" downloads ShareGPT to sample from.
        self.assertEqual(command[command.index("--dataset-name") + 1], "random-ids")
        self.assertNotIn("--dataset-path", command)
        self.assertIn("--tokenize-prompt", command)
        self.assertIn("--flush-cache", command)
        self.assertNotIn("--disable-ignore-eos", command)
        for flag, value in [
            ("--random-input-len", "16"),
            ("--random-output-len", "8"),
            ("--random-range-ratio", "1.0"),  # exactly those lengths
            ("--num-prompts", "32"),
            ("--max-concurrency", "8"),
            ("--output-file", "/o.jsonl"),
        ]:
            self.assertEqual(command[command.index(flag) + 1], value, flag)
        # --output-len-spread S: bench_serving's one ratio spreads prompts and outputs
        # alike, both around their means by S.
        args.output_len_spread = 0.5
        spread = self.random_ids_command(args)
        lengths = {
            flag: float(spread[spread.index(flag) + 1])
            for flag in (
                "--random-input-len",
                "--random-output-len",
                "--random-range-ratio",
            )
        }
        self.assertEqual(lengths["--random-input-len"], 24)
        self.assertEqual(lengths["--random-output-len"], 12)
        self.assertAlmostEqual(lengths["--random-range-ratio"] * 24, 8, places=4)
        self.assertEqual(
            sweep.bench_serving.OFFLINE_ENV,
            {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        )
        # Its client counts and times only streamed text: servers keep their
        # tokenizer, and with it or without, run the same front end.
        server = sweep_args("--concurrency", "8")
        nospec = sweep.configs.KNOWN_CONFIGS["nospec"]
        without = sweep.server.config_server_args(server, nospec, "/d")
        server.bench_serving = [8]
        self.assertEqual(sweep.server.config_server_args(server, nospec, "/d"), without)
        self.assertNotIn("--skip-tokenizer-init", without)

    def test_a_results_dir_holds_one_front_end_and_workload(self):
        args = argparse.Namespace(
            input_len=512, output_len=128, steady=True, output_len_spread=0.0
        )
        workload = sweep.workloads.sweep_workload(args)
        spread = {**workload, "output_len_spread": 0.5}
        flags = ["--enable-metrics", "--stream-interval", "1"]
        header = {"model": "tiny", "gpu": "g", "commit": "c", "command": "x"}
        with tempfile.TemporaryDirectory() as out_dir:
            incomparable = sweep.records.incomparable_records
            self.assertEqual(incomparable(out_dir, flags, workload), [])
            for name, server_args, record_workload in [
                # Before --stream-interval was passed, and before workloads were kept.
                ("nospec", ["--enable-metrics"], None),
                ("eagle3-topk1", ["--skip-tokenizer-init", "--enable-metrics"], None),
                ("auto-topk1", ["--enable-metrics", "--stream-interval", "8"], None),
                ("loadaware-topk1", flags, workload),
                ("eagle3-topk4", flags, spread),
            ]:
                record = {"config": name, "server_args": server_args, "points": []}
                if record_workload is not None:
                    record["workload"] = record_workload
                sweep.records.merge_record(out_dir, record, header)
            decode_rate = {"server_args": ["--stream-interval", "4"], "points": []}
            sweep.records.merge_record(
                out_dir, {"config": "plain-topk1", "decode_rate": decode_rate}, header
            )
            other_front_ends = ["auto-topk1", "eagle3-topk1", "plain-topk1"]
            self.assertEqual(
                incomparable(out_dir, flags, workload),
                sorted([*other_front_ends, "eagle3-topk4"]),
            )
            self.assertEqual(
                incomparable(out_dir, flags, spread),
                sorted([*other_front_ends, "loadaware-topk1"]),
            )
            # A decode-rate run sends no sweep workload: only front ends count.
            self.assertEqual(incomparable(out_dir, flags, None), other_front_ends)
            with self.assertRaisesRegex(SystemExit, "auto-topk1, eagle3-topk1"):
                sweep.cli.refuse_incomparable_records(out_dir, flags, None)

    def test_bench_serving_results_come_from_its_output_file(self):
        runs = [
            {
                "completed": 4,
                "output_throughput": r,
                "median_ttft_ms": t,
                "median_tpot_ms": 2.0,
            }
            for r, t in ((300.0, 9.0), (100.0, 7.0), (200.0, 8.0))
        ]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "o.jsonl")
            path.write_text("".join(json.dumps(r) + "\n" for r in runs))
            self.assertEqual(
                sweep.bench_serving.bench_serving_result(str(path), 4),
                {
                    "num_requests": 12,
                    "output_tok_s": 200.0,
                    "output_tok_s_min": 100.0,
                    "output_tok_s_max": 300.0,
                    "ttft_p50_ms": 8.0,
                    "tpot_p50_ms": 2.0,
                },
            )
            with self.assertRaisesRegex(RuntimeError, r"completed \[4, 4, 4\] of 5"):
                sweep.bench_serving.bench_serving_result(str(path), 5)

    def bench_serving_stand_in(self, generated: List[dict], flushed: List[bool]):
        """Routes of a stand-in server that streams text as a server with its
        tokenizer does; it keeps the requests it got and its cache flushes."""

        async def generate(request):
            body = await request.json()
            generated.append(body)
            response = web.StreamResponse()
            await response.prepare(request)
            n = body["sampling_params"]["max_new_tokens"]
            for i in range(1, n + 1):
                chunk = {
                    "text": " ".join(["w5"] * i),
                    "meta_info": {"completion_tokens": i},
                }
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(0.002)
            await response.write(b"data: [DONE]\n\n")
            return response

        async def flush(request):
            flushed.append(True)
            return web.Response(text="ok")

        async def models(request):
            return web.json_response({"data": [{"id": "m"}]})

        async def info(request):
            return web.json_response({})

        return [
            web.post("/generate", generate),
            web.post("/flush_cache", flush),
            web.get("/v1/models", models),
            web.get("/server_info", info),
        ]

    def test_bench_serving_runs_against_the_server_offline(self):
        """The real bench_serving of this sglang, against a stand-in server."""
        generated, flushed = [], []
        routes = self.bench_serving_stand_in(generated, flushed)
        with tempfile.TemporaryDirectory() as root, mock.patch.dict(
            os.environ, {"SGLANG_SYNTHETIC_MODELS_DIR": root}
        ):
            target, _ = synthetic_pair("tiny", 0.8)

            async def load(url):
                args = self.bench_serving_args(url)
                point = {"concurrency": 2, "output_tok_s": 8.0}
                return await asyncio.to_thread(
                    sweep.bench_serving.run_bench_serving,
                    args,
                    "nospec",
                    target,
                    point,
                    root,
                )

            result = self.against_server(None, load, routes)
            self.assertTrue(Path(root, "nospec-bench-serving.log").is_file())
        self.assertEqual(result["num_requests"], 4)
        self.assertGreater(result["output_tok_s"], 0)
        self.assertGreater(result["ttft_p50_ms"], 0)
        self.assertEqual(flushed, [True])
        self.assertEqual(len(generated), 5)  # its warm-up request, then 4
        measured = generated[1:]
        self.assertEqual({len(b["input_ids"]) for b in measured}, {16})
        self.assertEqual(
            {b["sampling_params"]["max_new_tokens"] for b in measured}, {8}
        )
        self.assertTrue(all(b["sampling_params"]["ignore_eos"] for b in measured))
        self.assertEqual(len({tuple(b["input_ids"]) for b in measured}), 4)

    def test_bench_serving_runs_the_content_shift_easy_then_hard(self):
        """The real bench_serving on the content shift: a run on prompts ending in
        the easy region's tokens, then one on the hard region's, sent as text that
        the pair's tokenizer reads back as those tokens, --repeats times."""
        generated, flushed = [], []
        routes = self.bench_serving_stand_in(generated, flushed)
        with tempfile.TemporaryDirectory() as root, mock.patch.dict(
            os.environ, {"SGLANG_SYNTHETIC_MODELS_DIR": root}
        ):
            target, _ = synthetic_pair("tiny", (0.95, 0.3))
            regions = load_spec(os.path.dirname(target))["region_tokens"]
            tokenizer = AutoTokenizer.from_pretrained(target)

            async def load(url):
                args = self.bench_serving_args(url)
                args.content_shift, args.repeats = 2, 2
                args.ramp_phase_seconds = 0.5
                # Ours read 8 and 100 tok/s: a closed loop's 4 prompts, then 7.
                ours = {"phases": [{"output_tok_s": 8.0}, {"output_tok_s": 100.0}]}
                return await asyncio.to_thread(
                    sweep.bench_serving.run_content_shift_bench_serving,
                    args,
                    "auto-topk1",
                    target,
                    root,
                    ours,
                )

            result = self.against_server(None, load, routes)
            phase_runs = [
                sweep.bench_serving.bench_serving_runs(
                    os.path.join(root, f"auto-topk1-bench-serving-shift-{name}.jsonl"),
                    num,
                )
                for name, num in (("easy", 4), ("hard", 7))
            ]
        # per repeat: a warm-up request and 4 easy ones, then one and 7 hard ones
        self.assertEqual(len(generated), 26)
        self.assertEqual(flushed, [True] * 4)
        last_tokens = []
        for body in generated:
            ids = tokenizer.encode(body["text"])
            self.assertEqual(len(ids), 16)
            self.assertEqual(body["sampling_params"]["max_new_tokens"], 8)
            self.assertTrue(body["sampling_params"]["ignore_eos"])
            last_tokens.append(ids[-1])
        for start in (0, 13):
            self.assertTrue(
                all(t in regions[0] for t in last_tokens[start : start + 5])
            )
            self.assertTrue(
                all(t in regions[1] for t in last_tokens[start + 5 : start + 13])
            )
        self.assertEqual(result["concurrency"], 2)
        self.assertEqual([p["prompts"] for p in result["phases"]], ["easy", "hard"])
        self.assertTrue(all(p["output_tok_s"] > 0 for p in result["phases"]))
        # Per repeat, both phases' tokens over both phases' durations: between that
        # repeat's phase rates (not between the phases' medians over the repeats).
        totals = []
        for runs in zip(*phase_runs):
            total = sum(r["total_output_tokens"] for r in runs) / sum(
                r["duration"] for r in runs
            )
            rates = [r["output_throughput"] for r in runs]
            self.assertLessEqual(min(rates) * 0.999, total)
            self.assertLessEqual(total, max(rates) * 1.001)
            totals.append(total)
        self.assertEqual(len(totals), 2)
        self.assertAlmostEqual(result["output_tok_s"], statistics.median(totals))
        self.assertEqual(result["output_tok_s_min"], min(totals))
        self.assertEqual(result["output_tok_s_max"], max(totals))

    def test_the_content_shift_runs_bench_serving_when_asked(self):
        shifts, saved = [], []

        def run_content_shift_bench_serving(args, server, target, log_dir, shift):
            shifts.append((server, dict(saved[-1]["content_shift"])))
            return {"output_tok_s": 2.0}

        patches = dict(
            run_content_shift=lambda args, config, target: {"output_tok_s": 1.0},
            run_content_shift_bench_serving=run_content_shift_bench_serving,
        )
        args = self.run_config_args(concurrency=[8], bench_serving=[1], content_shift=8)
        self.run_config_on_stand_ins(args, "auto-topk1", saved, **patches)
        # ours is saved before bench_serving runs: a call cut off keeps it
        self.assertEqual(shifts, [("auto-topk1", {"output_tok_s": 1.0})])
        self.assertEqual(
            saved[-1]["content_shift"],
            {"output_tok_s": 1.0, "bench_serving": {"output_tok_s": 2.0}},
        )
        args.bench_serving = None
        self.run_config_on_stand_ins(args, "auto-topk1", saved, **patches)
        self.assertEqual(len(shifts), 1)
        self.assertNotIn("bench_serving", saved[-1]["content_shift"])

    def test_bench_serving_is_recorded_beside_our_point(self):
        record = self.record("nospec", 100.0)
        record["points"][1]["bench_serving"] = {
            "output_tok_s": 760.0,
            "output_tok_s_min": 750.0,
            "output_tok_s_max": 770.0,
        }
        table = sweep.tables.bench_serving_table(
            [record, self.record("eagle3-topk1", 1)]
        )
        self.assertIn("| config | C=1 | C=8 |", table)
        self.assertIn("| nospec | - | 760 [750-770], 0.95x |", table)
        self.assertNotIn("eagle3-topk1", table)
        self.assertEqual(
            sweep.results.summary_point(record["points"][1])[
                "bench_serving_output_tok_s"
            ],
            760.0,
        )
        self.assertEqual(
            set(sweep.results.summary_point(record["points"][0])), SUMMARY_POINT_KEYS
        )

    def test_mean_latencies_are_tabled_where_recorded(self):
        record = self.record("nospec", 100.0)
        record["points"][1].update(ttft_mean_ms=51.4, latency_mean_ms=2812.6)
        table = sweep.tables.latency_table([record, self.record("eagle3-topk1", 1)])
        self.assertIn("| config | C=1 | C=8 |", table)
        self.assertIn("| nospec | - | 51 / 2813 |", table)
        self.assertNotIn("eagle3-topk1", table)

    def test_the_clients_pace_is_tabled_where_recorded(self):
        record = self.record("nospec", 100.0)
        record["points"][1].update(
            requests_in_flight=7.93, client_loop_lag_max_ms=171.6
        )
        record["points"][0].update(
            requests_in_flight=1.0,
            client_loop_lag_max_ms=12.0,
            quiet_share=0.57,
            front_end_cpu_share=0.934,
        )
        table = sweep.tables.client_pace_table([record, self.record("eagle3-topk1", 1)])
        self.assertIn("| nospec | 1.0 / 12 / 57% / 93% | 7.9 / 172 |", table)
        self.assertNotIn("eagle3-topk1", table)

    def test_bench_serving_runs_at_every_point_or_at_the_c_listed(self):
        at = sweep.bench_serving.bench_serving_at
        every = sweep_args("--bench-serving")
        self.assertTrue(at(every, 1) and at(every, 128))
        listed = sweep_args("--bench-serving", "16,128")
        self.assertEqual([c for c in (1, 16, 64, 128) if at(listed, c)], [16, 128])
        off = sweep_args()
        self.assertFalse(at(off, 16))
        self.assertFalse(sweep.bench_serving.bench_serving_enabled(off))
        for args in (every, listed):
            self.assertTrue(sweep.bench_serving.bench_serving_enabled(args))

    def run_config_on_stand_ins(
        self,
        args: argparse.Namespace,
        config: str,
        saved: List[dict],
        server: int = 0,
        **patches,
    ) -> None:
        """run_config of `config` in the server-th stand-in server with stand-in
        points and ramp (``patches`` replace more of sweep.runs); it appends to
        ``saved`` every record it saves."""

        @contextlib.contextmanager
        def serving(args, config, target, draft, prompts, warmup, log_path):
            Path(log_path).write_text("")
            yield sweep.server.Launched({"server_args": [], "env": {}}, 7)

        stand_ins = dict(
            serving=serving,
            server_state=lambda url: {"memory_usage": {"token_capacity": 9}},
            measure_point=lambda args, config, prompts, c, pid: {"concurrency": c},
            run_ramp=lambda args, config, prompts: {},
            tqdm=lambda items, desc: items,
        )
        with tempfile.TemporaryDirectory() as log_dir, mock.patch.multiple(
            sweep.runs, **{**stand_ins, **patches}
        ):
            config = sweep.configs.KNOWN_CONFIGS[config]
            sweep.runs.run_config(
                args, config, "/t", "/d", log_dir, saved.append, server
            )

    def run_config_args(self, **kwargs) -> argparse.Namespace:
        return argparse.Namespace(
            url="u",
            ramp=[1],
            input_len=4,
            output_len=2,
            steady=False,
            output_len_spread=0.0,
            **kwargs,
        )

    def test_a_point_runs_bench_serving_when_asked(self):
        calls, saved = [], []

        def run_bench_serving(args, server, target, point, log_dir):
            saved_points = [p["concurrency"] for p in saved[-1]["points"]]
            calls.append((server, target, point["concurrency"], saved_points))
            return {"output_tok_s": 1.0}

        args = self.run_config_args(
            concurrency=[1, 8], bench_serving=[8], content_shift=None
        )
        self.run_config_on_stand_ins(
            args, "nospec", saved, run_bench_serving=run_bench_serving
        )
        # the point is saved before bench_serving runs: a call cut off keeps it
        self.assertEqual(calls, [("nospec", "/t", 8, [1, 8])])
        self.assertEqual(
            saved[-1]["points"],
            [
                {"concurrency": 1},
                {"concurrency": 8, "bench_serving": {"output_tok_s": 1.0}},
            ],
        )
        # --servers: a later server's runs go to files of its own, as its log does
        self.run_config_on_stand_ins(
            args, "nospec", saved, server=1, run_bench_serving=run_bench_serving
        )
        self.assertEqual(calls[-1], ("nospec-server1", "/t", 8, [1, 8]))

    def test_per_config_thresholds_only_for_load_aware_configs(self):
        parser = argparse.ArgumentParser()
        sweep.cli.add_server_args(parser)
        args = parser.parse_args(
            [
                "--configs",
                "loadaware-topk1",
                "--disable-threshold-for",
                "loadaware-topk1=48",
            ]
        )
        self.assertEqual(args.disable_threshold_for, [("loadaware-topk1", 48)])
        (config,) = sweep.cli.selected_configs(args)
        self.assertEqual(sweep.results.model_name(args), "tiny-p0.8")
        args.tp_size = 8
        self.assertEqual(sweep.results.model_name(args), "tiny-p0.8-tp8")
        args.out_dir, args.results_date = "/r", "2026-11-29"
        self.assertEqual(sweep.results.results_dir(args), "/r/2026-11-29-tiny-p0.8-tp8")
        self.assertEqual(config.extra_args[-1], "48")
        args.disable_threshold_for = [("nospec", 48)]
        with self.assertRaises(SystemExit):
            sweep.cli.selected_configs(args)
        with self.assertRaises(argparse.ArgumentTypeError):
            sweep.cli.config_threshold("loadaware-topk1:48")

    def test_spec_step_share_from_policy_counts(self):
        configs = sweep.configs.build_configs(disable_threshold=8)
        before = {
            "load_aware_speculation": {"num_spec_steps": 10, "num_plain_steps": 5}
        }
        after = {
            "load_aware_speculation": {"num_spec_steps": 40, "num_plain_steps": 95}
        }
        share = sweep.server.spec_step_share(configs["loadaware-topk4"], before, after)
        self.assertAlmostEqual(share, 0.25)
        self.assertEqual(sweep.server.spec_step_share(configs["nospec"], {}, {}), 0.0)
        self.assertEqual(
            sweep.server.spec_step_share(configs["eagle3-topk4"], {}, {}), 1.0
        )
        # The adaptive tiers may run 0 draft steps: not counted, not shown.
        self.assertIsNone(
            sweep.server.spec_step_share(configs["adaptive-topk1"], {}, {})
        )
        point = {"output_tok_s": 702.0, "spec_step_share": None}
        self.assertEqual(sweep.tables.markdown_cell(point), "702")

    def record(self, name: str, speed: float, commit: str = "abc") -> dict:
        points = [
            dict(
                config=name,
                concurrency=c,
                output_tok_s=speed * c,
                tpot_p50_ms=10.0,
                tpot_p99_ms=12.0,
                ttft_p50_ms=30.0,
                accept_length=None if name == "nospec" else 2.5,
                spec_step_share=0.0 if name == "nospec" else 0.5,
                num_requests=16,
            )
            for c in (1, 8)
        ]
        ramp = {"config": name, "output_tok_s": speed * 4, "phases": []}
        server_args = ["--speculative-disable-batch-threshold", "8"]
        return dict(
            config=name,
            points=points,
            ramp=ramp,
            kv_capacity_tokens=1000,
            server_args=server_args if name.startswith("loadaware") else [],
        )

    def header(self, commit: str) -> dict:
        return {"model": "tiny-p0.8", "gpu": "none", "commit": commit, "command": "b"}

    def merge(self, out_dir: str, record: dict, commit: str = "abc") -> list:
        return sweep.records.merge_record(out_dir, record, self.header(commit))

    def test_a_saved_record_is_written_out_before_raw_json_is_unlocked(self):
        """Invocations on other GPUs merge into the same raw.json: the results
        written from one merge are not overtaken by another's."""
        import fcntl

        written = []

        def write(out_dir, records):
            with open(os.path.join(out_dir, "raw.lock"), "w") as lock:
                with self.assertRaises(BlockingIOError):
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            written.append([r["config"] for r in records])

        with tempfile.TemporaryDirectory() as out_dir:
            with mock.patch.object(sweep.results, "write_results", write):
                save = sweep.results.record_saver(out_dir, self.header("abc"))
                save(self.record("loadaware-topk4", 150.0))
                save(self.record("nospec", 100.0))
        self.assertEqual(written, [["loadaware-topk4"], ["nospec", "loadaware-topk4"]])

    def test_write_results_produces_summary_table_and_plot(self):
        with tempfile.TemporaryDirectory() as out_dir:
            self.merge(out_dir, self.record("loadaware-topk4", 150.0))
            sweep.results.write_results(
                out_dir, self.merge(out_dir, self.record("nospec", 100.0))
            )
            summary = json.loads(Path(out_dir, "summary.json").read_text())
            self.assertEqual(len(summary["points"]), 4)
            self.assertTrue(
                all(set(p) == SUMMARY_POINT_KEYS for p in summary["points"])
            )
            self.assertEqual(
                [r["config"] for r in summary["ramp"]], ["nospec", "loadaware-topk4"]
            )
            self.assertEqual(
                summary["kv_capacity_tokens"], {"nospec": 1000, "loadaware-topk4": 1000}
            )
            self.assertIn(
                "| loadaware-topk4 | 1000 | 600 | 150 (50% spec) | 1200 (50% spec) |",
                Path(out_dir, "results.md").read_text(),
            )
            self.assertGreater(os.path.getsize(Path(out_dir, "throughput.png")), 1000)

    def test_targets_compare_load_aware_with_the_static_configs(self):
        nospec, always_on = self.record("nospec", 100.0), self.record(
            "eagle3-topk4", 90.0
        )
        load_aware = self.record("loadaware-topk4", 95.0)
        load_aware["points"][0]["output_tok_s"] = 99.0  # C=1: vs max(100, 90)
        load_aware["kv_capacity_tokens"] = 960
        table = sweep.tables.targets_table([nospec, always_on, load_aware])
        self.assertIn(
            "| loadaware-topk4 | 0.95 at C=8 missed | 0.95 at C=8 missed "
            "| 0.95 missed | 0.96 missed |",
            table,
        )
        self.assertNotIn("| nospec |", table)
        # A missing reference leaves its targets open; C < N is not compared with nospec.
        load_aware["points"][1]["output_tok_s"] = 1000.0
        table = sweep.tables.targets_table([nospec, load_aware])
        self.assertIn("| loadaware-topk4 | - | 1.25 at C=8 met | - | - |", table)

    def test_the_plot_shows_load_aware_configs_against_their_envelope(self):
        nospec, tree, chain = (
            self.record("nospec", 100.0),
            self.record("eagle3-topk4", 90.0),
            self.record("loadaware-topk4", 95.0),
        )
        tree["points"][1]["output_tok_s"] = 2000.0  # C=8: always-on is the best
        # The chain's always-on config was not measured: it has no envelope.
        orphan = self.record("loadaware-topk1", 95.0)
        records = [nospec, tree, chain, orphan]
        self.assertEqual(
            sweep.results.envelopes(records), {"eagle3-topk4": {1: 100.0, 8: 2000.0}}
        )
        with tempfile.TemporaryDirectory() as out_dir:
            path = os.path.join(out_dir, "throughput.png")
            sweep.results.plot(records, path, "tiny")
            envelope_panel = os.path.getsize(path)
            sweep.results.plot([nospec, tree], path, "tiny")
            self.assertGreater(envelope_panel, os.path.getsize(path))

    def test_suggested_threshold_is_where_no_speculation_stays_ahead(self):
        nospec, spec = self.record("nospec", 100.0), self.record("eagle3-topk1", 0.0)
        for p in nospec["points"] + spec["points"]:
            p["concurrency"] *= 4  # C = 4, 32
        spec["points"][0]["output_tok_s"] = 500.0  # speculation wins at C=4
        self.assertEqual(sweep.targets.crossover_concurrency(nospec, spec), 32)
        self.assertIn(
            "- eagle3-topk1: no speculation is as fast from C=32 on: disable threshold 32",
            sweep.targets.suggested_thresholds([nospec, spec]),
        )
        spec["points"][1]["output_tok_s"] = 4000.0  # and at C=32
        self.assertIsNone(sweep.targets.crossover_concurrency(nospec, spec))
        spec["points"][0]["output_tok_s"] = spec["points"][1]["output_tok_s"] = 1.0
        self.assertIn(
            "speculation does not pay",
            sweep.targets.suggested_thresholds([nospec, spec]),
        )

    def test_ramp_gain_of_switching_takes_the_faster_config_per_phase(self):
        nospec, spec = self.crossing_at_8()
        nospec["ramp"]["phases"] = [{"concurrency": c} for c in (1, 8, 1)]
        # Per phase: 300 + 800 + 300 against 1000 for either config alone.
        self.assertAlmostEqual(sweep.targets.ramp_gain_of_switching(nospec, spec), 1.4)
        self.assertIn(
            "disable threshold 8; the faster of the two in each ramp phase would give"
            " 1.40x the better of them on the ramp",
            sweep.targets.suggested_thresholds([nospec, spec]),
        )
        nospec["ramp"]["phases"].append({"concurrency": 4})  # not measured
        self.assertIsNone(sweep.targets.ramp_gain_of_switching(nospec, spec))

    def crossing_at_8(self) -> List[dict]:
        """nospec and eagle3-topk1 records where speculation pays at C=1 only."""
        nospec, spec = self.record("nospec", 100.0), self.record("eagle3-topk1", 0.0)
        spec["points"][0]["output_tok_s"] = 300.0  # C=1; nospec: 100
        spec["points"][1]["output_tok_s"] = 400.0  # C=8; nospec: 800
        return [nospec, spec]

    def sweep_args(self, out_dir: str, *flags: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        sweep.cli.add_server_args(parser)
        return parser.parse_args(["--out-dir", out_dir, "--results-date", "d", *flags])

    def test_a_suggested_threshold_comes_from_the_static_records(self):
        with tempfile.TemporaryDirectory() as out_dir:
            args = self.sweep_args(
                out_dir,
                "--configs",
                "nospec,loadaware-topk1",
                "--disable-threshold-for",
                "loadaware-topk1=suggested",
            )
            nospec, load_aware = sweep.cli.selected_configs(args)
            self.assertIs(sweep.cli.with_suggested_threshold(args, nospec), nospec)
            with self.assertRaisesRegex(SystemExit, "eagle3-topk1.*measure them first"):
                sweep.cli.with_suggested_threshold(args, load_aware)
            results = sweep.results.results_dir(args)
            for record in self.crossing_at_8():
                self.merge(results, record)
            resolved = sweep.cli.with_suggested_threshold(args, load_aware)
            self.assertEqual(
                resolved.extra_args, ["--speculative-disable-batch-threshold", "8"]
            )
            faster_everywhere = self.record("eagle3-topk1", 1000.0)
            self.merge(results, faster_everywhere)
            with self.assertRaisesRegex(SystemExit, "speculation was faster"):
                sweep.cli.with_suggested_threshold(args, load_aware)

    def run_main(self, run_config, *flags) -> None:
        """bench_sweep's main() with these flags, each config's run run_config,
        results in a temporary directory."""
        with tempfile.TemporaryDirectory() as out_dir, contextlib.ExitStack() as stack:
            argv = ["bench_sweep.py", "--out-dir", out_dir, "--results-date", "d"]
            for flag in flags:
                argv += flag
            for name, value in [
                ("generated_pair", lambda *_: ("/t", "/d")),
                ("describe_run", lambda model: self.header("abc")),
                ("run_config", run_config),
            ]:
                stack.enter_context(mock.patch.object(sweep.cli, name, value))
            stack.enter_context(mock.patch.object(sys, "argv", argv))
            sweep.cli.main()

    def test_a_sweep_suggests_the_threshold_from_the_configs_it_ran_first(self):
        """main() resolves a suggested threshold only when that config's turn comes."""
        static = {r["config"]: r for r in self.crossing_at_8()}
        thresholds = {}

        def run_config(args, config, target, draft, log_dir, save, server):
            if config.load_aware:
                thresholds[config.name] = sweep.targets.disable_threshold_of(
                    {"server_args": config.extra_args}
                )
            else:
                save(static[config.name])

        self.run_main(
            run_config,
            ["--configs", "nospec,eagle3-topk1,loadaware-topk1"],
            ["--disable-threshold-for", "loadaware-topk1=suggested"],
        )
        self.assertEqual(thresholds, {"loadaware-topk1": 8})

    def test_configs_take_turns_over_their_servers(self):
        runs = []

        def run_config(args, config, target, draft, log_dir, save, server):
            runs.append((config.name, server))

        self.run_main(run_config, ["--configs", "nospec,auto-topk1", "--servers", "2"])
        self.assertEqual(
            runs,
            [("nospec", 0), ("auto-topk1", 0), ("nospec", 1), ("auto-topk1", 1)],
        )

    def test_a_config_whose_server_dies_does_not_stop_the_others(self):
        ran = []
        oom = (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 192.00 MiB."
        )

        def run_config(args, config, target, draft, log_dir, save, server):
            ran.append(config.name)
            if config.name == "adaptive-topk1":
                os.makedirs(log_dir, exist_ok=True)
                with open(os.path.join(log_dir, f"{config.name}.log"), "w") as log:
                    log.write(f"[17:13:31] {oom}\n[17:13:31] SIGQUIT received.\n")
                raise RuntimeError("Response payload is not completed")

        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), self.assertRaises(SystemExit) as exit:
            self.run_main(
                run_config, ["--configs", "auto-adaptive-topk1,adaptive-topk1,nospec"]
            )
        self.assertEqual(ran, ["auto-adaptive-topk1", "adaptive-topk1", "nospec"])
        self.assertIn("failed: adaptive-topk1;", str(exit.exception.code))
        self.assertIn(f"adaptive-topk1: failed: [17:13:31] {oom}", stderr.getvalue())

    def test_a_config_measured_in_several_servers_is_pooled(self):
        with tempfile.TemporaryDirectory() as out_dir:
            for server, speed in enumerate((100.0, 130.0, 110.0)):
                record = {**self.record("nospec", speed), "server": server}
                record["points"][1]["bench_serving"] = {"output_tok_s": speed * 7}
                if server == 0:  # the others' were cut off
                    record["points"][0]["bench_serving"] = {"output_tok_s": speed}
                record["ramp"]["phases"] = [
                    {"concurrency": c, "output_tok_s": speed * c} for c in (1, 8)
                ]
                records = self.merge(out_dir, record)
            self.assertEqual(len(records), 3)  # one per server in raw.json
            unfinished = {**self.record("nospec", 500.0), "server": 1}
            del unfinished["ramp"]  # a later run cut off keeps the finished one
            records = self.merge(out_dir, unfinished)
            (pooled,) = sweep.records.pooled_records(records)
            self.assertEqual(pooled["servers"], 3)
            at_8 = pooled["points"][1]
            self.assertEqual(at_8["output_tok_s"], 880.0)  # the median of 800-1040
            self.assertEqual(
                (at_8["output_tok_s_min"], at_8["output_tok_s_max"]), (800.0, 1040.0)
            )
            self.assertEqual(at_8["servers_output_tok_s"], [800.0, 1040.0, 880.0])
            theirs = at_8["bench_serving"]
            self.assertEqual(theirs["output_tok_s"], 770.0)
            self.assertEqual(
                (theirs["output_tok_s_min"], theirs["output_tok_s_max"]), (700.0, 910.0)
            )
            self.assertNotIn("bench_serving", pooled["points"][0])
            self.assertEqual(pooled["ramp"]["output_tok_s"], 440.0)
            self.assertEqual(
                [p["output_tok_s"] for p in pooled["ramp"]["phases"]], [110.0, 880.0]
            )
            sweep.results.write_results(out_dir, records)
            summary = json.loads(Path(out_dir, "summary.json").read_text())
            self.assertEqual(
                [p["output_tok_s"] for p in summary["points"]], [110.0, 880.0]
            )

    def test_decode_throughput_from_the_server_log(self):
        def decode(bs, tok_s, spec=None, accept_len=None):
            mode = f"spec: {spec}, " if spec else ""
            if accept_len is not None:
                mode = f"accept len: {accept_len:.2f}, {mode}"
            return (
                f"[t] Decode batch, #running-req: {bs}, #token: {int(tok_s)}, token "
                f"usage: 0.00, {mode}cuda graph: True, gen throughput (token/s): "
                f"{tok_s}, #queue-req: 0"
            )

        prefill = "[t] Prefill batch, #new-seq: 1, #new-token: 512, #cached-token: 0"
        log = [
            decode(4, 1.0),  # its window started at launch
            decode(4, 100.0),
            prefill,
            decode(4, 2.0),  # a prefill ran in its window
            decode(4, 300.0),
            decode(3, 3.0),  # the batch changed in its window
            decode(3, 200.0),
            decode(3, 500.0, spec="off", accept_len=0.0),
            decode(3, 400.0, spec="off", accept_len=1.1),  # probes ran in its window
            decode(3, 90.0, spec="on", accept_len=2.5),
            decode(3, 80.0, spec="on"),
        ]
        windows = sweep.server.decode_windows(log, speculative=True)
        self.assertEqual(
            windows[:2],
            [
                {"mode": "spec", "batch": 4, "tokens": 100, "tok_s": 100.0},
                {"mode": "spec", "batch": 4, "tokens": 300, "tok_s": 300.0},
            ],
        )
        self.assertEqual(
            sweep.server.decode_throughput(windows),
            [
                {"mode": "plain", "batch": 3, "tok_s": 500.0, "windows": 1},
                {"mode": "spec", "batch": 3, "tok_s": 90.0, "windows": 3},
                {"mode": "spec", "batch": 4, "tok_s": 200.0, "windows": 2},
            ],
        )
        plain = sweep.server.decode_windows(log[:5], False)
        self.assertEqual({d["mode"] for d in plain}, {"plain"})
        hybrid = [
            line.replace("#token:", "#full token:").replace("batch,", "batch [7],")
            for line in log[:2]
        ]
        self.assertEqual(sweep.server.decode_windows(hybrid, True), windows[:1])

    def test_decode_rate_at_the_same_kv_tokens(self):
        def windows(step_s, tokens, mode="plain", batch=64):
            return [
                {"mode": mode, "batch": batch, "tokens": t, "tok_s": batch / step_s(t)}
                for t in tokens
            ]

        def nospec_step(tokens):  # a step's time grows with the KV in use
            return 0.007 + tokens * 1e-7

        nospec = windows(nospec_step, range(10_000, 100_001, 10_000))
        # Windows offset from nospec's, 1% slower at the same KV tokens: medians
        # over whole runs put it ahead of nospec, at shorter sequences.
        plain = windows(lambda t: nospec_step(t) * 1.01, range(5_000, 90_001, 10_000))
        plain += windows(lambda t: 1.0, [10_000], mode="spec")
        plain += windows(lambda t: 1.0, [10_000], batch=128)
        self.assertGreater(
            statistics.median(w["tok_s"] for w in plain[:9]),
            statistics.median(w["tok_s"] for w in nospec),
        )
        self.assertAlmostEqual(
            sweep.stats.rate_at_same_kv_tokens(plain, nospec, 64), 1 / 1.01
        )
        self.assertAlmostEqual(
            sweep.stats.rate_at_same_kv_tokens(nospec, nospec, 64), 1
        )
        # Outside the reference's span, or at a batch it did not run: no answer.
        self.assertIsNone(sweep.stats.rate_at_same_kv_tokens(plain[:1], nospec, 64))
        self.assertIsNone(sweep.stats.rate_at_same_kv_tokens(plain, nospec, 128))

    def test_plain_step_cost_against_nospec_at_the_same_batch(self):
        nospec, load_aware = self.record("nospec", 100.0), self.record(
            "loadaware-topk4", 100.0
        )
        nospec["decode_tok_s"] = [
            {"mode": "plain", "batch": bs, "tok_s": 1000.0, "windows": 5}
            for bs in (4, 8, 16)
        ]
        load_aware["decode_tok_s"] = [
            {"mode": "spec", "batch": 1, "tok_s": 300.0, "windows": 5},
            {"mode": "plain", "batch": 4, "tok_s": 500.0, "windows": 5},  # < N
            {"mode": "plain", "batch": 8, "tok_s": 990.0, "windows": 5},
            {"mode": "plain", "batch": 16, "tok_s": 950.0, "windows": 5},
            {"mode": "plain", "batch": 24, "tok_s": 10.0, "windows": 2},  # too few
            {"mode": "spec", "batch": 8, "tok_s": 77.0, "windows": 1},  # too few
        ]
        self.assertIn(
            "| 0.95 at batch 16 missed |",
            sweep.tables.targets_table([nospec, load_aware]),
        )
        table = sweep.tables.decode_table([nospec, load_aware])
        self.assertIn("| config | batch 1 | batch 8 |", table)
        self.assertIn("| nospec | - | 1000 |", table)
        self.assertIn("| loadaware-topk4 | 300 spec | 990 |", table)
        self.assertEqual(sweep.tables.decode_table([self.record("nospec", 1.0)]), "")

    def test_a_config_measured_again_replaces_its_record(self):
        with tempfile.TemporaryDirectory() as out_dir:
            self.merge(out_dir, self.record("nospec", 100.0), "old")
            self.merge(out_dir, self.record("eagle3-topk4", 90.0), "old")
            records = self.merge(out_dir, self.record("nospec", 120.0), "new")
            self.assertEqual(
                [(r["config"], r["commit"]) for r in records],
                [("nospec", "new"), ("eagle3-topk4", "old")],
            )
            self.assertEqual(records[0]["points"][0]["output_tok_s"], 120.0)
            saved = json.loads(Path(out_dir, "raw.json").read_text())["records"]
            self.assertEqual(saved, records)

    def test_a_run_cut_off_keeps_the_points_it_finished(self):
        measured = []

        def measure_point(args, config, prompts, concurrency, front_end_pid):
            if len(measured) == 2:
                raise KeyboardInterrupt  # the run's time limit
            point = self.record(config.name, 100.0)["points"][0]
            measured.append({**point, "concurrency": concurrency})
            return measured[-1]

        @contextlib.contextmanager
        def serving(
            args, config, target, draft, prompts, warmup_concurrencies, log_path
        ):
            self.assertEqual(warmup_concurrencies, [1, 8, 64, 1, 4])
            Path(log_path).write_text("")
            yield sweep.server.Launched({"server_args": [], "env": {}}, 7)

        state = {"memory_usage": {"token_capacity": 1000}}
        args = argparse.Namespace(
            url="u",
            concurrency=[1, 8, 64],
            ramp=[1, 4],
            input_len=4,
            output_len=2,
            steady=True,
            output_len_spread=0.5,
        )
        config = sweep.configs.KNOWN_CONFIGS["nospec"]
        with tempfile.TemporaryDirectory() as out_dir, mock.patch.multiple(
            sweep.runs,
            serving=serving,
            server_state=lambda url: state,
            measure_point=measure_point,
            tqdm=lambda items, desc: items,
        ):
            self.merge(out_dir, self.record("eagle3-topk4", 90.0))
            save = sweep.results.record_saver(out_dir, self.header("abc"))
            with self.assertRaises(KeyboardInterrupt):
                sweep.runs.run_config(
                    args, config, "t", "d", os.path.join(out_dir, "logs"), save
                )
            saved = json.loads(Path(out_dir, "raw.json").read_text())["records"]
            self.assertEqual([r["config"] for r in saved], ["nospec", "eagle3-topk4"])
            self.assertEqual([p["concurrency"] for p in saved[0]["points"]], [1, 8])
            self.assertEqual(
                saved[0]["workload"],
                {
                    "input_len": 4,
                    "output_len": 2,
                    "steady": True,
                    "output_len_spread": 0.5,
                },
            )
            self.assertFalse(sweep.records.finished(saved[0]))
            summary = json.loads(Path(out_dir, "summary.json").read_text())
            self.assertEqual([r["config"] for r in summary["ramp"]], ["eagle3-topk4"])
            self.assertIn(
                "| nospec | 1000 | - | 100 (0% spec) | 100 (0% spec) |",
                Path(out_dir, "results.md").read_text(),
            )

    def cut_off(self, name: str, speed: float) -> dict:
        record = self.record(name, speed)
        del record["ramp"]
        return record

    def test_a_cut_off_record_does_not_replace_a_finished_one(self):
        with tempfile.TemporaryDirectory() as out_dir:
            self.merge(out_dir, self.record("nospec", 100.0), "old")
            records = self.merge(out_dir, self.cut_off("nospec", 120.0), "new")
            self.assertEqual(records[0]["commit"], "old")
            records = self.merge(out_dir, self.record("nospec", 130.0), "new")
            self.assertEqual(records[0]["commit"], "new")

    def test_a_cut_off_config_leaves_its_ramp_target_open(self):
        table = sweep.tables.targets_table(
            [
                self.record("nospec", 100.0),
                self.record("eagle3-topk4", 90.0),
                self.cut_off("loadaware-topk4", 95.0),
            ]
        )
        self.assertIn(
            "| loadaware-topk4 | 0.95 at C=1 missed | 0.95 at C=8 missed | - | 1.00 met |",
            table,
        )

    def test_content_shift_prompts_move_from_the_easy_region_to_the_hard(self):
        spec = {"region_tokens": [[10, 11, 12], [20, 21, 22]]}
        prompts = sweep.client.ContentShiftPrompts(5, spec, shift_after=0.2)
        easy = prompts.take(3)
        time.sleep(0.25)
        hard = prompts.take(3)
        self.assertTrue(all(p[-1] in (10, 11, 12) for p in easy))
        self.assertTrue(all(p[-1] in (20, 21, 22) for p in hard))
        self.assertTrue(all(len(p) == 5 for p in easy + hard))
        self.assertEqual(parse_draft_accept("0.95,0.3"), (0.95, 0.3))
        self.assertEqual(parse_draft_accept("0.9"), 0.9)
        record = {
            "config": "auto-topk1",
            "content_shift": {
                "concurrency": 32,
                "output_tok_s": 900.0,
                "output_tok_s_min": 880.0,
                "output_tok_s_max": 910.0,
                "phases": [
                    {"prompts": "easy", "output_tok_s": 1200.0},
                    {"prompts": "hard", "output_tok_s": 600.0},
                ],
            },
        }
        table = sweep.tables.content_shift_table([record, {"config": "nospec"}])
        self.assertIn("| auto-topk1 | 32 | 900 [880-910] | 1200 | 600 |", table)
        self.assertNotIn("bench_serving |", table)
        record["content_shift"]["bench_serving"] = {
            "output_tok_s": 850.0,
            "phases": [
                {"prompts": "easy", "output_tok_s": 1100.0},
                {"prompts": "hard", "output_tok_s": 590.0},
            ],
        }
        table = sweep.tables.content_shift_table([record])
        self.assertIn("| auto-topk1, bench_serving | 32 | 850 | 1100 | 590 |", table)
        self.assertEqual(sweep.tables.content_shift_table([{"config": "nospec"}]), "")


if __name__ == "__main__":
    unittest.main()
