"""Substitution and placement in the simulator, on the papers' machines (decode at batch 1; a trace carries no
batch boundaries):

1. SMoE's ablation (its Fig. 14), stepwise: base (LRU, exact) -> +CE (score-window eviction) -> +CR (the
   expert-cache router: substitution at the paper's α for the shape) -> +Pre (prefetch of top-score experts; the
   predictor is the trace's own routing made 18% wrong, the accuracy SMoE's Fig. 17 reports for its look-ahead) ->
   +BA (CPU-assisted loading: the two-pointer split of SMoE Alg. 2). On a6000 with Qwen2-57B-A14B's shape and on
   rtx3080ti with DeepSeek-MoE-16B's, each at the fast tier's room (`auto`, the paper's settings S3 and S1).
   Substitution needs every expert's router score, which the shared traces do not have: the routing is
   demo-deep's recorded on held-out text (full scores; 64 experts like both shapes), laid onto the shape's MoE
   layers cyclically (layer j takes demo-deep's layer j mod 12) with the shape's top-k re-selected from the
   scores.
2. PreScope's PreSched (cross-layer placement + its prefetch count) against greedy layer-by-layer placement
   (Eq. 5 alone, no prefetch), and against no placement, fp16 experts: v100-pcie3 and a100-pcie4 with Mixtral-8x7B (the shared
   real trace) and Qwen3-30B-A3B (a synthetic trace fitted to Qwen1.5-MoE's real one). The predictor is the trace's
   own routing made 6% wrong (LLaPor's top-4 accuracy is at least 94%, PreScope Table 3).
3. HOBBIT's CPU-GPU cooperative mode on rtx4090 with Mixtral-8x7B (fp16): every decode miss computed on the CPU,
   against GPU-centric loading; both start with the cache filled (HOBBIT places "a portion of experts" in GPU
   memory; the shared trace has no prompts to fill it, and in the cooperative mode only a prompt loads), with LFU
   (global LRU thrashes on a 32-layer cycle: every read evicts what the next token needs).

    moetier trace import data/traces/mixtral-8x7b --out bench/out/traces/mixtral        # once
    moetier trace import data/traces/qwen1.5-moe-a2.7b --out bench/out/traces/qwen15     # once
    moetier trace record --model demo-deep ... --out bench/out/traces/demo-deep-held-out           # (docs/traces.md)
    python bench/sim_smoe.py                                   # tables + JSON + PNG in bench/out/
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from common import OUT, save_figure  # noqa: E402

TRACES = ROOT / "out" / "traces"
SMOE_SETUPS = (("a6000", "qwen2-57b-a14b"), ("rtx3080ti", "deepseek-moe-16b"))
SMOE_STEPS = {  # step -> (policy, substitute, prefetch, placement)
    "base": ("lru", False, "none", "none"),
    "+CE": ("smoe-score", False, "none", "none"),
    "+CR": ("smoe-score", True, "none", "none"),
    "+Pre": ("smoe-score", True, "smoe", "none"),
    "+BA": ("smoe-score", True, "smoe", "smoe-two-pointer"),
}
PRESCHED_SETUPS = (("v100-pcie3", "mixtral-8x7b"), ("a100-pcie4", "mixtral-8x7b"), ("v100-pcie3", "qwen3-30b-a3b"),
                   ("a100-pcie4", "qwen3-30b-a3b"))
PRESCHED_ARMS = {  # arm -> (placement, prefetch, predictor distance: None for --presched-distance)
    "no placement": ("none", "none", 1), "greedy": ("greedy", "none", 1),
    "prescope p=1": ("prescope", "presched", 1),  # the next layer alone: no room for Q4's larger window
    "prescope": ("prescope", "presched", None)}
SMOE_PREDICTOR_ERROR, LLAPOR_ERROR = 0.18, 0.06


def score_oracle(trace, error: float, seed: int = 0):
    """A predictor of the next MoE layer's full router scores, read from `trace`: the truth for most tokens, for a
    share `error` of them another token's scores of that layer (a plausible, wrong routing). SMoE's look-ahead
    predicts scores, not just ids, and its prefetch needs them to tell top-score experts from low-score ones."""
    from moetier.predict.base import Predictor
    from moetier.sim.replay import steps

    rows = [r for _, r in steps(trace)]
    column = {layer: j for j, layer in enumerate(trace.layers)}
    rng = np.random.default_rng(seed)

    class ScoreOracle(Predictor):
        name = "score-oracle"

        def observe(self, layer, gate_input, route) -> None:
            self.step = route.step

        def predict(self, layer, gate_input):
            out = {}
            for f in self.future_layers(layer):
                mine = rows[self.step - 1]
                wrong = rng.random(len(mine)) < error
                picked = np.where(wrong, rng.integers(0, trace.num_tokens, len(mine)), mine)
                out[f] = trace.scores[picked, column[f]].astype(np.float32)  # [T, E]
            return out

    return ScoreOracle(trace.layers, trace.num_experts, trace.top_k, 1)


def retarget(trace, shape):
    """`trace`'s routing (with full scores) on `shape`'s MoE layers: layer j takes the trace's layer j mod L, the
    shape's top-k re-selected from the scores (weights: the scores themselves, as families without
    renormalisation weigh their experts)."""
    from moetier.trace.format import Trace

    cols = [j % len(trace.layers) for j in range(len(shape.moe_layers))]
    scores = trace.scores[:, cols].astype(np.float32)  # [N, L', E]
    ids = np.argsort(-scores, axis=-1, kind="stable")[..., :shape.top_k]
    weights = np.take_along_axis(scores, ids, axis=-1)
    return Trace(shape.name, shape.num_layers, shape.num_experts, shape.top_k, list(shape.moe_layers), trace.seq,
                 trace.pos, trace.phase, ids.astype(np.int16), weights.astype(np.float16),
                 scores=scores.astype(np.float16), source=f"{trace.model}'s routing laid onto {shape.name}",
                 synthetic=True, notes=[retarget.__doc__.split(":")[0]])


def synthetic_trace(shape, source, tokens: int):
    from moetier.trace.synthetic import fit_locality, generate

    fit = fit_locality(source)
    return generate(fit, shape.num_layers, shape.num_experts, shape.top_k, tokens, model=shape.name,
                    layers=list(shape.moe_layers))


def simulate_one(trace, shape, profile, budget, policy="lru", substitute=False, prefetch="none", placement="none",
                 error=0.0, preload=False, distance=1):
    from moetier.cache.policies import PolicyContext
    from moetier.plan.substitute import Substitution
    from moetier.sim.cost import CostModel
    from moetier.sim.predictors import trace_predictor
    from moetier.sim.profile import HardwareProfile
    from moetier.sim.replay import simulate, trace_policy
    from moetier.sim.sweep import budget_slots

    cost = CostModel.of(HardwareProfile.load(profile), shape)
    slots = budget_slots(budget, trace, cost)
    ctx = PolicyContext(slots, tuple(trace.layers), trace.num_experts, trace.top_k)
    predictor = None
    if prefetch != "none":
        predictor = score_oracle(trace, error) if trace.scores is not None else \
            trace_predictor("oracle", trace, distance, error_rate=error)
    sub = Substitution().resolved(shape.total_expert_params) if substitute else None
    result = simulate(trace, trace_policy(policy, ctx, trace), slots, cost, cost.precision, preload, prefetch=prefetch,
                      predictor=predictor, substitution=sub, placement=placement)
    return dict(profile=profile, shape=shape.name, budget=budget, slots=slots, policy=policy,
                alpha=sub.alpha if sub else None, prefetch=prefetch, placement=placement, **result.summary())


def main() -> None:
    from moetier.cli.models import model_shape
    from moetier.progress import tqdm
    from moetier.trace.format import Trace

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="smoe,presched,coop")
    ap.add_argument("--budgets", default="auto", help="SMoE's part: budgets (auto: the fast tier's room)")
    ap.add_argument("--presched-budgets", default="10%,25%")
    ap.add_argument("--coop-budgets", default="10%,20%,auto")
    ap.add_argument("--presched-distance", type=int, default=3,
                    help="PreSched's part: MoE layers ahead the predictor sees (its window grows to this, Q4)")
    ap.add_argument("--tokens", type=int, default=400, help="tokens of the synthetic Qwen3-30B trace")
    ap.add_argument("--demo-share", type=float, default=0.35,
                    help="SMoE's part: the share of demo-deep's trace replayed (its first prompts)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    parts = args.parts.split(",")
    rows = []
    shapes = {name: model_shape(name)[0] for name in ("qwen2-57b-a14b", "deepseek-moe-16b", "mixtral-8x7b",
                                                       "qwen3-30b-a3b")}
    mixtral = Trace.load(TRACES / "mixtral")
    if "smoe" in parts:
        demo = Trace.load(TRACES / "demo-deep-held-out")
        if args.demo_share < 1:
            demo = demo.split(args.demo_share)[0]
        budgets = args.budgets.split(",")
        for profile, name in tqdm(SMOE_SETUPS, desc="smoe ablation"):
            trace = retarget(demo, shapes[name])
            for budget in budgets:
                for step, (policy, sub, prefetch, placement) in SMOE_STEPS.items():
                    rows.append(dict(part="smoe", step=step, **simulate_one(
                        trace, shapes[name], profile, budget, policy, sub, prefetch, placement,
                        SMOE_PREDICTOR_ERROR)))
    if "presched" in parts:
        qwen3 = synthetic_trace(shapes["qwen3-30b-a3b"], Trace.load(TRACES / "qwen15"), args.tokens)
        traces = {"mixtral-8x7b": mixtral, "qwen3-30b-a3b": qwen3}
        for profile, name in tqdm(PRESCHED_SETUPS, desc="presched vs greedy"):
            shape = dataclasses.replace(shapes[name], precision="fp16")  # (a V100 has no bf16)
            for budget in args.presched_budgets.split(","):
                for arm, (placement, prefetch, distance) in PRESCHED_ARMS.items():
                    rows.append(dict(part="presched", step=arm, **simulate_one(
                        traces[name], shape, profile, budget, "lru", False, prefetch, placement, LLAPOR_ERROR,
                        distance=distance or args.presched_distance)))
    if "coop" in parts:
        shape = dataclasses.replace(shapes["mixtral-8x7b"], precision="fp16")
        for budget in tqdm(args.coop_budgets.split(","), desc="hobbit coop"):
            for arm, placement in (("gpu-centric", "none"), ("hobbit-coop", "hobbit-coop")):
                rows.append(dict(part="coop", step=arm, **simulate_one(mixtral, shape, "rtx4090", budget, "lfu",
                                                                        placement=placement, preload=True)))
    for r in rows:  # speed-up over each group's first row
        group = [b for b in rows if (b["part"], b["profile"], b["shape"], b["budget"]) ==
                 (r["part"], r["profile"], r["shape"], r["budget"])]
        r["speedup"] = group[0]["tpot_s"] / r["tpot_s"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim_smoe.json").write_text(json.dumps({"rows": rows}, indent=1, default=str))
    plot(rows, args.out / "sim_smoe.png")
    print(f"{'part':>8} {'profile':>11} {'shape':>17} {'budget':>6} {'step':>13} {'TPOT ms':>9} {'speed-up':>8} "
          f"{'hit':>6} {'host':>5} {'subst':>6}")
    for r in rows:
        print(f"{r['part']:>8} {r['profile']:>11} {r['shape']:>17} {r['budget']:>6} {r['step']:>13} "
              f"{r['tpot_s'] * 1e3:9.2f} {r['speedup']:7.2f}x {r['hit_rate']:6.1%} {r['host_share']:5.0%} "
              f"{r['substituted']:6d}")
    print(f"wrote {args.out / 'sim_smoe.json'} and {args.out / 'sim_smoe.png'}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["part"], r["profile"], r["shape"], r["budget"]) for r in rows))
    cols = min(4, len(groups))
    fig, axes = plt.subplots((len(groups) + cols - 1) // cols, cols, figsize=(4.2 * cols, 3.6 *
                                                                            ((len(groups) + cols - 1) // cols)),
                             squeeze=False)
    for ax, group in zip(axes.flat, groups):
        mine = [r for r in rows if (r["part"], r["profile"], r["shape"], r["budget"]) == group]
        ax.bar([r["step"] for r in mine], [r["tpot_s"] * 1e3 for r in mine])
        for i, r in enumerate(mine):
            ax.annotate(f"{r['speedup']:.2f}x\n{r['hit_rate']:.0%}", (i, r["tpot_s"] * 1e3), ha="center", fontsize=7,
                        xytext=(0, 2), textcoords="offset points")
        ax.set_title(f"{group[1]}, {group[2]}, {group[3]}", fontsize=8)
        ax.tick_params(axis="x", labelsize=7, rotation=20)
        ax.margins(y=0.25)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    axes[0][0].set_ylabel("simulated TPOT, ms")
    save_figure(fig, "substitution and placement in the simulator (speed-up over each panel's first bar; hit rate)",
                path)


if __name__ == "__main__":
    main()
