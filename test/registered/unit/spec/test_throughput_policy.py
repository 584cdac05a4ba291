"""The throughput policy of load-aware speculation (srt/speculative/throughput_policy.py):
each decode step runs the mode with the best expected tokens per second.

Pure Python: no server, no model loading, no GPU. The cost tables are fixtures (seconds
per batch bucket, as the server learns them from its decode steps), not measurements.
"""

import threading
import unittest
from types import SimpleNamespace
from typing import List, Optional, Tuple

from sglang.srt.speculative.throughput_policy import (
    PLAIN,
    REASON_BEST,
    REASON_CALIBRATE,
    REASON_DWELL,
    REASON_MARGIN,
    REASON_PROBE,
    AcceptanceEstimate,
    DecodeStepTimer,
    PendingObservations,
    StepCosts,
    ThroughputPolicy,
    ThroughputSpecPolicy,
    power_of_two_buckets,
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


def policy(
    accept_length: float = 2.952, table: Optional[StepCosts] = None, **kwargs
) -> ThroughputPolicy:
    """The policy on the fixture's step costs, or on ``table``, with an acceptance
    estimate settled at ``accept_length``."""
    return ThroughputPolicy(
        costs() if table is None else table,
        settled_acceptance(accept_length),
        **kwargs,
    )


def settled_acceptance(accept_length: float) -> AcceptanceEstimate:
    """An estimate that observed ``accept_length`` for as many verify steps as its
    EMA averages over."""
    estimate = AcceptanceEstimate([3], {3: 1.0})
    estimate.observe(3, accept_length * 10, 10, num_verifies=10)
    return estimate


def first_server_costs() -> StepCosts:
    """Step costs as an H100 server learned them (llama8b, triton): speculation
    timed at every bucket, plain steps up to batch 64, and once at 128, in a step
    that caught a stall."""
    table = StepCosts.unmeasured([PLAIN, 3], SIZES)
    for bs, seconds in zip(SIZES, [0.0066, 0.0070, 0.0074, 0.0090]):
        table.observe(PLAIN, bs, seconds)
        table.observe(PLAIN, bs, seconds)
    for bs, seconds in zip(SIZES, [0.0092, 0.0110, 0.0197, 0.0351, 0.0673, 0.1277]):
        table.observe(3, bs, seconds)
        table.observe(3, bs, seconds)
    table.observe(PLAIN, 128, 0.0756)
    return table


def adaptive_costs_with_a_stall(others_at_32: str) -> StepCosts:
    """Step costs as an H100 server learned them with --speculative-adaptive (tiny
    synthetic model) at batches 1 and 32, where the only 7-step step caught a
    stall; the 1- and 3-step steps at 32 timed "before" it, "after" it or "never"."""
    table = StepCosts.unmeasured([PLAIN, 1, 3, 7], [1, 2, 4, 8, 16, 32, 64])

    def timed_twice(bs: int, seconds_by_mode: dict) -> None:
        for mode, seconds in seconds_by_mode.items():
            table.observe(mode, bs, seconds)
            table.observe(mode, bs, seconds)

    others = {1: 0.00459, 3: 0.00344}
    timed_twice(1, {PLAIN: 0.00191, 1: 0.00448, 3: 0.00307, 7: 0.00404})
    timed_twice(32, {PLAIN: 0.00277, **(others if others_at_32 == "before" else {})})
    table.observe(7, 32, 0.0770)
    if others_at_32 == "after":
        timed_twice(32, others)
    return table


def costs_timed(
    batch_sizes: List[int], samples: List[Tuple[int, int, float, int]]
) -> StepCosts:
    """Plain, 3- and 7-step costs at ``batch_sizes``, each (mode, batch size,
    seconds, times) of ``samples`` observed that many times, in that order."""
    table = StepCosts.unmeasured([PLAIN, 3, 7], batch_sizes)
    for mode, bs, seconds, times in samples:
        for _ in range(times):
            table.observe(mode, bs, seconds)
    return table


def chain_step_count_decided(table: StepCosts, batch_size: int) -> int:
    """The mode a policy on ``table`` runs at ``batch_size``, with the 7-step chain
    accepting 0.95 of its drafts and no dwell."""
    acceptance = AcceptanceEstimate([3, 7], {7: chain_accept_length(0.95, 7)})
    policy = ThroughputPolicy(table, acceptance, min_dwell_steps=0)
    return policy.decide(batch_size).num_steps


def costs_untimed_at(mode: int, batch_size: int) -> StepCosts:
    """The fixture's step costs, every one timed but ``mode``'s at ``batch_size``."""
    table = StepCosts.unmeasured([PLAIN, 3], SIZES)
    for bs, plain, spec in zip(SIZES, PLAIN_SECONDS, SPEC3_SECONDS):
        for m, seconds in ((PLAIN, plain), (3, spec)):
            if (m, bs) != (mode, batch_size):
                table.observe(m, bs, seconds)
    return table


def mode_and_reason(p: ThroughputPolicy, batch_size: int) -> Tuple[int, str]:
    decision = p.decide(batch_size)
    return decision.num_steps, decision.reason


def probe_gaps(reasons: List[str]) -> List[int]:
    """The steps from each probe's first step to the next one's."""
    starts = [
        i
        for i, reason in enumerate(reasons)
        if reason == REASON_PROBE and (i == 0 or reasons[i - 1] != REASON_PROBE)
    ]
    return [b - a for a, b in zip(starts, starts[1:])]


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
        table = costs()
        table.observe(PLAIN, 20, 0.009)
        self.assertEqual(table.estimate(PLAIN, 32), 0.009)
        self.assertEqual(table.estimate(PLAIN, 64), 0.016)
        self.assertEqual(table.estimate(3, 32), 0.028)

    def test_unmeasured_until_the_first_sample_sets_it(self):
        table = StepCosts.unmeasured([PLAIN, 3], [1, 8, 64])
        self.assertIsNone(table.estimate(PLAIN, 5))
        table.observe(PLAIN, 5, 0.012)
        self.assertEqual(table.estimate(PLAIN, 8), 0.012)
        table.observe(PLAIN, 8, 0.016)
        self.assertEqual(table.estimate(PLAIN, 8), 0.012)  # the lower of two
        self.assertIsNone(table.estimate(3, 8))
        self.assertEqual(table.bucket(100), 64)

    def test_an_unmeasured_bucket_costs_the_lower_bound_of_its_neighbours(self):
        table = StepCosts.unmeasured([PLAIN, 3], [1, 8, 64, 256])
        table.observe(PLAIN, 256, 0.040)
        self.assertFalse(table.is_measured(PLAIN, 64))
        self.assertAlmostEqual(table.estimate(PLAIN, 64), 0.010)  # 256's, / 4
        table.observe(PLAIN, 8, 0.012)
        self.assertAlmostEqual(table.estimate(PLAIN, 64), 0.012)  # at least 8's
        self.assertAlmostEqual(table.estimate(PLAIN, 40), 0.012)
        self.assertAlmostEqual(table.estimate(PLAIN, 1), 0.0015)  # 8's, / 8
        self.assertTrue(table.is_measured(PLAIN, 200))
        self.assertIsNone(table.estimate(3, 64))  # measured nowhere

    def test_eager_batches_beyond_the_graphs_are_not_fed(self):
        table = costs()
        table.observe(PLAIN, 300, 1.0)
        self.assertEqual(table.estimate(PLAIN, 256), 0.035)

    def test_one_slow_sample_does_not_set_the_cost(self):
        table = StepCosts.unmeasured([PLAIN, 3], SIZES)
        for seconds in (0.092, 0.0135, 0.0153):
            table.observe(PLAIN, 128, seconds)
        self.assertEqual(table.estimate(PLAIN, 128), 0.0153)

    def test_a_slow_sample_does_not_set_the_cost_of_two(self):
        # A calibration that timed two steps, one across a host stall: a mean
        # (124 ms) would keep the mode from ever running there again.
        table = StepCosts.unmeasured([PLAIN, 3], SIZES)
        for seconds in (0.0066, 0.1243):
            table.observe(3, 8, seconds)
        self.assertEqual(table.estimate(3, 8), 0.0066)

    def test_a_bucket_costs_no_more_than_a_larger_measured_one(self):
        # A stall in the only step timed at a bucket: the cost is batch 64's until
        # a step there is timed at its usual speed.
        table = costs_untimed_at(3, 32)
        table.observe(3, 28, 0.102)
        self.assertEqual(table.estimate(3, 32), 0.042)
        self.assertEqual(table.estimate(3, 8), 0.019)
        table.observe(3, 28, 0.027)
        self.assertEqual(table.estimate(3, 32), 0.027)
        table.observe(3, 64, 0.015)
        self.assertEqual(table.estimate(3, 8), 0.015)
        self.assertEqual(table.table()["3"][8], 0.015)

    def test_a_bucket_timed_once_costs_no_more_per_request_than_a_smaller_one(self):
        # The first plain step at batch 128 waited for a Triton compile (75.6 ms;
        # batch 64's took 9 ms), and no larger plain bucket was timed to cap it.
        table = first_server_costs()
        self.assertAlmostEqual(table.estimate(PLAIN, 128), 0.018)  # 64's, x 2
        self.assertAlmostEqual(table.estimate(PLAIN, 256), 0.018)  # at least 128's
        table.observe(PLAIN, 128, 0.0119)  # the low median of the two
        self.assertEqual(table.estimate(PLAIN, 128), 0.0119)
        self.assertEqual(table.estimate(PLAIN, 256), 0.0119)

    def test_a_stall_is_priced_at_the_per_request_bound_below_a_larger_buckets_cost(
        self,
    ):
        table = first_server_costs()
        table.observe(PLAIN, 256, 0.030)
        table.observe(PLAIN, 256, 0.030)
        self.assertAlmostEqual(table.estimate(PLAIN, 128), 0.018)

    def test_a_bucket_timed_once_near_its_per_request_bound_keeps_its_time(self):
        # A speculative step at batch 128 costs about twice one at 64: capping it at
        # twice 64's cost would move it with 64's noise, about a crossover.
        table = StepCosts.unmeasured([PLAIN, 3], SIZES)
        table.observe(3, 64, 0.0227)
        table.observe(3, 64, 0.0227)
        table.observe(3, 128, 0.0460)
        self.assertEqual(table.estimate(3, 128), 0.0460)

    def test_a_stall_in_a_step_counts_only_step_is_capped_by_the_others_times(self):
        # 7 steps cost no less than 1 step (the tiny model's 1-step steps took
        # longer than its 7-step ones at batch 1), until timed again.
        capped = 0.00459
        for others_at_32 in ("before", "after"):
            with self.subTest(others_at_32=others_at_32):
                table = adaptive_costs_with_a_stall(others_at_32)
                self.assertAlmostEqual(table.estimate(7, 32), capped)
        accepted = {s: chain_accept_length(0.95, s) for s in (1, 3, 7)}
        acceptance = AcceptanceEstimate([1, 3, 7], {3: accepted[3]})
        for num_steps, accept_length in accepted.items():
            acceptance.observe(num_steps, accept_length * 10, 10, num_verifies=10)
        self.assertEqual(ThroughputPolicy(table, acceptance).decide(32).num_steps, 7)
        table.observe(7, 32, 0.0047)  # the low median of the two
        self.assertEqual(table.estimate(7, 32), 0.0047)

    def test_a_stall_in_another_step_counts_only_step_does_not_cap_a_step_count(self):
        # llama8b on an H200 with --speculative-adaptive: the only 3-step step timed
        # at batch 64 caught a stall, so 3 steps seemed to cost 5x what 7 do there;
        # scaled by that, 3 steps' time at 256 capped 7's first one at a sixth of
        # it, and the server ran 7 steps at batch 256 for 13 s instead of plain.
        table = costs_timed(
            [1, 64, 256],
            [
                (PLAIN, 1, 0.0043, 2),
                (3, 1, 0.00755, 2),
                (7, 1, 0.00843, 2),
                (7, 64, 0.02732, 2),
                (3, 256, 0.11981, 2),
                (PLAIN, 256, 0.01304, 2),
                (3, 64, 0.13751, 1),
                (7, 256, 0.15633, 1),
            ],
        )
        self.assertEqual(table.estimate(7, 256), 0.15633)
        self.assertEqual(chain_step_count_decided(table, 256), PLAIN)

    def test_a_stall_in_a_step_count_is_capped_where_only_single_steps_anchor_it(
        self,
    ):
        # llama8b on an H100 with --speculative-adaptive: the only 7-step step timed
        # at batch 64 caught a stall (115.7 ms; 40 ms once timed again), 3 steps
        # were then the best other mode, so probes never timed 7 again there, and
        # the server ran plain at C=64. The buckets both were timed at had them
        # timed once or twice, one 7-step step faster than the 3-step ones.
        table = costs_timed(
            [1, 4, 16, 64],
            [
                (3, 4, 0.0064, 2),
                (7, 4, 0.0050, 1),
                (7, 16, 0.0160, 3),
                (PLAIN, 64, 0.0087, 2),
                (3, 64, 0.0352, 2),
                (7, 64, 0.1157, 1),
            ],
        )
        self.assertEqual(table.estimate(7, 64), 0.0352)
        self.assertEqual(chain_step_count_decided(table, 64), 7)

    def test_a_stall_in_a_larger_step_count_at_the_anchor_does_not_cap_a_smaller(
        self,
    ):
        # The mirror of the H200 case: a 7-step step stalled at batch 4, where both
        # step counts were timed once, would scale 3 steps' true time at 64 down to
        # less than half of it; batch 1 timed both more than once.
        table = costs_timed(
            [1, 4, 64],
            [
                (3, 1, 0.0055, 2),
                (7, 1, 0.0057, 2),
                (3, 4, 0.0064, 1),
                (7, 4, 0.0500, 1),
                (7, 64, 0.0400, 2),
                (3, 64, 0.0350, 1),
            ],
        )
        self.assertEqual(table.estimate(3, 64), 0.0350)

    def test_a_plain_steps_time_does_not_cap_a_step_counts(self):
        # A plain step's time grows far slower with the batch than a speculative one's.
        table = adaptive_costs_with_a_stall(others_at_32="never")
        self.assertEqual(table.estimate(7, 32), 0.0770)

    def test_the_cost_follows_the_last_samples(self):
        table = StepCosts.unmeasured([PLAIN, 3], SIZES, window=3)
        for seconds in (0.010, 0.011, 0.012, 0.020, 0.021):
            table.observe(PLAIN, 64, seconds)
        self.assertEqual(table.estimate(PLAIN, 64), 0.020)
        with self.assertRaises(ValueError):
            StepCosts.unmeasured([PLAIN, 3], SIZES, window=1)

    def test_a_restarted_bucket_keeps_its_cost_until_its_next_sample(self):
        table = StepCosts.unmeasured([PLAIN, 3], SIZES)
        for seconds in (0.0087, 0.0105, 0.0110, 0.0108):
            table.observe(3, 16, seconds)
        table.observe(3, 64, 0.020)
        table.restart(3, 16)
        self.assertEqual(table.estimate(3, 16), 0.0105)
        table.observe(3, 16, 0.0086)
        self.assertEqual(table.estimate(3, 16), 0.0086)
        table.observe(3, 16, 0.0089)
        self.assertEqual(table.estimate(3, 16), 0.0086)
        table.observe(3, 64, 0.030)  # another bucket's window was kept
        self.assertEqual(table.estimate(3, 64), 0.020)

    def test_profile_needs_every_mode_at_the_same_sizes(self):
        with self.assertRaises(ValueError):
            StepCosts({PLAIN: {1: 0.01, 8: 0.02}, 3: {1: 0.02}})


class TestAcceptanceEstimate(CustomTestCase):
    def test_plain_step_yields_one_token(self):
        self.assertEqual(AcceptanceEstimate([3], {3: 2.5}).expected(PLAIN), 1.0)

    def test_first_observation_replaces_the_prior_then_a_mean_then_an_ema(self):
        estimate = AcceptanceEstimate([3], {3: 1.0}, ema_alpha=0.25)
        self.assertEqual(estimate.expected(3), 1.0)
        estimate.observe(3, num_tokens=30, num_requests=10)
        self.assertAlmostEqual(estimate.expected(3), 3.0)
        estimate.observe(3, num_tokens=20, num_requests=10, num_verifies=3)
        self.assertAlmostEqual(estimate.expected(3), 2.25)  # the mean of the four
        estimate.observe(3, num_tokens=40, num_requests=10)
        self.assertAlmostEqual(estimate.expected(3), 2.25 + 0.25 * (4 - 2.25))

    def test_unobserved_step_counts_follow_the_fitted_chain(self):
        p = 0.8
        estimate = AcceptanceEstimate([1, 3, 7], {3: chain_accept_length(p, 3)})
        self.assertAlmostEqual(estimate.expected(7), chain_accept_length(p, 7), 5)
        self.assertAlmostEqual(estimate.expected(1), 1.8, 5)

    def test_grouped_verify_steps_move_the_estimate_as_one_by_one(self):
        # Groups of 16 (a TP fold), from the first verify step, and across the end
        # of the mean of the first 10.
        for seen in (0, 5, 10):
            with self.subTest(seen=seen):
                one_by_one = AcceptanceEstimate([3], {3: 1.0})
                grouped = AcceptanceEstimate([3], {3: 1.0})
                for estimate in (one_by_one, grouped):
                    for _ in range(seen):
                        estimate.observe(3, num_tokens=20, num_requests=10)
                for _ in range(16):
                    one_by_one.observe(3, num_tokens=40, num_requests=10)
                grouped.observe(
                    3, num_tokens=16 * 40, num_requests=16 * 10, num_verifies=16
                )
                self.assertAlmostEqual(grouped.expected(3), one_by_one.expected(3))
                self.assertAlmostEqual(grouped.best(3), one_by_one.best(3))
                self.assertGreater(grouped.expected(3), 3.4)

    def test_a_few_unlucky_verify_steps_rule_nothing_out(self):
        estimate = AcceptanceEstimate([3], {3: 1.0})
        self.assertEqual(estimate.best(3), 4.0)
        for _ in range(9):
            estimate.observe(3, num_tokens=1, num_requests=1)
        self.assertEqual(estimate.expected(3), 1.0)
        self.assertEqual(estimate.best(3), 4.0)  # every draft accepted
        self.assertFalse(estimate.is_settled())
        estimate.observe(3, num_tokens=1, num_requests=1)
        self.assertEqual(estimate.best(3), 1.0)

    def test_a_lucky_first_verify_is_not_a_best(self):
        estimate = AcceptanceEstimate([3], {3: 1.0})
        estimate.observe(3, num_tokens=4, num_requests=1)
        for _ in range(30):
            estimate.observe(3, num_tokens=29, num_requests=10)
        self.assertLess(estimate.best(3), 3.05)  # the mean of the first 10
        # one held for as many verify steps as the EMA averages over is
        for _ in range(10):
            estimate.observe(3, num_tokens=38, num_requests=10)
        for _ in range(30):
            estimate.observe(3, num_tokens=29, num_requests=10)
        self.assertGreater(estimate.best(3), 3.4)

    def test_a_step_count_not_verified_for_long_follows_the_fresh_one(self):
        estimate = AcceptanceEstimate([3, 7], {3: 1.0}, stale_after=100)
        hard, easy = chain_accept_length(0.3, 7), chain_accept_length(0.9, 3)
        estimate.observe(7, num_tokens=hard * 10, num_requests=10)
        for _ in range(99):
            estimate.observe(3, num_tokens=easy * 10, num_requests=10)
        self.assertAlmostEqual(estimate.expected(7), hard)  # still its own
        estimate.observe(3, num_tokens=easy * 10, num_requests=10)
        self.assertAlmostEqual(estimate.expected(7), chain_accept_length(0.9, 7), 4)
        self.assertAlmostEqual(estimate.expected(3), easy)


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

    def test_dwell_holds_a_new_mode_at_the_bucket_it_was_chosen_at(self):
        p = policy(min_dwell_steps=4, margin=0.0)
        self.assertEqual(p.decide(256).num_steps, PLAIN)  # the start is not held
        for _ in range(60):  # the traffic turns easy: speculating pays at 256 too
            p.observe_verify(3, 256 * 4, 256)
        for _ in range(3):  # the plain step chosen at 256 lasts its dwell there
            decision = p.decide(256)
            self.assertEqual(
                (decision.num_steps, decision.reason), (PLAIN, REASON_DWELL)
            )
        self.assertEqual(p.decide(256).num_steps, 3)

    def test_a_batch_in_another_bucket_is_not_held_by_the_dwell(self):
        # A batch that dips (requests finished, their successors still in prefill)
        # and returns: each size gets its own best mode at once.
        p = policy(min_dwell_steps=8, margin=0.0)
        modes = [p.decide(bs).num_steps for bs in (256, 1, 256, 1)]
        self.assertEqual(modes, [PLAIN, 3, PLAIN, 3])

    def test_acceptance_learned_from_speculative_steps_changes_the_choice(self):
        p = policy(accept_length=3.8, min_dwell_steps=0, margin=0.0)
        self.assertEqual(p.decide(64).num_steps, 3)
        for _ in range(60):  # the traffic turns hard: 1.2 tokens per verify
            p.observe_verify(3, int(64 * 1.2), 64)
        self.assertEqual(p.decide(64).num_steps, PLAIN)

    def test_probes_take_a_bounded_share_of_the_time(self):
        # At 256 a speculative step takes 0.125 / 0.035 = 3.6 plain steps' time and
        # would not pay (below): its probes come that much less often, and as much
        # less as the plain step leads (its 7314 tok/s are 1.15 times 1.05 times a
        # speculative step's 6046), so that they take explore_steps /
        # (probe_interval * lead + explore_steps) of the time, not of the steps.
        p = policy(
            min_dwell_steps=0, probe_interval=16, explore_steps=2, max_probe_backoff=1
        )
        decisions = [p.decide(256) for _ in range(67 * 10)]
        probes = [d for d in decisions if d.reason == REASON_PROBE]
        self.assertTrue(all(d.num_steps == 3 for d in probes))
        self.assertEqual(p.num_probes, 10)
        seconds = {PLAIN: 0.035, 3: 0.125}
        probe_time = sum(seconds[d.num_steps] for d in probes)
        total_time = sum(seconds[d.num_steps] for d in decisions)
        lead = (256 / 0.035) / (256 * 2.952 / 0.125 * 1.05)
        self.assertAlmostEqual(
            probe_time / total_time, 2 / (16 * lead + 2), delta=0.002
        )
        # a probe refreshes the estimate that would otherwise go stale while plain
        p.observe_verify(3, 256 * 4, 256)
        self.assertGreater(p.acceptance.expected(3), 2.952)
        # and speculating, the plain step's time, the only estimate that can go
        # stale there (every step observes the acceptance): the interval doubles at
        # each probe (a plain step is the shorter one), up to max_probe_backoff
        # times itself, and is stretched by the lead (184.5 tok/s speculating are
        # 1.76 times 1.05 times the plain step's 100): the first after 16 * 1.76
        # steps, then every 2 + 32 * 1.76 - 1.
        p = policy(min_dwell_steps=0, probe_interval=16, explore_steps=2)
        decisions = [p.decide(1) for _ in range(300)]
        probes = [d for d in decisions if d.reason == REASON_PROBE]
        self.assertEqual({d.num_steps for d in probes}, {PLAIN})
        reasons = [d.reason for d in decisions]
        self.assertEqual(reasons.index(REASON_PROBE), 28)
        self.assertEqual(set(probe_gaps(reasons)), {2 + 56})
        # Traffic easier than any before changes nothing there.
        p.observe_verify(3, 8, 1)
        self.assertEqual(p.get_state()["probe_interval"], 32)

    def test_acceptance_probes_come_sooner_where_speculation_is_closer(self):
        p = policy(min_dwell_steps=0, probe_interval=256, explore_steps=2)
        p.observe_verify(3, 64 * 3.8 * 10, 64 * 10, num_verifies=10)
        # The traffic turned harder: at 64 a speculative step (2.6 plain steps'
        # time) gives 64 * 2.4 / 0.042 = 3657 tok/s against the plain step's 4000,
        # so a probe step loses 2.6 * (1 - 3657 / 4000) = 0.225 plain steps' output:
        # probes come every 256 * 0.225 = 58 steps, and lose 2 * 0.225 / 58 of the
        # output, explore_steps / probe_interval.
        p.observe_verify(3, 64 * 2.4 * 100, 64 * 100, num_verifies=100)
        gaps = probe_gaps([p.decide(64).reason for _ in range(400)])
        self.assertEqual(p.get_state()["mode_num_steps"], PLAIN)
        self.assertEqual(set(gaps), {2 + 57})
        # Harder still (1.5 tokens: a probe step loses more than a plain step's
        # output), every probe_interval steps.
        p.observe_verify(3, 64 * 1.5 * 100, 64 * 100, num_verifies=100)
        gaps = probe_gaps([p.decide(64).reason for _ in range(800)])
        self.assertEqual(set(gaps[1:]), {2 + 255})
        # Where speculation is the faster (2.7 tokens: 4114 tok/s) but not by the
        # margin, every min_probe_interval steps.
        p.observe_verify(3, 64 * 2.7 * 100, 64 * 100, num_verifies=100)
        gaps = probe_gaps([p.decide(64).reason for _ in range(100)])
        self.assertEqual(p.get_state()["mode_num_steps"], PLAIN)
        self.assertEqual(set(gaps[1:]), {2 + 15})

    def test_probes_back_off_where_speculation_cannot_pay(self):
        # At 256 speculating gives 256 * 2.952 / 0.125 = 6046 tok/s against the plain
        # step's 7314: even the best acceptance seen (the same) would not pay.
        p = policy(
            min_dwell_steps=0, probe_interval=16, explore_steps=2, max_probe_backoff=4
        )
        gaps = probe_gaps([p.decide(256).reason for _ in range(800)])
        # From one probe's start to the next: its 2 steps, then the interval (in
        # plain steps: 3.6 per speculative one, times the plain step's lead of
        # 1.15) less one step; the interval doubles at each probe (16 before the
        # first), up to 64.
        self.assertEqual(gaps[:3], [2 + 131, 2 + 263, 2 + 263])
        self.assertEqual(p.get_state()["probe_interval"], 64)
        # Once a 4.0 acceptance has held long enough to bring the estimate near it
        # (256 * 4 / 0.125 = 8192 tok/s would pay), probing returns to the base
        # interval, counted in steps.
        p.observe_verify(3, 256 * 4 * 40, 256 * 40, num_verifies=40)
        for _ in range(60):  # and the traffic turned hard again
            p.observe_verify(3, int(256 * 2.5), 256)
        gaps = probe_gaps([p.decide(256).reason for _ in range(200)])
        self.assertEqual(p.get_state()["mode_num_steps"], PLAIN)
        self.assertEqual(set(gaps), {2 + 15})

    def test_a_change_of_mode_or_a_new_best_acceptance_resets_the_interval(self):
        p = policy(
            min_dwell_steps=0, probe_interval=16, explore_steps=2, max_probe_backoff=4
        )
        for _ in range(200):
            p.decide(256)
        self.assertEqual(p.get_state()["probe_interval"], 64)
        self.assertEqual(p.decide(1).num_steps, 3)
        self.assertEqual(p.get_state()["probe_interval"], 16)
        for _ in range(200):
            p.decide(256)
        self.assertEqual(p.get_state()["probe_interval"], 64)
        # a probe saw more than ever (3.0 > 2.952), though not enough to pay at 256
        p.observe_verify(3, 256 * 3, 256)
        self.assertEqual(p.get_state()["probe_interval"], 16)
        # the next probe comes 16 * 3.6 * 1.14 = 65 plain steps after the last one,
        # not 4 times that
        reasons = [p.decide(256).reason for _ in range(70)]
        self.assertIn(REASON_PROBE, reasons)
        self.assertEqual(p.get_state()["mode_num_steps"], PLAIN)

    def test_calibrates_an_unmeasured_mode_before_comparing(self):
        table = StepCosts.unmeasured([PLAIN, 3], SIZES)
        p = policy(
            table=table, min_dwell_steps=0, calibrate_steps=3, probe_interval=1000
        )

        # neither timed: speculation, the mode it starts in, runs and is timed first
        self.assertEqual(mode_and_reason(p, 256), (3, REASON_CALIBRATE))
        table.observe(3, 256, 0.125)
        self.assertEqual(
            [mode_and_reason(p, 256) for _ in range(3)], [(PLAIN, REASON_CALIBRATE)] * 3
        )
        # no time arrived yet: not calibrated again before probe_interval steps
        self.assertEqual(mode_and_reason(p, 256), (3, REASON_CALIBRATE))
        table.observe(PLAIN, 256, 0.035)
        self.assertEqual(mode_and_reason(p, 256), (PLAIN, REASON_BEST))
        self.assertEqual(p.num_calibrations, 1)
        # a new bucket: plain runs until it is timed there; then speculation, priced
        # from batch 256 per request, looks better and runs, untimed
        self.assertEqual(mode_and_reason(p, 1), (PLAIN, REASON_BEST))
        table.observe(PLAIN, 1, 0.010)
        self.assertEqual(mode_and_reason(p, 1), (3, REASON_BEST))

    def test_no_calibration_where_the_other_mode_could_not_win(self):
        # Speculation untimed at 256 costs at least its 70 ms at 128: at 1.5 tokens
        # per request it would not beat a plain step's 35 ms even then, at 2.952 it
        # might, and runs.
        table = costs_untimed_at(3, 256)
        for accept_length, runs in ((1.5, False), (2.952, True)):
            with self.subTest(accept_length=accept_length):
                p = policy(accept_length, table=table, min_dwell_steps=0)
                self.assertEqual(p.decide(128).num_steps, PLAIN)
                modes = {p.decide(256).num_steps for _ in range(20)}
                self.assertEqual(3 in modes, runs)

    def test_a_few_hard_first_requests_do_not_shut_speculation_out(self):
        # The server's first verify steps accepted nothing; at 32, where speculation
        # is untimed, it is timed at once all the same, and then wins on what its
        # steps accept there (the mean of 3 x 1.0 and 3 x 3.6: 2.3 tokens, 2629
        # tok/s against the plain step's 2462).
        table = costs_untimed_at(3, 32)
        p = ThroughputPolicy(
            table,
            AcceptanceEstimate([3], {3: 1.0}),
            min_dwell_steps=0,
            calibrate_steps=3,
        )
        p.observe_verify(3, num_tokens=3, num_requests=3, num_verifies=3)
        self.assertEqual(
            [mode_and_reason(p, 32) for _ in range(3)], [(3, REASON_CALIBRATE)] * 3
        )
        table.observe(3, 32, 0.028)
        p.observe_verify(
            3, num_tokens=32 * 3.6 * 3, num_requests=32 * 3, num_verifies=3
        )
        self.assertEqual(mode_and_reason(p, 32), (3, REASON_BEST))

    def test_the_dwell_holds_no_mode_chosen_on_a_guessed_time(self):
        # Speculation at 256, untimed, priced at its 70 ms at 128, beats plain; once
        # its 125 ms arrive, plain is back at once, not after the dwell.
        table = costs_untimed_at(3, 256)
        p = policy(
            table=table, min_dwell_steps=8, calibrate_steps=1, probe_interval=1000
        )
        p.decide(128)
        modes = [p.decide(256).num_steps for _ in range(2)]
        self.assertEqual(modes[-1], 3)
        table.observe(3, 256, 0.125)
        self.assertEqual(mode_and_reason(p, 256), (PLAIN, REASON_BEST))

    def test_a_calibration_ends_where_the_batch_leaves_its_bucket(self):
        # A batch refilling from 128 to 256 during speculation's calibration at 128:
        # its steps at 256 would time nothing, at ~3.5 plain steps' time each.
        table = costs_untimed_at(3, 128)
        p = policy(
            table=table, min_dwell_steps=0, calibrate_steps=5, probe_interval=1000
        )
        self.assertEqual(p.decide(256).num_steps, PLAIN)

        self.assertEqual(mode_and_reason(p, 128), (3, REASON_CALIBRATE))
        # the same bucket: the calibration runs on
        self.assertEqual(mode_and_reason(p, 100), (3, REASON_CALIBRATE))
        self.assertEqual(mode_and_reason(p, 256), (PLAIN, REASON_BEST))
        self.assertEqual(mode_and_reason(p, 128)[0], PLAIN)  # not resumed

    def test_a_probe_runs_on_across_buckets(self):
        # A probe also refreshes the acceptance, at any batch size.
        p = policy(min_dwell_steps=0, probe_interval=16)
        first = next(
            d for d in (p.decide(256) for _ in range(1000)) if d.reason == REASON_PROBE
        )
        self.assertEqual(first.num_steps, 3)
        self.assertEqual(
            [mode_and_reason(p, bs) for bs in (128, 8, 64)],
            [(3, REASON_PROBE)] * 3,
        )

    def test_an_untimed_mode_is_priced_from_its_neighbours(self):
        # Plain steps not timed at batch 128 yet (their calibration may time none:
        # a prefill every few steps): the policy prices them from buckets 64 and
        # 256 and runs them, rather than speculating at ~3x a plain step's time
        # until a plain step there has been timed.
        table = costs_untimed_at(PLAIN, 128)
        p = policy(table=table, min_dwell_steps=0)
        modes = [p.decide(128).num_steps for _ in range(50)]
        self.assertEqual(modes, [PLAIN] * 50)

    def test_a_stall_in_a_buckets_only_timed_step_does_not_shut_speculation_out(
        self,
    ):
        # dense32b-32l on an H100 (results/2026-12-06-bs-h100-dense32b-32l-p0.95):
        # the one speculative step timed at batch 28, in a drain, took 102 ms
        # (batch 64's took 47 ms), and every later drain ran plain there.
        table = costs_untimed_at(3, 32)
        table.observe(3, 28, 0.102)
        p = policy(3.8, table, min_dwell_steps=0)
        modes = [p.decide(28).num_steps for _ in range(50)]
        self.assertEqual(modes, [3] * 50)

    def test_a_stall_in_a_buckets_only_timed_plain_step_does_not_lock_speculation_in(
        self,
    ):
        # llama8b on an H100 with a fresh Triton cache
        # (results/2026-12-06-stalls-h100-llama8b-p0.95): priced from that one step,
        # plain steps lost to speculation at batch 128 and, by the lower bound, at
        # 256, where they were never timed; the server speculated at 0.70x of its
        # throughput with plain steps at C=256.
        p = policy(
            chain_accept_length(0.95, 3), first_server_costs(), min_dwell_steps=0
        )
        modes = [p.decide(256).num_steps for _ in range(50)]
        self.assertEqual(modes, [PLAIN] * 50)

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

    def test_a_step_count_passed_over_while_the_traffic_was_hard_comes_back(self):
        table = StepCosts(
            {PLAIN: {1: 0.015}, 3: {1: 0.016}, 7: {1: 0.020}},
        )
        p = ThroughputPolicy(
            table,
            AcceptanceEstimate([3, 7], {3: 1.0}, stale_after=64),
            min_dwell_steps=0,
            probe_interval=16,
        )
        # 7 steps once, on hard traffic (71 tok/s against 3 steps' 89, plain 67)
        p.observe_verify(7, chain_accept_length(0.3, 7), 1)
        p.observe_verify(3, chain_accept_length(0.3, 3), 1)
        self.assertEqual(p.decide(1).num_steps, 3)
        # then easy: 7 steps would give 285 tok/s, 3 steps 215
        modes = []
        for _ in range(200):
            decision = p.decide(1)
            modes.append(decision.num_steps)
            accept_length = chain_accept_length(0.9, decision.num_steps)
            if decision.num_steps != PLAIN:
                p.observe_verify(decision.num_steps, accept_length, 1)
        self.assertEqual(p.get_state()["mode_num_steps"], 7)
        self.assertGreater(modes[-100:].count(7), 90)  # the rest: probes of 3

    def test_toggles_and_state(self):
        p = policy(min_dwell_steps=0, margin=0.0, probe_interval=1000)
        for bs in [1, 256, 1, 256]:
            p.decide(bs)
        state = p.get_state()
        self.assertEqual(state["num_toggles"], 3)
        self.assertEqual(state["step_costs_seconds"]["0"][32], 0.013)
        self.assertAlmostEqual(state["accept_length"]["3"], 2.952)
        self.assertLess(state["expected_gain"], 0)  # plain at 256
        self.assertEqual(p.step_counts[(3, REASON_BEST)], 2)
        self.assertGreater(p.decide(1).expected_gain, 0.5)

    def test_refuses_inconsistent_inputs(self):
        with self.assertRaises(ValueError):
            ThroughputPolicy(costs(), AcceptanceEstimate([7], {7: 2.0}))
        with self.assertRaises(ValueError):
            policy(probe_interval=0)
        with self.assertRaises(ValueError):
            policy(max_probe_backoff=0)
        with self.assertRaises(ValueError):
            policy(min_probe_interval=0)
        with self.assertRaises(ValueError):
            policy().decide(0)


class TestDecodeStepTimer(CustomTestCase):
    @staticmethod
    def timer() -> DecodeStepTimer:
        return DecodeStepTimer(StepCosts.unmeasured([PLAIN, 3], [1, 8, 64]).bucket)

    def test_three_contiguous_launches_of_one_mode_give_one_interval(self):
        timer = self.timer()
        self.assertIsNone(timer.record(10, 1.00, 3, 7))
        self.assertIsNone(timer.record(11, 1.02, 3, 7))
        sample = timer.record(12, 1.05, 3, 7)
        self.assertEqual((sample.num_steps, sample.batch_size), (3, 7))
        self.assertAlmostEqual(sample.seconds, 0.03)
        self.assertAlmostEqual(timer.record(13, 1.09, 3, 7).seconds, 0.04)

    def test_no_sample_across_a_prefill_a_mode_switch_or_a_bucket_change(self):
        for second, third in [
            ((11, 1.02, 3, 6), (13, 1.05, 3, 6)),  # a prefill ran as forward 12
            ((11, 1.02, PLAIN, 6), (12, 1.05, PLAIN, 6)),  # the mode just changed
            ((11, 1.02, 3, 6), (12, 1.05, 3, 9)),  # the batch moved to bucket 64
        ]:
            timer = self.timer()
            timer.record(10, 1.00, 3, 6)
            timer.record(*second)
            self.assertIsNone(timer.record(*third), (second, third))

    def test_steps_in_which_requests_finish_are_timed(self):
        # Under load requests finish in most steps (at a batch of 128 and four
        # tokens per step, every third one at least): they must not starve the
        # timer, or a mode calibrated there never gets its time.
        timer = self.timer()
        sizes = [64, 62, 62, 59, 57]
        samples = [
            timer.record(10 + k, 1.0 + 0.01 * k, PLAIN, size)
            for k, size in enumerate(sizes)
        ]
        self.assertEqual([s.batch_size for s in samples[2:]], sizes[:3])

    def test_a_batch_that_did_not_run_again_is_not_counted_twice(self):
        timer = self.timer()
        for launch in [(10, 1.0, 3, 5), (11, 1.02, 3, 5), (12, 1.05, 3, 5)]:
            timer.record(*launch)
        self.assertIsNone(timer.record(12, 1.05, 3, 5))


class TestThroughputSpecPolicy(CustomTestCase):
    """The server-side policy on step launches as the scheduler records them."""

    def spec_policy(
        self, reduce=list, fold_interval=1, **kwargs
    ) -> ThroughputSpecPolicy:
        kwargs.setdefault("speculative_steps", [3])
        kwargs.setdefault("sets_step_count", False)
        return ThroughputSpecPolicy(
            max_batch_size=256,
            min_dwell_steps=0,
            reduce=reduce,
            fold_interval=fold_interval,
            **kwargs,
        )

    @staticmethod
    def decode_batch(batch_size: int) -> SimpleNamespace:
        """The running batch as plan_decode_step reads it, before its first launch."""
        return SimpleNamespace(
            batch_size=lambda: batch_size,
            forward_mode=SimpleNamespace(is_decode=lambda: True),
            forward_iter=None,
            launch_ts=None,
            spec_plain_step=False,
            spec_prev_plain_step=False,
            spec_num_steps=None,
        )

    def run_steps(self, policy, batch_size, num_steps, seconds, accept_length, clock):
        """num_steps decode steps of a steady batch; each step's launch takes the
        time of the mode the policy chose for it."""
        batch = self.decode_batch(batch_size)
        chosen = []
        for _ in range(num_steps):
            policy.plan_decode_step(batch)
            plain = batch.spec_plain_step
            mode = policy.planned_num_steps
            self.assertEqual(plain, mode == PLAIN)
            chosen.append(mode if policy.sets_step_count else plain)
            clock["forward"] += 1
            clock["t"] += seconds(mode) if callable(seconds) else seconds[mode]
            batch.forward_iter, batch.launch_ts = clock["forward"], clock["t"]
            if not plain:
                accepted = (
                    accept_length(mode) if callable(accept_length) else accept_length
                )
                policy.observe_verify(mode, [round(accepted) - 1] * batch_size)
        return chosen

    def test_a_step_is_filed_under_the_bucket_it_ran_at(self):
        """Under overlap the interval between two launches is the step launched two
        before; a batch that moves between buckets 8 and 16 (once both are
        calibrated, within one mode) files no step of one size under the other's
        bucket."""
        policy = self.spec_policy()
        filed = []
        add_step_time = policy.pending.add_step_time

        def record_filing(num_steps, bucket, seconds):
            filed.append((bucket, seconds))
            add_step_time(num_steps, bucket, seconds)

        policy.pending.add_step_time = record_filing
        sizes = [8] * 20 + [9] * 20 + ([8] * 6 + [9] * 6) * 3
        seconds = {8: 0.010, 9: 0.050}
        batch = self.decode_batch(sizes[0])
        t = 0.0
        for k, size in enumerate(sizes):
            batch.batch_size = lambda size=size: size
            policy.plan_decode_step(batch)
            if k >= 2:
                t += seconds[sizes[k - 2]]
            batch.forward_iter, batch.launch_ts = k, t
        self.assertEqual({bucket for bucket, _ in filed}, {8, 16})
        for bucket, step_seconds in filed:
            self.assertAlmostEqual(step_seconds, {8: 0.010, 16: 0.050}[bucket])

    def test_learns_the_crossover_from_the_steps_it_times(self):
        policy = self.spec_policy()
        clock = {"forward": 0, "t": 0.0}
        # batch 8: a speculative step (4 tokens per request) in 0.019 s beats a
        # plain one in 0.011 s; batch 256, harder traffic: a speculative step (2
        # tokens per request) in 0.125 s loses to a plain one in 0.035 s.
        small = self.run_steps(policy, 8, 100, {PLAIN: 0.011, 3: 0.019}, 4, clock)
        self.assertGreater(small[-50:].count(False), 45)
        large = self.run_steps(policy, 256, 100, {PLAIN: 0.035, 3: 0.125}, 2, clock)
        self.assertGreater(large[-50:].count(True), 45)
        state = policy.get_state()
        self.assertEqual(state["policy"], "auto")
        self.assertAlmostEqual(state["step_costs_seconds"]["0"][256], 0.035)
        self.assertAlmostEqual(state["step_costs_seconds"]["3"][8], 0.019)
        self.assertLess(state["accept_length"]["3"], 3.5)  # plain since: stale
        self.assertLess(state["expected_gain"], 0)
        self.assertGreater(policy.step_counts[("plain", "best_throughput")], 40)
        self.assertGreaterEqual(policy.num_toggles, 1)

    def test_a_slow_first_plain_step_does_not_keep_it_speculating(self):
        """Batch 128 as a decode-rate run met it: the first timed plain step took
        92 ms, later ones 13.5 ms, a speculative step 60 ms for 4 tokens per
        request. The calibration's median is the plain step's cost, so the policy
        goes plain at once rather than after the slow sample has decayed."""
        policy = self.spec_policy()
        plain_launches = []

        def seconds(mode):
            if mode != PLAIN:
                return 0.060
            plain_launches.append(mode)
            return 0.092 if len(plain_launches) == 3 else 0.0135

        clock = {"forward": 0, "t": 0.0}
        steps = self.run_steps(policy, 128, 60, seconds, 4, clock)
        self.assertNotIn(False, steps[-40:])  # all plain
        self.assertAlmostEqual(
            policy.get_state()["step_costs_seconds"]["0"][128], 0.0135
        )

    def test_times_a_closed_loop_where_requests_finish_every_few_steps(self):
        """A closed loop at 128 as the 2026-12-03 sweep ran it: requests finish in
        every third step, and the prefill of their replacements runs before the
        next one. The plain step must get timed there, and win (a speculative
        step takes 62 ms for 3.7 tokens per request, a plain one 9.7 ms)."""
        policy = self.spec_policy(fold_interval=16)
        clock = {"forward": 0, "t": 0.0}
        self.run_steps(policy, 16, 50, {PLAIN: 0.0054, 3: 0.012}, 3.7, clock)
        batch = self.decode_batch(128)
        chosen = []
        for k in range(600):
            size = 124 if k % 3 == 2 else 128
            batch.batch_size = lambda size=size: size
            policy.plan_decode_step(batch)
            plain = batch.spec_plain_step
            chosen.append(plain)
            clock["forward"] += 1 if k % 3 else 2  # a prefill ran before
            clock["t"] += 0.0097 if plain else 0.062
            batch.forward_iter, batch.launch_ts = clock["forward"], clock["t"]
            if not plain:
                policy.observe_verify(3, [3] * size)
        self.assertGreater(chosen.count(True), 0.95 * len(chosen))
        self.assertAlmostEqual(
            policy.get_state()["step_costs_seconds"]["0"][128], 0.0097
        )

    def test_chooses_among_the_adaptive_step_counts(self):
        """With --speculative-adaptive: plain, 1 or 3 draft steps, whichever the
        measured times and acceptance favour at each batch size; the worker gets
        the choice in spec_num_steps."""
        policy = self.spec_policy(speculative_steps=[1, 3], sets_step_count=True)
        clock = {"forward": 0, "t": 0.0}
        # Each draft accepted with p = 0.9: 1.9 tokens per request at 1 step,
        # 3.44 at 3 (rounded to 2 and 3 accepted tokens here).
        accepted = {1: 2, 3: 3}.get
        # batch 4: 3 steps (3 tokens / 0.020 s) beat 1 step (2 / 0.014) and plain.
        small = self.run_steps(
            policy, 4, 120, {PLAIN: 0.010, 1: 0.014, 3: 0.020}, accepted, clock
        )
        self.assertGreater(small[-50:].count(3), 45)
        # batch 64: 1 step (2 / 0.024 s) beats 3 steps (3 / 0.060) and plain (1 / 0.016).
        mid = self.run_steps(
            policy, 64, 120, {PLAIN: 0.016, 1: 0.024, 3: 0.060}, accepted, clock
        )
        self.assertGreater(mid[-50:].count(1), 45)
        state = policy.get_state()
        self.assertAlmostEqual(state["step_costs_seconds"]["1"][64], 0.024)
        self.assertAlmostEqual(state["accept_length"]["1"], 2.0)
        self.assertAlmostEqual(state["accept_length"]["3"], 3.0)

    def test_refuses_step_counts_it_cannot_run(self):
        for bad in ([], [PLAIN, 3]):
            with self.assertRaises(ValueError):
                self.spec_policy(speculative_steps=bad)
        with self.assertRaises(ValueError):
            self.spec_policy(fold_interval=0)

    def test_a_batch_made_by_a_prefill_is_not_timed(self):
        policy = self.spec_policy()
        prefill = SimpleNamespace(is_decode=lambda: False)
        decode = SimpleNamespace(is_decode=lambda: True)
        batch = SimpleNamespace(
            batch_size=lambda: 8, spec_plain_step=False, spec_num_steps=None
        )
        # Under overlap the third launch waits for the prefill's result: 5 s.
        launches = [(prefill, 1, 0.0), (decode, 2, 0.01), (decode, 3, 5.01)]
        for mode, forward_iter, launch_ts in launches:
            batch.forward_mode, batch.forward_iter = mode, forward_iter
            batch.launch_ts = launch_ts
            batch.spec_plain_step = False
            policy.plan_decode_step(batch)
        # The prefill's 5 s are not a decode step's.
        self.assertIsNone(policy.get_state()["step_costs_seconds"]["3"][8])

    def test_tp_ranks_decide_alike_from_different_local_timings(self):
        """Two ranks whose clocks disagree by 30%: the step times are summed over
        the ranks before either folds them, so their decisions stay identical."""
        barrier = threading.Barrier(2)
        exchange: List[List[float]] = [[], []]

        def reduce_for(rank):
            def reduce(values):
                exchange[rank] = values
                barrier.wait()
                total = [a + b for a, b in zip(*exchange)]
                barrier.wait()
                return total

            return reduce

        decisions = [None, None]

        def run(rank, scale):
            policy = self.spec_policy(reduce=reduce_for(rank), fold_interval=4)
            clock = {"forward": 0, "t": 0.0}
            steps = []
            for bs in (8, 256, 64, 8):
                seconds = {PLAIN: 0.011 * scale * bs**0.3, 3: 0.019 * scale * bs**0.5}
                steps += self.run_steps(policy, bs, 60, seconds, 4, clock)
            decisions[rank] = (steps, policy.get_state()["step_costs_seconds"])

        threads = [
            threading.Thread(target=run, args=(r, s)) for r, s in ((0, 1.0), (1, 1.3))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        self.assertEqual(decisions[0], decisions[1])
        self.assertIn(True, decisions[0][0])
        self.assertIn(False, decisions[0][0])

    def test_observations_are_folded_only_every_fold_interval(self):
        pending = PendingObservations([PLAIN, 3], [1, 8])
        policy = ThroughputPolicy(
            StepCosts.unmeasured([PLAIN, 3], [1, 8]), AcceptanceEstimate([3], {3: 1.0})
        )
        pending.add_step_time(PLAIN, 8, 0.010)
        pending.add_step_time(PLAIN, 8, 0.014)
        pending.add_verify(3, num_tokens=30, num_requests=10)
        self.assertIsNone(policy.costs.estimate(PLAIN, 8))
        pending.fold_into(policy, list)
        self.assertEqual(policy.costs.estimate(PLAIN, 8), 0.010)  # the lower of two
        self.assertAlmostEqual(policy.acceptance.expected(3), 3.0)
        pending.fold_into(policy, list)  # nothing new: unchanged
        self.assertEqual(policy.costs.estimate(PLAIN, 8), 0.010)

    def test_a_new_best_acceptance_folded_in_resets_the_probe_interval(self):
        for reduce in (None, list):
            with self.subTest(reduce=reduce):
                p = policy(
                    min_dwell_steps=0,
                    probe_interval=16,
                    explore_steps=2,
                    max_probe_backoff=4,
                )
                for _ in range(200):
                    p.decide(256)
                self.assertEqual(p.get_state()["probe_interval"], 64)
                pending = PendingObservations([PLAIN, 3], SIZES)
                pending.add_verify(3, num_tokens=256 * 3, num_requests=256)
                pending.fold_into(p, reduce)
                self.assertEqual(p.get_state()["probe_interval"], 16)

    def test_buckets(self):
        self.assertEqual(power_of_two_buckets(48), [1, 2, 4, 8, 16, 32, 64])
        self.assertEqual(power_of_two_buckets(1), [1])


if __name__ == "__main__":
    unittest.main()
