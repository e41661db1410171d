"""A gpt-oss-20b-shaped GGUF as its released files hold it (llama-quantize's MXFP4_MOE: the experts in MXFP4 beside
F32 biases, every other matrix in Q8_0, the router as converted), with random weights — the file llama.cpp and
moetier both run in bench/peers/compare.py's `mxfp4_moe` rows (`--formats mxfp4_moe`).

How: a tiny gpt-oss (transformers' own class, the bench's tokenizer) goes through llama.cpp's converter and
`llama-quantize ... MXFP4_MOE`, so the names, types and metadata are llama.cpp's; that file is then written again
at gpt-oss-20b's shapes (24 layers, 32 experts of 2,880 x 2,880, top-4, 64 query heads and 8 key-value heads of
64, a 201,088-token vocabulary: the tokenizer's tokens padded as the converter pads them), each tensor's blocks
drawn at random with scales that give weights of ~0.02 (an MXFP4 block's exponent 2^-8, a Q8_0 block's scale
2^-12), the norms 1, the routers wider (decisive routing, as a trained one's). 12.1 GB, written in ~1 min.

    python bench/peers/gpt_oss_synth.py [--out FILE]      # default: moetier's cache, peers/models/
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

NAME = "gpt-oss-20b-synth-mxfp4_moe.gguf"
# gpt-oss-20b's config.json (openai/gpt-oss-20b), the fields that set shapes
SHAPE = dict(hidden=2880, intermediate=2880, experts=32, top_k=4, layers=24, heads=64, kv_heads=8, head_dim=64,
             vocab=201088)
TINY = dict(hidden_size=320, intermediate_size=192, num_local_experts=6, num_experts_per_tok=2, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=128,
            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096)
# the metadata that carries shapes, gpt-oss's keys (the rest is the tiny file's)
SHAPE_KEYS = {"embedding_length": "hidden", "feed_forward_length": "intermediate",
              "expert_feed_forward_length": "intermediate", "expert_count": "experts", "expert_used_count": "top_k",
              "block_count": "layers", "attention.head_count": "heads", "attention.head_count_kv": "kv_heads",
              "attention.key_length": "head_dim", "attention.value_length": "head_dim"}


def tensor_shape(name: str, s: dict) -> tuple[int, ...]:
    """A tensor's shape (torch's order: rows first) at shapes `s`, from its name."""
    h, i, e, v = s["hidden"], s["intermediate"], s["experts"], s["vocab"]
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    part = name.split(".", 2)[-1] if name.startswith("blk.") else name
    shapes = {"token_embd.weight": (v, h), "output.weight": (v, h), "output_norm.weight": (h,),
              "attn_norm.weight": (h,), "post_attention_norm.weight": (h,), "attn_sinks.weight": (s["heads"],),
              "attn_q.weight": (q, h), "attn_q.bias": (q,), "attn_k.weight": (kv, h), "attn_k.bias": (kv,),
              "attn_v.weight": (kv, h), "attn_v.bias": (kv,), "attn_output.weight": (h, q), "attn_output.bias": (h,),
              "ffn_gate_inp.weight": (e, h), "ffn_gate_inp.bias": (e,), "ffn_gate_exps.weight": (e, i, h),
              "ffn_up_exps.weight": (e, i, h), "ffn_down_exps.weight": (e, h, i), "ffn_gate_exps.bias": (e, i),
              "ffn_up_exps.bias": (e, i), "ffn_down_exps.bias": (e, h)}
    if part not in shapes:
        raise SystemExit(f"gpt_oss_synth.py: no shape for {name} (a converter of another version?)")
    return shapes[part]


def random_data(name: str, kind: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random contents of a tensor of GGML type `kind` (bytes for block types, values for float ones)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind in ("F32", "F16", "BF16"):
        if name.endswith("norm.weight"):
            values = np.ones(shape, np.float32)
        elif name.endswith("ffn_gate_inp.weight"):  # a wider router: decisive routing
            values = rng.standard_normal(shape, np.float32) * 0.5 / np.sqrt(shape[-1])
        elif name.endswith("sinks.weight"):
            values = np.zeros(shape, np.float32)
        else:
            values = rng.standard_normal(shape, np.float32) * 0.01
        if kind == "BF16":
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(*shape[:-1], -1)
        return values.astype(np.float16 if kind == "F16" else np.float32)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = int(np.prod(shape)) // block
    data = rng.integers(0, 256, size=(blocks, size), dtype=np.uint8)
    if kind == "MXFP4":
        data[:, 0] = 120  # E8M0: 2^(120 - 128) = 2^-8 times the doubled E2M1 values (RMS 5.9): ~0.023
    elif kind == "Q8_0":
        data[:, :2] = np.frombuffer(np.float16(2.0 ** -12).tobytes(), np.uint8)  # 2^-12 x int8 (RMS 74): ~0.018
    else:
        raise SystemExit(f"gpt_oss_synth.py: {name} is {kind}; MXFP4_MOE makes MXFP4, Q8_0 and float tensors")
    return data.reshape(*shape[:-1], shape[-1] // block * size)


def tiny_gguf(llama, work: Path) -> Path:
    """The tiny gpt-oss through llama.cpp's converter and llama-quantize MXFP4_MOE (made once)."""
    import torch
    from transformers import AutoModelForCausalLM, GptOssConfig

    out = work / "gpt-oss-tiny-mxfp4_moe.gguf"
    if out.exists():
        return out
    hf, bf16 = work / "gpt-oss-tiny-hf", work / "gpt-oss-tiny-bf16.gguf"
    shutil.rmtree(hf, ignore_errors=True)
    tokenizer = HERE.parents[1] / "models" / "demo-coarse" / "tokenizer.json"
    vocab = len(json.loads(tokenizer.read_text())["model"]["vocab"])
    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=vocab, **TINY)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(hf)
    shutil.copy(tokenizer, hf / "tokenizer.json")
    llama.quantize(llama.convert(hf, bf16), out, "mxfp4_moe")
    shutil.rmtree(hf)
    bf16.unlink()
    return out


def scale_up(tiny: Path, out: Path, s: dict = SHAPE, seed: int = 0) -> Path:
    """`tiny` written again at shapes `s`: its metadata (the shape keys and the vocabulary changed), its tensors'
    names and types, random contents. Written under a temporary name, renamed when whole."""
    import gguf

    from moetier.progress import tqdm

    reader = gguf.GGUFReader(tiny)
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    pad = s["vocab"] - len(tokens)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        short = key.removeprefix(f"{arch}.")
        if short in SHAPE_KEYS:
            value = s[SHAPE_KEYS[short]]
        elif key == "tokenizer.ggml.tokens":
            value = tokens + [f"[PAD{i}]" for i in range(pad)]  # as the converter pads a vocabulary
        elif key == "tokenizer.ggml.token_type":
            value = list(value) + [gguf.TokenType.UNUSED] * pad
        elif key.startswith("tokenizer.") and isinstance(value, list) and len(value) == len(tokens):
            value = value + [type(value[0])()] * pad  # (a per-token array: scores)
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    rng = np.random.default_rng(seed)
    layers = [t for t in reader.tensors if not t.name.startswith("blk.")]
    blocks = [t for t in reader.tensors if t.name.startswith("blk.0.")]
    names = [(t.name, t.tensor_type.name) for t in layers] + [
        (f"blk.{n}.{t.name.split('.', 2)[-1]}", t.tensor_type.name) for n in range(s["layers"]) for t in blocks]
    shapes = {name: tensor_shape(name, s) for name, _ in names}
    for name, kind in names:
        qtype = gguf.GGMLQuantizationType[kind]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        shape = shapes[name]
        nbytes = int(np.prod(shape)) // block * size
        writer.add_tensor_info(name, (*shape[:-1], shape[-1] // block * size) if block > 1 else shape,
                               np.dtype(np.uint8) if block > 1 else np.dtype(np.float32), nbytes,
                               raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, kind in tqdm(names, desc=f"write {out.name}", unit="tensor"):
        writer.write_tensor_data(random_data(name, kind, shapes[name], rng))
    writer.close()
    tmp.rename(out)
    return out


def make(llama, work: Path) -> Path:
    """The gpt-oss-20b-shaped MXFP4_MOE file in `work` (made once)."""
    out = work / NAME
    if not out.exists():
        work.mkdir(parents=True, exist_ok=True)
        print(f"writing {out} (gpt-oss-20b's shapes, random weights) ...", flush=True)
        scale_up(tiny_gguf(llama, work), out)
    return out


def main() -> None:
    from llamacpp import build

    from moetier.paths import default_cache_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="default: moetier's cache, peers/models/" + NAME)
    args = ap.parse_args()
    work = args.out.parent if args.out else default_cache_dir() / "peers" / "models"
    path = make(build(default_cache_dir()), work)
    if args.out and path != args.out:
        path.rename(args.out)
    print(args.out or path)


if __name__ == "__main__":
    main()
