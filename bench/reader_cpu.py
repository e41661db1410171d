"""What an expert read costs the CPU: the process's CPU time per blob read through the engine's reader, with the
first-read checksum and without, one blob at a time (as a layer's single miss is read), in alternating rounds.

On a 2-core machine that CPU comes out of the compute whenever a read runs beside it (a prefetch), which is why
the simulator's `this-machine` profile carries it (`cpu_s_per_byte`, measured by `moetier calibrate`).

    python bench/reader_cpu.py                       # demo-deep-xl, 96 blobs, 2 rounds each way
    python bench/reader_cpu.py --model demo-fine-xl --blobs 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def measure(store, blobs, verify: bool) -> tuple[float, float]:
    """(CPU s, wall s) per blob, reading `blobs` one after another through a fresh reader (every read a first)."""
    from moetier.engine.slots import HostSlots
    from moetier.store.reader import ExpertReader

    pool = HostSlots(store.native_layout, 2)
    with ExpertReader(store.path, verify=verify, manifest=store.manifest) as reader:
        cpu, wall = time.process_time(), time.perf_counter()
        for i, blob in enumerate(blobs):
            reader.submit(blob, pool.views[i % 2], pool.completions[i % 2])
            pool.completions[i % 2].wait()
        return (time.process_time() - cpu) / len(blobs), (time.perf_counter() - wall) / len(blobs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo-deep-xl")
    ap.add_argument("--blobs", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    from moetier.resolve import resolve_model
    from moetier.store.store import Store

    store = Store(resolve_model(args.model))
    blobs = list(store.manifest.blobs)[:args.blobs]
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(args.rounds):
        for verify in (True, False):
            runs[verify].append(measure(store, blobs, verify))
    mib = blobs[0].length / 2**20
    rows = [{"verify": v, "cpu_ms": statistics.median(c for c, _ in r) * 1e3,
             "wall_ms": statistics.median(w for _, w in r) * 1e3, "blob_mib": mib} for v, r in runs.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reader_cpu.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                          "rows": rows}, indent=1))
    print(f"{args.model}, {len(blobs)} blobs of {mib:.1f} MiB, median of {args.rounds} rounds")
    print(f"{'checksum':>9} {'CPU ms/blob':>12} {'wall ms/blob':>13}")
    for r in rows:
        print(f"{'on' if r['verify'] else 'off':>9} {r['cpu_ms']:12.2f} {r['wall_ms']:13.2f}")
    print(f"json: {args.out / 'reader_cpu.json'}")


if __name__ == "__main__":
    main()
