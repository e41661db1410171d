"""The engine end to end on tiny checkpoints: batching, sampling, statistics and its errors."""

import pytest
import torch

from moetier import Engine
from moetier.config import MemoryBudget
from moetier.engine.engine import EngineConfig
from moetier.errors import BudgetError, MoetierError, PromptTooLongError


def prompts(n: int, lengths: list[int], vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths]


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss", "phimoe"])
def test_batch_of_different_lengths_matches_one_at_a_time(tiny_store, family):
    _, path = tiny_store(family)
    batch = prompts(0, [5, 13, 9])
    with Engine.from_pretrained(path, expert_memory="40%") as engine:
        together = engine.generate(batch, max_new_tokens=12, ignore_eos=True).token_ids
    singles = []
    for p in batch:
        with Engine.from_pretrained(path, expert_memory="40%") as engine:
            singles.append(engine.generate([p], max_new_tokens=12, ignore_eos=True).token_ids[0])
    assert together == singles


def test_sequences_stop_at_eos_independently(tiny_store):
    _, path = tiny_store("olmoe")
    with Engine.from_pretrained(path, expert_memory="100%") as engine:
        free = engine.generate(prompts(1, [6, 8]), max_new_tokens=10, ignore_eos=True).token_ids
        eos = free[0][3]
        from moetier.engine.generate import generate
        from moetier.engine.sampling import SamplingParams
        out, _ = generate(engine.model, engine.executor, prompts(1, [6, 8]), SamplingParams(10), eos_ids=(eos,))
    assert out[0] == free[0][:4]  # stopped right after its EOS
    cut = free[1].index(eos) + 1 if eos in free[1] else len(free[1])
    assert out[1] == free[1][:cut]  # the other sequence went on without it


def test_sampling_is_seeded_and_top_p_near_zero_is_greedy(tiny_store):
    _, path = tiny_store("mixtral")
    p = prompts(2, [7])
    with Engine.from_pretrained(path, expert_memory="100%") as engine:
        greedy = engine.generate(p, max_new_tokens=16, ignore_eos=True).token_ids
        a = engine.generate(p, max_new_tokens=16, temperature=1.5, seed=3, ignore_eos=True).token_ids
        b = engine.generate(p, max_new_tokens=16, temperature=1.5, seed=3, ignore_eos=True).token_ids
        c = engine.generate(p, max_new_tokens=16, temperature=1.5, seed=4, ignore_eos=True).token_ids
        nucleus = engine.generate(p, max_new_tokens=16, temperature=1.0, top_p=1e-6, ignore_eos=True).token_ids
    assert a == b and a != c
    assert nucleus == greedy


def test_statistics_follow_the_definitions(tiny_store):
    _, path = tiny_store("qwen3_moe")
    with Engine.from_pretrained(path, expert_memory="100%") as engine:
        assert engine.preload() == 16
        s = engine.generate(prompts(3, [9]), max_new_tokens=8, ignore_eos=True).stats
    assert s["hit_rate"] == 1.0 and s["expert_bytes_read"] == 0 and s["expert_bytes_per_token"] == 0
    assert s["new_tokens"] == 8 and s["decode"]["layer_steps"] == 7 * 2  # 7 decode steps x 2 MoE layers
    assert s["tpot_p50_s"] <= s["tpot_p90_s"] and s["ttft_s"] > 0

    with Engine.from_pretrained(path, expert_memory="25%") as engine:
        s = engine.generate(prompts(3, [9]), max_new_tokens=8, ignore_eos=True).stats
        slot = engine.executor.pool.slot_bytes
    for phase in ("prefill", "decode"):
        c = s[phase]
        assert c["bytes_read"] == c["loads"] * slot and c["loads"] == c["needed"] - c["hits"]
    assert s["expert_bytes_per_token"] == s["decode"]["bytes_read"] / 7
    assert 0 <= s["hit_rate"] < 1


def test_budget_too_small_says_the_minimum(tiny_store):
    _, path = tiny_store("olmoe")
    with pytest.raises(BudgetError, match=r"(?s)top-2 needs 2.*at least \d+ bytes"):
        Engine.from_pretrained(path, expert_memory="4KiB")
    with pytest.raises(BudgetError, match="top-2"):
        Engine.from_pretrained(path, expert_memory="1%")


def test_prompt_longer_than_the_context_window(tiny_store):
    _, path = tiny_store("olmoe")
    with Engine.from_pretrained(path, expert_memory="50%") as engine:
        with pytest.raises(PromptTooLongError, match="context window is 256"):
            engine.generate([[5] * 300], max_new_tokens=4)
        with pytest.raises(MoetierError, match="empty"):
            engine.generate([[]], max_new_tokens=4)
        with pytest.raises(MoetierError, match=r"outside the vocabulary \[0, 128\): \[128, -1\]"):
            engine.generate([[5, 128, -1]], max_new_tokens=4)


def test_generation_stops_at_the_context_window(tiny_store):
    _, path = tiny_store("olmoe")
    with Engine.from_pretrained(path, expert_memory="50%") as engine:
        out = engine.generate([[5] * 250], max_new_tokens=20, ignore_eos=True)
    assert len(out.token_ids[0]) == 256 - 250 + 1  # the last token is sampled but never fed back


def test_hugging_face_folder_is_converted_once_into_the_cache(tiny_store, tmp_path):
    from moetier.store.format import Manifest

    ref, store_path = tiny_store("mixtral")
    hf = Manifest.load(store_path).source
    Engine.from_pretrained(hf, cache_dir=tmp_path, progress=False).close()
    made = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]  # beside it: the conversion's lock file
    assert len(made) == 1 and (made[0] / "manifest.json").exists()
    mtime = (made[0] / "manifest.json").stat().st_mtime_ns
    Engine.from_pretrained(hf, cache_dir=tmp_path, progress=False).close()
    assert (made[0] / "manifest.json").stat().st_mtime_ns == mtime  # reused, not converted again


def test_a_closed_engine_refuses_work_instead_of_hanging(tiny_store):
    from moetier.store.store import Store

    _, path = tiny_store("olmoe")
    engine = Engine(Store(path))
    engine.close()
    engine.close()  # closing twice is harmless
    for call in (lambda: engine.generate([[1, 2, 3]], max_new_tokens=2), engine.preload):
        with pytest.raises(MoetierError, match="this Engine is closed"):
            call()


def test_numpys_blas_runs_one_thread_while_an_engine_is_open_and_as_before_once_closed(tiny_store):
    """A policy's products on NumPy's BLAS threads would spin on the cores torch computes on
    (moetier/engine/blas_threads.py): one thread while the engine is open, the caller's setting again after."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from moetier.store.store import Store

    def blas_threads() -> list[int]:
        return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]

    _, path = tiny_store("olmoe")
    with threadpool_limits(limits=2, user_api="blas"):  # as on a 2-core machine, whatever this one has
        assert blas_threads() and set(blas_threads()) == {2}
        engine = Engine(Store(path))
        assert set(blas_threads()) == {1}
        engine.generate([[1, 2, 3]], max_new_tokens=2)
        assert set(blas_threads()) == {1}
        engine.close()
        assert set(blas_threads()) == {2}


def resident_pages(address: int, nbytes: int) -> int:
    """Pages of [address, address + nbytes) in this process's memory now (/proc/self/pagemap's present bit: a
    mapping's own pages, where smaps' Rss counts the neighbours the kernel merged it with)."""
    import mmap
    import struct

    first, last = address // mmap.PAGESIZE, (address + nbytes - 1) // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(8 * first)
        entries = struct.unpack(f"<{last - first + 1}Q", f.read(8 * (last - first + 1)))
    return sum(entry >> 63 for entry in entries)


def test_closing_an_engine_hands_its_expert_cache_back_while_the_engine_object_lives(tiny_store):
    """A closed engine's cache pages go back at `close`, not when the object is collected: a caller keeps the name
    after `with` (a 9 GiB cache of demo-deep-xl stayed resident in a benchmark that opened one engine after
    another, until the next found no room for its own)."""
    import mmap

    from moetier.store.store import Store

    _, path = tiny_store("olmoe")
    with Engine(Store(path), EngineConfig(expert_memory=MemoryBudget.parse("50%"))) as engine:
        engine.generate([[1, 2, 3]], max_new_tokens=2)
        pool = engine.executor.pool
        address = pool.region(0).data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE  # the slots' mapping (a blob may
        assert resident_pages(address, pool.nbytes) > 0                       # start into its first page)
    assert resident_pages(address, pool.nbytes) == 0  # (`engine` still names the slots)


@pytest.mark.parametrize("budget", ["50%", "100%"])
def test_an_engine_dropped_without_close_frees_its_weights_at_once(tiny_store, budget):
    """No cycle holds a dropped engine's weights (its attention layers named their own bound methods, the resident
    step its own): reference counting frees them when the last name goes, not Python's cycle collector some time
    later — a notebook making its engine again; and its reader threads stop."""
    import gc
    import weakref

    from moetier.engine.resident_layers import ResidentLayers
    from moetier.model.attention import Attention
    from moetier.store.store import Store

    _, path = tiny_store("olmoe")
    gc.collect()
    gc.disable()  # (nothing but reference counting may free them)
    try:
        engine = Engine(Store(path), EngineConfig(expert_memory=MemoryBudget.parse(budget)))
        if budget == "100%":
            engine.preload()  # (every expert resident: the steps run from ResidentLayers' tables)
        engine.generate([[1, 2, 3]], max_new_tokens=3)
        held = [weakref.ref(o) for o in gc.get_objects() if type(o) in (Attention, ResidentLayers)]
        assert sum(type(ref()) is ResidentLayers for ref in held) == (budget == "100%")
        threads = list(engine.reader._threads)
        assert threads and all(t.is_alive() for t in threads)
        del engine
        assert all(ref() is None for ref in held)
        assert not any(t.is_alive() for t in threads)  # its reader stopped with it (they waited on its queue)
    finally:
        gc.enable()


@pytest.mark.parametrize("speculate", [0, 2])
def test_a_generate_call_leaves_no_cycle_holding_its_kv_cache(tiny_store, speculate):
    """A call's scheduler and its KV cache are freed when the call returns, not when Python's cycle collector
    next runs (a scheduler and its decode step named each other)."""
    import gc

    from moetier.engine.kv_pool import KVPool
    from moetier.engine.speculative import Speculation
    from moetier.store.store import Store

    _, path = tiny_store("olmoe")
    spec = Speculation(tokens=speculate) if speculate else None
    with Engine(Store(path), EngineConfig(speculation=spec)) as engine:
        gc.collect()
        gc.disable()
        try:
            engine.generate([[1, 2, 3, 1, 2, 3, 1, 2]], max_new_tokens=6, ignore_eos=True)
            assert not [o for o in gc.get_objects() if type(o) is KVPool]
        finally:
            gc.enable()


def test_the_python_apis_bad_arguments_are_moetier_errors_naming_them(tiny_store):
    """(expert_memory=None, a flat list of ids, max_new_tokens=2.5, set_expert_memory(-1), seed=2**70 gave raw
    Python errors.)"""
    import math

    import pytest

    from moetier.errors import MoetierError

    _, path = tiny_store("olmoe")
    for bad in (None, [1], math.nan):
        with pytest.raises(MoetierError, match="expert memory"):
            Engine.from_pretrained(path, expert_memory=bad, progress=False)
    with Engine.from_pretrained(path, expert_memory="50%", progress=False) as engine:
        assert len(engine.generate([5, 9, 17], max_new_tokens=3).token_ids) == 1  # a flat list is one prompt
        for kw, name in ((dict(max_new_tokens=2.5), "max new tokens"), (dict(seed=2**70), "seed"),
                         (dict(temperature=math.nan), "temperature"), (dict(top_kk=1), "top_kk"),
                         (dict(logit_bias=[1, 2]), "logit_bias")):
            with pytest.raises(MoetierError, match=name):
                engine.generate([5, 9], **kw)
        for bad in (-1, None, math.inf):
            with pytest.raises(MoetierError, match="expert memory"):
                engine.set_expert_memory(bad)
        with pytest.raises(MoetierError, match="token ids"):
            engine.generate([[5, "x"]])


def test_a_config_field_given_as_plain_data_where_an_object_is_due_is_refused_in_one_line():
    """EngineConfig's substitution and precision are objects: a dict (what JSON gives) is refused with the class to
    use, before anything loads (it failed later, as an AttributeError deep in the executor)."""
    from moetier.engine.engine import EngineConfig
    from moetier.plan.substitute import Substitution

    with pytest.raises(MoetierError, match="substitution must be a Substitution") as e:
        EngineConfig(substitution={"alpha": 0.35})
    assert "Substitution(alpha=0.35)" in e.value.hint
    with pytest.raises(MoetierError, match="precision must be a MixedPrecision"):
        EngineConfig(precision="hobbit")
    assert EngineConfig(substitution=Substitution(alpha=0.35)).substitution.alpha == 0.35
