"""Tiny GGUF files for the tests, written by the `gguf` package's writer (llama.cpp's own) with the keys and tensor
names llama.cpp's converter gives an OLMoE model (convert_hf_to_gguf.py's OlmoeModel: no permutation, experts
stacked per layer as blk.N.ffn_{gate,up,down}_exps, norms and the router in F32)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf import quants as gguf_quants

from moetier.quant.kquants import quantize

BLOCK_TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_k": GGMLQuantizationType.Q4_K,
               "q5_k": GGMLQuantizationType.Q5_K, "q6_k": GGMLQuantizationType.Q6_K,
               "q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1,
               "q5_0": GGMLQuantizationType.Q5_0, "q5_1": GGMLQuantizationType.Q5_1}
LEGACY = ("q4_0", "q4_1", "q5_0", "q5_1")  # quantized by the gguf package's own (moetier never writes them)
# Types neither moetier nor the gguf package quantizes: written as random valid blocks (random codes, scales
# fixed to sane values — the byte of each block that holds them), whatever the values given: tests compare them
# with their dequantized values, not with the checkpoint's. {type: [(byte offset in a block, its value)]}
RANDOM_BLOCKS = {"Q2_K": [(80, b"\x00\x14"), (82, b"\x00\x14")], "Q3_K": [(108, b"\x00\x14")],
                 "IQ4_XS": [(0, b"\x00\x04")], "MXFP4": [(0, bytes([121]))]}  # (fp16 2^-10, 2^-14; 2^-6)


def random_blocks(shape: tuple[int, ...], kind: str, seed: int = 0) -> np.ndarray:
    """uint8 [*shape[:-1], row bytes] of `kind` for float values of `shape` (rows along the last axis)."""
    qtype = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    rows, blocks = int(np.prod(shape[:-1])), shape[-1] // block
    data = np.random.default_rng(seed).integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for offset, value in RANDOM_BLOCKS[kind]:
        data[:, :, offset:offset + len(value)] = np.frombuffer(value, np.uint8)
    return data.reshape(*shape[:-1], blocks * size)


def tokenizer_metadata(tokenizer_json: Path) -> dict:
    """A byte-level BPE tokenizer.json as the converter writes it into `tokenizer.ggml.*`."""
    d = json.loads(tokenizer_json.read_text())
    vocab = d["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["id"] for t in d["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in d["model"]["merges"]]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3 if i in special else 1 for i in range(len(tokens))],
            "tokenizer.ggml.merges": merges}


def write(path: Path, arch: str, keys: dict, tensors: dict, tokenizer: dict | None = None) -> Path:
    """`keys`: {arch}-relative metadata (ints, floats, strings); `tensors`: name -> float32 array (written F32) or
    (array, type): a block type (quantized with moetier's ggml-exact quantizer, rows along the last axis),
    "bf16", or a RANDOM_BLOCKS type (random blocks of the array's shape)."""
    w = GGUFWriter(path, arch)
    for key, value in keys.items():
        full = f"{arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_string(full, value)
    for key, value in (tokenizer or {}).items():
        if key == "tokenizer.ggml.token_type":
            w.add_array(key, [int(v) for v in value])
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            values, kind = t
            import torch

            if kind == "bf16":
                raw = torch.from_numpy(np.ascontiguousarray(values, np.float32)).bfloat16().view(torch.int16).numpy()
                data = raw.view(np.uint8).reshape(*values.shape[:-1], -1)  # the writer takes a byte shape
                w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType.BF16)
                continue
            if kind in RANDOM_BLOCKS:
                raw = random_blocks(values.shape, kind, seed=len(name))
                w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType[kind])
                continue
            rows = torch.from_numpy(np.ascontiguousarray(values, np.float32)).reshape(-1, values.shape[-1])
            raw = (gguf_quants.quantize(rows.numpy(), BLOCK_TYPES[kind]) if kind in LEGACY else
                   quantize(rows, kind).numpy()).reshape(*values.shape[:-1], -1)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=BLOCK_TYPES[kind])
        else:
            w.add_tensor(name, np.ascontiguousarray(t, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def olmoe_keys(layers=2, hidden=256, heads=4, experts=4, top_k=2, ff=256) -> dict:
    return {"block_count": layers, "context_length": 128, "embedding_length": hidden, "feed_forward_length": ff,
            "attention.head_count": heads, "attention.head_count_kv": heads, "rope.freq_base": 10000.0,
            "attention.layer_norm_rms_epsilon": 1e-6, "expert_count": experts, "expert_used_count": top_k}


def olmoe_tensors(rng, layers=2, hidden=256, experts=4, ff=256, vocab=300, expert_type=None) -> dict:
    """Random weights in the converter's names; experts F32, or (array, type) when `expert_type` is given."""
    def r(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    out = {"token_embd.weight": r(vocab, hidden), "output_norm.weight": 1 + r(hidden), "output.weight": r(vocab, hidden)}
    for i in range(layers):
        b = f"blk.{i}."
        out.update({b + "attn_norm.weight": 1 + r(hidden), b + "ffn_norm.weight": 1 + r(hidden),
                    b + "attn_q.weight": r(hidden, hidden), b + "attn_k.weight": r(hidden, hidden),
                    b + "attn_v.weight": r(hidden, hidden), b + "attn_output.weight": r(hidden, hidden),
                    b + "attn_q_norm.weight": 1 + r(hidden), b + "attn_k_norm.weight": 1 + r(hidden),
                    b + "ffn_gate_inp.weight": r(experts, hidden)})
        for part, shape in (("gate", (experts, ff, hidden)), ("up", (experts, ff, hidden)),
                            ("down", (experts, hidden, ff))):
            values = r(*shape)
            out[b + f"ffn_{part}_exps.weight"] = values if expert_type is None else (values, expert_type)
    return out
