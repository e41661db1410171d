"""No second copy on disk: a linked store (the experts read where they lie in the checkpoint's safetensors files)
against a copied one, on the same OLMoE-1B-7B-shaped weights.

The synthetic store (bench_offload.py writes it on first use) is the copied store; it is exported to a Hugging
Face folder (one safetensors file per layer, experts per-expert gate/up/down, as the hub's OLMoE checkpoint is)
and converted again without --copy. Reports what that conversion wrote and how long it took, then decode TPOT at
each budget on both stores, each run a fresh process, the stores alternating and the order turning every round.

    python bench/bench_linked.py [--budgets 25%,100%] [--rounds 3]

Writes OUT/linked.json and OUT/linked.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT / "peers")]
from bench_offload import SYNTH, store_of  # noqa: E402
from common import OUT, run_child  # noqa: E402

from moetier.paths import default_cache_dir  # noqa: E402

WORK = default_cache_dir() / "bench" / "linked"


def disk_bytes(path: Path) -> int:
    """Bytes the folder takes on disk (allocated blocks, as `du` counts them)."""
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def child(cfg: dict) -> dict:
    import random

    from moetier import Engine

    engine = Engine.from_pretrained(cfg["store"], expert_memory=cfg["budget"], progress=False)
    if cfg["budget"] == "100%":
        engine.preload()
    rng = random.Random(0)
    warm, prompt = ([rng.randrange(engine.spec.vocab_size) for _ in range(16)] for _ in range(2))
    engine.generate([warm], max_new_tokens=cfg["tokens"], ignore_eos=True)
    stats = engine.generate([prompt], max_new_tokens=cfg["tokens"], ignore_eos=True).stats
    engine.close()
    return {k: stats[k] for k in ("tpot_s", "tpot_p50_s", "decode_hit_rate", "expert_bytes_per_token")}


def linked_store(copied: Path) -> tuple[Path, dict]:
    """The linked store of the same weights, made once: (its path, what making it took)."""
    from export import export_hf

    hf = export_hf(copied, WORK / "hf")
    store = WORK / "store"
    facts_file = WORK / "conversion.json"
    if not (store / "manifest.json").exists():
        t0 = time.perf_counter()
        subprocess.run(["moetier", "convert", "--force", str(hf), str(store)], check=True)
        facts_file.write_text(json.dumps(dict(seconds=time.perf_counter() - t0, store_bytes=disk_bytes(store),
                                              checkpoint_bytes=disk_bytes(hf))))
    return store, json.loads(facts_file.read_text())


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = list(dict.fromkeys(r["budget"] for r in rows))
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for i, kind in enumerate(("copied", "linked")):
        ys = [next(r["tpot_s"] * 1e3 for r in rows if r["budget"] == b and r["store"] == kind) for b in budgets]
        ax.bar([j + (i - 0.5) * 0.4 for j in range(len(budgets))], ys, 0.4, label=f"{kind} store")
    ax.set_xticks(range(len(budgets)), budgets)
    ax.set_xlabel("expert budget")
    ax.set_ylabel("TPOT, ms (median)")
    ax.set_title("OLMoE-1B-7B-shaped: experts copied vs read in place", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--budgets", default="25%,100%")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    copied = store_of(SYNTH)
    linked, made = linked_store(copied)
    print(f"linked conversion: {made['store_bytes'] / 2**30:.2f} GiB written in {made['seconds']:.0f} s "
          f"(the checkpoint: {made['checkpoint_bytes'] / 2**30:.1f} GiB; the copied store: "
          f"{disk_bytes(copied) / 2**30:.1f} GiB)", flush=True)
    stores = {"copied": copied, "linked": linked}
    runs = {(b, k): [] for b in args.budgets.split(",") for k in stores}
    for r in range(args.rounds):
        for budget in args.budgets.split(","):
            kinds = list(stores) if r % 2 == 0 else list(stores)[::-1]
            for kind in kinds:
                out = run_child(__file__, dict(store=str(stores[kind]), budget=budget, tokens=args.tokens))
                runs[(budget, kind)].append(out)
                print(f"round {r + 1} {budget:>5} {kind}: TPOT {out['tpot_s'] * 1e3:.1f} ms, hit "
                      f"{out['decode_hit_rate']:.1%}", flush=True)
    rows = []
    for (budget, kind), outs in runs.items():
        rows.append(dict(budget=budget, store=kind, tpot_s=statistics.median(o["tpot_s"] for o in outs),
                         tpot_runs_s=[o["tpot_s"] for o in outs],
                         hit_rate=statistics.median(o["decode_hit_rate"] for o in outs)))
    for budget in args.budgets.split(","):
        a, b = (next(r for r in rows if r["budget"] == budget and r["store"] == k) for k in ("copied", "linked"))
        print(f"{budget:>5}: copied {a['tpot_s'] * 1e3:.1f} ms, linked {b['tpot_s'] * 1e3:.1f} ms "
              f"(linked / copied {b['tpot_s'] / a['tpot_s']:.3f})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "linked.json").write_text(json.dumps(dict(conversion=made, rows=rows), indent=1))
    plot(rows, args.out / "linked.png")
    print(f"wrote {args.out / 'linked.json'} and {args.out / 'linked.png'}")


if __name__ == "__main__":
    main()
