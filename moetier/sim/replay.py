"""A trace driven through the engine's own layer step — the very residency, planner and policy objects — and
carried out by the simulated executor: on a hardware profile's clock (`simulate`), or on a machine where nothing
takes time for hits and misses alone (`replay`). Hits and misses are the engine's on the same routing, budget and
policy (a test checks it)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from moetier.cache.keys import ExpertKey, Precision
from moetier.cache.policies import OFFLINE, EvictionPolicy, PolicyContext, base_name
from moetier.plan.costs import RunningCosts
from moetier.plan.counters import CountingHook, predictor_recall, prefetch_summary
from moetier.plan.device_memory import FixedMemory
from moetier.plan.layer_plan import LayerPlan
from moetier.plan.offload_priority import OffloadPriority
from moetier.plan.pipeline import plan_stages
from moetier.plan.planner import Planner
from moetier.plan.precision import MixedPrecision, setup
from moetier.plan.route import DECODE, PREFILL, RouteResult
from moetier.plan.similar_substitute import SimilarSubstitution
from moetier.plan.step import LayerHook, LayerStep
from moetier.plan.substitute import Substitution
from moetier.predict.base import Predictor
from moetier.sim.cost import CostModel, FreeCost
from moetier.sim.executor import LayerTimeline, SimExecutor
from moetier.sim.host_cache import HostCache
from moetier.sim.host_issue import HostLane, mechanism_keys
from moetier.trace.format import Trace

NATIVE = "native"  # the precision a trace's experts are replayed at when the model's own is not known
SHRINKS = ("offload-priority", "policy")  # who leaves a shrinking cache


def steps(trace: Trace) -> Iterator[tuple[int, np.ndarray]]:
    """(phase, row indices) per forward step: the trace's own steps where it carries them (a batched recording, an
    interleaved trace), else a prompt's prefill rows together and each decode row alone (batch 1)."""
    if trace.step is not None:
        starts = np.flatnonzero(np.diff(trace.step, prepend=-1) != 0)
        for start, end in zip(starts, [*starts[1:], trace.num_tokens]):
            yield int(trace.phase[start]), np.arange(start, end)
        return
    start, n = 0, trace.num_tokens
    while start < n:
        end = start + 1
        if trace.phase[start] == PREFILL:
            while end < n and trace.phase[end] == PREFILL and trace.seq[end] == trace.seq[start]:
                end += 1
        yield int(trace.phase[start]), np.arange(start, end)
        start = end


def topk_scores(topk_ids: np.ndarray, topk_weights: np.ndarray, num_experts: int) -> np.ndarray:
    """[T, E] scores holding each token's top-k weights and zeros elsewhere."""
    scores = np.zeros((len(topk_ids), num_experts), np.float32)
    np.put_along_axis(scores, topk_ids, topk_weights, axis=1)
    return scores


def layer_visits(trace: Trace, rows: np.ndarray, encoder_rows: dict[int, np.ndarray]
                 ) -> list[tuple[Trace, np.ndarray, int, int]]:
    """(table, its rows, column, model layer) for each MoE layer a step routes, in order. An encoder-decoder's
    prefill runs the encoder over its prompts' tokens first (the encoder's rows of the step's sequences), then the
    decoder's start tokens — one forward step, as the engine runs it."""
    visits = []
    if trace.encoder is not None and trace.phase[rows[0]] == PREFILL:
        tokens = [encoder_rows[s] for s in dict.fromkeys(trace.seq[rows].tolist()) if s in encoder_rows]
        if tokens:
            enc_rows = np.concatenate(tokens)
            visits += [(trace.encoder, enc_rows, j, layer) for j, layer in enumerate(trace.encoder.layers)]
    return visits + [(trace, rows, j, layer) for j, layer in enumerate(trace.layers)]


def next_uses(trace: Trace) -> dict[ExpertKey, list[int]]:
    """For each expert, the times of its uses as the replay visits them — (step - 1) * layers + the layer's
    position among all the trace's layers (an encoder's first) — the future Belady is handed."""
    uses: dict[ExpertKey, list[int]] = {}
    position = {layer: i for i, layer in enumerate(trace.all_layers)}
    encoder_rows = trace.encoder_rows()
    for index, (_, rows) in enumerate(steps(trace)):
        for table, table_rows, j, layer in layer_visits(trace, rows, encoder_rows):
            for e in np.unique(table.topk_ids[table_rows, j]).tolist():
                uses.setdefault(ExpertKey(layer, e), []).append(index * len(position) + position[layer])
    return uses


def trace_policy(name: str, ctx: PolicyContext, trace: Trace, model_dir=None, **params) -> EvictionPolicy:
    """Policy `name` for replaying `trace`: the offline optimum gets the trace's future; a learned policy its
    parameters (given, or read from beside `model_dir`)."""
    from moetier.policy_files import make_policy_for_model

    if base_name(name) in OFFLINE:
        params.setdefault("future", next_uses(trace))
    return make_policy_for_model(name, ctx, model_dir, **params)


class PlanLog(LayerHook):
    """Keeps every plan, in order."""

    def __init__(self) -> None:
        self.plans: list[LayerPlan] = []

    def on_plan(self, plan: LayerPlan, phase: int) -> None:
        self.plans.append(plan)


@dataclass
class SimResult:
    step_phase: list[int] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    step_time_s: list[float] = field(default_factory=list)
    bytes_read: list[int] = field(default_factory=list)  # per step
    miss_penalty_s: float = 0.0  # the idle-link read time of every load, summed (HOBBIT's miss penalty)
    timelines: dict[int, list[LayerTimeline]] = field(default_factory=dict)  # step index -> its layers
    counts: CountingHook | None = None
    plans: list[LayerPlan] = field(default_factory=list)  # when kept
    host: HostCache | None = None  # the host tier behind the cache, with its hits and reads (`host_slots`)

    @property
    def needed(self) -> int:
        return sum(p.needed for p in self.counts.phases)

    @property
    def hits(self) -> int:
        return sum(p.hits for p in self.counts.phases)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.needed if self.needed else float("nan")

    def outcomes(self) -> list[tuple[int, list[int], list[int]]]:
        """(layer, hit experts, loaded experts) per layer step, in order: what the engine must match."""
        return [(p.layer, [r.expert for r in p.hits], [ld.expert for ld in p.loads]) for p in self.plans]

    def summary(self) -> dict:
        times, phase = np.asarray(self.step_time_s), np.asarray(self.step_phase)
        dec = phase == DECODE
        dec_tokens = int(np.asarray(self.step_tokens)[dec].sum())
        return {"tpot_s": float(times[dec].mean()) if dec.any() else None,
                "batch": dec_tokens / int(dec.sum()) if dec.any() else None,  # decode tokens a step
                "decode_tokens_per_s": dec_tokens / float(times[dec].sum()) if dec.any() else None,
                "tpot_p50_s": float(np.percentile(times[dec], 50)) if dec.any() else None,
                "tpot_p90_s": float(np.percentile(times[dec], 90)) if dec.any() else None,
                "ttft_s": float(times[phase == PREFILL].mean()) if (phase == PREFILL).any() else None,
                "hit_rate": self.hit_rate,
                "expert_bytes_per_token": float(np.asarray(self.bytes_read)[dec].sum() / dec_tokens) if dec_tokens
                else None,
                "miss_penalty_s": self.miss_penalty_s,
                "prefetches": prefetch_summary(self.counts.phases),
                "substituted": self.counts.phases[DECODE].substituted,
                "host_share": self.counts.phases[DECODE].host_runs / max(1, self.counts.phases[DECODE].needed),
                "predictor_recall": predictor_recall(self.counts.phases[DECODE]),
                "host_tier": None if self.host is None else {"hits": self.host.hits, "reads": self.host.reads}}


def simulate(trace: Trace, policy: EvictionPolicy, num_slots: int, cost: CostModel | FreeCost,
             precision: Precision = NATIVE, preload: bool | Sequence[ExpertKey] = False, per_layer: bool = False,
             timeline_steps: tuple[int, ...] = (), keep_plans: bool = False, prefetch: str = "none",
             predictor: Predictor | None = None, prefetch_params: dict | None = None,
             mixed: MixedPrecision | None = None, substitution: Substitution | SimilarSubstitution | None = None,
             placement: str = "none", resizes: Mapping[int, int] | None = None,
             shrink: str = "offload-priority", host_slots: Mapping[str, int] | None = None) -> SimResult:
    """Drive `trace` through a layer step with a cache of `num_slots` experts and carry its plans out on `cost`'s
    clock. A policy's start set (static-hot's hot table) is loaded first, as the engine loads it when made; `preload`
    then starts as Engine.preload() does (experts admitted layer by layer until the cache is full), or, given keys,
    admits those in their order until it is (a hot-expert table, hottest first, under any policy);
    `per_layer` splits the cache evenly among the trace's layers; timelines are kept for `timeline_steps`
    (negative indices count from the end). Layers the trace does not cover run with their experts resident. A
    trace without full router scores hands the policies its top-k weights with zeros elsewhere. `prefetch` names a
    stage of moetier.plan.prefetchers fed by `predictor`, which hears the trace's gate inputs where it has them.
    `mixed`: a precision mode (moetier/plan/precision.py) over the model's own `precision`; `num_slots` then counts
    the budget in experts at that precision, and the cost model prices each read and compute at its own.
    `substitution`: SMoE's (α None: the paper's for the model's size, from the cost model's shape), or CoMoE's
    similar-expert one (its similarity handed in). `placement`: a
    stage of moetier.plan.placement choosing per missing expert between a read and the profile's host CPU.
    `resizes`: memory pressure, {step index: slots} — before that step the cache is resized to that many experts (at
    the model's precision, a low tier's share beside them) as `--adapt` resizes the engine's; shrinking, `shrink`
    chooses who leaves: "offload-priority" (CoMoE Eq. 18, plan/offload_priority.py, as --adapt) or "policy".
    `host_slots`: a host tier behind the cache (a GPU's `--host-memory`), {precision: slots}, least recently used
    out (moetier/sim/host_cache.py): its hits copied over the profile's first tier, its misses read from the
    last into it first; None: each expert in its profile tier, as the tiers' sizes place them."""
    if shrink not in SHRINKS:
        raise ValueError(f"unknown shrink order {shrink!r}: one of {', '.join(SHRINKS)}")
    if host_slots is not None and isinstance(cost, CostModel) and len(cost.profile.tiers) < 2:
        raise ValueError("a host tier needs a profile with two tiers below the cache: the link to host memory "
                         "first, the disk behind it")
    if predictor is not None and set(predictor.moe_layers) != set(trace.all_layers):
        raise ValueError("the predictor must cover the trace's MoE layers (an encoder's too: sim/predictors.py)")
    mixed = mixed or MixedPrecision()
    # a free machine counts experts, not bytes
    entry_bytes = {p: max(1, cost.at(p).expert_bytes) for p in {precision, *mixed.precisions(precision)}}
    made = setup(mixed, precision, entry_bytes, num_slots * entry_bytes[precision], policy, tuple(trace.all_layers),
                 trace.num_experts, trace.top_k, per_layer)
    residency, high = made.residency, made.high
    counts, log = CountingHook(entry_bytes, high if mixed.mixed else None), PlanLog()
    costs = RunningCosts(entry_bytes[high])
    if isinstance(substitution, Substitution) and substitution.alpha is None:
        if not isinstance(cost, CostModel):
            raise ValueError("a replay knows no model size: give the substitution its alpha")
        substitution = substitution.resolved(cost.shape.total_expert_params)
    prefetch_params = {"memory": FixedMemory((free_share(cost, made.residency.capacity_bytes),)),
                       **(prefetch_params or {})}
    stages = plan_stages(made, substitution, prefetch, predictor, costs, trace.top_k, prefetch_params, placement)
    layer_step = LayerStep(residency, Planner(high, stages), hooks=[counts, log] if keep_plans else [counts],
                           predictor=predictor)
    host = None if host_slots is None else HostCache(
        host_slots, (ExpertKey(layer, e) for layer in trace.all_layers for e in range(trace.num_experts)))
    executor = SimExecutor(layer_step, cost, costs, host, host_lane(cost, policy, prefetch, predictor, mixed,
                                                                     substitution, placement))
    # the engine reads each layer's routing on the host unless nothing but the on-demand plan runs and every expert
    # is resident (engine/resident_layers.py)
    plain, every_key = len(stages) == 1 and predictor is None, len(trace.all_layers) * trace.num_experts
    resizes = dict(resizes or {})
    order = None
    if resizes and shrink == "offload-priority":  # counts the activations from the first step, as --adapt's
        order = OffloadPriority(trace.all_layers, trace.num_experts, lambda k: residency.entries[k].nbytes,
                                lambda: costs.bandwidth)
        layer_step.hooks.append(order)
    # as the engine starts: a policy's hot set loaded when it is made, then Engine.preload() if asked
    starts = [policy.start_set()]
    if preload is True:
        starts.append(ExpertKey(layer, e) for layer in trace.all_layers for e in range(trace.num_experts))
    elif preload:
        starts.append(preload)
    for keys in starts:
        for key, _ in residency.admit_while_room(keys, high):
            residency.landed(key)
        residency.unpin_all()
    all_steps = list(steps(trace))
    keep = {i % len(all_steps) for i in timeline_steps} if all_steps else set()
    result = SimResult(counts=counts)
    encoder_rows = trace.encoder_rows()
    group: set[int] = set()  # the sequences of the current generate call
    for index, (phase, rows) in enumerate(all_steps):
        seqs = set(trace.seq[rows].tolist())
        if not seqs <= group:  # the engine starts its sequences with each generate call (a batch: one call)
            group = seqs
            layer_step.on_sequence_start()
        layer_step.begin_step(phase)
        if index in resizes:
            executor.resize(resizes[index] * entry_bytes[precision] - made.tier_bytes, order)
        executor.routed = not plain or len(residency) < every_key or bool(executor.landing)
        start, loads_before = executor.now, counts.phases[phase].bytes_read
        for table, table_rows, j, layer in layer_visits(trace, rows, encoder_rows):
            if table is not trace and j == 0:  # the encoder's layers the trace does not cover run resident
                executor.idle(cost.encoder_rest_s(table.layers, len(table_rows)))
            gate_input = table.gate_inputs[table_rows, j] if table.gate_inputs is not None else None
            plan, timeline = executor.layer(trace_route(table, table_rows, j, layer, layer_step.step), len(table_rows),
                                            gate_input)
            result.miss_penalty_s += sum(executor.idle_read_s(ExpertKey(layer, ld.expert), ld.precision)
                                         for ld in plan.loads)
            if index in keep:
                result.timelines.setdefault(index, []).append(timeline)
        executor.idle(cost.rest_of_step_s(trace.layers, len(rows)))  # untraced decoder layers, the head
        result.step_phase.append(phase)
        result.step_tokens.append(len(rows))
        result.step_time_s.append(executor.now - start)
        result.bytes_read.append(counts.phases[phase].bytes_read - loads_before)
    result.plans = log.plans
    result.host = host
    return result


def host_lane(cost, policy: EvictionPolicy, prefetch: str, predictor: Predictor | None, mixed: MixedPrecision,
              substitution, placement: str) -> HostLane | None:
    """The host thread that issues a GPU's work, where the profile prices it (host_issue), for this configuration's
    mechanisms."""
    issue = cost.profile.host_issue if isinstance(cost, CostModel) else None
    if issue is None:
        return None
    kind = None if substitution is None else "smoe" if isinstance(substitution, Substitution) else "similar"
    return HostLane.of(issue, mechanism_keys(policy.name, prefetch, predictor.name if predictor is not None else None,
                                             mixed.mode if mixed.mixed else None, kind, placement))


def free_share(cost: CostModel | FreeCost, cache_bytes: int) -> float:
    """The simulated device's free memory beside the model (CoMoE's m_avail/m_GPU): the profile's fast tier less
    the dense weights and the expert cache; a free machine (no profile) has none beside its cache."""
    profile = getattr(cost, "profile", None)
    if profile is None or profile.fast_tier_bytes <= 0:
        return 0.0
    used = cost.shape.dense_bytes() + cache_bytes
    return max(0.0, profile.fast_tier_bytes - used) / profile.fast_tier_bytes


def replay(trace: Trace, policy: EvictionPolicy, num_slots: int, preload: bool = False, per_layer: bool = False,
           precision: Precision = NATIVE, keep_plans: bool = False, predictor: Predictor | None = None,
           mixed: MixedPrecision | None = None, entry_bytes: dict[Precision, int] | None = None,
           substitution: Substitution | SimilarSubstitution | None = None) -> SimResult:
    """Hits and misses alone: `simulate` on a machine where nothing takes time (the policy hears `predictor`'s
    predictions, if one is given; nothing is prefetched). A mixed-precision `mixed` needs each precision's
    `entry_bytes` (a store's blob sizes) to split the cache as the engine does; a `substitution` its alpha."""
    return simulate(trace, policy, num_slots, FreeCost(entry_bytes, precision), precision, preload, per_layer,
                    keep_plans=keep_plans, predictor=predictor, mixed=mixed, substitution=substitution)


def trace_route(trace: Trace, rows: np.ndarray, column: int, layer: int, step: int) -> RouteResult:
    """The routing of the token steps `rows` at the trace's column `column` (model layer `layer`), as a step
    stamped `step` saw it."""
    ids = trace.topk_ids[rows, column].astype(np.int64)
    weights = trace.topk_weights[rows, column].astype(np.float32)
    scores = trace.scores[rows, column].astype(np.float32) if trace.scores is not None else \
        topk_scores(ids, weights, trace.num_experts)
    return RouteResult(layer, step, ids, weights, scores, int(trace.phase[rows[0]]))
