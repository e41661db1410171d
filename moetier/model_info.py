"""What `--model` names, read from its config.json (or a store's manifest) alone: nothing converted, built or
loaded. Commands check their input against it before any work — a prompt's length against the context window, a
trace against a shape — so a refused input never costs a conversion or a 9 GiB `-xl` build first."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moetier.config import ModelSpec
from moetier.errors import StoreError
from moetier.model.families import family_for, parse_spec
from moetier.resolve import inflated_builtins, model_path
from moetier.store.checkpoint import Checkpoint, read_config
from moetier.store.format import PRECISION_OF_DTYPE, Manifest
from moetier.store.names import MANIFEST, RECONVERT, is_gguf


@dataclass(frozen=True)
class ModelInfo:
    """`spec` as the engine would build it; `precision` and `blob_bytes`: one expert as the store holds (or will
    hold) it; `folder`: where its config and tokenizer files are (for an `-xl` name, its base model's)."""

    name: str
    spec: ModelSpec
    precision: str
    blob_bytes: int
    folder: Path

    def __post_init__(self) -> None:
        if self.blob_bytes <= 0:
            raise ValueError(f"blob_bytes must be positive, got {self.blob_bytes}")

    def tokenizer(self):
        """The model's tokenizer from its own files (unverified: the engine checks them again at load), or None."""
        from moetier.engine.tokenizer import Tokenizer

        if is_gguf(self.folder):  # built from the file's metadata, as indexing builds it
            from moetier.store.gguf_file import GgufModel
            from moetier.store.gguf_tokenizer import tokenizer_files

            files = tokenizer_files(GgufModel(self.folder).metadata)
            return Tokenizer(files["tokenizer.json"].decode(), json.loads(files["tokenizer_config.json"]),
                             self.spec.bos_token_id)
        path = self.folder / "tokenizer.json"
        if not path.exists():
            return None
        try:
            return Tokenizer.from_file(path, self.spec.bos_token_id)
        except (OSError, ValueError) as e:
            raise StoreError(f"cannot read {path}: {e}", hint=RECONVERT) from None


def inspect_model(model: str | Path) -> ModelInfo:
    """`model` as `resolve_model` would resolve it, without resolving it: the same names, the same refusals."""
    name = str(model)
    if name in inflated_builtins() and not Path(model).exists():
        return _inflated(name, inspect_model(inflated_builtins()[name]))
    path = model_path(model)
    if is_gguf(path):
        return _gguf_info(name, path)
    if (path / MANIFEST).exists():
        m = Manifest.load(path)
        native = m.precisions[m.native_precision]
        return ModelInfo(name, parse_spec(m.config), m.native_precision, native.blob_bytes, path)
    config = read_config(path)
    family, spec = family_for(config), parse_spec(config)
    return _checkpoint_info(name, path, family, spec)


def _gguf_info(name: str, path: Path) -> ModelInfo:
    """A GGUF as indexing will store it: its config from the metadata, its experts' precision and largest layout."""
    from moetier.store.gguf_file import GgufModel
    from moetier.store.gguf_store import expert_layout, model_dtype

    model = GgufModel(path)
    config = model.config()
    family_for(config)  # an unsupported family is refused here, as at indexing
    dtype = model_dtype(model)
    spec = parse_spec(dict(config, dtype=str(dtype).removeprefix("torch.")))
    layout = expert_layout(model, spec, dtype)
    return ModelInfo(name, spec, layout.name, layout.blob_bytes, path)


def _checkpoint_info(name: str, path: Path, family, spec: ModelSpec) -> ModelInfo:
    """A Hugging Face folder's experts as conversion will store them: the dtype of its first expert's tensors
    (read from the shard headers and one small tensor; gpt-oss's MXFP4 comes out as bf16, as conversion makes it)."""
    from moetier.store.convert import check_expert_dtype, native_layout
    from moetier.store.sources import expert_source

    first = expert_source(Checkpoint(path), family, spec, spec.moe_layers[0]).get(0)["down_proj"]
    check_expert_dtype(first.dtype)
    return ModelInfo(name, spec, PRECISION_OF_DTYPE[first.dtype], native_layout(spec, first.dtype).blob_bytes, path)


def _inflated(name: str, base: ModelInfo) -> ModelInfo:
    """Built-in `name` (`<base>-xl`) as `resolve_model` will build it: the base's experts inflated to OLMoE's size."""
    from moetier.store.convert import native_layout
    from moetier.store.inflate import intermediate_for_spec

    dtype = next(d for d, p in PRECISION_OF_DTYPE.items() if p == base.precision)
    n = intermediate_for_spec(base.spec, dtype.itemsize)
    key = family_for(_config(base)).expert_intermediate_key
    spec = parse_spec(dict(_config(base), **{key: n}))
    return ModelInfo(name, spec, base.precision, native_layout(spec, dtype).blob_bytes, base.folder)


def _config(info: ModelInfo) -> dict:
    if (info.folder / MANIFEST).exists():
        return Manifest.load(info.folder).config
    return read_config(info.folder)
