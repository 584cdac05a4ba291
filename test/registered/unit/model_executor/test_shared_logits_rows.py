"""Rows of the logits buffer shared by the CUDA-graph runners (ModelRunner.
max_decode_logits_rows), on CPU: with --speculative-adaptive the verify graphs
of every candidate step count borrow it, so it must hold the largest candidate's
draft tokens per request, not the launch count's (upstream #30549: a server
launched with 3 steps crashed capturing the default config's 7-step state)."""

import types
import unittest

from sglang.srt.model_executor.cuda_graph_config import default_cuda_graph_config
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.runtime_context import get_context, get_parallel
from sglang.srt.speculative.adaptive_spec_params import (
    resolve_candidate_steps_from_config,
)
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

CAPTURE_BS = [1, 2, 4, 8, 16, 32, 48]
NUM_STEPS, NUM_DRAFT_TOKENS = 3, 4


class TestSharedLogitsRows(CustomTestCase):
    def max_decode_logits_rows(self, **server_fields) -> int:
        cuda_graph_config = default_cuda_graph_config()
        cuda_graph_config.decode.bs = CAPTURE_BS
        override = get_context().override_server_args(
            device="cpu",
            speculative_algorithm="EAGLE",
            speculative_num_steps=NUM_STEPS,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=NUM_DRAFT_TOKENS,
            cuda_graph_config=cuda_graph_config,
            **server_fields,
        )
        server_args = override.install()
        self.addCleanup(override.restore)
        self.enterContext(get_parallel().override(attn_tp_size=1, attn_cp_size=1))
        # The two ModelRunner methods read only these attributes.
        runner = types.SimpleNamespace(
            server_args=server_args,
            spec_algorithm=SpeculativeAlgorithm.EAGLE,
            is_draft_worker=False,
            req_to_token_pool=types.SimpleNamespace(size=max(CAPTURE_BS)),
        )
        runner.decode_num_tokens_per_req = types.MethodType(
            ModelRunner.decode_num_tokens_per_req, runner
        )
        return ModelRunner.max_decode_logits_rows(runner)

    def test_fixed_steps_size_it_by_the_launch_draft_tokens(self):
        self.assertEqual(
            self.max_decode_logits_rows(), max(CAPTURE_BS) * NUM_DRAFT_TOKENS
        )

    def test_adaptive_sizes_it_by_the_largest_candidate(self):
        largest_draft_tokens = max(resolve_candidate_steps_from_config(None)) + 1
        self.assertGreater(largest_draft_tokens, NUM_DRAFT_TOKENS)
        self.assertEqual(
            self.max_decode_logits_rows(speculative_adaptive=True),
            max(CAPTURE_BS) * largest_draft_tokens,
        )


if __name__ == "__main__":
    unittest.main()
