"""What `--model` names: a converted store, a Hugging Face folder (converted on first use into a cache), a GGUF
file or split set (indexed on first use into the cache: its experts read in place), a built-in model's name, or a
built-in name with `-xl` (its experts inflated to OLMoE's size, built on first use into the cache)."""

from __future__ import annotations

import errno
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

from moetier.atomic import DiskFullError, atomic_write_json, discard_dir, sweep, target_lock
from moetier.config import format_bytes
from moetier.errors import ModelNotFoundError, StoreError
from moetier.paths import default_cache_dir
from moetier.store.names import DENSE, MANIFEST, RECONVERT, is_gguf

# (torch and the store's converters are imported where a model is converted or a manifest read, so that what
# `--model` names is checked — model_path — before anything loads: a mistyped path refused in a tenth of a second)

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "models"
XL = "-xl"  # a built-in model with real-size experts: `demo-fine-xl`
BUILT_FROM = "built-from.json"  # in each cache entry: the folder it was built from


def builtin_models() -> dict[str, Path]:
    """Models shipped in the repository's models/ folder, by folder name."""
    if not BUILTIN_DIR.is_dir():
        return {}
    return {p.name: p for p in sorted(BUILTIN_DIR.iterdir()) if (p / "config.json").exists()}


def shipped(path: Path | str) -> bool:
    """Whether `path` lies in a model shipped with moetier (the repository's models/): files moetier never writes."""
    where = Path(path).absolute().resolve()
    return any(where.is_relative_to(model.resolve()) for model in builtin_models().values())


def inflated_builtins() -> dict[str, str]:
    """`<name>-xl` -> `<name>` for every built-in model: its experts inflated to OLMoE-1B-7B's 12 MiB
    (moetier/store/inflate.py), same routing and tokens, built on first use."""
    return {name + XL: name for name in builtin_models()}


def builtin_names() -> list[str]:
    """Every name `--model` knows without a path: the shipped models and their inflated versions."""
    return [*builtin_models(), *inflated_builtins()]


def _fingerprint(model_dir: Path, files: list[Path] | None = None) -> str:
    """Changes when the checkpoint does: its path, and each file's name, size and modification time (`files`: a
    GGUF's parts; default the folder's files)."""
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    for f in files if files is not None else sorted(model_dir.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _note(message: str) -> None:
    print(f"moetier: {message}", file=sys.stderr)


def model_path(model: str | Path) -> Path:
    """The folder `model` names (a built-in name, or a path): a store, or a folder to convert; refused if there is
    none, or if it is a store whose conversion never finished."""
    builtin = builtin_models()
    path = builtin[str(model)] if str(model) in builtin else Path(model).expanduser()
    if (path / MANIFEST).exists():
        return path
    if not path.exists():
        names = ", ".join(builtin_names()) or "none shipped yet"
        raise ModelNotFoundError(f"no model at {path}",
                                 hint=f"give a Hugging Face model folder, a GGUF file, a converted store, or a "
                                      f"built-in model name ({names})")
    if path.is_file() and not is_gguf(path):
        raise ModelNotFoundError(f"{path} is a file, not a model",
                                 hint="give a GGUF file (.gguf), a Hugging Face model folder or a converted store")
    if path.is_dir() and (path / DENSE).exists() and not (path / "config.json").exists():
        raise StoreError(f"{path} looks like a moetier store but has no {MANIFEST} (its conversion never finished, "
                         f"or the file was removed)", hint=RECONVERT)
    return path


def check_model(model: str) -> None:
    """Refuses a `model` that names nothing (model_path's refusals; an `-xl` name is built later) — the engine
    commands check `--model` as their options are read, before torch loads."""
    if model not in inflated_builtins() or Path(model).exists():
        model_path(model)


def resolve_model(model: str | Path, cache_dir: str | Path | None = None, progress: bool = True,
                  reconvert: bool = False) -> Path:
    """The store directory for `model`, converting a Hugging Face folder into the cache if needed (or, with
    `reconvert`, again). Several processes resolving the same folder at once convert it once: the others wait
    for the first and reuse its store."""
    if str(model) in inflated_builtins() and not Path(model).exists():
        return _inflated(str(model), cache_dir, progress, reconvert)
    path = model_path(model)
    if (path / MANIFEST).exists():
        if reconvert:
            raise StoreError(f"{path} is a converted store, not a model converted on first use",
                             hint="convert its source again with `moetier convert --force SRC STORE`")
        return path
    if is_gguf(path):
        return _indexed(path, cache_dir, progress, reconvert)
    from moetier.store.checkpoint import read_config
    from moetier.store.convert import convert

    read_config(path)  # clear errors for a folder without a readable config.json
    cache = _cache(cache_dir)
    sweep(cache)  # what conversions killed earlier left behind
    store = cache / f"{path.name}-{_fingerprint(path)}"
    return _build_once(store, path, lambda: convert(path, store, overwrite=True, progress=progress), reconvert,
                       progress)


def _indexed(path: Path, cache_dir: str | Path | None, progress: bool, reindex: bool) -> Path:
    """The linked store of GGUF `path` in the cache, indexed on first use (and again once the file changes)."""
    from moetier.store.gguf_file import GgufModel, split_parts
    from moetier.store.gguf_store import index_gguf

    parts = split_parts(path)
    GgufModel(path)  # every refusal (arch, types, a truncated file) before the cache is touched
    cache = _cache(cache_dir)
    sweep(cache)
    store = cache / f"{parts[0].name.removesuffix('.gguf')}-{_fingerprint(parts[0], parts)}"
    return _build_once(store, parts[0], lambda: index_gguf(path, store, overwrite=True, progress=progress), reindex,
                       progress)


def _cache(cache_dir: str | Path | None) -> Path:
    """The cache folder, made if missing; one that cannot be made is refused in one line."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(f"cannot create the cache folder {cache}: {e.strerror or e}", hint=CACHE_HINT) from None
    return cache


CACHE_HINT = "point --cache-dir (or $MOETIER_CACHE) at a folder you can write"


def _build_once(store: Path, source: Path, build: Callable[[], Path], rebuild: bool, progress: bool) -> Path:
    """`store` in the cache, built from `source` by `build` unless a whole one is there (or `rebuild`); under the
    target's lock, so several processes asking at once build it once and the others reuse it. Then the cache's
    older builds of the same source go (`_discard_stale`). A whole, marked store is used without the lock (it
    only ever appears or is replaced by a rename), so a read-only cache that holds what is needed works."""
    if not rebuild and _whole(store) and _built_from(store) is not None:
        _discard_stale(store, progress)
        return store
    try:
        with target_lock(store, on_wait=_note if progress else None):
            if rebuild or not _whole(store):
                build()
            if _built_from(store) is None:  # also marks a store an earlier moetier built without the note
                atomic_write_json(store / BUILT_FROM, {"source": str(source.resolve())})
    except PermissionError as e:
        raise StoreError(f"cannot write {store.name} into the cache {store.parent}: {e.strerror}",
                         hint=CACHE_HINT) from None
    except OSError as e:
        if e.errno != errno.EROFS:
            raise
        raise StoreError(f"cannot write {store.name} into the cache {store.parent}: it is on a read-only file "
                         f"system", hint=CACHE_HINT) from None
    _discard_stale(store, progress)
    return store


def _whole(store: Path) -> bool:
    from moetier.store.format import Manifest

    if not (store / MANIFEST).exists():
        return False
    try:
        Manifest.load(store)
        return True
    except StoreError:
        return False  # an earlier build was damaged: build again


def _built_from(entry: Path) -> str | None:
    """The folder a cache entry was built from, if moetier built it (its manifest and note are there)."""
    try:
        note = json.loads((entry / BUILT_FROM).read_text())
    except (OSError, ValueError):
        return None
    source = note.get("source") if isinstance(note, dict) else None
    return source if isinstance(source, str) and (entry / MANIFEST).exists() else None


def _discard_stale(keep: Path, progress: bool) -> None:
    """Remove the cache entries nothing can resolve to any more: builds of the folder `keep` was built from,
    made before that folder last changed (a fingerprint names each build), and builds made from a cache entry
    that is gone (the -xl model of a removed conversion). Without this the cache keeps a full copy of a model's
    experts per change of its folder: tens of GiB for one -xl model. Only entries carrying moetier's note are
    looked at; a process still reading a removed store loses the files it had not opened yet."""
    cache, source = keep.parent, _built_from(keep)
    where = cache.resolve()  # notes hold resolved paths
    changed = True
    while changed:  # removing a conversion orphans what was built from it
        changed = False
        for entry in sorted(p for p in cache.iterdir() if p.is_dir() and p != keep):
            origin = _built_from(entry)
            orphan = origin is not None and Path(origin).parent == where and not Path(origin).exists()
            if origin is None or (origin != source and not orphan):
                continue
            try:
                size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
                discard_dir(entry)
            except FileNotFoundError:  # another process resolving into this cache removed it first
                continue
            except OSError:  # a read-only cache: what cannot be removed stays
                continue
            changed = True
            if progress:
                why = f"built from {Path(origin).name}, which is gone" if orphan else f"an older build of {origin}"
                _note(f"removed {entry.name} from the cache ({format_bytes(size)}): {why}")


def _inflated(name: str, cache_dir: str | Path | None, progress: bool, rebuild: bool) -> Path:
    """The store of built-in `name` (`<base>-xl`), inflated from the base model's store on first use."""
    from moetier.store.inflate import inflate, intermediate_for
    from moetier.store.store import Store

    base = resolve_model(inflated_builtins()[name], cache_dir, progress, rebuild)
    cache = _cache(cache_dir)
    store = cache / f"{name}-{_inflation_key(base)}"  # a base whose weights changed gets a new inflation

    def build() -> Path:
        n = intermediate_for(Store(base))
        if progress:
            _note(f"building {name} once: {inflated_builtins()[name]}'s experts inflated to intermediate size {n} "
                  f"into {store}")
        try:
            return inflate(base, store, n, overwrite=True, progress=progress)
        except DiskFullError as e:  # name what in this cache could go: an older build of the same model
            stale = [p for p in cache.iterdir() if p.is_dir() and p != store and p.name.startswith(f"{name}-")
                     and _built_from(p) == str(base.resolve())]
            if not stale:
                raise
            size = sum(f.stat().st_size for p in stale for f in p.rglob("*") if f.is_file())
            raise DiskFullError(str(e).split("\n")[0], hint=f"an older build of {name} in the same cache takes "
                                f"{format_bytes(size)}: remove {', '.join(str(p) for p in stale)}") from None

    return _build_once(store, base, build, rebuild, progress)


def _inflation_key(base: Path) -> str:
    """What an inflation reads of its base store — the config, the dense weights and the native experts (their
    checksums) — so the quantized copies `moetier quantize` adds to the base leave its -xl build alone (they
    changed the base's manifest, and the 9 GiB demo-deep-xl was built again)."""
    from moetier.store.format import Manifest

    m = Manifest.load(base)
    native = [(b.layer, b.expert, b.crc32) for b in m.blobs if b.precision == m.native_precision]
    key = json.dumps([str(base.resolve()), m.config, m.native_precision, m.dense_crc32, sorted(native)],
                     sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:16]
