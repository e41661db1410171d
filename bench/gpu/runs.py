"""A GPU run's measured rows — bench_gpu.py's and llama-bench's (`bench-*.json` in a results folder) — with each
configuration's rounds folded into one row: its median TPOT, the rounds' TPOTs beside it. Two configurations are
told apart only where their rounds do not overlap; the run's noise is what one round of demo-fine-xl showed on the
H200 (two rows that made the same plans 14.1 and 9.3 ms), so a single round orders nothing it cannot.

Used by report.py (the table and plot), gpu_profile.py (the 100% rows), sim_check.py (simulated against the
median, and the ranking) and acceptance.py (issue 52's targets). A row is held against its replay with what each
mechanism did in both (`acted`): where one computed on the host, substituted or prefetched and the other never did,
the two made different plans (the 2026-11-27 run's cpu-assist and presched rows, whose engine priced no load then).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

KEY = ("model", "engine", "mode", "tier", "budget", "batch")  # what makes two rows the same configuration


def load(folder: Path) -> tuple[str, list[dict]]:
    """(the device's name, every measured row of `folder`'s bench-*.json — or bench-*/rows.json, as run.sh leaves
    them before they are filed — rounds apart, errors left out)."""
    device, rows = "", []
    for path in sorted([*folder.glob("bench-*.json"), *folder.glob("bench-*/rows.json")]):
        data = json.loads(path.read_text())
        device = data.get("device", device)
        rows += [r for r in data["rows"] if "tpot_s" in r]
    return device, rows


def key(row: dict) -> tuple:
    return tuple(row.get(k) for k in KEY)


def fold(rows: list[dict]) -> list[dict]:
    """One row a configuration, in the order each was first seen: the round whose TPOT is the median's (the lower
    of the two middle ones for an even count) with `tpot_s` the median itself, `decode_tokens_per_s` from it, and
    `tpot_rounds_s` every round's TPOT, sorted."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    out = []
    for members in groups.values():
        members = sorted(members, key=lambda r: r["tpot_s"])
        tpots = [r["tpot_s"] for r in members]
        median = statistics.median(tpots)
        row = dict(members[(len(members) - 1) // 2])
        row.pop("round", None)
        row.update(tpot_s=median, decode_tokens_per_s=row.get("batch", 1) / median, tpot_rounds_s=tpots)
        out.append(row)
    return out


def rounds(row: dict) -> list[float]:
    return row.get("tpot_rounds_s") or [row["tpot_s"]]


def apart(a: dict, b: dict) -> bool:
    """Whether every round of one ran faster than every round of the other (a single round each: always)."""
    ra, rb = rounds(a), rounds(b)
    return max(ra) < min(rb) or max(rb) < min(ra)


def spread(row: dict) -> str:
    """'73.1' for one round, '73.1 (71.9-74.0)' for several: milliseconds."""
    r = rounds(row)
    ms = f"{row['tpot_s'] * 1e3:.1f}"
    return ms if len(r) == 1 else f"{ms} ({r[0] * 1e3:.1f}-{r[-1] * 1e3:.1f})"


def ranking(pairs: list[tuple[str, dict, float]]) -> dict:
    """Simulated order against measured over (name, measured row, simulated TPOT): each pair of names whose
    measured rounds are apart is `alike` where the simulator orders them the same, else `swapped`; pairs within
    the rounds' spread are `unresolved` (the measurement orders nothing there)."""
    alike, swapped, unresolved = [], [], []
    for i, (na, ra, sa) in enumerate(pairs):
        for nb, rb, sb in pairs[i + 1:]:
            if not apart(ra, rb):
                unresolved.append((na, nb))
            elif (ra["tpot_s"] < rb["tpot_s"]) == (sa < sb):
                alike.append((na, nb))
            else:
                swapped.append((na, nb) if ra["tpot_s"] < rb["tpot_s"] else (nb, na))  # (measured faster first)
    return {"alike": alike, "swapped": swapped, "unresolved": unresolved,
            "measured": [n for n, r, _ in sorted(pairs, key=lambda p: p[1]["tpot_s"])],
            "simulated": [n for n, _, s in sorted(pairs, key=lambda p: p[2])]}


# what a mechanism did over the measured call, by the name a row counts it under (bench_gpu.py's rows: the decode
# steps' host runs and substituted assignments, the whole call's prefetches issued) and the replay's
ACTS = {"host runs": ("host_runs", "sim_host_runs"), "substituted": ("substituted", "sim_substituted"),
        "prefetched": ("prefetches_issued", "sim_prefetches_issued")}


def acted(row: dict, sim: dict) -> dict[str, list]:
    """Each mechanism's count in the measured row and in its replay, [real, sim] (real None where the row does not
    say), where either did something: a replay that computes on the host where the GPU run never did compares two
    plans, not the simulator's prices."""
    row = {**row, "prefetches_issued": (row.get("prefetches") or {}).get("issued")}
    sim = {**sim, "sim_prefetches_issued": sim["sim_prefetches"]["issued"]}
    counts = {name: [row.get(real), sim[simmed]] for name, (real, simmed) in ACTS.items()}
    return {name: pair for name, pair in counts.items() if any(pair)}


def acted_alone(pair: list) -> bool:
    """Whether a mechanism acted in one of the two, [real, sim], and not at all in the other (the row saying so)."""
    real, sim = pair
    return real is not None and (real == 0) != (sim == 0)


def plans_differ(acts: dict[str, list]) -> bool:
    return any(map(acted_alone, acts.values()))


def acts_in_words(acts: dict[str, list], alone: bool = False) -> str:
    """`acts` in a few words ('host runs 0 / 816'); `alone`: only the mechanisms that acted in one of the two."""
    shown = {name: pair for name, pair in acts.items() if not alone or acted_alone(pair)}
    return ", ".join(f"{name} {'?' if real is None else real} / {sim}" for name, (real, sim) in shown.items()) or "-"
