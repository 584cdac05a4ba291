"""results.md: the markdown tables of the records."""

from __future__ import annotations

import collections
import statistics
from typing import Callable, Dict, List, Optional, Sequence

from sweep.records import finished, steady_decode, swept_records
from sweep.stats import (
    QUIET_BIN_SECONDS,
    QUIET_RATE_FRACTION,
    rate_at_same_kv_tokens,
)
from sweep.targets import (
    TARGETS,
    load_aware_records,
    suggested_thresholds,
    target_ratios,
)


def results_markdown(records: List[dict], title: str) -> str:
    swept = swept_records(records)
    sections = [f"# {title}\n\n"]
    if swept:
        sections.append(markdown_table(swept))
    decode = decode_table(swept)
    if decode:
        sections += [
            "\nDecode tok/s the servers logged at a steady running batch (median over"
            " log windows without prefill; plain steps unless marked):\n\n",
            decode,
        ]
    second_client = bench_serving_table(swept)
    if second_client:
        sections += [
            "\nOutput tok/s of upstream's bench_serving (--bench-serving) at the same C"
            " against the same servers, median [min-max], and its ratio to ours:\n\n",
            second_client,
        ]
    latencies = latency_table(swept)
    if latencies:
        sections += [
            "\nMean TTFT / mean latency per request, ms (our client; a closed loop's"
            " output tok/s is C times the output tokens over the mean latency):\n\n",
            latencies,
        ]
    pace = client_pace_table(swept)
    if pace:
        sections += [
            "\nRequests in flight (mean) / the client's worst event-loop lag, ms (a"
            " closed loop below C, or a lag of a step or more, is the client's, not the"
            " server's) / quiet share: the share of the window, in"
            f" {QUIET_BIN_SECONDS} s bins, that streamed under {QUIET_RATE_FRACTION:.0%}"
            " of its mean token rate (where requests that started together are"
            " prefilled together, in waves) / the server's front end: the share of a"
            " core that its process (HTTP server and tokenizer manager) kept busy over"
            " the point (near 100%, it sets the pace):\n\n",
            pace,
        ]
    rates = decode_rate_table(records)
    if rates:
        sections += [
            "\nDecode rate at a steady running batch (--decode-rate): output tok/s of"
            " B requests decoding at once, from the moment the last of them streamed"
            " its first token to the first finish (no prefill, no finish in between);"
            " median of the repeats [min-max], the ratio to nospec's, the decode"
            " tok/s the server logged at that batch, the output tok/s of the"
            " window's first and last tenth against its middle eight (edges), the"
            " middle eight's output tok/s against nospec's, and"
            " the share of a core the server's front end kept busy in the windows"
            " (near 100%, it sets the pace):\n\n",
            rates,
        ]
    if swept:
        sections += [
            "\nTargets (output tok/s ratios; N: the config's disable threshold):\n\n",
            targets_table(swept),
            "\nThresholds suggested by these points (against nospec):\n\n",
            suggested_thresholds(swept),
        ]
    sections.append("\nCommands (commit):\n\n")
    sections += [
        f"- {r['config']}: `{r['command']}` ({r['commit']}{code_note(r)})\n"
        for r in swept
    ]
    sections += [
        f"- {r['config']} decode rate: `{d['command']}` ({d['commit']}{code_note(d)})\n"
        for r in records
        for d in [r.get("decode_rate")]
        if d
    ]
    return "".join(sections)


def rate_with_spread(measured: dict) -> str:
    """Median output tok/s, with [min-max] where repeats differed."""
    low, high = measured.get("output_tok_s_min"), measured.get("output_tok_s_max")
    spread = f" [{low:.0f}-{high:.0f}]" if low is not None and high > low else ""
    return f"{measured['output_tok_s']:.0f}{spread}"


def markdown_cell(point: dict) -> str:
    share = point["spec_step_share"]
    if share is None:
        return rate_with_spread(point)
    return f"{rate_with_spread(point)} ({share:.0%} spec)"


def table_head(columns: Sequence[str]) -> List[str]:
    """A markdown table's header and separator lines."""
    return ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]


def targets_table(records: List[dict]) -> str:
    by_name = {r["config"]: r for r in records}
    lines = table_head(["config", *(f"{what} >= {low}" for what, low in TARGETS)])
    for record in load_aware_records(records):
        cells = []
        for (_, low), ratio in zip(TARGETS, target_ratios(record, by_name)):
            if ratio is None:
                cells.append("-")
                continue
            value, where = ratio
            at = f" at {where}" if where is not None else ""
            cells.append(f"{value:.2f}{at} {'met' if value >= low else 'missed'}")
        lines.append(f"| {record['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown_table(records: List[dict]) -> str:
    concurrency = sorted({p["concurrency"] for r in records for p in r["points"]})
    lines = table_head(
        ["config", "KV tokens", "ramp tok/s", *(f"C={c}" for c in concurrency)]
    )
    for record in records:
        by_c = {p["concurrency"]: p for p in record["points"]}
        cells = [markdown_cell(by_c[c]) if c in by_c else "-" for c in concurrency]
        ramp = rate_with_spread(record["ramp"]) if finished(record) else "-"
        lines.append(
            f"| {record['config']} | {record['kv_capacity_tokens']} | {ramp} | "
            + " | ".join(cells)
            + " |"
        )
    return (
        "\n".join(lines)
        + "\n\nCells: output tok/s, median of the repeats [min-max] (share of decode"
        + " steps that speculated, where the server counts it); -: not measured (a run"
        + " cut off).\n"
        + repeated_prompts_note(records)
        + content_shift_table(records)
    )


def content_shift_table(records: List[dict]) -> str:
    shifted = [r for r in records if "content_shift" in r]
    if not shifted:
        return ""
    lines = [
        "\nContent shift (--content-shift): output tok/s of C clients, easy prompts "
        "then hard ones, one phase each; median of the repeats [min-max]. With "
        "--bench-serving, upstream's bench_serving then ran the same shift (a run on "
        "easy prompts, at once a run on hard ones):\n",
        *table_head(["config", "C", "total", "easy phase", "hard phase"]),
    ]
    for record in shifted:
        shift = record["content_shift"]
        lines.append(
            f"| {record['config']} | {shift['concurrency']} | {phased(shift)} |"
        )
        if "bench_serving" in shift:
            lines.append(
                f"| {record['config']}, bench_serving | {shift['concurrency']} | "
                f"{phased(shift['bench_serving'])} |"
            )
    return "\n".join(lines) + "\n"


def phased(measured: dict) -> str:
    """Total and per-phase output tok/s cells of a phased load."""
    phases = (f"{p['output_tok_s']:.0f}" for p in measured["phases"])
    return " | ".join([rate_with_spread(measured), *phases])


def repeated_prompts_note(records: List[dict]) -> str:
    """Names the records measured before every request got a new prompt: theirs
    repeated, and the radix cache spared many of their requests the prefill (their
    ramp also drained every phase, and their client kept at most 100 requests in
    flight)."""
    repeated = [r["config"] for r in records if not r.get("unique_prompts")]
    if not repeated:
        return ""
    return (
        "Measured over repeated prompts (many requests found theirs in the radix cache"
        " and skipped the prefill), with a ramp that drained every phase and at most"
        " 100 requests in flight at C=128 and 256:"
        f" {', '.join(repeated)}. Their output tok/s does not compare with that of rows"
        " where every request had a new prompt.\n"
    )


def decode_table(records: List[dict]) -> str:
    """Server-logged decode tok/s at running batch sizes equal to the points' C."""
    logged = [r for r in records if steady_decode(r)]
    if not logged:
        return ""
    batches = sorted({p["concurrency"] for r in records for p in r["points"]})
    lines = table_head(["config", *(f"batch {bs}" for bs in batches)])
    for record in logged:
        by_batch: Dict[int, List[str]] = collections.defaultdict(list)
        for d in steady_decode(record):
            suffix = " spec" if d["mode"] == "spec" else ""
            by_batch[d["batch"]].append(f"{d['tok_s']:.0f}{suffix}")
        cells = [" / ".join(by_batch[bs]) or "-" for bs in batches]
        lines.append(f"| {record['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def points_table(records: List[dict], key: str, cell: Callable[[dict], str]) -> str:
    """A row per record with points that have ``key``, a column per C: ``cell`` of
    the point there, or -."""
    measured = [r for r in records if any(key in p for p in r["points"])]
    if not measured:
        return ""
    concurrency = sorted({p["concurrency"] for r in measured for p in r["points"]})
    lines = table_head(["config", *(f"C={c}" for c in concurrency)])
    for record in measured:
        by_c = {p["concurrency"]: p for p in record["points"] if key in p}
        cells = [cell(by_c[c]) if c in by_c else "-" for c in concurrency]
        lines.append(f"| {record['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def bench_serving_table(records: List[dict]) -> str:
    def cell(point: dict) -> str:
        theirs = point["bench_serving"]
        ratio = theirs["output_tok_s"] / point["output_tok_s"]
        return f"{rate_with_spread(theirs)}, {ratio:.2f}x"

    return points_table(records, "bench_serving", cell)


def latency_table(records: List[dict]) -> str:
    return points_table(
        records,
        "latency_mean_ms",
        lambda p: f"{p['ttft_mean_ms']:.0f} / {p['latency_mean_ms']:.0f}",
    )


def client_pace_table(records: List[dict]) -> str:
    """Where each figure came later, older records lack it."""
    shares = ("quiet_share", "front_end_cpu_share")
    return points_table(
        records,
        "requests_in_flight",
        lambda p: " / ".join(
            [
                f"{p['requests_in_flight']:.1f}",
                f"{p['client_loop_lag_max_ms']:.0f}",
                *(f"{p[share]:.0%}" for share in shares if share in p),
            ]
        ),
    )


def decode_rate_table(records: List[dict]) -> str:
    measured = [r for r in records if "decode_rate" in r]
    if not measured:
        return ""
    point_at = {
        (r["config"], p["batch"]): p
        for r in measured
        for p in r["decode_rate"]["points"]
    }
    batches = sorted({b for _, b in point_at})
    nospec_windows = next(
        (
            r["decode_rate"].get("decode_windows")
            for r in measured
            if r["config"] == "nospec"
        ),
        None,
    )
    lines = table_head(["config", *(f"batch {b}" for b in batches)])
    for record in measured:
        section = record["decode_rate"]
        by_batch = {p["batch"]: p for p in section["points"]}
        # Both modes at a batch: the one logged in more windows.
        logged = {
            d["batch"]: d["tok_s"]
            for d in sorted(steady_decode(section), key=lambda d: d["windows"])
        }
        cells = []
        for b in batches:
            if b not in by_batch:
                cells.append("-")
                continue
            cell = rate_with_spread(by_batch[b])
            nospec_point = point_at.get(("nospec", b))
            if nospec_point is not None:
                ratio = by_batch[b]["output_tok_s"] / nospec_point["output_tok_s"]
                cell += f", {ratio:.3f}x"
            if b in logged:
                cell += f" (log {logged[b]:.0f}{same_kv_tokens_note(section, nospec_windows, b)})"
            cell += edges_note(by_batch[b], nospec_point)
            if "front_end_cpu_share" in by_batch[b]:
                cell += f", front end {by_batch[b]['front_end_cpu_share']:.0%}"
            cells.append(cell)
        lines.append(f"| {record['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def middle_eight_rate(tenths: List[float]) -> float:
    return statistics.mean(tenths[1:-1])


def edges_note(point: dict, nospec_point: Optional[dict]) -> str:
    """The window's first and last tenth against its middle eight, median of the
    repeats, and the middle eight's rate against nospec's (mean of the repeats):
    whether a rate below the server's comes from the window's edges."""
    if "tenths_tok_s" not in point:
        return ""
    first, last = (
        statistics.median(t[i] / middle_eight_rate(t) for t in point["tenths_tok_s"])
        for i in (0, -1)
    )
    note = f", edges {first:.2f}x / {last:.2f}x"
    if point is not nospec_point and "tenths_tok_s" in (nospec_point or {}):
        middle, nospec_middle = (
            statistics.mean(map(middle_eight_rate, p["tenths_tok_s"]))
            for p in (point, nospec_point)
        )
        note += f", middle eight {middle / nospec_middle:.3f}x"
    return note


def same_kv_tokens_note(
    section: dict, nospec_windows: Optional[List[dict]], batch: int
) -> str:
    windows = section.get("decode_windows")
    if not windows or not nospec_windows or windows is nospec_windows:
        return ""
    ratio = rate_at_same_kv_tokens(windows, nospec_windows, batch)
    return "" if ratio is None else f", {ratio:.3f}x at nospec's KV tokens"


def code_note(record: dict) -> str:
    """Names the records whose server ran pristine upstream instead of the fork."""
    code = record.get("code", {})
    if code.get("sglang") != "pristine upstream":
        return ""
    return f"; the server ran pristine upstream, {code['wheel']}"
