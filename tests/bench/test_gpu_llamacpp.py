"""bench/gpu/llamacpp_cuda.py's own arithmetic (the build and the benchmark run on the GPU machine): a GPU expert
budget as llama.cpp's `--n-cpu-moe`, and the packed source tree keeping its sources and leaving build folders."""

import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))
from llamacpp_cuda import _source_only, layers_on_cpu  # noqa: E402


@pytest.mark.parametrize("budget, on_cpu", [("0%", 16), ("25%", 12), ("50%", 8), ("100%", 0), ("10%", 14)])
def test_a_budget_keeps_that_share_of_the_layers_experts_on_the_gpu(budget, on_cpu):
    assert layers_on_cpu(budget, 16) == on_cpu


def test_a_budget_beyond_the_whole_is_refused():
    with pytest.raises(ValueError, match="from 0% to 100%"):
        layers_on_cpu("120%", 16)


def entry(name: str, folder: bool) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if folder else tarfile.REGTYPE
    return info


def test_the_packed_tree_leaves_build_folders_and_keeps_build_info():
    assert _source_only(entry("llama.cpp/ggml/build", True)) is None
    assert _source_only(entry("llama.cpp/build-avx2", True)) is None
    assert _source_only(entry("llama.cpp/gguf-py/gguf/__pycache__", True)) is None
    for kept in ("llama.cpp/cmake/build-info.cmake", "llama.cpp/common/build-info.cpp.in"):
        assert _source_only(entry(kept, False)) is not None


def test_every_tool_the_packed_tree_builds_is_packed_and_a_build_target():
    """tools/CMakeLists.txt in the archive adds llama-bench and quantize: both folders go in it, and the build
    asks for both binaries (bench --type q4_k_m needs llama-quantize)."""
    import re

    from llamacpp_cuda import PARTS, TARGETS, TOOLS

    folders = re.findall(r"add_subdirectory\((.+?)\)", TOOLS)
    assert folders == ["llama-bench", "quantize"]
    assert all(f"tools/{folder}" in PARTS for folder in folders)
    assert TARGETS == ("llama-bench", "llama-quantize")
