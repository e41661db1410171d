"""A model converted on first use lives in the cache once: a newer build of the same folder replaces the older
one (and what was built from it), while other folders' builds and anything moetier did not make stay."""

import os
import shutil

import pytest

from moetier import resolve
from moetier.atomic import discard_dir
from moetier.store import inflate as inflate_module
from moetier.store.store import Store
from tests.tiny_models import build_tiny


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    build_tiny("olmoe", root / "tiny")
    return root / "tiny"


def change(folder) -> None:
    """What a user's edit of the checkpoint does to its fingerprint: a file's modification time moves."""
    config = folder / "config.json"
    st = config.stat()
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def entries(cache) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if not p.name.startswith("."))


def test_a_changed_folder_replaces_its_older_build_and_nothing_else(hf, tmp_path, capsys):
    cache, model = tmp_path / "cache", tmp_path / "tiny"
    shutil.copytree(hf, model)
    other = tmp_path / "other" / "tiny"  # same folder name, another checkpoint
    shutil.copytree(hf, other)
    first = resolve.resolve_model(model, cache, progress=False)
    kept = resolve.resolve_model(other, cache, progress=False)
    mine = cache / "tiny-notes"  # a user's folder in the cache: moetier did not make it
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert len({first, kept}) == 2 and resolve.resolve_model(model, cache, progress=False) == first

    change(model)
    second = resolve.resolve_model(model, cache, progress=True)
    assert second != first and not first.exists()
    assert entries(cache) == sorted([second.name, kept.name, "tiny-notes"])
    assert (mine / "notes.txt").read_text() == "keep me"
    Store(second).load_dense()  # the new build is whole
    assert f"removed {first.name} from the cache" in capsys.readouterr().err


def test_an_xl_model_of_a_replaced_build_goes_with_it(hf, tmp_path, monkeypatch):
    models, cache = tmp_path / "models", tmp_path / "cache"  # reached through a link, as $MOETIER_CACHE may be
    (tmp_path / "real-cache").mkdir()
    cache.symlink_to(tmp_path / "real-cache")
    shutil.copytree(hf, models / "tiny")
    monkeypatch.setattr(resolve, "BUILTIN_DIR", models)  # `tiny` is a built-in model, `tiny-xl` its inflation
    monkeypatch.setattr(inflate_module, "OLMOE_EXPERT_BYTES", 3 * 96 * 64 * 4)  # twice the tiny fp32 experts
    base, xl = resolve.resolve_model("tiny", cache, progress=False), resolve.resolve_model("tiny-xl", cache,
                                                                                        progress=False)
    assert entries(cache) == sorted([base.name, xl.name])

    change(models / "tiny")
    new_xl = resolve.resolve_model("tiny-xl", cache, progress=False)
    new_base = resolve.resolve_model("tiny", cache, progress=False)
    assert not base.exists() and not xl.exists()
    assert entries(cache) == sorted([new_base.name, new_xl.name])


def test_a_store_built_before_the_note_existed_gets_it_and_is_reused(hf, tmp_path):
    cache = tmp_path / "cache"
    store = resolve.resolve_model(hf, cache, progress=False)
    (store / resolve.BUILT_FROM).unlink()  # as an earlier moetier left it
    stamp = (store / "manifest.json").stat().st_mtime_ns
    assert resolve.resolve_model(hf, cache, progress=False) == store
    assert (store / "manifest.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert resolve._built_from(store) == str(hf.resolve())


def test_discard_dir_leaves_nothing_behind(tmp_path):
    victim = tmp_path / "store"
    (victim / "sub").mkdir(parents=True)
    (victim / "sub" / "blob").write_bytes(b"x" * 100)
    discard_dir(victim)
    assert list(tmp_path.iterdir()) == []


def test_an_older_build_another_process_removed_first_is_passed_over(hf, tmp_path, monkeypatch, capsys):
    cache, model = tmp_path / "cache", tmp_path / "tiny"
    shutil.copytree(hf, model)
    first = resolve.resolve_model(model, cache, progress=False)
    change(model)

    def gone(path):
        raise FileNotFoundError(path)  # as when a second process resolving into this cache renamed it away

    monkeypatch.setattr(resolve, "discard_dir", gone)
    second = resolve.resolve_model(model, cache, progress=True)
    assert second != first and first.exists()  # nothing removed here, no error, no note
    assert "removed" not in capsys.readouterr().err
