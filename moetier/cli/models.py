"""What the commands accept as a model shape: a shape's name, a built-in model, or a model or store directory
(whose shape is read from its config.json, and beside which its trained policies live)."""

from __future__ import annotations

from pathlib import Path

from moetier.resolve import builtin_names, resolve_model
from moetier.sim.shapes import SHAPES, ModelShape, ShapeError, shape_named
from moetier.store.store import Store


def _store(name: str, cache_dir: str | None) -> Store | None:
    if name not in builtin_names() and not Path(name).is_dir():
        return None
    return Store(resolve_model(name, cache_dir, progress=False))


def model_shape(name: str, cache_dir: str | None = None) -> tuple[ModelShape, int | None]:
    """(shape, expert blob bytes if known) for a shape name, a Hugging Face id naming one, a built-in model, or a
    model or store directory."""
    shape = shape_named(name)
    if shape is not None:
        return shape, None
    store = _store(name, cache_dir)
    if store is None:
        known = ", ".join(sorted(SHAPES) + builtin_names())
        raise ShapeError(f"no model shape {name!r}", hint=f"known shapes: {known}; or give a model or store directory")
    shape = ModelShape.from_spec(store.spec, Path(name).name, store.manifest.native_precision)
    return shape, store.native_layout.blob_bytes


def routers(name: str, cache_dir: str | None) -> dict | None:
    """Each MoE layer's router weight [E, H] of a built-in model or a model directory (None for a bare shape)."""
    store = _store(name, cache_dir) if shape_named(name) is None else None
    if store is None:
        return None
    dense = store.load_dense()
    return {layer: dense[f"layers.{layer}.router"] for layer in store.spec.moe_layers}


def policy_dir(name: str, cache_dir: str | None, folder: str = "policies") -> Path | None:
    """Where trained policies of a built-in model or a model directory live, as the engine finds them (None for a
    bare shape)."""
    store = _store(name, cache_dir) if shape_named(name) is None else None
    return store.trained_dir(folder) if store is not None else None
