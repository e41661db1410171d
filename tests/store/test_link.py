"""Linked stores: the experts read where they lie in the checkpoint's safetensors files (no second copy on disk),
byte for byte what a copied store holds, checked at every open against the source files' size and time, and at
first read against their checksums."""

import os
import shutil

import pytest
import torch

from moetier.cli import main
from moetier.errors import ChecksumError, StoreError
from moetier.store.checkpoint import Checkpoint
from moetier.store.convert import convert
from moetier.store.format import LINKED_VERSION, VERSION, Manifest
from moetier.store.reader import ExpertReader
from moetier.store.store import Store
from tests.tiny_models import build_tiny


def test_a_linked_store_holds_no_expert_bytes_and_names_its_sources(tiny_store):
    _, path = tiny_store("qwen2_moe")
    m = Manifest.load(path)
    assert m.version == LINKED_VERSION and set(m.sources) == {"model.safetensors"}
    assert all(b.linked and b.file == "" for b in m.blobs)
    assert not (path / "experts").exists()
    assert all(len(b.segments) == 3 for b in m.blobs)  # per-expert gate, up, down in the checkpoint
    _, copied = tiny_store("qwen2_moe", copy=True)
    assert Manifest.load(copied).version == VERSION and not Manifest.load(copied).sources


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "switch_transformers"])
def test_linked_and_copied_stores_read_the_same_experts(tiny_store, family):
    _, linked = tiny_store(family)
    _, copied = tiny_store(family, copy=True)
    a, b = Store(linked), Store(copied)
    for layer in a.spec.moe_layers:
        for e in range(a.spec.num_experts):
            x, y = a.read_expert(layer, e), b.read_expert(layer, e)
            assert all(torch.equal(x[name], y[name]) for name in y)


@pytest.mark.parametrize("phased", [True, False], ids=["slot-at-the-files-phase", "aligned-slot"])
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("chunk", [4096, 2 << 20])
def test_the_reader_lands_unaligned_segments_exactly(tiny_store, direct, chunk, phased):
    """The tiny checkpoint's tensors start at offsets O_DIRECT cannot read in place: into an aligned slot each piece
    goes through the thread's bounce buffer, into a slot with slack at the blob's phase only partial pages do (or,
    without O_DIRECT, everything straight in); small chunks split a segment into many pieces."""
    from moetier.engine.slots import HostSlots

    _, path = tiny_store("mixtral")
    store = Store(path)
    assert any(s.offset % 4096 for b in store.manifest.blobs for s in b.segments)
    pool = HostSlots(store.native_layout, 3, slack=4096 if phased else 0)
    keys = [(0, 1), (1, 7), (0, 0)]
    with ExpertReader(path, num_threads=3, chunk_bytes=chunk, direct=direct) as reader:
        for slot, (layer, e) in enumerate(keys):
            blob = store.manifest.blob(layer, e)
            reader.submit(blob, pool.read_target(slot, blob.phase if phased else 0), pool.completions[slot])
        for slot, (layer, e) in enumerate(keys):
            pool.completions[slot].wait()  # its checksum was checked as it landed
            want = store.read_expert(layer, e)
            assert all(torch.equal(pool.weights(slot)[n], want[n]) for n in want)


def test_whole_pages_of_a_linked_expert_go_straight_into_a_slot_at_its_phase(tmp_path, monkeypatch):
    """Experts of whole pages after a header of any length (the usual checkpoint): all of a blob's segments share
    one phase, and with the slot there, only each segment's partial first and last page is bounced."""
    from moetier.engine.slots import HostSlots

    build_tiny("qwen2_moe", tmp_path / "hf", hidden_size=256, moe_intermediate_size=64,
               shared_expert_intermediate_size=64)
    path = convert(tmp_path / "hf", tmp_path / "store", progress=False)
    store = Store(path)
    blob = store.manifest.blob(store.spec.moe_layers[0], 3)
    assert blob.linked and all(s.length % 4096 == 0 for s in blob.segments) and blob.phase
    bounced, direct = [], []
    read = ExpertReader._read
    monkeypatch.setattr(ExpertReader, "_read", lambda self, chunk, buf: (
        (bounced if chunk.bounce else direct).append(len(chunk.dest)), read(self, chunk, buf))[1])
    pool = HostSlots(store.native_layout, 1, slack=4096)
    with ExpertReader(path, num_threads=2) as reader:
        reader.submit(blob, pool.read_target(0, blob.phase), pool.completions[0])
        pool.completions[0].wait()
    want = store.read_expert(blob.layer, blob.expert)
    assert all(torch.equal(pool.weights(0)[n], want[n]) for n in want)
    if sum(direct):  # (a filesystem without O_DIRECT reads everything buffered, straight in)
        assert len(bounced) <= 2 * len(blob.segments) and max(bounced) < 4096
        assert sum(direct) >= sum(s.length for s in blob.segments) - len(blob.segments) * 4096


@pytest.fixture
def hf(tmp_path):
    build_tiny("olmoe", tmp_path / "hf")
    return tmp_path / "hf"


def test_a_source_changed_after_indexing_is_never_read(hf, tmp_path):
    store = convert(hf, tmp_path / "s", progress=False)
    Store(store)
    shard = hf / "model.safetensors"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # touched: maybe rewritten
    with pytest.raises(StoreError, match="changed since .* indexed it"):
        Store(store)
    shard.rename(hf / "moved.safetensors")
    with pytest.raises(StoreError, match="cannot be opened") as e:
        Store(store)
    assert "re-convert" in str(e.value)


def test_bytes_that_rot_under_an_unchanged_name_and_time_fail_their_checksum(hf, tmp_path):
    from moetier import Engine

    store = convert(hf, tmp_path / "s", progress=False)
    shard = hf / "model.safetensors"
    where = Checkpoint(hf).locate("model.layers.1.mlp.experts.6.down_proj.weight")
    st = shard.stat()
    with open(shard, "r+b") as f:
        f.seek(where.offset + 8)
        f.write(b"\xff\xff\xff\xff")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same size and time: only the checksum can tell
    with Engine.from_pretrained(store, expert_memory="100%", progress=False) as engine:
        with pytest.raises(ChecksumError, match=r"expert 6 of layer 1.*model.safetensors"):
            engine.preload()
    with pytest.raises(ChecksumError, match="expert 6 of layer 1"):
        Store(store).read_expert(1, 6)


def test_a_checkpoint_in_another_layout_is_copied_with_a_note(tiny_store, capsys):
    """gpt-oss stores its experts transposed with gate and up interleaved: the store makes its own layout."""
    _, path = tiny_store("gpt_oss")
    m = Manifest.load(path)
    assert not m.sources and all(not b.linked for b in m.blobs)


def test_quantized_copies_of_a_linked_store_are_real_blobs(hf, tmp_path):
    from moetier.store.variants import add_precisions

    store = convert(hf, tmp_path / "s", progress=False)
    add_precisions(store, "int4", progress=False)
    m = Manifest.load(store)
    assert {b.linked for b in m.blobs if b.precision == "int4"} == {False}
    assert {b.linked for b in m.blobs if b.precision == m.native_precision} == {True}
    assert (store / "experts" / "int4").is_dir()
    Store(store).read_expert(0, 3, "int4")


def test_convert_copy_and_the_default(hf, tmp_path, capsys):
    assert main(["convert", str(hf), str(tmp_path / "linked")]) == 0
    assert "read from" in capsys.readouterr().out
    assert main(["convert", "--copy", str(hf), str(tmp_path / "copied")]) == 0
    linked = sum(f.stat().st_size for f in (tmp_path / "linked").rglob("*") if f.is_file())
    copied = sum(f.stat().st_size for f in (tmp_path / "copied").rglob("*") if f.is_file())
    experts = Store(tmp_path / "copied").total_expert_bytes()
    assert copied - linked >= experts * 0.99  # the copy is what a linked store saves
    shutil.rmtree(hf)  # a copied store stands alone; a linked one needs its checkpoint
    Store(tmp_path / "copied")
    with pytest.raises(StoreError, match="cannot be opened"):
        Store(tmp_path / "linked")
