"""An untied embedding table read a row a token from the store file's pages on the CPU, and counted in the budget
as the rows a run reads (moetier/engine/embedding_rows.py)."""

from types import SimpleNamespace

import pytest
import torch

from moetier import Engine
from moetier.config import MemoryBudget
from moetier.engine import embedding_rows
from moetier.engine.embedding_rows import kept_bytes, rows_read
from moetier.engine.engine import EngineConfig
from moetier.errors import ChecksumError
from moetier.store.checkpoint import safetensors_header
from moetier.store.names import DENSE
from moetier.store.store import Store

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
UNTIED = {"embed_tokens": ((50000, 2048), 204_800_000), "lm_head": ((50000, 2048), 204_800_000)}


def test_only_an_untied_table_on_the_cpu_with_the_weights_as_kept_is_read_by_row():
    decoder, seq2seq = SimpleNamespace(encoder_decoder=None), SimpleNamespace(encoder_decoder=object())
    assert rows_read(decoder, UNTIED, "native", CPU) == ("embed_tokens",)
    assert rows_read(decoder, {"embed_tokens": UNTIED["embed_tokens"]}, "native", CPU) == ()  # (a tied head)
    assert rows_read(decoder, UNTIED, "native", CUDA) == ()
    assert rows_read(decoder, UNTIED, "int4", CPU) == ()  # (quantized at load: read into memory of its own)
    assert rows_read(seq2seq, UNTIED, "native", CPU) == ()


def test_a_table_is_counted_as_the_pages_of_its_rows_a_run_reads():
    """OLMoE's (4 KiB rows: two pages each, with the one a row may straddle into) and gpt-oss's (5,760 bytes:
    three), at most the table itself."""
    page = 4096
    assert kept_bytes((50304, 2048), 50304 * 4096) == embedding_rows.EMBEDDING_ROWS * 2 * page
    assert kept_bytes((201088, 2880), 201088 * 5760) == embedding_rows.EMBEDDING_ROWS * 3 * page  # 48 MiB
    assert kept_bytes((1000, 64), 128_000) == 128_000


def mapped_file(address: int) -> str:
    """The path of the mapping that holds `address` ("" for an anonymous one; /proc/self/maps)."""
    for line in open("/proc/self/maps"):
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) > 5 else ""
    raise AssertionError(f"no mapping holds {address:#x}")


def wide_vocabulary(tiny_store):
    """A tiny OLMoE (untied) whose table is wider than the rows counted below."""
    _, path = tiny_store("olmoe", dtype=torch.bfloat16, vocab_size=8192)
    return path


def test_the_engine_reads_the_table_by_row_and_counts_it_so_with_the_same_tokens(tiny_store, monkeypatch):
    monkeypatch.setattr(embedding_rows, "EMBEDDING_ROWS", 16)
    store = Store(wide_vocabulary(tiny_store))
    tensors = store.dense_tensors()
    table = tensors["embed_tokens"][1]
    assert kept_bytes(*tensors["embed_tokens"]) < table
    prompts = [[5, 900, 8000, 17, 4000], [3, 3, 7000]]

    def run():
        with Engine(store, EngineConfig(expert_memory=MemoryBudget.parse("50%")), progress=False) as engine:
            out = engine.generate(prompts, max_new_tokens=6, ignore_eos=True).token_ids
            return out, engine.dense_bytes, engine.budget.dense_bytes, engine.model.w["embed_tokens"]

    got, dense, budgeted, embed = run()
    assert mapped_file(embed.data_ptr()).endswith(DENSE)  # (the store file's pages, not the huge pages' copy)
    monkeypatch.setattr("moetier.engine.engine.rows_read", lambda *args: ())  # the table whole, in huge pages
    want, whole, budgeted_whole, embed = run()
    assert not mapped_file(embed.data_ptr()).endswith(DENSE)
    assert got == want
    assert whole - dense == budgeted_whole - budgeted == table - kept_bytes(*tensors["embed_tokens"])


def test_a_table_read_by_row_is_checked_against_its_checksum(tiny_store, tmp_path):
    import shutil

    path = tmp_path / "store"
    shutil.copytree(wide_vocabulary(tiny_store), path)
    header, start = safetensors_header(path / DENSE)
    begin, end = header["embed_tokens"]["data_offsets"]
    with open(path / DENSE, "r+b") as f:  # one byte of the table's last row changed
        f.seek(start + end - 3)
        byte = f.read(1)
        f.seek(start + end - 3)
        f.write(bytes([byte[0] ^ 0x40]))
    store = Store(path)
    with pytest.raises(ChecksumError, match="embed_tokens"):
        store.load_dense(by_row=("embed_tokens",))
    loaded = store.load_dense(skip=("embed_tokens",))  # (a tensor skipped is never read, so never checked)
    assert "embed_tokens" not in loaded and "lm_head" in loaded
