"""Memory pressure, for real: moetier generating inside a memory cgroup with `--adapt` while another process in the
same cgroup takes memory — the engine shrinks its cache instead of being killed, both processes live, the output
continues, and when the memory comes back the cache grows again. Skipped where no memory cgroup can be made."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moetier.store.inflate import inflate
from moetier.store.store import Store

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "peers"))
from cage import make_cage  # noqa: E402

ENGINE = """
import sys, time
from moetier import Engine
engine = Engine.from_pretrained(sys.argv[1], expert_memory="100%", progress=False, adapt=True)
engine.generate([[5, 9, 17]], max_new_tokens=4)
print("ready", engine.executor.slots, flush=True)
end, made = time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < end:
    made += len(engine.generate([[5, 9, 17]], max_new_tokens=16, ignore_eos=True).token_ids[0])
print("done", made, engine.executor.slots, flush=True)
"""
HOG = """
import sys, time
step, total, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
blocks = []
while sum(map(len, blocks)) < total:
    b = bytearray(step)
    b[::4096] = b"\\1" * len(range(0, step, 4096))  # every page touched: really taken
    blocks.append(b)
    time.sleep(0.25)  # ~32 MB/s: a look every 0.25 s sees the memory go 8 MiB at a time
print("held", flush=True)
time.sleep(hold)
print("freed", flush=True)
"""


def usage(cage) -> int:
    return int((cage.path / ("memory.current" if cage.v2 else "memory.usage_in_bytes")).read_text())


def set_limit(cage, limit: int) -> None:
    (cage.path / ("memory.max" if cage.v2 else "memory.limit_in_bytes")).write_text(str(limit))


def test_the_cache_gives_way_to_another_process_and_grows_back(tiny_store, tmp_path):
    _, small = tiny_store("olmoe")
    store = inflate(small, tmp_path / "xl", 16384, progress=False)  # 16 experts of 12 MiB (fp32)
    cache = Store(store).total_expert_bytes()
    cage = make_cage(8 << 30, "moetier-adapt-test")
    if isinstance(cage, str):
        pytest.skip(cage)
    try:
        engine = subprocess.Popen(cage.wrap([sys.executable, "-c", ENGINE, str(store), "16"]), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        ready = engine.stdout.readline().split()
        assert ready and ready[0] == "ready" and int(ready[1]) == 16, engine.stderr.read()[-2000:]
        errors: list[str] = []
        reader = threading.Thread(target=lambda: errors.extend(engine.stderr), daemon=True)
        reader.start()
        margin = 128 << 20
        set_limit(cage, usage(cage) + margin)  # the engine as it is, and 128 MiB free beside it
        start = time.monotonic()
        # another process takes the margin and 60% of the cache's bytes, holds them 3 s, then gives them back
        hog = subprocess.run(cage.wrap([sys.executable, "-c", HOG, str(8 << 20), str(margin + int(0.6 * cache)),
                                        "3"]), capture_output=True, text=True, timeout=120)
        freed_at = time.monotonic() - start
        out, _ = engine.communicate(timeout=120)
        reader.join(timeout=5)
    finally:
        cage.remove()
    assert hog.returncode == 0 and hog.stdout.split() == ["held", "freed"], hog.stderr[-1000:]
    assert engine.returncode == 0, "".join(errors)[-2000:]
    done = out.split()
    assert done[0] == "done" and int(done[1]) > 0
    decisions = [line for line in errors if line.startswith("moetier: adapt: expert cache")]
    sizes = [(int(line.split()[4]), int(line.split()[6])) for line in decisions]  # "cache A -> B slots"
    assert sizes and sizes[0][1] < 16, decisions  # it gave way first
    assert min(b for _, b in sizes) <= 16 * 0.5  # more than half the cache went while the other held on
    assert any(b > a for a, b in sizes), decisions  # and it grew back after
    assert freed_at < 16, decisions  # (the memory came back while the engine was still generating)
