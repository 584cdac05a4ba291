"""Server args of load-aware speculation: CLI flags, defaults and validation.

CPU only: ServerArgs is built for real (device="cpu") from a tiny local model
config; no server, no weights, no GPU.
"""

import argparse
import unittest
from dataclasses import MISSING, fields
from types import SimpleNamespace

from sglang.srt.environ import envs
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_policy import (
    SpecPolicy,
    default_enable_batch_threshold,
    load_aware_unsupported_reason,
    resolve_load_aware_server_args,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.spec_engine_utils import tiny_llama_config_dir
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")


def default_args_namespace(**overrides):
    """The ServerArgs field defaults, as a plain namespace (pure-function tests)."""
    values = {f.name: f.default for f in fields(ServerArgs) if f.default is not MISSING}
    values.update(
        speculative_algorithm="EAGLE",
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
        disable_overlap_schedule=True,  # the v1 worker
    )
    values.update(overrides)
    return SimpleNamespace(**values)


class TestLoadAwareCli(CustomTestCase):
    def parse(self, argv):
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        return parser.parse_args(["--model-path", "dummy"] + argv)

    def test_flags_default_off(self):
        ns = self.parse([])
        self.assertIsNone(ns.speculative_disable_batch_threshold)
        self.assertIsNone(ns.speculative_enable_batch_threshold)
        self.assertEqual(ns.speculative_load_aware_min_dwell_steps, 8)
        self.assertIsNone(ServerArgs.speculative_disable_batch_threshold)

    def test_flags_parse_as_ints(self):
        ns = self.parse(
            [
                "--speculative-disable-batch-threshold",
                "32",
                "--speculative-enable-batch-threshold",
                "20",
                "--speculative-load-aware-min-dwell-steps",
                "3",
            ]
        )
        self.assertEqual(ns.speculative_disable_batch_threshold, 32)
        self.assertEqual(ns.speculative_enable_batch_threshold, 20)
        self.assertEqual(ns.speculative_load_aware_min_dwell_steps, 3)


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
        args = default_args_namespace(speculative_algorithm="NGRAM")
        resolve_load_aware_server_args(args)
        self.assertIsNone(args.speculative_enable_batch_threshold)

    def test_invalid_thresholds(self):
        flag_n = "--speculative-disable-batch-threshold"
        flag_m = "--speculative-enable-batch-threshold"
        self.assertRaisesNaming(
            default_args_namespace(speculative_disable_batch_threshold=1), flag_n
        )
        self.assertRaisesNaming(
            default_args_namespace(speculative_disable_batch_threshold=0), flag_n
        )
        self.assertRaisesNaming(
            default_args_namespace(speculative_disable_batch_threshold=-3), flag_n
        )
        self.assertRaisesNaming(
            default_args_namespace(
                speculative_disable_batch_threshold=8,
                speculative_enable_batch_threshold=8,
            ),
            flag_m,
            flag_n,
        )
        self.assertRaisesNaming(
            default_args_namespace(
                speculative_disable_batch_threshold=8,
                speculative_enable_batch_threshold=0,
            ),
            flag_m,
        )
        self.assertRaisesNaming(
            default_args_namespace(speculative_enable_batch_threshold=4),
            flag_m,
            flag_n,
        )
        self.assertRaisesNaming(
            default_args_namespace(
                speculative_disable_batch_threshold=8,
                speculative_load_aware_min_dwell_steps=-1,
            ),
            "--speculative-load-aware-min-dwell-steps",
        )

    def test_unsupported_modes_are_named(self):
        base = dict(speculative_disable_batch_threshold=8)
        cases = [
            (dict(speculative_algorithm=None), "--speculative-algorithm"),
            (dict(speculative_algorithm="NGRAM"), "NGRAM"),
            (dict(speculative_algorithm="STANDALONE"), "STANDALONE"),
            (dict(speculative_algorithm="DFLASH"), "DFLASH"),
            (dict(enable_multi_layer_eagle=True), "--enable-multi-layer-eagle"),
            (dict(enable_dp_attention=True), "--enable-dp-attention"),
            (dict(enable_two_batch_overlap=True), "--enable-two-batch-overlap"),
            (dict(enable_pdmux=True), "--enable-pdmux"),
            (dict(speculative_adaptive=True), "--speculative-adaptive"),
            (dict(enable_lora=True), "--enable-lora"),
            (dict(pp_size=2), "--pp-size"),
        ]
        for overrides, needle in cases:
            args = default_args_namespace(**base, **overrides)
            self.assertIsNotNone(load_aware_unsupported_reason(args), overrides)
            self.assertRaisesNaming(
                args, "--speculative-disable-batch-threshold", needle
            )
        for algo in ("EAGLE", "EAGLE3"):
            for topk in (1, 4):
                args = default_args_namespace(
                    speculative_algorithm=algo, speculative_eagle_topk=topk, **base
                )
                self.assertIsNone(load_aware_unsupported_reason(args))
            # The spec-v2 overlap worker: chains, trees, and chains with the adaptive
            # step count.
            for topk, ndt, adaptive in ((1, 4, False), (4, 16, False), (1, 4, True)):
                args = default_args_namespace(
                    speculative_algorithm=algo,
                    disable_overlap_schedule=False,
                    speculative_eagle_topk=topk,
                    speculative_num_draft_tokens=ndt,
                    speculative_adaptive=adaptive,
                    **base,
                )
                self.assertIsNone(load_aware_unsupported_reason(args))

    def test_adaptive_refusal_names_the_worker(self):
        args = default_args_namespace(
            speculative_disable_batch_threshold=8, speculative_adaptive=True
        )
        self.assertIn("spec-v2", load_aware_unsupported_reason(args))

    def test_policy_from_args(self):
        self.assertIsNone(SpecPolicy.from_server_args(default_args_namespace()))
        args = default_args_namespace(
            speculative_disable_batch_threshold=10,
            speculative_load_aware_min_dwell_steps=2,
        )
        resolve_load_aware_server_args(args)
        policy = SpecPolicy.from_server_args(args)
        self.assertEqual(
            (
                policy.disable_batch_threshold,
                policy.enable_batch_threshold,
                policy.min_dwell_steps,
            ),
            (10, 8, 2),
        )


class TestLoadAwareServerArgs(CustomTestCase):
    """The real ServerArgs post-init path (_handle_speculative_decoding)."""

    @classmethod
    def setUpClass(cls):
        cls.tmpdir = tiny_llama_config_dir()

    @classmethod
    def tearDownClass(cls):
        cls.tmpdir.cleanup()

    def make(self, spec_v2=False, **kwargs):
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
        with envs.SGLANG_ENABLE_SPEC_V2.override(spec_v2):
            return ServerArgs(**values)

    def test_feature_off_keeps_speculative_defaults(self):
        args = self.make()
        self.assertIsNone(args.speculative_disable_batch_threshold)
        self.assertIsNone(args.speculative_enable_batch_threshold)
        self.assertEqual(args.max_running_requests, 48)

    def test_feature_on_lifts_running_request_cap(self):
        args = self.make(speculative_disable_batch_threshold=16)
        self.assertEqual(args.speculative_enable_batch_threshold, 12)
        self.assertIsNone(args.max_running_requests)
        self.assertTrue(args.disable_overlap_schedule)

    def test_explicit_max_running_requests_kept(self):
        args = self.make(
            speculative_disable_batch_threshold=16, max_running_requests=256
        )
        self.assertEqual(args.max_running_requests, 256)

    def test_tree_speculation_supported(self):
        args = self.make(
            speculative_disable_batch_threshold=8,
            speculative_enable_batch_threshold=2,
            speculative_eagle_topk=4,
            speculative_num_draft_tokens=8,
        )
        self.assertEqual(args.speculative_enable_batch_threshold, 2)

    def test_spec_v2_supported(self):
        args = self.make(spec_v2=True, speculative_disable_batch_threshold=8)
        self.assertFalse(args.disable_overlap_schedule)  # the v2 overlap worker
        self.assertEqual(args.speculative_enable_batch_threshold, 6)
        self.assertIsNone(args.max_running_requests)

    def test_worker_of_draft_trees(self):
        """Trees run on spec v2 at page size 1 and fall back to v1 at page size 16
        (or stay there when v1 is asked for), with or without load-aware speculation."""
        page_16 = dict(page_size=16, attention_backend="flashinfer")
        cases = [  # (overrides, on the v1 worker)
            (dict(spec_v2=True, page_size=1), False),
            (dict(spec_v2=True, **page_16), True),
            (dict(spec_v2=False, **page_16), True),
            (dict(spec_v2=True, disable_overlap_schedule=True, **page_16), True),
        ]
        for overrides, on_v1 in cases:
            for threshold in (None, 8):
                args = self.make(
                    speculative_disable_batch_threshold=threshold,
                    speculative_eagle_topk=4,
                    speculative_num_draft_tokens=16,
                    **overrides,
                )
                self.assertEqual(
                    args.disable_overlap_schedule, on_v1, (overrides, threshold)
                )
                self.assertEqual(args.speculative_eagle_topk, 4)

    def test_spec_v2_chain_at_page_size_16_allowed(self):
        args = self.make(spec_v2=True, page_size=16)
        self.assertFalse(args.disable_overlap_schedule)

    def test_spec_v2_adaptive_accepted(self):
        args = self.make(
            spec_v2=True,
            speculative_disable_batch_threshold=8,
            speculative_adaptive=True,
        )
        self.assertTrue(args.speculative_adaptive)
        self.assertFalse(args.disable_overlap_schedule)
        self.assertEqual(args.speculative_enable_batch_threshold, 6)

    def test_v1_adaptive_rejected(self):
        with self.assertRaises(ValueError) as ctx:
            self.make(speculative_disable_batch_threshold=8, speculative_adaptive=True)
        self.assertIn("--speculative-adaptive", str(ctx.exception))

    def test_invalid_threshold_rejected(self):
        with self.assertRaises(ValueError) as ctx:
            self.make(
                speculative_disable_batch_threshold=8,
                speculative_enable_batch_threshold=9,
            )
        self.assertIn("--speculative-enable-batch-threshold", str(ctx.exception))

    def test_threshold_without_speculation_rejected(self):
        with self.assertRaises(ValueError) as ctx:
            self.make(
                speculative_algorithm=None,
                speculative_draft_model_path=None,
                speculative_num_steps=None,
                speculative_eagle_topk=None,
                speculative_num_draft_tokens=None,
                speculative_disable_batch_threshold=8,
            )
        self.assertIn("--speculative-algorithm", str(ctx.exception))


if __name__ == "__main__":
    unittest.main()
