"""The benchmark's HTTP client: streamed /generate requests of token ids, what each
one measured, and the prompts they send.

Not upstream's ``async_request_sglang_generate`` (sglang.benchmark.serving): it reads
its settings from that module's command-line ``args``, opens a session per request,
parses every streamed chunk, and keeps neither the verify counts nor the per-chunk
timeline a point needs. Upstream's client runs beside this one instead
(bench_serving.py, ``--bench-serving``)."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import time
from typing import List, Optional, Tuple

import aiohttp
from sglang.test.synthetic_spec_models import region_prompt


@dataclasses.dataclass
class RequestResult:
    ttft: float
    latency: float
    output_tokens: int
    verify_ct: int
    correct_drafts: int
    finished_at: float


def client_session() -> aiohttp.ClientSession:
    """A session that opens as many connections as there are clients (aiohttp's default
    of 100 would cap every point above C=100) and lets idle ones go before the server
    does (its keep-alive is SGLANG_TIMEOUT_KEEP_ALIVE, 5 s): a connection the server
    closes just as a request reuses it fails that request."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2)
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=3600)
    )


# A streamed chunk's output token count, found from the end (its output_ids, before
# meta_info, grow with every chunk).
COMPLETION_TOKENS_KEY = b'"completion_tokens":'
COMPLETION_TOKENS_VALUE = re.compile(rb"\s*(\d+)")


def streamed_tokens(chunk: bytes) -> Optional[int]:
    """completion_tokens of a streamed chunk (None: it has none, e.g. an error)."""
    at = chunk.rfind(COMPLETION_TOKENS_KEY)
    if at < 0:
        return None
    match = COMPLETION_TOKENS_VALUE.match(chunk, at + len(COMPLETION_TOKENS_KEY))
    return int(match.group(1)) if match else None


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    input_ids: List[int],
    output_len: int,
    timeline: Optional[List[Tuple[float, int]]] = None,
) -> RequestResult:
    """timeline: gets (time, output tokens so far) of every streamed chunk."""
    payload = {
        "input_ids": input_ids,
        "sampling_params": {
            "temperature": 0.0,
            "max_new_tokens": output_len,
            "ignore_eos": True,
        },
        "stream": True,
    }
    start = time.perf_counter()
    ttft, last = None, b""
    async with session.post(f"{url}/generate", json=payload) as response:
        response.raise_for_status()
        # The last chunk's meta_info holds the request's totals: parse only that one.
        async for line in response.content:
            if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            if timeline is not None:
                tokens = streamed_tokens(line)
                if tokens is not None:
                    timeline.append((time.perf_counter(), tokens))
            last = line
    end = time.perf_counter()
    if not last:
        raise RuntimeError(f"{url}/generate streamed no output")
    chunk = json.loads(last[5:])
    if "error" in chunk:
        raise RuntimeError(f"{url}/generate: {chunk['error']['message']}")
    meta = chunk["meta_info"]
    return RequestResult(
        ttft=ttft,
        latency=end - start,
        output_tokens=meta["completion_tokens"],
        verify_ct=meta.get("spec_verify_ct", 0),
        correct_drafts=meta.get("spec_num_correct_drafts", 0),
        finished_at=end,
    )


class PromptSource:
    """Random prompts of input_len tokens, a new one each time: no request finds its
    prompt in the radix cache, so every request prefills its whole input. Sources of
    the same seed give the same prompts in the same order."""

    def __init__(self, input_len: int, seed: int = 0) -> None:
        self.input_len = input_len
        self.rng = random.Random(seed)

    def __iter__(self) -> "PromptSource":
        return self

    def __next__(self) -> List[int]:
        return [self.rng.randrange(3, 1000) for _ in range(self.input_len)]

    def take(self, num: int) -> List[List[int]]:
        return [next(self) for _ in range(num)]


class ContentShiftPrompts(PromptSource):
    """Prompts of a content-shift pair: for ``shift_after`` seconds from the first
    one, prompts whose continuations the draft predicts well (region 0), then
    ones it predicts badly (region 1)."""

    def __init__(
        self, input_len: int, spec: dict, shift_after: float, seed: int = 0
    ) -> None:
        super().__init__(input_len, seed)
        self.spec = spec
        self.shift_after = shift_after
        self.started: Optional[float] = None

    def __next__(self) -> List[int]:
        now = time.perf_counter()
        self.started = self.started if self.started is not None else now
        region = 0 if now - self.started < self.shift_after else 1
        return region_prompt(self.spec, region, self.input_len, self.rng)
