"""A store can be trusted: every byte checksummed, conversions killed at any moment leave nothing half-written and
no leftovers, two processes converting one folder share one result, a damaged cache store is re-converted on
request."""

import contextlib
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time

import pytest

from moetier.cli import main
from moetier.errors import ChecksumError, StoreError
from moetier.store.names import DENSE, MANIFEST
from moetier.store.store import Store
from moetier.store.synth import byte_tokenizer
from tests.tiny_models import build_tiny

CHILD = """
import sys
from moetier.resolve import resolve_model
import moetier.store.convert  # (resolve_model imports it when it converts: here, before the race starts)
print("ready", flush=True)
sys.stdin.readline()  # go
print(resolve_model(sys.argv[2], sys.argv[3], progress=True), flush=True)
print("done", flush=True)
"""


def child(*args):
    return subprocess.Popen([sys.executable, "-c", CHILD, *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Conversions:
    """Conversions of `source` each in a process of its own, forked from one that has made the imports (2.7 s of a
    Zen 3's time a process, which twenty-two fresh interpreters paid): `start` forks one and gives its pid, `ended`
    waits for it and gives its exit code (-9 where it was killed)."""

    FORKS = """
import os, sys, traceback
from moetier.store.convert import convert
print("ready", flush=True)
for dest in sys.stdin:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            convert(sys.argv[1], dest.strip(), overwrite=True, progress=False)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""

    def __init__(self, source) -> None:
        self.forks = subprocess.Popen([sys.executable, "-c", self.FORKS, str(source)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.forks.stdout.readline() == "ready\n", self.forks.stderr.read()

    def start(self, dest) -> int:
        self.forks.stdin.write(f"{dest}\n")
        self.forks.stdin.flush()
        return int(self.forks.stdout.readline())

    def ended(self) -> int:
        line = self.forks.stdout.readline()
        assert line, self.forks.stderr.read()
        return int(line)

    def close(self) -> None:
        self.forks.stdin.close()
        assert self.forks.wait(timeout=60) == 0, self.forks.stderr.read()


def verify(path) -> None:
    """A store is whole: its manifest loads, its files are long enough, every dense tensor and every expert blob
    matches its checksum."""
    store = Store(path)
    store.load_dense()
    for blob in store.manifest.blobs:
        store.read_expert(blob.layer, blob.expert, blob.precision)  # checked against its CRC-32 (or raises)


def leftovers(folder):
    return [p for p in os.listdir(folder) if ".tmp-" in p or ".old-" in p]


@pytest.fixture(scope="module")
def big_hf(tmp_path_factory):
    """A checkpoint that takes about a second to convert: 4 layers of 64 experts, 100 MB."""
    root = tmp_path_factory.mktemp("big")
    build_tiny("olmoe", root / "hf", num_layers=4, num_experts=64, intermediate_size=512)
    return root / "hf"


def test_both_ways_of_reading_the_dense_weights_give_the_same_tensors(tiny_store):
    """Mapped (float runs) and read tensor by tensor into memory of its own (what a quantized run converts)."""
    _, path = tiny_store("olmoe")
    mapped = Store(path).load_dense()
    seen = []
    read = Store(path).load_dense(lambda name, t: seen.append(name) or t.clone())
    assert sorted(seen) == sorted(mapped) == sorted(read)
    for name, t in mapped.items():
        assert read[name].dtype == t.dtype and read[name].shape == t.shape and read[name].equal(t), name


@pytest.mark.parametrize("convert", [None, lambda name, t: t], ids=["mapped", "read"])
def test_a_flipped_dense_block_names_the_tensor(tiny_store, tmp_path, capsys, convert):
    _, path = tiny_store("olmoe")
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    data = bytearray((bad / DENSE).read_bytes())
    header = 8 + struct.unpack("<Q", data[:8])[0]
    meta = json.loads(data[8:header])
    name, info = max(((k, v) for k, v in meta.items() if k != "__metadata__"),
                     key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0])
    start = header + info["data_offsets"][0]
    data[start:start + 4096] = bytes(b ^ 0xFF for b in data[start:start + 4096])  # 4 KiB of flipped bytes
    (bad / DENSE).write_bytes(data)
    with pytest.raises(ChecksumError, match=f"dense tensor {name} .* fails its checksum"):
        Store(bad).load_dense(convert)
    byte_tokenizer().save(str(bad / "tokenizer.json"))
    assert main(["generate", "--model", str(bad), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert f"dense tensor {name}" in err and "--reconvert" in err and "Traceback" not in err


def test_a_damaged_tokenizer_is_caught(tmp_path):
    from moetier.engine.tokenizer import Tokenizer

    out = tmp_path / "s"
    assert main(["synth", str(out), "--preset", "tiny"]) == 0
    text = (out / "tokenizer.json").read_text()
    (out / "tokenizer.json").write_text(text.replace('"Ā"', '"Ă"', 1))  # one vocabulary entry changed
    with pytest.raises(ChecksumError, match="tokenizer.json fails its checksum"):
        Tokenizer.from_store(Store(out))


def test_a_store_of_an_older_format_is_refused_with_the_way_out(tiny_store, tmp_path):
    _, path = tiny_store("olmoe")
    old = tmp_path / "old"
    shutil.copytree(path, old)
    manifest = json.loads((old / MANIFEST).read_text())
    manifest["version"] = 1
    (old / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="version 1.*reads versions 2, 3") as e:
        Store(old)
    assert "moetier convert --force" in str(e.value)


def test_reconvert_repairs_a_damaged_store_in_the_cache(private_cache, capsys):
    args = ["generate", "--prompt", "The sea", "--max-tokens", "3", "--expert-memory", "100%"]
    assert main(args) == 0
    store = next(p for p in private_cache.iterdir() if p.name.startswith("demo-deep-"))  # (the default model)
    # the dense weights, which the store holds whether its experts are copied or read from the checkpoint
    with open(store / DENSE, "r+b") as f:
        f.seek(-64, 2)
        f.write(b"\1\2\3\4")
    capsys.readouterr()
    assert main(args) == 1
    assert "fails its checksum" in capsys.readouterr().err
    assert main([*args, "--reconvert"]) == 0
    verify(store)
    assert main(args) == 0


def test_twenty_conversions_killed_at_random_moments(big_hf, tmp_path):
    """After each kill the destination is absent or whole; after the next run no temporary folder is left."""
    dest = tmp_path / "store"
    conversions = Conversions(big_hf)
    conversions.start(tmp_path / "timing")
    start = time.perf_counter()
    assert conversions.ended() == 0
    duration = time.perf_counter() - start
    shutil.rmtree(tmp_path / "timing")
    rng = random.Random(0)
    outcomes = {"absent": 0, "whole": 0}
    for i in range(20):
        if i % 2 and dest.exists():
            shutil.rmtree(dest)  # into nothing half of the time, over a whole store the other (its replacement killed)
        pid = conversions.start(dest)
        time.sleep(rng.uniform(0, duration * 1.2))
        with contextlib.suppress(ProcessLookupError):  # (it finished first, and was waited for)
            os.kill(pid, signal.SIGKILL)
        assert conversions.ended() in (0, -signal.SIGKILL)
        if dest.exists():
            verify(dest)
            outcomes["whole"] += 1
        else:
            outcomes["absent"] += 1
    conversions.start(dest)
    assert conversions.ended() == 0
    conversions.close()
    verify(dest)
    assert leftovers(tmp_path) == []
    assert outcomes["absent"] + outcomes["whole"] == 20 and outcomes["absent"] and outcomes["whole"], outcomes


def test_two_processes_converting_one_folder_share_one_store(big_hf, tmp_path):
    cache = tmp_path / "cache"
    first, second = child("resolve", big_hf, cache), child("resolve", big_hf, cache)
    for p in (first, second):
        assert p.stdout.readline() == "ready\n"
    first.stdin.write("go\n")
    first.stdin.flush()
    deadline = time.monotonic() + 60
    while not (cache.exists() and leftovers(cache)) and time.monotonic() < deadline:
        time.sleep(0.001)  # until the first is converting (its temporary folder exists): it holds the lock
    second.stdin.write("go\n")
    second.stdin.flush()
    results = []
    for p in (first, second):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append((out.splitlines()[0], err))
    assert results[0][0] == results[1][0]
    assert "waiting for another moetier process" in results[1][1]
    stores = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(stores) == 1 and str(stores[0]) == results[0][0]
    verify(stores[0])
    assert leftovers(cache) == []


def test_a_dense_file_cut_short_is_named_when_read_tensor_by_tensor(tiny_store, tmp_path):
    """The quantizing read (pread per tensor, not a mapping) meets the end of a truncated file: one StoreError."""
    _, path = tiny_store("olmoe")
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    data = (bad / DENSE).read_bytes()
    (bad / DENSE).write_bytes(data[:len(data) - 100])
    with pytest.raises(StoreError, match="ends inside tensor"):
        Store(bad).load_dense(lambda name, t: t)
