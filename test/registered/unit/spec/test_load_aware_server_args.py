"""Server args of load-aware speculation: CLI flags, defaults and validation.

CPU only: ServerArgs is built for real (device="cpu") from a tiny local model
config, through __post_init__ and handle_speculative_decoding (which calls
resolve_load_aware_server_args); no server, no weights, no GPU. The pure
validation functions are also run on plain namespaces of the field defaults.
"""

import argparse
import json
import os
import unittest
from dataclasses import MISSING, fields
from types import SimpleNamespace

from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_policy import (
    build_load_aware_policy,
    default_enable_batch_threshold,
    load_aware_unsupported_reason,
    plain_decode_graph_reserve_mb,
    resolve_load_aware_server_args,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.spec_engine_utils import tiny_llama_config_dir
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

FLAG_N = "--speculative-disable-batch-threshold"
FLAG_M = "--speculative-enable-batch-threshold"
FLAG_DWELL = "--speculative-load-aware-min-dwell-steps"


def default_args_namespace(**overrides):
    """The ServerArgs field defaults, as a plain namespace (pure-function tests)."""
    values = {f.name: f.default for f in fields(ServerArgs) if f.default is not MISSING}
    values.update(
        speculative_algorithm="EAGLE",
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


def cli_namespace(argv):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(argv)


class TestLoadAwareCli(CustomTestCase):
    def test_flags_default_off(self):
        ns = cli_namespace(["--model-path", "dummy"])
        self.assertIsNone(ns.speculative_disable_batch_threshold)
        self.assertIsNone(ns.speculative_enable_batch_threshold)
        self.assertEqual(ns.speculative_load_aware_min_dwell_steps, 8)
        self.assertIsNone(ServerArgs.speculative_disable_batch_threshold)
        self.assertIsNone(ServerArgs.speculative_enable_batch_threshold)
        self.assertEqual(ServerArgs.speculative_load_aware_min_dwell_steps, 8)

    def test_flags_parse_as_ints(self):
        ns = cli_namespace(
            ["--model-path", "dummy", FLAG_N, "32", FLAG_M, "20", FLAG_DWELL, "3"]
        )
        self.assertEqual(ns.speculative_disable_batch_threshold, 32)
        self.assertEqual(ns.speculative_enable_batch_threshold, 20)
        self.assertEqual(ns.speculative_load_aware_min_dwell_steps, 3)

    def test_non_integer_threshold_refused_by_the_parser(self):
        with self.assertRaises(SystemExit):
            cli_namespace(["--model-path", "dummy", FLAG_N, "many"])

    def test_auto_threshold_parses(self):
        ns = cli_namespace(["--model-path", "dummy", FLAG_N, "auto"])
        self.assertEqual(ns.speculative_disable_batch_threshold, "auto")


class TestLoadAwareValidationPure(CustomTestCase):
    def assertRaisesNaming(self, args, *needles):
        with self.assertRaises(ValueError) as ctx:
            resolve_load_aware_server_args(args)
        for needle in needles:
            self.assertIn(needle, str(ctx.exception))

    def test_defaults_filled(self):
        args = default_args_namespace(speculative_disable_batch_threshold=16)
        resolve_load_aware_server_args(args)
        self.assertEqual(args.speculative_enable_batch_threshold, 12)
        self.assertEqual(
            args.speculative_enable_batch_threshold, default_enable_batch_threshold(16)
        )

    def test_explicit_enable_threshold_kept(self):
        args = default_args_namespace(
            speculative_disable_batch_threshold=16,
            speculative_enable_batch_threshold=4,
        )
        resolve_load_aware_server_args(args)
        self.assertEqual(args.speculative_enable_batch_threshold, 4)

    def test_feature_off_is_untouched(self):
        for algo in ("NGRAM", "EAGLE", None):
            args = default_args_namespace(speculative_algorithm=algo)
            resolve_load_aware_server_args(args)
            self.assertIsNone(args.speculative_enable_batch_threshold, algo)

    def test_invalid_thresholds(self):
        cases = [
            (dict(speculative_disable_batch_threshold=1), [FLAG_N]),
            (dict(speculative_disable_batch_threshold=0), [FLAG_N]),
            (dict(speculative_disable_batch_threshold=-3), [FLAG_N]),
            (
                dict(
                    speculative_disable_batch_threshold=8,
                    speculative_enable_batch_threshold=8,
                ),
                [FLAG_M, FLAG_N],
            ),
            (
                dict(
                    speculative_disable_batch_threshold=8,
                    speculative_enable_batch_threshold=0,
                ),
                [FLAG_M],
            ),
            (dict(speculative_enable_batch_threshold=4), [FLAG_M, FLAG_N]),
            (
                dict(
                    speculative_disable_batch_threshold=8,
                    speculative_load_aware_min_dwell_steps=-1,
                ),
                [FLAG_DWELL],
            ),
        ]
        for overrides, needles in cases:
            with self.subTest(**overrides):
                self.assertRaisesNaming(default_args_namespace(**overrides), *needles)

    def test_auto_takes_no_enable_threshold_but_adaptive(self):
        self.assertRaisesNaming(
            default_args_namespace(
                speculative_disable_batch_threshold="auto",
                speculative_enable_batch_threshold=4,
            ),
            FLAG_M,
            "auto",
        )
        # auto chooses among the adaptive candidates itself.
        args = default_args_namespace(
            speculative_disable_batch_threshold="auto", speculative_adaptive=True
        )
        resolve_load_aware_server_args(args)
        self.assertTrue(args.speculative_adaptive)
        self.assertRaisesNaming(
            default_args_namespace(speculative_disable_batch_threshold="many"),
            FLAG_N,
            "auto",
        )

    def test_unsupported_modes_are_named(self):
        base = dict(speculative_disable_batch_threshold=8)
        cases = [
            (dict(speculative_algorithm=None), "--speculative-algorithm"),
            (dict(speculative_algorithm="NGRAM"), "NGRAM"),
            (dict(speculative_algorithm="STANDALONE"), "STANDALONE"),
            (dict(speculative_algorithm="DFLASH"), "DFLASH"),
            (dict(speculative_algorithm="DSPARK"), "DSPARK"),
            (dict(speculative_algorithm="FROZEN_KV_MTP"), "FROZEN_KV_MTP"),
            (dict(enable_multi_layer_eagle=True), "--enable-multi-layer-eagle"),
            (dict(enable_dp_attention=True), "--enable-dp-attention"),
            (dict(enable_two_batch_overlap=True), "--enable-two-batch-overlap"),
            (dict(enable_pdmux=True), "--enable-pdmux"),
            (dict(enable_lora=True), "--enable-lora"),
            (
                dict(speculative_use_rejection_sampling=True),
                "--speculative-use-rejection-sampling",
            ),
            (dict(pp_size=2), "--pp-size"),
            (dict(attention_backend="fa4"), "--attention-backend"),
            (
                dict(attention_backend="triton", decode_attention_backend="trtllm_mha"),
                "the trtllm_mha attention backend (--decode-attention-backend)",
            ),
            (
                dict(
                    attention_backend="triton",
                    speculative_draft_attention_backend="fa4",
                ),
                "--speculative-draft-attention-backend",
            ),
        ]
        for overrides, needle in cases:
            with self.subTest(**overrides):
                args = default_args_namespace(**base, **overrides)
                self.assertIn(needle, load_aware_unsupported_reason(args))
                self.assertRaisesNaming(args, FLAG_N, needle)

    def test_verified_attention_backends(self):
        for backend in ("triton", "flashinfer", "fa3", "torch_native", None):
            with self.subTest(backend=backend):
                args = default_args_namespace(
                    attention_backend=backend,
                    speculative_draft_attention_backend=backend,
                    speculative_disable_batch_threshold=8,
                )
                self.assertIsNone(load_aware_unsupported_reason(args))

    def test_supported_modes(self):
        """EAGLEWorkerV2 serves chains and draft trees, with and without the
        overlap scheduler, and chains with upstream's adaptive step count."""
        for algo in ("EAGLE", "EAGLE3"):
            for topk, ndt, adaptive in ((1, 4, False), (4, 16, False), (1, 4, True)):
                for disable_overlap in (False, True):
                    args = default_args_namespace(
                        speculative_algorithm=algo,
                        speculative_eagle_topk=topk,
                        speculative_num_draft_tokens=ndt,
                        speculative_adaptive=adaptive,
                        disable_overlap_schedule=disable_overlap,
                        speculative_disable_batch_threshold=8,
                    )
                    self.assertIsNone(load_aware_unsupported_reason(args))
                    resolve_load_aware_server_args(args)
                    self.assertEqual(args.speculative_enable_batch_threshold, 6)

    def test_unsupported_modes_without_the_feature_are_left_alone(self):
        args = default_args_namespace(speculative_algorithm="NGRAM", enable_lora=True)
        resolve_load_aware_server_args(args)
        self.assertIsNone(args.speculative_enable_batch_threshold)

    def test_policy_from_args(self):
        self.assertIsNone(build_load_aware_policy(default_args_namespace()))
        args = default_args_namespace(
            speculative_disable_batch_threshold=10,
            speculative_load_aware_min_dwell_steps=2,
        )
        resolve_load_aware_server_args(args)
        policy = build_load_aware_policy(args)
        self.assertEqual(
            (
                policy.disable_batch_threshold,
                policy.enable_batch_threshold,
                policy.min_dwell_steps,
            ),
            (10, 8, 2),
        )


class TestLoadAwareServerArgs(CustomTestCase):
    """The real ServerArgs post-init path (handle_speculative_decoding)."""

    @classmethod
    def setUpClass(cls):
        cls.tmpdir = tiny_llama_config_dir()

    @classmethod
    def tearDownClass(cls):
        cls.tmpdir.cleanup()

    def values(self, **kwargs):
        values = dict(
            model_path=self.tmpdir.name,
            device="cpu",
            skip_tokenizer_init=True,
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=self.tmpdir.name,
            speculative_num_steps=3,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=4,
        )
        values.update(kwargs)
        return values

    def make(self, **kwargs):
        return ServerArgs(**self.values(**kwargs))

    def assertRefused(self, *needles, **kwargs):
        with self.assertRaises(ValueError) as ctx:
            self.make(**kwargs)
        for needle in needles:
            self.assertIn(needle, str(ctx.exception))

    def test_feature_off_keeps_speculative_defaults(self):
        args = self.make()
        self.assertIsNone(args.speculative_disable_batch_threshold)
        self.assertIsNone(args.speculative_enable_batch_threshold)
        self.assertEqual(args.max_running_requests, 48)

    def test_feature_on_lifts_running_request_cap(self):
        args = self.make(speculative_disable_batch_threshold=16)
        self.assertEqual(args.speculative_disable_batch_threshold, 16)
        self.assertEqual(args.speculative_enable_batch_threshold, 12)
        self.assertEqual(args.speculative_load_aware_min_dwell_steps, 8)
        self.assertIsNone(args.max_running_requests)

    def test_from_the_command_line(self):
        argv = ["--model-path", self.tmpdir.name, "--device", "cpu"]
        argv += ["--skip-tokenizer-init", "--speculative-algorithm", "EAGLE3"]
        argv += ["--speculative-draft-model-path", self.tmpdir.name]
        argv += ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1"]
        argv += ["--speculative-num-draft-tokens", "4"]
        argv += [FLAG_N, "24", FLAG_DWELL, "2"]
        args = ServerArgs.from_cli_args(cli_namespace(argv))
        self.assertEqual(args.speculative_algorithm, "EAGLE3")
        self.assertEqual(args.speculative_disable_batch_threshold, 24)
        self.assertEqual(args.speculative_enable_batch_threshold, 18)
        self.assertEqual(args.speculative_load_aware_min_dwell_steps, 2)
        self.assertIsNone(args.max_running_requests)

    def test_auto_from_the_command_line(self):
        argv = ["--model-path", self.tmpdir.name, "--device", "cpu"]
        argv += ["--skip-tokenizer-init", "--speculative-algorithm", "EAGLE3"]
        argv += ["--speculative-draft-model-path", self.tmpdir.name]
        argv += ["--speculative-num-steps", "3", "--speculative-eagle-topk", "4"]
        argv += ["--speculative-num-draft-tokens", "8", FLAG_N, "auto"]
        args = ServerArgs.from_cli_args(cli_namespace(argv))
        self.assertEqual(args.speculative_disable_batch_threshold, "auto")
        self.assertIsNone(args.speculative_enable_batch_threshold)
        self.assertIsNone(args.max_running_requests)
        self.assertRefused(
            FLAG_N,
            "NGRAM",
            speculative_algorithm="NGRAM",
            speculative_draft_model_path=None,
            speculative_disable_batch_threshold="auto",
        )

    def test_the_plain_decode_graphs_are_in_the_memory_reserve(self):
        """A second DECODE graph family (and, on flashinfer, its workspace) is
        captured after the KV pool is sized: the reserve that sizes it counts them."""
        without = self.make(attention_backend="triton")
        plain_graphs = without.cuda_graph_config.decode.max_bs * 2
        for kwargs, extra in [
            (dict(speculative_disable_batch_threshold=16), plain_graphs),
            (dict(speculative_disable_batch_threshold="auto"), plain_graphs),
            (dict(speculative_adaptive=True), plain_graphs),
        ]:
            args = self.make(attention_backend="triton", **kwargs)
            self.assertEqual(plain_decode_graph_reserve_mb(args), extra, kwargs)
            self.assertEqual(
                args.reserve_for_graph_mb(), without.reserve_for_graph_mb() + extra
            )
        self.assertEqual(plain_decode_graph_reserve_mb(without), 0)
        # Adaptive tiers that never run 0 draft steps, or whose 0-step tiers keep
        # upstream's verify (a feature the plain step does not support), capture none.
        config = os.path.join(self.tmpdir.name, "adaptive_no_zero_steps.json")
        with open(config, "w") as f:
            json.dump({"1": {"candidate_steps": [1, 3]}}, f)
        for kwargs in (
            dict(speculative_adaptive_config=config),
            dict(speculative_use_rejection_sampling=True),
        ):
            args = self.make(
                attention_backend="triton", speculative_adaptive=True, **kwargs
            )
            self.assertTrue(args.speculative_adaptive, kwargs)
            self.assertEqual(plain_decode_graph_reserve_mb(args), 0, kwargs)
        flashinfer = self.make(
            attention_backend="flashinfer", speculative_disable_batch_threshold=16
        )
        self.assertEqual(plain_decode_graph_reserve_mb(flashinfer), plain_graphs + 384)

    def test_explicit_max_running_requests_kept(self):
        for threshold in (None, 16):
            args = self.make(
                speculative_disable_batch_threshold=threshold, max_running_requests=256
            )
            self.assertEqual(args.max_running_requests, 256, threshold)

    def test_cap_below_the_threshold_warns(self):
        with self.assertLogs("sglang.srt.speculative.spec_policy", "WARNING") as logs:
            args = self.make(
                speculative_disable_batch_threshold=16, max_running_requests=8
            )
        self.assertEqual(args.max_running_requests, 8)
        self.assertIn("the threshold never makes a decode step plain", logs.output[0])

    def test_chains_of_eagle_and_eagle3(self):
        for algo in ("EAGLE", "EAGLE3", "NEXTN"):  # NEXTN resolves to EAGLE
            args = self.make(
                speculative_algorithm=algo, speculative_disable_batch_threshold=8
            )
            self.assertIn(args.speculative_algorithm, ("EAGLE", "EAGLE3"))
            self.assertEqual(args.speculative_enable_batch_threshold, 6)

    def test_draft_trees_accepted(self):
        for page in (dict(page_size=1), dict(page_size=16, attention_backend="triton")):
            args = self.make(
                speculative_disable_batch_threshold=8,
                speculative_enable_batch_threshold=2,
                speculative_eagle_topk=4,
                speculative_num_draft_tokens=8,
                **page,
            )
            self.assertEqual(args.speculative_eagle_topk, 4, page)
            self.assertEqual(args.speculative_num_draft_tokens, 8, page)
            self.assertEqual(args.speculative_enable_batch_threshold, 2, page)
            self.assertIsNone(args.max_running_requests)

    def test_adaptive_accepted_with_the_thresholds(self):
        args = self.make(
            speculative_disable_batch_threshold=8, speculative_adaptive=True
        )
        self.assertTrue(args.speculative_adaptive)
        self.assertEqual(args.speculative_disable_batch_threshold, 8)
        self.assertEqual(args.speculative_enable_batch_threshold, 6)
        # The step count left to the adaptive tiers.
        args = self.make(
            speculative_disable_batch_threshold=8,
            speculative_adaptive=True,
            speculative_num_steps=None,
            speculative_eagle_topk=None,
            speculative_num_draft_tokens=None,
        )
        self.assertTrue(args.speculative_adaptive)
        self.assertEqual(args.speculative_eagle_topk, 1)
        self.assertEqual(
            args.speculative_num_draft_tokens, args.speculative_num_steps + 1
        )

    def test_adaptive_refused_by_upstream_keeps_the_thresholds(self):
        """Upstream's adaptive mode is topk 1 only: with a tree it falls back to
        static steps; the load-aware thresholds still apply."""
        args = self.make(
            speculative_disable_batch_threshold=8,
            speculative_adaptive=True,
            speculative_eagle_topk=4,
            speculative_num_draft_tokens=8,
        )
        self.assertFalse(args.speculative_adaptive)
        self.assertEqual(args.speculative_enable_batch_threshold, 6)

    def test_invalid_thresholds_rejected(self):
        self.assertRefused(
            FLAG_M,
            FLAG_N,
            speculative_disable_batch_threshold=8,
            speculative_enable_batch_threshold=9,
        )
        self.assertRefused(FLAG_N, speculative_disable_batch_threshold=1)
        self.assertRefused(
            FLAG_DWELL,
            speculative_disable_batch_threshold=8,
            speculative_load_aware_min_dwell_steps=-2,
        )
        self.assertRefused(FLAG_M, FLAG_N, speculative_enable_batch_threshold=4)

    def test_unsupported_modes_rejected(self):
        self.assertRefused(
            FLAG_N,
            "--speculative-algorithm",
            speculative_algorithm=None,
            speculative_draft_model_path=None,
            speculative_num_steps=None,
            speculative_eagle_topk=None,
            speculative_num_draft_tokens=None,
            speculative_disable_batch_threshold=8,
        )
        self.assertRefused(
            FLAG_N,
            "NGRAM",
            speculative_algorithm="NGRAM",
            speculative_draft_model_path=None,
            speculative_disable_batch_threshold=8,
        )
        self.assertRefused(
            FLAG_N,
            "STANDALONE",
            speculative_algorithm="STANDALONE",
            speculative_disable_batch_threshold=8,
        )
        self.assertRefused(
            FLAG_N,
            "--speculative-use-rejection-sampling",
            speculative_use_rejection_sampling=True,
            speculative_disable_batch_threshold=8,
        )
        self.assertRefused(
            FLAG_N, "--pp-size", pp_size=2, speculative_disable_batch_threshold=8
        )

    def test_policy_from_resolved_args(self):
        args = self.make(
            speculative_disable_batch_threshold=12,
            speculative_load_aware_min_dwell_steps=0,
        )
        policy = build_load_aware_policy(args)
        self.assertEqual(
            (policy.disable_batch_threshold, policy.enable_batch_threshold), (12, 9)
        )
        self.assertEqual(
            [policy.decide(bs).speculate for bs in (11, 12, 10, 9)],
            [True, False, False, True],
        )
        self.assertIsNone(build_load_aware_policy(self.make()))


if __name__ == "__main__":
    unittest.main()
