"""The one place a budget becomes the expert cache's capacity, for the engine, the simulator and cache-bench."""

from __future__ import annotations

from moetier.config import MemoryBudget, format_bytes
from moetier.errors import BudgetError


def cache_capacity(budget: MemoryBudget, total_bytes: int, entry_bytes: int, min_entries: int,
                   fits: int | None = None, room: str = "", label: str | None = None) -> int:
    """Bytes of the expert cache for `budget` (as the user wrote it: `label`): at most every expert
    (`total_bytes`), in whole experts of `entry_bytes` (1: a cache counted in experts, as cache-bench's). Refused
    if it holds fewer than `min_entries` experts (one layer's top-k), or more than `fits` (what the fast tier can
    give, which `room` describes; `auto` takes all of it)."""
    if budget.kind == "auto" and fits is None:
        raise ValueError("an auto budget needs to know what fits")
    entries = min(budget.resolve(total_bytes, fits, entry_bytes), total_bytes) // entry_bytes
    capacity, need = entries * entry_bytes, min_entries * entry_bytes
    if entries < min_entries:
        if budget.kind == "auto":
            raise BudgetError(f"expert memory auto: too little memory for one layer's top-{min_entries} experts "
                              f"({format_bytes(need)}): {room}", hint="free memory, or raise the limit")
        share = f"{-(-need * 1000 // total_bytes) / 10:.1f}%"  # rounded up: a share that, given back, suffices
        if entry_bytes == 1:
            raise BudgetError(f"expert memory {label or budget.label()} holds {entries} expert(s); one layer's "
                              f"top-{min_entries} needs {min_entries}", hint=f"give at least {min_entries} ({share})")
        raise BudgetError(
            f"expert memory {label or budget.label()} holds {entries} expert(s) of {format_bytes(entry_bytes)}; one "
            f"layer's top-{min_entries} needs {min_entries} ({format_bytes(need)}, {share} of all expert bytes)",
            hint=f"give --expert-memory of at least {need} bytes ({share})")
    if fits is not None and capacity > fits:
        raise BudgetError(f"expert memory {format_bytes(capacity)} does not fit: {room}",
                          hint=f"give --expert-memory {fits // 2**20}MiB or less, or auto")
    return capacity


def split_by_layer(partition: str, speculating: bool, slots: int, layers: int, experts: int) -> bool:
    """Whether a cache of `slots` is split evenly among its `layers` MoE layers: as `partition` asks ("global",
    "per-layer"), or with "auto" where speculation verifies drafts (`speculating`) and the cache cannot hold all
    `experts`. A verify step's experts — the union of its tokens', over every layer — can outnumber a global LRU
    cache's slots, which then evicts the next layer's experts to load this one's, and the plain steps after miss
    what it threw out (docs/serving.md measures it); split by layer, a layer's load evicts only its own."""
    if partition == "auto":
        return speculating and layers <= slots < experts
    return partition == "per-layer"


def check_split(per_layer: bool, slots: int, layers: int) -> None:
    """A cache split by layer streams each layer's experts through that layer's own slots, so it needs one a layer:
    refused (BudgetError) where `slots` are fewer than its `layers`."""
    if per_layer and slots < layers:
        raise BudgetError(f"a per-layer cache needs a slot for each of the {layers} MoE layers; the budget gives "
                          f"{slots}", hint="give more --expert-memory, or --cache-partition global")
