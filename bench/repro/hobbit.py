"""HOBBIT's headlines in the simulator: Fig. 14 (decode speed-ups over MoE-Offloading and MoE-Infinity), Fig. 16
(dynamic expert loading), Fig. 17b (prefetching, with and without mixed precision) and Fig. 18 (its cache policy by
miss penalty; sequence-level LFU).

Mixtral-8x7B's real routing (the shared trace: two HumanEval and two GSM8K problems, batch 1, as HOBBIT runs), on
the rtx4090 profile with fp16 experts (+ int4 copies) and on jetson-orin with int8 (+ int2), the paper's Table 2
pairs, at the fast tier's room (`auto`). Learned things (HOBBIT's policy weights) are fitted on the first 70% of the
trace; every system is timed on the rest. The baselines as the simulator can pose them: MoE-Offloading is LRU with a
next-layer gate-based prefetch at one precision (one layer ahead); MoE-Infinity an activation-count (LFU) cache with
a prefetch two layers ahead; HOBBIT its loader (T1 0.6, T2 0.9), its policy and its mixed-precision prefetch. The prefetches' predictor
is the trace's own routing made 16% wrong (stacked gates' recall one layer ahead on demo-deep, docs/prediction.md),
looking two layers ahead (HOBBIT's p).

    python bench/repro/hobbit.py        # ~2 min; bench/out/repro/hobbit.{json,md,png}
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Claim, Config, real_trace, report, shape_of, simulate  # noqa: E402

PAIRS = {"rtx4090": ("fp16", "int4"), "jetson-orin": ("int8", "int2")}
PREDICT = dict(predictor="oracle", error=0.16, distance=2)
WHY = {  # rows outside the magnitude band: why
    "14": "the baselines are moetier's stages with the same prefetch, not MoE-Offloading's or MoE-Infinity's own "
          "runtimes (their overheads are not modelled); and HOBBIT now reads an important expert's high copy where "
          "its low copy is cached (by gate, §3.2): 5x the reads of as-held on the Orin",
    "18": "the policy is fitted on 70% of four problems' routing and scored on the rest: a small trace, where the "
          "fitted weights beat LRU and LFU by more than the paper's 4.7-8.7% and 2.1-4.2%",
}
FIG16 = (1.19, 1.57)  # dynamic loading's speed-up, the paper's range over prompt and output lengths


def systems(low: str, weights) -> dict[str, Config]:
    hobbit_policy = (("weights", weights),)
    return {
        "moe-offloading": Config("lru", "hobbit", **dict(PREDICT, distance=1)),  # its gate looks one layer ahead
        "moe-infinity": Config("lfu", "hobbit", **PREDICT),
        "hobbit": Config("hobbit", "hobbit", **PREDICT, precision_mode="hobbit", low=low, policy_params=hobbit_policy),
        "hobbit, one precision": Config("hobbit", "hobbit", **PREDICT, policy_params=hobbit_policy),
        "hobbit, no prefetch": Config("hobbit", precision_mode="hobbit", low=low, policy_params=hobbit_policy),
        "hobbit, one precision, no prefetch": Config("hobbit", policy_params=hobbit_policy),
        "coop, one precision": Config("lfu", placement="hobbit-coop", preload=True),
        "coop, hobbit": Config("lfu", placement="hobbit-coop", preload=True, precision_mode="hobbit", low=low),
    }


def geometry(cost, high: str, low: str) -> dict[str, int]:
    """One expert's bytes at each copy of the pair, as the timed runs' cache holds them."""
    return {p: cost.at(p).expert_bytes for p in (high, low)}


def fitted_weights(train, slots: int, high: str, low: str, entry_bytes: dict[str, int]):
    """Fitted on the run's own pair (int8+int2 on the Orin: a low miss 1/4 of a high one) and geometry."""
    from moetier.plan.precision import MixedPrecision
    from moetier.sim.fit import fit_hobbit

    return fit_hobbit(train, slots, mixed=MixedPrecision("hobbit", low=low), high=high, entry_bytes=entry_bytes)[0]


def penalties(test, slots: int, high: str, low: str, weights, entry_bytes: dict[str, int]) -> dict[str, float]:
    """Fig. 18a's measure on `test`: the miss penalty of each policy in HOBBIT's mixed-precision mode (a missed low
    copy costs its bits over the high copy's), the cache as the timed runs hold it."""
    from moetier.cache.policies import PolicyContext
    from moetier.plan.precision import MixedPrecision
    from moetier.sim.fit import miss_penalty
    from moetier.sim.replay import replay, trace_policy

    mixed = MixedPrecision("hobbit", low=low).with_thresholds()
    ctx = PolicyContext(slots, tuple(test.layers), test.num_experts, test.top_k, high)
    out = {}
    for name, params in (("lru", {}), ("lfu", {}), ("hobbit", {"weights": weights})):
        result = replay(test, trace_policy(name, ctx, test, **params), slots, precision=high, keep_plans=True,
                        mixed=mixed, entry_bytes=entry_bytes)
        out[name] = miss_penalty(result.plans, high)
    return out


def precision_shares(test, slots: int, high: str, low: str, weights, entry_bytes: dict[str, int],
                     cached: str) -> dict[str, float]:
    """HOBBIT's loader on `test` (its policy, no prefetch): the share of expert runs at the low precision, and of
    each token's top-1 expert (§3.2: always high; Fig. 5b: ~30% of all loads low on Mixtral at 0.6 / 0.9), under
    the cached-copy rule `cached` (by-gate: the paper's; as-held: any cached copy runs as held)."""
    import numpy as np

    from moetier.cache.policies import PolicyContext
    from moetier.cache.policies.hobbit import HobbitPolicy
    from moetier.plan.precision import MixedPrecision
    from moetier.sim.replay import replay

    mixed = MixedPrecision("hobbit", low=low, cached=cached).with_thresholds()
    ctx = PolicyContext(slots, tuple(test.layers), test.num_experts, test.top_k, high)
    plans = replay(test, HobbitPolicy(ctx, weights), slots, precision=high, keep_plans=True, mixed=mixed,
                   entry_bytes=entry_bytes).plans
    runs = [run for p in plans for run in p.runs]
    top1, low_top1 = 0, 0
    for p in plans:
        at = {run.expert: run.precision for run in p.runs}
        firsts = np.take_along_axis(p.route.topk_ids, p.route.topk_weights.argmax(axis=1)[:, None], axis=1)[:, 0]
        top1 += len(firsts)
        low_top1 += sum(at.get(int(e)) == low for e in firsts)
    return {"low_share": sum(run.precision == low for run in runs) / len(runs), "top1_low_share": low_top1 / top1,
            "reads": sum(len(p.loads) for p in plans)}


def main() -> None:
    from moetier.cache.policies import PolicyContext
    from moetier.progress import tqdm
    from moetier.sim.cost import CostModel
    from moetier.sim.profile import HardwareProfile
    from moetier.sim.replay import replay, trace_policy
    from moetier.sim.sweep import budget_slots

    trace = real_trace("mixtral")
    train, test = trace.split(0.7)
    rows, claims = [], []
    for profile, (high, low) in PAIRS.items():
        shape = shape_of("mixtral-8x7b", high)
        cost = CostModel.of(HardwareProfile.load(profile), shape, high)
        slots, entry_bytes = budget_slots("auto", test, cost), geometry(cost, high, low)
        weights = fitted_weights(train, slots, high, low, entry_bytes)
        tpot, landed = {}, {}
        for name, config in tqdm(systems(low, weights).items(), desc=profile, unit="system"):
            row = simulate(test, shape, profile, "auto", config)
            rows.append(dict(row, system=name, weights=str(weights)))
            tpot[name] = row["tpot_s"]
            pre = row["prefetches"]
            landed[name] = f"{pre['used']:,} of {pre['issued']:,} prefetches landed in time ({pre['late']:,} late)"
        setting = f"Mixtral-8x7B {high}+{low}, {profile}, {slots} slots"
        speed = lambda a, b, tpot=tpot: tpot[b] / tpot[a]  # noqa: E731  (a's decode speed over b's)
        if profile == "rtx4090":
            claims += [Claim("Fig. 14c", "HOBBIT over MoE-Offloading, decode", 3.21,
                             speed("hobbit", "moe-offloading"), setting, why=WHY["14"]),
                       Claim("Fig. 14c", "HOBBIT over MoE-Infinity, decode", 2.30, speed("hobbit", "moe-infinity"),
                             setting, why=WHY["14"]),
                       Claim("Fig. 16", "dynamic loading, 4090 + CPU (coop)", 1.19,
                             speed("coop, hobbit", "coop, one precision"), setting,
                             "the paper's lowest: gains from CPU compute at int4", band=FIG16),
                       Claim("Fig. 17b", "prefetch speed-up, fp16", 1.01,
                             speed("hobbit, one precision", "hobbit, one precision, no prefetch"), setting,
                             landed["hobbit, one precision"]),
                       Claim("Fig. 17b", "prefetch speed-up, fp16+int4", 1.05,
                             speed("hobbit", "hobbit, no prefetch"), setting, landed["hobbit"]),
                       Claim("Fig. 17b", "prefetch gain, mixed over one precision", 1.05 / 1.01,
                             speed("hobbit", "hobbit, no prefetch") /
                             speed("hobbit, one precision", "hobbit, one precision, no prefetch"), setting,
                             "a wrong int4 prefetch costs a quarter of the link")]
        else:
            claims += [Claim("Fig. 14a", "HOBBIT over MoE-Infinity, decode", 3.64, speed("hobbit", "moe-infinity"),
                             setting, "llama.cpp's 13x comes from page faults, not modelled", why=WHY["14"]),
                       Claim("Fig. 16", "dynamic loading, Jetson", 1.57, speed("hobbit", "hobbit, one precision"),
                             setting, "the paper's highest", band=FIG16)]
        shares = {rule: precision_shares(test, slots, high, low, weights, entry_bytes, rule)
                  for rule in ("by-gate", "as-held")}
        rows.append(dict(profile=profile, precision_shares=shares))
        print(f"{profile}: low-precision runs {shares['by-gate']['low_share']:.1%} of all, "
              f"{shares['by-gate']['top1_low_share']:.1%} of top-1 (by gate; as held: "
              f"{shares['as-held']['low_share']:.1%}, {shares['as-held']['top1_low_share']:.1%}; paper ~30%, 0%)")
        pen = penalties(test, slots, high, low, weights, entry_bytes)
        rows.append(dict(profile=profile, penalties=pen))
        claims += [Claim("Fig. 18a", "miss penalty, LRU over HOBBIT's policy", 1 / (1 - 0.0469),
                         pen["lru"] / pen["hobbit"], setting, "paper: 4.69-8.68% lower than LRU",
                         band=(1 / (1 - 0.0469), 1 / (1 - 0.0868)), why=WHY["18"]),
                   Claim("Fig. 18a", "miss penalty, LFU over HOBBIT's policy", 1 / (1 - 0.0213),
                         pen["lfu"] / pen["hobbit"], setting, "paper: 2.13-4.19% lower than LFU",
                         band=(1 / (1 - 0.0213), 1 / (1 - 0.0419)), why=WHY["18"])]
    # Fig. 18b: sequence-level LFU against model-level LFU, hit rate, at the 4090's slots
    ctx = PolicyContext(slots, tuple(test.layers), test.num_experts, test.top_k)
    hits = {name: replay(trace, trace_policy(name, ctx, trace), slots).hit_rate for name in ("lfu", "lfu-seq")}
    rows.append(dict(figure="18b", hit_rate=hits))
    claims.append(Claim("Fig. 18b", "hit ratio, sequence- over model-level LFU", 1.045, hits["lfu-seq"] / hits["lfu"],
                        f"Mixtral-8x7B, {slots} slots, whole trace"))
    report("hobbit", "HOBBIT, reproduced in the simulator", rows, claims)


if __name__ == "__main__":
    main()
