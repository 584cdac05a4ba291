"""The records of raw.json, one per config: what they hold, and how a new one merges
into those already there."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import statistics
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from sweep.configs import KNOWN_CONFIGS
from sweep.stats import median_with_spread


def finished(record: Optional[dict]) -> bool:
    """Whether a record holds all of its config's measurements (the ramp runs last)."""
    return record is not None and "ramp" in record


def swept_records(records: List[dict]) -> List[dict]:
    """The records of sweeps (not only a --decode-rate section)."""
    return [r for r in records if "points" in r]


# Fewer steady log windows at a batch size are too noisy to show or compare.
MIN_DECODE_WINDOWS = 3


def steady_decode(record: dict) -> List[dict]:
    return [
        d for d in record.get("decode_tok_s", []) if d["windows"] >= MIN_DECODE_WINDOWS
    ]


def record_key(record: dict) -> str:
    """A record's key in raw.json: its config, and beyond the first the fresh
    server of --servers it was measured in."""
    server = record.get("server", 0)
    return f"{record['config']}@server{server}" if server else record["config"]


def merge_record(
    out_dir: str,
    record: dict,
    header: Dict[str, str],
    then: Optional[Callable[[List[dict]], None]] = None,
) -> List[dict]:
    """Add a config's record to raw.json, replacing an older record of it (of the
    same server) unless that one is finished and this one is not; returns all
    records, in config order, after passing them to ``then`` while raw.json is
    still locked (so that what it writes from them is not overtaken by an older
    merge). A record of --decode-rate (its decode_rate section only, no points)
    replaces only the older record's section; a sweep's record keeps it."""
    name = record_key(record)
    with results_lock(out_dir):
        records = records_by_config(out_dir)
        older = records.get(name)
        if "points" not in record:
            base = older or {"config": record["config"], **header}
            records[name] = {**base, "decode_rate": {**record["decode_rate"], **header}}
        elif finished(record) or not finished(older):
            kept = {k: v for k, v in (older or {}).items() if k == "decode_rate"}
            records[name] = {**kept, **record, **header}
        merged = sorted(records.values(), key=config_order)
        with open(os.path.join(out_dir, "raw.json"), "w") as f:
            json.dump({"model": header["model"], "records": merged}, f, indent=1)
        if then is not None:
            then(merged)
    return merged


def config_order(record: dict) -> Tuple[int, int]:
    """A record's place: KNOWN_CONFIGS' order, then the configs that no longer exist
    (in earlier results: the v1 worker's); a config's servers in turn."""
    order = list(KNOWN_CONFIGS)
    name = record["config"]
    return order.index(name) if name in order else len(order), record.get("server", 0)


def pooled_records(records: List[dict]) -> List[dict]:
    """One record per config. A config measured in several fresh servers
    (--servers) gets, at each concurrency all of them measured, for the ramp and
    the content shift, and for bench_serving's runs there, the median of the
    servers' output tok/s, their min and max as the spread and each server's
    value; its other fields are its first server's."""
    by_config: Dict[str, List[dict]] = {}
    for record in records:
        by_config.setdefault(record["config"], []).append(record)
    return [
        group[0] if len(group) == 1 else pooled_record(group)
        for group in by_config.values()
    ]


def pooled_record(group: List[dict]) -> dict:
    first = group[0]
    pooled = {k: v for k, v in first.items() if k not in ("ramp", "content_shift")}
    pooled["servers"] = len(group)
    if all("points" in r for r in group):
        by_c = [{p["concurrency"]: p for p in r["points"]} for r in group]
        pooled["points"] = [
            pooled_rates([points[p["concurrency"]] for points in by_c])
            for p in first["points"]
            if all(p["concurrency"] in points for points in by_c)
        ]
    for section in ("ramp", "content_shift"):
        if all(section in r for r in group):
            pooled[section] = pooled_rates([r[section] for r in group])
    return pooled


def pooled_rates(measured: List[dict]) -> dict:
    """A point (or phased load) measured in several servers: the first's fields,
    with output tok/s the median over the servers and their min and max, each
    phase's the median over the servers, and so for bench_serving's where every
    server ran it (else none: one server's beside the others' median would read as
    a ratio of the two)."""
    first = {k: v for k, v in measured[0].items() if k != "bench_serving"}
    pooled = {
        **first,
        **median_with_spread(m["output_tok_s"] for m in measured),
        "servers_output_tok_s": [m["output_tok_s"] for m in measured],
    }
    if all("phases" in m for m in measured):
        pooled["phases"] = [
            {
                **phase,
                "output_tok_s": statistics.median(
                    p["output_tok_s"] for p in server_phases
                ),
            }
            for phase, *server_phases in zip(
                first["phases"], *(m["phases"] for m in measured)
            )
        ]
    if all("bench_serving" in m for m in measured):
        pooled["bench_serving"] = pooled_rates([m["bench_serving"] for m in measured])
    return pooled


@contextlib.contextmanager
def results_lock(out_dir: str) -> Iterator[None]:
    """Held while reading or writing raw.json: invocations on other GPUs may write it."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "raw.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def front_end(server_args: List[str]) -> Tuple[bool, str]:
    """What a server's front end does with each streamed chunk: whether it skipped
    the tokenizer, and its stream interval."""
    interval = "1"
    if "--stream-interval" in server_args:
        interval = server_args[server_args.index("--stream-interval") + 1]
    return "--skip-tokenizer-init" in server_args, interval


def incomparable_records(
    out_dir: str, server_args: List[str], workload: Optional[dict]
) -> List[str]:
    """The records in out_dir's raw.json that do not compare with a run of servers
    with server_args whose clients send workload (None: not a sweep): their servers
    ran another front end (at a few hundred clients it can pace a point), or their
    clients another workload. A record from before a field was kept matches it."""
    ours = front_end(server_args)

    def differs(section: dict) -> bool:
        if "server_args" in section and front_end(section["server_args"]) != ours:
            return True
        return workload is not None and section.get("workload", workload) != workload

    with results_lock(out_dir):
        records = records_by_config(out_dir)
    return sorted(
        key
        for key, record in records.items()
        if differs(record) or differs(record.get("decode_rate", {}))
    )


def records_by_config(out_dir: str) -> Dict[str, dict]:
    """The records in out_dir's raw.json by record_key (the config name for its
    first server; {} before the first record); under results_lock."""
    raw_path = os.path.join(out_dir, "raw.json")
    if not os.path.exists(raw_path):
        return {}
    with open(raw_path) as f:
        return {record_key(r): r for r in json.load(f)["records"]}
