"""What the commands accept as a model shape: a shape's name, a built-in model, a model or store directory (whose
shape is read from its config.json, and beside which its trained policies live), or a GGUF file."""

from __future__ import annotations

from pathlib import Path

from moetier.model_info import inspect_model
from moetier.resolve import builtin_names, inflated_builtins, resolve_model
from moetier.sim.shapes import SHAPES, ModelShape, ShapeError, shape_named
from moetier.store.names import is_gguf
from moetier.store.store import Store


def _store(name: str, cache_dir: str | None) -> Store | None:
    """The store whose weights or trained files `name` uses. An `-xl` model's routers and trained files are its
    base model's (inflating touches only the experts), so the small base is converted, never the 9 GiB -xl."""
    if name not in builtin_names() and not _model_path(name):
        return None
    base = inflated_builtins().get(name, name) if not Path(name).exists() else name
    return Store(resolve_model(base, cache_dir, progress=False))


def _model_path(name: str) -> bool:
    """A model directory (Hugging Face or a store) or a GGUF file."""
    return Path(name).is_dir() or (is_gguf(name) and Path(name).is_file())


def model_shape(name: str) -> tuple[ModelShape, int | None]:
    """(shape, expert blob bytes if known) for a shape name, a Hugging Face id naming one, a built-in model, or a
    model or store directory: read from its config.json or manifest, nothing converted or built."""
    shape = None if is_gguf(name) and Path(name).is_file() else shape_named(name)  # (a file named after a model)
    if shape is not None:
        return shape, None
    if name not in builtin_names() and not _model_path(name):
        known = ", ".join(sorted(SHAPES) + builtin_names())
        raise ShapeError(f"no model shape {name!r}",
                         hint=f"known shapes: {known}; or give a model or store directory, or a GGUF file")
    info = inspect_model(name)
    return ModelShape.from_spec(info.spec, Path(name).name, info.precision), info.blob_bytes


def config_shape(config_json: Path) -> ModelShape:
    """A shape from a config.json alone (no weights: what `moetier doctor` is for); the experts' precision is the
    config's torch_dtype (bf16 if it names none)."""
    from moetier.model.families import family_for, parse_spec
    from moetier.store.checkpoint import read_config

    config = read_config(config_json.parent)
    family_for(config)  # an architecture moetier does not run is refused here
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    precision = {"float32": "fp32", "float16": "fp16"}.get(dtype, "bf16")
    return ModelShape.from_spec(parse_spec(config), config_json.parent.name, precision)


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


def replay_predictor(name: str, trace, model: str, cache_dir: str | None, distance: int, error_rate: float = 0.0,
                     fit_on=None):
    """A maker of fresh predictors `name` for replaying parts of `trace` (llapor learns online, so each replay gets
    its own), or None for "none"; built on `model`'s routers or trained networks where it needs them, `hot` on the
    use counts of `fit_on` (default: the trace replayed). Makes one now, so a predictor that cannot be built is
    refused before any work."""
    from moetier.predictor_files import TRAINED, load_nets
    from moetier.sim.predictors import trace_counts, trace_predictor

    if name == "none":
        return None
    weights = routers(model, cache_dir) if name == "stacked-gates" else None
    net_dir = policy_dir(model, cache_dir, "predictors") if name in TRAINED else None

    counts = trace_counts(fit_on) if name == "hot" and fit_on is not None else None

    def make(part):
        nets = load_nets(name, net_dir) if name in TRAINED else None
        return trace_predictor(name, part, distance, weights, counts, error_rate=error_rate, nets=nets)

    make(trace)
    return make
