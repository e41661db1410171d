"""Folders that appear whole or not at all; what --force may replace; leftovers of killed writers; the lock."""

import os
import threading
import time

import pytest

from moetier.atomic import ReplaceError, _owner_tag, atomic_dir, check_replaceable, sweep, target_lock


def ours(path):
    return (path / "mine").exists()


def make(path, *files):
    path.mkdir(parents=True)
    for f in files:
        (path / f).write_text(f)
    return path


def test_replacing_moves_the_old_folder_aside_and_removes_it_last(tmp_path):
    dest = make(tmp_path / "out", "mine", "old")
    with atomic_dir(dest) as tmp:
        (tmp / "new").write_text("new")
        assert (dest / "old").exists()  # untouched while the new one is written
    assert sorted(os.listdir(dest)) == ["new"]
    assert os.listdir(tmp_path) == ["out"]


def test_a_failed_write_leaves_the_old_folder_untouched(tmp_path):
    dest = make(tmp_path / "out", "old")
    with pytest.raises(RuntimeError), atomic_dir(dest) as tmp:
        (tmp / "new").write_text("new")
        raise RuntimeError("boom")
    assert os.listdir(dest) == ["old"] and os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize("layout,message", [
    ("file", "is a file"),
    ("under-file", "cannot be created"),
    ("same", "which this command reads"),
    ("inside", "is inside"),
    ("around", "holds"),
    ("exists", "already exists"),
])
def test_refused_destinations(tmp_path, layout, message):
    src = make(tmp_path / "src", "config.json")
    dest = {"file": tmp_path / "f", "under-file": tmp_path / "f" / "store", "same": src, "inside": src / "store",
            "around": tmp_path, "exists": make(tmp_path / "d", "mine")}[layout]
    (tmp_path / "f").write_text("a file")
    force = layout != "exists"
    with pytest.raises(ReplaceError, match=message):
        check_replaceable(dest, "store", ours, force, (src,))
    assert (src / "config.json").read_text() == "config.json"


def test_force_replaces_only_what_moetier_made(tmp_path):
    theirs = make(tmp_path / "theirs", "photo.jpg", "notes.txt")
    with pytest.raises(ReplaceError, match="is not a moetier store .*photo.jpg"):
        check_replaceable(theirs, "store", ours, True)
    assert sorted(os.listdir(theirs)) == ["notes.txt", "photo.jpg"]
    check_replaceable(make(tmp_path / "mine", "mine"), "store", ours, True)  # ours: allowed
    check_replaceable(make(tmp_path / "empty"), "store", ours, True)  # nothing to lose: allowed
    check_replaceable(tmp_path / "new", "store", ours, False)  # absent: allowed


def test_sweep_removes_dead_owners_leftovers_and_restores_an_old_folder_left_aside(tmp_path):
    gone = f"{os.getpid()}-0"  # our pid with another start time: a process that is gone (its pid reused)
    dead_tmp = make(tmp_path / f".store.tmp-{gone}-abc123", "half")
    live_tmp = make(tmp_path / f".store.tmp-{_owner_tag()}-def456", "writing")
    aside = make(tmp_path / f".other.old-{gone}-0a1b2c3d", "manifest.json")  # killed between the two renames
    unrelated = make(tmp_path / ".store.tmp-notours", "x")
    swept = sweep(tmp_path)
    assert not dead_tmp.exists() and live_tmp.exists() and unrelated.exists()
    assert (tmp_path / "other" / "manifest.json").exists() and not aside.exists()
    assert len(swept) == 2


def test_sweep_drops_an_old_folder_whose_replacement_landed(tmp_path):
    make(tmp_path / "store", "new")
    aside = make(tmp_path / f".store.old-{os.getpid()}-0-0a1b2c3d", "old")
    sweep(tmp_path)
    assert not aside.exists() and os.listdir(tmp_path / "store") == ["new"]


def test_target_lock_makes_a_second_writer_wait(tmp_path):
    dest = tmp_path / "store"
    order, waited = [], []
    held = threading.Event()

    def first():
        with target_lock(dest):
            held.set()
            time.sleep(0.3)
            order.append("first")

    t = threading.Thread(target=first)
    t.start()
    held.wait()
    with target_lock(dest, on_wait=waited.append):
        order.append("second")
    t.join()
    assert order == ["first", "second"] and "waiting for another moetier process" in waited[0]
