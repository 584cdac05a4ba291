"""The configs a sweep compares: their speculation, extra server flags and environment,
and the pristine upstream tree that the upstream-* configs' servers import."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Dict, List, Optional, Sequence, Union

from sglang.test.spec_engine_utils import EAGLE3_CHAIN, EAGLE3_TREE

# --speculative-adaptive-config of upstream-steps0-topk1 (0.5.17's
# speculative/adaptive_spec_params.py): the "1" tier covers every batch size (a batch
# goes to the largest tier key <= it, smaller ones to the smallest), candidate steps
# [0] only, so the controller never leaves 0.
STEPS0_ADAPTIVE_CONFIG = {"1": {"candidate_steps": [0]}}
# eagle3_args' step counts at steps 0: upstream takes the initial step count from
# --speculative-num-steps, which must be a candidate, and one draft token (the root).
UPSTREAM_STEPS0 = dict(num_steps=0, topk=1, num_draft_tokens=1)
# The --speculative-adaptive configs launch at the default config's largest
# candidate, 7 steps: pristine 0.5.17 sizes its shared logits buffer by the launch
# draft tokens and crashes capturing a larger candidate's graphs (upstream #30549,
# fixed by the fork's patch 0011); the fork's adaptive configs start alike.
ADAPTIVE_LAUNCH = dict(num_steps=7, topk=1, num_draft_tokens=8)


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    spec: Optional[Dict[str, int]]  # eagle3_args' step counts; None: no speculation
    extra_args: List[str]
    env: Dict[str, str]
    # Load-aware configs only: the same speculation always on, which they are judged against.
    always_on: Optional[str] = None
    # The server imports pristine upstream (tools/fork's extraction of the pinned
    # wheel, PRISTINE_DIR) instead of the fork.
    pristine: bool = False
    # Written to a file passed as --speculative-adaptive-config.
    adaptive_config: Optional[Dict[str, dict]] = None

    @property
    def load_aware(self) -> bool:
        return self.always_on is not None

    @property
    def auto(self) -> bool:
        """--speculative-disable-batch-threshold auto."""
        return self.load_aware and "auto" in self.extra_args


def build_configs(
    disable_threshold: int, per_config: Optional[Dict[str, int]] = None
) -> Dict[str, Config]:
    """per_config: disable thresholds of named load-aware configs (the others get
    disable_threshold, the plain-* configs 2, the auto-* configs "auto")."""

    def load_aware(
        name: str,
        spec: Dict[str, int],
        env: Dict[str, str],
        always_on: str,
        extra_args: Sequence[str] = (),
        threshold: Union[int, str, None] = None,
    ) -> Config:
        threshold = (per_config or {}).get(name, threshold or disable_threshold)
        flags = ["--speculative-disable-batch-threshold", str(threshold), *extra_args]
        return Config(name, spec, flags, env, always_on=always_on)

    adaptive = ["--speculative-adaptive"]
    # Every speculative config runs on the spec-v2 overlap worker (EAGLEWorkerV2, the
    # only one 0.5.17 has; trees at page size 1).
    return {
        c.name: c
        for c in [
            # The reference: no speculation.
            Config("nospec", None, [], {}),
            # EAGLE-3 chain (topk 1) always on: the topk 1 configs' reference.
            Config("eagle3-topk1", EAGLE3_CHAIN, [], {}),
            # EAGLE-3 draft tree (topk 4) always on: the topk 4 configs' reference.
            Config("eagle3-topk4", EAGLE3_TREE, [], {}),
            # Load-aware chain: speculates below the threshold, plain steps from it.
            load_aware("loadaware-topk1", EAGLE3_CHAIN, {}, "eagle3-topk1"),
            # The same with the full draft forward on every plain step (drafts that
            # cannot write their KV alone): what the KV-only catch-up saves.
            load_aware(
                "loadaware-topk1-full-catch-up",
                EAGLE3_CHAIN,
                {"SGLANG_LOAD_AWARE_FULL_DRAFT_CATCH_UP": "1"},
                "eagle3-topk1",
            ),
            # Load-aware draft tree.
            load_aware("loadaware-topk4", EAGLE3_TREE, {}, "eagle3-topk4"),
            # No threshold: each decode step runs the mode with the better expected
            # throughput, from the step times and acceptance the server measures.
            load_aware(
                "auto-topk1", EAGLE3_CHAIN, {}, "eagle3-topk1", threshold="auto"
            ),
            load_aware("auto-topk4", EAGLE3_TREE, {}, "eagle3-topk4", threshold="auto"),
            # The fork's plain step at every running batch >= 2 (a lone request
            # speculates), chain: its decode rate against nospec's and upstream's
            # steps-0 step's (upstream-steps0-topk1).
            load_aware("plain-topk1", EAGLE3_CHAIN, {}, "eagle3-topk1", threshold=2),
            # The same for the draft tree.
            load_aware("plain-topk4", EAGLE3_TREE, {}, "eagle3-topk4", threshold=2),
            # Upstream's adaptive step count on the fork: its steps-0 tiers (a
            # candidate from batch 8, the only one from 64 in upstream's default
            # config) run the fork's plain step instead of upstream's steps-0 step.
            Config("adaptive-topk1", ADAPTIVE_LAUNCH, adaptive, {}),
            # Upstream's adaptive step count while speculating, plain steps under load.
            load_aware(
                "loadaware-adaptive-topk1",
                ADAPTIVE_LAUNCH,
                {},
                "adaptive-topk1",
                adaptive,
            ),
            # auto choosing among the plain step and the adaptive candidate step
            # counts by measured throughput, in place of the adaptive controller.
            load_aware(
                "auto-adaptive-topk1",
                ADAPTIVE_LAUNCH,
                {},
                "adaptive-topk1",
                adaptive,
                threshold="auto",
            ),
            # Pristine upstream 0.5.17 (not the fork) with its adaptive mode and
            # default config: what upstream gives, steps-0 tiers included.
            Config(
                "upstream-adaptive-topk1",
                ADAPTIVE_LAUNCH,
                adaptive,
                {},
                pristine=True,
            ),
            # Pristine upstream with steps 0 at every batch size: upstream's own
            # steps-0 step (a one-node TARGET_VERIFY and the full draft extend)
            # always, against the fork's plain-topk1 and nospec. Upstream refuses an
            # initial step count outside the candidates: it starts at 0.
            Config(
                "upstream-steps0-topk1",
                UPSTREAM_STEPS0,
                adaptive,
                {},
                pristine=True,
                adaptive_config=STEPS0_ADAPTIVE_CONFIG,
            ),
            # The same without its draft extend (upstream's switch for it): its best
            # case where steps 0 is the only candidate, never resuming speculation.
            Config(
                "upstream-steps0-no-extend-topk1",
                UPSTREAM_STEPS0,
                adaptive,
                {"SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND": "1"},
                pristine=True,
                adaptive_config=STEPS0_ADAPTIVE_CONFIG,
            ),
        ]
    }


# Names, order and references of the configs (the threshold does not matter here).
KNOWN_CONFIGS = build_configs(disable_threshold=2)


# Where `tools/fork sync` extracts the pinned upstream wheel, relative to the
# repository root (tools/forklib/wheel.py: pristine_package): one directory per
# wheel, PRISTINE_DIR/<its sha256[:16]>/sglang/, with a .complete file naming it.
PRISTINE_DIR = os.path.join("python", ".fork", "pristine")
# sweep/ is benchmark/dynamic_spec/sweep/.
REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def pristine_upstream(root: str = REPO_ROOT) -> Dict[str, str]:
    """The pristine upstream tree of the pristine configs: {"pythonpath": the
    directory holding its sglang/ package, "wheel": the wheel it came from}. Of
    several extractions, the one of this interpreter's wheel. Exits when there is
    none."""
    base = os.path.join(root, PRISTINE_DIR)
    extracted = {}  # wheel file name -> directory
    if os.path.isdir(base):
        for name in sorted(os.listdir(base)):
            complete = os.path.join(base, name, ".complete")
            package = os.path.join(base, name, "sglang", "__init__.py")
            if os.path.isfile(complete) and os.path.isfile(package):
                with open(complete) as f:
                    extracted[f.read().strip()] = os.path.join(base, name)
    python_tag = f"-cp{sys.version_info.major}{sys.version_info.minor}-"
    ours = [wheel for wheel in extracted if python_tag in wheel]
    if len(extracted) == 1 or len(ours) == 1:
        wheel = ours[0] if ours else next(iter(extracted))
        return {"pythonpath": extracted[wheel], "wheel": wheel}
    found = f"found {sorted(extracted)}" if extracted else "found none"
    sys.exit(
        f"pristine upstream: no single extracted upstream package under {base} "
        f"({found}); the pristine configs need one: run `python3 tools/fork sync` "
        f"in {root} (offline: SGLANG_FORK_UPSTREAM_WHEEL=<the pinned wheel>)"
    )
