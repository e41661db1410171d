"""The default eviction policy against LRU and the other cheap online policies, in the engine: decode TPOT and hit
rate per model and expert budget, the policies alternated in fresh processes round by round (common.rotated_rounds),
so a drift of the machine spreads over all of them. JSON and a plot.

    python bench/bench_policy.py                                   # demo-deep, demo-fine: 8%..50%, 3 rounds
    python bench/bench_policy.py --models /path/to/model.gguf --budgets 2GiB --rounds 2 --random-prompts
    python bench/bench_policy.py --replot RUN1.json RUN2.json --out DIR   # their rows in one plot

A trained model is prompted with real text (bench/prompts/mixed.txt: warm-up on the first line, measured on the
rest); `--random-prompts` gives random ids, for random-weight models (their routing is near uniform whatever the
text).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from common import OUT, grouped_bars, model_panels, rotated_rounds, save_panels, write_results  # noqa: E402

PROMPTS = ROOT / "prompts" / "mixed.txt"


def child(cfg: dict) -> dict:
    """One policy at one budget, in its own process: the statistics of the measured call."""
    from moetier import Engine

    engine = Engine.from_pretrained(cfg["model"], expert_memory=cfg["budget"], policy=cfg["config"], progress=False)
    if cfg["random_prompts"]:
        rng = random.Random(0)
        warm, prompt = ([rng.randrange(engine.spec.vocab_size) for _ in range(cfg["prompt_len"])] for _ in range(2))
    else:
        lines = [line for line in PROMPTS.read_text().splitlines() if line.strip()]
        warm, prompt = engine.tokenizer.encode(lines[0]), engine.tokenizer.encode(" ".join(lines[1:]))
        prompt = prompt[:cfg["prompt_len"]]
    engine.generate([warm], max_new_tokens=cfg["warmup_tokens"], ignore_eos=True)  # the cache's steady state
    stats = engine.generate([prompt], max_new_tokens=cfg["tokens"], ignore_eos=True).stats
    engine.close()
    return stats


def row(model: str, budget: str, policy: str, stats: list[dict]) -> dict:
    """One policy's row: the medians of its rounds, and every round's TPOT."""
    def median(key: str) -> float:
        return statistics.median(s[key] for s in stats)

    return dict(model=model, budget=budget, policy=policy, tpot_s=median("tpot_s"),
                tpot_runs_s=[s["tpot_s"] for s in stats], hit_rate=median("decode_hit_rate"),
                expert_bytes_per_token=median("expert_bytes_per_token"),
                runs_under_load=sum(bool(s.get("load", {}).get("under_load")) for s in stats))


def plot(rows: list[dict], path: Path) -> None:
    fig, panels = model_panels(rows, 4.6, 3.8)
    for ax, model, mine in panels:
        for x, r in grouped_bars(ax, mine, "budget", "policy", lambda r: r["tpot_s"] * 1e3):
            ax.text(x, r["tpot_s"] * 1e3, f"{r['hit_rate']:.0%}", ha="center", va="bottom", fontsize=6)
        ax.set_title(Path(model).name, fontsize=9)
        ax.set_xlabel("expert budget (hit rate above each bar)")
        ax.set_ylabel("decode TPOT, ms (median of rounds)")
    save_panels(fig, "eviction policies in the engine, alternated round by round", path)


def replotted(paths: list[Path]) -> list[dict]:
    """The rows of earlier runs, a (model, budget, policy) measured again keeping its later run's row."""
    rows = {}
    for path in paths:
        for r in json.loads(path.read_text())["rows"]:
            rows[r["model"], r["budget"], r["policy"]] = r
    return list(rows.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--models", default="demo-deep,demo-fine")
    ap.add_argument("--budgets", default="8%,15%,25%,50%")
    ap.add_argument("--policies", default="lru,comoe,lfu,fld")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96, help="measured tokens")
    ap.add_argument("--warmup-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--random-prompts", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT / "policy")
    ap.add_argument("--replot", nargs="+", type=Path, metavar="JSON",
                    help="plot the rows of these earlier runs' JSON together into OUT/bench_policy.png; run nothing")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.replot:
        args.out.mkdir(parents=True, exist_ok=True)
        plot(replotted(args.replot), args.out / "bench_policy.png")
        print(f"wrote {args.out / 'bench_policy.png'}")
        return
    from tqdm import tqdm

    models, budgets, policies = (s.split(",") for s in (args.models, args.budgets, args.policies))
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tqdm(total=len(models) * len(budgets) * len(policies) * args.rounds, desc="bench_policy", unit="run") as bar:
        for model in models:
            for budget in budgets:
                base = dict(model=model, budget=budget, tokens=args.tokens, warmup_tokens=args.warmup_tokens,
                            prompt_len=args.prompt_len, random_prompts=args.random_prompts)
                runs = rotated_rounds(__file__, policies, args.rounds, base, bar)
                rows += [row(model, budget, policy, stats) for policy, stats in runs.items()]
    base_of = {(r["model"], r["budget"]): r["tpot_s"] for r in rows if r["policy"] == policies[0]}
    print(f"{'model':>16} {'budget':>7} {'policy':>8} {'TPOT ms':>8} {'hit':>6} {'vs ' + policies[0]:>8}")
    for r in rows:
        r["speedup_over_first"] = base_of[r["model"], r["budget"]] / r["tpot_s"]
        print(f"{Path(r['model']).name[:16]:>16} {r['budget']:>7} {r['policy']:>8} {r['tpot_s'] * 1e3:8.2f} "
              f"{r['hit_rate']:6.1%} {r['speedup_over_first']:7.2f}x")
    write_results(args.out, "bench_policy", args, {"rows": rows}, plot, rows)


if __name__ == "__main__":
    main()
