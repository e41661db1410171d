"""The expert budget against the memory this process may take (host and cgroup), decided before anything is
loaded or reserved; a real 1 GiB cgroup where the machine allows creating one."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moetier.config import MemoryBudget
from moetier.engine.budget import AUTO_PROMPT_TOKENS, PREFILL_BYTES_PER_TOKEN, RUNTIME_BYTES, plan_budget
from moetier.errors import BudgetError
from moetier.memory import MemoryView
from moetier.plan.precision import MixedPrecision
from moetier.store.store import Store
from moetier.store.variants import expert_layouts
from tests.tiny_models import sparse_store

GiB = 2**30


@pytest.fixture(scope="module")
def huge(tmp_path_factory):
    """16 experts of 192 MiB each (3 GiB), in sparse files."""
    return Store(sparse_store(tmp_path_factory.mktemp("huge") / "store", 2**18))


def fits(store, available, auto=False):
    """What a budget may take, for a process holding nothing yet (held=0): the runtime is all to come."""
    return available - RUNTIME_BYTES - store.dense_bytes - (AUTO_PROMPT_TOKENS * PREFILL_BYTES_PER_TOKEN if auto else 0)


def test_auto_takes_what_fits_and_says_so(huge):
    view = MemoryView(2 * GiB, "cgroup v2 /box", 4 * GiB, 2 * GiB)
    choice = plan_budget(huge, MemoryBudget.parse("auto"), view, held=0)
    slot = huge.native_layout.blob_bytes
    assert choice.slots == fits(huge, 2 * GiB, auto=True) // slot
    assert "asked auto" in choice.note and "cgroup v2 /box: limit 4.0 GiB" in choice.note


def test_auto_leaves_only_the_measured_overhead_not_a_share(huge):
    """With room for every expert and the measured overhead, auto takes every expert (a fixed 20% margin would
    leave 725 MiB unused and hold 15 of the 16). What this process already holds is already in the view's usage,
    so it is not left twice."""
    slot = huge.native_layout.blob_bytes
    overhead = RUNTIME_BYTES + AUTO_PROMPT_TOKENS * PREFILL_BYTES_PER_TOKEN
    view = MemoryView(huge.total_expert_bytes() + huge.dense_bytes + overhead, "cgroup v2 /box", 8 * GiB, 4 * GiB)
    fresh = plan_budget(huge, MemoryBudget.parse("auto"), view, held=0)
    assert fresh.slots == 16 and int(view.available * 0.8 - huge.dense_bytes) // slot == 15
    short = MemoryView(view.available - 1, "host")
    assert plan_budget(huge, MemoryBudget.parse("auto"), short, held=0).slots == 15
    assert plan_budget(huge, MemoryBudget.parse("auto"), short, held=RUNTIME_BYTES).slots == 16


def test_where_memory_is_short_auto_leaves_less_for_the_prompt_before_refusing(huge):
    """One layer's top-k and the runtime fit, a 1,024-token prompt besides does not: auto still runs, with the top-k
    and room for a shorter prompt (it refused here before)."""
    slot, k = huge.native_layout.blob_bytes, huge.spec.top_k
    view = MemoryView(huge.dense_bytes + RUNTIME_BYTES + k * slot + 3 * PREFILL_BYTES_PER_TOKEN, "host")
    choice = plan_budget(huge, MemoryBudget.parse("auto"), view, held=0)
    assert choice.slots == k
    assert plan_budget(huge, MemoryBudget.parse("auto"), MemoryView(view.available + slot, "host"), held=0).slots == k
    with pytest.raises(BudgetError, match="too little memory"):
        plan_budget(huge, MemoryBudget.parse("auto"), MemoryView(view.available - 4 * PREFILL_BYTES_PER_TOKEN,
                                                                  "host"), held=0)


@pytest.mark.parametrize("budget", ["2GiB", "60%"])
def test_an_explicit_budget_that_cannot_fit_is_refused_with_what_fits(huge, budget):
    view = MemoryView(2 * GiB, "cgroup v1 /box", 4 * GiB, 2 * GiB)
    with pytest.raises(BudgetError, match="does not fit: 2.0 GiB available") as e:
        plan_budget(huge, MemoryBudget.parse(budget), view, held=0)
    assert f"give --expert-memory {fits(huge, 2 * GiB) // 2**20}MiB or less, or auto" in str(e.value)
    assert plan_budget(huge, MemoryBudget.parse("1GiB"), view, held=0).cache_bytes == 5 * 192 * 2**20  # fits, runs


def test_a_budget_above_all_experts_reserves_only_the_experts(tiny_store):
    _, path = tiny_store("olmoe")
    store = Store(path)
    choice = plan_budget(store, MemoryBudget.parse("100GB"), MemoryView(GiB, "host"))
    assert choice.cache_bytes == store.total_expert_bytes()


@pytest.mark.parametrize("mode", ["int8", "int4", "int2"])
def test_a_uniform_precision_counts_the_budget_in_its_own_copies(tiny_store, mode):
    """100% of an int4 run is every int4 copy (not 100% of the bf16 bytes filled with int4 slots), and the note
    counts int4 slots; a mixed mode keeps the model's own precision as its unit."""
    _, path = tiny_store("olmoe")
    store = Store(path)
    layout = expert_layouts(store.spec, [mode])[mode]
    n = store.spec.num_expert_keys
    full = plan_budget(store, MemoryBudget.parse("100%"), MemoryView(GiB, "host"), MixedPrecision(mode))
    assert (full.slots, full.cache_bytes, full.precision) == (n, n * layout.blob_bytes, mode)
    assert f"({n} {mode} slots, 100% of" in full.note
    half = plan_budget(store, MemoryBudget.parse("50%"), MemoryView(GiB, "host"), MixedPrecision(mode))
    assert half.slots == n // 2
    mixed = plan_budget(store, MemoryBudget.parse("50%"), MemoryView(GiB, "host"), MixedPrecision("hobbit"))
    native = store.manifest.native_precision
    assert mixed.cache_bytes == (n // 2) * store.native_layout.blob_bytes and mixed.precision == native


def test_auto_with_too_little_memory_says_what_is_missing(huge):
    with pytest.raises(BudgetError, match="too little memory for one layer's top-2 experts"):
        plan_budget(huge, MemoryBudget.parse("auto"), MemoryView(256 * 2**20, "host"), held=0)


def test_loading_that_would_not_fit_beside_the_dense_weights_is_refused_before_it_starts(huge):
    """Quantizing the dense weights while loading holds the largest float tensor and its copy beside what is kept,
    before the cache exists: where even that does not fit, refused in one line (a kill by the cgroup otherwise)."""
    from moetier.model.dense_quant import dense_load_bytes

    tensors = huge.dense_tensors()
    load = dense_load_bytes(tensors, "int4")
    largest = max(nbytes for name, (_, nbytes) in tensors.items() if name != "norm")
    assert dense_load_bytes(tensors, "native") == 0 and 0 < load <= 2 * largest

    def refusal(available: int) -> str:
        try:
            plan_budget(huge, MemoryBudget.parse("auto"), MemoryView(available, "host"), held=RUNTIME_BYTES,
                        load_bytes=load)
            return ""
        except BudgetError as e:
            return str(e)

    assert "to load the dense weights" not in refusal(huge.dense_bytes + load)  # (the cache is another check)
    assert "too little memory to load the dense weights" in refusal(huge.dense_bytes + load - 1)


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
