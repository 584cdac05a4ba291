"""Load-aware speculative decoding: the per-step policy and its server args.

Speculation (EAGLE / EAGLE-3, draft trees included) pays off when the running
decode batch is small and costs throughput when it is large. A speculative
server with ``--speculative-disable-batch-threshold N`` therefore decides once
per decode step whether to speculate or to run a plain decode step (one token
per request, the forward of a server without speculation):

* plain as soon as the running decode batch size ``bs >= N``;
* speculative again once ``bs <= M`` (``--speculative-enable-batch-threshold``,
  ``M < N``) *and* the plain mode has lasted at least
  ``--speculative-load-aware-min-dwell-steps`` decode steps;
* in between (``M < bs < N``) the current mode is kept (hysteresis).

Upstream's ``--speculative-adaptive`` picks the number of draft steps per
batch-size tier; a tier at 0 draft steps runs the same plain step. With both,
the thresholds decide whether a step may speculate and the adaptive tiers how
many draft steps it runs; the adaptive acceptance average learns from
speculative steps only.

With ``--speculative-disable-batch-threshold auto``, ``ThroughputSpecPolicy``
(throughput_policy.py) takes the decision instead, from measured step times and
acceptance.

The decision is taken in ``Scheduler.update_running_batch``, before the decode
memory check, so that the step's KV reservation follows it
(``decode_kv_reserve``). Its inputs (the sequence of batch sizes, and the
adaptive tiers, which move with the acceptance every rank observes) are
identical on every TP rank, so every rank reaches the same decision without
any communication. ``auto`` also needs the step times, which differ between
ranks: it averages the ranks' low medians (a CPU all-reduce every
``throughput_policy.AUTO_FOLD_INTERVAL`` decode steps) before deciding from them.
"""

from __future__ import annotations

import logging
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    List,
    NamedTuple,
    Optional,
    Protocol,
    Tuple,
    Union,
)

from sglang.srt.environ import envs

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.adaptive_runtime_state import AdaptiveController

logger = logging.getLogger(__name__)

# --speculative-disable-batch-threshold auto (throughput_policy.py)
AUTO = "auto"


def parse_disable_batch_threshold(value: str) -> Union[int, str]:
    """--speculative-disable-batch-threshold: an integer, or ``auto``."""
    return value if value == AUTO else int(value)


DEFAULT_MIN_DWELL_STEPS = 8

# The decision reasons, a metric label; auto adds its own.
REASON_DWELL = "dwell"  # keep the current mode: the dwell has not elapsed
REASON_LOW_LOAD = "low_load"  # speculate: bs <= enable threshold (or no threshold)
REASON_HYSTERESIS = "hysteresis"  # keep the current mode: M < bs < N
REASON_HIGH_LOAD = "high_load"  # plain: bs >= disable threshold
REASON_ZERO_DRAFT_STEPS = "zero_draft_steps"  # plain: the adaptive tier runs 0 steps


class LoadAwarePolicy(Protocol):
    """What the scheduler, its metrics and /server_info use of a load-aware policy:
    ``SpecPolicy`` (thresholds) or ``ThroughputSpecPolicy`` (``auto``)."""

    @property
    def speculating(self) -> bool: ...

    @property
    def num_toggles(self) -> int: ...

    @property
    def step_counts(self) -> Dict[Tuple[str, str], int]:
        """Decode steps by (mode, reason), mode "spec" or "plain"."""

    def plan_decode_step(self, batch: ScheduleBatch) -> None: ...

    def get_state(self) -> Dict[str, Any]: ...


def default_enable_batch_threshold(disable_batch_threshold: int) -> int:
    """Default for ``--speculative-enable-batch-threshold`` given only N.

    ``max(1, N - max(1, N // 4))``: about 25% below N, at least one below N
    (e.g. N=2 -> 1, N=4 -> 3, N=8 -> 6, N=16 -> 12, N=64 -> 48).
    """
    n = disable_batch_threshold
    return max(1, n - max(1, n // 4))


class SpecDecision(NamedTuple):
    """The mode of one decode step."""

    speculate: bool
    reason: str
    # True iff this step's mode differs from the previous step's mode.
    toggled: bool


class SpecPolicy:
    """Decides, once per decode step, whether the step speculates.

    Starts speculating. Call ``decide`` exactly once per decode step with the
    running decode batch size of that step; the call advances the state.

    disable_batch_threshold: N, or None for no threshold (only the adaptive
    tiers' zero draft steps make a step plain);
    zero_draft_steps: whether the adaptive tier of a batch size runs 0 draft
    steps (None without ``--speculative-adaptive``).
    """

    def __init__(
        self,
        disable_batch_threshold: Optional[int],
        enable_batch_threshold: Optional[int] = None,
        min_dwell_steps: int = DEFAULT_MIN_DWELL_STEPS,
        zero_draft_steps: Optional[Callable[[int], bool]] = None,
    ) -> None:
        if disable_batch_threshold is not None and enable_batch_threshold is None:
            enable_batch_threshold = default_enable_batch_threshold(
                disable_batch_threshold
            )
        reason = threshold_error(
            disable_batch_threshold, enable_batch_threshold, min_dwell_steps
        )
        if reason is not None:
            raise ValueError(reason)

        self.disable_batch_threshold = disable_batch_threshold
        self.enable_batch_threshold = enable_batch_threshold
        self.min_dwell_steps = min_dwell_steps
        self.zero_draft_steps = zero_draft_steps

        # The thresholds' own mode (hysteresis and dwell apply to it) and the
        # number of decode steps it has lasted, including the step that entered it.
        self._threshold_speculating = True
        self._steps_in_mode = 0
        self._speculating = True
        self.num_toggles = 0
        # Decode steps by (mode, reason), mode "spec" or "plain".
        self.step_counts: Dict[Tuple[str, str], int] = {}

    @property
    def speculating(self) -> bool:
        """The mode of the last decided step (True before the first step)."""
        return self._speculating

    def decide(self, batch_size: int) -> SpecDecision:
        """Decide the mode of the next decode step and advance the state."""
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0, got {batch_size}")
        speculate, reason = self._decide_by_thresholds(batch_size)
        if speculate and self.zero_draft_steps is not None:
            if self.zero_draft_steps(batch_size):
                speculate, reason = False, REASON_ZERO_DRAFT_STEPS

        toggled = speculate != self._speculating
        if toggled:
            log_toggle(speculate, sum(self.step_counts.values()), batch_size, reason)
            self._speculating = speculate
            self.num_toggles += 1
        key = ("spec" if speculate else "plain", reason)
        self.step_counts[key] = self.step_counts.get(key, 0) + 1
        return SpecDecision(speculate=speculate, reason=reason, toggled=toggled)

    def _decide_by_thresholds(self, batch_size: int) -> Tuple[bool, str]:
        if self.disable_batch_threshold is None:
            return True, REASON_LOW_LOAD
        if batch_size >= self.disable_batch_threshold:
            speculate, reason = False, REASON_HIGH_LOAD
        elif batch_size > self.enable_batch_threshold:
            speculate, reason = self._threshold_speculating, REASON_HYSTERESIS
        elif self._threshold_speculating or self._steps_in_mode >= self.min_dwell_steps:
            speculate, reason = True, REASON_LOW_LOAD
        else:
            speculate, reason = False, REASON_DWELL
        if speculate != self._threshold_speculating:
            self._threshold_speculating = speculate
            self._steps_in_mode = 0
        self._steps_in_mode += 1
        return speculate, reason

    def plan_decode_step(self, batch: ScheduleBatch) -> None:
        """Decide the mode of ``batch``'s next decode step (before its memory check)."""
        mark_plain_step(batch, not self.decide(batch.batch_size()).speculate)

    def get_state(self) -> Dict[str, Any]:
        """A snapshot for /server_info, metrics and logs."""
        return {
            "speculating": self._speculating,
            "num_toggles": self.num_toggles,
            "disable_batch_threshold": self.disable_batch_threshold,
            "enable_batch_threshold": self.enable_batch_threshold,
            "min_dwell_steps": self.min_dwell_steps,
            "adaptive_zero_draft_steps": self.zero_draft_steps is not None,
            **step_count_state(self.step_counts),
        }


def has_zero_step_tiers(adaptive_controller: Optional[AdaptiveController]) -> bool:
    """Whether ``--speculative-adaptive``'s tiers include 0 draft steps."""
    return adaptive_controller is not None and 0 in adaptive_controller.candidate_steps


def build_load_aware_policy(
    server_args: ServerArgs, worker: Any = None
) -> Optional[LoadAwarePolicy]:
    """The policy of a speculative server whose decode steps can be plain, or
    None: a ``ThroughputSpecPolicy`` for ``auto``, else a ``SpecPolicy``.
    worker: the scheduler's model worker (if it runs plain steps, its adaptive
    controller's tiers at 0 draft steps are plain steps; ``auto`` needs it)."""
    threshold = server_args.speculative_disable_batch_threshold
    if threshold == AUTO:
        # Imported here: throughput_policy imports this module.
        from sglang.srt.speculative.throughput_policy import ThroughputSpecPolicy

        return ThroughputSpecPolicy.from_server_args(server_args, worker)
    adaptive = getattr(worker, "adaptive_controller", None)
    zero_draft_steps = None
    if getattr(worker, "plain_step", None) is not None and has_zero_step_tiers(
        adaptive
    ):
        params = adaptive.params
        zero_draft_steps = lambda bs: params.get_steps_for_batch(bs) == 0
    if threshold is None and zero_draft_steps is None:
        return None
    return SpecPolicy(
        disable_batch_threshold=threshold,
        enable_batch_threshold=server_args.speculative_enable_batch_threshold,
        min_dwell_steps=server_args.speculative_load_aware_min_dwell_steps,
        zero_draft_steps=zero_draft_steps,
    )


def decode_kv_reserve(batch: ScheduleBatch) -> int:
    """KV length a speculative server's decode step reserves per request beyond
    ``kv_committed_len``; the decode memory check and the allocation both use it.

    Under overlap the previous step's tokens are not committed yet when this
    step is prepared: a speculative step may have added up to
    ``get_alloc_len_per_decode()`` of them, a plain step one. A speculative step
    reserves upstream's double buffer; a plain step that lag plus its own token.
    """
    # Imported here: server_args imports this module, and allocation_sizing imports
    # server_args.
    from sglang.srt.mem_cache.allocation_sizing import (
        get_alloc_len_per_decode,
        get_alloc_reserve_per_decode,
    )

    if not batch.spec_plain_step:
        return get_alloc_reserve_per_decode()
    lag = 1 if batch.spec_prev_plain_step else get_alloc_len_per_decode()
    return lag + 1


def log_toggle(speculate: bool, step: int, batch_size: int, why: str) -> None:
    """One line per switch and rank: with TP, the ranks' lines must agree."""
    logger.info(
        "Load-aware speculation: %s from decode step %d (running batch %d, %s).",
        "speculative" if speculate else "plain",
        step,
        batch_size,
        why,
    )


def mark_plain_step(batch: ScheduleBatch, plain: bool) -> None:
    """The decided mode, as the decode memory check and the worker read it."""
    batch.spec_prev_plain_step = batch.spec_plain_step
    batch.spec_plain_step = plain


def step_count_state(step_counts: Dict[Tuple[str, str], int]) -> Dict[str, Any]:
    """The decode step counts of /server_info, from the counts by (mode, reason),
    mode "spec" or "plain": by mode, and by ``mode/reason``."""
    totals = {"spec": 0, "plain": 0}
    for (mode, _), n in step_counts.items():
        totals[mode] += n
    return {
        "num_spec_steps": totals["spec"],
        "num_plain_steps": totals["plain"],
        "steps_by_reason": {
            f"{mode}/{reason}": n for (mode, reason), n in step_counts.items()
        },
    }


# ---------------------------------------------------------------------------
# Server args: validation and defaults (called from
# arg_groups/speculative_hook.handle_speculative_decoding).
# ---------------------------------------------------------------------------


def threshold_error(
    disable_batch_threshold: Union[int, str, None],
    enable_batch_threshold: Optional[int],
    min_dwell_steps: int,
) -> Optional[str]:
    """Why the thresholds are invalid, or None. Pure."""
    if min_dwell_steps < 0:
        return (
            "--speculative-load-aware-min-dwell-steps must be >= 0, "
            f"got {min_dwell_steps}"
        )
    if disable_batch_threshold is None or disable_batch_threshold == AUTO:
        if enable_batch_threshold is not None:
            return (
                "--speculative-enable-batch-threshold requires "
                "--speculative-disable-batch-threshold N"
                + (
                    " (auto chooses when to speculate)"
                    if disable_batch_threshold == AUTO
                    else ""
                )
            )
        return None
    if isinstance(disable_batch_threshold, str):
        return (
            "--speculative-disable-batch-threshold must be an integer or auto, "
            f"got {disable_batch_threshold!r}"
        )
    if disable_batch_threshold < 2:
        return (
            "--speculative-disable-batch-threshold must be >= 2 (speculation "
            f"runs only below it), got {disable_batch_threshold}"
        )
    if enable_batch_threshold is not None:
        if enable_batch_threshold < 1:
            return (
                "--speculative-enable-batch-threshold must be >= 1, "
                f"got {enable_batch_threshold}"
            )
        if enable_batch_threshold >= disable_batch_threshold:
            return (
                "--speculative-enable-batch-threshold "
                f"({enable_batch_threshold}) must be smaller than "
                "--speculative-disable-batch-threshold "
                f"({disable_batch_threshold})"
            )
    return None


def decode_steps_can_run_plain(server_args: ServerArgs) -> bool:
    """Whether the server runs plain decode steps: under a load-aware threshold,
    or on ``--speculative-adaptive`` tiers at 0 draft steps, unless the plain step
    does not support the args (those tiers then keep upstream's one-node verify;
    load_aware.build_plain_step also checks the model the worker loaded)."""
    if server_args.speculative_disable_batch_threshold is not None:
        return True
    if not server_args.speculative_adaptive:
        return False
    from sglang.srt.speculative.adaptive_spec_params import (
        resolve_candidate_steps_from_config,
    )

    candidate_steps = resolve_candidate_steps_from_config(
        server_args.speculative_adaptive_config
    )
    return 0 in candidate_steps and load_aware_unsupported_reason(server_args) is None


def plain_decode_graph_reserve_mb(server_args: ServerArgs) -> float:
    """GPU memory (MB) of the plain step's own DECODE attention backend and CUDA
    graphs (load_aware.TargetDecodeGraphs), counted as
    ``ServerArgs.reserve_for_graph_mb`` counts the decode graphs: a server whose
    decode steps can run plain captures a second decode family after the KV pool
    is sized."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    if not decode_steps_can_run_plain(server_args):
        return 0.0
    reserved = 0.0
    decode = server_args.cuda_graph_config.decode
    if decode.backend != Backend.DISABLED:
        reserved += decode.max_bs * 2
    decode_backend = (
        server_args.decode_attention_backend or server_args.attention_backend
    )
    if decode_backend in ("flashinfer", None):  # None: chosen later, maybe flashinfer
        # The target's DECODE backend gets a workspace of its own (TargetDecodeGraphs).
        reserved += envs.SGLANG_FLASHINFER_WORKSPACE_SIZE.get() / (1 << 20)
    return reserved


def load_aware_unsupported_reason(server_args: ServerArgs) -> Optional[str]:
    """Why load-aware speculation cannot run with these args, or None.

    Called from ``handle_speculative_decoding`` once the algorithm is resolved
    (a threshold is then refused), and for ``--speculative-adaptive`` tiers at 0
    draft steps, which then keep upstream's one-node verify. Chains and draft
    trees run on EAGLEWorkerV2, with and without the overlap scheduler, and
    combine with upstream's ``--speculative-adaptive``.
    """
    from sglang.srt.arg_groups.overrides import resolved_view

    view = resolved_view(server_args)
    algo = server_args.speculative_algorithm
    if algo is None:
        return "it requires --speculative-algorithm EAGLE or EAGLE3"
    if algo not in ("EAGLE", "EAGLE3"):
        return (
            f"--speculative-algorithm {algo} is not supported yet "
            "(supported: EAGLE, EAGLE3)"
        )
    unsupported_flags = (
        ("enable_multi_layer_eagle", "--enable-multi-layer-eagle"),
        ("enable_dp_attention", "--enable-dp-attention"),
        ("enable_two_batch_overlap", "--enable-two-batch-overlap"),
        ("enable_pdmux", "--enable-pdmux"),
        ("enable_lora", "--enable-lora"),
        (
            "speculative_use_rejection_sampling",
            "--speculative-use-rejection-sampling",
        ),
    )
    for field, flag in unsupported_flags:
        if getattr(view, field, False):
            return f"{flag} is not supported yet"
    if (getattr(view, "pp_size", 1) or 1) > 1:
        return "pipeline parallelism (--pp-size > 1) is not supported yet"
    return unverified_decode_backend_reason(view)


# Decode attention backends the plain step (and the draft's catch-up, which runs
# an extend batch relabelled as decode) has run on; torch_native is the CPU tier's.
PLAIN_STEP_DECODE_BACKENDS = ("triton", "flashinfer", "fa3", "torch_native")


def unverified_decode_backend_reason(cfg: Any) -> Optional[str]:
    """Why the decode attention backend of the target or the draft (of server args,
    or of their view mid-resolution) is not one the plain step runs on, or None
    (None also while it is not chosen yet)."""
    from sglang.srt.arg_groups.overrides import attention_backends_of

    _, decode = attention_backends_of(cfg)
    decode_flag = (
        "--decode-attention-backend"
        if cfg.decode_attention_backend
        else "--attention-backend"
    )
    for backend, flag in (
        (decode, decode_flag),
        (
            cfg.speculative_draft_attention_backend,
            "--speculative-draft-attention-backend",
        ),
    ):
        if backend is not None and backend not in PLAIN_STEP_DECODE_BACKENDS:
            return (
                f"the {backend} attention backend ({flag}) has not been verified "
                "with plain decode steps yet (verified: "
                f"{', '.join(PLAIN_STEP_DECODE_BACKENDS)}); pass {flag} triton, "
                "flashinfer or fa3"
            )
    return None


def resolve_load_aware_server_args(server_args: ServerArgs) -> None:
    """Validate the load-aware flags and fill defaults. Raises ValueError."""
    n = server_args.speculative_disable_batch_threshold
    m = server_args.speculative_enable_batch_threshold
    error = threshold_error(n, m, server_args.speculative_load_aware_min_dwell_steps)
    if error is not None:
        raise ValueError(error)
    if n is None:
        return

    reason = load_aware_unsupported_reason(server_args)
    if reason is not None:
        raise ValueError(f"--speculative-disable-batch-threshold: {reason}.")

    if n == AUTO:
        return
    if m is None:
        server_args.speculative_enable_batch_threshold = default_enable_batch_threshold(
            n
        )
    max_running = server_args.max_running_requests
    if max_running is not None and max_running < n:
        logger.warning(
            "--speculative-disable-batch-threshold %d exceeds "
            "--max-running-requests %d: the threshold never makes a decode step "
            "plain.",
            n,
            max_running,
        )


# ---------------------------------------------------------------------------
# CUDA graph batch sizes.
# ---------------------------------------------------------------------------


def speculative_capture_bs(
    capture_bs: List[int], disable_batch_threshold: Union[int, str, None]
) -> List[int]:
    """Batch sizes at which speculative (verify / draft-decode) graphs are needed.

    Speculation runs only at ``bs <= N - 1``; a batch replays the smallest
    captured size >= its bs, so keep the sizes up to the smallest captured size
    >= N - 1. ``capture_bs`` must be sorted ascending; it is not modified.
    """
    if disable_batch_threshold is None or disable_batch_threshold == AUTO:
        return list(capture_bs)
    max_spec_bs = disable_batch_threshold - 1
    kept = []
    for bs in capture_bs:
        kept.append(bs)
        if bs >= max_spec_bs:
            break
    return kept
