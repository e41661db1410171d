"""Weights in huge pages: moved whole (values, shapes, dtypes; a tensor named twice copied once), aligned, and the
mappings advised so the kernel may back them with 2 MiB pages (what /proc/self/smaps says of the mapping)."""

from pathlib import Path

import pytest
import torch

from moetier.engine.huge_pages import in_huge_pages
from moetier.engine.slots import HostSlots
from moetier.model.dense_quant import QuantizedMatrix, quantize_matrix
from moetier.model.stacked import Stacked
from moetier.store.format import PrecisionLayout

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_on() -> bool:
    return THP.exists() and "[never]" not in THP.read_text()


def eligible(address: int) -> bool:
    """Whether the mapping holding `address` may take huge pages (smaps' THPeligible)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= address < hi:
                for rest in lines[i + 1:]:
                    if rest.startswith("THPeligible:"):
                        return rest.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


def test_dense_weights_move_whole_and_a_shared_tensor_once():
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(300, 64, generator=g).bfloat16()
    q_proj = torch.randn(128, 256, generator=g).bfloat16()
    dense = {"embed_tokens": embed, "lm_head": embed, "layers.0.q_proj": quantize_matrix(q_proj, "int4"),
             "layers.0.input_norm": torch.ones(7, dtype=torch.float32), "empty": torch.empty(0, 3),
             "big": torch.randn(1024, 2048, generator=g).bfloat16()}  # (a mapping of 4 MiB: room for 2 MiB pages)
    want = {name: v.clone() if isinstance(v, torch.Tensor) else v for name, v in dense.items()}
    codes, scales, zeros = (t.clone() for t in (want["layers.0.q_proj"].q.codes, want["layers.0.q_proj"].q.scales,
                                                 want["layers.0.q_proj"].q.zeros))
    out = in_huge_pages(dense)
    assert list(out) == list(want) and not dense  # moved: nothing left behind
    for name in ("embed_tokens", "lm_head", "layers.0.input_norm", "empty", "big"):
        assert out[name].dtype == want[name].dtype and torch.equal(out[name], want[name])
    assert out["embed_tokens"].data_ptr() == out["lm_head"].data_ptr()  # one copy of a tied head
    q = out["layers.0.q_proj"]
    assert isinstance(q, QuantizedMatrix) and q.shape == (128, 256)
    assert torch.equal(q.q.codes, codes) and torch.equal(q.q.scales, scales) and torch.equal(q.q.zeros, zeros)
    for t in (out["embed_tokens"], out["layers.0.input_norm"], q.q.codes, q.q.scales, q.q.zeros):
        assert t.data_ptr() % 64 == 0
    if thp_on():
        assert eligible(out["embed_tokens"].data_ptr())


@pytest.mark.skipif(not thp_on(), reason="this kernel has transparent huge pages off")
def test_expert_slots_may_take_huge_pages():
    layout = PrecisionLayout.swiglu("native", "bfloat16", 1024, 512)  # 3 MiB a slot: 2 MiB pages fit
    slots = HostSlots(layout, 2)
    w = slots.weights(0)
    assert eligible(next(iter(w.values())).data_ptr())


@pytest.mark.parametrize("kind", ["bf16", "int4", "int8"])
def test_a_stacked_matrix_is_its_parts_one_after_another_in_one_place(kind):
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(n, 256, generator=g).bfloat16() for n in (128, 64, 64)]
    made = tuple(p if kind == "bf16" else quantize_matrix(p, kind) for p in parts)
    biases = tuple(torch.randn(n, generator=g).bfloat16() for n in (128, 64, 64))
    want, want_bias = Stacked(made).build(), Stacked(biases).build()  # torch.cat of each role
    out = in_huge_pages({"layers.0.qkv_proj": Stacked(made), "layers.0.qkv_proj.bias": Stacked(biases),
                         "after": torch.ones(3)})
    got = out["layers.0.qkv_proj"]
    assert torch.equal(out["layers.0.qkv_proj.bias"], want_bias) and torch.equal(out["after"], torch.ones(3))
    if kind == "bf16":
        assert torch.equal(got, want) and got.is_contiguous() and got.data_ptr() % 64 == 0
    else:
        assert isinstance(got, QuantizedMatrix) and got.shape == (256, 256) and got.group == want.group
        for a, b in ((got.q.codes, want.q.codes), (got.q.scales, want.q.scales), (got.q.zeros, want.q.zeros)):
            assert (a is None) == (b is None) and (a is None or (torch.equal(a, b) and a.is_contiguous()))
