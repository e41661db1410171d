"""Decode with each prefetch configuration against none, side by side in one run, on the 12 MiB-expert demo models.

For each model and expert budget, every configuration (none, and each prefetch stage with the stacked-gates
predictor; a configuration written STAGE:oracle uses the perfect predictor instead, the true routing of the same
run, recorded by none's run — exact mode makes every run route alike; STAGE:PREDICTOR@POLICY names the eviction policy too, e.g.
none:smoe-lookahead@lru+predicted) runs in a fresh process, in rounds: round r runs them all in a rotated order, so a drift of the disk
or the CPU during the run spreads over every configuration. Reported per configuration: the median TPOT over the
rounds, its ratio to none's, the hit rate (a prefetch counts only if it landed in time), the prefetches issued,
used in time, late and wasted, the expert bytes read per token, and the share of the measured call during which
the disk had a read running (near 100%, the run is I/O-bound and prefetching can only add reads).

    python bench/bench_prefetch.py                           # table on stdout, JSON + PNG in bench/out/
    python bench/bench_prefetch.py --models demo-deep-xl --budgets 25% --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from common import add_run_options, grouped_bars, model_panels, run_child, save_panels  # noqa: E402

from moetier.plan.step import LayerHook  # noqa: E402

MODELS = ("demo-deep-xl", "demo-fine-xl")
CONFIGS = ("none", "hobbit", "smoe", "comoe", "presched")
PROMPTS = ROOT / "prompts" / "mixed.txt"


class RouteLog(LayerHook):
    """A layer hook keeping every (step, layer)'s topk_ids: the truth an oracle run is handed. It hears routes
    alone, so a step whose every expert is resident still skips planning beside it (it is told the routes)."""

    needs_plans = False

    def __init__(self) -> None:
        self.routes: dict[tuple[int, int], object] = {}

    def on_route(self, route, gate_input) -> None:
        self.routes[(route.step, route.layer)] = route.topk_ids.copy()


def child(cfg: dict) -> dict:
    """One configuration, in its own process: warm the cache on one prompt, measure on the rest of the text."""
    import pickle

    from moetier.config import MemoryBudget
    from moetier.engine.engine import Engine, EngineConfig
    from moetier.predict.oracle import OraclePredictor
    from moetier.resolve import resolve_model
    from moetier.store.store import Store

    spec, _, policy = cfg["prefetch"].partition("@")
    stage, _, predictor = spec.partition(":")
    predictor = predictor or ("none" if stage == "none" else cfg["predictor"])
    store = Store(resolve_model(cfg["model"], progress=False))
    config = EngineConfig(expert_memory=MemoryBudget.parse(cfg["budget"]), policy=policy or cfg["policy"],
                          prefetch=stage,
                          predictor=predictor, predict_distance=cfg["distance"], verify_checksums=cfg["verify"])
    oracle = None
    if predictor == "oracle":
        routes = pickle.loads(Path(cfg["routes"]).read_bytes())
        spec = store.spec
        oracle = OraclePredictor(spec.moe_layers, spec.num_experts, spec.top_k, lambda s, layer: routes[(s, layer)],
                                 cfg["distance"])
    engine = Engine(store, config, predictor=oracle)
    log = RouteLog()
    baseline = cfg["prefetch"] == "none"
    if baseline:
        engine.executor.layer_step.hooks.append(log)
    lines = [line for line in PROMPTS.read_text().splitlines() if line.strip()]
    warm = engine.tokenizer.encode(lines[0])
    prompt = engine.tokenizer.encode(" ".join(lines[1:]))[:cfg["prompt_len"]]
    with engine:
        engine.generate([warm], max_new_tokens=cfg["warmup_tokens"], ignore_eos=True)
        busy = engine.reader.activity()[0]
        stats = engine.generate([prompt], max_new_tokens=cfg["tokens"], ignore_eos=True).stats
        wall = stats["ttft_s"] + stats["tpot_s"] * (stats["new_tokens"] - 1)
        stats["disk_busy_share"] = (engine.reader.activity()[0] - busy) / wall  # the disk's time with a read running
    if baseline:
        Path(cfg["routes"]).write_bytes(pickle.dumps(log.routes))
    return stats


def plot(rows: list[dict], path: Path) -> None:
    fig, panels = model_panels(rows, 5.5, 4)
    for ax, model, mine in panels:
        grouped_bars(ax, mine, "budget", "prefetch", lambda r: r["tpot_s"] * 1e3)
        ax.set_xlabel("expert budget")
        ax.set_title(model)
    save_panels(fig, "moetier decode with prefetching (stacked-gates predictor), median TPOT", path, 8)


def share(prefetches: dict, key: str) -> str:
    return f"{prefetches[key] / prefetches['issued']:.0%}" if prefetches["issued"] else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(ap)
    ap.set_defaults(budgets="50%,25%")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--configs", default=",".join(CONFIGS), help="prefetch stages (none is the baseline)")
    ap.add_argument("--predictor", default="stacked-gates")
    ap.add_argument("--distance", type=int, default=2, help="MoE layers ahead the predictor scores")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                    help="checksum each blob's first read, as the engine does (~0.2 ms of CPU per 12 MiB expert "
                         "with zlib-ng; --no-verify measures the reads alone)")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from moetier.progress import tqdm

    models, budgets, configs = args.models.split(","), args.budgets.split(","), args.configs.split(",")
    if "none" not in configs:
        configs.insert(0, "none")
    args.out.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(models) * len(budgets) * len(configs) * args.rounds, desc="bench", unit="run")
    rows = []
    for model in models:
        for budget in budgets:
            runs: dict[str, list[dict]] = {c: [] for c in configs}
            for r in range(args.rounds):
                order = configs[r % len(configs):] + configs[:r % len(configs)]  # rotated each round
                if r == 0:
                    order.sort(key=lambda c: c != "none")  # but none first: the oracles need its routes
                for config in order:
                    cfg = dict(model=model, budget=budget, policy=args.policy, prefetch=config,
                               predictor=args.predictor, distance=args.distance, tokens=args.tokens,
                               warmup_tokens=args.warmup_tokens, prompt_len=args.prompt_len,
                               routes=str(args.out / f"routes-{model}.pkl"), verify=args.verify)
                    runs[config].append(run_child(__file__, cfg))
                    bar.update()
            base = statistics.median(s["tpot_s"] for s in runs["none"])
            for config, stats in runs.items():
                tpot = statistics.median(s["tpot_s"] for s in stats)
                pf = {k: sum(s["prefetches"][k] for s in stats) / len(stats) for k in stats[0]["prefetches"]}
                rows.append(dict(model=model, budget=budget, prefetch=config, tpot_s=tpot, ratio=tpot / base,
                                 tpot_runs_s=[s["tpot_s"] for s in stats],
                                 hit_rate=statistics.median(s["decode_hit_rate"] for s in stats),
                                 expert_bytes_per_token=statistics.median(s["expert_bytes_per_token"] for s in stats),
                                 disk_busy_share=statistics.median(s["disk_busy_share"] for s in stats),
                                 prefetches=pf))
    bar.close()
    args.out.mkdir(parents=True, exist_ok=True)
    report = dict(policy=args.policy, predictor=args.predictor, distance=args.distance, rounds=args.rounds,
                  verify_checksums=args.verify,
                  tokens=args.tokens, warmup_tokens=args.warmup_tokens, prompt_len=args.prompt_len, rows=rows)
    (args.out / "prefetch.json").write_text(json.dumps(report, indent=1))
    plot(rows, args.out / "prefetch.png")
    print(f"{'model':>13} {'budget':>6} {'configuration':>34} {'TPOT ms':>8} {'vs none':>8} {'hit':>6} {'MiB/tok':>8} "
          f"{'disk busy':>9} {'issued':>7} {'in time':>8} {'late':>6} {'wasted':>7}")
    for r in rows:
        pf = r["prefetches"]
        print(f"{r['model']:>13} {r['budget']:>6} {r['prefetch']:>34} {r['tpot_s'] * 1e3:8.1f} {r['ratio'] - 1:+8.1%} "
              f"{r['hit_rate']:6.1%} {r['expert_bytes_per_token'] / 2**20:8.1f} {r['disk_busy_share']:9.0%} "
              f"{pf['issued']:7.0f} "
              f"{share(pf, 'used'):>8} {share(pf, 'late'):>6} {share(pf, 'wasted'):>7}")
    print(f"wrote {args.out / 'prefetch.json'} and {args.out / 'prefetch.png'}")


if __name__ == "__main__":
    main()
