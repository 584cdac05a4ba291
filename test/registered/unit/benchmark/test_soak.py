"""benchmark/dynamic_spec/soak.py against a local stand-in server that answers as the
synthetic target would (greedy map, stop strings, regex detours, logprobs,
streaming), or gets some tokens wrong: the soak's checks must tell them apart."""

import asyncio
import json
import subprocess
import sys
import threading
import unittest

from aiohttp import web

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.spec_engine_utils import load_benchmark_script, synthetic_pair
from sglang.test.synthetic_spec_models import (
    greedy_continuation,
    next_token_map,
    prompt_text,
    token_ids_in,
    token_name,
)
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

soak = load_benchmark_script("soak")


class StandInServer:
    """/generate, /metrics and /health of a server of the synthetic target, in a
    thread; every corrupt_every-th answer has one wrong token."""

    def __init__(self, token_map, corrupt_every=0):
        self.token_map = token_map
        self.corrupt_every = corrupt_every
        self.num_requests = 0
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        self.started.wait(10)
        return self.url

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def _serve(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.add_routes(
            [
                web.post("/generate", self.generate),
                web.get("/metrics", self.metrics),
                web.get("/health", lambda request: web.Response(text="ok")),
            ]
        )
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        self.started.set()
        self.loop.run_forever()

    def answer(self, body: dict) -> dict:
        params = body["sampling_params"]
        n = params["max_new_tokens"]
        finish = "length"
        if "regex" in params:
            tokens = token_ids_in(params["regex"])
        else:
            tokens = greedy_continuation(self.token_map, body["input_ids"], n)
            stop = params.get("stop")
            at = list(map(token_name, tokens)).index(stop[0]) if stop else n
            if at < n - 1:  # the length is checked first, as upstream does
                tokens, finish = tokens[:at], "stop"
        self.num_requests += 1
        if self.corrupt_every and self.num_requests % self.corrupt_every == 0:
            tokens = tokens[:-1] + [(tokens[-1] + 1) % len(self.token_map)]
        meta = {"finish_reason": {"type": finish}, "completion_tokens": len(tokens)}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[0.0, t, None] for t in tokens]
        return {
            "text": prompt_text(tokens),
            "output_ids": tokens,
            "meta_info": meta,
        }

    async def generate(self, request):
        body = await request.json()
        answer = self.answer(body)
        if not body["stream"]:
            return web.json_response(answer)
        response = web.StreamResponse()
        await response.prepare(request)
        try:
            for _ in answer["output_ids"]:
                await response.write(f"data: {json.dumps(answer)}\n\n".encode())
                await asyncio.sleep(0.002)
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, RuntimeError):
            pass  # the client left: an abort
        return response

    async def metrics(self, request):
        return web.Response(
            text=f"sglang:spec_toggles_total {self.num_requests}\n"
            f'sglang:spec_decode_steps_total{{mode="plain",reason="x"}} 3\n'
        )


class TestSoak(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        target, _ = synthetic_pair("tiny", 0.8)
        cls.model_dir = target.rsplit("/", 1)[0]
        cls.token_map = next_token_map(cls.model_dir)

    def soak_against(self, server: StandInServer) -> dict:
        with server as url:
            return soak.main(
                [
                    "--url",
                    url,
                    "--model-dir",
                    self.model_dir,
                    "--minutes",
                    "0.05",
                    "--phase-seconds",
                    "0.5",
                    "--max-concurrency",
                    "8",
                    "--abort-share",
                    "0.2",
                    "--kinds",
                    "plain=0.4,logprob=0.2,stop=0.2,grammar=0.2",
                    "--max-output-len",
                    "32",
                    "--idle-seconds",
                    "0",
                ]
            )

    def test_every_kind_of_request_checks_out_against_a_correct_server(self):
        summary = self.soak_against(StandInServer(self.token_map))
        self.assertGreater(summary["requests"], 20)
        self.assertEqual(set(summary["by_kind"]), set(soak.KINDS))
        self.assertEqual((summary["errors"], summary["mismatches"]), (0, 0))
        self.assertGreater(summary["aborted"], 0)
        self.assertGreater(summary["finished"], summary["aborted"])
        self.assertGreater(summary["switches"], 0)
        self.assertTrue(summary["healthy_after_idle"])
        self.assertEqual(summary["concurrency_schedule"][0], 1)

    def test_wrong_tokens_are_counted_as_mismatches(self):
        summary = self.soak_against(StandInServer(self.token_map, corrupt_every=3))
        self.assertGreater(summary["mismatches"], 0)
        self.assertTrue(summary["problems"])

    def test_gpu_memory_of_a_server_that_died_is_unknown(self):
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        self.assertIsNone(soak.gpu_memory_used_mib(gone.pid))

    def test_the_concurrency_moves_between_one_and_the_maximum(self):
        import random

        for seconds, max_concurrency in ((600, 256), (600, 2), (45, 256)):
            for seed in range(200):
                schedule = soak.concurrency_schedule(
                    random.Random(seed), seconds, 30, max_concurrency
                )
                self.assertEqual((schedule[0], schedule[-1]), (1, 1))
                self.assertIn(len(schedule), (19, 20) if seconds == 600 else (3,))
                self.assertTrue(all(a != b for a, b in zip(schedule, schedule[1:])))
                self.assertEqual(max(schedule), max_concurrency, schedule)
        with self.assertRaises(ValueError):
            soak.concurrency_schedule(random.Random(0), 600, 30, 1)


if __name__ == "__main__":
    unittest.main()
