"""Mixed precision in the real engine: every mode runs from the store's quantized copies, reads what its plan
says, and leaves exact mode alone."""


import pytest
import torch

from moetier import Engine
from moetier.config import MemoryBudget
from moetier.engine.engine import EngineConfig
from moetier.errors import MoetierError
from moetier.plan.precision import MixedPrecision
from moetier.store.format import Manifest
from moetier.store.store import Store
from moetier.store.variants import add_precisions


def prompts(vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 12)]


def run(path, mode, memory="100%", **kw):
    config = EngineConfig(expert_memory=MemoryBudget.parse(memory), precision=MixedPrecision(mode, **kw))
    with Engine(Store(path), config) as engine:
        outs = [engine.generate([p], max_new_tokens=10, ignore_eos=True) for p in prompts()]
    return [o.token_ids[0] for o in outs], [o.stats for o in outs]


def test_native_mode_is_exact_mode(quantized, tiny_store):
    _, plain = tiny_store("olmoe", dtype=torch.bfloat16, num_hidden_layers=4)
    assert run(quantized, "native")[0] == run(plain, "native")[0]


def test_uniform_precisions_read_their_own_bytes(quantized):
    manifest = Manifest.load(quantized)
    for mode in ("int8", "int4", "int2"):
        tokens, stats = run(quantized, mode, memory="30%")
        s = stats[0]
        assert s["expert_bytes_read"] == s["prefill"]["loads"] * manifest.precisions[mode].blob_bytes + \
            s["decode"]["loads"] * manifest.precisions[mode].blob_bytes
        assert all(len(t) == 10 for t in tokens)


def test_int8_keeps_most_tokens_and_int2_changes_more(quantized):
    exact = sum(run(quantized, "native")[0], [])
    agree = {m: sum(a == b for a, b in zip(exact, sum(run(quantized, m)[0], []))) / len(exact)
             for m in ("int8", "int2")}
    assert agree["int8"] >= 0.8 and agree["int8"] >= agree["int2"]


def test_hobbit_loads_low_copies_and_skips(quantized):
    _, stats = run(quantized, "hobbit", memory="30%")
    decode = [s["decode"] for s in stats]
    assert sum(d["low_loads"] for d in decode) > 0 and sum(d["skipped"] for d in decode) > 0
    assert all(d["low_runs"] >= d["low_loads"] for d in decode)


def test_low_tier_computes_unimportant_experts_from_resident_low_copies(quantized):
    tokens, stats = run(quantized, "low-tier", memory="60%", low="int2")
    d = stats[0]["decode"]
    assert d["low_runs"] > 0 and d["low_loads"] == 0 and d["skipped"] == 0  # low copies are never read again
    assert stats[0]["expert_cache_bytes"] <= 0.6 * Store(quantized).total_expert_bytes() + 4096 * 64


def test_low_tier_chooses_the_most_precise_low_copy_that_fits(quantized):
    config = EngineConfig(expert_memory=MemoryBudget.parse("100%"), precision=MixedPrecision("low-tier"))
    with Engine(Store(quantized), config) as engine:
        assert engine.precision.low == "int8"
    config = EngineConfig(expert_memory=MemoryBudget.parse("10%"), precision=MixedPrecision("low-tier"))
    with pytest.raises(MoetierError, match="even int2"):
        Engine(Store(quantized), config)


def test_a_user_store_without_the_copies_is_refused_with_the_command(tiny_store):
    _, plain = tiny_store("olmoe", dtype=torch.bfloat16, num_hidden_layers=4)
    with pytest.raises(MoetierError, match="not int4") as e:
        Engine(Store(plain), EngineConfig(precision=MixedPrecision("int4")))
    assert "moetier quantize" in e.value.hint
    assert "int4" not in Manifest.load(plain).precisions  # never changed


def test_a_model_converted_on_first_use_gets_its_copies_on_first_use(tiny_store):
    _, plain = tiny_store("olmoe", dtype=torch.bfloat16, num_hidden_layers=4)
    with Engine.from_pretrained(plain.parent / "hf", precision=MixedPrecision("int4"), progress=False) as engine:
        assert "int4" in engine.store.manifest.precisions
        assert len(engine.generate([prompts()[0]], max_new_tokens=3, ignore_eos=True).token_ids[0]) == 3


def test_a_model_built_in_another_cache_gets_its_copies_there_too(tiny_store, tmp_path):
    """`--cache-dir` elsewhere than the default: the build there is moetier's (its note says so), so a mode's
    copies are added to it on first use, as in the default cache."""
    _, plain = tiny_store("olmoe", dtype=torch.bfloat16, num_hidden_layers=4)
    with Engine.from_pretrained(plain.parent / "hf", precision=MixedPrecision("int4"), cache_dir=tmp_path / "elsewhere",
                                progress=False) as engine:
        assert engine.store.path.is_relative_to(tmp_path / "elsewhere")
        assert "int4" in engine.store.manifest.precisions


def test_a_models_fitted_thresholds_are_its_defaults(quantized):
    from moetier.policy_files import save_thresholds

    path = quantized / "policies" / "thresholds.json"
    save_thresholds(path, 0.3, 0.5, "hand-made")
    try:
        for given, expected in (({}, (0.3, 0.5)), ({"t1": 0.2}, (0.2, 0.5)), ({"t1": 0.4, "t2": 0.8}, (0.4, 0.8))):
            config = EngineConfig(precision=MixedPrecision("hobbit", **given))
            with Engine(Store(quantized), config) as engine:
                assert (engine.precision.t1, engine.precision.t2) == expected
        path.write_text('{"t1": 0.9, "t2": 0.1}')
        with pytest.raises(MoetierError, match="damaged"):
            Engine(Store(quantized), EngineConfig(precision=MixedPrecision("hobbit")))
    finally:
        path.unlink()


def test_train_thresholds_writes_what_the_engine_reads(tmp_path, capsys):
    import json

    from moetier.cli import main
    from tests.test_cli_inputs import olmoe_trace

    olmoe_trace(tokens=60).save(tmp_path / "t")
    out = tmp_path / "thresholds.json"
    assert main(["train", "thresholds", "--trace", str(tmp_path / "t"), "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert 0 <= d["t1"] <= d["t2"] <= 1 and "T1 = " in capsys.readouterr().out


def test_a_copy_another_process_added_meanwhile_is_used_not_refused(tiny_store):
    """Two processes asking for the same quantized copy on first use: the second waits under the store's lock for
    the first, finds the copy there, and must read the manifest again (it refused 'the store holds its experts at
    bf16, not int2')."""
    from moetier.resolve import resolve_model

    ref, path = tiny_store("olmoe", dtype=torch.bfloat16, num_hidden_layers=2)
    cached = resolve_model(path.parent / "hf", progress=False)  # a store moetier converted into its cache
    stale = Store(cached)  # read before the other process added int2
    add_precisions(cached, "int2", progress=False)  # (the other process)
    assert "int2" not in stale.manifest.precisions
    with Engine(stale, EngineConfig(expert_memory=MemoryBudget.parse("50%"), precision=MixedPrecision("int2")),
                progress=False) as engine:
        assert engine.generate([[5, 9, 17]], max_new_tokens=3).token_ids[0]
