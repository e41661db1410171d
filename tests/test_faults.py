"""Faults nobody had tried (issue 28): a disk that fills up, a read that fails under a running engine. Each fault is
made for real where the machine allows it (a small tmpfs in a private mount namespace) and the test skips with
the reason where it does not; the reads that fail are made by truncating, removing or failing the store's files."""

import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from moetier import Engine
from moetier.errors import StoreError
from moetier.store.convert import convert
from moetier.store.format import Manifest
from tests.faults import moetier, run_with_mounts
from tests.test_cli_inputs import olmoe_trace
from tests.tiny_models import build_tiny

SMALL = 256 << 10  # a filesystem that holds a little, not a tiny store (~780 KB)
# the disk looks empty to the check, so it fills while writing
NO_CHECK = "import shutil; shutil.disk_usage = lambda path: shutil._ntuple_diskusage(1 << 50, 0, 1 << 50)\n"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny"
    build_tiny("olmoe", path)
    return path


def listing(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def refused_in_one_line(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert lines[-2].startswith("moetier: error: ") and lines[-1].startswith("  hint: "), r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def python(script: str, *args: str) -> list[str]:
    return [sys.executable, "-c", "import sys\n" + script, *map(str, args)]


# disk full: refused before writing where the size is known, cleaned up where the disk fills while writing


def test_converting_onto_a_full_disk_is_refused_first_and_then_succeeds_with_room(hf, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    r = run_with_mounts(moetier("convert", "--copy", str(hf), str(small / "store")), small={small: SMALL})
    refused_in_one_line(r, "the store store needs ", "free", "free disk space")
    # the same with the check gone: the disk fills while writing; nothing of the store is left behind
    script = NO_CHECK + ("from moetier.cli import main\nimport os\n"
                         "code = main(['convert', '--copy', sys.argv[1], sys.argv[2]])\n"
                         "print(sorted(os.listdir(sys.argv[3])))\nsys.exit(code)")
    r = run_with_mounts(python(script, hf, small / "store", small), small={small: SMALL})
    refused_in_one_line(r, "the disk filled up while writing", "nothing of it was kept")
    assert r.stdout.strip() == "[]"  # no temporary folder, no half store
    r = run_with_mounts(moetier("convert", "--copy", str(hf), str(small / "store")), small={small: 4 << 20})
    assert r.returncode == 0, r.stderr  # with room, the same command succeeds
    # a linked store (the default) writes no expert: it fits where the copy did not
    r = run_with_mounts(moetier("convert", str(hf), str(small / "store")), small={small: SMALL})
    assert r.returncode == 0, r.stderr


def test_quantizing_onto_a_full_disk_leaves_the_store_as_it_was_and_resumes_with_room(hf, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    # inside one namespace: the store copied in (it fits, its copies do not), quantize refused, the filesystem grown,
    # quantize again
    script = ("import json, os, shutil, subprocess\nfrom pathlib import Path\nfrom moetier.cli import main\n"
              "store = Path(sys.argv[2]); shutil.copytree(sys.argv[1], store)\n"
              "before = (store / 'manifest.json').read_text()\n"
              "code = main(['quantize', str(store), '--precisions', 'int8,int4'])\n"
              "left = [p.name for p in store.rglob('*') if '.tmp-' in p.name]\n"
              "print('R:', code, (store / 'manifest.json').read_text() == before, left)\n"
              "subprocess.run(['mount', '-o', 'remount,size=8m', sys.argv[3]], check=True)\n"
              "print('R:', main(['quantize', str(store), '--precisions', 'int8,int4']),"
              " sorted(json.loads((store / 'manifest.json').read_text())['precisions']))\n")
    store = convert(hf, tmp_path / "store", progress=False)
    size = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    for no_check in ("", NO_CHECK):
        r = run_with_mounts(python(no_check + script, store, small / "store", small),
                            small={small: size + (200 << 10)})
        assert "Traceback" not in r.stderr and "free disk space" in r.stderr, r.stderr
        refused, resumed = [line for line in r.stdout.splitlines() if line.startswith("R: ")]
        assert refused == "R: 1 True []", r.stdout  # refused, the manifest as it was, no partial file left
        assert resumed == "R: 0 ['fp32', 'int4', 'int8']", r.stdout  # with room, the same command completes


def test_a_trace_onto_a_full_disk_is_refused_and_leaves_nothing(tmp_path):
    trace = olmoe_trace(tokens=2000).save(tmp_path / "trace")  # 2000 x 16 x 8 ids and weights: ~1 MB
    small = tmp_path / "small"
    small.mkdir()
    r = run_with_mounts(moetier("trace", "synth", "--fit", str(trace), "--out", str(small / "t"), "--tokens", "4000",
                                "--model-shape", "olmoe-1b-7b"), small={small: SMALL})
    refused_in_one_line(r, "the trace t needs")
    script = NO_CHECK + ("from moetier.cli import main\nimport os\ncode = main(['trace', 'synth', '--fit', sys.argv[1], "
                         "'--out', sys.argv[2], '--tokens', '4000', '--model-shape', 'olmoe-1b-7b'])\n"
                         "print(sorted(os.listdir(sys.argv[3])))\nsys.exit(code)")
    r = run_with_mounts(python(script, trace, small / "t", small), small={small: SMALL})
    refused_in_one_line(r, "the disk filled up while writing")
    assert r.stdout.strip() == "[]"


def test_building_an_inflated_model_onto_a_full_disk_is_refused_first(hf, tmp_path):
    """`synth --inflate` is what building an `-xl` model runs (resolve._inflated): refused with the bytes needed."""
    store = convert(hf, tmp_path / "store", progress=False)
    small = tmp_path / "small"
    small.mkdir()
    r = run_with_mounts(moetier("synth", str(small / "xl"), "--inflate", str(store), "--expert-intermediate", "512"),
                        small={small: 2 << 20})
    refused_in_one_line(r, "the store xl needs")
    assert "MiB" in r.stderr


# a read that fails under a running engine: named, and the engine stops cleanly


def reader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("moetier-reader")]


def run_briefly(fn, seconds: float = 60):
    """`fn()` in a thread; fails the test instead of hanging if it never returns."""
    box = {}

    def go():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test
            box["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the engine hung on a read that failed"
    return box


@pytest.mark.parametrize("fault", ["shrunk", "removed", "eio"])
def test_a_read_that_fails_names_the_expert_and_file_and_the_engine_stops_cleanly(hf, tmp_path, monkeypatch, fault):
    store = convert(hf, tmp_path / "store", progress=False, copy=True)
    layer_file = store / "experts" / "fp32" / "layer_001.bin"
    engine = Engine.from_pretrained(store, expert_memory="50%")
    assert len(reader_threads()) >= 4
    if fault == "shrunk":  # the blob file shrinks under the running engine
        os.truncate(layer_file, 4096)
    elif fault == "removed":  # the store's drive went away: its files are no longer there to open
        shutil.move(store / "experts", tmp_path / "experts-elsewhere")
    else:  # the disk answers with an I/O error
        import errno

        from moetier.store import reader as reader_module

        real = reader_module.os.preadv

        def failing(fd, buffers, offset):
            if os.readlink(f"/proc/self/fd/{fd}").endswith("layer_001.bin"):
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real(fd, buffers, offset)

        monkeypatch.setattr(reader_module.os, "preadv", failing)
    with engine:
        box = run_briefly(lambda: engine.generate([[5, 6, 7, 8, 9, 10]], max_new_tokens=8, ignore_eos=True))
    error = box.get("error")
    assert isinstance(error, StoreError), box
    message = str(error)
    layer = 0 if fault == "removed" else 1  # (every file is gone; the first read fails first)
    assert f" of layer {layer} (fp32) from " in message and f"layer_00{layer}.bin" in message, message
    cause = {"shrunk": "the file ends early", "removed": "No such file", "eio": "Input/output error"}[fault]
    assert cause in message, message
    deadline = time.monotonic() + 10
    while reader_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reader_threads() == []  # joined by close()


def test_a_store_damaged_before_it_is_opened_is_refused_at_open(hf, tmp_path):
    """(A file that shrank before the engine opened the store is found by the size check at open.)"""
    store = convert(hf, tmp_path / "store", progress=False, copy=True)
    os.truncate(store / "experts" / "fp32" / "layer_000.bin", 4096)
    script = ("from moetier import Engine\nfrom moetier.errors import MoetierError\n"
              "try:\n    Engine.from_pretrained(sys.argv[1], expert_memory='50%').generate([[5, 6, 7]], 4)\n"
              "except MoetierError as e:\n    print(e, file=sys.stderr); sys.exit(1)")
    r = subprocess.run(python(script, store), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "layer_000.bin is truncated" in r.stderr and "--reconvert" in r.stderr
    assert Manifest.load(store)  # nothing else touched


def test_a_checkpoint_that_shrinks_under_an_engine_on_a_linked_store_is_named(tmp_path):
    """A linked store reads the checkpoint's own file: that file, not the store's, is named."""
    build_tiny("olmoe", tmp_path / "hf")
    store = convert(tmp_path / "hf", tmp_path / "store", progress=False)
    engine = Engine.from_pretrained(store, expert_memory="50%")
    os.truncate(tmp_path / "hf" / "model.safetensors", 4096)
    with engine:
        box = run_briefly(lambda: engine.generate([[5, 6, 7, 8, 9, 10]], max_new_tokens=8, ignore_eos=True))
    message = str(box.get("error"))
    assert isinstance(box.get("error"), StoreError) and "model.safetensors" in message, box
    assert "the file ends early" in message and " of layer " in message
    deadline = time.monotonic() + 10
    while reader_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reader_threads() == []
