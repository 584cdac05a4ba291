"""GPU tier of load-aware speculation on EAGLEWorkerV2 (chains and draft trees, with
and without the overlap scheduler): plain decode steps above a batch threshold, or in
the 0-draft-step tiers of --speculative-adaptive, speculative steps below it, under
CUDA graphs.

The synthetic checkpoints make greedy outputs a known function of the prompt (the
plain engine reproduces it exactly: test_synthetic_spec_models_gpu.py), so every
response is compared token for token with it. Servers run with the idle and busy
KV leak checks of the scheduler on, so a leaked slot kills the server.
"""

import itertools
import json
import os
import re
import tempfile
import threading
import time
import unittest
from typing import Dict, List, Optional, Tuple

import pytest
import requests
import torch
from sglang.test.ci.ci_register import register_cuda_ci
from sglang.test.spec_engine_utils import (
    EAGLE3_CHAIN,
    EAGLE3_TREE,
    LEAK_CHECK_ENV,
    cli_args,
    eagle3_args,
    greedy_params,
    metric_total,
    plain_step_tokens,
    post_concurrently,
    random_prompts,
    running_server,
    scrape_metrics,
    synthetic_pair,
)
from sglang.test.synthetic_spec_models import (
    expected_accept_length,
    greedy_continuation,
    next_token_map,
    token_ids_in,
    token_name,
)
from sglang.test.test_utils import CustomTestCase

register_cuda_ci(est_time=1660, suite="base-b-test-1-gpu-large")
pytestmark = pytest.mark.gpu

PROMPT_LEN = 16
# Plain steps a request may still see after the batch shrank (the policy's default dwell).
MIN_DWELL_STEPS = 8


def spec_server_args(
    draft: str,
    spec: Dict[str, int],
    backend: str,
    page_size: int,
    cuda_graph: bool,
    draft_arch: str = "eagle3",
) -> List[str]:
    return cli_args(
        dict(
            **eagle3_args(draft, **spec, draft_arch=draft_arch),
            attention_backend=backend,
            page_size=page_size,
            cuda_graph_max_bs=48,
            max_running_requests=48,
            mem_fraction_static=0.5,
            # A pool far above what the classes need, and small enough that the
            # servers of several classes fit on one GPU at once.
            max_total_tokens=65536,
            grammar_backend="none",
            enable_metrics=True,
            random_seed=0,
            disable_cuda_graph=not cuda_graph,
        )
    )


def spec_accept_length(metas: List[dict]) -> float:
    verify = sum(m.get("spec_verify_ct", 0) for m in metas)
    correct = sum(m.get("spec_num_correct_drafts", 0) for m in metas)
    return (correct + verify) / verify


class LoadAwareServerBase(CustomTestCase):
    """One load-aware server per class; subclasses pick the configuration."""

    draft_accept = 0.8
    spec = EAGLE3_TREE
    backend = "triton"
    page_size = 1
    cuda_graph = True
    disable_threshold = 5
    enable_threshold = None
    seed = 11
    draft_kv_check = False
    draft_arch = "eagle3"  # "eagle": an EAGLE draft (synthetic_pair), served as such
    preset = "tiny"
    extra_args: List[str] = []
    extra_env: Dict[str, str] = {}
    server_log: Optional[str] = None  # a path: the server's output goes there

    @classmethod
    def server_args(cls) -> List[str]:
        args = spec_server_args(
            cls.draft,
            cls.spec,
            cls.backend,
            cls.page_size,
            cls.cuda_graph,
            draft_arch=cls.draft_arch,
        )
        if cls.disable_threshold is not None:  # None: load-aware speculation off
            args += [
                "--speculative-disable-batch-threshold",
                str(cls.disable_threshold),
            ]
        if cls.enable_threshold is not None:
            args += ["--speculative-enable-batch-threshold", str(cls.enable_threshold)]
        return args + cls.extra_args

    @classmethod
    def setUpClass(cls):
        cls.target, cls.draft = synthetic_pair(
            cls.preset,
            cls.draft_accept,
            draft_kv_check=cls.draft_kv_check,
            draft_arch=cls.draft_arch,
        )
        cls.token_map = next_token_map(cls.target.rsplit("/", 1)[0])
        cls._server = running_server(
            cls.target,
            cls.server_args(),
            env={**LEAK_CHECK_ENV, **cls.extra_env},
            log_path=cls.server_log,
        )
        cls.base_url, cls.process = cls._server.__enter__()

    @classmethod
    def tearDownClass(cls):
        cls._server.__exit__(None, None, None)

    def prompts(self, num: int, seed: int) -> List[List[int]]:
        return random_prompts(
            num, PROMPT_LEN, len(self.token_map), seed=self.seed * 1000 + seed
        )

    def intended(self, prompt: List[int], num_tokens: int) -> List[int]:
        return greedy_continuation(self.token_map, prompt, num_tokens)

    def assert_outputs_intended(
        self, prompts: List[List[int]], outputs: List[dict], lengths: List[int]
    ) -> None:
        for i, (prompt, out, n) in enumerate(zip(prompts, outputs, lengths)):
            self.assertEqual(
                out["output_ids"], self.intended(prompt, n), f"request {i}"
            )
            self.assertEqual(
                out["meta_info"]["finish_reason"]["type"], "length", f"request {i}"
            )

    def internal_state(self) -> dict:
        info = requests.get(f"{self.base_url}/server_info", timeout=30).json()
        return info["internal_states"][0]

    def load_aware_state(self) -> dict:
        return self.internal_state()["load_aware_speculation"]

    def predicted_accept_length(self) -> float:
        """The accept length of a server that never switched, at the step count that
        the server runs now."""
        num_steps = self.internal_state()["speculative_num_steps"]
        return expected_accept_length(self.draft_accept, num_steps, self.spec["topk"])

    def assert_server_alive_and_idle_clean(self) -> None:
        # The idle memory check runs once the server has been idle; a leak raises there.
        time.sleep(6)
        self.assertIsNone(self.process.poll(), "server died (KV leak check or crash)")
        self.assertEqual(
            requests.get(f"{self.base_url}/health", timeout=30).status_code, 200
        )

    def run_mixed_batch(
        self, num: int, seed: int, **extra
    ) -> Tuple[List[List[int]], List[dict], List[int]]:
        """num concurrent requests of different lengths: most end during plain steps."""
        prompts = self.prompts(num, seed)
        lengths = [7 + (5 * i) % 41 for i in range(num)]
        outputs = post_concurrently(
            self.base_url,
            [(p, greedy_params(n)) for p, n in zip(prompts, lengths)],
            **extra,
        )
        self.assert_outputs_intended(prompts, outputs, lengths)
        return prompts, outputs, lengths


class TestLoadAwareTreeAtTheCrashingThreshold(LoadAwareServerBase):
    """The case that crashed a naive patch: topk 4, 2 steps, 16 draft tokens,
    disable threshold 5, 10 concurrent requests."""

    def test_ten_concurrent_requests_run_plain_and_match(self):
        prompts = self.prompts(10, seed=0)
        outputs = post_concurrently(
            self.base_url, [(p, greedy_params(64)) for p in prompts]
        )
        self.assert_outputs_intended(prompts, outputs, [64] * 10)
        plain = [plain_step_tokens(o["meta_info"]) for o in outputs]
        self.assertTrue(
            all(n > 0 for n in plain), f"plain-step tokens per request: {plain}"
        )
        single = post_concurrently(self.base_url, [(prompts[0], greedy_params(64))])
        self.assertLessEqual(
            plain_step_tokens(single[0]["meta_info"]),
            MIN_DWELL_STEPS,
            "a lone request must speculate",
        )
        self.assert_server_alive_and_idle_clean()


class RampMixin:
    """Concurrency 1 -> 32 -> 1, repeated: one long request lives through each plain phase."""

    cycles = 20
    burst = 31
    long_request_tokens = 192

    def run_ramp(self) -> Tuple[List[dict], List[dict]]:
        from concurrent.futures import ThreadPoolExecutor

        from sglang.test.spec_engine_utils import post_generate

        long_outputs, burst_outputs = [], []
        with ThreadPoolExecutor(max_workers=self.burst + 1) as pool:
            for cycle in range(self.cycles):
                long_prompt = self.prompts(1, seed=100 + cycle)[0]
                long_future = pool.submit(
                    post_generate,
                    self.base_url,
                    long_prompt,
                    greedy_params(self.long_request_tokens),
                )
                time.sleep(0.15)
                burst_prompts = self.prompts(self.burst, seed=200 + cycle)
                burst = [
                    pool.submit(post_generate, self.base_url, p, greedy_params(24))
                    for p in burst_prompts
                ]
                outs = [f.result() for f in burst]
                self.assert_outputs_intended(burst_prompts, outs, [24] * self.burst)
                long_out = long_future.result()
                self.assert_outputs_intended(
                    [long_prompt], [long_out], [self.long_request_tokens]
                )
                long_outputs.append(long_out)
                burst_outputs.extend(outs)
        return long_outputs, burst_outputs


class TestLoadAwareRampTree(RampMixin, LoadAwareServerBase):
    disable_threshold = 8

    def test_ramp_switches_and_resumes_at_full_acceptance(self):
        state_before = self.load_aware_state()
        long_outputs, _ = self.run_ramp()
        after = scrape_metrics(self.base_url)
        metas = [o["meta_info"] for o in long_outputs]
        resumed = [m for m in metas if plain_step_tokens(m) > 0]
        self.assertGreaterEqual(
            len(resumed), self.cycles // 2, "long requests rarely saw plain steps"
        )
        measured = spec_accept_length(metas)
        never_switched = self.predicted_accept_length()
        print(
            f"[load-aware-ramp] accept length over spec steps {measured:.3f}, "
            f"never-switched prediction {never_switched:.3f}"
        )
        self.assertAlmostEqual(measured, never_switched, delta=0.10 * never_switched)
        state = self.load_aware_state()
        toggles = state["num_toggles"] - state_before["num_toggles"]
        print(f"[load-aware-ramp] state {state}")
        self.assertGreaterEqual(toggles, 2 * self.cycles)
        self.assertGreater(
            metric_total(after, "sglang:spec_decode_steps_total", mode="plain"), 0
        )
        self.assertGreater(metric_total(after, "sglang:spec_toggles_total"), 0)
        retracted = metric_total(after, "sglang:num_retracted_requests_total")
        self.assertEqual(retracted, 0, "retractions during the ramp")
        self.assert_server_alive_and_idle_clean()


def multi_gpu_tp_size() -> int:
    """Tensor parallelism of the multi-GPU classes: the largest power of two of the
    visible GPUs, up to 8 (TP 2 on a 2-GPU machine, 4 or 8 on larger ones)."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    tp_size = 1
    while tp_size * 2 <= min(visible, 8):
        tp_size *= 2
    return tp_size


TP_SIZE = multi_gpu_tp_size()
needs_multi_gpu = unittest.skipIf(TP_SIZE < 2, "needs 2 or more GPUs")


@needs_multi_gpu
class TestLoadAwareTreeAtTheCrashingThresholdTP(
    TestLoadAwareTreeAtTheCrashingThreshold
):
    """The crashing case at tensor parallelism TP_SIZE."""

    extra_args = ["--tp-size", str(TP_SIZE)]


class RanksAgreeMixin:
    """The ramp at tensor parallelism TP_SIZE: every rank must take the same decision
    per step (the switch lines of the server log, per rank)."""

    extra_args = ["--tp-size", str(TP_SIZE)]
    min_switches = 2 * RampMixin.cycles

    def test_ranks_switch_at_the_same_steps(self):
        self.run_ramp()
        switches: Dict[str, List[str]] = {}
        with open(self.server_log) as log:
            for line in log:
                match = re.search(
                    r" (TP\d+)[^\]]*\] Load-aware speculation: (\w+ from decode .*)",
                    line,
                )
                if match:
                    switches.setdefault(match.group(1), []).append(match.group(2))
        counts = {rank: len(lines) for rank, lines in switches.items()}
        print(f"[load-aware-tp{TP_SIZE}] switches per rank: {counts}")
        ranks = [f"TP{rank}" for rank in range(TP_SIZE)]
        self.assertEqual(sorted(switches), sorted(ranks))
        self.assertGreaterEqual(len(switches["TP0"]), self.min_switches)
        for rank in ranks[1:]:
            self.assertEqual(switches[rank], switches["TP0"], rank)


@needs_multi_gpu
class TestLoadAwareRampTreeTP(RanksAgreeMixin, TestLoadAwareRampTree):
    server_log = os.path.join(tempfile.gettempdir(), "load_aware_tp_server.log")


class TestLoadAwareAutoRampTree(RampMixin, LoadAwareServerBase):
    """--speculative-disable-batch-threshold auto on the ramp: every output is the
    intended one while the server times both modes and picks the faster."""

    disable_threshold = "auto"

    def test_ramp_times_both_modes_and_serves_the_intended_tokens(self):
        self.run_ramp()
        after = scrape_metrics(self.base_url)
        state = self.load_aware_state()
        print(f"[load-aware-auto] state {state}")
        self.assertEqual(state["policy"], "auto")
        costs = state["step_costs_seconds"]
        plain, spec = costs["0"], costs[str(self.spec["num_steps"])]
        timed = [bs for bs in plain if plain[bs] is not None and spec[bs] is not None]
        self.assertGreaterEqual(len(timed), 2, f"buckets timed in both modes: {timed}")
        self.assertGreater(
            metric_total(after, "sglang:spec_decode_steps_total", reason="calibrate"),
            0,
        )
        measured = state["accept_length"][str(self.spec["num_steps"])]
        self.assertAlmostEqual(
            measured, self.predicted_accept_length(), delta=0.2 * measured
        )
        self.assert_server_alive_and_idle_clean()


@needs_multi_gpu
class TestLoadAwareAutoRampTreeTP(RanksAgreeMixin, TestLoadAwareAutoRampTree):
    """The ranks time their own steps but sum the times before deciding."""

    min_switches = 1  # auto switches where the measured rates cross
    server_log = os.path.join(tempfile.gettempdir(), "load_aware_auto_tp_server.log")


class TestLoadAwareFrequentResumeKVCheck(LoadAwareServerBase):
    """A long request goes plain and back every few steps, with the draft variant that
    proposes right only when the draft KV of the previous position is valid: a plain
    step that left the draft KV stale would drop the first speculative round after
    every resume to accept length 1."""

    draft_kv_check = True
    disable_threshold = 2
    enable_threshold = 1
    extra_args = ["--speculative-load-aware-min-dwell-steps", "0"]
    resumed_request_tokens = 256
    min_toggles = 20
    prefills_write_kv_only = True

    def test_acceptance_survives_frequent_resumes(self):
        from concurrent.futures import ThreadPoolExecutor

        from sglang.test.spec_engine_utils import post_generate

        state_before = self.load_aware_state()
        prompt = self.prompts(1, seed=300)[0]
        done = threading.Event()

        def interrupt_with_short_requests():
            for i in itertools.count():
                if done.is_set():
                    return
                post_generate(
                    self.base_url, self.prompts(1, 400 + i)[0], greedy_params(2)
                )
                time.sleep(0.02)

        with ThreadPoolExecutor(max_workers=1) as pool:
            interrupter = pool.submit(interrupt_with_short_requests)
            try:
                out = post_generate(
                    self.base_url, prompt, greedy_params(self.resumed_request_tokens)
                )
            finally:
                done.set()
            interrupter.result()
        self.assert_outputs_intended([prompt], [out], [self.resumed_request_tokens])
        meta = out["meta_info"]
        toggles = self.load_aware_state()["num_toggles"] - state_before["num_toggles"]
        measured = spec_accept_length([meta])
        predicted = self.predicted_accept_length()
        print(
            f"[load-aware-resume] toggles {toggles}, plain tokens {plain_step_tokens(meta)}, "
            f"accept length {measured:.3f} (predicted {predicted:.3f})"
        )
        self.assertGreaterEqual(toggles, self.min_toggles)
        self.assertAlmostEqual(measured, predicted, delta=0.10 * predicted)
        self.assert_server_alive_and_idle_clean()

    def test_a_prompt_drafts_alike_prefilled_while_speculating_or_plain(self):
        """A prefill writes the draft KV only (with the full draft catch-up: runs
        the draft extend). While speculating, the draft's proposal at the prompt's
        end runs at once; after plain steps, the resume before the request's first
        speculative step runs it. The request's verify rounds must be the same
        either way."""
        from sglang.test.spec_engine_utils import post_generate

        prompt = self.prompts(1, seed=500)[0]
        num_tokens = self.resumed_request_tokens
        kv_only_prefills = int(self.prefills_write_kv_only)
        post_generate(self.base_url, self.prompts(1, 501)[0], greedy_params(8))
        prefills_before = self.load_aware_state()["draft_prefills_kv_only"]
        reference = post_generate(self.base_url, prompt, greedy_params(num_tokens))
        prefills = self.load_aware_state()["draft_prefills_kv_only"] - prefills_before
        self.assertEqual(prefills, kv_only_prefills)
        self.assertEqual(requests.post(f"{self.base_url}/flush_cache").status_code, 200)
        pair = self.prompts(2, seed=502)
        ended_plain = post_generate(self.base_url, pair, greedy_params(16))
        self.assertEqual(
            [o["meta_info"].get("spec_verify_ct", 0) for o in ended_plain], [0, 0]
        )
        prefills_before = self.load_aware_state()["draft_prefills_kv_only"]
        out = post_generate(self.base_url, prompt, greedy_params(num_tokens))
        prefills = self.load_aware_state()["draft_prefills_kv_only"] - prefills_before
        self.assertEqual(prefills, kv_only_prefills)
        self.assert_outputs_intended([prompt] * 2, [reference, out], [num_tokens] * 2)
        for key in ("spec_verify_ct", "spec_num_correct_drafts"):
            self.assertEqual(out["meta_info"][key], reference["meta_info"][key], key)


class TestLoadAwareFrequentResumeKVCheckFullCatchUp(TestLoadAwareFrequentResumeKVCheck):
    """The same with the full draft forward on every plain step: the path of drafts
    that cannot write their KV alone (the synthetic one-layer heads can), replayed
    from CUDA graphs of its own."""

    extra_env = {"SGLANG_LOAD_AWARE_FULL_DRAFT_CATCH_UP": "1"}
    prefills_write_kv_only = False
    server_log = os.path.join(tempfile.gettempdir(), "load_aware_full_catch_up.log")
    catch_up_graphs = True

    def test_the_catch_up_graphs_are_captured_unless_disabled(self):
        with open(self.server_log) as log:
            captured = "Captured one-token draft catch-up cuda graphs" in log.read()
        self.assertEqual(captured, self.catch_up_graphs)


class TestLoadAwareFrequentResumeKVCheckFullCatchUpEager(
    TestLoadAwareFrequentResumeKVCheckFullCatchUp
):
    """The full draft forward run eagerly, as batches beyond its graphs run it."""

    extra_env = {
        **TestLoadAwareFrequentResumeKVCheckFullCatchUp.extra_env,
        "SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH": "1",
    }
    catch_up_graphs = False


class MatrixMixin:
    """Stop strings, logprobs and max_new_tokens ending during plain steps."""

    def test_mixed_lengths_with_logprobs(self):
        prompts, outputs, lengths = self.run_mixed_batch(
            24, seed=1, return_logprob=True
        )
        for out, n in zip(outputs, lengths):
            token_logprobs = out["meta_info"]["output_token_logprobs"]
            self.assertEqual([t[1] for t in token_logprobs], out["output_ids"])
            self.assertTrue(
                all(-1.0 < t[0] <= 0.0 for t in token_logprobs), token_logprobs[:4]
            )
        self.assertTrue(any(plain_step_tokens(o["meta_info"]) > 0 for o in outputs))
        self.assert_server_alive_and_idle_clean()

    def test_stop_strings_during_plain_steps(self):
        # Stop at a 4-digit token: its text "wNNNN" is no substring of another token's.
        prompts, stop_at = [], []
        for prompt in self.prompts(48, seed=2):
            k = self.first_four_digit_position(prompt, start=5 + len(prompts))
            if k is not None:
                prompts.append(prompt)
                stop_at.append(k)
            if len(prompts) == 16:
                break
        self.assertEqual(len(prompts), 16, "prompts with a 4-digit token")
        params = [
            greedy_params(64, stop=[token_name(self.intended(p, k)[-1])])
            for p, k in zip(prompts, stop_at)
        ]
        outputs = post_concurrently(self.base_url, list(zip(prompts, params)))
        for prompt, k, out in zip(prompts, stop_at, outputs):
            got = token_ids_in(out["text"])
            self.assertEqual(got, self.intended(prompt, k)[:-1], out["text"])
            self.assertEqual(out["meta_info"]["finish_reason"]["type"], "stop")
        self.assert_server_alive_and_idle_clean()

    def first_four_digit_position(self, prompt: List[int], start: int) -> Optional[int]:
        continuation = self.intended(prompt, 64)
        return next((k for k in range(start, 64) if continuation[k - 1] >= 1000), None)

    def test_lone_request_speculates_at_predicted_acceptance(self):
        prompt = self.prompts(1, seed=3)[0]
        out = post_concurrently(self.base_url, [(prompt, greedy_params(128))])[0]
        self.assert_outputs_intended([prompt], [out], [128])
        self.assertLessEqual(plain_step_tokens(out["meta_info"]), MIN_DWELL_STEPS)
        predicted = self.predicted_accept_length()
        self.assertAlmostEqual(
            spec_accept_length([out["meta_info"]]), predicted, delta=0.2 * predicted
        )


class ChainMixin:
    spec = EAGLE3_CHAIN


class TestLoadAwareChainAtTheThreshold(
    ChainMixin, TestLoadAwareTreeAtTheCrashingThreshold
):
    pass


class TestLoadAwareRampChain(ChainMixin, TestLoadAwareRampTree):
    pass


class TestLoadAwareRampTreeFlashinfer(TestLoadAwareRampTree):
    backend = "flashinfer"


class TestLoadAwareRampTreeNoOverlap(TestLoadAwareRampTree):
    """The synchronous path of EAGLEWorkerV2 (no overlap scheduler)."""

    extra_args = ["--disable-overlap-schedule"]


class TestLoadAwareChainFrequentResumeKVCheck(
    ChainMixin, TestLoadAwareFrequentResumeKVCheck
):
    pass


class TestLoadAwareChainFrequentResumeKVCheckFA3(
    ChainMixin, TestLoadAwareFrequentResumeKVCheck
):
    """The resume of a KV-only draft runs FA3's decode kernels."""

    backend = "fa3"


class TestLoadAwareFrequentResumeKVCheckFlashinfer(TestLoadAwareFrequentResumeKVCheck):
    """The resume's decode backend shares the draft's flashinfer workspace."""

    backend = "flashinfer"


class TestLoadAwareFrequentResumeEagleDraft(TestLoadAwareFrequentResumeKVCheck):
    """The same with an EAGLE draft (LlamaForCausalLMEagle), which writes its KV
    alone too. The synthetic EAGLE draft proposes what the target decodes whatever
    its KV holds (acceptance 1): this checks that such a draft takes the KV-only
    path end to end and resumes with every draft accepted, not the KV it writes
    (test_eagle_draft_kv_only checks that)."""

    draft_arch = "eagle"
    draft_accept = 1.0
    draft_kv_check = False


class TestLoadAwareFrequentResumeQwen2EagleDraft(TestLoadAwareFrequentResumeEagleDraft):
    """The same with the EAGLE draft of a Qwen2 target (Qwen2ForCausalLMEagle)."""

    preset = "tiny-qwen2"


class TestLoadAwareFrequentResumeKVCheckFullCatchUpFlashinfer(
    TestLoadAwareFrequentResumeKVCheckFullCatchUp
):
    """The one-token draft extend on every plain step runs flashinfer's decode
    kernels in the draft's workspace."""

    backend = "flashinfer"


class TestLoadAwareTopk1TritonGraphs(ChainMixin, MatrixMixin, LoadAwareServerBase):
    pass


class TestLoadAwareTopk1TritonPage16Eager(ChainMixin, MatrixMixin, LoadAwareServerBase):
    page_size = 16
    cuda_graph = False


class TestLoadAwareTopk1FlashinferPage16Graphs(
    ChainMixin, MatrixMixin, LoadAwareServerBase
):
    backend = "flashinfer"
    page_size = 16


class TestLoadAwareTopk4TritonGraphs(MatrixMixin, LoadAwareServerBase):
    pass


class TestLoadAwareTopk4TritonEager(MatrixMixin, LoadAwareServerBase):
    cuda_graph = False


class TestLoadAwareTopk4FlashinferGraphs(MatrixMixin, LoadAwareServerBase):
    backend = "flashinfer"


class TestLoadAwareTopk4FlashinferPage16Graphs(MatrixMixin, LoadAwareServerBase):
    backend = "flashinfer"
    page_size = 16


class TestLoadAwareTopk4FlashinferEager(MatrixMixin, LoadAwareServerBase):
    backend = "flashinfer"
    cuda_graph = False


class TestLoadAwareTopk1FA3Graphs(ChainMixin, MatrixMixin, LoadAwareServerBase):
    """FlashAttention-3, SGLang's default attention backend on Hopper for chains."""

    backend = "fa3"


class TestLoadAwareTopk4FA3Graphs(MatrixMixin, LoadAwareServerBase):
    backend = "fa3"


class TestLoadAwareChainFrequentResumeKVCheckFullCatchUpFA3(
    ChainMixin, TestLoadAwareFrequentResumeKVCheckFullCatchUp
):
    """The full draft catch-up (an extend batch relabelled as decode) on FA3."""

    backend = "fa3"


class AdaptiveMixin(ChainMixin):
    """Upstream's adaptive step count on the speculative steps: at draft acceptance
    0.95 it rises from 3 to 7 steps after its warmup (15 verify steps by default) and
    stays there. A first request takes the server there before the tests run."""

    draft_accept = 0.95
    adaptive_num_steps = 7
    # At 7 steps a request takes ~2.8x fewer steps than at 3: longer requests
    # (the synthetic models' context is 512) see as many plain phases.
    long_request_tokens = 448
    resumed_request_tokens = 448
    min_toggles = 12

    @classmethod
    def server_args(cls) -> List[str]:
        return super().server_args() + ["--speculative-adaptive"]

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        try:
            prompt = random_prompts(1, PROMPT_LEN, len(cls.token_map), seed=7)[0]
            post_concurrently(cls.base_url, [(prompt, greedy_params(192))])
        except BaseException:
            cls.tearDownClass()
            raise

    def predicted_accept_length(self) -> float:
        num_steps = self.internal_state()["speculative_num_steps"]
        self.assertEqual(num_steps, self.adaptive_num_steps, "adaptive step count")
        return super().predicted_accept_length()


class TestLoadAwareAdaptiveRamp(AdaptiveMixin, TestLoadAwareRampTree):
    pass


class TestLoadAwareAdaptiveFrequentResumeKVCheck(
    AdaptiveMixin, TestLoadAwareFrequentResumeKVCheck
):
    pass


class TestLoadAwareAdaptiveTritonPage16Eager(
    AdaptiveMixin, MatrixMixin, LoadAwareServerBase
):
    """Eager plain steps on the target backend of an adaptive state other than the
    initial one."""

    page_size = 16
    cuda_graph = False


class TestLoadAwareAutoAdaptiveRamp(ChainMixin, RampMixin, LoadAwareServerBase):
    """auto with --speculative-adaptive (upstream's default config): each decode
    step runs the plain step or one of the candidate step counts, every output is
    the intended one, and every step count that ran is timed and accepts as a
    chain of its length should."""

    disable_threshold = "auto"
    draft_accept = 0.95
    extra_args = ["--speculative-adaptive"]

    def test_ramp_times_the_step_counts_it_runs(self):
        self.run_ramp()
        state = self.load_aware_state()
        print(f"[load-aware-auto-adaptive] state {state}")
        costs = state["step_costs_seconds"]
        timed = sorted(int(m) for m, by_bs in costs.items() if any(by_bs.values()))
        self.assertIn(0, timed)
        self.assertGreaterEqual(len(timed), 3, f"step counts timed: {timed}")
        for num_steps in timed[1:]:
            measured = state["accept_length"][str(num_steps)]
            predicted = expected_accept_length(self.draft_accept, num_steps)
            self.assertAlmostEqual(measured, predicted, delta=0.2 * predicted)
        self.assert_server_alive_and_idle_clean()


class TestAdaptiveZeroDraftStepsRunThePlainStep(ChainMixin, LoadAwareServerBase):
    """--speculative-adaptive alone, with a tier at 0 draft steps from a running batch
    of 8: those steps are the plain step (DECODE graphs, KV-only draft catch-up), and
    a lone request speculates again at full acceptance. The tier's runtime state
    captures no graphs of its own."""

    disable_threshold = None
    server_log = os.path.join(tempfile.gettempdir(), "adaptive_zero_step_server.log")

    @classmethod
    def server_args(cls) -> List[str]:
        cls.adaptive_config = tempfile.NamedTemporaryFile("w", suffix=".json")
        json.dump(
            {"1": {"candidate_steps": [3]}, "8": {"candidate_steps": [0]}},
            cls.adaptive_config,
        )
        cls.adaptive_config.flush()
        return super().server_args() + [
            "--speculative-adaptive",
            "--speculative-adaptive-config",
            cls.adaptive_config.name,
        ]

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        cls.adaptive_config.close()

    def test_zero_step_state_builds_no_graphs(self):
        with open(self.server_log) as log:
            startup = log.read()
        self.assertIn("Adaptive runtime state steps=0: run by the load-aware", startup)
        self.assertNotIn("Built adaptive runtime state steps=0", startup)

    def test_zero_step_tier_runs_plain_steps_and_resumes(self):
        self.run_mixed_batch(16, seed=8)
        after = scrape_metrics(self.base_url)
        plain = metric_total(
            after,
            "sglang:spec_decode_steps_total",
            mode="plain",
            reason="zero_draft_steps",
        )
        self.assertGreater(plain, 0, "no plain step in the 0-step tier")
        self.assertTrue(self.load_aware_state()["adaptive_zero_draft_steps"])
        prompt = self.prompts(1, seed=9)[0]
        out = post_concurrently(self.base_url, [(prompt, greedy_params(128))])[0]
        self.assert_outputs_intended([prompt], [out], [128])
        self.assertLessEqual(plain_step_tokens(out["meta_info"]), 0)
        predicted = self.predicted_accept_length()
        self.assertAlmostEqual(
            spec_accept_length([out["meta_info"]]), predicted, delta=0.2 * predicted
        )
        self.assert_server_alive_and_idle_clean()


if __name__ == "__main__":
    unittest.main()
