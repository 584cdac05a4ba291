"""The README's serve commands, exactly as a new user runs them on one GPU: generate
the synthetic pair, serve it with the README's flags (the default memory fraction
included), one request, and the load-aware metrics. Only the output directory and
the port differ. The CPU tier checks that the command parses
(test_readme_serve_args.py)."""

import os
import subprocess
import sys
import tempfile
import unittest

import pytest

from sglang.test.ci.ci_register import register_cuda_ci
from sglang.test.spec_engine_utils import (
    greedy_params,
    metric_total,
    post_concurrently,
    random_prompts,
    running_server,
    scrape_metrics,
)
from sglang.test.synthetic_spec_models import greedy_continuation, next_token_map
from sglang.test.test_utils import CustomTestCase

from readme_commands import README_OUT_DIR, readme_serve_commands

register_cuda_ci(est_time=300, suite="base-b-test-1-gpu-large")
pytestmark = pytest.mark.gpu


class TestReadmeServeCommand(CustomTestCase):
    def test_readme_commands_serve_and_report_metrics(self):
        generate, serve = readme_serve_commands()
        with tempfile.TemporaryDirectory() as out:
            relocated = lambda argv: [a.replace(README_OUT_DIR, out) for a in argv]
            subprocess.run([sys.executable, *relocated(generate)[1:]], check=True)
            serve_args = relocated(serve)[3:]
            i = serve_args.index("--model-path")
            model_path, other_args = (
                serve_args[i + 1],
                serve_args[:i] + serve_args[i + 2 :],
            )
            token_map = next_token_map(out)
            with running_server(model_path, other_args, synthetic_tokenizer=False) as (
                base_url,
                process,
            ):
                # A lone request speculates; 24 at once (>= the threshold 16) run plain.
                for num in (1, 24):
                    prompts = random_prompts(num, 16, len(token_map), seed=num)
                    outputs = post_concurrently(
                        base_url, [(p, greedy_params(48)) for p in prompts]
                    )
                    for prompt, output in zip(prompts, outputs):
                        self.assertEqual(
                            output["output_ids"],
                            greedy_continuation(token_map, prompt, 48),
                        )
                metrics = scrape_metrics(base_url)
                self.assertIsNone(process.poll())
        for mode in ("spec", "plain"):
            self.assertGreater(
                metric_total(metrics, "sglang:spec_decode_steps_total", mode=mode),
                0,
                mode,
            )
        self.assertGreater(metric_total(metrics, "sglang:spec_toggles_total"), 0)


if __name__ == "__main__":
    unittest.main()
