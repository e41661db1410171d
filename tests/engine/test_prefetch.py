"""Prefetching in the real engine: exact mode is unchanged by any prefetch configuration (the tokens equal those
without it, whose parity with transformers tests/model/test_parity.py holds), and the statistics add up."""

import pytest
import torch

from moetier import Engine
from moetier.config import MemoryBudget
from moetier.engine.engine import EngineConfig
from moetier.engine.stats import format_summary
from moetier.errors import MoetierError
from moetier.plan.prefetchers import PREFETCHERS
from moetier.store.store import Store


def prompts(lengths: list[int], vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def deep(tiny_store):
    """A four-layer OLMoE: three layers to predict from."""
    return tiny_store("olmoe", num_hidden_layers=4)


@pytest.fixture(scope="module")
def reference(deep):
    """Without prefetching, everything resident."""
    _, path = deep
    with Engine.from_pretrained(path, expert_memory="100%") as engine:
        return [engine.generate([p], max_new_tokens=14, ignore_eos=True).token_ids[0] for p in prompts([6, 11])]


@pytest.mark.parametrize("prefetch", sorted(PREFETCHERS))
def test_any_prefetch_configuration_leaves_the_output_exact(deep, reference, prefetch):
    _, path = deep
    with Engine.from_pretrained(path, expert_memory="30%", prefetch=prefetch, predictor="stacked-gates") as engine:
        singles = [engine.generate([p], max_new_tokens=14, ignore_eos=True) for p in prompts([6, 11])]
        batch = engine.generate(prompts([6, 11]), max_new_tokens=14, ignore_eos=True)
        slot = engine.executor.pool.slot_bytes
    assert [o.token_ids[0] for o in singles] == reference
    assert batch.token_ids == reference
    for out in singles + [batch]:
        s = out.stats
        pf = s["prefetches"]
        assert pf["used"] + pf["late"] <= pf["issued"] and pf["cancelled"] <= pf["wasted"]
        for phase in ("prefill", "decode"):
            c = s[phase]
            assert c["bytes_read"] == (c["loads"] + c["prefetches"] - c["prefetch_cancelled"]) * slot
            assert c["hits"] <= c["needed"]


@pytest.mark.parametrize("prefetch", ["smoe", "hobbit"])
def test_smoe_lookahead_leaves_the_output_exact_and_predicts_better_than_chance(deep, reference, prefetch):
    """The look-ahead runs the next layer's attention on an approximate state inside the step, writing the KV
    cache; the output stays exact, and the engine scores the predictor live."""
    _, path = deep
    with Engine.from_pretrained(path, expert_memory="30%", prefetch=prefetch, predictor="smoe-lookahead") as engine:
        singles = [engine.generate([p], max_new_tokens=14, ignore_eos=True) for p in prompts([6, 11])]
        batch = engine.generate(prompts([6, 11]), max_new_tokens=14, ignore_eos=True)
    assert [o.token_ids[0] for o in singles] == reference and batch.token_ids == reference
    for out in singles + [batch]:
        dec = out.stats["decode"]
        assert dec["predicted"] == 13 * len(out.token_ids) * 3 * 2  # decode steps · rows · predicted layers · k
        assert out.stats["predictor_recall"] > 2 / 8  # chance: k of E


def test_without_a_predictor_there_is_no_recall(deep):
    _, path = deep
    with Engine.from_pretrained(path, expert_memory="30%") as engine:
        s = engine.generate(prompts([6]), max_new_tokens=4, ignore_eos=True).stats
    assert s["predictor_recall"] is None and s["decode"]["predicted"] == 0 and "recall" not in format_summary(s)


def test_hobbit_prefetches_and_raises_the_hit_rate(deep):
    _, path = deep
    p = prompts([9])
    with Engine.from_pretrained(path, expert_memory="30%") as engine:
        base = engine.generate(p, max_new_tokens=24, ignore_eos=True).stats
    with Engine.from_pretrained(path, expert_memory="30%", prefetch="hobbit", predictor="stacked-gates") as engine:
        pre = engine.generate(p, max_new_tokens=24, ignore_eos=True).stats
    assert pre["prefetches"]["issued"] > 0 and base["prefetches"]["issued"] == 0
    assert pre["decode"]["hits"] + pre["prefetches"]["late"] >= base["decode"]["hits"]


def test_prefetch_configuration_errors_say_what_to_do(deep):
    with pytest.raises(MoetierError, match="needs a predictor"):
        EngineConfig(prefetch="hobbit")
    with pytest.raises(MoetierError, match="unknown prefetcher 'nope'"):
        EngineConfig(prefetch="nope", predictor="stacked-gates")
    with pytest.raises(MoetierError, match="unknown predictor 'nope'"):
        EngineConfig(predictor="nope")
    _, path = deep
    with pytest.raises(MoetierError, match="needs counts"):
        Engine(Store(path), EngineConfig(prefetch="hobbit", predictor="hot"))


def test_a_trained_predictor_learns_online_inside_the_engine(deep):
    """llapor's online updates run inside the engine's inference mode, and leave the output exact."""
    import numpy as np

    from moetier.predict import make_predictor
    from moetier.predictor_files import train_nets

    _, path = deep
    store = Store(path)
    spec = store.spec
    rng = np.random.default_rng(0)
    n, layers = 64, list(spec.moe_layers)
    ids = np.stack([[rng.choice(spec.num_experts, spec.top_k, replace=False) for _ in layers] for _ in range(n)])
    nets = train_nets("llapor", rng.standard_normal((n, len(layers), spec.hidden_size)).astype(np.float16),
                      ids.astype(np.int16), np.full(ids.shape, 0.5, np.float16), np.zeros(n, np.int32), layers,
                      spec.num_experts, epochs=1)
    predictor = make_predictor("llapor", layers, spec.num_experts, spec.top_k, nets=nets, online_every=1)
    before = [t.clone() for t in nets[layers[0]].parameters()]
    config = EngineConfig(expert_memory=MemoryBudget.parse("30%"), prefetch="hobbit", predictor="llapor")
    with Engine(store, config, predictor=predictor) as engine:
        out = engine.generate(prompts([6]), max_new_tokens=14, ignore_eos=True)
    with Engine.from_pretrained(path, expert_memory="100%") as engine:
        assert out.token_ids == engine.generate(prompts([6]), max_new_tokens=14, ignore_eos=True).token_ids
    assert any(not torch.equal(a, b) for a, b in zip(before, nets[layers[0]].parameters()))


def test_hobbit_mode_prefetches_low_precision_copies_where_its_loader_would(tiny_store, tmp_path):
    """HOBBIT §3.3 (Fig. 9d–e): with mixed precision, a prefetch reads the copy the loader would choose — some at
    int4 — into that precision's sub-cache, and the statistics still add up byte for byte."""
    import shutil

    from moetier.plan.precision import MixedPrecision
    from moetier.sim.replay import PlanLog
    from moetier.store.variants import add_precisions

    _, path = tiny_store("olmoe", dtype=torch.bfloat16, num_hidden_layers=4)
    shutil.copytree(path, tmp_path / "s")
    add_precisions(tmp_path / "s", "int4", progress=False)
    store = Store(tmp_path / "s")
    config = EngineConfig(expert_memory=MemoryBudget.parse("40%"), precision=MixedPrecision("hobbit"),
                          prefetch="hobbit", predictor="stacked-gates")
    log = PlanLog()
    with Engine(store, config) as engine:
        engine.executor.layer_step.hooks.append(log)
        out = engine.generate(prompts([9, 5]), max_new_tokens=16, ignore_eos=True)
    prefetched = [p.precision for plan in log.plans for p in plan.prefetches]
    assert {"bf16", "int4"} <= set(prefetched)
    sizes = {p: layout.blob_bytes for p, layout in store.manifest.precisions.items()}
    read = sum(sizes[ld.precision] for plan in log.plans for ld in plan.loads) + \
        sum(sizes[p] for p in prefetched)
    s = out.stats
    cancelled = s["prefill"]["prefetch_cancelled"] + s["decode"]["prefetch_cancelled"]
    assert s["prefill"]["bytes_read"] + s["decode"]["bytes_read"] <= read
    assert cancelled > 0 or s["prefill"]["bytes_read"] + s["decode"]["bytes_read"] == read
