"""Simulating a trace under one or many (policy, expert budget) configurations: the table, the JSON, the plot."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from moetier.cache.capacity import cache_capacity, check_split, split_by_layer
from moetier.cache.policies import PolicyContext
from moetier.config import HostMemory, MemoryBudget, format_bytes
from moetier.errors import MoetierError
from moetier.plan.route import DECODE
from moetier.plan.substitute import Substitution
from moetier.predict import Predictor
from moetier.sim.cost import CostModel
from moetier.sim.pressure import Pressure
from moetier.sim.replay import SimResult, simulate, trace_policy
from moetier.sim.shapes import ModelShape
from moetier.sim.speculation import verify_steps
from moetier.trace.batch import interleave
from moetier.trace.format import Trace


def encoder_set_aside(trace: Trace, fitted: bool, say: Callable[[str], None]) -> Trace:
    """Learned policies and trained predictors are fitted on a trace's own columns, the decoder's: with either, an
    encoder-decoder's encoder routing is left out of the replay (and that is said). The predictors built on the
    trace or the routers (oracle, hot, stacked-gates) cover the encoder's layers too."""
    if trace.encoder is None or not fitted:
        return trace
    say(f"note: the encoder's routing (layers {trace.encoder.layers}) is set aside: learned policies and trained "
        f"predictors cover the decoder's layers")
    return trace.decoder_only()


def check_fits(trace: Trace, shape: ModelShape) -> None:
    """A trace can drive a shape only if its experts, top-k and layers are the shape's."""
    if (trace.num_experts, trace.top_k) != (shape.num_experts, shape.top_k):
        raise MoetierError(f"the trace routes top-{trace.top_k} of {trace.num_experts} experts; model shape "
                           f"{shape.name} has top-{shape.top_k} of {shape.num_experts}",
                           hint="pick the shape the trace was recorded on (--model-shape), or synthesise a trace "
                                "for this shape with `moetier trace synth --model-shape`")
    outside = sorted(set(trace.all_layers) - set(shape.moe_layers))
    if outside:
        raise MoetierError(f"the trace has routing for layers {outside}, which are not MoE layers of {shape.name}")


def check_holds(cost: CostModel) -> None:
    """Every expert of the model must live somewhere: in the fast tier beside the dense weights or in a tier below
    it, each holding what its profile states (a tier of no stated size holds any amount)."""
    tiers = cost.profile.tiers
    if any(t.bytes is None for t in tiers):
        return
    shape = cost.shape
    experts = len(shape.moe_layers) * shape.num_experts * cost.expert_bytes
    fast = max(0, cost.profile.fast_tier_bytes - cost.shape.dense_bytes())
    if experts > fast + sum(t.bytes for t in tiers):
        below = ", ".join(f"{t.name} {format_bytes(t.bytes)}" for t in tiers)
        raise MoetierError(f"{shape.name}'s experts ({format_bytes(experts)} at {cost.precision}) do not fit "
                           f"{cost.profile.name}: {format_bytes(fast)} of fast tier after the dense weights, {below}",
                           hint="a smaller precision (--precision int8, int4), or a profile with more memory")


def budget_slots(budget: str, trace: Trace, cost: CostModel) -> int:
    """Expert slots for a budget on the profile's fast tier, which also holds the dense weights; a share is of the
    experts of the layers the trace covers (DESIGN)."""
    total = len(trace.all_layers) * trace.num_experts * cost.expert_bytes
    fits = max(0, cost.profile.fast_tier_bytes - cost.shape.dense_bytes())
    room = f"the fast tier of {cost.profile.name} holds {format_bytes(fits)} after the dense weights"
    return cache_capacity(MemoryBudget.parse(budget), total, cost.expert_bytes, trace.top_k, fits, room) \
        // cost.expert_bytes


def cache_split(partition: str, speculating: bool, slots: int, trace: Trace) -> bool:
    """Whether `slots` are split among the trace's layers (as the engine's `--cache-partition`); refused, as the
    engine refuses it, where a split leaves a layer without a slot."""
    layers = len(trace.all_layers)
    per_layer = split_by_layer(partition, speculating, slots, layers, layers * trace.num_experts)
    check_split(per_layer, slots, layers)
    return per_layer


def host_tier_slots(host_memory: str, trace: Trace, cost: CostModel) -> int:
    """Host slots for `--host-memory` (bytes, or a share of the experts of the layers the trace covers) behind the
    cache: a host tier needs a profile with the link to host memory first and the disk behind it."""
    if len(cost.profile.tiers) < 2:
        raise MoetierError(f"--host-memory needs a profile with a disk tier behind host memory; {cost.profile.name} "
                           f"has one tier ({cost.profile.tiers[0].name})", hint="use a profile with two tiers, e.g. "
                                                                                 "h200-pcie5, or leave --host-memory out")
    total = len(trace.all_layers) * trace.num_experts
    budget = HostMemory.parse(host_memory).budget  # (what the engine's --host-memory takes)
    if budget is None:
        raise MoetierError("--host-memory 0 (no host tier) is not simulated: every load a disk read and a copy",
                           hint="give the host tier bytes or a share, or leave --host-memory out")
    slots = {"share": lambda: budget.value * total, "bytes": lambda: budget.value // cost.expert_bytes,
             "auto": lambda: total}[budget.kind]()
    slots = min(total, int(slots))
    if slots < 1:
        raise MoetierError(f"--host-memory {host_memory} holds no {format_bytes(cost.expert_bytes)} expert",
                           hint="give at least one expert's bytes, or leave --host-memory out")
    return slots


@dataclass
class SimRun:
    policy: str
    budget: str
    slots: int
    result: SimResult
    prefetch: str = "none"
    placement: str = "none"
    alpha: float | None = None  # the substitution's, if any
    batch: int | None = None  # sequences interleaved into a batch (None: the trace's own steps)
    pressure: dict = field(default_factory=dict)  # the budget's changes, as Pressure.row gives them (none: empty)

    def row(self) -> dict:
        return {"policy": self.policy, "expert_memory": self.budget, "prefetch": self.prefetch, "slots": self.slots,
                "placement": self.placement, "substitution_alpha": self.alpha, "interleaved": self.batch,
                **self.pressure, **self.result.summary()}


def run(trace: Trace, cost: CostModel, policy: str, budget: str, preload: bool = False,
        timeline_steps: tuple[int, ...] = (), partition: str = "global", model_dir: Path | None = None,
        prefetch: str = "none", predictor: Callable[[], Predictor] | None = None, placement: str = "none",
        substitution: Substitution | None = None, batch: int | None = None,
        pressure: Pressure | None = None, speculation: tuple[int, float] | None = None,
        host_memory: str | None = None) -> SimRun:
    """`model_dir`: where trained policy files for the model live. `predictor`: makes a fresh predictor (of the
    trace it is given), which the `prefetch` stage and the policy hear. `placement`, `substitution`: as
    `simulate`'s. `batch`: the trace's sequences interleaved into batches of this many (moetier/trace/batch.py).
    `pressure`: the budget's changes during the replay (moetier/sim/pressure.py). `speculation`: (k, acceptance):
    decode steps regrouped as `--speculate k` verifies them (moetier/sim/speculation.py). `partition`: the cache's,
    as the engine's `--cache-partition` (global, per-layer, or auto: per-layer where speculation runs under a
    budget). `host_memory`: a bounded host tier behind the cache, as the GPU engine's `--host-memory` (None: each
    expert in its profile tier)."""
    if batch is not None:
        trace = interleave(trace, batch)
    produced = None
    if speculation is not None:
        trace, produced = verify_steps(trace, *speculation)
    slots = budget_slots(budget, trace, cost)
    per_layer = cache_split(partition, speculation is not None, slots, trace)
    resizes = pressure.resizes(trace, cost, budget_slots) if pressure is not None else {}
    ctx = PolicyContext(slots, tuple(trace.all_layers), trace.num_experts, trace.top_k)
    if substitution is not None:
        substitution = substitution.resolved(cost.shape.total_expert_params)
    result = simulate(trace, trace_policy(policy, ctx, trace, model_dir), slots, cost, cost.precision, preload,
                      per_layer, timeline_steps, prefetch=prefetch,
                      predictor=predictor(trace) if predictor is not None else None, substitution=substitution,
                      placement=placement, resizes=resizes,
                      shrink=pressure.shrink if pressure is not None else "offload-priority",
                      host_slots=None if host_memory is None else {
                          cost.precision: host_tier_slots(host_memory, trace, cost)})
    extra = pressure.row(resizes) if pressure is not None else {}
    if produced is not None:  # a step's tokens are those it produced, not those it computed
        computed, result.step_tokens = result.step_tokens, produced
        decode = [i for i, phase in enumerate(result.step_phase) if phase == DECODE]
        extra["speculation"] = {"draft_tokens": speculation[0], "acceptance": speculation[1],
                                "tokens_computed_per_token": sum(computed[i] for i in decode) /
                                max(1, sum(produced[i] for i in decode))}
    return SimRun(policy, budget, slots, result, prefetch, placement,
                  substitution.alpha if substitution is not None else None, batch, extra)


def format_table(runs: list[SimRun]) -> str:
    head = f"{'policy':>21} {'budget':>8} {'prefetch':>9} {'slots':>6} {'batch':>5} {'TPOT ms':>9} {'p90 ms':>8} " \
           f"{'tok/s':>8} {'TTFT ms':>9} {'hit':>7} {'MiB/token':>10} {'host':>5} {'subst':>6}"
    lines = [head]
    for r in runs:
        s = r.result.summary()
        ms = lambda v: "n/a" if v is None else f"{v * 1e3:.2f}"  # noqa: E731
        mib = "n/a" if s["expert_bytes_per_token"] is None else f"{s['expert_bytes_per_token'] / 2**20:.1f}"
        batch = "n/a" if s["batch"] is None else f"{s['batch']:.1f}"
        tps = "n/a" if s["decode_tokens_per_s"] is None else f"{s['decode_tokens_per_s']:.1f}"
        lines.append(f"{r.policy:>21} {r.budget:>8} {r.prefetch:>9} {r.slots:>6} {batch:>5} {ms(s['tpot_s']):>9} "
                     f"{ms(s['tpot_p90_s']):>8} {tps:>8} {ms(s['ttft_s']):>9} {s['hit_rate']:>7.1%} {mib:>10} "
                     f"{s['host_share']:>5.0%} {s['substituted']:>6}")
    return "\n".join(lines)


def plot_sweep(runs: list[SimRun], path: Path, title: str) -> None:
    """TPOT and hit rate against the expert budget, one line per policy (and prefetch stage, where one ran)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_h) = plt.subplots(1, 2, figsize=(11, 4))
    for policy, prefetch, batch in dict.fromkeys((r.policy, r.prefetch, r.batch) for r in runs):
        mine = sorted((r for r in runs if (r.policy, r.prefetch, r.batch) == (policy, prefetch, batch)),
                      key=lambda r: r.slots)
        slots, label = [r.slots for r in mine], policy if prefetch == "none" else f"{policy} + {prefetch}"
        label += "" if batch is None else f", batch {batch}"
        ax_t.plot(slots, [r.result.summary()["tpot_s"] * 1e3 for r in mine], marker="o", label=label)
        ax_h.plot(slots, [r.result.hit_rate * 100 for r in mine], marker="o", label=label)
    ax_t.set_ylabel("TPOT, ms (simulated)")
    ax_h.set_ylabel("hit rate, %")
    for ax in (ax_t, ax_h):
        ax.set_xlabel("expert cache, slots")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
