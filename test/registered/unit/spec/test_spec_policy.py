"""Unit tests for the load-aware speculation policy (srt/speculative/spec_policy.py).

Pure Python: no server, no model loading, no GPU.
"""

import itertools
import random
import unittest

from sglang.srt.speculative.spec_policy import (
    DECISION_REASONS,
    REASON_DWELL,
    REASON_HIGH_LOAD,
    REASON_HYSTERESIS,
    REASON_LOW_LOAD,
    SpecPolicy,
    default_enable_batch_threshold,
    speculative_capture_bs,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")


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
        for reason in (REASON_LOW_LOAD, REASON_HYSTERESIS, REASON_HIGH_LOAD):
            self.assertIn(reason, DECISION_REASONS)

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
        self.assertEqual(policy.num_plain_steps, dwell)

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
            self.assertEqual(policy.num_spec_steps, sum(modes))
            self.assertEqual(policy.num_plain_steps, len(modes) - sum(modes))
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
        with self.assertLogs("sglang.srt.speculative.spec_policy", "INFO") as logs:
            for bs in (2, 9, 9, 6, 3, 3):
                policy.decide(bs)
        self.assertEqual(
            [record.getMessage() for record in logs.records],
            [
                "Load-aware speculation: plain from decode step 1 (running batch 9).",
                "Load-aware speculation: speculative from decode step 4 (running batch 3).",
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


if __name__ == "__main__":
    unittest.main()
