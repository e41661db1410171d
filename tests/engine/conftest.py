"""Fixtures the engine's tests share."""

import shutil

import pytest
import torch

from moetier.store.variants import add_precisions


@pytest.fixture(scope="module")
def quantized(tiny_store, tmp_path_factory):
    """A bf16 four-layer OLMoE with int8, int4 and int2 copies (a store the user made)."""
    _, path = tiny_store("olmoe", dtype=torch.bfloat16, num_hidden_layers=4)
    dest = tmp_path_factory.mktemp("quantized") / "store"
    shutil.copytree(path, dest)
    add_precisions(dest, "int8,int4,int2", progress=False)
    return dest


@pytest.fixture(scope="module")
def wide_quantized(tiny_store, tmp_path_factory):
    """A bf16 two-layer OLMoE whose rows are whole 256-weight blocks (every native kernel takes them), with int8,
    int4, q8_0 and q4_k copies."""
    _, path = tiny_store("olmoe", dtype=torch.bfloat16, hidden_size=256, intermediate_size=256, num_hidden_layers=2)
    dest = tmp_path_factory.mktemp("wide_quantized") / "store"
    shutil.copytree(path, dest)
    add_precisions(dest, "int8,int4,q8_0,q4_k", progress=False)
    return dest
