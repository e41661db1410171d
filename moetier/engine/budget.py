"""The expert cache a run reserves, decided before anything is loaded or reserved: the user's budget, counted in
the experts the run computes (a uniform int4 run's share is a share of the int4 copies' bytes, and its slots are
int4 slots), bounded by what the memory this process may still take (host or cgroup) leaves after the dense
weights and the runtime's measured overhead."""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from moetier.cache.capacity import cache_capacity
from moetier.config import HostMemory, MemoryBudget, format_bytes
from moetier.errors import BudgetError
from moetier.memory import MemoryView
from moetier.plan.precision import UNIFORM, MixedPrecision
from moetier.store.store import Store
from moetier.store.variants import expert_layouts

# What the process takes beyond the expert cache and the dense weights, measured (peak RSS less both, AMD EPYC,
# torch 2.13): 269-306 MiB at short prompts (the interpreter, torch, the tokenizer, the kernels), growing with
# the tokens of a packed prefill by 36-219 KiB a token (demo-fine to an OLMoE-width model, 4 prompts of 1,000).
# The budget note promises peak RSS within the two plus these bounds; tests/engine/test_budget.py holds it.
RUNTIME_BYTES = 384 << 20
PREFILL_BYTES_PER_TOKEN = 256 << 10
# `auto` also leaves room for a prefill of this many tokens, or of as many as leave one layer's top-k experts (an
# explicit budget is refused only where the cache, the dense weights and the runtime cannot fit at all; the note
# says what a longer prompt adds).
AUTO_PROMPT_TOKENS = 1024


@dataclass(frozen=True)
class BudgetChoice:
    """The expert cache a run reserves, and the one line that says why. `slots` and `cache_bytes` are in experts
    of `precision`, the copy the run computes (a mixed mode's: its high precision)."""

    slots: int
    cache_bytes: int
    note: str
    dense_bytes: int = 0
    precision: str = ""

    def peak_rss_bound(self, prompt_tokens: int) -> int:
        """What the note promises this process's peak RSS stays within, for a prefill of `prompt_tokens`."""
        return self.cache_bytes + self.dense_bytes + RUNTIME_BYTES + prompt_tokens * PREFILL_BYTES_PER_TOKEN


def budget_precision(store: Store, mixed: MixedPrecision) -> str:
    """The copy a budget is counted in: a uniform mode's, else the model's own (a mixed mode's high copy)."""
    return mixed.mode if mixed.mode in UNIFORM else store.manifest.native_precision


def runtime_to_come(held: int | None = None) -> int:
    """What the runtime will still take: RUNTIME_BYTES less what this process already holds (`held`, default its
    resident memory now: the interpreter and torch are loaded by then, and `memory` already counts them as used)."""
    held = psutil.Process().memory_info().rss if held is None else held
    return max(0, RUNTIME_BYTES - held)


def plan_budget(store: Store, budget: MemoryBudget, memory: MemoryView, mixed: MixedPrecision = MixedPrecision(),
                dense_bytes: int | None = None, held: int | None = None, load_bytes: int = 0) -> BudgetChoice:
    """The expert cache for `budget`: at least one layer's top-k, at most every expert, and never more than fits in
    `memory` after the dense weights (`dense_bytes`, default the store's) and the runtime still to come
    (`runtime_to_come(held)`); `auto` takes that less a prefill of AUTO_PROMPT_TOKENS. Counted in experts of the
    precision the run computes (`budget_precision`). `load_bytes`: what loading the dense weights holds beside them
    at its peak (dense_quant.dense_load_bytes), before the cache exists: refused where even that does not fit."""
    spec = store.spec
    dense = store.dense_bytes if dense_bytes is None else dense_bytes
    if dense + load_bytes > memory.available:
        raise BudgetError(f"too little memory to load the dense weights: {format_bytes(dense)} kept, and up to "
                          f"{format_bytes(load_bytes)} more while quantizing them; {memory.describe()}",
                          hint="free memory, or raise the limit")
    precision = budget_precision(store, mixed)
    if precision == store.manifest.native_precision:
        slot_bytes, total = store.native_layout.blob_bytes, store.total_expert_bytes()
    else:  # (the store may not hold the copy yet: a store in the cache gets it after this check)
        slot_bytes = expert_layouts(spec, [precision])[precision].blob_bytes
        total = slot_bytes * spec.num_expert_keys
    runtime = runtime_to_come(held)
    fits = max(0, memory.available - dense - runtime)
    room = f"{memory.describe()}; after the dense weights ({format_bytes(dense)})"
    if budget.kind == "auto":
        # room for a prompt of AUTO_PROMPT_TOKENS, or as much as leaves one layer's top-k: where memory is that
        # short a short prompt still runs (the note's per-token promise says what a longer one adds)
        tokens = min(AUTO_PROMPT_TOKENS, max(0, fits - spec.top_k * slot_bytes) // PREFILL_BYTES_PER_TOKEN)
        fits = max(0, fits - tokens * PREFILL_BYTES_PER_TOKEN)
        room += f", the runtime still to come ({format_bytes(runtime)}) and a {tokens:,}-token prompt"
    else:
        room += f" and the runtime still to come ({format_bytes(runtime)})"
    room += f", {format_bytes(fits)} fits"
    cache = cache_capacity(budget, total, slot_bytes, spec.top_k, fits, room)
    slots = cache // slot_bytes
    unit = "" if precision == store.manifest.native_precision else f" {precision}"
    note = (f"expert cache {format_bytes(cache)} ({slots}{unit} slots, {cache / total:.0%} of {format_bytes(total)} "
            f"of{unit} experts; asked {budget.label()}); {memory.describe()}; peak RSS at most "
            f"{format_bytes(cache + dense + RUNTIME_BYTES)} (with the dense weights and "
            f"{format_bytes(RUNTIME_BYTES)} of runtime) + {PREFILL_BYTES_PER_TOKEN >> 10} KiB per prompt token")
    return BudgetChoice(slots, cache, note, dense, precision)


def check_host_tier(store: Store, budget: BudgetChoice, memory: MemoryView, on_cpu: bool,
                    precisions: tuple[str, ...] = ()) -> None:
    """Placement keeps every expert in host memory at each of `precisions` (default: the store's own) beside the
    dense weights (and, on the CPU, the cache): refused where the host cannot hold them."""
    tier = sum(store.manifest.expert_bytes(p) for p in precisions) if precisions else store.total_expert_bytes()
    on_host = tier + (budget.dense_bytes + budget.cache_bytes if on_cpu else 0)
    room = max(0, memory.available - runtime_to_come())
    if on_host > room:
        raise BudgetError(f"placement computes experts where they live, so every expert is kept in host memory: "
                          f"{format_bytes(on_host)} with what else the host holds, more than the "
                          f"{format_bytes(room)} {memory.describe()} leaves for them",
                          hint="run without --placement (experts are then read from disk as needed)")


# what the host tier leaves of the host's memory beside the runtime (the CUDA context's own host memory, the
# pinned-memory bookkeeping, the page tables of a large locked mapping)
HOST_TIER_MARGIN = 1 << 30


@dataclass(frozen=True)
class HostTierChoice:
    """The host tier behind a GPU's cache: slots per precision, and the line that says why."""

    slots: dict[str, int]
    nbytes: int
    note: str


def plan_host_tier(store: Store, host: HostMemory, memory: MemoryView, precisions: tuple[str, ...],
                   must_hold_all: bool = False, held: int | None = None) -> HostTierChoice | None:
    """Host memory for the experts at `precisions` behind a GPU's cache: `auto` takes every expert where the host
    has room for them all and as much as it has otherwise; a share is of those experts' bytes; bytes are bytes.
    Refused where it is more than the host can hold, or (`must_hold_all`: placement computes from it) less than
    every expert. None for no tier (`--host-memory 0`: every miss is read from disk). `held`: as plan_budget's."""
    budget = host.budget
    if budget is None:
        if must_hold_all:
            raise BudgetError("placement computes experts in host memory, so it needs every expert there",
                              hint="drop --host-memory 0, or run without --placement")
        return None
    layouts = {p: store.manifest.precisions[p].blob_bytes if p in store.manifest.precisions
               else expert_layouts(store.spec, [p])[p].blob_bytes for p in precisions}
    n = store.spec.num_expert_keys
    total = sum(b * n for b in layouts.values())
    room = max(0, memory.available - runtime_to_come(held) - HOST_TIER_MARGIN)
    if budget.kind == "auto":
        want = min(total, room)
    elif budget.kind == "share":
        want = int(budget.value * total)
    else:  # (bytes: HostMemory refuses a number of experts)
        want = min(int(budget.value), total)
    asked = f"asked {budget.label()}"
    if want > room:
        raise BudgetError(f"host memory for the experts: {format_bytes(want)} asked, but {memory.describe()} leaves "
                          f"{format_bytes(room)} beside the runtime", hint="give less --host-memory, or auto")
    if must_hold_all and want < total:
        raise BudgetError(f"placement computes experts in host memory, so it needs every expert there: "
                          f"{format_bytes(total)}, more than the {format_bytes(want)} of host memory ({asked})",
                          hint="give more --host-memory, or run without --placement")
    floor = min(n, 2 * store.spec.top_k)  # a layer's reads in flight, and as many prefetched
    slots = {p: min(n, int(want * (b * n / total)) // b) for p, b in layouts.items()}
    short = [p for p, s in slots.items() if s < floor]
    if short:
        raise BudgetError(f"host memory for the experts: {format_bytes(want)} holds fewer than {floor} {short[0]} "
                          f"experts ({asked})", hint="give more --host-memory, or 0 to read every miss from disk")
    nbytes = sum(slots[p] * b for p, b in layouts.items())
    whole = all(s == n for s in slots.values())
    note = (f"host memory {format_bytes(nbytes)} for the experts ({'every expert' if whole else f'{nbytes / total:.0%} of them'}"
            f" at {', '.join(precisions)}; {asked}), pinned for the GPU")
    return HostTierChoice(slots, nbytes, note)
