"""Load-aware speculation without a threshold: each decode step runs the mode with
the best expected output throughput.

A mode is a number of draft steps: 0 is the plain step (one token per request), s > 0
a speculative step with s draft steps (the step counts the server has verify graphs
for: the configured one, or upstream's adaptive candidates). With running batch b,
mode m produces ``b * E[accept length | m]`` tokens (1 per request for the plain
step) in ``T_m(b)`` seconds; the policy picks the mode with the most tokens per
second, with a margin and a dwell so that a batch at the crossover does not flip
every step.

* ``StepCosts``: ``T_m(b)`` per captured batch size (a batch replays the smallest
  captured size >= b), from a startup profile, refined online from the decode steps
  that run (steps with prefill in them are not decode steps and must not be fed).
* ``AcceptanceEstimate``: ``E[accept length | m]`` observed over speculative steps
  (an EMA per step count); step counts not observed yet are predicted from the
  per-token acceptance of a chain fitted to the ones that were
  (``E = 1 + p + ... + p^s``).
* ``ThroughputPolicy``: the decision. While plain, the acceptance estimate would go
  stale; every ``probe_interval`` plain steps it runs one speculative step to
  refresh it, which costs at most ``1 / probe_interval`` of the plain steps'
  throughput times the relative loss of that step.

Every input must be identical on every TP rank: the startup profile is broadcast from
rank 0, the acceptance is rank-identical; online timings are per rank, so they are
only fed where one rank decides (``StepCosts.refine_online``).

Pure Python: the server wiring and the profile are separate.
"""

from __future__ import annotations

import bisect
from typing import Dict, List, NamedTuple, Optional, Sequence

PLAIN = 0

REASON_BEST = "best_throughput"  # the mode with the best expected tokens/s
REASON_MARGIN = "within_margin"  # another mode is better, but not by the margin
REASON_DWELL = "dwell"  # another mode is better, but the dwell has not elapsed
REASON_PROBE = "probe"  # a speculative step that refreshes the acceptance estimate
THROUGHPUT_REASONS = (REASON_BEST, REASON_MARGIN, REASON_DWELL, REASON_PROBE)


def chain_accept_length(p: float, num_steps: int) -> float:
    """Expected tokens per verify step of a chain whose drafts are each accepted
    with probability p given the previous one was: 1 + p + ... + p^num_steps."""
    return sum(p**k for k in range(num_steps + 1))


def fit_chain_acceptance(accept_length: float, num_steps: int) -> float:
    """The per-token acceptance p with ``chain_accept_length(p, num_steps)`` equal to
    ``accept_length`` (clamped to the reachable range [1, num_steps + 1])."""
    target = min(max(accept_length, 1.0), num_steps + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if chain_accept_length(mid, num_steps) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class StepCosts:
    """Seconds of one decode step by mode and captured batch size."""

    def __init__(
        self,
        profile: Dict[int, Dict[int, float]],
        ema_alpha: float = 0.05,
        refine_online: bool = True,
    ):
        """profile: {mode: {captured batch size: seconds}}, every mode at the same
        batch sizes (the startup replays of the captured graphs)."""
        sizes = {tuple(sorted(by_bs)) for by_bs in profile.values()}
        if len(sizes) != 1 or not next(iter(sizes)):
            raise ValueError("the profile needs every mode at the same batch sizes")
        self.batch_sizes: List[int] = list(next(iter(sizes)))
        self._seconds = {
            mode: [by_bs[bs] for bs in self.batch_sizes]
            for mode, by_bs in profile.items()
        }
        self.ema_alpha = ema_alpha
        self.refine_online = refine_online

    @property
    def modes(self) -> List[int]:
        return sorted(self._seconds)

    def _bucket(self, batch_size: int) -> int:
        return min(
            bisect.bisect_left(self.batch_sizes, batch_size), len(self.batch_sizes) - 1
        )

    def estimate(self, mode: int, batch_size: int) -> float:
        """T_mode(batch_size): the captured size it pads to; beyond the largest one,
        its time per request times the batch size."""
        i = self._bucket(batch_size)
        seconds = self._seconds[mode][i]
        largest = self.batch_sizes[-1]
        return seconds * batch_size / largest if batch_size > largest else seconds

    def observe(self, mode: int, batch_size: int, seconds: float) -> None:
        """Fold the measured time of one decode step (no prefill in it) into its
        bucket; beyond the largest captured size the step is not a graph replay."""
        if not self.refine_online or batch_size > self.batch_sizes[-1]:
            return
        row, i = self._seconds[mode], self._bucket(batch_size)
        row[i] += self.ema_alpha * (seconds - row[i])

    def table(self) -> Dict[str, Dict[int, float]]:
        return {
            str(mode): dict(zip(self.batch_sizes, row))
            for mode, row in sorted(self._seconds.items())
        }


class AcceptanceEstimate:
    """Tokens per verify step (accepted drafts + the bonus token), per step count."""

    def __init__(
        self,
        step_counts: Sequence[int],
        initial_accept_length: Dict[int, float],
        ema_alpha: float = 0.1,
    ):
        """initial_accept_length: a prior for at least one step count (e.g. the
        draft's typical acceptance, or 1.0: speculation must then earn its place)."""
        if not initial_accept_length:
            raise ValueError("the acceptance estimate needs a prior")
        self.step_counts = sorted(step_counts)
        self.ema_alpha = ema_alpha
        self._observed: Dict[int, float] = dict(initial_accept_length)

    def observe(self, num_steps: int, num_tokens: int, num_requests: int) -> None:
        """One speculative step: ``num_tokens`` committed by ``num_requests``."""
        if num_requests <= 0:
            return
        sample = num_tokens / num_requests
        old = self._observed.get(num_steps)
        self._observed[num_steps] = (
            sample if old is None else old + self.ema_alpha * (sample - old)
        )

    def expected(self, num_steps: int) -> float:
        """E[accept length | num_steps]; unobserved step counts from the chain fit to
        the nearest observed one."""
        if num_steps == PLAIN:
            return 1.0
        if num_steps in self._observed:
            return self._observed[num_steps]
        nearest = min(self._observed, key=lambda s: (abs(s - num_steps), s))
        p = fit_chain_acceptance(self._observed[nearest], nearest)
        return chain_accept_length(p, num_steps)

    def state(self) -> Dict[int, float]:
        return {s: round(self.expected(s), 4) for s in self.step_counts}


class ThroughputDecision(NamedTuple):
    num_steps: int  # 0: a plain step
    reason: str
    toggled: bool  # True iff plain vs speculative differs from the previous step
    # Expected tokens/s of the chosen mode over the plain step's, minus 1.
    expected_gain: float


class ThroughputPolicy:
    """Chooses each decode step's mode by expected output tokens per second."""

    def __init__(
        self,
        costs: StepCosts,
        acceptance: AcceptanceEstimate,
        margin: float = 0.05,
        min_dwell_steps: int = 8,
        probe_interval: int = 64,
    ):
        if PLAIN not in costs.modes:
            raise ValueError("the step costs need the plain step (mode 0)")
        missing = set(acceptance.step_counts) - set(costs.modes)
        if missing:
            raise ValueError(f"no step costs for draft step counts {sorted(missing)}")
        if margin < 0 or min_dwell_steps < 0 or probe_interval < 1:
            raise ValueError("margin and dwell must be >= 0, probe_interval >= 1")
        self.costs = costs
        self.acceptance = acceptance
        self.margin = margin
        self.min_dwell_steps = min_dwell_steps
        self.probe_interval = probe_interval
        self.modes = [PLAIN] + [s for s in acceptance.step_counts if s != PLAIN]

        # The mode the policy is in (a probe does not change it), how many steps it
        # has lasted, and what the last step ran.
        self._mode = max(self.modes)  # start speculating, as the threshold policy does
        self._steps_in_mode = 0
        self._plain_since_spec = 0
        self._last_speculated = True
        self.last_gain = 0.0
        self.num_toggles = 0
        self.num_probes = 0
        self.step_counts: Dict[tuple, int] = {}

    def throughput(self, num_steps: int, batch_size: int) -> float:
        """Expected output tokens per second of one step of this mode."""
        tokens = batch_size * self.acceptance.expected(num_steps)
        return tokens / self.costs.estimate(num_steps, batch_size)

    @property
    def speculating(self) -> bool:
        """Whether the last decided step speculated (True before the first)."""
        return self._last_speculated

    def decide(self, batch_size: int) -> ThroughputDecision:
        """The mode of the next decode step; advances the state."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        rates = {m: self.throughput(m, batch_size) for m in self.modes}
        best = max(rates, key=lambda m: (rates[m], -m))
        mode, reason = self._mode, REASON_BEST
        if best != self._mode:
            if rates[best] <= rates[self._mode] * (1 + self.margin):
                reason = REASON_MARGIN
            elif self._steps_in_mode < self.min_dwell_steps:
                reason = REASON_DWELL
            else:
                mode = best
        chosen = mode
        if chosen == PLAIN and self._plain_since_spec + 1 >= self.probe_interval:
            chosen = max(
                (m for m in self.modes if m != PLAIN), key=lambda m: rates[m]
            )
            reason = REASON_PROBE
            self.num_probes += 1

        toggled = (chosen != PLAIN) != self._last_speculated
        self._advance(mode, chosen, toggled)
        self.last_gain = rates[chosen] / rates[PLAIN] - 1
        key = (chosen, reason)
        self.step_counts[key] = self.step_counts.get(key, 0) + 1
        return ThroughputDecision(chosen, reason, toggled, self.last_gain)

    def _advance(self, mode: int, chosen: int, toggled: bool) -> None:
        if mode != self._mode:
            self._mode, self._steps_in_mode = mode, 0
        self._steps_in_mode += 1
        self._plain_since_spec = self._plain_since_spec + 1 if chosen == PLAIN else 0
        self._last_speculated = chosen != PLAIN
        self.num_toggles += toggled

    def observe(
        self,
        num_steps: int,
        batch_size: int,
        num_tokens: Optional[int] = None,
        seconds: Optional[float] = None,
    ) -> None:
        """What a decode step of this mode did: tokens committed (speculative steps
        refresh the acceptance), and its time if measured (decode steps only)."""
        if num_steps != PLAIN and num_tokens is not None:
            self.acceptance.observe(num_steps, num_tokens, batch_size)
        if seconds is not None:
            self.costs.observe(num_steps, batch_size, seconds)

    def get_state(self) -> Dict[str, object]:
        """For /server_info: the learned table, the acceptance, the current gain."""
        return {
            "mode_num_steps": self._mode,
            "expected_gain": round(self.last_gain, 4),
            "step_costs_seconds": self.costs.table(),
            "accept_length": self.acceptance.state(),
            "num_toggles": self.num_toggles,
            "num_probes": self.num_probes,
            "margin": self.margin,
            "min_dwell_steps": self.min_dwell_steps,
            "probe_interval": self.probe_interval,
        }
