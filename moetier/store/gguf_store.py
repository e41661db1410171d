"""A GGUF file (or split set) -> a linked store: nothing of the experts copied where the kernels compute the file's
types (otherwise each expert is copied once: below). Each expert is three slices of its layer's stacked tensors
(`blk.N.ffn_{gate,up,down}_exps.weight`: gate's and up's rows one after the other make the store's gate_up_proj,
down's its down_proj), read in place in the file's own type — bf16/f16/f32 as a safetensors folder's experts are,
q8_0/q6_k/q5_k/q4_k, the legacy q5_1/q5_0/q4_1/q4_0 and gpt-oss's mxfp4 as GGML's blocks the kernels compute on
(moetier/model/ggml_experts.py) — and, where the experts carry biases (gpt-oss's `ffn_*_exps.bias`, float), three
more slices: gate's and up's biases one after the other, down's. The store holds the dense weights, the manifest
(every expert's slices and their CRC-32, the file's size and time, checked at every open) and the tokenizer built
from the file's metadata.

A file whose layers keep their experts in different types (Q4_K_M: down_proj in Q6_K in some layers, Q4_K in the
rest) is one precision whose layout differs by layer (format.PrecisionLayout.layers). The attention projections and
the head, where the file keeps them in a block format, are indexed where they lie (Manifest.dense_blocks) and
computed in it; dense.safetensors holds every dense tensor in the model's dtype as well (what `--dense-precision
int8|int4` and the tools that rewrite a store read), the others dequantized here with a note saying which.

Experts in a type no kernel of ours computes (Q3_K, Q2_K, the IQ types: gguf_file.DEQUANTIZED_TYPES) are copied
into the store's own blobs as a Hugging Face folder's would be — in the model's dtype, dequantized by the gguf
package — with a note naming the types and what the copies cost."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from zlib_ng.zlib_ng import crc32

from moetier.atomic import check_replaceable
from moetier.config import ModelSpec, format_bytes
from moetier.model.dense_quant import quantized_names
from moetier.model.families import family_for, parse_spec
from moetier.progress import tqdm
from moetier.quant.ggml_blocks import dequantize
from moetier.quant.precisions import GGUF_BLOCKS, matrix_shape
from moetier.store.checkpoint import Located
from moetier.store.convert import dense_tensors, native_layout
from moetier.store.format import PRECISION_OF_DTYPE, DenseBlock, Manifest, PrecisionLayout, SourceFile, is_store
from moetier.store.gguf_file import HINT, KNOWN_TYPES, GgufError, GgufModel, Tensor, unpermute
from moetier.store.gguf_tokenizer import tokenizer_files
from moetier.store.link import segments_crc32, segments_of
from moetier.store.writer import MANIFEST_BYTES_PER_LINKED_BLOB, StoreWriter, store_bytes

FLOATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PARTS = ("gate", "up", "down")


class GgufCheckpoint:
    """A GGUF's dense tensors by their Hugging Face names (what Family.dense_names gives), through the converter's
    own name table (the gguf package's TensorNameMap), as the model's dtype: what convert.dense_tensors reads."""

    def __init__(self, model: GgufModel, dtype: torch.dtype) -> None:
        import gguf

        arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == model.arch)
        self.model, self.dtype = model, dtype
        self.names = gguf.get_tensor_name_map(arch, int(model.key("block_count", 0)))
        self.dequantized: list[str] = []  # dense tensors the file keeps in a block format

    def gguf_name(self, hf_name: str) -> str:
        # (the converter renames DeepSeek's e_score_correction_bias to e_score_correction.bias before its table)
        hf_name = hf_name.removesuffix("_bias") + ".bias" if hf_name.endswith("e_score_correction_bias") else hf_name
        hf_name = hf_name + ".weight" if hf_name.endswith("self_attn.sinks") else hf_name  # (gpt-oss's, likewise)
        name = self.names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise GgufError(f"{self.model.path.name}: no GGUF name for {hf_name} in llama.cpp's {self.model.arch} "
                            f"table", hint=HINT)
        return name

    def get(self, hf_name: str) -> torch.Tensor:
        name = self.gguf_name(hf_name)
        if name.endswith("attn_kv_b.weight") and name not in self.model.tensors:
            return self.kv_b(name).to(self.dtype)
        t = self.model.tensor(name)
        w = self.read(t)
        if self.model.arch_spec.permute_qk and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = "attention.head_count" if "q_proj" in hf_name else "attention.head_count_kv"
            w = unpermute(w, int(self.model.key(heads)))
        return w.to(self.dtype)

    def read(self, t: Tensor) -> torch.Tensor:
        if t.type not in FLOATS:
            self.dequantized.append(t.name)
        return values(t)

    def kv_b(self, name: str) -> torch.Tensor:
        """MLA's kv_b_proj [H·(nope + v), kv_lora] from the two halves the converter splits it into for llama.cpp's
        absorbed attention: attn_k_b [H, kv_lora, nope] (each head's key rows, transposed) and attn_v_b
        [H, v, kv_lora]."""
        k_b = self.read(self.model.tensor(name.replace("attn_kv_b", "attn_k_b")))
        v_b = self.read(self.model.tensor(name.replace("attn_kv_b", "attn_v_b")))
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1])


def values(t: Tensor, expert: int | None = None) -> torch.Tensor:
    """A tensor's values (float32 for a block format, dequantized as ggml does), in torch's shape; `expert`: one
    expert's matrix of a stacked [E, rows, k] tensor."""
    raw, shape = (t.data, t.shape) if expert is None else (t.data[expert], t.shape[1:])
    if t.type is None:  # a type only the gguf package dequantizes (DEQUANTIZED_TYPES)
        from gguf import GGMLQuantizationType, quants

        return torch.from_numpy(quants.dequantize(np.asarray(raw), GGMLQuantizationType[t.ggml_type])).reshape(shape)
    data = torch.from_numpy(np.array(raw))  # a copy: the reader's map is read-only
    if t.type in FLOATS:
        return data.view(FLOATS[t.type]).reshape(shape) if data.dtype == torch.uint8 else data.reshape(shape)
    return dequantize(data, t.type).reshape(shape)


def model_dtype(model: GgufModel) -> torch.dtype:
    """What the model computes in: its experts' float type (a float expert is computed in its own), else the
    embeddings', else bfloat16 (a file that quantized both)."""
    experts = next((n for n in model.tensors if n.endswith("ffn_gate_exps.weight")), "")  # (the first MoE layer's)
    for name in (experts, "token_embd.weight"):
        t = model.tensors.get(name)
        if t is not None and t.type in FLOATS:
            return FLOATS[t.type]
    return torch.bfloat16


@dataclass(frozen=True)
class ExpertTensors:
    """One layer's three stacked expert tensors, and their biases where the experts have them (gpt-oss)."""

    gate: Tensor
    up: Tensor
    down: Tensor
    biases: tuple[Tensor, Tensor, Tensor] | None = None  # gate's, up's, down's: [E, I], [E, I], [E, H]

    def matrix(self, name: str, t: Tensor, rows: int, k: int) -> tuple[str, str, tuple[int, int]]:
        """(store tensor, dtype, shape) of one expert's slice of `t` [E, rows, k]."""
        if t.type in GGUF_BLOCKS:
            return name, t.type, matrix_shape(t.type, rows, k)
        if t.type in FLOATS:
            return name, t.type, (rows, k)
        raise GgufError(f"{t.name} is {t.ggml_type}; moetier reads a GGUF's experts in F32, F16, BF16, "
                        f"{', '.join(f.upper() for f in GGUF_BLOCKS)}", hint="requantize with llama-quantize")

    def layout(self, spec: ModelSpec, name: str) -> PrecisionLayout:
        h, i = spec.hidden_size, spec.moe_intermediate_size
        if self.gate.type != self.up.type:
            raise GgufError(f"{self.gate.name} is {self.gate.ggml_type} but {self.up.name} is {self.up.ggml_type}: "
                            f"moetier keeps an expert's gate and up in one type", hint="requantize with llama-quantize")
        tensors = [self.matrix("gate_up_proj", self.gate, 2 * i, h), self.matrix("down_proj", self.down, h, i)]
        if self.biases is not None:
            gate_b, up_b, down_b = self.biases
            if gate_b.type != up_b.type:
                raise GgufError(f"{gate_b.name} is {gate_b.ggml_type} but {up_b.name} is {up_b.ggml_type}: moetier "
                                f"keeps an expert's gate and up biases in one type", hint=HINT)
            tensors += [("gate_up_proj.bias", gate_b.type, (2 * i,)), ("down_proj.bias", down_b.type, (h,))]
        return PrecisionLayout.packed(name, tensors)

    def locate(self, expert: int) -> dict[str, list[Located]]:
        def piece(t: Tensor) -> Located:
            step = t.nbytes // t.shape[0]
            rows, *k = t.shape[1:]
            return Located(t.path, t.offset + expert * step, step, t.type,
                           matrix_shape(t.type, rows, *k) if t.type in GGUF_BLOCKS else (rows, *k))

        out = {"gate_up_proj": [piece(self.gate), piece(self.up)], "down_proj": [piece(self.down)]}
        if self.biases is not None:
            gate_b, up_b, down_b = self.biases
            out |= {"gate_up_proj.bias": [piece(gate_b), piece(up_b)], "down_proj.bias": [piece(down_b)]}
        return out


def expert_tensors(model: GgufModel, spec: ModelSpec, layer: int) -> ExpertTensors:
    h, i, e = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    biases = None
    if bias_tensors(spec):
        biases = tuple(model.tensor(f"blk.{layer}.ffn_{p}_exps.bias") for p in PARTS)
        for t, shape in zip(biases, ((e, i), (e, i), (e, h))):
            if t.shape != shape:
                raise GgufError(f"{t.name} is {t.shape}; the file's metadata implies {shape}", hint=HINT)
    tensors = ExpertTensors(*(model.tensor(f"blk.{layer}.ffn_{p}_exps.weight") for p in PARTS), biases)
    for t, shape in zip((tensors.gate, tensors.up, tensors.down), ((e, i, h), (e, i, h), (e, h, i))):
        if t.shape != shape:
            raise GgufError(f"{t.name} is {t.shape}; the file's metadata implies {shape}", hint=HINT)
    return tensors


def kept_as_they_are(model: GgufModel, spec: ModelSpec) -> bool:
    """Whether the experts are read in place: every expert tensor in a type the kernels compute, their biases
    (gpt-oss's) in a float type. Otherwise every expert is copied."""
    kinds = (*FLOATS, *GGUF_BLOCKS)
    return all(t.type in kinds for layer in spec.moe_layers
               for t in (model.tensor(f"blk.{layer}.ffn_{p}_exps.weight") for p in PARTS)) and \
        (not bias_tensors(spec) or all(model.tensor(f"blk.{layer}.ffn_{p}_exps.bias").type in FLOATS
                                       for layer in spec.moe_layers for p in PARTS))


def bias_tensors(spec: ModelSpec) -> bool:
    return any(name.endswith(".bias") for name, _ in spec.expert_shapes)


def expert_copy(model: GgufModel, tensors: ExpertTensors, expert: int, dtype: torch.dtype,
                       biases: bool) -> dict[str, torch.Tensor]:
    """One expert's tensors as native_layout keeps them, in `dtype`: dequantized (or as they are, for floats)."""
    gate, up, down = (values(t, expert).to(dtype) for t in (tensors.gate, tensors.up, tensors.down))
    out = {"gate_up_proj": torch.cat([gate, up]), "down_proj": down}
    if biases:
        gate_b, up_b, down_b = (values(model.tensor(t.name.replace(".weight", ".bias")), expert).to(dtype)
                                for t in (tensors.gate, tensors.up, tensors.down))
        out |= {"gate_up_proj.bias": torch.cat([gate_b, up_b]), "down_proj.bias": down_b}
    return out


def note_copied_experts(model: GgufModel, spec: ModelSpec, layout: PrecisionLayout) -> None:
    experts = [model.tensor(f"blk.{layer}.ffn_{p}_exps.weight") for layer in spec.moe_layers for p in PARTS]
    kinds = Counter(t.ggml_type for t in experts)
    file_bytes = sum(t.nbytes for t in experts)
    copies = len(spec.moe_layers) * spec.num_experts * layout.blob_bytes
    unread = [k for k in kinds if KNOWN_TYPES.get(k) not in (*FLOATS, *GGUF_BLOCKS)]
    why = (f"are {', '.join(kinds)}; moetier's kernels do not compute {', '.join(unread)}" if unread else
           "carry biases in a type moetier does not read in place")
    print(f"moetier: the experts of {model.path.name} {why}: copied once here to {layout.name} in the store "
          f"({format_bytes(copies)} written, {copies / file_bytes:.1f}x the file's {format_bytes(file_bytes)})"
          + ("; requantized to Q4_K_M, Q8_0 or Q6_K with llama-quantize, they are read in place" if unread else ""),
          file=sys.stderr)


def expert_layout(model: GgufModel, spec: ModelSpec, dtype: torch.dtype) -> PrecisionLayout:
    """How the store keeps the experts: in the file's types where read in place, else as a folder's copies."""
    return precision_layout(model, spec) if kept_as_they_are(model, spec) else native_layout(spec, dtype)


def precision_layout(model: GgufModel, spec: ModelSpec) -> PrecisionLayout:
    """The experts' precision (named by gate and up's type) and its layout, per layer where layers differ."""
    per_layer = {layer: expert_tensors(model, spec, layer) for layer in spec.moe_layers}
    kinds = {t.gate.type for t in per_layer.values()}
    if len(kinds) > 1:
        raise GgufError(f"{model.path.name} keeps its layers' experts in several types ({', '.join(sorted(kinds))}); "
                        f"moetier reads one type for gate and up across layers", hint="requantize with llama-quantize")
    kind = kinds.pop()
    name = kind if kind in GGUF_BLOCKS else PRECISION_OF_DTYPE[FLOATS[kind]]
    layouts = {layer: t.layout(spec, name).tensors for layer, t in per_layer.items()}
    common = Counter(layouts.values()).most_common(1)[0][0]
    if kind in FLOATS and {t.down.type for t in per_layer.values()} != {kind}:
        raise GgufError(f"{model.path.name}: experts' down_proj in another type than gate and up ({kind})", hint=HINT)
    return PrecisionLayout(name, common, {layer: t for layer, t in layouts.items() if t != common})


def index_gguf(path: Path | str, store_dir: Path | str, overwrite: bool = False, progress: bool = True) -> Path:
    """Index GGUF `path` (any part of a split set) into a linked store at `store_dir`. Atomic, as convert."""
    path, store_dir = Path(path), Path(store_dir)
    check_replaceable(store_dir, "store", is_store, overwrite, (path,))
    model = GgufModel(path)
    dtype = model_dtype(model)
    config = dict(model.config(), dtype=str(dtype).removeprefix("torch."))
    family, spec = family_for(config), parse_spec(config)
    in_place, biases = kept_as_they_are(model, spec), bias_tensors(spec)
    layout = expert_layout(model, spec, dtype)
    ckpt = GgufCheckpoint(model, dtype)
    dense = dense_tensors(ckpt, family, spec)
    names = {part: part.name for part in model.parts}
    indexed = {name: SourceFile.of(part) for part, name in names.items()}
    blocks = dense_blocks(model, ckpt, family.dense_names(spec))
    in_blocks = {model.tensor(ckpt.gguf_name(family.dense_names(spec)[n])).name for n in blocks}
    dequantized = [n for n in ckpt.dequantized if n not in in_blocks]
    if dequantized:
        size = sum(model.tensor(n).nbytes for n in dequantized)
        print(f"moetier: {len(dequantized)} dense tensors of {path.name} ({format_bytes(size)}, e.g. {dequantized[0]}) "
              f"are computed in {str(ckpt.dtype).removeprefix('torch.')}, dequantized once here; what the kernels "
              f"compute in the file's blocks stays in them", file=sys.stderr)
    files = tokenizer_files(model.metadata)
    total = len(spec.moe_layers) * spec.num_experts
    copies = (0, 0) if in_place else (total, layout.blob_bytes)
    needed = store_bytes(sum(t.nbytes for t in dense.values()), *copies, sum(map(len, files.values()))) \
        + total * MANIFEST_BYTES_PER_LINKED_BLOB
    if not in_place:
        note_copied_experts(model, spec, layout)
    with StoreWriter(store_dir, overwrite, tuple(model.parts), needed) as writer, \
            tqdm(total=total, desc=f"index {path.name}", unit="expert", disable=not progress) as bar:
        writer.write_dense(dense)
        paths = {name: part for part, name in names.items()}
        for layer in spec.moe_layers:
            tensors, own = expert_tensors(model, spec, layer), layout.for_layer(layer)
            for e in range(spec.num_experts):
                if not in_place:
                    writer.add_expert(layer, e, layout, expert_copy(model, tensors, e, dtype, biases))
                    bar.update()
                    continue
                segments = segments_of(tensors.locate(e), own, names)
                if isinstance(segments, str):
                    raise GgufError(f"expert {e} of layer {layer}: {segments}", hint=HINT)
                writer.add_linked(layer, e, layout, segments, segments_crc32(segments, paths))
                bar.update()
        for name, data in files.items():
            (writer.tmp / name).write_bytes(data)
            writer.add_file(name)
        manifest = Manifest(family=family.name, config=config, precisions={layout.name: layout},
                            native_precision=layout.name, blobs=tuple(writer.blobs), source=str(path.resolve()),
                            tokenizer_files=tuple(files), sources=indexed, dense_blocks=blocks)
        return writer.commit(manifest)


def dense_blocks(model: GgufModel, ckpt: GgufCheckpoint, names: dict[str, str]) -> dict[str, DenseBlock]:
    """The attention projections and the head the file keeps in a block format, as the engine computes them in it
    (`--dense-precision native`): where each lies, and its checksum."""
    out = {}
    for ours, theirs in names.items():
        if not (ours == "lm_head" or quantized_names([ours])):
            continue
        t = model.tensor(ckpt.gguf_name(theirs))
        if t.type not in GGUF_BLOCKS:
            continue
        heads = 0
        if model.arch_spec.permute_qk and ours.endswith(("q_proj", "k_proj")):
            heads = int(model.key("attention.head_count" if ours.endswith("q_proj") else "attention.head_count_kv"))
        out[ours] = DenseBlock(t.path.name, t.offset, t.nbytes, t.type, t.shape[0], t.shape[1],
                               crc32(np.asarray(t.data).reshape(-1)), heads)
    return out
