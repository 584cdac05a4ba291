"""Load-aware speculation end to end on a CPU: an EAGLE-3 ``sglang.Engine`` on the
synthetic pair (sglang.test.cpu_spec_engine), one engine per class.

The threshold and adaptive classes run mixed-length concurrent requests (all but
the longest end during plain steps) and a lone request; the threshold classes also
a long request that other requests push to plain steps and back every few steps.
One class runs a KV pool too small for its requests (retractions) while some of
them are aborted, one xgrammar regex and JSON-schema constraints (its tokenizer
spells a JSON object's opener and closer), three the ``auto`` policy (alone, with
the adaptive mode, and at TP 2: two ranks on this CPU). Every output is
compared token for token with the synthetic target's greedy continuation. The
draft is the KV-check variant: it proposes right only if the draft KV at the
previous position is what the draft writes there, so a stale draft KV where the
plain steps stopped would drop the first speculative round after each resume to
accept length 1. The scheduler's busy KV leak check runs after every step and
the idle one whenever it idles (a leak kills the engine, failing the test).
"""

import asyncio
import json
import os
import tempfile
import time
import unittest
from typing import Dict, List, Optional, Sequence, Tuple

from sglang.srt.speculative.throughput_policy import power_of_two_buckets
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.cpu_spec_engine import cpu_spec_engine
from sglang.test.spec_engine_utils import (
    EAGLE3_CHAIN,
    EAGLE3_TREE,
    LEAK_CHECK_ENV,
    accept_length,
    eagle3_args,
    greedy_params,
    load_benchmark_script,
    plain_step_tokens,
    random_prompts,
    synthetic_pair,
)
from sglang.test.synthetic_spec_models import (
    detoured_continuation,
    expected_accept_length,
    greedy_continuation,
    next_token_map,
    token_regex,
    write_json_object_tokenizer,
)
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=1050, suite="base-a-test-cpu")

DRAFT_ACCEPT = 0.8
PROMPT_LEN = 16
MIXED_LENGTHS = [7 + 5 * i for i in range(8)]
RESUMED_REQUEST_TOKENS = 128
LONE_REQUEST_TOKENS = 128
# Measured accept length vs expected_accept_length, per request of 128 tokens on
# this pair: within about 12%. A stale draft KV gives 1 in the rounds after a
# resume: with a resume before at least every other round, < (predicted + 1) / 2.
ACCEPT_TOLERANCE = 0.2


def object_schema(value: str) -> str:
    """JSON schema of exactly the object {"a": value}."""
    return json.dumps(
        {
            "type": "object",
            "properties": {"a": {"type": "string", "pattern": f"^{value}$"}},
            "required": ["a"],
            "additionalProperties": False,
        }
    )


class CpuEngineTestBase(CustomTestCase):
    """One engine per class (subclasses: its speculative and load-aware args)."""

    spec = EAGLE3_CHAIN
    engine_args: Dict[str, object] = {}
    # --speculative-adaptive with these tiers: {batch size: candidate step counts}.
    adaptive_tiers: Optional[Dict[int, List[int]]] = None
    # Whether auto writes its step trace (to cls.trace_path).
    step_trace = False
    seed = 0
    # "eagle": synthetic_pair's EAGLE draft (acceptance 1) instead of the KV-check
    # EAGLE-3 head.
    draft_arch = "eagle3"
    preset = "tiny"

    @classmethod
    def setUpClass(cls):
        eagle3 = cls.draft_arch == "eagle3"
        cls.draft_accept = DRAFT_ACCEPT if eagle3 else 1.0
        cls.target, cls.draft = synthetic_pair(
            cls.preset,
            cls.draft_accept,
            draft_kv_check=eagle3,
            draft_arch=cls.draft_arch,
        )
        cls.token_map = next_token_map(cls.target.rsplit("/", 1)[0])
        cls._tmp = tempfile.TemporaryDirectory()
        engine_args = dict(cls.engine_args, **cls.setup_engine_args())
        env = dict(LEAK_CHECK_ENV)
        if cls.adaptive_tiers is not None:
            config = os.path.join(cls._tmp.name, "adaptive.json")
            with open(config, "w") as f:
                tiers = {
                    str(bs): {"candidate_steps": c}
                    for bs, c in cls.adaptive_tiers.items()
                }
                json.dump(tiers, f)
            engine_args.update(
                speculative_adaptive=True, speculative_adaptive_config=config
            )
        if cls.step_trace:
            cls.trace_path = os.path.join(cls._tmp.name, "steps.jsonl")
            env["SGLANG_LOAD_AWARE_STEP_TRACE"] = cls.trace_path
        cls._engine = cpu_spec_engine(
            env=env,
            model_path=cls.target,
            **eagle3_args(cls.draft, **cls.spec, draft_arch=cls.draft_arch),
            **engine_args,
        )
        try:
            cls.engine = cls._engine.__enter__()
        except BaseException:
            cls._tmp.cleanup()
            raise

    @classmethod
    def setup_engine_args(cls) -> Dict[str, object]:
        """Engine args made at class setup (after cls.target and cls._tmp)."""
        return {}

    @classmethod
    def tearDownClass(cls):
        cls._engine.__exit__(None, None, None)
        cls._tmp.cleanup()

    def prompts(self, num: int, seed: int) -> List[List[int]]:
        return random_prompts(
            num, PROMPT_LEN, len(self.token_map), seed=self.seed * 1000 + seed
        )

    def assert_outputs_intended(
        self,
        prompts: Sequence[List[int]],
        outputs: Sequence[dict],
        lengths: Sequence[int],
    ) -> None:
        for i, (prompt, out, n) in enumerate(zip(prompts, outputs, lengths)):
            intended = greedy_continuation(self.token_map, prompt, n)
            self.assertEqual(out["output_ids"], intended, f"request {i}")
            self.assertEqual(out["meta_info"]["finish_reason"]["type"], "length")

    def load_aware_state(self) -> dict:
        return self.engine.get_server_info()["internal_states"][0][
            "load_aware_speculation"
        ]

    def assert_accept_length_predicted(self, outputs: Sequence[dict]) -> None:
        measured = accept_length(outputs)
        predicted = expected_accept_length(
            self.draft_accept, self.spec["num_steps"], self.spec["topk"]
        )
        print(f"[cpu-engine] accept length {measured:.3f}, predicted {predicted:.3f}")
        self.assertAlmostEqual(measured, predicted, delta=ACCEPT_TOLERANCE * predicted)

    def assert_all_but_the_longest_plain(self, outputs: Sequence[dict]) -> None:
        """The requests of a mixed batch that end while 2 or more run: only plain
        decode steps (no verify step); the longest: some."""
        metas = [o["meta_info"] for o in outputs]
        for i, meta in enumerate(metas[:-1]):
            self.assertEqual(meta.get("spec_verify_ct", 0), 0, f"request {i}")
            self.assertEqual(plain_step_tokens(meta), meta["completion_tokens"] - 1)
        self.assertGreater(plain_step_tokens(metas[-1]), 0)

    def assert_engine_alive(self) -> None:
        """The idle KV leak check ran (the engine was idle); a leak killed it."""
        time.sleep(1)
        prompt = self.prompts(1, seed=999)[0]
        out = self.engine.generate(input_ids=prompt, sampling_params=greedy_params(2))
        self.assert_outputs_intended([prompt], [out], [2])

    def run_mixed_batch(self, seed: int) -> List[dict]:
        """Concurrent requests of different lengths (ascending), sent as one batch."""
        prompts = self.prompts(len(MIXED_LENGTHS), seed)
        outputs = self.engine.generate(
            input_ids=prompts,
            sampling_params=[greedy_params(n) for n in MIXED_LENGTHS],
        )
        self.assert_outputs_intended(prompts, outputs, MIXED_LENGTHS)
        return outputs

    def run_lone_request(self, seed: int) -> dict:
        return self.run_lone_request_of(self.prompts(1, seed)[0])

    def run_lone_request_of(self, prompt: List[int]) -> dict:
        out = self.engine.generate(
            input_ids=prompt, sampling_params=greedy_params(LONE_REQUEST_TOKENS)
        )
        self.assert_outputs_intended([prompt], [out], [LONE_REQUEST_TOKENS])
        return out


class ThresholdTests:
    """--speculative-disable-batch-threshold 2 (enable at 1, no dwell): every
    decode step of a batch of 2 or more is plain."""

    engine_args = dict(
        speculative_disable_batch_threshold=2,
        speculative_enable_batch_threshold=1,
        speculative_load_aware_min_dwell_steps=0,
    )

    def test_mixed_lengths_end_in_plain_steps_then_a_lone_request_speculates(self):
        outputs = self.run_mixed_batch(seed=1)
        self.assert_all_but_the_longest_plain(outputs)
        state = self.load_aware_state()
        print(f"[cpu-engine] {state}")
        self.assertGreater(state["steps_by_reason"]["plain/high_load"], 0)
        out = self.run_lone_request(seed=4)
        self.assertEqual(plain_step_tokens(out["meta_info"]), 0)
        self.assert_accept_length_predicted([out])
        self.assert_engine_alive()

    def test_frequent_resumes_keep_the_draft_kv_current(self):
        state_before = self.load_aware_state()
        prompt = self.prompts(1, seed=2)[0]
        out, shorts = self.engine.loop.run_until_complete(
            self.long_request_with_interruptions(prompt, RESUMED_REQUEST_TOKENS, seed=3)
        )
        self.assert_outputs_intended([prompt], [out], [RESUMED_REQUEST_TOKENS])
        self.assert_outputs_intended(*zip(*shorts), [2] * len(shorts))
        resumes = (
            self.load_aware_state()["num_toggles"] - state_before["num_toggles"]
        ) // 2
        verify_steps = out["meta_info"]["spec_verify_ct"]
        print(f"[cpu-engine] {resumes} resumes, {verify_steps} verify steps")
        # With a stale draft KV, this many rounds after a resume would pull the
        # accept length below the tolerance.
        self.assertGreaterEqual(resumes, verify_steps // 2)
        self.assertGreater(plain_step_tokens(out["meta_info"]), 0)
        self.assert_accept_length_predicted([out])
        self.assert_engine_alive()

    def test_a_prompt_drafts_alike_prefilled_while_speculating_or_plain(self):
        """A prefill writes the draft KV only. While speculating, the draft's
        proposal at the prompt's end runs at once; after plain steps, the resume
        before the request's first speculative step runs it. The request's verify
        rounds must be the same either way (the kv-check draft proposes right only
        on valid draft KV)."""
        prompt = self.prompts(1, seed=5)[0]
        self.run_lone_request(seed=6)  # a speculative step: nothing pending
        prefills_before = self.load_aware_state()["draft_prefills_kv_only"]
        reference = self.run_lone_request_of(prompt)
        self.assertEqual(
            self.load_aware_state()["draft_prefills_kv_only"], prefills_before + 1
        )
        self.assertTrue(self.engine.flush_cache().success)  # no cached prompt KV
        self.run_equal_lengths_to_the_end_in_plain_steps(seed=7)
        prefills_before = self.load_aware_state()["draft_prefills_kv_only"]
        out = self.run_lone_request_of(prompt)
        self.assertEqual(
            self.load_aware_state()["draft_prefills_kv_only"], prefills_before + 1
        )
        for key in ("spec_verify_ct", "spec_num_correct_drafts"):
            self.assertEqual(out["meta_info"][key], reference["meta_info"][key], key)
        self.assert_engine_alive()

    def run_equal_lengths_to_the_end_in_plain_steps(self, seed: int) -> None:
        prompts = self.prompts(2, seed)
        outputs = self.engine.generate(
            input_ids=prompts, sampling_params=greedy_params(LONE_REQUEST_TOKENS // 8)
        )
        self.assert_outputs_intended(prompts, outputs, [LONE_REQUEST_TOKENS // 8] * 2)
        for out in outputs:
            self.assertEqual(out["meta_info"].get("spec_verify_ct", 0), 0)

    async def long_request_with_interruptions(
        self, prompt: List[int], num_tokens: int, seed: int
    ) -> Tuple[dict, List[Tuple[List[int], dict]]]:
        """One request, and 2-token requests one after another until it ends:
        each takes it to plain steps (batch 2) and back."""
        long_request = asyncio.ensure_future(
            self.engine.async_generate(
                input_ids=prompt, sampling_params=greedy_params(num_tokens)
            )
        )
        shorts = []
        for short in self.prompts(num_tokens, seed):
            if long_request.done():
                break
            out = await self.engine.async_generate(
                input_ids=short, sampling_params=greedy_params(2)
            )
            shorts.append((short, out))
            await asyncio.sleep(0.02)
        return await long_request, shorts


class TestChainThresholdOverlap(ThresholdTests, CpuEngineTestBase):
    """Chain (3 steps, topk 1), overlap scheduler."""

    spec = EAGLE3_CHAIN
    seed = 1


class TestEagleDraftChainThresholdOverlap(ThresholdTests, CpuEngineTestBase):
    """The chain with an EAGLE draft (LlamaForCausalLMEagle), which writes its KV
    alone on plain steps too. The synthetic EAGLE draft proposes what the target
    decodes whatever its KV holds: this checks that such a draft takes the KV-only
    path end to end (plain steps, prefills, resumes) at full acceptance, not the
    KV it writes (test_eagle_draft_kv_only checks that)."""

    draft_arch = "eagle"
    seed = 3


class TestQwen2EagleDraftChainThresholdOverlap(TestEagleDraftChainThresholdOverlap):
    """The same with the EAGLE draft of a Qwen2 target (Qwen2ForCausalLMEagle)."""

    preset = "tiny-qwen2"


class TestTreeThresholdNoOverlap(ThresholdTests, CpuEngineTestBase):
    """Draft tree (2 steps, topk 4, 16 draft tokens), the synchronous path."""

    spec = EAGLE3_TREE
    engine_args = dict(ThresholdTests.engine_args, disable_overlap_schedule=True)
    seed = 2


class TestAdaptiveZeroStepTier(CpuEngineTestBase):
    """--speculative-adaptive alone, 0 draft steps from a running batch of 2: those
    decode steps are the plain step."""

    spec = EAGLE3_CHAIN
    adaptive_tiers = {1: [3], 2: [0]}
    seed = 3

    def test_zero_step_tier_runs_plain_steps_then_speculates(self):
        outputs = self.run_mixed_batch(seed=1)
        self.assert_all_but_the_longest_plain(outputs)
        state = self.load_aware_state()
        print(f"[cpu-engine] {state}")
        self.assertTrue(state["adaptive_zero_draft_steps"])
        self.assertGreater(state["steps_by_reason"].get("plain/zero_draft_steps", 0), 0)
        out = self.run_lone_request(seed=2)
        self.assertEqual(plain_step_tokens(out["meta_info"]), 0)
        self.assert_accept_length_predicted([out])
        self.assert_engine_alive()


class TestChainThresholdKVPressureAndAborts(CpuEngineTestBase):
    """Threshold 2 with a KV pool a third of what the requests need: the scheduler
    retracts requests in both modes and across switches, while some requests are
    aborted mid-generation; the rest still get the intended tokens, the aborted
    ones a prefix of them, and no KV slot leaks (the idle check)."""

    spec = EAGLE3_CHAIN
    engine_args = dict(
        ThresholdTests.engine_args, max_total_tokens=640, schedule_conservativeness=0.05
    )
    seed = 5
    num_requests = 16
    output_len = 96
    aborted = (1, 6, 11)

    def test_retractions_and_aborts_keep_the_other_requests_intended(self):
        prompts = self.prompts(self.num_requests, seed=1)
        outputs = self.engine.loop.run_until_complete(self.generate_and_abort(prompts))
        kept = [i for i in range(self.num_requests) if i not in self.aborted]
        for i, out in enumerate(outputs):
            print(
                f"[cpu-engine] request {i}: {len(out['output_ids'])} tokens, "
                f"{out['meta_info']['finish_reason']}, "
                f"{out['meta_info'].get('num_retractions')} retractions"
            )
        self.assert_outputs_intended(
            [prompts[i] for i in kept],
            [outputs[i] for i in kept],
            [self.output_len] * len(kept),
        )
        for i in self.aborted:
            out = outputs[i]
            self.assertEqual(out["meta_info"]["finish_reason"]["type"], "abort", i)
            intended = greedy_continuation(self.token_map, prompts[i], self.output_len)
            self.assertEqual(out["output_ids"], intended[: len(out["output_ids"])], i)
        retractions = sum(o["meta_info"].get("num_retractions", 0) for o in outputs)
        print(f"[cpu-engine] {retractions} retractions, {self.load_aware_state()}")
        self.assertGreater(retractions, 0, "the pool never ran short")
        self.assertGreater(plain_step_tokens(outputs[kept[-1]]["meta_info"]), 0)
        self.assert_engine_alive()

    async def generate_and_abort(self, prompts: List[List[int]]) -> List[dict]:
        # Aborts match rids by prefix: none is a prefix of another.
        rids = [f"kv-pressure-{i:03d}." for i in range(len(prompts))]
        return await asyncio.gather(
            *(
                self.generate(prompt, rid, abort=i in self.aborted)
                for i, (prompt, rid) in enumerate(zip(prompts, rids))
            )
        )

    async def generate(self, prompt: List[int], rid: str, abort: bool) -> dict:
        """The request's output; with abort, aborted once it has half its tokens (a
        fixed delay let fast runs finish it first)."""
        params = dict(input_ids=prompt, sampling_params=greedy_params(self.output_len))
        if not abort:
            return await self.engine.async_generate(**params, rid=rid)
        chunk, aborted = None, False
        async for chunk in await self.engine.async_generate(
            **params, rid=rid, stream=True
        ):
            if not aborted and len(chunk["output_ids"]) >= self.output_len // 2:
                self.engine.tokenizer_manager.abort_request(rid)
                aborted = True
        return chunk


class TestTreeThresholdRetractsLikeNoSpeculation(CpuEngineTestBase):
    """Under KV pressure (the pool of TestChainThresholdKVPressureAndAborts), a
    load-aware draft-tree server whose steps are plain retracts the same requests
    as a server without speculation: its decode steps reserve the KV of a plain
    step (2 tokens per request; a speculative tree step reserves 32), decided
    before the memory check. Reserving for speculative steps there retracts 6
    requests instead of these 4."""

    spec = EAGLE3_TREE
    pool_args = dict(max_total_tokens=640, schedule_conservativeness=0.05)
    engine_args = dict(ThresholdTests.engine_args, **pool_args)
    seed = 7
    num_requests = 16
    output_len = 96

    def retractions(self, engine, prompts: List[List[int]]) -> List[int]:
        outputs = engine.generate(
            input_ids=prompts,
            sampling_params=[greedy_params(self.output_len)] * len(prompts),
        )
        self.assert_outputs_intended(prompts, outputs, [self.output_len] * len(prompts))
        return [o["meta_info"].get("num_retractions", 0) for o in outputs]

    def test_the_same_requests_are_retracted_as_without_speculation(self):
        prompts = self.prompts(self.num_requests, seed=1)
        load_aware = self.retractions(self.engine, prompts)
        with cpu_spec_engine(
            env=LEAK_CHECK_ENV, model_path=self.target, **self.pool_args
        ) as no_speculation:
            reference = self.retractions(no_speculation, prompts)
        print(f"[cpu-engine] retractions {load_aware}, without speculation {reference}")
        self.assertGreater(sum(reference), 0, "the pool never ran short")
        self.assertEqual(load_aware, reference)


class TestChainThresholdGrammar(CpuEngineTestBase):
    """xgrammar regex and JSON-schema constraints through plain steps, speculative
    steps and the switches between them: each request's grammar forces one token
    the target would not pick (a detour), so its output follows the greedy map only
    where the grammar's mask, advanced over every committed token, allows it. The
    engine's tokenizer renames two tokens the target never emits to ``{"a":"`` and
    ``"}``, so a schema can force the object ``{"a":"<detoured tokens>"}``."""

    spec = EAGLE3_CHAIN
    engine_args = dict(
        ThresholdTests.engine_args,
        grammar_backend="xgrammar",
        skip_tokenizer_init=False,
    )
    seed = 6
    lengths = (12, 20, 28, 40)

    @classmethod
    def setup_engine_args(cls) -> Dict[str, object]:
        tokenizer_dir = os.path.join(cls._tmp.name, "json-tokenizer")
        cls.opener, cls.closer = write_json_object_tokenizer(cls.target, tokenizer_dir)
        return dict(tokenizer_path=tokenizer_dir)

    def detoured(self, contexts: Sequence[List[int]]) -> List[List[int]]:
        """Each request's detoured continuation of its context, self.lengths tokens.
        The last request's detour comes after the others ended: in its speculative
        steps; the others' during plain steps."""
        detour_at = [n // 2 for n in self.lengths[:-1]] + [self.lengths[-1] - 4]
        return [
            detoured_continuation(self.token_map, context, n, at)
            for context, n, at in zip(contexts, self.lengths, detour_at)
        ]

    def assert_plain_then_speculative(self, outputs: Sequence[dict]) -> None:
        """The longest request also ran verify steps; the others only plain ones."""
        self.assertGreater(outputs[-1]["meta_info"]["spec_verify_ct"], 0)
        self.assert_all_but_the_longest_plain(outputs)

    def test_regex_detours_hold_in_plain_and_speculative_steps(self):
        prompts = self.prompts(len(self.lengths), seed=1)
        wanted = self.detoured(prompts)
        params = [
            dict(greedy_params(n), regex=token_regex(tokens))
            for n, tokens in zip(self.lengths, wanted)
        ]
        outputs = self.engine.generate(input_ids=prompts, sampling_params=params)
        for i, (out, tokens) in enumerate(zip(outputs, wanted)):
            self.assertEqual(out["output_ids"], tokens, f"request {i}")
        self.assert_plain_then_speculative(outputs)
        self.assert_engine_alive()

    def test_json_schema_detours_hold_in_plain_and_speculative_steps(self):
        prompts = self.prompts(len(self.lengths), seed=2)
        # The opener is the only token the schema allows first (xgrammar's JSON
        # grammar admits it with any whitespace, sglang's default; without, it
        # wants '": "'); the string's tokens continue from it.
        values = self.detoured([[self.opener]] * len(prompts))
        for tokens in prompts + values:
            self.assertNotIn(self.opener, tokens)
            self.assertNotIn(self.closer, tokens)
        params = [
            dict(greedy_params(len(v) + 2), json_schema=object_schema(token_regex(v)))
            for v in values
        ]
        outputs = self.engine.generate(input_ids=prompts, sampling_params=params)
        for i, (out, value) in enumerate(zip(outputs, values)):
            self.assertEqual(
                out["output_ids"], [self.opener] + value + [self.closer], f"request {i}"
            )
            # The tokenizer has no decoder: its text joins the tokens with spaces.
            spaced = "".join(f" w{t}" for t in value) + " "
            self.assertEqual(json.loads(out["text"]), {"a": spaced}, f"request {i}")
        self.assert_plain_then_speculative(outputs)
        self.assert_engine_alive()


class TestChainAutoOverlap(CpuEngineTestBase):
    """--speculative-disable-batch-threshold auto: the engine times its own plain
    and speculative steps (here on a CPU, eager) and runs the faster one; its step
    trace replays through policy_sim.py."""

    spec = EAGLE3_CHAIN
    engine_args = dict(
        speculative_disable_batch_threshold="auto",
        speculative_load_aware_min_dwell_steps=0,
    )
    step_trace = True
    seed = 4

    def test_times_both_modes_and_serves_the_intended_tokens(self):
        outputs = self.run_mixed_batch(seed=1)
        outputs.append(self.run_lone_request(seed=2))
        state = self.load_aware_state()
        print(f"[cpu-engine] {state}")
        self.assertEqual(state["policy"], "auto")
        plain, spec = state["step_costs_seconds"]["0"], state["step_costs_seconds"]["3"]
        both = [bs for bs in plain if plain[bs] is not None and spec[bs] is not None]
        self.assertTrue(both, "no batch bucket timed in both modes")
        # The buckets reach the running limit the scheduler enforces, no further.
        internal = self.engine.get_server_info()["internal_states"][0]
        running_limit = internal["effective_max_running_requests_per_dp"]
        self.assertEqual(max(map(int, plain)), power_of_two_buckets(running_limit)[-1])
        self.assertGreater(state["num_calibrations"], 0)
        steps = state["steps_by_reason"]
        self.assertGreater(
            sum(n for k, n in steps.items() if k.startswith("plain/")), 0
        )
        self.assertGreater(sum(n for k, n in steps.items() if k.startswith("spec/")), 0)
        predicted = expected_accept_length(DRAFT_ACCEPT, self.spec["num_steps"], 1)
        self.assertAlmostEqual(
            state["accept_length"]["3"], predicted, delta=0.25 * predicted
        )
        self.assert_engine_alive()
        self.assert_trace_replays(state, predicted)

    def assert_trace_replays(self, state: dict, predicted: float) -> None:
        sim = load_benchmark_script("policy_sim")
        with open(self.trace_path) as f:
            trace = [json.loads(line) for line in f]
        verifies = [r for r in trace if "num_requests" in r]
        per_request = sum(r["num_tokens"] for r in verifies) / sum(
            r["num_requests"] for r in verifies
        )
        self.assertAlmostEqual(per_request, predicted, delta=0.25 * predicted)
        env = sim.environment_from_trace(trace, sim.trace_buckets(trace))
        self.assertEqual(set(env.costs), {0, 3})
        # Every decode step is decided, timed or not.
        wall = sim.step_wall_times(trace)
        self.assertGreaterEqual(wall["decode_steps"], len(sim.step_records(trace)))
        self.assertGreater(wall["switches"], 0)
        # The run's timeline with each step held 50 times as long. Once over, it
        # lasts a few seconds, in which auto's calibration steps at each bucket are
        # too large a share to compare policies by; and a batch size held for one
        # plain step would pass within one speculative step (several plain ones on
        # a CPU) before a policy running those could see it.
        phases = [(bs, 50 * seconds) for bs, seconds in sim.phases_of_trace(trace)]
        results = {
            policy: sim.simulate(sim.make_policy(policy, env), env, phases)
            for policy in ("nospec", "always", "auto")
        }
        print(f"[cpu-engine] trace replay {results}")
        # Which static policy is the better one depends on the CPU's load (another
        # busy process makes a speculative step relatively cheaper): auto, choosing
        # per bucket, must beat the worse one whichever it is.
        rate = {p: r["tokens_per_second"] for p, r in results.items()}
        self.assertGreater(rate["auto"], min(rate["nospec"], rate["always"]))


class TestChainAutoTensorParallel(CpuEngineTestBase):
    """auto at TP 2 (two ranks on this CPU, all-reducing through gloo): the ranks'
    sums of their step times (a CPU all-reduce every few steps) line up, every
    output is the intended one, and both ranks take the same decision at every
    step (their step traces). On a CPU a speculative step costs several plain
    ones, so the decisions are far from the margin: a lost sum would hang the
    ranks rather than part their decisions."""

    spec = EAGLE3_CHAIN
    engine_args = dict(
        speculative_disable_batch_threshold="auto",
        speculative_load_aware_min_dwell_steps=0,
        tp_size=2,
    )
    step_trace = True
    seed = 6

    def test_ranks_take_the_same_decisions(self):
        self.run_mixed_batch(seed=1)
        self.run_lone_request(seed=2)
        rank0, rank1 = (self.decisions_of_rank(rank) for rank in range(2))
        print(f"[cpu-engine] {len(rank0)} decisions per rank")
        self.assertEqual(rank1, rank0)
        self.assertEqual({num_steps for num_steps, _, _ in rank0}, {0, 3})
        self.assert_engine_alive()

    def decisions_of_rank(self, rank: int) -> List[Tuple[int, str, int]]:
        with open(f"{self.trace_path}.tp{rank}") as f:
            records = [json.loads(line) for line in f]
        return [
            (r["decision"], r["reason"], r["batch_size"])
            for r in records
            if "decision" in r
        ]


class TestChainAutoAdaptive(CpuEngineTestBase):
    """auto with --speculative-adaptive: each decode step runs plain, 1 or 3 draft
    steps (the adaptive candidates), whichever it expects to be fastest; every
    verify is counted at the step count it ran."""

    spec = EAGLE3_CHAIN
    engine_args = dict(
        speculative_disable_batch_threshold="auto",
        speculative_load_aware_min_dwell_steps=0,
    )
    adaptive_tiers = {1: [1, 3]}
    step_trace = True
    seed = 5

    def test_times_every_step_count_and_serves_the_intended_tokens(self):
        self.run_mixed_batch(seed=1)
        self.run_lone_request(seed=2)
        state = self.load_aware_state()
        print(f"[cpu-engine] {state}")
        costs = state["step_costs_seconds"]
        self.assertEqual(set(costs), {"0", "1", "3"})
        timed = {mode for mode, by_bs in costs.items() if any(by_bs.values())}
        self.assertEqual(timed, {"0", "1", "3"})
        with open(self.trace_path) as f:
            verifies = [r for r in map(json.loads, f) if "num_requests" in r]
        self.assertEqual({r["num_steps"] for r in verifies}, {1, 3})
        for r in verifies:  # a verify of s draft steps commits at most s + 1 each
            self.assertLessEqual(
                r["num_tokens"], (r["num_steps"] + 1) * r["num_requests"]
            )
        self.assertGreater(state["accept_length"]["3"], state["accept_length"]["1"])
        self.assert_engine_alive()


if __name__ == "__main__":
    unittest.main()
