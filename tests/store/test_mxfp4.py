"""gpt-oss's MXFP4 experts: dequantized as transformers does, and converted into the store's layout."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetier.errors import UnsupportedModelError
from moetier.store.convert import convert
from moetier.store.mxfp4 import dequantize_mxfp4
from moetier.store.store import Store
from tests.tiny_models import build_tiny


def random_mxfp4(shape, seed):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 130, shape, dtype=torch.uint8, generator=g)
    return blocks, scales


def test_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4((3, 10, 4), seed=0)
    theirs = convert_moe_packed_tensors(blocks, scales)  # [E, in, out], as the reference multiplies x @ W
    for e in range(3):
        assert torch.equal(dequantize_mxfp4(blocks[e], scales[e]), theirs[e].T)


def test_bad_blocks_are_refused():
    blocks, scales = random_mxfp4((4, 2), seed=1)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[:3])


def test_convert_dequantizes_mxfp4_experts(tmp_path):
    """A checkpoint laid out as the released gpt-oss ones: experts as blocks and scales, the rest bf16."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = tmp_path / "hf"
    build_tiny("gpt_oss", hf, dtype=torch.bfloat16, intermediate_size=64)
    tensors = load_file(str(hf / "model.safetensors"))
    expected = {}
    for layer in range(2):
        base = f"model.layers.{layer}.mlp.experts."
        for name, (rows, cols) in {"gate_up_proj": (128, 64), "down_proj": (64, 64)}.items():
            blocks, scales = random_mxfp4((8, rows, cols // 32), seed=layer * 2 + len(name))
            del tensors[base + name]
            tensors[base + name + "_blocks"], tensors[base + name + "_scales"] = blocks, scales
            expected[layer, name] = convert_moe_packed_tensors(blocks, scales)  # [E, in, out]
    save_file(tensors, str(hf / "model.safetensors"))
    config = json.loads((hf / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (hf / "config.json").write_text(json.dumps(config))

    store = Store(convert(hf, tmp_path / "store", progress=False))
    assert store.manifest.native_precision == "bf16"
    for layer in range(2):
        for e in (0, 5):
            w = store.read_expert(layer, e)
            gate_up = expected[layer, "gate_up_proj"][e].T  # [2I, H], gate and up rows interleaved
            assert torch.equal(w["gate_up_proj"], torch.cat((gate_up[0::2], gate_up[1::2])))
            assert torch.equal(w["down_proj"], expected[layer, "down_proj"][e].T)
            bias = tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj_bias"][e]
            assert torch.equal(w["gate_up_proj.bias"], torch.cat((bias[0::2], bias[1::2])))


def test_other_quantized_checkpoints_are_refused(tmp_path):
    hf = tmp_path / "hf"
    build_tiny("deepseek_v3", hf)
    config = json.loads((hf / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="quantized \\('fp8'\\)"):
        convert(hf, tmp_path / "store", progress=False)
    assert not (tmp_path / "store").exists()
