"""How the load-aware configs' records compare with the static configs': the issue's
targets, and the disable threshold the static records suggest."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from sweep.configs import KNOWN_CONFIGS
from sweep.records import finished, steady_decode

# Issue targets for a load-aware config: (what, minimum ratio).
TARGETS = (
    ("every C: vs max(nospec, always on)", 0.97),
    ("C >= N: vs nospec", 0.98),
    ("ramp: vs the better static config", 1.05),
    ("KV tokens: vs always on", 0.97),
    # The server-logged decode throughput of plain steps, at a running batch >= N.
    ("plain step: vs nospec at the same batch", 0.98),
)
# A ratio, and where it was lowest ("C=16", "batch 64"; None: a single value).
Ratio = Tuple[float, Optional[str]]


def disable_threshold_of(record: dict) -> int:
    """The smallest running batch that may run plain steps (1 for auto)."""
    flags = record["server_args"]
    value = flags[flags.index("--speculative-disable-batch-threshold") + 1]
    return 1 if value == "auto" else int(value)


def lowest_ratio(
    mine: Dict[int, float], reference: Dict[int, float], min_key: int
) -> Optional[Tuple[float, int]]:
    """(the lowest mine / reference over the keys >= min_key both have, its key)."""
    ratios = [
        (v / reference[k], k)
        for k, v in mine.items()
        if k >= min_key and k in reference
    ]
    return min(ratios) if ratios else None


def labelled(ratio: Optional[Tuple[float, int]], label: str) -> Optional[Ratio]:
    return None if ratio is None else (ratio[0], f"{label}{ratio[1]}")


def output_tok_s_by_c(record: dict) -> Dict[int, float]:
    return {p["concurrency"]: p["output_tok_s"] for p in record["points"]}


def best_by_c(references: List[dict]) -> Dict[int, float]:
    """The best tok/s of references at each concurrency all of them measured."""
    by_c = [output_tok_s_by_c(r) for r in references]
    return {c: max(ref[c] for ref in by_c) for c in set.intersection(*map(set, by_c))}


def worst_ratio(
    record: dict, references: List[dict], min_concurrency: int = 0
) -> Optional[Ratio]:
    """The lowest tok/s ratio to the best of references over the concurrencies
    every record measured."""
    return labelled(
        lowest_ratio(output_tok_s_by_c(record), best_by_c(references), min_concurrency),
        "C=",
    )


def load_aware_records(records: List[dict]) -> List[dict]:
    """The records of load-aware configs (configs no longer known are left out)."""
    return [
        r
        for r in records
        if (config := KNOWN_CONFIGS.get(r["config"])) is not None and config.load_aware
    ]


def static_references(record: dict, by_name: Dict[str, dict]) -> List[dict]:
    """A load-aware record's references, nospec and its always-on config, or []
    while either is missing: its envelope is the best of the two at each C."""
    always_on = KNOWN_CONFIGS[record["config"]].always_on
    statics = [by_name.get("nospec"), by_name.get(always_on)]
    return statics if all(statics) else []


def plain_decode_by_batch(record: dict) -> Dict[int, float]:
    return {
        d["batch"]: d["tok_s"] for d in steady_decode(record) if d["mode"] == "plain"
    }


def worst_plain_step_ratio(record: dict, nospec: dict) -> Optional[Ratio]:
    """The lowest ratio of the record's plain-step decode throughput to nospec's,
    at the running batch sizes >= N that both logged."""
    return labelled(
        lowest_ratio(
            plain_decode_by_batch(record),
            plain_decode_by_batch(nospec),
            disable_threshold_of(record),
        ),
        "batch ",
    )


def target_ratios(record: dict, by_name: Dict[str, dict]) -> List[Optional[Ratio]]:
    """The load-aware record's ratio for each of TARGETS (None: a reference is missing)."""
    nospec = by_name.get("nospec")
    always_on = by_name.get(KNOWN_CONFIGS[record["config"]].always_on)
    statics = static_references(record, by_name)

    def ramp(r: dict) -> float:
        return r["ramp"]["output_tok_s"]

    return [
        worst_ratio(record, statics) if statics else None,
        worst_ratio(record, [nospec], disable_threshold_of(record)) if nospec else None,
        (
            (ramp(record) / max(ramp(r) for r in statics), None)
            if statics and all(map(finished, [record, *statics]))
            else None
        ),
        (
            (record["kv_capacity_tokens"] / always_on["kv_capacity_tokens"], None)
            if always_on
            else None
        ),
        worst_plain_step_ratio(record, nospec) if nospec else None,
    ]


def crossover_concurrency(nospec: dict, always_on: dict) -> Optional[int]:
    """The lowest C from which no speculation stays at least as fast as always_on
    (at every larger C both measured): the disable threshold this data suggests.
    None: speculation was faster at the largest C."""
    nospec_by_c, spec_by_c = output_tok_s_by_c(nospec), output_tok_s_by_c(always_on)
    crossover = None
    for c in sorted(set(nospec_by_c) & set(spec_by_c), reverse=True):
        if nospec_by_c[c] < spec_by_c[c]:
            break
        crossover = c
    return crossover


def suggested_threshold(nospec: dict, always_on: dict) -> Tuple[Optional[int], str]:
    """The disable threshold the two static configs' points suggest (None: none
    does), and why."""
    c = crossover_concurrency(nospec, always_on)
    if c is None:
        return None, "speculation was faster at the largest C measured"
    if c == min(p["concurrency"] for p in always_on["points"]):
        return None, "no speculation was as fast at every C: speculation does not pay"
    return c, f"no speculation is as fast from C={c} on: disable threshold {c}"


def suggested_thresholds(records: List[dict]) -> str:
    by_name = {r["config"]: r for r in records}
    if "nospec" not in by_name:
        return ""
    lines = []
    for name in sorted({c.always_on for c in KNOWN_CONFIGS.values() if c.load_aware}):
        if name not in by_name:
            continue
        _, advice = suggested_threshold(by_name["nospec"], by_name[name])
        gain = ramp_gain_of_switching(by_name["nospec"], by_name[name])
        if gain is not None:
            advice += (
                f"; the faster of the two in each ramp phase would give {gain:.2f}x"
                " the better of them on the ramp"
            )
        lines.append(f"- {name}: {advice}\n")
    return "".join(lines)


def ramp_gain_of_switching(nospec: dict, always_on: dict) -> Optional[float]:
    """What a server running the faster of the two configs in every ramp phase would
    gain over the better of them on the whole ramp, estimated from their points at the
    phases' concurrencies (phases last equally long); an estimate, since a ramp phase
    is not a steady closed loop at its C. None: no ramp, or a phase's concurrency was
    not measured."""
    if not finished(nospec):
        return None
    phases = [phase["concurrency"] for phase in nospec["ramp"]["phases"]]
    by_c = [output_tok_s_by_c(nospec), output_tok_s_by_c(always_on)]
    if not phases or any(c not in r for r in by_c for c in phases):
        return None
    faster_each_phase = sum(max(r[c] for r in by_c) for c in phases)
    better_static = max(sum(r[c] for c in phases) for r in by_c)
    return faster_each_phase / better_static if better_static else None
