"""`moetier cache-bench`: every eviction policy replayed on the same traces and budgets, against Belady.

Each trace is split in time: policies that learn (flashmoe-ml's networks, hobbit's weights, static-hot's
profile) are fitted on the first part, and every policy — learned or not — is evaluated on the rest from a cold
cache, so no policy is scored on what it was fitted on and all are scored on the same accesses.

With a predictor every policy hears its predictions (DESIGN.md's `on_predict`; `comoe` uses them in Eq. 38), and
`NAME+predicted` spares the experts it names for the coming layers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from moetier.cache.capacity import cache_capacity, check_split
from moetier.cache.policies import LEARNED, POLICIES, SUFFIX, base_name
from moetier.cache.policies.context import PolicyContext
from moetier.config import MemoryBudget
from moetier.errors import MoetierError
from moetier.plan.route import DECODE
from moetier.predict import Predictor
from moetier.sim.fit import fit_hobbit, train_flashmoe, use_counts
from moetier.sim.replay import replay, trace_policy
from moetier.sim.sweep import encoder_set_aside
from moetier.trace.format import Trace


@dataclass(frozen=True)
class Record:
    trace: str
    policy: str
    expert_memory: str
    partition: str
    slots: int
    hit_rate: float
    misses: int
    bytes_per_token: float | None  # expert bytes read per decoded token (None: the expert size is unknown)
    miss_penalty_s: float | None  # read time of every miss on the given profile
    gap_closed: float | None  # (hit - LRU's) / (Belady's - LRU's)


def read_budget(budget: str) -> MemoryBudget:
    """A share of the traced experts ("25%") or a number of them ("96")."""
    try:
        return MemoryBudget("share", float(budget[:-1]) / 100) if budget.endswith("%") else \
            MemoryBudget("entries", int(budget))
    except (ValueError, MoetierError):
        raise MoetierError(f"cannot read the budget {budget!r}", hint="a share like 25% or a number of slots") from None


def budget_slots(budget: str, trace: Trace) -> int:
    """Slots for a share of the experts of the layers the trace covers ("25%", to the nearest expert), or a slot
    count ("96")."""
    total = len(trace.all_layers) * trace.num_experts
    parsed = read_budget(budget)
    if parsed.kind == "share":  # the nearest: 25% of 60 experts is 15 slots, however the float rounds
        parsed = MemoryBudget("entries", max(1, round(parsed.value * total)))
    return cache_capacity(parsed, total, 1, trace.top_k, label=budget)


def fit_learned(train: Trace, slots: int, cache: dict, names: list[str]) -> dict[str, dict]:
    """Constructor arguments of the learned policies among `names`, fitted on `train` (cached per budget)."""
    params: dict[str, dict] = {}
    if "flashmoe-ml" in names:
        if "flashmoe-ml" not in cache:
            cache["flashmoe-ml"] = train_flashmoe(train)
        params["flashmoe-ml"] = {"model": cache["flashmoe-ml"]}
    if "static-hot" in names:
        cache.setdefault("counts", use_counts(train))
        params["static-hot"] = {"counts": cache["counts"]}
    if "hobbit" in names:
        params["hobbit"] = {"weights": fit_hobbit(train, slots)[0]}
    return params


def evaluate(trace: Trace, name: str, budgets: list[str], policies: list[str], partition: str = "global",
             train_fraction: float = 0.7, expert_bytes: int | None = None, read_s: float | None = None,
             progress=None, note=None, predictor: Callable[[Trace], Predictor] | None = None) -> list[Record]:
    """`predictor`: makes a fresh predictor for the held-out part (one per replay: some learn as they go)."""
    trace = encoder_set_aside(trace, predictor is not None or bool(set(map(base_name, policies)) & set(LEARNED)),
                              note or (lambda _: None))
    train, test = trace.split(train_fraction)
    decoded = int((test.phase == DECODE).sum()) or test.num_tokens
    records, fitted = [], {}
    for budget in budgets:
        try:
            slots = budget_slots(budget, test)
            check_split(partition == "per-layer", slots, len(test.all_layers))
        except MoetierError as e:  # too small for this trace's top-k or a split: the other budgets still run
            if note is not None:
                note(f"{name}: skipping budget {budget}: {e}")
            if progress is not None:
                for _ in policies:
                    progress()
            continue
        params = fit_learned(train, slots, fitted, [base_name(p) for p in policies])
        results = {}
        for policy in policies:
            ctx = PolicyContext(slots, tuple(test.all_layers), test.num_experts, test.top_k)
            result = replay(test, trace_policy(policy, ctx, test, **params.get(base_name(policy), {})), slots,
                            per_layer=partition == "per-layer", predictor=predictor(test) if predictor else None)
            results[policy] = result
            if progress is not None:
                progress()
        lru, opt = results.get("lru"), results.get("belady")
        for policy, result in results.items():
            gap = None
            if lru is not None and opt is not None and opt.hit_rate > lru.hit_rate:
                gap = (result.hit_rate - lru.hit_rate) / (opt.hit_rate - lru.hit_rate)
            misses = result.needed - result.hits
            records.append(Record(name, policy, budget, partition, slots, result.hit_rate, misses,
                                  misses * expert_bytes / decoded if expert_bytes else None,
                                  misses * read_s if read_s else None, gap))
    return records


def format_table(records: list[Record]) -> str:
    """One row a replay; a partition column where the records hold more than one (`--cache-partition both`), so
    the global and per-layer rows of a budget are told apart."""
    both = len({r.partition for r in records}) > 1
    part = f" {'partition':>9}" if both else ""
    lines = [f"{'trace':>22} {'budget':>7}{part} {'policy':>21} {'hit':>7} {'gap closed':>10} {'MiB/token':>10} "
             f"{'penalty s':>10}"]
    for r in records:
        gap = "" if r.gap_closed is None else f"{r.gap_closed:.0%}"
        mib = "" if r.bytes_per_token is None else f"{r.bytes_per_token / 2**20:.1f}"
        pen = "" if r.miss_penalty_s is None else f"{r.miss_penalty_s:.2f}"
        part = f" {r.partition:>9}" if both else ""
        lines.append(f"{r.trace[-22:]:>22} {r.expert_memory:>7}{part} {r.policy:>21} {r.hit_rate:>7.1%} {gap:>10} "
                     f"{mib:>10} {pen:>10}")
    return "\n".join(lines)


def plot(records: list[Record], path: Path) -> None:
    """Hit rate against budget per policy (and partition, where there are two), one panel per trace (the shape of
    FlashMoE's Figure 6)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r.trace for r in records))
    policies = list(dict.fromkeys(r.policy for r in records))
    colors = {p: plt.cm.tab20(i % 20) for i, p in enumerate(policies)}  # 13 policies: more than the default cycle
    fig, axes = plt.subplots(1, len(traces), figsize=(5 * len(traces), 4), squeeze=False)
    partitions = list(dict.fromkeys(r.partition for r in records))  # a line each, per-layer's dotted
    for ax, trace in zip(axes[0], traces):
        mine = [r for r in records if r.trace == trace]
        for policy, partition in dict.fromkeys((r.policy, r.partition) for r in mine):
            pts = sorted((r.slots, r.hit_rate) for r in mine if (r.policy, r.partition) == (policy, partition))
            style = {"color": "black", "linestyle": "--"} if policy == "belady" else {"color": colors[policy]}
            if partition == "per-layer":
                style.update(linestyle=":", marker="s")
            label = policy if len(partitions) == 1 else f"{policy} ({partition})"
            ax.plot([p[0] for p in pts], [p[1] * 100 for p in pts], **{"marker": "o", **style}, label=label)
        ax.set_title(trace)
        ax.set_xlabel("cache slots")
        ax.set_ylabel("hit rate, % (held-out part)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def to_json(records: list[Record]) -> list[dict]:
    return [asdict(r) for r in records]


def all_policies(predicted: bool = False) -> list[str]:
    """Every policy, the classic ones first and the optimum last; with `predicted`, each also as NAME+predicted."""
    online = [name for name in POLICIES if name != "belady"]
    return online + ([name + SUFFIX for name in online] if predicted else []) + ["belady"]
