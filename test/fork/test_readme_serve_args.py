"""The README's serve command is one ServerArgs accepts, with the load-aware flags
(test_readme_serve_command.py serves it on a GPU). CPU only: ServerArgs is built
for real (device="cpu") from a tiny local model config."""

import argparse
import unittest

from readme_commands import README_OUT_DIR, readme_serve_commands

from sglang.srt.server_args import ServerArgs
from sglang.test.spec_engine_utils import tiny_llama_config_dir
from sglang.test.test_utils import CustomTestCase


class TestReadmeServeArgs(CustomTestCase):
    def test_the_readme_serve_command_parses(self):
        generate, serve = readme_serve_commands()
        self.assertEqual(
            generate[:3], ["python", "-m", "sglang.test.synthetic_spec_models"]
        )
        self.assertEqual(serve[:3], ["python", "-m", "sglang.launch_server"])
        with tiny_llama_config_dir() as model_dir:
            argv = [
                model_dir if a.startswith(f"{README_OUT_DIR}/") else a
                for a in serve[3:]
            ]
            parser = argparse.ArgumentParser()
            ServerArgs.add_cli_args(parser)
            args = ServerArgs.from_cli_args(
                parser.parse_args(argv + ["--device", "cpu", "--skip-tokenizer-init"])
            )
        self.assertEqual(args.speculative_disable_batch_threshold, 16)
        self.assertEqual(args.speculative_eagle_topk, 4)
        self.assertTrue(args.enable_metrics)


if __name__ == "__main__":
    unittest.main()
