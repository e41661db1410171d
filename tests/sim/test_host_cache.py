"""The host tier behind a GPU's cache in the simulator (moetier/sim/host_cache.py, `moetier sim --host-memory`): its
LRU bookkeeping on hand-made keys, and on a trace the disk behind it pricing what it misses. (Against the engine's
own host tier on one trace: tests/engine/test_host_tier.py; the timing on round numbers: tests/sim/
test_executor.py.)"""

import json

import pytest

from moetier.cache.keys import ExpertKey
from moetier.cli import main
from moetier.sim.host_cache import HostCache
from moetier.trace.synthetic import LocalityFit, generate

KEYS = [ExpertKey(layer, e) for layer in (0, 1) for e in range(3)]


def test_least_recently_used_out_and_a_whole_pool_filled_first():
    host = HostCache({"bf16": 2, "int4": 6}, KEYS)
    assert all(host.lookup(k, "int4") for k in KEYS)  # (6 slots for 6 experts: filled, as the engine fills it)
    a, b, c = KEYS[:3]
    for key in (a, b):
        assert not host.lookup(key, "bf16")
        host.admit(key, "bf16")
    assert host.lookup(a, "bf16")  # a is now the most recent: b goes
    host.admit(c, "bf16")
    assert (a, "bf16") in host and (b, "bf16") not in host and (c, "bf16") in host
    assert (host.hits, host.reads) == (7, 3)
    with pytest.raises(ValueError, match="at least one"):
        HostCache({"bf16": 0}, KEYS)
    with pytest.raises(ValueError, match="no int8 slots"):
        host.lookup(a, "int8")


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "olmoe"
    generate(LocalityFit(0.8, 0.4, 0.0, "hand-made"), 2, 64, 8, 60, seed=2, model="olmoe-1b-7b").save(path)
    return path


def sim(trace, capsys, *extra: str) -> dict:
    assert main(["sim", "--trace", str(trace), "--profile", "h200-pcie5", "--model-shape", "olmoe-1b-7b",
                 "--expert-memory", "25%", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_host_tier_holding_every_expert_is_the_profiles_own_tier_and_a_smaller_one_reads_from_disk(trace, capsys):
    plain, whole, small = sim(trace, capsys), sim(trace, capsys, "--host-memory", "100%"), \
        sim(trace, capsys, "--host-memory", "30%")
    assert plain["host_tier"] is None and whole["host_tier"]["reads"] == 0 and whole["host_tier"]["hits"] > 0
    assert whole["tpot_s"] == pytest.approx(plain["tpot_s"]) and whole["hit_rate"] == small["hit_rate"]
    assert small["host_tier"]["reads"] > 0 and small["tpot_s"] > 1.5 * whole["tpot_s"]  # (the disk at 1.36 GB/s)
    assert small["miss_penalty_s"] > whole["miss_penalty_s"]


def test_a_profile_with_no_disk_behind_host_memory_is_refused_in_one_line(trace, capsys):
    assert main(["sim", "--trace", str(trace), "--profile", "a100-pcie4", "--model-shape", "olmoe-1b-7b",
                 "--expert-memory", "25%", "--host-memory", "50%"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("moetier: error: --host-memory needs a profile with a disk tier") and len(err) == 2


@pytest.mark.parametrize("host, says", [("0", "--host-memory 0 (no host tier) is not simulated"),
                                        ("lots", "host memory"), ("1KiB", "holds no")])
def test_a_host_tier_it_cannot_simulate_is_refused_in_one_line(trace, capsys, host, says):
    assert main(["sim", "--trace", str(trace), "--profile", "h200-pcie5", "--model-shape", "olmoe-1b-7b",
                 "--expert-memory", "25%", "--host-memory", host]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("moetier: error:") and says in err[0] and len(err) == 2
