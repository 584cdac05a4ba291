"""The output path of a load-aware plain decode step (spec v2), on CPU.

A plain step returns a result shaped like a verify that accepted no draft (one
token per request: accept_lens 1, stride 1), flagged ``spec_plain_step``. The
result processor (managers/scheduler_components/batch_result_processor.py)
then commits that token like a verify's, and counts no verify: no per-request
spec_verify_ct / accepted-draft statistics, no adaptive controller feed, no
accept-length metric. Real SchedulerBatchResultProcessor, ScheduleBatch and
Req objects; the scheduler's other components are recording stand-ins.
"""

import unittest
from array import array
from typing import List

import torch

from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler_components.batch_result_processor import (
    SchedulerBatchResultProcessor,
)
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.cpu_schedule_batch import TinyEagleTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

PROMPT_LENS = [3, 5, 2, 4]
NUM_DRAFT_TOKENS = 4


class RecordingSpecWorker:
    """The model worker's adaptive hook (EAGLEWorkerV2 feeds its controller)."""

    def __init__(self):
        self.verify_feeds = []

    def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size=0):
        self.verify_feeds.append((list(num_correct_drafts_per_req), batch_size))


class RecordingMetricsReporter:
    def __init__(self):
        self.num_generated_tokens = 0
        self.forward_ct_decode = 0
        self.spec_metrics = []
        self.decode_stats = []

    def update_spec_metrics(self, bs, num_correct_drafts, **kwargs):
        self.spec_metrics.append((bs, num_correct_drafts))

    def report_decode_stats(self, can_run_cuda_graph, running_batch, **kwargs):
        self.decode_stats.append(kwargs)


class RecordingOutputStreamer:
    def __init__(self):
        self.streamed = []

    def stream_output(self, reqs, return_logprob):
        self.streamed.append([req.rid for req in reqs])


def plain_result(tokens: List[int], logprobs=None) -> GenerationBatchResult:
    """What LoadAwarePlainStep returns (after copy_to_cpu)."""
    bs = len(tokens)
    return GenerationBatchResult(
        logits_output=LogitsProcessorOutput(
            next_token_logits=None,
            next_token_logprobs=(
                None if logprobs is None else torch.tensor(logprobs).view(bs, 1)
            ),
        ),
        next_token_ids=torch.tensor(tokens),
        accept_lens=torch.ones(bs, dtype=torch.int32),
        speculative_num_draft_tokens=1,
        spec_plain_step=True,
    )


def verify_result(tokens_per_req: List[List[int]]) -> GenerationBatchResult:
    """A verify step's result: NUM_DRAFT_TOKENS slots per request, the first
    accept_len of them accepted."""
    padded = [t + [0] * (NUM_DRAFT_TOKENS - len(t)) for t in tokens_per_req]
    return GenerationBatchResult(
        logits_output=LogitsProcessorOutput(next_token_logits=None),
        next_token_ids=torch.tensor(sum(padded, [])),
        accept_lens=torch.tensor([len(t) for t in tokens_per_req], dtype=torch.int32),
        speculative_num_draft_tokens=NUM_DRAFT_TOKENS,
    )


class LoadAwareResultTestBase(TinyEagleTestCase):
    def setUp(self):
        self.publish_eagle_args(NUM_DRAFT_TOKENS - 1, 1, NUM_DRAFT_TOKENS)
        self.worker = RecordingSpecWorker()
        self.metrics = RecordingMetricsReporter()
        self.streamer = RecordingOutputStreamer()
        self.processor = SchedulerBatchResultProcessor(
            is_generation=True,
            disaggregation_mode=DisaggregationMode.NULL,
            enable_overlap=False,
            enable_overlap_mlx=False,
            server_args=None,
            model_config=self.model_config,
            token_to_kv_pool_allocator=TokenToKVPoolAllocator(
                size=64,
                dtype=torch.bfloat16,
                device="cpu",
                kvcache=None,
                need_sort=False,
            ),
            tree_cache=None,
            hisparse_coordinator=None,
            req_to_token_pool=None,
            decode_offload_manager=None,
            metrics_collector=None,
            metrics_reporter=self.metrics,
            draft_worker=self.worker,
            model_worker=self.worker,
            logprob_result_processor=None,
            output_streamer=self.streamer,
            abort_request=None,
        )

    def decode_batch(self, return_logprob=False) -> ScheduleBatch:
        """Requests after prefill (first token out, its KV not committed yet)."""
        reqs = []
        for i, n in enumerate(PROMPT_LENS):
            sampling_params = SamplingParams(max_new_tokens=64)
            sampling_params.normalize(None)
            req = Req(
                f"r{i}",
                "",
                array("q", range(1, n + 1)),
                sampling_params,
                return_logprob=return_logprob,
                vocab_size=self.model_config.vocab_size,
            )
            req.output_ids.append(100 + i)
            req.kv_committed_len = n
            reqs.append(req)
        return ScheduleBatch(
            reqs=reqs,
            forward_mode=ForwardMode.DECODE,
            spec_algorithm=SpeculativeAlgorithm.EAGLE,
            return_logprob=return_logprob,
        )

    def spec_stats(self, batch):
        return [
            (
                req.spec_verify_ct,
                req.spec_num_correct_drafts,
                list(req.spec_correct_drafts_histogram),
            )
            for req in batch.reqs
        ]


class TestResolveSpecV2Tokens(LoadAwareResultTestBase):
    def test_plain_step_commits_one_token_and_counts_no_verify(self):
        batch = self.decode_batch()
        stats = self.spec_stats(batch)
        result = plain_result([40, 41, 42, 43])

        tokens = self.processor._resolve_spec_v2_tokens(result, batch)

        self.assertEqual(tokens, [[40], [41], [42], [43]])
        self.assertEqual(
            [req.kv_committed_len for req in batch.reqs], [n + 1 for n in PROMPT_LENS]
        )
        self.assertEqual(self.spec_stats(batch), stats)
        self.assertEqual(self.worker.verify_feeds, [])
        self.assertEqual(result.num_correct_drafts, 0)

    def test_verify_step_commits_and_counts(self):
        batch = self.decode_batch()
        result = verify_result([[1, 2, 3], [4], [5, 6, 7, 8], [9, 10]])

        tokens = self.processor._resolve_spec_v2_tokens(result, batch)

        self.assertEqual(tokens, [[1, 2, 3], [4], [5, 6, 7, 8], [9, 10]])
        self.assertEqual(
            [req.kv_committed_len for req in batch.reqs],
            [n + a for n, a in zip(PROMPT_LENS, [3, 1, 4, 2])],
        )
        self.assertEqual(
            self.spec_stats(batch),
            [(1, 2, [0, 0, 1]), (1, 0, [1]), (1, 3, [0, 0, 0, 1]), (1, 1, [0, 1])],
        )
        self.assertEqual(self.worker.verify_feeds, [([2, 0, 3, 1], 4)])
        self.assertEqual(result.num_correct_drafts, 6)

    def test_steps_of_both_kinds(self):
        batch = self.decode_batch()
        self.processor._resolve_spec_v2_tokens(plain_result([1, 2, 3, 4]), batch)
        self.processor._resolve_spec_v2_tokens(
            verify_result([[5, 6], [7], [8], [9, 10, 11]]), batch
        )
        self.processor._resolve_spec_v2_tokens(plain_result([12, 13, 14, 15]), batch)
        self.assertEqual(
            [req.kv_committed_len for req in batch.reqs],
            [n + a for n, a in zip(PROMPT_LENS, [4, 3, 3, 5])],
        )
        self.assertEqual([req.spec_verify_ct for req in batch.reqs], [1] * 4)
        self.assertEqual(
            [req.spec_num_correct_drafts for req in batch.reqs], [1, 0, 0, 2]
        )
        self.assertEqual(self.worker.verify_feeds, [([1, 0, 0, 2], 4)])

    def test_finished_request_commits_nothing(self):
        batch = self.decode_batch()
        batch.reqs[1].finished_reason = object()
        self.processor._resolve_spec_v2_tokens(plain_result([1, 2, 3, 4]), batch)
        self.assertEqual([req.kv_committed_len for req in batch.reqs], [4, 5, 3, 5])


class TestProcessBatchResultDecode(LoadAwareResultTestBase):
    def test_plain_step_skips_the_spec_metrics(self):
        batch = self.decode_batch()
        self.processor.process_batch_result_decode(batch, plain_result([7, 8, 9, 10]))
        self.assertEqual(
            [list(req.output_ids) for req in batch.reqs],
            [[100, 7], [101, 8], [102, 9], [103, 10]],
        )
        self.assertEqual(self.metrics.spec_metrics, [])
        self.assertEqual(self.metrics.num_generated_tokens, 4)
        self.assertEqual(len(self.metrics.decode_stats), 1)
        self.assertEqual(self.streamer.streamed, [["r0", "r1", "r2", "r3"]])
        self.assertEqual(self.worker.verify_feeds, [])

    def test_verify_step_updates_the_spec_metrics(self):
        batch = self.decode_batch()
        self.processor.process_batch_result_decode(
            batch, verify_result([[1, 2], [3], [4, 5, 6], [7]])
        )
        self.assertEqual(
            [list(req.output_ids)[1:] for req in batch.reqs],
            [[1, 2], [3], [4, 5, 6], [7]],
        )
        self.assertEqual(self.metrics.spec_metrics, [(4, 3)])
        self.assertEqual(len(self.worker.verify_feeds), 1)

    def test_plain_step_logprobs(self):
        """The plain step's logprobs are [bs, 1], one per accepted token."""
        batch = self.decode_batch(return_logprob=True)
        result = plain_result([7, 8, 9, 10], logprobs=[-0.5, -1.0, -1.5, -2.0])
        self.processor.process_batch_result_decode(batch, result)
        self.assertEqual(
            [req.logprob.output_token_logprobs_val for req in batch.reqs],
            [[-0.5], [-1.0], [-1.5], [-2.0]],
        )
        self.assertEqual(
            [req.logprob.output_token_logprobs_idx for req in batch.reqs],
            [[7], [8], [9], [10]],
        )


if __name__ == "__main__":
    unittest.main()
