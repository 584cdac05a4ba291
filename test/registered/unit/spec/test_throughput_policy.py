"""The throughput policy of load-aware speculation (srt/speculative/throughput_policy.py):
each decode step runs the mode with the best expected tokens per second.

Pure Python: no server, no model loading, no GPU. The cost tables are fixtures of the
shape a startup profile has (seconds per captured batch size), not measurements.
"""

import unittest

from sglang.srt.speculative.throughput_policy import (
    PLAIN,
    REASON_BEST,
    REASON_DWELL,
    REASON_MARGIN,
    REASON_PROBE,
    AcceptanceEstimate,
    StepCosts,
    ThroughputPolicy,
    chain_accept_length,
    fit_chain_acceptance,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

SIZES = [1, 8, 32, 64, 128, 256]
# A plain step's time grows slowly with the batch, a speculative one's (verify of 4
# tokens per request, and the draft) fast: speculation pays at small batches only.
PLAIN_SECONDS = [0.010, 0.011, 0.013, 0.016, 0.022, 0.035]
SPEC3_SECONDS = [0.016, 0.019, 0.028, 0.042, 0.070, 0.125]


def costs(**kwargs) -> StepCosts:
    return StepCosts(
        {
            PLAIN: dict(zip(SIZES, PLAIN_SECONDS)),
            3: dict(zip(SIZES, SPEC3_SECONDS)),
        },
        **kwargs,
    )


def policy(accept_length: float = 2.952, **kwargs) -> ThroughputPolicy:
    return ThroughputPolicy(
        costs(), AcceptanceEstimate([3], {3: accept_length}), **kwargs
    )


def crossover(accept_length: float) -> int:
    """The smallest captured batch size at which the plain step is faster."""
    return next(
        bs
        for bs, t0, t3 in zip(SIZES, PLAIN_SECONDS, SPEC3_SECONDS)
        if bs / t0 > bs * accept_length / t3
    )


class TestChainAcceptance(CustomTestCase):
    def test_accept_length_of_a_chain(self):
        self.assertAlmostEqual(chain_accept_length(0.8, 3), 1 + 0.8 + 0.64 + 0.512)
        self.assertEqual(chain_accept_length(0.0, 3), 1.0)
        self.assertEqual(chain_accept_length(1.0, 7), 8.0)

    def test_fit_inverts_it(self):
        for p in (0.1, 0.5, 0.8, 0.95):
            for steps in (1, 3, 7):
                fitted = fit_chain_acceptance(chain_accept_length(p, steps), steps)
                self.assertAlmostEqual(fitted, p, places=6)

    def test_fit_clamps_unreachable_lengths(self):
        self.assertAlmostEqual(fit_chain_acceptance(0.5, 3), 0.0, places=6)
        self.assertAlmostEqual(fit_chain_acceptance(9.0, 3), 1.0, places=6)


class TestStepCosts(CustomTestCase):
    def test_a_batch_costs_what_its_captured_size_costs(self):
        table = costs()
        self.assertEqual(table.estimate(PLAIN, 8), 0.011)
        self.assertEqual(table.estimate(PLAIN, 9), 0.013)  # pads to 32
        self.assertEqual(table.estimate(3, 1), 0.016)

    def test_beyond_the_largest_size_time_scales_per_request(self):
        self.assertAlmostEqual(costs().estimate(PLAIN, 512), 0.070)

    def test_online_refinement_moves_only_its_bucket(self):
        table = costs(ema_alpha=0.5)
        table.observe(PLAIN, 20, 0.021)
        self.assertAlmostEqual(table.estimate(PLAIN, 32), 0.017)
        self.assertEqual(table.estimate(PLAIN, 64), 0.016)
        self.assertEqual(table.estimate(3, 32), 0.028)

    def test_no_online_refinement_where_ranks_would_disagree(self):
        table = costs(refine_online=False)
        table.observe(PLAIN, 32, 1.0)
        self.assertEqual(table.estimate(PLAIN, 32), 0.013)

    def test_eager_batches_beyond_the_graphs_are_not_fed(self):
        table = costs(ema_alpha=1.0)
        table.observe(PLAIN, 300, 1.0)
        self.assertEqual(table.estimate(PLAIN, 256), 0.035)

    def test_profile_needs_every_mode_at_the_same_sizes(self):
        with self.assertRaises(ValueError):
            StepCosts({PLAIN: {1: 0.01, 8: 0.02}, 3: {1: 0.02}})


class TestAcceptanceEstimate(CustomTestCase):
    def test_plain_step_yields_one_token(self):
        self.assertEqual(AcceptanceEstimate([3], {3: 2.5}).expected(PLAIN), 1.0)

    def test_ema_over_speculative_steps(self):
        estimate = AcceptanceEstimate([3], {3: 1.0}, ema_alpha=0.5)
        estimate.observe(3, num_tokens=30, num_requests=10)
        self.assertAlmostEqual(estimate.expected(3), 2.0)

    def test_unobserved_step_counts_follow_the_fitted_chain(self):
        p = 0.8
        estimate = AcceptanceEstimate([1, 3, 7], {3: chain_accept_length(p, 3)})
        self.assertAlmostEqual(estimate.expected(7), chain_accept_length(p, 7), 5)
        self.assertAlmostEqual(estimate.expected(1), 1.8, 5)


class TestThroughputPolicy(CustomTestCase):
    def test_speculates_below_the_crossover_and_runs_plain_above(self):
        for accept_length in (1.5, 2.952, 3.4):
            n = crossover(accept_length)
            for bs in SIZES:
                p = policy(accept_length, min_dwell_steps=0, margin=0.0)
                decision = p.decide(bs)
                self.assertEqual(
                    decision.num_steps == PLAIN, bs >= n, (accept_length, bs)
                )

    def test_the_crossover_moves_with_the_acceptance(self):
        self.assertLess(crossover(1.5), crossover(2.952))
        self.assertLess(crossover(2.952), crossover(3.4))

    def test_margin_keeps_the_mode_near_the_crossover(self):
        # At 128 with this acceptance the plain step is 7.8% faster.
        p = policy(min_dwell_steps=0, margin=0.10)
        decision = p.decide(128)
        self.assertEqual((decision.num_steps, decision.reason), (3, REASON_MARGIN))
        p = policy(min_dwell_steps=0, margin=0.05)
        self.assertEqual(p.decide(128).num_steps, PLAIN)

    def test_dwell_holds_a_new_mode(self):
        p = policy(min_dwell_steps=4, margin=0.0)
        for _ in range(4):  # the initial speculative mode lasts its dwell
            self.assertEqual(p.decide(256).reason, REASON_DWELL)
        self.assertEqual(p.decide(256).num_steps, PLAIN)
        decision = p.decide(1)  # plain for 1 step only: held
        self.assertEqual((decision.num_steps, decision.reason), (PLAIN, REASON_DWELL))

    def test_acceptance_learned_from_speculative_steps_changes_the_choice(self):
        p = policy(accept_length=3.8, min_dwell_steps=0, margin=0.0)
        self.assertEqual(p.decide(64).num_steps, 3)
        for _ in range(60):  # the traffic turns hard: 1.2 tokens per verify
            p.observe(3, 64, num_tokens=int(64 * 1.2))
        self.assertEqual(p.decide(64).num_steps, PLAIN)

    def test_probes_bound_the_speculative_share_while_plain(self):
        p = policy(min_dwell_steps=0, probe_interval=16)
        modes = [p.decide(256) for _ in range(16 * 10)]
        probes = [d for d in modes if d.reason == REASON_PROBE]
        self.assertTrue(all(d.num_steps == 3 for d in probes))
        self.assertEqual(len(probes), 10)
        self.assertEqual(p.num_probes, 10)
        # a probe refreshes the estimate that would otherwise go stale while plain
        p.observe(3, 256, num_tokens=256 * 4)
        self.assertGreater(p.acceptance.expected(3), 2.952)

    def test_picks_the_best_step_count(self):
        table = StepCosts(
            {
                PLAIN: {8: 0.010, 64: 0.016},
                1: {8: 0.012, 64: 0.022},
                3: {8: 0.014, 64: 0.042},
            }
        )
        p = ThroughputPolicy(
            table,
            AcceptanceEstimate([1, 3], {3: chain_accept_length(0.8, 3)}),
            min_dwell_steps=0,
            margin=0.0,
        )
        self.assertEqual(p.decide(8).num_steps, 3)
        self.assertEqual(p.decide(64).num_steps, 1)  # 64*1.8/0.022 beats both

    def test_toggles_and_state(self):
        p = policy(min_dwell_steps=0, margin=0.0, probe_interval=1000)
        for bs in [1, 256, 1, 256]:
            p.decide(bs)
        state = p.get_state()
        self.assertEqual(state["num_toggles"], 3)
        self.assertEqual(state["step_costs_seconds"]["0"][32], 0.013)
        self.assertAlmostEqual(state["accept_length"][3], 2.952)
        self.assertEqual(state["expected_gain"], 0.0)  # plain at 256
        self.assertEqual(p.step_counts[(3, REASON_BEST)], 2)
        self.assertGreater(p.decide(1).expected_gain, 0.5)

    def test_refuses_inconsistent_inputs(self):
        with self.assertRaises(ValueError):
            ThroughputPolicy(costs(), AcceptanceEstimate([7], {7: 2.0}))
        with self.assertRaises(ValueError):
            policy(probe_interval=0)
        with self.assertRaises(ValueError):
            policy().decide(0)


if __name__ == "__main__":
    unittest.main()
