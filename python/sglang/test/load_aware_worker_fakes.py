"""Stand-in target and draft models for CPU tests of the load-aware plain steps
(srt/speculative/load_aware.py and load_aware_v2.py). They record what each
forward receives; the kernels themselves need a GPU."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Dict, List
from unittest import TestCase, mock

import torch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative import load_aware_draft
from sglang.srt.speculative.eagle_info import EagleDraftInput

# What the stand-ins return for request i of a step.
FIRST_TARGET_TOKEN = 40
FIRST_DRAFT_TOKEN = 3
DRAFT_HIDDEN_SIZE = 8
DRAFT_VOCAB_SIZE = 32
KV_ONLY_HIDDEN_OFFSET = 0.5


class RecordingTarget:
    """The target worker: request i gets hidden state i (every dim) and the next
    token FIRST_TARGET_TOKEN + i; records each forward and the graph runner it ran
    under."""

    def __init__(self, hidden_size: int):
        self.hidden_size = hidden_size
        self.model_runner = SimpleNamespace(
            mambaish_config=None, graph_runner="verify-graphs"
        )
        self.calls: List[Dict[str, Any]] = []

    def forward_batch_generation(self, batch) -> GenerationBatchResult:
        self.calls.append(
            dict(
                input_ids=batch.input_ids.clone(),
                spec_info=batch.spec_info,
                capture_hidden_mode=batch.capture_hidden_mode,
                seq_lens=batch.seq_lens.tolist(),
                forward_mode=batch.forward_mode,
                graph_runner=self.model_runner.graph_runner,
            )
        )
        bs = len(batch.seq_lens)
        return GenerationBatchResult(
            logits_output=SimpleNamespace(
                hidden_states=torch.arange(bs)[:, None]
                .float()
                .repeat(1, self.hidden_size)
            ),
            next_token_ids=torch.arange(bs) + FIRST_TARGET_TOKEN,
        )


class KVOnlyDraftModel:
    """A draft model that writes its KV cache alone: records each call and returns
    the target hidden state's first DRAFT_HIDDEN_SIZE dims + KV_ONLY_HIDDEN_OFFSET as
    the projected hidden state."""

    def __init__(self):
        self.calls: List[Dict[str, Any]] = []

    def can_write_kv_cache_only(self) -> bool:
        return True

    def write_kv_cache_only(
        self, input_ids, positions, hidden_states, out_cache_loc, token_to_kv_pool
    ) -> torch.Tensor:
        self.calls.append(
            dict(
                input_ids=input_ids.tolist(),
                positions=positions.tolist(),
                hidden_states=hidden_states,
                out_cache_loc=out_cache_loc.tolist(),
                token_to_kv_pool=token_to_kv_pool,
            )
        )
        return hidden_states[:, :DRAFT_HIDDEN_SIZE] + KV_ONLY_HIDDEN_OFFSET


class RecordingDraft:
    """The draft model runner of the catch-up, run eagerly (--disable-cuda-graph):
    request i's top-1 is FIRST_DRAFT_TOKEN + i, its hidden state all ones. Records
    the attention metadata planned (forward mode, spec_info) and each draft-extend
    preparation. kv_only: the model is a KVOnlyDraftModel (``model``)."""

    def __init__(
        self, test: TestCase, req_to_token_pool, num_reqs: int, kv_only: bool = False
    ):
        self.metadata_calls: List[tuple] = []
        self.extend_calls: List[Dict[str, Any]] = []
        self.model = KVOnlyDraftModel() if kv_only else SimpleNamespace()
        logits = torch.zeros(num_reqs, DRAFT_VOCAB_SIZE)
        logits[torch.arange(num_reqs), torch.arange(num_reqs) + FIRST_DRAFT_TOKEN] = 10
        attention = SimpleNamespace(
            init_forward_metadata=lambda forward_batch: self.metadata_calls.append(
                (forward_batch.forward_mode, forward_batch.spec_info)
            )
        )
        self.runner = SimpleNamespace(
            model=self.model,
            token_to_kv_pool="draft-kv-pool",
            tp_group=None,
            server_args=SimpleNamespace(disable_cuda_graph=True),
            req_to_token_pool=req_to_token_pool,
            device="cpu",
            init_new_workspace=False,
            _get_attention_backend=lambda init_new_workspace: attention,
            forward=lambda forward_batch, skip_attn_backend_init: SimpleNamespace(
                logits_output=SimpleNamespace(
                    next_token_logits=logits,
                    hidden_states=torch.ones(num_reqs, DRAFT_HIDDEN_SIZE),
                )
            ),
        )
        self._patch(test)

    def _prepare_extend(self, extend_input, batch, predict, num_draft_tokens, *args):
        self.extend_calls.append(
            dict(
                hidden_states=extend_input.hidden_states,
                predict=predict.tolist(),
                num_draft_tokens=num_draft_tokens,
                seq_lens=batch.seq_lens.tolist(),
                seq_lens_cpu=batch.seq_lens_cpu.tolist(),
                seq_lens_sum=batch.seq_lens_sum,
                out_cache_loc=batch.out_cache_loc.tolist(),
            )
        )
        return SimpleNamespace(
            forward_mode=ForwardMode.DRAFT_EXTEND_V2, spec_info=extend_input
        )

    def _patch(self, test: TestCase) -> None:
        recorder = self

        def prepare_extend(extend_input, *args):
            return recorder._prepare_extend(extend_input, *args)

        patches = [
            mock.patch.object(torch.Tensor, "record_stream", lambda self, s: None),
            mock.patch.object(
                EagleDraftInput,
                "prepare_for_extend_to_fill_draft_kvcache",
                prepare_extend,
            ),
            mock.patch.object(
                load_aware_draft,
                "speculative_moe_backend_context",
                contextlib.nullcontext,
            ),
            mock.patch.object(
                load_aware_draft,
                "speculative_moe_a2a_backend_context",
                contextlib.nullcontext,
            ),
        ]
        for patcher in patches:
            patcher.start()
            test.addCleanup(patcher.stop)


def no_tp_context(group) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()
