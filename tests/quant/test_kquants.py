"""moetier.quant.kquants fits as ggml's reference quantizers fit (no importance matrix): byte for byte against a
line-by-line transliteration of the C (ggml_reference.py) on blocks of every kind a model has, and its weights as
close as the format allows."""

import numpy as np
import pytest
import torch

from moetier.quant import codes
from moetier.quant.ggml_blocks import FORMATS, dequantize
from moetier.quant.kquants import quantize, round_away
from tests.quant import ggml_reference as ref


def blocks(name: str, kind: str, n: int, seed: int) -> np.ndarray:
    size = FORMATS[name].block_size
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, size)) * 0.02
    if kind == "zeros":
        x[:] = 0
    elif kind == "positive":  # every minimum above 0: q4_k/q5_k fit a scale through 0
        x = np.abs(x) + 0.01
    elif kind == "outliers":  # a few weights 50x the rest, as real matrices have
        x[rng.random(x.shape) < 0.01] *= 50
    elif kind == "constant":
        x[:] = 0.125
    elif kind == "mixed":  # a block whose groups differ by orders of magnitude, one group all zero
        x *= 10.0 ** rng.integers(-4, 2, size=(n, size // 16)).repeat(16, axis=1)
        x[:, :16] = 0
    return x.astype(np.float32)


@pytest.mark.parametrize("name", ["q8_0", "q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("kind", ["normal", "zeros", "positive", "outliers", "constant", "mixed"])
def test_the_bytes_are_ggmls(name, kind):
    x = blocks(name, kind, 6, seed=len(kind))
    got = quantize(torch.from_numpy(x), name).numpy()
    want = np.stack([np.frombuffer(ref.QUANTIZE[name](list(map(np.float32, row))), np.uint8) for row in x])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["q8_0", "q4_k", "q5_k", "q6_k"])
def test_a_matrix_is_its_rows_blocks_and_comes_back_close(name):
    fmt = FORMATS[name]
    w = torch.randn(8, 2 * 256) * 0.02
    q = quantize(w, name)
    assert q.shape == (8, fmt.row_bytes(512)) and q.dtype == torch.uint8
    torch.testing.assert_close(q[3], quantize(w[3:4], name)[0], rtol=0, atol=0)
    back = dequantize(q, name)
    rel = ((back - w).norm() / w.norm()).item()
    assert rel < {"q8_0": 0.01, "q6_k": 0.03, "q5_k": 0.05, "q4_k": 0.1}[name]


def test_q4_k_fits_closer_than_min_max_int4():
    """What the issue is about: at ~4.5 bits, the fitted scales beat our min/max int4's 4.25 (on weights with the
    heavy tails trained weights have)."""
    w = torch.from_numpy(np.random.default_rng(0).standard_t(4.0, size=(64, 1024)).astype(np.float32)) * 0.02
    q4k = dequantize(quantize(w, "q4_k"), "q4_k")
    int4 = codes.dequantize(codes.quantize(w, "int4"), torch.float32)
    assert (q4k - w).pow(2).mean() < 0.8 * (int4 - w).pow(2).mean()


@pytest.mark.parametrize("scale", [0.02, 1.0, 2.0 ** -100, 2.0 ** 100])
def test_mxfp4_is_the_gguf_packages_quantizer_byte_for_byte(scale):
    """ggml's quantize_row_mxfp4_ref as the gguf package ports it: the exponent from the block's largest magnitude,
    each weight's nearest code (the first of equals) — over magnitudes far from 1, a block of zeros among them."""
    import gguf

    w = torch.from_numpy(np.random.default_rng(1).standard_t(4.0, size=(64, 512)).astype(np.float32)) * scale
    w[3, 32:64] = 0
    want = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.MXFP4)
    assert torch.equal(quantize(w, "mxfp4"), torch.from_numpy(want).view(64, -1))


def test_mxfp4_gives_back_the_values_of_any_mxfp4_blocks():
    """A gpt-oss checkpoint's experts, dequantized (the store's bf16), quantized again: every value as it was,
    whatever exponent and codes each block had (its new scale at most 2^3 under the old, where its values are codes
    again)."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (4096, 17), generator=g, dtype=torch.uint8)
    blocks[:, 0] = torch.randint(90, 160, (4096,), generator=g, dtype=torch.uint8)
    blocks[::7, 1:] &= 0x33  # (blocks whose largest code is small: their scale moves)
    values = dequantize(blocks.view(256, -1), "mxfp4")
    assert torch.equal(dequantize(quantize(values.bfloat16().float(), "mxfp4"), "mxfp4"), values)


def test_round_away_is_cs_roundf():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -0.49999997, 3.2, -3.7])
    assert round_away(x).tolist() == [1, 2, 3, -1, -3, 0, 0, 3, -4]


def test_what_cannot_be_fitted_is_refused():
    with pytest.raises(ValueError, match="cannot quantize to 'q4_0'"):
        quantize(torch.zeros(1, 32), "q4_0")
    with pytest.raises(ValueError, match="whole blocks of 256"):
        quantize(torch.zeros(2, 320), "q4_k")
    with pytest.raises(ValueError, match="matrix"):
        quantize(torch.zeros(256), "q4_k")
