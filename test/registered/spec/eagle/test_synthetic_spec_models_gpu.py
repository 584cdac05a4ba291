"""GPU tier for the synthetic EAGLE-3 pairs: speculative greedy output equals plain
greedy output token for token, and the measured accept length matches the
generator's prediction. Runs on the fork before the load-aware feature is used."""

import os
import unittest

import pytest
from sglang.test.ci.ci_register import register_cuda_ci
from sglang.test.spec_engine_utils import (
    EAGLE3_CHAIN,
    EAGLE3_TREE,
    accept_length,
    eagle3_args,
    generate_outputs,
    greedy_params,
    random_prompts,
    running_engine,
    synthetic_pair,
)
from sglang.test.synthetic_spec_models import (
    expected_accept_length,
    greedy_continuation,
    next_token_map,
)
from sglang.test.test_utils import CustomTestCase

register_cuda_ci(est_time=600, suite="base-b-test-1-gpu-large")
pytestmark = pytest.mark.gpu

NUM_PROMPTS = 16
PROMPT_LEN = 24
MAX_NEW_TOKENS = 48
ACCEPT_TOLERANCE = 0.10
SPEC_CONFIGS = {
    "topk1-steps3 (spec v2)": EAGLE3_CHAIN,
    "topk4-steps2-16tok": EAGLE3_TREE,
}


class TestSyntheticEagle3Parity(CustomTestCase):
    draft_accept = 0.6
    draft_kv_check = False

    @classmethod
    def setUpClass(cls):
        cls.target, cls.draft = synthetic_pair(
            "tiny", cls.draft_accept, draft_kv_check=cls.draft_kv_check
        )
        token_map = next_token_map(os.path.dirname(cls.target))
        cls.prompts = random_prompts(NUM_PROMPTS, PROMPT_LEN, len(token_map), seed=1)
        cls.params = greedy_params(MAX_NEW_TOKENS)
        cls.intended = [
            greedy_continuation(token_map, p, MAX_NEW_TOKENS) for p in cls.prompts
        ]
        with running_engine(cls.target, attention_backend="triton") as engine:
            cls.plain = {
                b: generate_outputs(engine, cls.prompts, cls.params, b)
                for b in (False, True)
            }

    def test_plain_engine_follows_the_intended_map(self):
        for batched, outputs in self.plain.items():
            self.assertEqual(
                [o["output_ids"] for o in outputs], self.intended, f"batched={batched}"
            )

    def test_eagle3_matches_plain_and_predicted_accept_length(self):
        for name, config in SPEC_CONFIGS.items():
            with self.subTest(config=name), running_engine(
                self.target,
                attention_backend="triton",
                **eagle3_args(self.draft, **config),
            ) as engine:
                predicted = expected_accept_length(
                    self.draft_accept, config["num_steps"], config["topk"]
                )
                for batched in (False, True):
                    outputs = generate_outputs(
                        engine, self.prompts, self.params, batched
                    )
                    self.assertEqual(
                        [o["output_ids"] for o in outputs],
                        self.intended,
                        f"{name} batched={batched}",
                    )
                    measured = accept_length(outputs)
                    print(
                        f"[synthetic-gpu] P={self.draft_accept} {name} "
                        f"batched={batched}: accept length {measured:.3f} "
                        f"(predicted {predicted:.3f})"
                    )
                    self.assertAlmostEqual(
                        measured, predicted, delta=ACCEPT_TOLERANCE * predicted
                    )


class TestSyntheticEagle3ParityHighAccept(TestSyntheticEagle3Parity):
    draft_accept = 0.9


class TestSyntheticEagle3ParityKVCheckDraft(TestSyntheticEagle3Parity):
    """The draft variant whose proposals need a valid draft KV cache (same law)."""

    draft_kv_check = True


if __name__ == "__main__":
    unittest.main()
