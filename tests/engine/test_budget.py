"""The expert budget against the memory this process may take (host and cgroup), decided before anything is
loaded or reserved; a real 1 GiB cgroup where the machine allows creating one."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moetier.config import MemoryBudget
from moetier.engine.engine import MEMORY_MARGIN, plan_budget
from moetier.errors import BudgetError
from moetier.memory import MemoryView
from moetier.store.store import Store
from tests.tiny_models import sparse_store

GiB = 2**30


@pytest.fixture(scope="module")
def huge(tmp_path_factory):
    """16 experts of 192 MiB each (3 GiB), in sparse files."""
    return Store(sparse_store(tmp_path_factory.mktemp("huge") / "store", 2**18))


def fits(store, available):
    return int(available * (1 - MEMORY_MARGIN)) - store.dense_bytes


def test_auto_takes_what_fits_and_says_so(huge):
    view = MemoryView(2 * GiB, "cgroup v2 /box", 4 * GiB, 2 * GiB)
    choice = plan_budget(huge, MemoryBudget.parse("auto"), view)
    slot = huge.native_layout.blob_bytes
    assert choice.slots == fits(huge, 2 * GiB) // slot and choice.cache_bytes <= fits(huge, 2 * GiB)
    assert "asked auto" in choice.note and "cgroup v2 /box: limit 4.0 GiB" in choice.note


@pytest.mark.parametrize("budget", ["2GiB", "60%"])
def test_an_explicit_budget_that_cannot_fit_is_refused_with_what_fits(huge, budget):
    view = MemoryView(2 * GiB, "cgroup v1 /box", 4 * GiB, 2 * GiB)
    with pytest.raises(BudgetError, match="does not fit: 2.0 GiB available") as e:
        plan_budget(huge, MemoryBudget.parse(budget), view)
    assert f"give --expert-memory {fits(huge, 2 * GiB) // 2**20}MiB or less, or auto" in str(e.value)
    assert plan_budget(huge, MemoryBudget.parse("1GiB"), view).cache_bytes == 5 * 192 * 2**20  # what fits runs


def test_a_budget_above_all_experts_reserves_only_the_experts(tiny_store):
    _, path = tiny_store("olmoe")
    store = Store(path)
    choice = plan_budget(store, MemoryBudget.parse("100GB"), MemoryView(GiB, "host"))
    assert choice.cache_bytes == store.total_expert_bytes()


def test_auto_with_too_little_memory_says_what_is_missing(huge):
    with pytest.raises(BudgetError, match="too little memory for one layer's top-2 experts"):
        plan_budget(huge, MemoryBudget.parse("auto"), MemoryView(256 * 2**20, "host"))


def make_cgroup(limit: int) -> Path | None:
    """A memory cgroup of `limit` bytes (v2, or v1's memory hierarchy), or None where this machine refuses."""
    name = f"moetier-test-{os.getpid()}"
    for base, limit_file in ((Path("/sys/fs/cgroup"), "memory.max"),
                             (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes")):
        if not (base / limit_file).exists() and not (base / "cgroup.controllers").exists():
            continue
        try:
            (base / name).mkdir()
        except OSError:
            continue
        try:
            (base / name / limit_file).write_text(str(limit))
            return base / name
        except OSError:
            (base / name).rmdir()
    return None


def run_in(cgroup: Path, *args: str) -> subprocess.CompletedProcess:
    script = f'echo $$ > {cgroup}/cgroup.procs && exec "$0" -m moetier.cli "$@"'
    return subprocess.run(["sh", "-c", script, sys.executable, *args], capture_output=True, text=True, timeout=300)


def test_under_a_1_gib_cgroup(huge):
    cgroup = make_cgroup(GiB)
    if cgroup is None:
        pytest.skip("this machine does not let the test create a memory cgroup")
    try:
        r = run_in(cgroup, "generate", "--prompt", "The sea was", "--max-tokens", "8", "--expert-memory", "auto")
        assert r.returncode == 0, r.stderr
        budget_line = next(line for line in r.stderr.splitlines() if line.startswith("moetier: expert cache"))
        assert f"cgroup v{1 + ('memory.max' in os.listdir(cgroup))} /{cgroup.name}: limit 1.0 GiB" in budget_line
        r = run_in(cgroup, "generate", "--model", str(huge.path), "--prompt", "x", "--expert-memory", "2GB")
        assert r.returncode == 1 and "does not fit" in r.stderr and "limit 1.0 GiB" in r.stderr
        assert "MiB or less, or auto" in r.stderr and "Traceback" not in r.stderr
    finally:
        cgroup.rmdir()


def promised_and_peak(r: subprocess.CompletedProcess) -> tuple[int, int]:
    """(the peak RSS the budget note promised for this run's prompt tokens, the peak RSS the run reached)."""
    import json
    import re

    note = next(line for line in r.stderr.splitlines() if line.startswith("moetier: expert cache"))
    m = re.search(r"peak RSS at most ([\d.]+) (MiB|GiB) .* \+ (\d+) KiB per prompt token", note)
    assert m, note
    base = float(m[1]) * (2**20 if m[2] == "MiB" else 2**30)
    stats = json.loads(r.stdout)["stats"]
    return int(base + int(m[3]) * 1024 * stats["prompt_tokens"]), stats["peak_rss_bytes"]


@pytest.mark.parametrize("args", [
    ["--model", "demo-fine", "--expert-memory", "30%"],
    ["--model", "demo-deep", "--expert-memory", "100%", "--prompt-file", "{long}", "--prompt-file", "{long}"],
])
def test_peak_rss_stays_within_what_the_budget_note_promises(tmp_path, args):
    long = tmp_path / "long.txt"
    long.write_text("The sea was calm and the ship went on through the night. " * 60)  # ~700 tokens
    args = [a.format(long=long) for a in args]
    if "--prompt-file" not in args:
        args += ["--prompt", "The sea was"]
    command = [sys.executable, "-m", "moetier.cli", "generate", *args, "--max-tokens", "16", "--json"]
    subprocess.run(command, capture_output=True, timeout=300)  # a first run converts the model (not promised)
    r = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    promised, peak = promised_and_peak(r)
    assert peak <= promised, (peak / 2**20, promised / 2**20)


def test_a_neighbour_taking_memory_in_the_same_cgroup_leaves_moetier_running(tmp_path):
    """Memory pressure without --adapt: in a 1 GiB cgroup another process takes all that moetier's promise leaves,
    while moetier decodes. Had moetier grown past its promise, the cgroup would run out and one of the two be
    killed; both finish."""
    cgroup = make_cgroup(GiB)
    if cgroup is None:
        pytest.skip("this machine does not let the test create a memory cgroup")
    neighbour = ("import sys, time\nchunks = []\nfor _ in range(int(sys.argv[1])):\n"
                 "    chunks.append(bytearray(8 << 20)); time.sleep(0.02)\nprint('held', flush=True)\ntime.sleep(30)")
    try:
        r = run_in(cgroup, "generate", "--prompt", "The sea was", "--max-tokens", "4", "--json")  # the promise
        promised, _ = promised_and_peak(r)
        room = (GiB - promised - (64 << 20)) // (8 << 20)  # what the promise leaves, less a little slack
        hog = subprocess.Popen(["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$0" -c "$1" {room}',
                                sys.executable, neighbour], stdout=subprocess.PIPE, text=True)
        try:
            r = run_in(cgroup, "generate", "--prompt", "The sea was", "--max-tokens", "48", "--ignore-eos", "--json")
            assert r.returncode == 0, r.stderr  # not killed (-9), not refused
            assert hog.poll() is None  # and the neighbour still holds its memory
        finally:
            hog.kill()
            hog.wait()
    finally:
        cgroup.rmdir()
