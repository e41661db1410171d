"""bench/bench_sim_validation.py's replay — what sim_check.py holds each GPU row against — on a tiny model's trace:
besides the time, what each mechanism did over the measured call's decode steps, counted as the engine's rows count
it (host runs, substituted assignments), so a row whose engine never acted is seen to compare another plan."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from bench_sim_validation import replay  # noqa: E402


@pytest.fixture(scope="module")
def traced(tiny_store, tmp_path_factory):
    """A tiny OLMoE's store and the routing of two calls (warm-up, measured) as sim_check.py records them."""
    from moetier import Engine
    from moetier.trace.record import TraceRecorder

    _, path = tiny_store("olmoe", num_hidden_layers=3)
    with Engine.from_pretrained(path, expert_memory="100%", progress=False) as engine, \
            TraceRecorder(engine, gate_inputs=True) as recorder:
        engine.generate([[5, 9, 11, 14]], max_new_tokens=4, ignore_eos=True)
        engine.generate([[7, 3, 20, 8, 6]], max_new_tokens=8, ignore_eos=True)
        trace = recorder.trace(["warm-up", "measured"])
    return path, trace


@pytest.mark.parametrize("prefetch, counted", [("none", None), ("substitute:0.9", "sim_substituted"),
                                               ("placement:cpu-offload", "sim_host_runs")])
def test_the_replay_counts_what_its_mechanism_did_over_the_decode_steps(traced, prefetch, counted):
    from moetier.sim.profile import HardwareProfile
    from moetier.store.store import Store

    path, trace = traced
    store = Store(path)
    spec = store.spec
    slots = len(spec.moe_layers) * spec.num_experts // 4  # (a quarter of the experts)
    sim = replay(trace, HardwareProfile.load("h200-pcie5"), {"model": str(path), "policy": "lru",
                                                              "prefetch": prefetch},
                 slots, store.native_layout.blob_bytes, 2, False)
    assert sim["sim_tpot_s"] > 0 and 0 <= sim["sim_hit_rate"] <= 1
    for name in ("sim_host_runs", "sim_substituted"):
        assert (sim[name] > 0) == (name == counted), (name, sim[name])
    if counted == "sim_host_runs":  # (llama.cpp's rule: every expert on the host, none loaded)
        assert sim["sim_loads_per_token"] == 0 and sim["sim_hit_rate"] == 0  # (so each expert a layer needs: a run)
        decode_steps = 7  # the measured call's 8 tokens less the one its prefill made
        assert sim["sim_host_runs"] <= decode_steps * len(spec.moe_layers) * spec.top_k


def test_a_policy_that_needs_its_cache_context_is_replayed_as_moetier_sim_builds_it(traced):
    """CoMoE's eviction (bench_gpu.py's `comoe` row) needs the cache it serves (a PolicyContext): built as `moetier
    sim` builds it, its row replays beside LRU's (made without one, it raised)."""
    from moetier.sim.profile import HardwareProfile
    from moetier.store.store import Store

    path, trace = traced
    store = Store(path)
    slots = len(store.spec.moe_layers) * store.spec.num_experts // 4
    sims = {policy: replay(trace, HardwareProfile.load("h200-pcie5"), {"model": str(path), "policy": policy,
                                                                       "prefetch": "none"},
                           slots, store.native_layout.blob_bytes, 2, False) for policy in ("lru", "comoe")}
    assert all(0 < s["sim_tpot_s"] and 0 <= s["sim_hit_rate"] <= 1 for s in sims.values())
