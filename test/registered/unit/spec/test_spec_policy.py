"""Unit tests for the load-aware speculation policy (srt/speculative/spec_policy.py).

No server, no model loading, no GPU: the policy is pure Python; decode_kv_reserve
reads the speculative server args published in the runtime context.
"""

import itertools
import json
import os
import random
import tempfile
import unittest
from types import SimpleNamespace

from sglang.srt.mem_cache.allocation_sizing import (
    get_alloc_len_per_decode,
    get_alloc_reserve_per_decode,
)
from sglang.srt.runtime_context import get_context
from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams
from sglang.srt.speculative.spec_policy import (
    REASON_DWELL,
    REASON_HIGH_LOAD,
    REASON_HYSTERESIS,
    REASON_LOW_LOAD,
    REASON_ZERO_DRAFT_STEPS,
    SpecPolicy,
    build_load_aware_policy,
    decode_kv_reserve,
    default_enable_batch_threshold,
    parse_disable_batch_threshold,
    speculative_capture_bs,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")


def reference_modes(sizes, n, m, dwell):
    """Independent restatement of the semantics, one step at a time."""
    speculating, plain_run, out = True, 0, []
    for bs in sizes:
        if bs >= n:
            speculating = False
        elif bs <= m and (speculating or plain_run >= dwell):
            speculating = True
        # Plain steps in the current plain run, this one included.
        plain_run = 0 if speculating else plain_run + 1
        out.append(speculating)
    return out


class TestSpecPolicyThresholds(CustomTestCase):
    def test_starts_speculating(self):
        policy = SpecPolicy(disable_batch_threshold=8, enable_batch_threshold=4)
        self.assertTrue(policy.speculating)
        self.assertEqual(policy.num_toggles, 0)

    def test_edge_sizes_from_speculating(self):
        n, m = 8, 4
        for bs, expected in [
            (0, True),
            (1, True),
            (m, True),
            (m + 1, True),
            (n - 1, True),
            (n, False),
            (n + 1, False),
            (10_000, False),
        ]:
            policy = SpecPolicy(n, m, min_dwell_steps=0)
            decision = policy.decide(bs)
            self.assertEqual(decision.speculate, expected, f"bs={bs}")
            self.assertEqual(decision.toggled, not expected, f"bs={bs}")

    def test_edge_sizes_from_plain_no_dwell(self):
        n, m = 8, 4
        for bs, expected in [
            (0, True),
            (1, True),
            (m, True),
            (m + 1, False),
            (n - 1, False),
            (n, False),
        ]:
            policy = SpecPolicy(n, m, min_dwell_steps=0)
            self.assertFalse(policy.decide(n).speculate)
            decision = policy.decide(bs)
            self.assertEqual(decision.speculate, expected, f"bs={bs}")
            self.assertEqual(decision.toggled, expected, f"bs={bs}")

    def test_reasons(self):
        policy = SpecPolicy(8, 4, min_dwell_steps=2)
        self.assertEqual(policy.decide(2).reason, REASON_LOW_LOAD)
        self.assertEqual(policy.decide(6).reason, REASON_HYSTERESIS)
        self.assertEqual(policy.decide(8).reason, REASON_HIGH_LOAD)
        self.assertEqual(policy.decide(6).reason, REASON_HYSTERESIS)
        # Two plain steps done (bs=8, bs=6): dwell of 2 elapsed.
        self.assertEqual(policy.decide(1).reason, REASON_LOW_LOAD)
        policy.decide(9)
        self.assertEqual(policy.decide(1).reason, REASON_DWELL)

    def test_smallest_thresholds(self):
        policy = SpecPolicy(disable_batch_threshold=2, min_dwell_steps=0)
        self.assertEqual(policy.enable_batch_threshold, 1)
        self.assertEqual(
            [policy.decide(bs).speculate for bs in [1, 2, 1, 2, 2, 1, 0]],
            [True, False, True, False, False, True, True],
        )

    def test_negative_batch_size_rejected(self):
        with self.assertRaises(ValueError):
            SpecPolicy(4, 2).decide(-1)

    def test_invalid_thresholds_rejected(self):
        for kwargs in [
            dict(disable_batch_threshold=1),
            dict(disable_batch_threshold=0),
            dict(disable_batch_threshold=4, enable_batch_threshold=4),
            dict(disable_batch_threshold=4, enable_batch_threshold=5),
            dict(disable_batch_threshold=4, enable_batch_threshold=0),
            dict(disable_batch_threshold=4, min_dwell_steps=-1),
        ]:
            with self.assertRaises(ValueError, msg=str(kwargs)):
                SpecPolicy(**kwargs)

    def test_default_enable_threshold(self):
        self.assertEqual(
            [default_enable_batch_threshold(n) for n in [2, 3, 4, 5, 8, 16, 64, 100]],
            [1, 2, 3, 4, 6, 12, 48, 75],
        )
        for n in range(2, 1000):
            m = default_enable_batch_threshold(n)
            self.assertTrue(1 <= m < n, n)
            self.assertEqual(SpecPolicy(n).enable_batch_threshold, m)

    def test_flag_values(self):
        self.assertEqual(parse_disable_batch_threshold("auto"), "auto")
        self.assertEqual(parse_disable_batch_threshold("16"), 16)
        with self.assertRaises(ValueError):
            parse_disable_batch_threshold("many")


class TestSpecPolicyDwell(CustomTestCase):
    def test_dwell_holds_plain(self):
        dwell = 5
        policy = SpecPolicy(8, 4, min_dwell_steps=dwell)
        self.assertFalse(policy.decide(8).speculate)  # plain step 1
        for step in range(2, dwell + 1):
            decision = policy.decide(1)
            self.assertFalse(decision.speculate, step)
            self.assertEqual(decision.reason, REASON_DWELL)
        decision = policy.decide(1)  # dwell plain steps done
        self.assertTrue(decision.speculate)
        self.assertTrue(decision.toggled)
        self.assertEqual(policy.get_state()["num_plain_steps"], dwell)

    def test_dwell_counts_hysteresis_and_high_load_steps(self):
        policy = SpecPolicy(8, 4, min_dwell_steps=3)
        policy.decide(9)
        policy.decide(6)
        policy.decide(20)
        self.assertTrue(policy.decide(4).speculate)

    def test_dwell_zero_resumes_immediately(self):
        policy = SpecPolicy(8, 4, min_dwell_steps=0)
        self.assertFalse(policy.decide(8).speculate)
        self.assertTrue(policy.decide(4).speculate)

    def test_dwell_restarts_on_each_switch_to_plain(self):
        policy = SpecPolicy(8, 4, min_dwell_steps=2)
        modes = [policy.decide(bs).speculate for bs in [8, 1, 1, 8, 1, 1]]
        self.assertEqual(modes, [False, False, True, False, False, True])

    def test_spec_to_plain_is_immediate_regardless_of_dwell(self):
        policy = SpecPolicy(8, 4, min_dwell_steps=100)
        self.assertTrue(policy.decide(7).speculate)
        self.assertFalse(policy.decide(8).speculate)


class TestSpecPolicySequences(CustomTestCase):
    def test_hysteresis_band_keeps_mode(self):
        policy = SpecPolicy(16, 8, min_dwell_steps=0)
        ramp = list(range(1, 31)) + list(range(30, 0, -1))
        modes = [policy.decide(bs).speculate for bs in ramp]
        # Up: speculating until 15, plain from 16 on.
        self.assertTrue(all(modes[:15]))
        self.assertFalse(any(modes[15:30]))
        # Down: plain until 9, speculating from 8 on.
        down = dict(zip(range(30, 0, -1), modes[30:]))
        self.assertFalse(any(down[bs] for bs in range(9, 31)))
        self.assertTrue(all(down[bs] for bs in range(1, 9)))
        self.assertEqual(policy.num_toggles, 2)

    def test_alternating_across_band_never_toggles_inside(self):
        policy = SpecPolicy(16, 8, min_dwell_steps=0)
        for bs in itertools.islice(itertools.cycle([9, 15]), 1000):
            self.assertTrue(policy.decide(bs).speculate)
        policy.decide(16)
        for bs in itertools.islice(itertools.cycle([9, 15]), 1000):
            self.assertFalse(policy.decide(bs).speculate)
        self.assertEqual(policy.num_toggles, 1)

    def test_alternating_across_both_thresholds_counts_toggles(self):
        policy = SpecPolicy(16, 8, min_dwell_steps=0)
        decisions = [policy.decide(bs) for bs in [16, 8] * 50]
        self.assertEqual(policy.num_toggles, 100)
        self.assertTrue(all(d.toggled for d in decisions))
        # With a dwell of 3, a resume needs 3 plain steps first.
        policy = SpecPolicy(16, 8, min_dwell_steps=3)
        modes = [policy.decide(bs).speculate for bs in [8, 16] * 50]
        self.assertEqual(
            modes[:8], [True, False, False, False, True, False, False, False]
        )
        self.assertEqual(policy.num_toggles, modes.count(True) * 2 - 1)

    def test_matches_reference_on_random_sequences(self):
        rng = random.Random(0)
        for trial in range(300):
            n = rng.randint(2, 40)
            m = rng.randint(1, n - 1)
            dwell = rng.randint(0, 10)
            sizes = [rng.randint(0, 2 * n) for _ in range(200)]
            policy = SpecPolicy(n, m, min_dwell_steps=dwell)
            decisions = [policy.decide(bs) for bs in sizes]
            modes = [d.speculate for d in decisions]
            self.assertEqual(modes, reference_modes(sizes, n, m, dwell), trial)
            # Invariants: speculation only below N; counters consistent.
            self.assertTrue(all(bs < n for bs, s in zip(sizes, modes) if s))
            toggles = sum(a != b for a, b in zip([True] + modes[:-1], modes))
            self.assertEqual(policy.num_toggles, toggles)
            self.assertEqual(sum(d.toggled for d in decisions), toggles)
            self.assertEqual(policy.get_state()["num_spec_steps"], sum(modes))
            self.assertEqual(
                policy.get_state()["num_plain_steps"], len(modes) - sum(modes)
            )
            self.assertEqual(policy.speculating, modes[-1])

    def test_get_state(self):
        policy = SpecPolicy(8, 4, min_dwell_steps=1)
        policy.decide(9)
        state = policy.get_state()
        self.assertEqual(state["speculating"], False)
        self.assertEqual(state["num_toggles"], 1)
        self.assertEqual(state["num_plain_steps"], 1)
        self.assertEqual(state["num_spec_steps"], 0)
        self.assertEqual(state["disable_batch_threshold"], 8)
        self.assertEqual(state["enable_batch_threshold"], 4)

    def test_each_switch_logs_one_line_with_its_step(self):
        policy = SpecPolicy(8, 4, min_dwell_steps=0)
        # The line of both policies (log_toggle).
        with self.assertLogs("sglang.srt.speculative.spec_policy", "INFO") as logs:
            for bs in (2, 9, 9, 6, 3, 3):
                policy.decide(bs)
        self.assertEqual(
            [record.getMessage() for record in logs.records],
            [
                "Load-aware speculation: plain from decode step 1 "
                "(running batch 9, high_load).",
                "Load-aware speculation: speculative from decode step 4 "
                "(running batch 3, low_load).",
            ],
        )


class TestSpeculativeCaptureBs(CustomTestCase):
    CAPTURE = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32, 48, 64]

    def test_feature_off_keeps_all(self):
        self.assertEqual(speculative_capture_bs(self.CAPTURE, None), self.CAPTURE)

    def test_prunes_to_smallest_size_covering_n_minus_1(self):
        self.assertEqual(speculative_capture_bs(self.CAPTURE, 9), self.CAPTURE[:8])
        self.assertEqual(speculative_capture_bs(self.CAPTURE, 10), self.CAPTURE[:9])
        # N-1 = 10 is captured: keep up to 10.
        self.assertEqual(speculative_capture_bs(self.CAPTURE, 11), self.CAPTURE[:9])
        # N-1 = 11 is not captured: keep up to 12.
        self.assertEqual(speculative_capture_bs(self.CAPTURE, 12), self.CAPTURE[:10])
        self.assertEqual(speculative_capture_bs(self.CAPTURE, 2), [1])
        self.assertEqual(speculative_capture_bs(self.CAPTURE, 1000), self.CAPTURE)

    def test_every_speculative_bs_is_covered(self):
        for n in range(2, 80):
            kept = speculative_capture_bs(self.CAPTURE, n)
            for bs in range(1, min(n, max(self.CAPTURE) + 1)):
                self.assertTrue(any(c >= bs for c in kept), (n, bs))
            # No size beyond the first one covering N-1.
            self.assertTrue(all(c < n - 1 for c in kept[:-1]), n)

    def test_input_not_modified(self):
        capture = list(self.CAPTURE)
        speculative_capture_bs(capture, 5)
        self.assertEqual(capture, self.CAPTURE)


def zero_at(*sizes):
    """zero_draft_steps of an adaptive config whose tiers run 0 steps at ``sizes``."""
    return lambda bs: bs in sizes


class TestSpecPolicyZeroDraftSteps(CustomTestCase):
    """--speculative-adaptive tiers at 0 draft steps: those decode steps run plain."""

    def test_adaptive_only_follows_the_tier(self):
        policy = SpecPolicy(None, zero_draft_steps=lambda bs: bs >= 32)
        self.assertIsNone(policy.enable_batch_threshold)
        decisions = [policy.decide(bs) for bs in [1, 31, 32, 100, 31, 1]]
        self.assertEqual(
            [d.speculate for d in decisions], [True, True, False, False, True, True]
        )
        self.assertEqual(
            [d.reason for d in decisions],
            [REASON_LOW_LOAD] * 2
            + [REASON_ZERO_DRAFT_STEPS] * 2
            + [REASON_LOW_LOAD] * 2,
        )
        self.assertEqual(
            [d.toggled for d in decisions], [False, False, True, False, True, False]
        )

    def test_zero_step_steps_are_counted_as_plain(self):
        policy = SpecPolicy(None, zero_draft_steps=zero_at(64))
        for bs in [64, 64, 1, 64, 1, 1]:
            policy.decide(bs)
        self.assertEqual(policy.get_state()["num_plain_steps"], 3)
        self.assertEqual(policy.get_state()["num_spec_steps"], 3)
        self.assertEqual(policy.num_toggles, 4)
        self.assertEqual(
            policy.step_counts,
            {("plain", REASON_ZERO_DRAFT_STEPS): 3, ("spec", REASON_LOW_LOAD): 3},
        )
        state = policy.get_state()
        self.assertTrue(state["adaptive_zero_draft_steps"])
        self.assertIsNone(state["disable_batch_threshold"])
        self.assertEqual(
            state["steps_by_reason"],
            {"plain/zero_draft_steps": 3, "spec/low_load": 3},
        )
        self.assertFalse(SpecPolicy(8).get_state()["adaptive_zero_draft_steps"])

    def test_the_tier_is_asked_at_each_step(self):
        """The tiers move with the acceptance: the policy asks them every step."""
        zero = set()
        policy = SpecPolicy(None, zero_draft_steps=lambda bs: bs in zero)
        self.assertTrue(policy.decide(8).speculate)
        zero.add(8)
        self.assertFalse(policy.decide(8).speculate)
        zero.clear()
        self.assertTrue(policy.decide(8).speculate)

    def test_thresholds_decide_first(self):
        """A zero-step tier makes a step plain only where the thresholds speculate;
        a plain step of the thresholds keeps its own reason."""
        policy = SpecPolicy(8, 4, min_dwell_steps=2, zero_draft_steps=zero_at(2, 6, 9))
        steps = [  # (bs, speculate, reason)
            (2, False, REASON_ZERO_DRAFT_STEPS),
            (3, True, REASON_LOW_LOAD),
            (6, False, REASON_ZERO_DRAFT_STEPS),  # band, thresholds speculating
            (5, True, REASON_HYSTERESIS),
            (9, False, REASON_HIGH_LOAD),  # plain by load, zero tier or not
            (6, False, REASON_HYSTERESIS),
            (3, True, REASON_LOW_LOAD),  # two plain steps: dwell elapsed
        ]
        for bs, speculate, reason in steps:
            decision = policy.decide(bs)
            self.assertEqual(
                (decision.speculate, decision.reason), (speculate, reason), bs
            )
        self.assertEqual(
            policy.step_counts,
            {
                ("plain", REASON_ZERO_DRAFT_STEPS): 2,
                ("spec", REASON_LOW_LOAD): 2,
                ("spec", REASON_HYSTERESIS): 1,
                ("plain", REASON_HIGH_LOAD): 1,
                ("plain", REASON_HYSTERESIS): 1,
            },
        )
        self.assertEqual(policy.num_toggles, 6)

    def test_zero_step_plain_steps_leave_hysteresis_alone(self):
        """Inside the band a zero-step plain step does not switch the thresholds'
        mode: the next non-zero step in the band speculates (no dwell)."""
        policy = SpecPolicy(16, 4, min_dwell_steps=100, zero_draft_steps=zero_at(10))
        self.assertFalse(policy.decide(10).speculate)
        decision = policy.decide(12)
        self.assertTrue(decision.speculate)
        self.assertEqual(decision.reason, REASON_HYSTERESIS)
        self.assertTrue(decision.toggled)

    def test_zero_step_plain_steps_do_not_start_a_dwell(self):
        policy = SpecPolicy(8, 4, min_dwell_steps=5, zero_draft_steps=zero_at(2))
        for _ in range(3):
            self.assertEqual(policy.decide(2).reason, REASON_ZERO_DRAFT_STEPS)
        decision = policy.decide(3)
        self.assertTrue(decision.speculate)
        self.assertEqual(decision.reason, REASON_LOW_LOAD)

    def test_matches_thresholds_and_tier_on_random_sequences(self):
        """Speculate iff the thresholds alone would and the tier is not at 0."""
        rng = random.Random(1)
        for trial in range(200):
            n = rng.randint(2, 40)
            m = rng.randint(1, n - 1)
            dwell = rng.randint(0, 10)
            zero = {bs for bs in range(2 * n + 1) if rng.random() < 0.3}
            sizes = [rng.randint(0, 2 * n) for _ in range(200)]
            thresholds_only = SpecPolicy(n, m, min_dwell_steps=dwell)
            policy = SpecPolicy(
                n, m, min_dwell_steps=dwell, zero_draft_steps=lambda bs: bs in zero
            )
            for step, bs in enumerate(sizes):
                expected = thresholds_only.decide(bs)
                decision = policy.decide(bs)
                if expected.speculate and bs in zero:
                    self.assertFalse(decision.speculate, (trial, step))
                    self.assertEqual(decision.reason, REASON_ZERO_DRAFT_STEPS)
                else:
                    self.assertEqual(
                        (decision.speculate, decision.reason),
                        (expected.speculate, expected.reason),
                        (trial, step),
                    )
            self.assertEqual(
                policy.get_state()["num_spec_steps"]
                + policy.get_state()["num_plain_steps"],
                len(sizes),
                trial,
            )
            self.assertEqual(sum(policy.step_counts.values()), len(sizes), trial)


def load_aware_args(**overrides):
    """The four server args build_load_aware_policy reads."""
    values = dict(
        speculative_disable_batch_threshold=None,
        speculative_enable_batch_threshold=None,
        speculative_load_aware_min_dwell_steps=8,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


class FakeAdaptiveParams:
    """The step count of each batch size, as AdaptiveSpeculativeParams routes it."""

    def __init__(self, steps_by_bs):
        self.steps_by_bs = steps_by_bs

    def get_steps_for_batch(self, batch_size: int) -> int:
        return self.steps_by_bs[batch_size]


def adaptive_worker(candidate_steps, params, plain_step=True):
    """A worker with an adaptive controller; ``plain_step``: whether it runs the
    plain step (build_plain_step gives None where the plain step cannot serve)."""
    return SimpleNamespace(
        adaptive_controller=SimpleNamespace(
            candidate_steps=candidate_steps, params=params
        ),
        plain_step=object() if plain_step else None,
    )


class TestBuildLoadAwarePolicy(CustomTestCase):
    def test_off_without_threshold_or_zero_step_tier(self):
        self.assertIsNone(build_load_aware_policy(load_aware_args()))
        self.assertIsNone(
            build_load_aware_policy(
                load_aware_args(), SimpleNamespace(adaptive_controller=None)
            )
        )
        worker = adaptive_worker([1, 3, 7], FakeAdaptiveParams({}))
        self.assertIsNone(build_load_aware_policy(load_aware_args(), worker))

    def test_thresholds(self):
        policy = build_load_aware_policy(
            load_aware_args(
                speculative_disable_batch_threshold=10,
                speculative_enable_batch_threshold=7,
                speculative_load_aware_min_dwell_steps=2,
            )
        )
        self.assertEqual(
            (
                policy.disable_batch_threshold,
                policy.enable_batch_threshold,
                policy.min_dwell_steps,
                policy.zero_draft_steps,
            ),
            (10, 7, 2, None),
        )
        # No enable threshold resolved yet: the policy's own default.
        policy = build_load_aware_policy(
            load_aware_args(speculative_disable_batch_threshold=16)
        )
        self.assertEqual(policy.enable_batch_threshold, 12)

    def test_adaptive_tiers_without_zero_steps_add_nothing(self):
        worker = adaptive_worker([1, 3, 7], FakeAdaptiveParams({}))
        policy = build_load_aware_policy(
            load_aware_args(speculative_disable_batch_threshold=8), worker
        )
        self.assertIsNone(policy.zero_draft_steps)
        self.assertTrue(policy.decide(7).speculate)

    def test_zero_step_tiers_of_a_worker_without_plain_step_add_nothing(self):
        worker = adaptive_worker([0, 1], FakeAdaptiveParams({}), plain_step=False)
        self.assertIsNone(build_load_aware_policy(load_aware_args(), worker))

    def test_zero_step_tier_alone_makes_a_policy(self):
        steps_by_bs = {1: 3, 8: 1, 64: 0}
        worker = adaptive_worker([0, 1, 3], FakeAdaptiveParams(steps_by_bs))
        policy = build_load_aware_policy(load_aware_args(), worker)
        self.assertIsNone(policy.disable_batch_threshold)
        self.assertEqual(policy.decide(1).reason, REASON_LOW_LOAD)
        self.assertEqual(policy.decide(64).reason, REASON_ZERO_DRAFT_STEPS)
        # The tier's current step count, read at each decision.
        steps_by_bs[8] = 0
        self.assertFalse(policy.decide(8).speculate)
        steps_by_bs[8] = 1
        self.assertTrue(policy.decide(8).speculate)

    def test_zero_step_tier_with_thresholds(self):
        worker = adaptive_worker([0, 1], FakeAdaptiveParams({4: 0, 5: 1, 20: 1}))
        policy = build_load_aware_policy(
            load_aware_args(
                speculative_disable_batch_threshold=16,
                speculative_enable_batch_threshold=8,
                speculative_load_aware_min_dwell_steps=0,
            ),
            worker,
        )
        self.assertEqual(policy.decide(4).reason, REASON_ZERO_DRAFT_STEPS)
        self.assertEqual(policy.decide(5).reason, REASON_LOW_LOAD)
        self.assertEqual(policy.decide(20).reason, REASON_HIGH_LOAD)

    def test_upstream_default_tiers(self):
        """With upstream's default adaptive config (bs >= 64: 0 steps only)."""
        params = AdaptiveSpeculativeParams(initial_steps=3)
        self.assertIn(0, params.candidate_steps)
        worker = adaptive_worker(params.candidate_steps, params)
        policy = build_load_aware_policy(load_aware_args(), worker)
        self.assertTrue(policy.decide(1).speculate)
        self.assertTrue(policy.decide(8).speculate)
        decision = policy.decide(64)
        self.assertFalse(decision.speculate)
        self.assertEqual(decision.reason, REASON_ZERO_DRAFT_STEPS)
        self.assertFalse(policy.decide(500).speculate)

    def test_adaptive_config_without_zero_steps(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "adaptive.json")
            with open(path, "w") as f:
                json.dump({"1": {"candidate_steps": [1, 3]}}, f)
            params = AdaptiveSpeculativeParams(initial_steps=3, cfg_path=path)
        worker = adaptive_worker(params.candidate_steps, params)
        self.assertIsNone(build_load_aware_policy(load_aware_args(), worker))


class TestPlanDecodeStep(CustomTestCase):
    def test_sets_this_and_previous_mode(self):
        batch = SimpleNamespace(
            size=2, spec_plain_step=False, spec_prev_plain_step=False
        )
        batch.batch_size = lambda: batch.size
        policy = SpecPolicy(8, 4, min_dwell_steps=0)
        expected = [  # (bs, spec_plain_step, spec_prev_plain_step)
            (2, False, False),
            (8, True, False),
            (9, True, True),
            (3, False, True),
            (3, False, False),
        ]
        for bs, plain, prev_plain in expected:
            batch.size = bs
            policy.plan_decode_step(batch)
            self.assertEqual(
                (batch.spec_plain_step, batch.spec_prev_plain_step),
                (plain, prev_plain),
                bs,
            )
        self.assertEqual(policy.get_state()["num_plain_steps"], 2)


class TestDecodeKvReserve(CustomTestCase):
    """KV length per request beyond kv_committed_len reserved for one decode step."""

    def reserve(self, plain, prev_plain):
        return decode_kv_reserve(
            SimpleNamespace(spec_plain_step=plain, spec_prev_plain_step=prev_plain)
        )

    def publish(self, **spec_args):
        override = get_context().override_server_args(
            speculative_algorithm="EAGLE", **spec_args
        )
        override.install()
        self.addCleanup(override.restore)

    def check(self, alloc_len):
        self.assertEqual(get_alloc_len_per_decode(), alloc_len)
        # A speculative step: upstream's reserve (twice a step's allocation).
        self.assertEqual(self.reserve(False, False), get_alloc_reserve_per_decode())
        self.assertEqual(self.reserve(False, True), 2 * alloc_len)
        # A plain step after a plain step: its token and the previous one's.
        self.assertEqual(self.reserve(True, True), 2)
        # A plain step after a speculative step: its token and up to a whole
        # speculative step's, not committed yet under overlap.
        self.assertEqual(self.reserve(True, False), alloc_len + 1)

    def test_chain(self):
        self.publish(
            speculative_num_steps=3,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=4,
            page_size=1,
        )
        self.check(alloc_len=4)

    def test_tree(self):
        self.publish(
            speculative_num_steps=3,
            speculative_eagle_topk=4,
            speculative_num_draft_tokens=8,
            page_size=1,
        )
        self.check(alloc_len=12)  # steps * topk

    def test_tree_at_page_size_16(self):
        self.publish(
            speculative_num_steps=3,
            speculative_eagle_topk=4,
            speculative_num_draft_tokens=8,
            page_size=16,
        )
        self.check(alloc_len=128)  # two pages per branch

    def test_plain_steps_reserve_less(self):
        self.publish(
            speculative_num_steps=5,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=6,
            page_size=1,
        )
        self.assertLess(self.reserve(True, False), self.reserve(False, False))
        self.assertLess(self.reserve(True, True), self.reserve(True, False))


if __name__ == "__main__":
    unittest.main()
