"""Quantized expert copies: codes pack and unpack exactly; dequantized weights stay within half a step of the
originals; torch's CPU weight-only kernels, fed our codes, compute what the dequantized weights compute."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.quant.codes import (
    GROUP_SIZE,
    dequantize,
    expert_matrices,
    pack,
    quantize,
    quantize_expert,
    swiglu_shapes,
    unpack,
)
from moetier.store.quantize import expert_layout


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([2, 4]), rows=st.integers(1, 5), blocks=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_pack_then_unpack_is_the_identity(bits, rows, blocks, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (rows, blocks * 8 // bits), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (rows, codes.shape[1] * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)


def test_pack_puts_the_even_column_in_the_low_bits():
    assert pack(torch.tensor([[1, 2]], dtype=torch.uint8), 4).item() == 0x21
    assert pack(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8), 2).item() == 0b00111001


def weights(n=64, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[3, 7] = 0.3  # an outlier: its channel (int8) or group (int4, int2) gets a coarser step
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
def test_dequantized_weights_are_within_half_a_step(precision):
    w = weights().float()
    q = quantize(w, precision)
    error = (dequantize(q, torch.float32) - w).abs()
    if precision == "int8":
        step = q.scales.float()[:, None].expand_as(w)
        bound = step / 2
    else:
        group = GROUP_SIZE[precision]
        step = q.scales.float().repeat_interleave(group, dim=1)
        # the zero is stored in bf16: the grid shifts by its rounding, which can push an end value past a clamp
        shift = q.zeros.float().abs().repeat_interleave(group, dim=1) * 2 ** -8
        bound = step / 2 + shift
    assert torch.all(error <= bound * (1 + 1e-3) + 1e-9)
    assert error.max() > 0  # something was rounded: the test could fail


def test_fewer_bits_lose_more_and_the_bytes_shrink():
    w = weights(k=512)
    errors, sizes = [], []
    for precision in ("int8", "int4", "int2"):
        q = quantize(w, precision)
        errors.append(((dequantize(q, torch.float32) - w.float()).norm() / w.float().norm()).item())
        sizes.append(sum(t.numel() * t.element_size() for t in (q.codes, q.scales, q.zeros) if t is not None))
    assert errors[0] < 0.02 < errors[1] < 0.15 < errors[2] < 0.6  # measured: 0.008, 0.10, 0.45
    assert sizes[0] > sizes[1] > sizes[2]
    assert sizes[1] < 0.55 * sizes[0]  # the codes dominate: about half of int8's bytes, scales included


def test_torch_int8_kernel_computes_what_the_dequantized_weights_do():
    w, x = weights(), torch.randn(3, 256).to(torch.bfloat16)
    q = quantize(w, "int8")
    out = torch.ops.aten._weight_int8pack_mm(x, q.codes, q.scales)
    ref = x.float() @ dequantize(q, torch.float32).t()
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-2)


def test_torch_int4_kernel_takes_our_scales_and_zeros():
    """`_weight_int4pack_mm_for_cpu` wants codes as int32 [N, K] (it packs them its own way) and [K/group, N, 2]
    (scale, zero) with zero the value of code 8: if our zero meant anything else the outputs would differ by
    the weights' whole offset, far beyond bf16 rounding."""
    w, x = weights(), torch.randn(3, 256).to(torch.bfloat16)
    q = quantize(w, "int4")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack(q.codes, 4).to(torch.int32), 1)
    scales_and_zeros = torch.stack([q.scales, q.zeros], dim=-1).transpose(0, 1).contiguous()
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP_SIZE["int4"], scales_and_zeros)
    ref = x.float() @ dequantize(q, torch.float32).t()
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("shape, precision, match", [((8, 300), "int4", "divisible by 128"),
                                                     ((8, 66), "int2", "not a multiple"),
                                                     ((8, 128), "int3", "unknown quantized precision"),
                                                     ((8,), "int8", "expected a matrix")])
def test_bad_input_says_what_is_wrong(shape, precision, match):
    with pytest.raises(ValueError, match=match):
        quantize(torch.zeros(shape), precision)


@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
def test_a_transposed_view_quantizes_as_its_copy(precision):
    w = weights(n=256, k=128).t()  # [128, 256], not contiguous
    a, b = quantize(w, precision), quantize(w.contiguous(), precision)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("precision", ["int4", "int2"])
def test_a_row_shorter_than_a_group_is_one_group(precision):
    w = weights(n=16, k=32)
    q = quantize(w, precision)
    assert q.scales.shape == (16, 1)
    err = (dequantize(q, torch.float32) - w).abs().amax(dim=1)
    assert (err <= q.scales.float()[:, 0] * 0.51 + 1e-2).all()


@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
def test_an_expert_blob_round_trips_through_its_layout(precision):
    hidden, inter = 256, 64
    g = torch.Generator().manual_seed(0)
    expert = {"gate_up_proj": torch.randn(2 * inter, hidden, generator=g).bfloat16(),
              "down_proj": torch.randn(hidden, inter, generator=g).bfloat16()}
    layout = expert_layout(precision, swiglu_shapes(hidden, inter))
    tensors = quantize_expert(expert, precision)
    blob = torch.zeros(layout.blob_bytes, dtype=torch.uint8)
    for t in layout.tensors:
        assert t.offset % 64 == 0  # aligned for a view of its dtype and for vector loads
        blob[t.offset:t.offset + t.nbytes] = tensors[t.name].contiguous().view(-1).view(torch.uint8)
    back = expert_matrices(layout.views(blob), precision)
    for name, w in expert.items():
        assert torch.equal(dequantize(back[name]), dequantize(quantize(w, precision)))
    assert layout.blob_bytes < {"int8": 0.6, "int4": 0.4, "int2": 0.3}[precision] * 3 * hidden * inter * 2 + 4096


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_an_expert_with_biases_keeps_them(precision):
    """gpt-oss's experts: the matrices quantized, the biases carried in bf16."""
    hidden, inter = 128, 32
    g = torch.Generator().manual_seed(1)
    shapes = (*swiglu_shapes(hidden, inter), ("gate_up_proj.bias", (2 * inter,)), ("down_proj.bias", (hidden,)))
    expert = {name: torch.randn(*shape, generator=g) for name, shape in shapes}
    layout = expert_layout(precision, shapes)
    tensors = quantize_expert(expert, precision)
    blob = torch.zeros(layout.blob_bytes, dtype=torch.uint8)
    for t in layout.tensors:
        blob[t.offset:t.offset + t.nbytes] = tensors[t.name].contiguous().view(-1).view(torch.uint8)
    views = layout.views(blob)
    assert sorted(expert_matrices(views, precision)) == ["down_proj", "gate_up_proj"]
    for name in ("gate_up_proj.bias", "down_proj.bias"):
        assert torch.equal(views[name], expert[name].bfloat16())


@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
def test_rows_taken_a_few_at_a_time_give_the_codes_of_all_at_once(precision, monkeypatch):
    """A big matrix is quantized in pieces written into place (a 50k-row head in one go would need GBs of fp32):
    the pieces, the last one shorter, make exactly the copy of the whole."""
    import moetier.quant.codes as codes

    w = torch.randn(37, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    whole = quantize(w, precision)
    monkeypatch.setattr(codes, "ROWS_AT_ONCE", 5 * 256)  # pieces of 5 rows: 8 of them, the last of 2
    pieces = quantize(w, precision)
    for a, b in zip((whole.codes, whole.scales, whole.zeros), (pieces.codes, pieces.scales, pieces.zeros)):
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))
