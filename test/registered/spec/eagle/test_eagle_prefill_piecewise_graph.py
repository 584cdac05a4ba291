"""GPU tier: upstream 0.5.17 already serves the prefill of an EAGLE-3 target with the
piecewise CUDA graphs (the fork dropped its patch for it): the server log says
`cuda graph: True` on every prefill batch, and what that prefill hands the draft is what
an eager one hands it: the responses follow the synthetic pair's greedy map token for
token, and every request's acceptance equals that of a server started with
--disable-piecewise-cuda-graph. Chains and draft trees (both prefill with
CaptureHiddenMode.FULL).

Only the prompts' prefills are checked: upstream runs a prefill eager when its capture
bucket would more than double it, as for the one-token prefill of /health_generate."""

import os
import re
import tempfile
import unittest
from typing import Dict, List, Sequence, Tuple

import pytest
from sglang.test.ci.ci_register import register_cuda_ci
from sglang.test.spec_engine_utils import (
    EAGLE3_CHAIN,
    EAGLE3_TREE,
    cli_args,
    eagle3_args,
    greedy_params,
    post_generate,
    random_prompts,
    running_server,
    synthetic_pair,
)
from sglang.test.synthetic_spec_models import greedy_continuation, next_token_map
from sglang.test.test_utils import CustomTestCase

register_cuda_ci(est_time=400, suite="base-b-test-1-gpu-large")
pytestmark = pytest.mark.gpu

NUM_PROMPTS = 8
# Not a piecewise capture size: the replay pads the batch, and the hidden states
# handed to the draft must be cut back to the prompt's tokens.
PROMPT_LEN = 37
MAX_NEW_TOKENS = 24
PREFILL_LINE = re.compile(
    rf"Prefill batch.*#new-token: {PROMPT_LEN},.*cuda graph: (True|False)"
)
SHAPES: Dict[str, Dict[str, int]] = {"chain": EAGLE3_CHAIN, "tree": EAGLE3_TREE}


def acceptance(response: dict) -> Tuple[int, int]:
    meta = response["meta_info"]
    return meta["spec_verify_ct"], meta["spec_num_correct_drafts"]


class TestEaglePrefillPiecewiseGraph(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        # The KV-checked draft reads the target's aux hidden states through fc.
        cls.target, cls.draft = synthetic_pair("tiny", 0.8, draft_kv_check=True)
        token_map = next_token_map(os.path.dirname(cls.target))
        cls.prompts = random_prompts(NUM_PROMPTS, PROMPT_LEN, len(token_map), seed=3)
        cls.intended = [
            greedy_continuation(token_map, p, MAX_NEW_TOKENS) for p in cls.prompts
        ]

    def serve(
        self, spec: Dict[str, int], piecewise: bool
    ) -> Tuple[List[dict], List[bool]]:
        """The responses to the prompts, one at a time, and for each prompt's prefill
        batch in the server's log whether it replayed a CUDA graph."""
        args = cli_args(
            dict(
                **eagle3_args(self.draft, **spec),
                attention_backend="triton",
                cuda_graph_max_bs=8,
                mem_fraction_static=0.5,
                max_total_tokens=65536,
                grammar_backend="none",
                random_seed=0,
                disable_piecewise_cuda_graph=not piecewise,
            )
        )
        params = greedy_params(MAX_NEW_TOKENS)
        with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
            with running_server(
                self.target,
                args,
                log_path=log.name,
            ) as (url, _):
                responses = [post_generate(url, p, params) for p in self.prompts]
            replayed = [m.group(1) == "True" for m in PREFILL_LINE.finditer(log.read())]
        return responses, replayed

    def assert_follow_the_map(self, responses: Sequence[dict]) -> None:
        self.assertEqual([r["output_ids"] for r in responses], self.intended)

    def test_prefill_replays_the_graph_and_matches_an_eager_prefill(self):
        for name, spec in SHAPES.items():
            with self.subTest(shape=name):
                graph, graph_replayed = self.serve(spec, piecewise=True)
                eager, eager_replayed = self.serve(spec, piecewise=False)
                self.assertEqual(len(graph_replayed), NUM_PROMPTS)
                self.assertEqual(len(eager_replayed), NUM_PROMPTS)
                self.assertTrue(all(graph_replayed), graph_replayed)
                self.assertFalse(any(eager_replayed), eager_replayed)
                self.assert_follow_the_map(graph)
                self.assert_follow_the_map(eager)
                self.assertEqual(
                    [acceptance(r) for r in graph], [acceptance(r) for r in eager]
                )


if __name__ == "__main__":
    unittest.main()
