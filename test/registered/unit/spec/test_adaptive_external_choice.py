"""The adaptive controller hands its step-count choice over to load-aware ``auto``
(AdaptiveController.choose_steps_externally / activate_steps). Pure Python: a stand-in
worker records the runtime states applied."""

import unittest
from types import SimpleNamespace

from sglang.srt.speculative.adaptive_runtime_state import AdaptiveController
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")


class TestAdaptiveControllerExternalChoice(CustomTestCase):
    """auto hands the adaptive controller's step-count choice over: its EMA and
    batch-size tiers no longer switch runtime states, activate_steps does."""

    def test_only_the_caller_switches_once_handed_over(self):
        applied = []
        worker = SimpleNamespace(speculative_num_steps=3)

        def apply_runtime_state(state):
            applied.append(state.speculative_num_steps)
            worker.speculative_num_steps = state.speculative_num_steps

        worker.apply_runtime_state = apply_runtime_state
        worker.build_adaptive_runtime_state = lambda speculative_num_steps, **kw: (
            SimpleNamespace(speculative_num_steps=speculative_num_steps)
        )
        controller = AdaptiveController(worker)
        controller.init_states()
        candidates = controller.candidate_steps
        low, high = min(candidates), max(candidates)
        # Before: verifies that accept nothing move the EMA down (after warmup).
        for _ in range(40):
            controller.on_verify_complete([0] * 4, batch_size=4)
        self.assertLess(worker.speculative_num_steps, 3)
        controller.choose_steps_externally()
        controller.activate_steps(high)
        before = list(applied)
        for _ in range(40):
            controller.on_verify_complete([0] * 4, batch_size=4)
        for bs in (1, 64, 256):
            controller.activate_step_by_batch(bs)
        self.assertEqual(applied, before)
        self.assertEqual(worker.speculative_num_steps, high)
        controller.activate_steps(low)
        self.assertEqual(worker.speculative_num_steps, low)


if __name__ == "__main__":
    unittest.main()
