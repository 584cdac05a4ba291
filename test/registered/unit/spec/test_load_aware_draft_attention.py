"""load_aware_draft.DecodeAttentionForOneTokenExtend: the one-token draft extend of a
plain step reaches the decode path of the attention backend. No GPU."""

import unittest

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.load_aware_draft import DecodeAttentionForOneTokenExtend
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")


class RecordingBackend(AttentionBackend):
    """Records what a real backend would branch on: forward mode and spec_info."""

    def __init__(self):
        self.calls = []

    def init_forward_metadata(self, forward_batch):
        self.calls.append(
            ("metadata", forward_batch.forward_mode, forward_batch.spec_info)
        )

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        self.calls.append(("graph_state", max_bs, max_num_tokens))

    def init_forward_metadata_capture_cuda_graph(
        self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens, mode, spec
    ):
        self.calls.append(("capture", bs, num_tokens, mode, spec))

    def init_forward_metadata_replay_cuda_graph(
        self, bs, req_pool_indices, seq_lens, seq_lens_sum, enc, mode, spec, cpu
    ):
        self.calls.append(("replay", bs, seq_lens_sum, mode, spec))

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self.calls.append(("decode", layer, save_kv_cache))
        return q

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        raise AssertionError("a one-token draft extend must not take the extend path")


def draft_extend_batch(bs: int) -> ForwardBatch:
    return ForwardBatch(
        forward_mode=ForwardMode.DRAFT_EXTEND_V2,
        batch_size=bs,
        input_ids=torch.zeros(bs, dtype=torch.int64),
        req_pool_indices=torch.arange(bs),
        seq_lens=torch.full((bs,), 9),
        out_cache_loc=torch.arange(bs),
        seq_lens_sum=9 * bs,
        spec_info=EagleDraftInput(hidden_states=torch.zeros(bs, 12)),
    )


class TestDecodeAttentionForOneTokenExtend(CustomTestCase):
    def setUp(self):
        self.inner = RecordingBackend()
        self.backend = DecodeAttentionForOneTokenExtend(self.inner)

    def test_eager_metadata_is_planned_as_decode_and_the_batch_is_kept(self):
        batch = draft_extend_batch(3)
        spec_info = batch.spec_info
        self.backend.init_forward_metadata(batch)
        self.assertEqual(self.inner.calls, [("metadata", ForwardMode.DECODE, None)])
        # The draft model reads its hidden-state input from the batch.
        self.assertIs(batch.spec_info, spec_info)
        self.assertEqual(batch.forward_mode, ForwardMode.DRAFT_EXTEND_V2)

    def test_graph_metadata_is_captured_and_replayed_as_decode(self):
        seq_lens = torch.full((4,), 9)
        spec_info = EagleDraftInput()
        self.backend.init_cuda_graph_state(8, 8)
        self.backend.init_forward_metadata_capture_cuda_graph(
            4, 4, None, seq_lens, None, ForwardMode.DRAFT_EXTEND, spec_info
        )
        self.backend.init_forward_metadata_replay_cuda_graph(
            4, None, seq_lens, 36, None, ForwardMode.DRAFT_EXTEND_V2, spec_info, None
        )
        self.assertEqual(
            self.inner.calls,
            [
                ("graph_state", 8, 8),
                ("capture", 4, 4, ForwardMode.DECODE, None),
                ("replay", 4, 36, ForwardMode.DECODE, None),
            ],
        )
        self.assertEqual(self.backend.get_cuda_graph_seq_len_fill_value(), 1)

    def test_capture_refuses_more_than_one_token_per_request(self):
        with self.assertRaises(AssertionError):
            self.backend.init_forward_metadata_capture_cuda_graph(
                4, 12, None, None, None, ForwardMode.DRAFT_EXTEND, None
            )

    def test_attention_of_a_draft_extend_batch_runs_the_decode_kernel(self):
        batch = draft_extend_batch(2)
        q = torch.ones(2, 8)
        out = self.backend.forward(q, q, q, "layer0", batch, save_kv_cache=True)
        self.assertIs(out, q)
        self.assertEqual(self.inner.calls, [("decode", "layer0", True)])


if __name__ == "__main__":
    unittest.main()
