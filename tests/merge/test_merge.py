"""`moetier merge`'s store runs as a model of its own: fewer experts on disk, each layer's groups in its config, and
the engine's logits equal transformers' carrying the same merged model (its router summing each group's
probabilities, every id of a group computing the merged expert) — resident and offloaded; what it cannot merge is
refused before anything is written."""

import copy
import dataclasses
import types

import pytest
import torch
import torch.nn.functional as F

from moetier.config import MemoryBudget
from moetier.engine.engine import Engine, EngineConfig
from moetier.errors import MoetierError
from moetier.memory import MemoryView
from moetier.merge.merge import MergeSettings, merge_store
from moetier.merge.plan import AdaptiveRatio, FixedRatio
from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.plan.precision import MixedPrecision
from moetier.plan.substitute import Substitution
from moetier.predict.grouped import GroupedPredictor
from moetier.store.store import Store
from moetier.trace.record import TraceRecorder

FAMILIES = {"olmoe": {"num_experts": 8}, "mixtral": {"num_local_experts": 8}, "qwen2_moe": {"num_experts": 8}}


def calibration(store, prompts: int = 4, tokens: int = 48, gate_inputs: bool = True):
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(3, 128, (tokens,), generator=g).tolist() for _ in range(prompts)]
    with Engine.from_pretrained(store, expert_memory="100%", progress=False) as engine, \
            TraceRecorder(engine, gate_inputs=gate_inputs) as rec:
        for p in ids:
            engine.generate([p], max_new_tokens=1)
        return rec.trace([str(i) for i in range(prompts)])


@pytest.fixture(scope="module")
def merged(tmp_path_factory, tiny_store):
    made = {}

    def get(family: str):
        if family not in made:
            ref, store = tiny_store(family, **FAMILIES[family])
            out = tmp_path_factory.mktemp("merged") / family
            made[family] = ref, store, merge_store(store, out, calibration(store), MergeSettings(FixedRatio(0.5)),
                                                   progress=False)
        return made[family]

    return get


def merged_reference(ref, report):
    """The transformers model with the merged model's routing and experts: each gate sums its group's
    probabilities into the principal (Eq. 30's router, as MergedRouter), each expert id computes its group's
    merged expert. A copy: the session's reference model stays as built."""
    ref, store = copy.deepcopy(ref), Store(report.path)
    spec = store.spec
    gates = [m for m in ref.modules() if type(m).__name__.endswith("TopKRouter")]
    experts = [m for m in ref.modules() if type(m).__name__.endswith("Experts") and hasattr(m, "gate_up_proj")]
    assert len(gates) == len(experts) == len(spec.moe_layers)
    for layer, groups, gate, ex in zip(spec.moe_layers, spec.expert_groups, gates, experts):
        g = torch.tensor(groups)
        with torch.no_grad():
            for e, principal in enumerate(groups):
                w = store.read_expert(layer, principal)
                ex.gate_up_proj[e].copy_(w["gate_up_proj"])
                ex.down_proj[e].copy_(w["down_proj"])

        def forward(self, h, g=g):
            h = h.reshape(-1, self.weight.shape[1])
            logits = F.linear(h, self.weight)
            sums = torch.zeros_like(logits).index_add_(1, g, F.softmax(logits.float(), dim=-1))
            top, ids = torch.topk(sums.masked_fill(g != torch.arange(len(g)), -1.0), self.top_k, dim=-1)
            if getattr(self, "norm_topk_prob", True):  # (Mixtral's router always renormalises)
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), ids

        gate.forward = types.MethodType(forward, gate)
    return ref


def logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    kv = KVCache(engine.spec, 1, len(ids), engine.model.dtype)
    return engine.model.forward(StepBatch.prefill([ids], [0]), kv, all_logits=True).float()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_merged_store_computes_the_merged_model(merged, family):
    ref, store, report = merged(family)
    src, out = Store(store), Store(report.path)
    assert report.kept == (4, 4) and report.bytes_after * 2 == report.bytes_before
    assert {(b.layer, b.expert) for b in out.manifest.blobs} == set(out.spec.expert_keys())
    assert len(out.manifest.blobs) == 8 and out.spec.num_expert_keys == 8
    assert out.dense_tensors().keys() == src.dense_tensors().keys()
    ids = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        original = ref(torch.tensor([ids])).logits[0].float()
        expected = merged_reference(ref, report)(torch.tensor([ids])).logits[0].float()
    assert (original - expected).abs().max() > 1e-2  # merging changed the model (the check below could fail)
    slot = out.native_layout.blob_bytes
    for budget in (MemoryBudget("share", 1.0), MemoryBudget("bytes", 2 * slot)):  # resident; one layer's top-2
        with Engine(out, EngineConfig(expert_memory=budget)) as engine:
            torch.testing.assert_close(logits(engine, ids), expected, atol=1e-4, rtol=1e-4)


def test_a_merged_model_generates_and_reads_only_what_it_kept(merged):
    _, _, report = merged("olmoe")
    with Engine.from_pretrained(report.path, expert_memory="100%", progress=False) as engine:
        out = engine.generate([[5, 9, 17, 33]], max_new_tokens=12)
        assert len(out.token_ids[0]) == 12 and out.stats["total_expert_bytes"] == report.bytes_after
        assert out.stats["expert_slots"] == 8


def test_adaptive_retention_keeps_per_layer_counts(tiny_store, tmp_path):
    _, store = tiny_store("olmoe", **FAMILIES["olmoe"])
    trace = calibration(store)
    report = merge_store(store, tmp_path / "adaptive", trace, MergeSettings(AdaptiveRatio(0.2, 0.1)), progress=False)
    spec = Store(report.path).spec
    assert all(2 <= k <= 8 for k in report.kept)  # never fewer than top-2
    assert tuple(len(set(g)) for g in spec.expert_groups) == report.kept
    assert spec.hf_config["moetier_merged"]["method"] == "adaptive-0.2-0.1"


def test_what_cannot_be_merged_is_refused_before_anything_is_written(merged, tiny_store, tmp_path):
    _, store, report = merged("olmoe")
    trace = calibration(store, prompts=1, tokens=8)
    settings = MergeSettings(FixedRatio(0.5))
    with pytest.raises(MoetierError, match="merged already"):
        merge_store(report.path, tmp_path / "again", trace, settings, progress=False)
    with pytest.raises(MoetierError, match="no router inputs"):
        merge_store(store, tmp_path / "x", calibration(store, 1, 8, gate_inputs=False), settings, progress=False)
    _, other = tiny_store("mixtral", **FAMILIES["mixtral"], num_experts_per_tok=3)
    with pytest.raises(MoetierError, match="not of this model"):
        merge_store(other, tmp_path / "y", trace, settings, progress=False)
    _, v3 = tiny_store("deepseek_v3")
    with pytest.raises(MoetierError, match="router is 'noaux-tc'"):
        merge_store(v3, tmp_path / "z", trace, settings, progress=False)
    with pytest.raises(MoetierError, match="merges an encoder-decoder's encoder"):
        merge_store(store, tmp_path / "z", trace, MergeSettings(FixedRatio(0.5), scope="encoder"), progress=False)
    with pytest.raises(MoetierError, match="--scope must be one of"):
        MergeSettings(FixedRatio(0.5), scope="decoder")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(MoetierError):
        merge_store(store, tmp_path / "mine", trace, settings, progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert not any((tmp_path / n).exists() for n in ("again", "x", "y", "z"))


@pytest.mark.parametrize("mode", ["int4", "hobbit", "low-tier"])
def test_a_merged_store_quantizes_and_runs_in_every_precision_mode(tiny_store, tmp_path, mode):
    """Its quantized copies are of the experts it holds; each mode reads only those (a merged-away id is never
    routed to, so never looked for)."""
    from moetier.store.variants import add_precisions

    _, store = tiny_store("olmoe", dtype=torch.bfloat16, num_experts=8, num_hidden_layers=3)
    report = merge_store(store, tmp_path / "merged", calibration(store), MergeSettings(FixedRatio(0.5)),
                         progress=False)
    add_precisions(report.path, "int8,int4", progress=False)
    out = Store(report.path)
    assert {(b.layer, b.expert) for b in out.manifest.blobs if b.precision == "int4"} == set(out.spec.expert_keys())
    config = EngineConfig(expert_memory=MemoryBudget.parse("60%"), precision=MixedPrecision(mode))
    with Engine(out, config) as engine:
        result = engine.generate([[5, 9, 17, 33, 2, 40]], max_new_tokens=16, ignore_eos=True)
    assert len(result.token_ids[0]) == 16


def test_alignment_changes_nothing_an_expert_computes_and_principal_members_keep_its_weights(merged, tmp_path):
    from moetier.merge.merge import aligned, permuted
    from moetier.merge.similarity import expert_output

    _, store, _ = merged("olmoe")
    src = Store(store)
    a, b = src.read_expert(0, 1), src.read_expert(0, 2)
    x = torch.randn(5, src.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(expert_output(aligned(b, a), x), expert_output(b, x))
    shuffled = permuted(a, torch.randperm(a["down_proj"].shape[1], generator=torch.Generator().manual_seed(1)))
    for name, t in aligned(shuffled, a).items():  # a unit order undone: matched back exactly
        torch.testing.assert_close(t, a[name], rtol=0, atol=0)
    principal = MergeSettings(FixedRatio(0.5), members="principal")  # its own weights: no refit, unless asked
    assert principal.refit == "none" and MergeSettings(FixedRatio(0.5)).refit is None  # (by the experts' size:)
    small, large = src.spec, dataclasses.replace(src.spec, moe_intermediate_size=1 << 20)
    assert MergeSettings(FixedRatio(0.5)).refit_for(small) == "all"
    assert MergeSettings(FixedRatio(0.5)).refit_for(large) == "down"
    assert MergeSettings(FixedRatio(0.5), refit="none").refit_for(small) == "none"
    with pytest.raises(MoetierError, match="keeps each principal's own weights"):
        MergeSettings(FixedRatio(0.5), members="principal", refit="down")
    report = merge_store(store, tmp_path / "p", calibration(store), principal, progress=False)
    out = Store(report.path)
    for layer in out.spec.moe_layers:
        for p in out.spec.experts_of(layer):
            torch.testing.assert_close(out.read_expert(layer, p)["down_proj"], src.read_expert(layer, p)["down_proj"],
                                       rtol=0, atol=0)


def test_experts_identical_in_pairs_merge_into_half_the_experts_and_the_same_outputs(tmp_path):
    """A Mixtral whose experts (and router rows) are identical in pairs, top-1: the router picks a member of the best
    pair, the merged one that pair's group; with Mixtral's renormalisation both weigh it 1 — so half the experts
    compute the same logits. (At top-k > 1 this cannot hold: the original may spend two of its k on one pair's
    twins, the merged model spends them on two groups.)"""
    from transformers import AutoModelForCausalLM

    from moetier.store.convert import convert
    from tests.tiny_models import build_tiny

    model = build_tiny("mixtral", tmp_path / "hf", top_k=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or name.endswith("gate.weight"):  # [E, ...]: odd ones copy their even twin
                p[1::2] = p[0::2]
    model.save_pretrained(tmp_path / "hf")
    store = convert(tmp_path / "hf", tmp_path / "store", progress=False)
    trace = calibration(store, prompts=6, tokens=64)
    # twins tie exactly, and torch.topk breaks ties now one way, now the other: counted as the even twin's, so the
    # four principals are one of each pair (split, both twins of a busy pair could outrank a quiet pair)
    trace = dataclasses.replace(trace, topk_ids=trace.topk_ids // 2 * 2)
    report = merge_store(store, tmp_path / "merged", trace, MergeSettings(FixedRatio(0.5)), progress=False)
    spec = Store(report.path).spec
    assert report.kept == (4, 4) and all(g[2 * j] == g[2 * j + 1] for g in spec.expert_groups for j in range(4))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].float()
    with Engine(Store(report.path), EngineConfig(expert_memory=MemoryBudget("share", 1.0))) as engine:
        torch.testing.assert_close(logits(engine, ids), expected, atol=1e-5, rtol=1e-5)


def test_an_engine_switches_between_a_model_and_its_merged_variant_between_calls(merged, tiny_store):
    """use_variant: the same engine (its dense weights, tokenizer, kernels) runs the merged experts from the next
    call — as a fresh engine on the merged store does — and back; what is not a variant is refused."""
    _, store, report = merged("olmoe")
    prompt = [[5, 9, 17, 33, 2, 40]]

    def tokens(path):
        with Engine(Store(path), EngineConfig(expert_memory=MemoryBudget.parse("100%"))) as engine:
            return engine.generate(prompt, max_new_tokens=12, ignore_eos=True).token_ids[0]

    alone = {"original": tokens(store), "merged": tokens(report.path)}
    assert alone["original"] != alone["merged"]
    with Engine(Store(store), EngineConfig(expert_memory=MemoryBudget.parse("100%"))) as engine:
        dense = engine.model.w
        assert engine.generate(prompt, max_new_tokens=12, ignore_eos=True).token_ids[0] == alone["original"]
        engine.use_variant(report.path)
        assert engine.model.w is dense and engine.store.path == report.path and engine.executor.slots == 8
        assert engine.generate(prompt, max_new_tokens=12, ignore_eos=True).token_ids[0] == alone["merged"]
        engine.use_variant(store)
        assert engine.generate(prompt, max_new_tokens=12, ignore_eos=True).token_ids[0] == alone["original"]
        _, other = tiny_store("mixtral", **FAMILIES["mixtral"])
        with pytest.raises(MoetierError, match="is not a variant of"):
            engine.use_variant(other)


def test_an_encoder_decoder_engine_switches_to_its_merged_variant(tiny_store, tmp_path):
    """use_variant on a Switch Transformers engine (no decode graphs on its model: closing the old model's graphs
    must not assume them); the variant's generation runs."""
    _, store = tiny_store("switch_transformers")
    report = merge_store(store, tmp_path / "merged", calibration(store), MergeSettings(FixedRatio(0.5)),
                         progress=False)
    with Engine(Store(store), EngineConfig(expert_memory=MemoryBudget.parse("100%"))) as engine:
        engine.use_variant(report.path)
        assert engine.store.path == report.path
        assert len(engine.generate([[5, 9, 17]], max_new_tokens=4, ignore_eos=True).token_ids[0]) == 4


def test_adapt_with_variants_switches_down_when_memory_goes_and_back_when_it_holds(merged, tmp_path):
    """CoMoE Eq. 17, 34-35 between requests: a library of the original and its half; the memory falls below what
    the original needs resident (E'(t) under its 16 experts: the half switched to at the next call, at once), then
    comes back and holds (switched back once it has held `hold` looks and the gain outweighs the refill)."""
    from moetier.engine.adapt_variant import AdaptVariant
    from moetier.merge.library import Library, Variant

    _, store, report = merged("olmoe")
    original, half = Store(store), Store(report.path)
    library = Library(str(store), (
        Variant("original", str(store), original.total_expert_bytes(), (8, 8), {"perplexity_change": 0.0}),
        Variant("fixed-medium", str(report.path), half.total_expert_bytes(), (4, 4), {"perplexity_change": 0.2})))
    library.save(tmp_path)
    prompt = [[5, 9, 17, 33]]
    config = EngineConfig(expert_memory=MemoryBudget.parse("100%"), adapt=True, variants=str(tmp_path))
    with Engine(original, config) as engine:
        hook = engine.adapt_variant
        assert isinstance(hook, AdaptVariant) and hook.current().name == "original"
        engine.step_hooks.remove(hook)  # (looked at by hand below, once a call)
        dense, whole, halved = engine.dense_bytes, original.total_expert_bytes(), half.total_expert_bytes()
        lines, ticks = [], iter(range(10**6))
        room = iter([10 * whole] * 2 + [dense + halved + whole // 4 - engine.executor.reserved_bytes - dense] * 3
                    + [10 * whole] * 12)
        hook.memory = lambda: MemoryView(int(next(room)), "host")
        hook.clock, hook.say = lambda: float(next(ticks)), lines.append
        names, targets = [], []
        for _ in range(17):
            hook()
            engine.generate(prompt, max_new_tokens=2)  # (a switch asked for is made at the start of a call)
            names.append(hook.current().name)
            targets.append(hook.target)
        assert names[:2] == ["original"] * 2 and "fixed-medium" in names[2:5] and names[-1] == "original"
        # Eq. 17's E'(t), the experts after aggregation the memory allows: all 16 with room, fewer than the
        # original's while the memory is short (the half's 8 chosen), all 16 again once it has held
        assert targets[:2] == [16, 16] and max(targets[2:5]) < 16 and targets[-1] == 16
        assert hook.switches[0] == ("original", "fixed-medium") and hook.switches[-1] == ("fixed-medium", "original")
        assert any("switch to fixed-medium" in line for line in lines)
        hook.pending = Variant("gone", str(tmp_path / "gone"), 1, (1,))  # a switch that cannot be made
        assert len(engine.generate(prompt, max_new_tokens=2).token_ids[0]) == 2  # the call runs as it was
        assert hook.current().name == "original" and lines[-1].startswith("moetier: adapt: stayed on original")
    with pytest.raises(MoetierError, match="needs --adapt"):
        EngineConfig(variants=str(tmp_path))


@pytest.fixture(scope="module")
def with_low_copies(tmp_path_factory, tiny_store):
    """An original (its own copy) and its half-merge, both with int4 copies of their experts (mixed precision)."""
    from moetier.store.variants import add_precisions

    _, store = tiny_store("olmoe", copy=True, **FAMILIES["olmoe"])
    report = merge_store(store, tmp_path_factory.mktemp("merged-int4") / "half", calibration(store),
                         MergeSettings(FixedRatio(0.5)), progress=False)
    for path in (store, report.path):
        add_precisions(path, ["int4"], progress=False)
    return store, report.path


SWITCHED = {  # CoMoE Algorithm 7: the coarse level's switch under each of the fine level's mechanisms
    "predict+prefetch+eq38+hobbit": dict(predictor="stacked-gates", prefetch="comoe-37", policy="comoe",
                                         precision=MixedPrecision("hobbit")),
    "substitution+placement": dict(predictor="stacked-gates", prefetch="comoe", substitution=Substitution(0.3),
                                   placement="greedy"),
}


@pytest.mark.parametrize("mechanisms", SWITCHED)
def test_a_switched_engine_writes_what_a_fresh_one_on_the_variant_writes(with_low_copies, mechanisms):
    """A variant switch under prediction, prefetch, Eq. 38's eviction and mixed precision (or substitution and
    placement): the same engine, switched to the merged variant and back, writes each time the tokens a fresh
    engine on that variant writes (a merged variant's predictions grouped onto its principals: never a
    merged-away id asked of its store)."""
    store, half = with_low_copies
    config = EngineConfig(expert_memory=MemoryBudget.parse("50%"), **SWITCHED[mechanisms])
    first, second = [[5, 9, 17, 33, 2, 40]], [[7, 3, 90, 11]]

    def fresh(path):
        with Engine(Store(path), config) as engine:
            return engine.generate(second, max_new_tokens=10, ignore_eos=True).token_ids[0]

    expected = {"original": fresh(store), "merged": fresh(half)}
    assert expected["original"] != expected["merged"]
    with Engine(Store(store), config) as engine:
        engine.generate(first, max_new_tokens=6, ignore_eos=True)
        engine.use_variant(half)
        out = engine.generate(second, max_new_tokens=10, ignore_eos=True)
        assert out.token_ids[0] == expected["merged"] and engine.store.spec.expert_groups
        assert isinstance(engine.executor.layer_step.predictor, GroupedPredictor)  # (its scores on principals)
        engine.use_variant(store)
        assert engine.generate(second, max_new_tokens=10, ignore_eos=True).token_ids[0] == expected["original"]
        assert not isinstance(engine.executor.layer_step.predictor, GroupedPredictor)


def test_switching_refuses_what_holds_one_stores_experts(merged, tmp_path):
    """An engine handed a predictor object (an oracle of one store's trace) cannot switch: use_variant refuses and
    keeps the store it runs; a store not in the library cannot start a variant hook."""
    from moetier.engine.adapt_variant import AdaptVariant
    from moetier.merge.library import Library, Variant
    from moetier.predict.hot import HotPredictor

    _, store, report = merged("olmoe")
    spec = Store(store).spec
    hot = HotPredictor(spec.moe_layers, spec.num_experts, spec.top_k, {i: [1] * 8 for i in spec.moe_layers})
    config = EngineConfig(expert_memory=MemoryBudget.parse("100%"), predictor="hot", prefetch="comoe")
    with Engine(Store(store), config, predictor=hot) as engine:
        with pytest.raises(MoetierError, match="handed a predictor or host tier"):
            engine.use_variant(report.path)
        assert engine.store.path == Store(store).path
        library = Library(str(report.path), (Variant("fixed-medium", str(report.path), 1, (4, 4)),))
        with pytest.raises(MoetierError, match="is not in the library"):
            AdaptVariant(engine, library, lambda: MemoryView(1, "host"))


def test_the_server_switches_variant_between_its_requests(merged, tmp_path):
    """`serve --adapt --variants`: a switch asked for while a request runs waits for it to finish on the variant it
    began on (newcomers wait meanwhile), then is made, and the next request runs the new variant — each request's
    tokens those of its variant alone."""
    import asyncio

    from moetier.engine.request import RequestParams
    from moetier.engine.sampling import SamplingParams
    from moetier.merge.library import Library, Variant
    from moetier.serve.engine_loop import EngineLoop, Sink
    from moetier.serve.metrics import Metrics

    _, store, report = merged("olmoe")
    original, half = Store(store), Store(report.path)
    Library(str(store), (
        Variant("original", str(store), original.total_expert_bytes(), (8, 8), {"perplexity_change": 0.0}),
        Variant("fixed-medium", str(report.path), half.total_expert_bytes(), (4, 4), {"perplexity_change": 0.2}),
    )).save(tmp_path)
    prompt, new = [5, 9, 17, 33, 2, 40], 10

    def alone(path):
        with Engine(Store(path), EngineConfig(expert_memory=MemoryBudget.parse("100%"))) as engine:
            return engine.generate([prompt], max_new_tokens=new, ignore_eos=True).token_ids[0]

    expected = {"original": alone(store), "merged": alone(report.path)}
    config = EngineConfig(expert_memory=MemoryBudget.parse("100%"), adapt=True, variants=str(tmp_path))
    with Engine(original, config) as engine:
        hook = engine.adapt_variant
        engine.step_hooks.remove(hook)  # (the switch is asked for by hand below)
        hook.say = lambda line: None
        loop = EngineLoop(engine, 2, 64, None, metrics := Metrics())
        loop.start()
        params = RequestParams(SamplingParams(max_new_tokens=new), ignore_eos=True)

        async def tokens_of(sink: Sink, first: asyncio.Event | None = None) -> list[int]:
            out = []
            while True:
                event = await sink.queue.get()
                out.append(event.token)
                if first is not None:
                    first.set()
                if event.finished:
                    return out

        async def run():
            a, b = Sink(asyncio.get_running_loop()), Sink(asyncio.get_running_loop())
            started = asyncio.Event()
            loop.submit(prompt, params, a)
            task_a = asyncio.create_task(tokens_of(a, started))
            await started.wait()  # the first request runs on the original...
            hook.pending = hook.library.variants[1]  # ...when the switch is asked for
            loop.submit(prompt, params, b)
            return await task_a, await tokens_of(b)

        try:
            got_a, got_b = asyncio.run(run())
        finally:
            loop.stop()
        assert got_a == expected["original"] and got_b == expected["merged"]
        assert engine.store.path == half.path and metrics.variant_switches._value.get() == 1


def switch_calibration(store, prompts: int = 6, tokens: int = 40):
    """A trace of a Switch model on random prompts with router inputs: the encoder's routing of each prompt and the
    decoder's of a few generated tokens."""
    g = torch.Generator().manual_seed(7)
    with Engine.from_pretrained(store, expert_memory="100%", progress=False) as engine, \
            TraceRecorder(engine, gate_inputs=True) as rec:
        for _ in range(prompts):
            engine.generate([torch.randint(3, 128, (tokens,), generator=g).tolist()], max_new_tokens=6,
                            ignore_eos=True)
        return rec.trace([str(i) for i in range(prompts)])


def merged_switch_reference(ref, path):
    """Transformers' Switch model with the merged store's routing and experts: each merged layer's top-1 router sums
    its group's probabilities into the principal and takes the best principal under the capacity (as
    MergedTop1Router), each expert id computes its group's merged expert."""
    ref, store = copy.deepcopy(ref), Store(path)
    spec = store.spec
    sparse = [m for m in ref.modules() if type(m).__name__ == "SwitchTransformersSparseMLP"]  # encoder's, then
    assert len(sparse) == len(spec.moe_layers)  # the decoder's
    for layer, groups, mlp in zip(spec.moe_layers, spec.expert_groups, sparse):
        g = torch.tensor(groups)
        with torch.no_grad():
            for e, principal in enumerate(groups):
                w = store.read_expert(layer, principal)
                mlp.experts[f"expert_{e}"].wi.weight.copy_(w["up_proj"])
                mlp.experts[f"expert_{e}"].wo.weight.copy_(w["down_proj"])
        if list(groups) == list(range(len(groups))):
            continue  # (a layer kept whole routes as it did)

        def forward(self, hidden_states, g=g):
            logits = self.classifier(hidden_states.to(self.dtype))
            probs = F.softmax(logits, dim=-1, dtype=self.dtype).to(hidden_states.dtype)
            sums = torch.zeros_like(probs).index_add_(-1, g, probs)
            top, index = sums.masked_fill(g != torch.arange(len(g)), -1.0).max(dim=-1)
            chosen = F.one_hot(index, num_classes=self.num_experts)
            chosen = chosen * (torch.cumsum(chosen, dim=-2) <= self.expert_capacity)
            return chosen, top.unsqueeze(-1), logits

        mlp.router.forward = types.MethodType(forward, mlp.router)
    return ref


@pytest.mark.parametrize("scope", ["encoder", "all"])
def test_a_merged_switch_model_computes_what_transformers_computes_with_its_merged_routers(tiny_store, tmp_path,
                                                                                           scope):
    """CoMoE's own models: a tiny Switch Transformers checkpoint (encoder and decoder experts, top-1 routers)
    merged to half its experts — the encoder's alone by default (encoder-focused aggregation: the decoder's kept
    whole), or every MoE layer's — runs in the engine with the decoder's logits equal to transformers' carrying the
    same merge, resident and offloaded."""
    from tests.model.test_parity_seq2seq import engine_steps, reference_steps

    ref, store = tiny_store("switch_transformers")
    settings = MergeSettings(FixedRatio(0.5), scope=None if scope == "encoder" else scope)
    report = merge_store(store, tmp_path / "half", switch_calibration(store), settings, progress=False)
    spec = Store(report.path).spec
    encoder = spec.encoder_decoder.encoder_layers
    kept = dict(zip(spec.moe_layers, report.kept))
    assert all(kept[layer] == 4 for layer in spec.moe_layers if layer < encoder or scope == "all")
    assert all(kept[layer] == 8 for layer in spec.moe_layers if layer >= encoder and scope == "encoder")
    assert Store(report.path).manifest.config["moetier_merged"]["scope"] == scope
    reference = merged_switch_reference(ref, report.path)
    torch.manual_seed(1)
    prompt, fed = torch.randint(3, 128, (11,)).tolist(), torch.randint(3, 128, (8,)).tolist()
    expected = reference_steps(reference, prompt, fed)
    assert (expected[-1] - reference_steps(ref, prompt, fed)[-1]).abs().max() > 1e-3  # (the merge changed it)
    for budget in ("100%", "30%"):
        with Engine(Store(report.path), EngineConfig(expert_memory=MemoryBudget.parse(budget))) as engine:
            for i, (ours, theirs) in enumerate(zip(engine_steps(engine, prompt, fed), expected)):
                assert (ours - theirs).abs().max().item() <= 1e-5, f"step {i} differs at {budget}"
