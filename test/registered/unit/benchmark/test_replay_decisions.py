"""benchmark/dynamic_spec/replay_decisions.py: an auto server's step trace replayed
through the policy reproduces the server's decisions. No GPU: the trace is written by
the server's policy object on a simulated batch, its step times a fixture."""

import os
import tempfile
import unittest

from sglang.srt.speculative.spec_policy import DEFAULT_MIN_DWELL_STEPS
from sglang.srt.speculative.throughput_policy import (
    PLAIN,
    StepTrace,
    ThroughputSpecPolicy,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.spec_engine_utils import load_benchmark_script
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

sim = load_benchmark_script("policy_sim")
replay_decisions = load_benchmark_script("replay_decisions")

MAX_RUNNING_REQUESTS = 64
# Seconds of a step by draft step count at batch 1 and per request beyond it.
STEP_SECONDS = {PLAIN: (0.004, 0.0001), 3: (0.006, 0.0008), 7: (0.008, 0.0012)}
# Drafts a request accepts per verify, by draft step count.
ACCEPTED = {3: 3, 7: 5}
# Speculating pays up to batch 16, plain above.
WORKLOAD = [1] * 200 + [16] * 300 + [40] * 300 + [64] * 200 + [4] * 200


def record_trace(path: str) -> None:
    """Drive the server's auto policy as the scheduler does (plan each step, launch
    it, report its verify), with one stall, writing its trace to ``path``."""
    server = ThroughputSpecPolicy(
        speculative_steps=[3, 7],
        sets_step_count=True,
        max_batch_size=MAX_RUNNING_REQUESTS,
        min_dwell_steps=DEFAULT_MIN_DWELL_STEPS,
        reduce=None,
        fold_interval=1,
        trace=StepTrace(path),
    )
    batch = sim._RunningBatch()
    clock = 0.0
    for forward_iter, batch_size in enumerate(WORKLOAD, start=1):
        batch.size = batch_size
        server.plan_decode_step(batch)
        num_steps = server.planned_num_steps
        batch.forward_iter, batch.launch_ts = forward_iter, clock
        fixed, per_request = STEP_SECONDS[num_steps]
        clock += fixed + per_request * batch_size
        if forward_iter == 250:
            clock += 0.1
        if num_steps != PLAIN:
            server.observe_verify(num_steps, [ACCEPTED[num_steps]] * batch_size)


class TestReplayDecisions(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmpdir = tempfile.TemporaryDirectory()
        path = os.path.join(cls.tmpdir.name, "steps.jsonl")
        record_trace(path)
        cls.records = sim.load_trace(path)

    @classmethod
    def tearDownClass(cls):
        cls.tmpdir.cleanup()

    def test_the_policy_that_wrote_a_trace_reproduces_every_decision(self):
        decisions = [r["decision"] for r in self.records if "decision" in r]
        self.assertEqual(len(decisions), len(WORKLOAD))
        self.assertGreater(len(set(decisions)), 1)
        result = replay_decisions.replay(self.records, MAX_RUNNING_REQUESTS)
        self.assertEqual(result.decided, len(WORKLOAD))
        self.assertEqual(result.matched, len(WORKLOAD))
        self.assertIsNone(result.first_difference)

    def test_a_different_decision_is_reported_where_it_comes(self):
        records = [dict(r) for r in self.records]
        changed = [r for r in records if "decision" in r][600]
        recorded = changed["decision"]
        changed["decision"] = 3 if recorded != 3 else 7
        result = replay_decisions.replay(records, MAX_RUNNING_REQUESTS)
        self.assertEqual(result.matched, len(WORKLOAD) - 1)
        self.assertIn(
            f"batch 40: recorded {changed['decision']} steps, replayed {recorded}",
            result.first_difference,
        )


if __name__ == "__main__":
    unittest.main()
