"""Load-aware speculation without a threshold (``--speculative-disable-batch-threshold
auto``): each decode step runs the mode with the best expected output throughput.

A mode is a number of draft steps: 0 is the plain step (one token per request), s > 0
a speculative step with s draft steps. With running batch b, mode m produces
``b * E[accept length | m]`` tokens (1 per request for the plain step) in ``T_m(b)``
seconds; the policy picks the mode with the most tokens per second, with a margin and
a dwell so that a batch at the crossover does not flip every step.

* ``StepCosts``: ``T_m(b)`` per batch bucket, the low median of the last samples
  there: decode steps timed alone (steps with a prefill in them are not fed), or
  with TP the ranks' mean of their low medians over a fold. Times measured while
  serving price attention at the context lengths actually served, which a replay
  of the captured graphs (at their capture-time lengths) would not. A bucket timed
  once, in a step that may have stalled, is capped by its neighbours (the class
  says how); a bucket not timed yet costs the lower bound its timed neighbours give.
* ``AcceptanceEstimate``: ``E[accept length | m]`` observed over speculative steps
  (an EMA per step count); step counts not observed yet, or not for a while, are
  predicted from the per-token acceptance of a chain fitted to the freshest one
  (``E = 1 + p + ... + p^s``).
* ``ThroughputPolicy``: the decision, with a margin and a dwell; a mode not timed
  at a bucket, where it could win, runs there for a few steps (calibration), and
  now and then the other mode runs for a few (a probe), so that neither its time
  nor, while plain, the acceptance goes stale (the class says when).
* ``ThroughputSpecPolicy``: the scheduler's policy object: times steps from the
  launches of the running batch (``DecodeStepTimer``) and folds what the steps
  observed into the policy, summed over TP ranks (``PendingObservations``), so that
  every rank decides from the same inputs.

The policy is pure Python: ``ThroughputSpecPolicy.from_server_args`` injects the TP
sum.
"""

from __future__ import annotations

import bisect
import collections
import json
import logging
import math
import statistics
import time
from typing import (
    TYPE_CHECKING,
    Callable,
    Deque,
    Dict,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

from sglang.srt.environ import envs
from sglang.srt.speculative.spec_policy import (
    DEFAULT_MIN_DWELL_STEPS,
    REASON_DWELL,
    log_toggle,
    mark_plain_step,
    step_count_state,
)

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

logger = logging.getLogger(__name__)

PLAIN = 0

# Samples in a bucket's median step time.
COST_WINDOW = 8
# How many times what a smaller bucket's time per request gives a bucket's only timed
# step must take to count as a stall: a step that waited (for a kernel's compile, or
# behind a burst of request handling) takes several times that; near 1x, capping would
# move the bucket's cost with the smaller bucket's noise.
STALL_FACTOR = 2.0

# Decision reasons (a metric label, as the thresholds' are); with REASON_DWELL: another
# mode is better, but the dwell has not elapsed.
REASON_BEST = "best_throughput"  # the mode with the best expected tokens/s
REASON_MARGIN = "within_margin"  # another mode is better, but not by the margin
REASON_PROBE = "probe"  # another mode's step, refreshing its time and acceptance
# A mode's first steps at a batch bucket, and the steps while a mode is untimed
# at every bucket.
REASON_CALIBRATE = "calibrate"


def chain_accept_length(p: float, num_steps: int) -> float:
    """Expected tokens per verify step of a chain whose drafts are each accepted
    with probability p given the previous one was: 1 + p + ... + p^num_steps."""
    if p >= 1.0:
        return num_steps + 1.0
    return (1 - p ** (num_steps + 1)) / (1 - p)


def fit_chain_acceptance(accept_length: float, num_steps: int) -> float:
    """The per-token acceptance p with ``chain_accept_length(p, num_steps)`` equal to
    ``accept_length`` (clamped to the reachable range [1, num_steps + 1])."""
    target = min(max(accept_length, 1.0), num_steps + 1.0)
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-9:
        mid = (lo + hi) / 2
        if chain_accept_length(mid, num_steps) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _least_time_ratio(num_steps: int, other_num_steps: int) -> float:
    """The least a step of ``num_steps`` draft steps can take, in steps of
    ``other_num_steps`` at the same batch: no less than one of fewer draft steps,
    and no less than its share of the draft steps of one of more."""
    return min(num_steps, other_num_steps) / other_num_steps


class StepCosts:
    """Seconds of one decode step by mode and batch bucket (a batch costs what the
    smallest bucket >= its size costs), measured online: a bucket's estimate is the
    low median of its last ``window`` samples. Step times are noisy upwards (a first
    step at a new size, a host stall such as a garbage collection): the median
    keeps slow steps from setting a bucket's cost, and the low one does so even with
    two samples, where a median would be their mean. A bucket timed once (since its
    start or its last ``restart``) costs at most what a larger measured one costs,
    and, where it took far more than its batch size times a smaller one's time per
    request, or (speculative modes) than another step count's time there scaled
    between the two, at most that (``_capped``): that sample may have caught a
    stall, and a mode it priced out would not run there again to be timed (nor,
    priced from it, at the buckets above). A bucket without samples is priced from
    its neighbours (``_lower_bound``). A bucket ``restart``-ed keeps its cost until
    its next sample, which then starts its window afresh."""

    def __init__(
        self,
        profile: Dict[int, Dict[int, Optional[float]]],
        window: int = COST_WINDOW,
    ) -> None:
        """profile: {mode: {batch bucket: seconds or None}}, every mode at the same
        buckets; a given time counts as the bucket's first sample."""
        sizes = {tuple(sorted(by_bs)) for by_bs in profile.values()}
        if len(sizes) != 1 or not next(iter(sizes)):
            raise ValueError("the step costs need every mode at the same batch sizes")
        if window < 2:
            # A window of one sample would leave every bucket timed once, for good.
            raise ValueError(f"window must be >= 2, got {window}")
        self.batch_sizes: List[int] = list(next(iter(sizes)))
        self._samples: Dict[int, List[Deque[float]]] = {
            mode: [
                collections.deque(
                    () if by_bs[bs] is None else (by_bs[bs],), maxlen=window
                )
                for bs in self.batch_sizes
            ]
            for mode, by_bs in profile.items()
        }
        self._restarting: Set[Tuple[int, int]] = set()  # (mode, bucket index)
        self._timed_once: Set[Tuple[int, int]] = set()  # (mode, bucket index)
        # The samples' medians, and the costs they give, kept as samples arrive:
        # estimate runs every step.
        self._medians: Dict[int, List[Optional[float]]] = {
            mode: [by_bs[bs] for bs in self.batch_sizes]
            for mode, by_bs in profile.items()
        }
        self._seconds = {mode: list(row) for mode, row in self._medians.items()}
        # Per bucket, the other buckets by distance from it.
        buckets = range(len(self.batch_sizes))
        self._nearest_first = [
            sorted((j for j in buckets if j != i), key=lambda j: abs(j - i))
            for i in buckets
        ]

    @classmethod
    def unmeasured(
        cls, modes: Sequence[int], batch_sizes: Sequence[int], window: int = COST_WINDOW
    ) -> "StepCosts":
        return cls({m: dict.fromkeys(batch_sizes) for m in modes}, window)

    @property
    def modes(self) -> List[int]:
        return sorted(self._samples)

    def _index(self, batch_size: int) -> int:
        """The index of the bucket a batch of this size is timed in: the smallest
        batch size >= it, or the largest one beyond them."""
        i = bisect.bisect_left(self.batch_sizes, batch_size)
        return min(i, len(self.batch_sizes) - 1)

    def bucket(self, batch_size: int) -> int:
        return self.batch_sizes[self._index(batch_size)]

    def estimate(self, mode: int, batch_size: int) -> Optional[float]:
        """T_mode(batch_size): its bucket's time (beyond the largest bucket, its
        time per request times the batch size); at an unmeasured bucket, the lower
        bound its measured neighbours give; None while the mode is unmeasured at
        every bucket."""
        i = self._index(batch_size)
        row = self._seconds[mode]
        if row[i] is None:
            return self._lower_bound(row, i, batch_size)
        if batch_size <= self.batch_sizes[i]:
            return row[i]
        return row[i] * batch_size / self.batch_sizes[i]

    def _lower_bound(
        self, row: List[Optional[float]], i: int, batch_size: int
    ) -> Optional[float]:
        """At least what the nearest smaller measured bucket costs, and at least the
        nearest larger one's time per request times the batch size. Optimistic on
        purpose: the policy then tends to run the unmeasured mode, which times it;
        a pessimistic guess would keep it from ever running there."""
        below = next((row[j] for j in range(i - 1, -1, -1) if row[j] is not None), None)
        above = next(
            (
                row[j] * batch_size / self.batch_sizes[j]
                for j in range(i + 1, len(row))
                if row[j] is not None
            ),
            None,
        )
        bounds = [b for b in (below, above) if b is not None]
        return max(bounds) if bounds else None

    def is_measured(self, mode: int, batch_size: int) -> bool:
        """Whether the mode has been timed at this batch size's bucket."""
        return self._seconds[mode][self._index(batch_size)] is not None

    def restart(self, mode: int, batch_size: int) -> None:
        """Let the next sample of this mode in this batch size's bucket replace its
        window."""
        self._restarting.add((mode, self._index(batch_size)))

    def observe(self, mode: int, batch_size: int, seconds: float) -> None:
        """Add the measured time of one decode step (no prefill in it) to its
        bucket's samples."""
        i = self._index(batch_size)
        samples = self._samples[mode][i]
        if (mode, i) in self._restarting:
            self._restarting.discard((mode, i))
            samples.clear()
        samples.append(seconds)
        if len(samples) == 1:
            self._timed_once.add((mode, i))
        else:
            self._timed_once.discard((mode, i))
        self._medians[mode][i] = statistics.median_low(samples)
        self._update_costs(mode)
        self._recap_other_step_counts(mode, i)

    def _update_costs(self, mode: int) -> None:
        """Each bucket's median; where one step only timed the bucket, capped
        (``_capped``)."""
        medians = self._medians[mode]
        for i, median in enumerate(medians):
            if median is not None and (mode, i) in self._timed_once:
                median = self._capped(mode, i)
            self._seconds[mode][i] = median

    def _recap_other_step_counts(self, mode: int, i: int) -> None:
        """Caps the other step counts' costs at bucket ``i`` that one step timed,
        now that ``mode`` has a time there (``_other_mode_bound``)."""
        if mode == PLAIN:
            return
        for other, j in self._timed_once:
            if j == i and other not in (mode, PLAIN):
                self._seconds[other][i] = self._capped(other, i)

    def _capped(self, mode: int, i: int) -> float:
        """The cost of bucket ``i``, timed by one step: at most what a larger
        measured bucket costs (a step costs no less at a larger batch), and at most
        the least of ``_per_request_bound`` and ``_other_mode_bound`` where the step
        took over ``STALL_FACTOR`` times that."""
        medians = self._medians[mode]
        cost = min(seconds for seconds in medians[i:] if seconds is not None)
        bounds = [self._per_request_bound(mode, i), self._other_mode_bound(mode, i)]
        bound = min((b for b in bounds if b is not None), default=None)
        if bound is not None and medians[i] > STALL_FACTOR * bound:
            return min(cost, bound)
        return cost

    def _per_request_bound(self, mode: int, i: int) -> Optional[float]:
        """What the smaller buckets' times per request give at bucket ``i``'s size
        (a step costs no more per request at a larger batch)."""
        size = self.batch_sizes[i]
        return min(
            (
                seconds * size / batch_size
                for seconds, batch_size in zip(
                    self._medians[mode][:i], self.batch_sizes
                )
                if seconds is not None
            ),
            default=None,
        )

    def _other_mode_bound(self, mode: int, i: int) -> Optional[float]:
        """For a speculative mode: what the other speculative modes timed at bucket
        ``i`` give there, each scaled by its time ratio to ``mode`` at the nearest
        bucket both were timed at, more than once where there is one; the highest.
        Step counts' times grow alike with the batch (a plain step's far slower). A
        probe runs the best other mode only, so among several step counts, one
        priced out by a stall would not be timed there again. A single step at the
        anchor may have caught a stall too, and a stalled other mode would scale
        ``mode`` down by the stall: the ratio is at least what the step counts alone
        give (``_least_time_ratio``)."""
        if mode == PLAIN:
            return None
        row = self._medians[mode]
        bounds = []
        for other, medians in self._medians.items():
            if other in (mode, PLAIN) or medians[i] is None:
                continue
            anchors = [
                j
                for j in self._nearest_first[i]
                if row[j] is not None and medians[j] is not None
            ]
            if not anchors:
                continue
            j = next(
                (
                    j
                    for j in anchors
                    if self._timed_repeatedly(mode, j)
                    and self._timed_repeatedly(other, j)
                ),
                anchors[0],
            )
            ratio = max(row[j] / medians[j], _least_time_ratio(mode, other))
            bounds.append(medians[i] * ratio)
        return max(bounds, default=None)

    def _timed_repeatedly(self, mode: int, i: int) -> bool:
        return self._medians[mode][i] is not None and (mode, i) not in self._timed_once

    def table(self) -> Dict[str, Dict[int, Optional[float]]]:
        return {
            str(mode): dict(zip(self.batch_sizes, row))
            for mode, row in sorted(self._seconds.items())
        }


class AcceptanceEstimate:
    """Tokens per verify step (accepted drafts + the bonus token), per step count.

    Each step count's estimate is the mean of its first ``1 / ema_alpha`` verify
    steps, then an EMA over them. A step count not verified within the last
    ``stale_after`` verify steps (the traffic may have changed since) is predicted,
    as one never verified, from the per-token acceptance of a chain fitted to the
    nearest fresh one."""

    def __init__(
        self,
        draft_step_counts: Sequence[int],
        prior_accept_length: Dict[int, float],
        ema_alpha: float = 0.1,
        stale_after: int = 256,
    ) -> None:
        """prior_accept_length: for at least one step count, what to expect before a
        speculative step has been observed (1.0: speculation must earn its place);
        the first observation of any step count replaces it for all of them."""
        if not prior_accept_length:
            raise ValueError("the acceptance estimate needs a prior")
        self.draft_step_counts = sorted(draft_step_counts)
        self.ema_alpha = ema_alpha
        self._mean_span = int(1 / ema_alpha)
        self.stale_after = stale_after
        self._prior = dict(prior_accept_length)
        self._observed: Dict[int, float] = {}
        self._num_verifies = 0
        # Per step count: its verify steps, and the total count at its last one.
        self._verifies_of: Dict[int, int] = {}
        self._last_verify: Dict[int, int] = {}
        # The highest estimate each step count has had once it averaged over as
        # many verify steps as its EMA does (a lucky first step is not a best).
        self._best: Dict[int, float] = {}
        # The predictions of the step counts not fresh, until the next observation:
        # each fits a chain, and the policy asks for every step count at every step.
        self._predicted: Dict[int, float] = {}

    def observe(
        self,
        num_steps: int,
        num_tokens: float,
        num_requests: float,
        num_verifies: int = 1,
    ) -> bool:
        """``num_verifies`` verify steps of one step count: ``num_tokens`` committed
        by ``num_requests`` verified requests in all: the estimate moves as it would
        for that many steps of the group's mean, one at a time. Returns whether the
        estimate rose above its best so far."""
        if num_requests <= 0 or num_verifies <= 0:
            return False
        sample = num_tokens / num_requests
        best_before = self.best(num_steps)
        seen = self._verifies_of.get(num_steps, 0)
        verifies = seen + num_verifies
        # The verify steps in the mean of the first ones; each later one is an EMA step.
        averaged = max(seen, min(verifies, self._mean_span))
        kept = seen / averaged * (1 - self.ema_alpha) ** (verifies - averaged)
        old = self._observed.get(num_steps, sample)
        new = sample + kept * (old - sample)
        self._observed[num_steps] = new
        self._verifies_of[num_steps] = verifies
        self._num_verifies += num_verifies
        self._last_verify[num_steps] = self._num_verifies
        if verifies >= self._mean_span:
            self._best[num_steps] = max(self._best.get(num_steps, new), new)
        self._predicted.clear()
        return new > best_before

    def expected(self, num_steps: int) -> float:
        """E[accept length | num_steps]; step counts unobserved or stale from the
        chain fit to the nearest fresh one (or prior)."""
        if num_steps == PLAIN:
            return 1.0
        if self._is_fresh(num_steps):
            return self._observed[num_steps]
        if num_steps not in self._predicted:
            self._predicted = self._predictions([*self.draft_step_counts, num_steps])
        return self._predicted[num_steps]

    def _predictions(self, step_counts: Sequence[int]) -> Dict[int, float]:
        """The estimates of these step counts from the fresh ones (or the prior),
        fitting each one's chain at most once."""
        known = {s: e for s, e in self._observed.items() if self._is_fresh(s)}
        known = known or self._prior
        fitted: Dict[int, float] = {}  # per known step count, its chain's p
        predictions = {}
        for num_steps in step_counts:
            if num_steps in known:
                predictions[num_steps] = known[num_steps]
                continue
            nearest = min(known, key=lambda s: (abs(s - num_steps), s))
            if nearest not in fitted:
                fitted[nearest] = fit_chain_acceptance(known[nearest], nearest)
            predictions[num_steps] = chain_accept_length(fitted[nearest], num_steps)
        return predictions

    def _is_fresh(self, num_steps: int) -> bool:
        """Whether this step count was verified within ``stale_after`` verify steps
        (the last one verified always was)."""
        last = self._last_verify.get(num_steps)
        return last is not None and self._num_verifies - last < self.stale_after

    def is_settled(self) -> bool:
        """Whether the estimate rests on as many verify steps as its EMA averages
        over."""
        return self._num_verifies >= self._mean_span

    def best(self, num_steps: int) -> float:
        """The highest E[accept length | num_steps] so far (the current estimate
        while it has none); every draft accepted until the estimate has settled: a
        few requests' verify steps cannot rule speculation out."""
        if not self.is_settled():
            return num_steps + 1.0
        return max(self.expected(num_steps), self._best.get(num_steps, 1.0))

    def state(self) -> Dict[str, float]:
        return {str(s): round(self.expected(s), 4) for s in self.draft_step_counts}


class ThroughputDecision(NamedTuple):
    num_steps: int  # 0: a plain step
    reason: str
    toggled: bool  # True iff plain vs speculative differs from the previous step
    # Expected tokens/s of the best speculative mode over the plain step's, minus
    # 1 (0 while they are untimed at every bucket): > 0 where speculation pays.
    expected_gain: float


class ThroughputPolicy:
    """Chooses each decode step's mode by expected output tokens per second.

    A mode not yet timed at the batch's bucket is priced at the lower bound of its
    timed neighbours, and run there for ``calibrate_steps`` steps (``calibrate``, cut
    short if the batch leaves the bucket) once the current mode has been timed there,
    if at that price it would beat the current mode (``_worth_calibrating``); at most
    once per ``probe_interval`` steps while its time has not arrived;
    ``probe_interval`` steps after the last probe or calibration, the best other mode
    runs for ``explore_steps`` (``probe``), which keeps its time and, while plain, the
    acceptance current. A change of mode does not restart that count: a mode entered
    long after the last probe soon probes the one it left, which catches a change made
    on a passing estimate. A probe that refreshes the acceptance comes sooner where
    its steps lose less (``_acceptance_probe_interval``): probes then lose at most
    ``explore_steps / probe_interval`` of the output. Where a probe can refresh only a
    step time (``_only_a_time_can_go_stale``), the interval is multiplied by the
    probed mode's step time over the current one's (probes take that share of the
    time, not of the steps) and by the current mode's lead over it (``_lead``), and
    each probe doubles it, up to ``max_probe_backoff`` times ``probe_interval``; any
    other probe, a change of mode or, while plain, a new best acceptance resets it.
    A new mode is held for ``min_dwell_steps`` steps while the batch stays in the
    bucket it was chosen at, unless it was chosen there on a lower bound (untimed
    there): then its first time decides at once. The mode left is timed afresh at
    that bucket (``StepCosts.restart``): if a passing stretch of slow steps made the
    change, the steps that made it do not outvote its next probe's.
    """

    def __init__(
        self,
        costs: StepCosts,
        acceptance: AcceptanceEstimate,
        margin: float = 0.05,
        min_dwell_steps: int = DEFAULT_MIN_DWELL_STEPS,
        probe_interval: int = 256,
        explore_steps: int = 4,
        calibrate_steps: int = 5,
        max_probe_backoff: int = 2,
        min_probe_interval: int = 16,
    ) -> None:
        if PLAIN not in costs.modes:
            raise ValueError("the step costs need the plain step (mode 0)")
        missing = set(acceptance.draft_step_counts) - set(costs.modes)
        if missing:
            raise ValueError(f"no step costs for draft step counts {sorted(missing)}")
        if margin < 0 or min_dwell_steps < 0:
            raise ValueError("margin and dwell must be >= 0")
        if min(probe_interval, explore_steps, calibrate_steps, min_probe_interval) < 1:
            raise ValueError(
                "probe_interval, explore_steps, calibrate_steps and "
                "min_probe_interval must be >= 1"
            )
        if max_probe_backoff < 1:
            raise ValueError("max_probe_backoff must be >= 1")
        self.costs = costs
        self.acceptance = acceptance
        self.margin = margin
        self.min_dwell_steps = min_dwell_steps
        self.probe_interval = probe_interval
        self.explore_steps = explore_steps
        self.calibrate_steps = calibrate_steps
        self.max_probe_interval = probe_interval * max_probe_backoff
        self.min_probe_interval = min(min_probe_interval, probe_interval)
        self.modes = [PLAIN] + [s for s in acceptance.draft_step_counts if s != PLAIN]

        # The mode the policy is in (exploration does not change it), how many steps
        # it has lasted, and what the last step ran.
        self._mode = max(self.modes)  # start speculating, as the threshold policy does
        self._mode_bucket: Optional[int] = None  # where the mode was chosen
        self._mode_timed_when_chosen = False  # else its dwell does not hold
        self._steps_in_mode = 0
        self._steps_since_explore = 0
        self._probe_interval_now = probe_interval
        # The steps since the last exploration after which the next probe that can
        # refresh only a time runs, spaced once its interval has passed (None: not
        # spaced yet).
        self._probe_due: Optional[int] = None
        self._exploring: Optional[Tuple[int, str]] = None  # (mode, reason)
        self._explore_left = 0
        # The bucket a calibration times: it ends where the batch leaves it, as its
        # steps elsewhere would time nothing (None: a probe, which also refreshes
        # the acceptance, runs on at any size).
        self._explore_bucket: Optional[int] = None
        # The decode step of the last calibration of each (mode, bucket).
        self._calibrated_at: Dict[Tuple[int, int], int] = {}
        self._num_decisions = 0
        self._last_speculated = True
        self.last_gain = 0.0
        self.num_toggles = 0
        self.num_probes = 0
        self.num_calibrations = 0
        # Decode steps by (mode, reason).
        self.step_counts: Dict[Tuple[int, str], int] = {}

    def throughput(
        self, num_steps: int, batch_size: int, accept_length: Optional[float] = None
    ) -> Optional[float]:
        """Expected output tokens per second of one step of this mode, at the
        acceptance estimate or at ``accept_length`` (None while the mode is untimed
        at every bucket)."""
        seconds = self.costs.estimate(num_steps, batch_size)
        if seconds is None:
            return None
        if accept_length is None:
            accept_length = self.acceptance.expected(num_steps)
        return batch_size * accept_length / seconds

    @property
    def speculating(self) -> bool:
        """Whether the last decided step speculated (True before the first)."""
        return self._last_speculated

    def decide(self, batch_size: int) -> ThroughputDecision:
        """The mode of the next decode step; advances the state."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        rates = {m: self.throughput(m, batch_size) for m in self.modes}
        bucket = self.costs.bucket(batch_size)
        mode, reason = self._mode_by_rates(rates, bucket)
        chosen = mode
        explore = self._exploration(mode, rates, batch_size, bucket)
        if explore is not None:
            chosen, reason = explore
        toggled = (chosen != PLAIN) != self._last_speculated
        self._advance(mode, chosen, toggled, bucket)
        self.last_gain = self._speculation_gain(rates)
        key = (chosen, reason)
        self.step_counts[key] = self.step_counts.get(key, 0) + 1
        return ThroughputDecision(chosen, reason, toggled, self.last_gain)

    def _speculation_gain(self, rates: Dict[int, Optional[float]]) -> float:
        spec = [r for m, r in rates.items() if m != PLAIN and r is not None]
        if not spec or rates[PLAIN] is None:
            return 0.0
        return max(spec) / rates[PLAIN] - 1

    def _mode_by_rates(
        self, rates: Dict[int, Optional[float]], bucket: int
    ) -> Tuple[int, str]:
        """The policy's mode among the measured ones, with margin and dwell (which
        holds only at the bucket the mode was chosen at: a batch that moved to
        another bucket is a different comparison, not a flip at the crossover)."""
        current = rates[self._mode]
        measured = {m: r for m, r in rates.items() if r is not None}
        if current is None or len(measured) < 2:
            return self._mode, REASON_CALIBRATE
        best = max(measured, key=lambda m: (measured[m], -m))
        if best == self._mode:
            return self._mode, REASON_BEST
        if measured[best] <= current * (1 + self.margin):
            return self._mode, REASON_MARGIN
        if (
            self._steps_in_mode < self.min_dwell_steps
            and bucket == self._mode_bucket
            and self._mode_timed_when_chosen
        ):
            return self._mode, REASON_DWELL
        return best, REASON_BEST

    def _exploration(
        self,
        mode: int,
        rates: Dict[int, Optional[float]],
        batch_size: int,
        bucket: int,
    ) -> Optional[Tuple[int, str]]:
        """(mode, reason) of a calibration or probe step instead of ``mode``: the
        next step of one under way, or the first of a new one (advances the state)."""
        if self._explore_left > 0 and self._explore_bucket in (bucket, None):
            self._explore_left -= 1
            return self._exploring
        self._explore_left = 0
        return self._start_calibration(
            mode, rates, batch_size, bucket
        ) or self._start_probe(mode, rates, batch_size)

    def _start_calibration(
        self,
        mode: int,
        rates: Dict[int, Optional[float]],
        batch_size: int,
        bucket: int,
    ) -> Optional[Tuple[int, str]]:
        """The first step of timing a mode not yet timed at ``bucket``, if due and
        worth it."""
        for other in self.modes:
            last = self._calibrated_at.get((other, bucket))
            due = last is None or self._num_decisions - last >= self.probe_interval
            if (
                other != mode
                and not self.costs.is_measured(other, batch_size)
                and due
                and self._worth_calibrating(other, mode, batch_size, rates[mode])
            ):
                self._calibrated_at[(other, bucket)] = self._num_decisions
                self.num_calibrations += 1
                return self._start_exploring(
                    other, REASON_CALIBRATE, self.calibrate_steps, bucket
                )
        return None

    def _start_probe(
        self, mode: int, rates: Dict[int, Optional[float]], batch_size: int
    ) -> Optional[Tuple[int, str]]:
        """The first step of a probe of the best other mode, if one is due."""
        # No probe comes sooner than min_probe_interval steps after the last.
        if self._steps_since_explore + 1 < self.min_probe_interval:
            return None
        others = [m for m in self.modes if m != mode]
        other = max(others, key=lambda m: (rates[m] or 0.0, m))
        if self._only_a_time_can_go_stale(mode, batch_size, rates[PLAIN]):
            if self._steps_since_explore + 1 < (
                self._probe_due or self._probe_interval_now
            ):
                return None
            if self._probe_due is None:
                self._probe_due = math.ceil(
                    self._probe_interval_now
                    * self._step_cost_ratio(other, mode, batch_size)
                    * self._lead(rates[mode], rates[other])
                )
                if self._steps_since_explore + 1 < self._probe_due:
                    return None
            self._probe_interval_now = min(
                2 * self._probe_interval_now, self.max_probe_interval
            )
            self._probe_due = None
        else:
            interval = self._acceptance_probe_interval(other, mode, batch_size, rates)
            if self._steps_since_explore + 1 < interval:
                return None
            self._reset_probe_interval()
        self.num_probes += 1
        return self._start_exploring(other, REASON_PROBE, self.explore_steps, None)

    def _worth_calibrating(
        self, other: int, mode: int, batch_size: int, mode_rate: Optional[float]
    ) -> bool:
        """Whether timing ``other`` at this batch size's bucket could change the
        choice: once ``mode``, which runs there anyway, has been timed there, if
        ``other`` would beat its rate at the lower bound of its time and the best
        acceptance it has had."""
        if not self.costs.is_measured(mode, batch_size):
            return False
        best = self.throughput(other, batch_size, self.acceptance.best(other))
        return best is None or best > mode_rate

    def _only_a_time_can_go_stale(
        self, mode: int, batch_size: int, plain_rate: Optional[float]
    ) -> bool:
        """Whether a probe from ``mode`` can refresh no estimate but the other modes'
        step times: while speculating (every step observes the acceptance, and
        step counts not run for a while follow the fit to the running one), or
        plain where no speculative mode would pay even at the best acceptance seen
        so far (only traffic easier than any before could change the choice)."""
        return mode != PLAIN or not self._speculation_could_pay(batch_size, plain_rate)

    def _acceptance_probe_interval(
        self,
        other: int,
        mode: int,
        batch_size: int,
        rates: Dict[int, Optional[float]],
    ) -> int:
        """The steps between probes that refresh the acceptance: ``probe_interval``
        where a probe step loses a whole step of ``mode``'s output or more (or
        either mode is untimed at every bucket), shorter in proportion where it
        loses less (down to ``min_probe_interval``), so that probes lose at most
        ``explore_steps / probe_interval`` of the output."""
        steps = self._time_ratio(other, mode, batch_size)
        if steps is None:
            return self.probe_interval
        # A step of `other` yields that much less than `steps` of `mode` would.
        loss = steps * max(0.0, 1 - rates[other] / rates[mode])
        return max(
            self.min_probe_interval, math.ceil(self.probe_interval * min(1.0, loss))
        )

    def _time_ratio(self, other: int, mode: int, batch_size: int) -> Optional[float]:
        """How many steps of ``mode`` one step of ``other`` takes at this batch size
        (None while either is untimed at every bucket)."""
        theirs = self.costs.estimate(other, batch_size)
        mine = self.costs.estimate(mode, batch_size)
        if theirs is None or mine is None:
            return None
        return theirs / mine

    def _step_cost_ratio(self, other: int, mode: int, batch_size: int) -> float:
        """``_time_ratio``, at least 1 (1 while either is untimed at every bucket)."""
        ratio = self._time_ratio(other, mode, batch_size)
        return 1.0 if ratio is None else max(1.0, ratio)

    def _lead(self, rate: Optional[float], other_rate: Optional[float]) -> float:
        """How many times faster the other mode's step would have to become to come
        within the margin of this one (at least 1; 1 while either is untimed at
        every bucket): a time that would have to drift that far goes stale that
        much later."""
        if rate is None or not other_rate:
            return 1.0
        return max(1.0, rate / (other_rate * (1 + self.margin)))

    def _speculation_could_pay(
        self, batch_size: int, plain_rate: Optional[float]
    ) -> bool:
        """Whether a speculative mode would beat the plain step by the margin at this
        batch size with the best acceptance it has had (True while a mode is untimed
        at every bucket)."""
        if plain_rate is None:
            return True
        for num_steps in self.modes[1:]:
            rate = self.throughput(
                num_steps, batch_size, self.acceptance.best(num_steps)
            )
            if rate is None or rate > plain_rate * (1 + self.margin):
                return True
        return False

    def _start_exploring(
        self, mode: int, reason: str, steps: int, bucket: Optional[int]
    ) -> Tuple[int, str]:
        self._exploring = (mode, reason)
        self._explore_left = steps - 1
        self._explore_bucket = bucket
        return self._exploring

    def _advance(self, mode: int, chosen: int, toggled: bool, bucket: int) -> None:
        if mode != self._mode:
            self.costs.restart(self._mode, bucket)
            self._mode, self._steps_in_mode, self._mode_bucket = mode, 0, bucket
            self._mode_timed_when_chosen = self.costs.is_measured(mode, bucket)
            self._reset_probe_interval()
        self._steps_in_mode += 1
        self._num_decisions += 1
        explored = chosen != mode
        self._steps_since_explore = 0 if explored else self._steps_since_explore + 1
        self._last_speculated = chosen != PLAIN
        self.num_toggles += toggled

    def observe_verify(
        self,
        num_steps: int,
        num_tokens: float,
        num_requests: float,
        num_verifies: int = 1,
    ) -> None:
        """``num_verifies`` speculative steps of one step count: ``num_tokens``
        committed by ``num_requests`` verified requests in all."""
        easier = self.acceptance.observe(
            num_steps, num_tokens, num_requests, num_verifies
        )
        if easier and self._mode == PLAIN:
            # Traffic easier than any before: speculation may pay where it would not.
            self._reset_probe_interval()

    def _reset_probe_interval(self) -> None:
        self._probe_interval_now = self.probe_interval
        self._probe_due = None

    def get_state(self) -> Dict[str, object]:
        """For /server_info: the learned table, the acceptance, the current gain."""
        return {
            "mode_num_steps": self._mode,
            "expected_gain": round(self.last_gain, 4),
            "step_costs_seconds": self.costs.table(),
            "accept_length": self.acceptance.state(),
            "num_toggles": self.num_toggles,
            "num_probes": self.num_probes,
            "num_calibrations": self.num_calibrations,
            "margin": self.margin,
            "min_dwell_steps": self.min_dwell_steps,
            "probe_interval": self._probe_interval_now,
            "explore_steps": self.explore_steps,
            "calibrate_steps": self.calibrate_steps,
        }


class StepSample(NamedTuple):
    num_steps: int
    batch_size: int
    seconds: float


class DecodeStepTimer:
    """Times decode steps from the scheduler's launches of the running batch.

    ``record`` is called once per decode step, before it is launched, with what the
    batch's previous launch recorded: the scheduler's forward counter, launch time,
    mode and batch size. The interval between two consecutive launches of the
    running batch is one decode step's time when no other batch (a prefill) ran in
    between; under the overlap scheduler it is the time of the step launched two
    before, so a sample counts only if the last three steps ran the same mode in
    the same batch bucket, one after another. Requests may finish in them: under
    load some finish in most steps, and a timer that waited for a step without
    one could wait for good.
    """

    WINDOW = 3

    def __init__(self, bucket: Callable[[int], int]) -> None:
        self._bucket = bucket
        # (forward_iter, launch time, num_steps, batch bucket, batch size) of the
        # last launches.
        self._launches: Deque[Tuple[int, float, int, int, int]] = collections.deque(
            maxlen=self.WINDOW
        )

    def record(
        self, forward_iter: int, launch_ts: float, num_steps: int, batch_size: int
    ) -> Optional[StepSample]:
        if self._launches and self._launches[-1][0] == forward_iter:
            return None  # the batch has not run since the last call
        launch = (
            forward_iter,
            launch_ts,
            num_steps,
            self._bucket(batch_size),
            batch_size,
        )
        self._launches.append(launch)
        if len(self._launches) < self.WINDOW:
            return None
        first = self._launches[0]
        contiguous = all(
            later[0] == first[0] + i and later[2:4] == first[2:4]
            for i, later in enumerate(self._launches)
        )
        if not contiguous:
            return None
        seconds = self._launches[-1][1] - self._launches[-2][1]
        # The size of the step timed under overlap (without it, the second launch's
        # step is timed; the three share a bucket).
        return StepSample(num_steps, first[4], seconds)


class PendingObservations:
    """What the decode steps observed since the last fold: step times per (mode,
    bucket) and committed tokens per step count. With TP, ``reduce`` adds up the
    ranks' per-fold medians and sums before every rank folds the same totals into
    its policy."""

    def __init__(self, modes: Sequence[int], batch_sizes: Sequence[int]) -> None:
        # Every rank flattens its sums in this order for the reduce.
        self._time_keys = [(m, bs) for m in modes for bs in batch_sizes]
        self._modes = list(modes)
        self._times: Dict[Tuple[int, int], List[float]] = {}
        self._verifies: Dict[int, List[float]] = {}  # [tokens, requests]
        # Verify steps per step count: rank-identical, so not summed over ranks.
        self._num_verifies: Dict[int, int] = {}

    def add_step_time(self, num_steps: int, bucket: int, seconds: float) -> None:
        self._times.setdefault((num_steps, bucket), []).append(seconds)

    def add_verify(self, num_steps: int, num_tokens: int, num_requests: int) -> None:
        total = self._verifies.setdefault(num_steps, [0.0, 0.0])
        total[0] += num_tokens
        total[1] += num_requests
        self._num_verifies[num_steps] = self._num_verifies.get(num_steps, 0) + 1

    def fold_into(
        self,
        policy: ThroughputPolicy,
        reduce: Optional[Callable[[List[float]], List[float]]] = None,
    ) -> None:
        """Feed the observations to the policy: per (mode, bucket) the low median
        step time (the mean of the ranks' with TP), per step count the tokens
        its verify steps committed (summed over the ranks)."""
        medians = {
            key: [statistics.median_low(times), 1.0]
            for key, times in self._times.items()
        }
        verifies = self._verifies
        if reduce is not None:
            medians, verifies = self._sum_over_ranks(medians, verifies, reduce)
        for (mode, bucket), (seconds, ranks) in medians.items():
            if ranks > 0:
                policy.costs.observe(mode, bucket, seconds / ranks)
        for mode, (tokens, requests) in verifies.items():
            policy.observe_verify(
                mode, tokens, requests, self._num_verifies.get(mode, 0)
            )
        self._times.clear()
        self._verifies.clear()
        self._num_verifies.clear()

    def _sum_over_ranks(
        self,
        medians: Dict[Tuple[int, int], List[float]],
        verifies: Dict[int, List[float]],
        reduce: Callable[[List[float]], List[float]],
    ) -> Tuple[Dict[Tuple[int, int], List[float]], Dict[int, List[float]]]:
        zero = (0.0, 0.0)
        flat = [
            x
            for totals, keys in ((medians, self._time_keys), (verifies, self._modes))
            for key in keys
            for x in totals.get(key, zero)
        ]
        summed = iter(reduce(flat))
        return (
            {key: [next(summed), next(summed)] for key in self._time_keys},
            {mode: [next(summed), next(summed)] for mode in self._modes},
        )


class StepTrace:
    """``SGLANG_LOAD_AWARE_STEP_TRACE``: one JSON line per timed decode step
    (``batch_size``, ``num_steps``, ``seconds``), per verify (``num_steps``,
    ``num_tokens``, ``num_requests``) and per decision (``decision``: its step
    count, ``reason``, ``batch_size``, ``t``: monotonic seconds), in the order they
    happened: what ``benchmark/dynamic_spec/policy_sim.py --trace`` replays. The
    decisions' times hold what the timed steps leave out: prefills in between and
    the steps around a switch."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)

    def step(self, sample: StepSample) -> None:
        self._write(sample._asdict())

    def decision(self, batch_size: int, decision: ThroughputDecision) -> None:
        self._write(
            {
                "decision": decision.num_steps,
                "reason": decision.reason,
                "batch_size": batch_size,
                "t": round(time.monotonic(), 6),
            }
        )

    def verify(self, num_steps: int, num_tokens: int, num_requests: int) -> None:
        self._write(
            {
                "num_steps": num_steps,
                "num_tokens": num_tokens,
                "num_requests": num_requests,
            }
        )

    def _write(self, record: Dict[str, Union[int, float, str]]) -> None:
        self._file.write(json.dumps(record) + "\n")


# Decode steps between two sums of the step times over TP ranks (one CPU
# all-reduce each); a single rank folds every step.
AUTO_FOLD_INTERVAL = 16


def tp_sum(values: List[float]) -> List[float]:
    import torch

    from sglang.srt.distributed import get_tp_group

    tensor = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(tensor, group=get_tp_group().cpu_group)
    return tensor.tolist()


def step_trace(tp_size: int) -> Optional[StepTrace]:
    """The trace SGLANG_LOAD_AWARE_STEP_TRACE asks for (one file per TP rank, the
    rank appended to the name with TP), or None."""
    path = envs.SGLANG_LOAD_AWARE_STEP_TRACE.get()
    if path is None:
        return None
    if tp_size > 1:
        from sglang.srt.distributed import get_tensor_model_parallel_rank

        path = f"{path}.tp{get_tensor_model_parallel_rank()}"
    return StepTrace(path)


def power_of_two_buckets(max_batch_size: int) -> List[int]:
    """1, 2, 4, ... up to the first power of two >= max_batch_size."""
    buckets = [1]
    while buckets[-1] < max_batch_size:
        buckets.append(buckets[-1] * 2)
    return buckets


class ThroughputSpecPolicy:
    """``--speculative-disable-batch-threshold auto``: the scheduler's per-step
    policy (a spec_policy.LoadAwarePolicy) on a ThroughputPolicy between
    the plain step and the server's speculative step counts: its
    ``--speculative-num-steps``, or with ``--speculative-adaptive`` every candidate
    step count the server captured (``sets_step_count``: the worker then runs the
    chosen one, from ``ScheduleBatch.spec_num_steps``, instead of the adaptive
    tier's).

    Step times come from ``DecodeStepTimer``, acceptance from the verify results
    (``observe_verify``); both are folded into the policy every ``fold_interval``
    decode steps, summed over TP ranks by ``reduce`` (None: a single rank), so
    that every rank decides from the same inputs.
    """

    def __init__(
        self,
        speculative_steps: Sequence[int],
        sets_step_count: bool,
        max_batch_size: int,
        min_dwell_steps: int,
        reduce: Optional[Callable[[List[float]], List[float]]],
        fold_interval: int,
        trace: Optional[StepTrace] = None,
    ) -> None:
        if fold_interval < 1:
            raise ValueError(f"fold_interval must be >= 1, got {fold_interval}")
        if not speculative_steps or PLAIN in speculative_steps:
            raise ValueError(
                f"the speculative step counts {list(speculative_steps)} must be "
                "one or more, all above 0"
            )
        buckets = power_of_two_buckets(max_batch_size)
        modes = [PLAIN, *sorted(speculative_steps)]
        self.sets_step_count = sets_step_count
        self.policy = ThroughputPolicy(
            StepCosts.unmeasured(modes, buckets),
            AcceptanceEstimate(speculative_steps, {max(speculative_steps): 1.0}),
            min_dwell_steps=min_dwell_steps,
        )
        self.timer = DecodeStepTimer(self.policy.costs.bucket)
        self.pending = PendingObservations(modes, buckets)
        self.reduce = reduce
        self.fold_interval = fold_interval
        self.trace = trace
        self._plans = 0
        # The running batch's size and mode at the last plan: what its last launch ran.
        self._planned: Optional[Tuple[int, int]] = None

    @classmethod
    def from_server_args(
        cls, server_args: ServerArgs, worker: EAGLEWorkerV2
    ) -> ThroughputSpecPolicy:
        """The ``auto`` policy of a server whose worker runs plain steps, choosing
        among the plain step and the speculative step counts the worker captured
        (the adaptive controller's candidates, or ``--speculative-num-steps``); its
        step times are folded over the TP ranks every ``AUTO_FOLD_INTERVAL`` decode
        steps (the mean of the ranks' low medians); its largest batch bucket covers
        the running batch the target's model runner allows."""
        adaptive = worker.adaptive_controller
        if adaptive is None:
            speculative_steps = [server_args.speculative_num_steps]
        else:
            speculative_steps = [s for s in adaptive.candidate_steps if s != PLAIN]
        if not speculative_steps:
            raise ValueError(
                "--speculative-disable-batch-threshold auto: the adaptive config has "
                "no candidate step count above 0 to speculate with."
            )
        if adaptive is not None:
            adaptive.choose_steps_externally()
        tp_size = server_args.tp_size
        policy = cls(
            speculative_steps=speculative_steps,
            sets_step_count=adaptive is not None,
            max_batch_size=worker.target_worker.model_runner.max_running_requests,
            min_dwell_steps=server_args.speculative_load_aware_min_dwell_steps,
            reduce=tp_sum if tp_size > 1 else None,
            fold_interval=AUTO_FOLD_INTERVAL if tp_size > 1 else 1,
            trace=step_trace(tp_size),
        )
        worker.plain_step.verify_listeners.append(policy.observe_verify)
        return policy

    @property
    def speculating(self) -> bool:
        return self.policy.speculating

    @property
    def num_toggles(self) -> int:
        return self.policy.num_toggles

    @property
    def step_counts(self) -> Dict[Tuple[str, str], int]:
        """Decode steps by (mode, reason), mode "spec" or "plain" (as SpecPolicy's)."""
        counts: Dict[Tuple[str, str], int] = {}
        for (num_steps, reason), n in self.policy.step_counts.items():
            key = ("spec" if num_steps else "plain", reason)
            counts[key] = counts.get(key, 0) + n
        return counts

    @property
    def planned_num_steps(self) -> Optional[int]:
        """The mode of the last decided step (None before the first)."""
        return None if self._planned is None else self._planned[1]

    def plan_decode_step(self, batch: ScheduleBatch) -> None:
        """Decide the mode of ``batch``'s next decode step (before its memory check).

        batch: the running ScheduleBatch; its ``forward_mode``, ``forward_iter``,
        ``launch_ts`` and ``spec_plain_step`` still describe its last launch (a
        prefill's, for a batch made by one: not timed)."""
        if (
            self._planned is not None
            and batch.launch_ts is not None
            and batch.forward_mode.is_decode()
        ):
            launched_size, launched_mode = self._planned
            sample = self.timer.record(
                batch.forward_iter, batch.launch_ts, launched_mode, launched_size
            )
            if sample is not None:
                if self.trace is not None:
                    self.trace.step(sample)
                self.pending.add_step_time(
                    sample.num_steps,
                    self.policy.costs.bucket(sample.batch_size),
                    sample.seconds,
                )
        self._plans += 1
        if self._plans % self.fold_interval == 0:
            self.pending.fold_into(self.policy, self.reduce)

        batch_size = batch.batch_size()
        decision = self.policy.decide(batch_size)
        self._planned = (batch_size, decision.num_steps)
        if self.trace is not None:
            self.trace.decision(batch_size, decision)
        if decision.toggled:
            log_toggle(
                decision.num_steps != PLAIN,
                self._plans - 1,
                batch_size,
                f"auto: {decision.reason}, expected gain of speculating "
                f"{decision.expected_gain:+.1%}",
            )
        mark_plain_step(batch, decision.num_steps == PLAIN)
        if self.sets_step_count:
            batch.spec_num_steps = decision.num_steps

    def observe_verify(
        self, num_steps: int, num_correct_drafts_per_req: List[int]
    ) -> None:
        """A speculative step's result (rank-identical): its draft step count and
        the drafts each request accepted."""
        num_requests = len(num_correct_drafts_per_req)
        num_tokens = sum(num_correct_drafts_per_req) + num_requests
        self.pending.add_verify(num_steps, num_tokens, num_requests)
        if self.trace is not None:
            self.trace.verify(num_steps, num_tokens, num_requests)

    def get_state(self) -> Dict[str, object]:
        return {
            "policy": "auto",
            "speculating": self.speculating,
            "fold_interval": self.fold_interval,
            **self.policy.get_state(),
            **step_count_state(self.step_counts),
        }
