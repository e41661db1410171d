"""Model shapes against the sizes their publishers state, and how names resolve."""

import pytest
import torch

from moetier.cli.models import model_shape
from moetier.sim.shapes import SHAPES, ModelShape, ShapeError


def total_params(s: ModelShape, tied: bool = False) -> float:
    layers = sum(s.dense_params(layer) for layer in range(s.num_layers))
    return s.total_expert_params + layers + s.head_params * (1 if tied else 2)


@pytest.mark.parametrize("name, billions", [
    ("mixtral-8x7b", 46.7), ("phi-3.5-moe", 41.9), ("qwen2-57b-a14b", 57.4), ("deepseek-moe-16b", 16.4),
    ("deepseek-v2-lite", 15.7), ("qwen3-30b-a3b", 30.5), ("moonlight-16b-a3b", 16.0), ("olmoe-1b-7b", 6.9),
    ("qwen1.5-moe-a2.7b", 14.3), ("gpt-oss-20b", 20.9), ("gpt-oss-120b", 116.8), ("deepseek-v3", 671),
    ("glm-4.5-air", 106)])
def test_parameter_counts_match_the_published_totals(name, billions):
    # norms and biases are left out of the shapes, so a total may fall short by a fraction of a percent
    assert total_params(SHAPES[name]) / 1e9 == pytest.approx(billions, rel=0.02)


def test_switch_experts_are_plain_two_matrix_mlps_in_fp32():
    s = SHAPES["switch-base-128"]
    assert (s.expert_params, s.top_k, s.encoder_layers) == (2 * 768 * 3072, 1, 12)
    assert s.moe_layers == (1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23)  # the encoder's, then the decoder's
    assert s.expert_bytes() == 2 * 768 * 3072 * 4  # already 4096-aligned
    assert s.dense_params(0) == 4 * 768 * 768 + 2 * 768 * 3072  # an encoder layer: self-attention only
    assert s.dense_params(12) == 8 * 768 * 768 + 2 * 768 * 3072  # a decoder layer: self- and cross-attention


@pytest.mark.parametrize("experts, billions", [(8, 0.62), (32, 1.98), (64, 3.8), (128, 7.4), (256, 14.7)])
def test_switch_totals_count_encoder_and_decoder(experts, billions):
    """As the model cards and CoMoE §IV-A state them (CoMoE's 15.8 B for -256 is not the checkpoint's 14.7 B)."""
    assert total_params(SHAPES[f"switch-base-{experts}"], tied=True) / 1e9 == pytest.approx(billions, rel=0.02)


def test_expert_bytes_follow_the_precision_and_the_store_alignment():
    s = SHAPES["olmoe-1b-7b"]
    assert s.expert_bytes("bf16") == 3 * 2048 * 1024 * 2
    assert s.expert_bytes("int4") % 4096 == 0 and s.expert_bytes("int4") < s.expert_bytes("bf16") / 3.5
    with pytest.raises(ShapeError, match="unknown precision 'fp8'"):
        s.expert_bytes("fp8")


def test_names_resolve_to_shapes():
    assert model_shape("mixtral-8x7b") == (SHAPES["mixtral-8x7b"], None)
    assert model_shape("allenai/OLMoE-1B-7B-0924")[0] is SHAPES["olmoe-1b-7b"]  # as an imported trace names it
    shape, blob = model_shape("demo-coarse")
    assert (shape.num_experts, shape.top_k) == (8, 2) and blob == shape.expert_bytes()
    with pytest.raises(ShapeError, match="no model shape 'gpt-5'"):
        model_shape("gpt-5")


def test_a_bad_shape_is_refused():
    with pytest.raises(ShapeError, match="top-9 of 8"):
        ModelShape("x", 8, 2, (0, 1), 8, 9, 16, 64, 8, 32)
    with pytest.raises(ShapeError, match="need dense_intermediate_size"):
        ModelShape("x", 8, 2, (1,), 8, 2, 16, 64, 8, 32)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe", "phimoe", "gpt_oss",
                                    "switch_transformers"])
def test_shape_of_a_store_counts_what_it_holds(tiny_store, family):
    """from_spec against the store's own tensors: an expert's parameters, a layer's attention, the KV per token."""
    import math

    from moetier.model.kv_cache import KVCache
    from moetier.store.store import Store

    _, path = tiny_store(family)
    store = Store(path)
    spec, dense = store.spec, store.load_dense()
    shape = ModelShape.from_spec(spec, family)
    assert shape.expert_params == sum(t.numel() for t in store.read_expert(spec.moe_layers[0], 0).values())
    layer = spec.num_layers - 1  # (a decoder layer of an encoder-decoder)
    attention = [t for name, t in dense.items() if name.startswith(f"layers.{layer}.") and t.dim() == 2
                 and name.split(".")[2].removeprefix("cross_") in ATTENTION_WEIGHTS]
    assert shape.attention_params == sum(t.numel() for t in attention)
    kv = KVCache(spec, 1, 10, torch.float32)
    decoder_layers = spec.num_layers - (spec.encoder_decoder.encoder_layers if spec.encoder_decoder else 0)
    assert shape.kv_per_token * decoder_layers * 10 * 4 == kv.nbytes  # (Switch's: cross-attention's too)
    assert math.isclose(shape.expert_bytes(), store.native_layout.blob_bytes)


ATTENTION_WEIGHTS = {"q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj"}


def test_an_encoder_decoders_decode_step_leaves_the_encoder_out(tiny_store):
    """Switch's shape from its spec: a decode step runs the decoder's layers and the head, never the encoder's."""
    from moetier.sim.cost import CostModel
    from moetier.sim.profile import HardwareProfile
    from moetier.store.store import Store

    _, path = tiny_store("switch_transformers")
    spec = Store(path).spec
    enc = spec.encoder_decoder.encoder_layers
    shape = ModelShape.from_spec(spec, "switch")
    assert shape.encoder_layers == enc
    cost = CostModel.of(HardwareProfile.load("rtx4090"), shape)
    traced = [layer for layer in spec.moe_layers if layer >= enc]  # what a recorded trace of it holds
    expected = sum(cost.dense_s(layer, 1) for layer in range(enc, spec.num_layers) if layer not in traced)
    assert cost.rest_of_step_s(traced, 1) == pytest.approx(expected + cost.head_s(1))
