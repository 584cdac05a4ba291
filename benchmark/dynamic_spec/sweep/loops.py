"""The load a measurement puts on a server: asyncio loops of streamed requests (closed,
steady, a batch decoding at once, a ramp of concurrencies) and what they count."""

from __future__ import annotations

import asyncio
import bisect
import gc
import math
import random
import time
from typing import (
    Awaitable,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Tuple,
    TypeVar,
)

from sweep.client import RequestResult, client_session, one_request
from sweep.stats import Run, quiet_share

T = TypeVar("T")


def run_load(load: Awaitable[T]) -> T:
    """asyncio.run(load) with Python's cyclic garbage collector paused. A loop keeps
    objects for every streamed chunk, and at a few hundred requests the collector's
    full passes over them stall the client's event loop for longer than a decode
    step, holding back the requests that replace finished ones. The loops make no
    garbage cycles that must be freed before they end."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return asyncio.run(load)
    finally:
        if was_enabled:
            gc.enable()


async def closed_loop(
    url: str,
    prompts: Iterable[List[int]],
    output_len: int,
    concurrency: int,
    length_spread: float = 0.0,
) -> List[RequestResult]:
    """concurrency workers issue the prompts back to back until they run out, each
    request for output_len tokens (output_lengths with length_spread)."""
    queue = iter(prompts)
    lengths = output_lengths(output_len, length_spread)
    results: List[RequestResult] = []
    async with client_session() as session:

        async def worker() -> None:
            for prompt in queue:
                length = next(lengths)
                results.append(await one_request(session, url, prompt, length))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def steady_loop(
    url: str,
    prompts: Iterable[List[int]],
    output_len: int,
    concurrency: int,
    window_seconds: float,
    length_spread: float = 0.0,
) -> Run:
    """A closed loop that does not run in waves: client i of C first generates
    ceil(output_len * (i + 1) / C) tokens, so its later requests, of output_len
    (output_lengths with length_spread), finish spread over a request's duration
    instead of together, and the loop never drains until the end. The window opens
    once every client has finished its first request and lasts window_seconds; it
    counts the output tokens streamed inside it (by the chunks' arrival: the requests
    still in flight when it closes finish faster, with no new requests beside them)
    and the latencies of the requests that finished inside it, the requests in flight
    (below C while clients are slow to send their next request), how late the
    client's event loop ran a ready task at worst (a stalled client sends nothing)
    and how much of the window streamed almost nothing (quiet_share)."""
    prompts = iter(prompts)
    lengths = output_lengths(output_len, length_spread)
    timed: List[RequestResult] = []
    timelines: List[List[Tuple[float, int]]] = []
    lags: List[Tuple[float, float]] = []
    staggered, closing = 0, False
    async with client_session() as session:

        async def streamed_request(length: int) -> RequestResult:
            timelines.append([])
            return await one_request(session, url, next(prompts), length, timelines[-1])

        async def client(slot: int) -> None:
            nonlocal staggered
            await streamed_request(math.ceil(output_len * (slot + 1) / concurrency))
            staggered += 1
            if staggered == concurrency:
                window_open.set()
            while not closing:
                timed.append(await streamed_request(next(lengths)))

        window_open = asyncio.Event()
        watcher = asyncio.create_task(sample_loop_lag(lags))
        clients = [asyncio.create_task(client(slot)) for slot in range(concurrency)]
        opened = asyncio.create_task(window_open.wait())
        await asyncio.wait([opened, *clients], return_when=asyncio.FIRST_COMPLETED)
        if not opened.done():
            await asyncio.gather(*clients)  # a client failed: raise its error
        start, cpu_start = time.perf_counter(), time.process_time()
        await asyncio.sleep(window_seconds)
        end, cpu = time.perf_counter(), time.process_time() - cpu_start
        closing = True
        watcher.cancel()
        await asyncio.gather(*clients)
    return Run(
        [r for r in timed if start <= r.finished_at < end],
        sum(tokens_by(t, end) - tokens_by(t, start) for t in timelines),
        end - start,
        cpu,
        in_flight=requests_in_flight(timed, start, end),
        loop_lag_max=max((lag for t, lag in lags if start <= t < end), default=0.0),
        quiet_share=quiet_share(timelines, start, end),
    )


def output_lengths(output_len: int, spread: float) -> Iterator[int]:
    """Endless output lengths: output_len, or with spread > 0 drawn uniformly from
    output_len * [1 - spread, 1 + spread]. With one length, requests that a stall
    lined up (sent together once it ended) finish together every request lifetime
    after it, and their replacements prefill together; varied lengths part them."""
    rng = random.Random(0)
    while True:
        if not spread:
            yield output_len
        else:
            yield max(1, round(output_len * rng.uniform(1 - spread, 1 + spread)))


# How often the client's event loop is asked to wake a probe task.
LAG_PROBE_SECONDS = 0.005


async def sample_loop_lag(lags: List[Tuple[float, float]]) -> None:
    """Until cancelled, (wake-up time, seconds late) of a task that asks to wake every
    LAG_PROBE_SECONDS: how long the event loop kept a ready task waiting."""
    while True:
        due = time.perf_counter() + LAG_PROBE_SECONDS
        await asyncio.sleep(LAG_PROBE_SECONDS)
        woke = time.perf_counter()
        lags.append((woke, woke - due))


def requests_in_flight(
    results: Iterable[RequestResult], start: float, end: float
) -> float:
    """The mean number of the requests in flight over [start, end)."""
    busy = sum(
        max(0.0, min(end, r.finished_at) - max(start, r.finished_at - r.latency))
        for r in results
    )
    return busy / (end - start)


async def decode_rate_loop(
    url: str,
    prompts: List[List[int]],
    output_len: int,
    front_end_cpu_seconds: Optional[Callable[[], float]] = None,
) -> Run:
    """len(prompts) requests at once, output_len tokens each: the output tokens they
    streamed between the moment the last of them streamed its first token (all
    prefilled, every one decoding) and the first one's last token (none finished),
    over that window. In it the server runs decode steps of exactly len(prompts)
    requests, with no prefill and no finish; tokens are counted from the chunks
    each request streamed by either end. With front_end_cpu_seconds, also the CPU
    seconds the server's front end used in the window: at a large batch it handles
    a chunk per request per step and can fall behind the decode steps."""
    timelines: List[List[Tuple[float, int]]] = [[] for _ in prompts]
    cpu_samples: List[Tuple[float, float]] = []
    began, cpu_began = time.perf_counter(), time.process_time()
    if front_end_cpu_seconds:
        sampler = asyncio.create_task(sample_cpu(front_end_cpu_seconds, cpu_samples))
    async with client_session() as session:
        results = await asyncio.gather(
            *(
                one_request(session, url, prompt, output_len, timeline)
                for prompt, timeline in zip(prompts, timelines)
            )
        )
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu_began
    if front_end_cpu_seconds:
        if sampler.done():  # it raised: its samples may not cover the window
            print(f"front end CPU not read: {sampler.exception()!r}", flush=True)
            cpu_samples.clear()
        else:
            sampler.cancel()
            cpu_samples.append((time.perf_counter(), front_end_cpu_seconds()))
    start = max(timeline[0][0] for timeline in timelines)
    end = min(timeline[-1][0] for timeline in timelines)
    if end <= start:
        raise RuntimeError(
            f"batch {len(prompts)}: a request finished before the last one started "
            f"decoding ({not_all_at_once(timelines, began, cpu_began)}); raise "
            "--decode-output-len, or find out why the server did not run them all at "
            "once"
        )
    tokens = sum(tokens_by(t, end) - tokens_by(t, start) for t in timelines)
    tenth_marks = [start + (end - start) * i / 10 for i in range(11)]
    # The client's CPU share over the whole run, for the window.
    return Run(
        results,
        tokens,
        end - start,
        cpu * (end - start) / wall,
        front_end_cpu=(
            value_at(cpu_samples, end) - value_at(cpu_samples, start)
            if cpu_samples
            else None
        ),
        tenths_tok_s=rates_between(timelines, tenth_marks),
    )


# How often decode_rate_loop reads the front end's CPU seconds.
CPU_SAMPLE_SECONDS = 0.1


async def sample_cpu(
    cpu_seconds: Callable[[], float], samples: List[Tuple[float, float]]
) -> None:
    """Until cancelled, (time, cpu_seconds()) every CPU_SAMPLE_SECONDS."""
    while True:
        samples.append((time.perf_counter(), cpu_seconds()))
        await asyncio.sleep(CPU_SAMPLE_SECONDS)


def value_at(samples: List[Tuple[float, float]], moment: float) -> float:
    """A sampled counter at moment, linear between the samples either side (the
    first or last sample's value outside them)."""
    times = [at for at, _ in samples]
    i = bisect.bisect_right(times, moment)
    if i == 0:
        return samples[0][1]
    if i == len(samples):
        return samples[-1][1]
    (t0, v0), (t1, v1) = samples[i - 1], samples[i]
    return v0 + (v1 - v0) * (moment - t0) / (t1 - t0)


def not_all_at_once(
    timelines: List[List[Tuple[float, int]]], began: float, cpu_began: float
) -> str:
    """What the timelines of a decode-rate run that never had every request
    decoding at once show: when the first one finished, with how many tokens, how
    many had started by then, and how busy the client was."""
    first_token = min(t[0][0] for t in timelines)
    finisher = min(timelines, key=lambda t: t[-1][0])
    first_end = finisher[-1][0]
    started = sum(t[0][0] <= first_end for t in timelines)
    cpu_share = (time.process_time() - cpu_began) / (time.perf_counter() - began)
    return (
        f"{first_end - first_token:.1f} s after the first token the first request "
        f"finished with {finisher[-1][1]} tokens, when {started} of {len(timelines)} "
        f"had streamed one; the last started after "
        f"{max(t[0][0] for t in timelines) - first_token:.1f} s; the client used "
        f"{cpu_share:.0%} of a core"
    )


def rates_between(
    timelines: List[List[Tuple[float, int]]], moments: List[float]
) -> List[float]:
    """The output tok/s the requests streamed between each two successive moments:
    whether a window's rate fell at its edges or throughout it."""
    streamed = [sum(tokens_by(t, moment) for t in timelines) for moment in moments]
    return [
        (streamed[i + 1] - streamed[i]) / (moments[i + 1] - moments[i])
        for i in range(len(moments) - 1)
    ]


def tokens_by(timeline: List[Tuple[float, int]], moment: float) -> int:
    """The output tokens a request had streamed by moment (its timeline is in
    time order)."""
    streamed = bisect.bisect_right(timeline, (moment, math.inf))
    return timeline[streamed - 1][1] if streamed else 0


async def ramp_loop(
    url: str,
    prompts: Iterable[List[int]],
    output_len: int,
    phases: Iterable[int],
    phase_seconds: float,
) -> Tuple[List[RequestResult], List[float]]:
    """A closed loop whose concurrency steps through phases without draining between
    them: at a phase's start, clients are added up to its concurrency, or those above
    it stop after the request they have in flight. prompts: an endless source.
    Returns (results, the phases' start times followed by the time the last request
    finished)."""
    prompts = iter(prompts)
    results: List[RequestResult] = []
    concurrency = 0
    async with client_session() as session:

        async def client(slot: int) -> None:
            while slot < concurrency:
                prompt = next(prompts)
                results.append(await one_request(session, url, prompt, output_len))

        clients: Dict[int, asyncio.Task] = {}
        starts: List[float] = []
        for phase_concurrency in phases:
            starts.append(time.perf_counter())
            concurrency = phase_concurrency
            for slot in range(concurrency):
                if slot not in clients or clients[slot].done():
                    clients[slot] = asyncio.create_task(client(slot))
            await asyncio.sleep(starts[0] + len(starts) * phase_seconds - starts[-1])
        concurrency = 0
        await asyncio.gather(*clients.values())
    return results, starts + [time.perf_counter()]
