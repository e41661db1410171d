"""Memory pressure while generating: moetier inside a memory cgroup, another process in the same cgroup taking memory,
holding it, and giving it back — with `--adapt` (the cache follows the memory: CoMoE Eq. 17) and without (the budget
as asked). Per run: the engine's expert-cache slots and decode speed over time, each adapt decision, the other
process's memory, and how each process ended. JSON and a plot.

    python bench/bench_adapt.py                              # demo-deep-xl at 30%, a taker of 60% of the cache
    python bench/bench_adapt.py --model demo-deep-xl --share 50% --take 0.8

Needs a memory cgroup (v1 or v2) it can create (root, or a delegated subtree); says so and stops where there is none.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "peers"))
from cage import make_cage  # noqa: E402

from bench.common import OUT, write_results  # noqa: E402

ENGINE = """
import sys, time, json
from moetier import Engine
engine = Engine.from_pretrained(sys.argv[1], expert_memory=sys.argv[2], progress=False, adapt=sys.argv[3] == "1")
engine.generate([[5, 9, 17]], max_new_tokens=4)
print(json.dumps({"ready": engine.executor.slots, "slot_bytes": engine.executor.residency.entry_bytes[
    engine.executor.precision]}), flush=True)
start, end = time.monotonic(), time.monotonic() + float(sys.argv[4])
while time.monotonic() < end:
    out = engine.generate([[5, 9, 17, 33]], max_new_tokens=8, ignore_eos=True)
    print(json.dumps({"t": time.monotonic() - start, "slots": engine.executor.slots,
                      "tok_s": out.stats["decode_tokens_per_s"]}), flush=True)
print(json.dumps({"done": True}), flush=True)
"""
TAKER = """
import sys, time
step, total, hold, pause = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
blocks, start = [], time.monotonic()
while sum(map(len, blocks)) < total:
    b = bytearray(step)
    b[::4096] = b"\\1" * len(range(0, step, 4096))
    blocks.append(b)
    print(time.monotonic() - start, sum(map(len, blocks)), flush=True)
    time.sleep(pause)
time.sleep(hold)
print(time.monotonic() - start, 0, flush=True)
"""


def usage(cage) -> int:
    return int((cage.path / ("memory.current" if cage.v2 else "memory.usage_in_bytes")).read_text())


def set_limit(cage, limit: int) -> None:
    (cage.path / ("memory.max" if cage.v2 else "memory.limit_in_bytes")).write_text(str(limit))


def run(model: str, share: str, adapt: bool, seconds: float, margin: int, take: float, hold: float) -> dict:
    cage = make_cage(64 << 30, "moetier-bench-adapt")
    if isinstance(cage, str):
        raise SystemExit(f"bench_adapt: {cage}")
    try:
        engine = subprocess.Popen(cage.wrap([sys.executable, "-c", ENGINE, model, share, "1" if adapt else "0",
                                             str(seconds)]), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = json.loads(engine.stdout.readline())
        errors: list[str] = []  # (read as it comes: a full pipe would stop the engine)
        reader = threading.Thread(target=lambda: errors.extend(engine.stderr), daemon=True)
        reader.start()
        set_limit(cage, usage(cage) + margin)
        cache = ready["ready"] * ready["slot_bytes"]
        taker = subprocess.run(cage.wrap([sys.executable, "-c", TAKER, str(16 << 20), str(margin + int(take * cache)),
                                          str(hold), "0.25"]), capture_output=True, text=True)
        taken = [(float(t), int(b)) for t, b in (line.split() for line in taker.stdout.splitlines())]
        out = engine.stdout.read()
        engine.wait(timeout=seconds + 120)
        reader.join(timeout=10)
    finally:
        cage.remove()
    points = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {"adapt": adapt, "engine_exit": engine.returncode, "taker_exit": taker.returncode,
            "slots_at_start": ready["ready"], "slot_bytes": ready["slot_bytes"], "margin": margin,
            "points": [p for p in points if "t" in p], "finished": any(p.get("done") for p in points),
            "taken": taken, "decisions": [line.strip() for line in errors if line.startswith("moetier: adapt:")]}


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for r in runs:
        label = "--adapt" if r["adapt"] else f"budget as asked (exit {r['engine_exit']})"
        t = [p["t"] for p in r["points"]]
        axes[0].step(t, [p["slots"] for p in r["points"]], where="post", label=label)
        axes[1].plot(t, [p["tok_s"] for p in r["points"]], label=label)
    taken = runs[0]["taken"]
    ax2 = axes[0].twinx()
    ax2.step([t for t, _ in taken], [b / 2**20 for _, b in taken], where="post", color="grey", ls=":")
    ax2.set_ylabel("taken by the other process (MiB)", color="grey")
    axes[0].set_ylabel("expert cache slots")
    axes[1].set_ylabel("decode tok/s")
    axes[1].set_xlabel("seconds since start (the other process starts at ~0)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo-deep-xl")
    ap.add_argument("--share", default="30%", help="the engine's --expert-memory")
    ap.add_argument("--take", type=float, default=0.6, help="the other process takes the margin and this share of "
                                                             "the cache's bytes")
    ap.add_argument("--margin-mib", type=int, default=256, help="memory free beside the engine when it starts")
    ap.add_argument("--hold", type=float, default=10.0, help="seconds the other process holds what it took")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the engine generates")
    ap.add_argument("--out", type=Path, default=OUT / "adapt")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from moetier.resolve import resolve_model

    model = str(resolve_model(args.model))  # (built into the cache once, outside the cgroup)
    runs = []
    for adapt in (True, False):
        r = run(model, args.share, adapt, args.seconds, args.margin_mib << 20, args.take, args.hold)
        runs.append(r)
        slots = [p["slots"] for p in r["points"]]
        print(f"{'--adapt' if adapt else 'as asked'}: engine exit {r['engine_exit']}, other process exit "
              f"{r['taker_exit']}, slots {r['slots_at_start']} -> min {min(slots, default=0)} -> end "
              f"{slots[-1] if slots else '-'}, {len(r['decisions'])} decisions", flush=True)
    write_results(args.out, "bench_adapt", args, {"runs": runs}, plot, runs)


if __name__ == "__main__":
    main()
