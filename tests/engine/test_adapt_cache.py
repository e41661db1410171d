"""Live resizing of the expert cache: a greedy run resized smaller and back in its middle writes the same tokens
(exact mode is unchanged by it), the freed slots' pages go back to the system, and `--adapt`'s hook follows a
hand-made memory series — shrinking when memory is taken, growing when it comes back, one line each."""

import psutil
import pytest

from moetier.config import MemoryBudget
from moetier.engine.adapt_cache import AdaptCache
from moetier.engine.engine import Engine, EngineConfig
from moetier.errors import BudgetError
from moetier.memory import MemoryView
from moetier.store.store import Store

PROMPT = [[5, 9, 17, 33, 2, 40, 11]]


def run(store, hooks=(), budget="100%"):
    with Engine(Store(store), EngineConfig(expert_memory=MemoryBudget.parse(budget))) as engine:
        for hook in hooks:
            engine.step_hooks.append(hook(engine))
        out = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
        return out.token_ids[0], engine


@pytest.mark.parametrize("family", ["olmoe", "mixtral"])
def test_a_resize_in_the_middle_of_a_greedy_run_keeps_its_tokens(tiny_store, family):
    _, store = tiny_store(family)
    slot = Store(store).native_layout.blob_bytes
    expected, _ = run(store)

    def resizer(engine):
        steps = []

        def hook(batch=None, phase=None):
            steps.append(phase)
            if len(steps) == 4:
                engine.set_expert_memory(MemoryBudget("bytes", engine.spec.top_k * slot))  # one layer's top-k
            elif len(steps) == 12:
                engine.set_expert_memory("100%")
        return hook

    tokens, engine = run(store, [resizer])
    assert tokens == expected and engine.executor.slots == engine.spec.num_expert_keys


def test_shrinking_gives_pages_back_and_growing_takes_them_again(tiny_store, tmp_path):
    """A store of ~100 MiB of experts: resident, then a quarter, then back; a budget below one layer's top-k is
    refused and changes nothing."""
    from moetier.store.inflate import inflate

    _, small = tiny_store("olmoe")
    big = inflate(small, tmp_path / "xl", 4096, progress=False)  # 16 experts of ~6 MiB
    proc = psutil.Process()
    with Engine(Store(big), EngineConfig(expert_memory=MemoryBudget.parse("100%"))) as engine:
        engine.generate(PROMPT, max_new_tokens=4)
        full = proc.memory_info().rss
        cache = engine.budget.cache_bytes
        engine.set_expert_memory("25%")
        assert proc.memory_info().rss < full - 0.6 * cache  # the evicted slots' pages are gone
        assert engine.executor.reserved_bytes <= 0.25 * Store(big).total_expert_bytes() + 1
        out = engine.generate(PROMPT, max_new_tokens=6, ignore_eos=True)
        assert out.stats["expert_slots"] == engine.executor.slots < 16
        engine.set_expert_memory("100%")
        engine.generate(PROMPT, max_new_tokens=6)
        assert engine.executor.slots == 16
        with pytest.raises(BudgetError):
            engine.set_expert_memory("1B")
        assert engine.executor.slots == 16


class Series:
    """A memory view whose available bytes follow a list, one value a look."""

    def __init__(self, values):
        self.values, self.i = values, 0

    def __call__(self) -> MemoryView:
        v = self.values[min(self.i, len(self.values) - 1)]
        self.i += 1
        return MemoryView(int(v), "cgroup v2 /test", 4 << 30, 0)


def test_the_hook_shrinks_when_memory_is_taken_and_grows_when_it_comes_back(tiny_store):
    _, store = tiny_store("olmoe")
    lines, clock = [], iter(range(10**6))
    with Engine(Store(store), EngineConfig(expert_memory=MemoryBudget.parse("100%"))) as engine:
        slot = engine.executor.residency.entry_bytes[engine.executor.precision]
        total = engine.spec.num_expert_keys
        cache = engine.executor.reserved_bytes
        # plenty beside the cache, then memory taken until the cache's own room is ~5 slots, then given back
        series = Series([10 * cache] * 3 + [5 * slot - cache] * 8 + [10 * cache] * 12)
        adapt = AdaptCache(engine, series, look_s=1, clock=lambda: float(next(clock)), say=lines.append)
        slots = []
        for _ in range(23):
            adapt()
            slots.append(engine.executor.slots)
            engine.generate(PROMPT, max_new_tokens=2)
        assert slots[0] == total and min(slots) <= 5 and slots[-1] == total
        assert adapt.decisions[0][1] < total and adapt.decisions[-1][1] == total
        assert all(line.startswith("moetier: adapt: expert cache ") for line in lines)
        assert len(lines) == len(adapt.decisions) >= 2


def test_without_adapt_the_budget_stays_as_asked(tiny_store):
    _, store = tiny_store("olmoe")
    with Engine(Store(store), EngineConfig(expert_memory=MemoryBudget.parse("50%"))) as engine:
        assert engine.adapt is None and not any(isinstance(h, AdaptCache) for h in engine.step_hooks)
        before = engine.executor.slots
        engine.generate(PROMPT, max_new_tokens=8)
        assert engine.executor.slots == before
    with Engine(Store(store), EngineConfig(expert_memory=MemoryBudget.parse("50%"), adapt=True)) as engine:
        assert isinstance(engine.adapt, AdaptCache) and engine.adapt in engine.step_hooks


def test_adapting_never_grows_past_what_was_asked(tiny_store):
    _, store = tiny_store("olmoe")
    ticks = iter(range(10**6))
    with Engine(Store(store), EngineConfig(expert_memory=MemoryBudget.parse("50%"))) as engine:
        asked = engine.executor.slots
        slot = engine.executor.residency.entry_bytes[engine.executor.precision]
        series = Series([100 * slot] * 4 + [3 * slot - engine.executor.reserved_bytes] * 4 + [100 * slot] * 14)
        adapt = AdaptCache(engine, series, look_s=1, clock=lambda: float(next(ticks)), say=lambda line: None)
        engine.adapt = adapt  # (what --adapt makes: set_expert_memory then moves its ceiling)
        slots = []
        for _ in range(22):
            adapt()
            slots.append(engine.executor.slots)
        assert slots[:4] == [asked] * 4 and min(slots) < asked and slots[-1] == asked and max(slots) == asked
        engine.set_expert_memory("25%")  # the caller asks for less: the new ceiling
        for _ in range(3):
            adapt()
        assert adapt.ceiling == engine.executor.slots < asked


def test_adapt_counts_every_route_for_eq_18_without_giving_up_the_resident_fast_path(tiny_store):
    """--adapt's offload priority (CoMoE Eq. 18) hears routes alone: with every expert resident the step still
    skips planning (ResidentLayers), which tells it each layer's route, so it counts what a planned run counts."""
    _, store = tiny_store("olmoe")
    spec = Store(store).spec
    counted, config = {}, EngineConfig(expert_memory=MemoryBudget.parse("100%"), adapt=True)
    with Engine(Store(store), config) as engine:
        engine.preload()
        fast = []
        engine.step_hooks.append(lambda batch=None, phase=None: fast.append(engine.executor.resident_layers))
        engine.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
        assert all(r is not None for r in fast)  # every step skipped planning
        counted["resident"] = engine.adapt.order.counts.copy()
    with Engine(Store(store), config) as engine:
        engine.generate(PROMPT, max_new_tokens=8, ignore_eos=True)  # (not preloaded: steps planned while it fills)
        counted["planned"] = engine.adapt.order.counts.copy()
    assert counted["resident"].sum() == counted["planned"].sum() == (len(PROMPT[0]) + 7) * spec.top_k * len(
        spec.moe_layers)
    assert (counted["resident"] == counted["planned"]).all()
