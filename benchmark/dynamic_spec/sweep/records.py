"""The records of raw.json, one per config: what they hold, and how a new one merges
into those already there."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from typing import Dict, Iterator, List, Optional

from sweep.configs import KNOWN_CONFIGS


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


def merge_record(out_dir: str, record: dict, header: Dict[str, str]) -> List[dict]:
    """Add a config's record to raw.json, replacing an older record of it unless
    that one is finished and this one is not; returns all records, in config order.
    A record of --decode-rate (its decode_rate section only, no points) replaces
    only the older record's section; a sweep's record keeps it."""
    name = record["config"]
    with results_lock(out_dir):
        records = records_by_config(out_dir)
        older = records.get(name)
        if "points" not in record:
            base = older or {"config": name, **header}
            records[name] = {**base, "decode_rate": {**record["decode_rate"], **header}}
        elif finished(record) or not finished(older):
            kept = {k: v for k, v in (older or {}).items() if k == "decode_rate"}
            records[name] = {**kept, **record, **header}
        merged = sorted(records.values(), key=config_order)
        with open(os.path.join(out_dir, "raw.json"), "w") as f:
            json.dump({"model": header["model"], "records": merged}, f, indent=1)
    return merged


def config_order(record: dict) -> int:
    """A record's place: KNOWN_CONFIGS' order, then the configs that no longer exist
    (in earlier results: the v1 worker's)."""
    order = list(KNOWN_CONFIGS)
    name = record["config"]
    return order.index(name) if name in order else len(order)


@contextlib.contextmanager
def results_lock(out_dir: str) -> Iterator[None]:
    """Held while reading or writing raw.json: invocations on other GPUs may write it."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "raw.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def records_by_config(out_dir: str) -> Dict[str, dict]:
    """The records in out_dir's raw.json by config name ({} before the first);
    under results_lock."""
    raw_path = os.path.join(out_dir, "raw.json")
    if not os.path.exists(raw_path):
        return {}
    with open(raw_path) as f:
        return {r["config"]: r for r in json.load(f)["records"]}
