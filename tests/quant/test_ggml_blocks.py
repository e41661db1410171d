"""GGML's block formats in torch, bit for bit against llama.cpp's own numpy dequantizers (the `gguf` package) on
random valid blocks of every type: random bytes everywhere but the float scales, which are drawn finite."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from moetier.quant.ggml_blocks import FORMATS, dequantize

TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_k": GGMLQuantizationType.Q4_K, "q5_k": GGMLQuantizationType.Q5_K,
         "q6_k": GGMLQuantizationType.Q6_K, "mxfp4": GGMLQuantizationType.MXFP4, "q4_0": GGMLQuantizationType.Q4_0,
         "q4_1": GGMLQuantizationType.Q4_1, "q5_0": GGMLQuantizationType.Q5_0, "q5_1": GGMLQuantizationType.Q5_1}
F16_AT = {"q8_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "mxfp4": (), "q4_0": (0,), "q4_1": (0, 2),
          "q5_0": (0,), "q5_1": (0, 2)}  # where a block keeps fp16s


def random_blocks(name: str, n: int, seed: int) -> np.ndarray:
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n, fmt.type_size), dtype=np.uint8)
    for at in F16_AT[name]:  # finite scales of every size a real file has, signs included
        b[:, at:at + 2] = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 2, n)).astype(np.float16) \
            .view(np.uint8).reshape(n, 2)
    return b


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_sizes_are_ggmls(name):
    assert (FORMATS[name].block_size, FORMATS[name].type_size) == GGML_QUANT_SIZES[TYPES[name]]


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dequantized_bit_for_bit_as_gguf_does(name, seed):
    b = random_blocks(name, 64, seed)
    with np.errstate(over="ignore"):  # MXFP4's largest exponents overflow to inf, in both
        want = gq.dequantize(b, TYPES[name]).reshape(64, -1)
    got = dequantize(torch.from_numpy(b), name).numpy()
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_matrix_of_rows_keeps_its_rows(name):
    fmt = FORMATS[name]
    rows = torch.from_numpy(random_blocks(name, 12, 7)).reshape(3, 4 * fmt.type_size)  # 3 rows of 4 blocks
    w = dequantize(rows, name)
    assert w.shape == (3, 4 * fmt.block_size)
    torch.testing.assert_close(w[1], dequantize(rows[1], name), rtol=0, atol=0)


def test_bytes_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="whole blocks of 144"):
        dequantize(torch.zeros(143, dtype=torch.uint8), "q4_k")
    with pytest.raises(ValueError, match="whole blocks of 256"):
        FORMATS["q4_k"].row_bytes(100)
