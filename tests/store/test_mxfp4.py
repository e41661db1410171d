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


def mxfp4_checkpoint(tmp_path):
    """A tiny checkpoint laid out as the released gpt-oss ones: experts as blocks and scales, the rest bf16 ->
    (its folder, its tensors, each (layer, matrix)'s experts as transformers dequantizes them [E, in, out])."""
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
    return hf, tensors, expected


def test_convert_dequantizes_mxfp4_experts(tmp_path):
    hf, tensors, expected = mxfp4_checkpoint(tmp_path)
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


def test_an_mxfp4_copy_is_the_checkpoints_values_and_runs(tmp_path):
    """`moetier quantize STORE --precisions mxfp4`: the store's bf16 experts (the checkpoint dequantized) into
    MXFP4 blocks again, every value as the checkpoint had it — the copy a token reads is 4.25 bits a weight where
    the store's is 16 — computed by the block kernels with the biases beside them."""
    from moetier import Engine
    from moetier.config import MemoryBudget
    from moetier.engine.engine import EngineConfig
    from moetier.plan.precision import MixedPrecision
    from moetier.quant.ggml_blocks import dequantize
    from moetier.store.variants import add_precisions

    hf, _, _ = mxfp4_checkpoint(tmp_path)
    path = convert(hf, tmp_path / "store", progress=False)
    add_precisions(path, "mxfp4", progress=False)
    store = Store(path)
    for layer, e in ((0, 1), (1, 6)):
        floats, copy = store.read_expert(layer, e), store.read_expert(layer, e, "mxfp4")
        for name in ("gate_up_proj", "down_proj"):
            assert copy[name].shape == (floats[name].shape[0], floats[name].shape[1] // 32, 17)
            assert torch.equal(dequantize(copy[name], "mxfp4").view(floats[name].shape), floats[name].float())
    matrices = {p: sum(t.nbytes for t in store.manifest.precisions[p].tensors if len(t.shape) > 1)
                for p in ("mxfp4", "bf16")}
    assert matrices["mxfp4"] * 3.7 < matrices["bf16"]  # (16 bits a weight against 4.25)
    outs = {}
    for mode in ("native", "mxfp4"):
        config = EngineConfig(expert_memory=MemoryBudget.parse("50%"), precision=MixedPrecision(mode))
        with Engine(Store(path), config) as engine:
            outs[mode] = engine.generate([[5, 17, 42, 9]], max_new_tokens=12, ignore_eos=True).token_ids[0]
    assert sum(a == b for a, b in zip(outs["native"], outs["mxfp4"])) >= 9


def test_other_quantized_checkpoints_are_refused(tmp_path):
    hf = tmp_path / "hf"
    build_tiny("deepseek_v3", hf)
    config = json.loads((hf / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="quantized \\('fp8'\\)"):
        convert(hf, tmp_path / "store", progress=False)
    assert not (tmp_path / "store").exists()
