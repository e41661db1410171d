"""Importers for the JSON-lines routing traces in data/traces (see its README), plain (`*.jsonl`) or gzipped
(`*.jsonl.gz`):

- Mixtral logger (`{"dataset", "problem_id", "layer", "experts", "gating_probs", "token_idx"}`), records ordered
  by layer within a token; `problem_id` separates sequences.
- vLLM-MoE-Logger (a `{"type": "meta"}` line, then `{"type": "route", "layer", "topk_ids", "topk_weights"}`):
  Qwen1.5-MoE and OLMoE. Each shared file starts with a warm-up pass of identical records (thousands: vLLM's
  profiling batch), detected and dropped here, with a note saying how many; sequence
  boundaries are not recoverable (token_idx restarts within vLLM batches), so the rest is one stream, and
  files holding different layers are aligned by record order.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np

from moetier.errors import parsing
from moetier.plan.route import DECODE
from moetier.trace.format import Trace, TraceError

# model name fragment -> (num_layers, num_experts), from the models' published configurations
# A leading run of at least this many records routed alike is a warm-up pass (the shared files' are 2,048 and
# 8,448 long); real tokens routed to the same top-k that many times in a row do not occur in them, and
# `--warmup 0` keeps everything where they might.
WARMUP_MIN_RUN = 64
JSONL = (".jsonl", ".jsonl.gz")
KNOWN_MODELS = {"mixtral-8x7b": (32, 8), "qwen1.5-moe-a2.7b": (24, 60), "olmoe-1b-7b": (16, 64)}


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise TraceError(f"{path}:{lineno}: malformed JSON ({getattr(e, 'msg', e)})") from None
                if not isinstance(record, dict):
                    raise TraceError(f"{path}:{lineno}: expected a JSON object")
                yield lineno, record
    except (OSError, EOFError) as e:  # (gzip: BadGzipFile is an OSError; a cut-off file an EOFError)
        raise TraceError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def field(record: dict, name: str, path: Path, lineno: int):
    if name not in record:
        raise TraceError(f"{path}:{lineno}: record has no {name!r} field")
    return record[name]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def expert_ids(value, where: str) -> tuple[int, ...]:
    """A record's routed experts: a non-empty list of expert numbers."""
    if not isinstance(value, list) or not value or not all(_is_int(x) and 0 <= x < 2**15 for x in value):
        raise TraceError(f"{where}: expert ids must be a non-empty list of integers in [0, 32768), got "
                         f"{json.dumps(value)[:80]}")
    return tuple(value)


def routing_weights(value, k: int, where: str) -> tuple[float, ...]:
    """A record's routing weights: one finite number per routed expert."""
    if not isinstance(value, list) or len(value) != k or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value):
        raise TraceError(f"{where}: routing weights must be {k} finite numbers (one per expert id), got "
                         f"{json.dumps(value)[:80]}")
    return tuple(value)


def index(value, name: str, where: str) -> int:
    if not _is_int(value) or value < 0:
        raise TraceError(f"{where}: {name} must be a non-negative integer, got {json.dumps(value)[:40]}")
    return value


def same_top_k(k: int, first_k: int | None, where: str) -> int:
    if first_k is not None and k != first_k:
        raise TraceError(f"{where}: {k} expert ids where earlier records have {first_k}",
                         hint="every record of a trace must route the same top-k")
    return k


def shape_for(hint: str, num_layers: int | None, num_experts: int | None) -> tuple[int, int]:
    known = next((v for k, v in KNOWN_MODELS.items() if k in str(hint).lower()), None)
    layers = num_layers or (known[0] if known else None)
    experts = num_experts or (known[1] if known else None)
    if layers is None or experts is None:
        raise TraceError(f"cannot tell the model shape of {hint!r}",
                         hint="pass --num-layers and --num-experts")
    return layers, experts


def _warmups(streams: dict[int, tuple[list, list]], warmup: int | None) -> dict[int, int]:
    """Records to drop per layer: `warmup` if given, else each layer's detected warm-up pass. Layers logged in the
    same run share its length, so when every stream has the same length the longest detected warm-up applies to
    every layer that has one (a layer's warm-up can end with a few records that differ from its first)."""
    if warmup is not None:
        return dict.fromkeys(streams, warmup)
    warm = {layer: warmup_run(ids) for layer, (ids, _) in streams.items()}
    if len({len(ids) for ids, _ in streams.values()}) == 1 and any(warm.values()):
        longest = max(warm.values())
        warm = {layer: longest if n else 0 for layer, n in warm.items()}
    return warm


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.name.endswith(JSONL))
        if not files:
            raise TraceError(f"{path} holds no *.jsonl or *.jsonl.gz files")
        twice = sorted({p.name.removesuffix(".gz") for p in files if p.name.endswith(".gz")}
                       & {p.name for p in files})
        if twice:
            raise TraceError(f"{path} holds {twice[0]} both plain and gzipped", hint="keep one of the two")
        return files
    if not path.exists():
        raise TraceError(f"{path} does not exist")
    return [path]


def import_trace(path: Path | str, num_layers: int | None = None, num_experts: int | None = None,
                 warmup: int | None = None) -> Trace:
    """`warmup`: records to drop from the start of each layer's stream of a vLLM-MoE-Logger file (None: detect a
    warm-up pass, WARMUP_MIN_RUN or more records routed alike; 0 keeps every record). The trace's notes say what
    was dropped."""
    if warmup is not None and warmup < 0:
        raise TraceError(f"--warmup must be auto or a number of records (0 keeps all), got {warmup}")
    files = _files(Path(path))
    lineno, first = next(read_jsonl(files[0]), (0, None))
    if first is None:
        raise TraceError(f"{files[0]} is empty", hint="a trace file holds one JSON record per line")
    if first.get("type") == "meta":
        importer = partial(_import_vllm, warmup=warmup)
    elif "experts" in first:
        importer = _import_mixtral
    else:
        raise TraceError(f"{files[0]}:{lineno}: unknown trace format (neither a vLLM-MoE-Logger meta line nor a "
                         f"Mixtral logger record)")
    with parsing(str(path), TraceError):  # anything the checks above missed still ends as a TraceError
        return importer(files, num_layers, num_experts)


def warmup_run(ids: list) -> int:
    """The length of the leading run of records routed as the first is, if it is long enough to be a warm-up pass
    (WARMUP_MIN_RUN), else 0."""
    run = next((i for i, x in enumerate(ids) if x != ids[0]), len(ids))
    return run if run >= WARMUP_MIN_RUN else 0


def _import_mixtral(files: list[Path], num_layers: int | None, num_experts: int | None) -> Trace:
    rows: dict[tuple, dict[int, tuple]] = {}  # (file, dataset, problem, token) -> layer -> (ids, weights)
    seqs: dict[tuple, int] = {}
    top_k = None
    for path in files:
        for lineno, r in read_jsonl(path):
            where = f"{path}:{lineno}"
            seq_key = (path.name, json.dumps(r.get("dataset")), json.dumps(field(r, "problem_id", path, lineno)))
            seqs.setdefault(seq_key, len(seqs))
            key = (*seq_key, index(field(r, "token_idx", path, lineno), "token_idx", where))
            ids = expert_ids(field(r, "experts", path, lineno), where)
            top_k = same_top_k(len(ids), top_k, where)
            rows.setdefault(key, {})[index(field(r, "layer", path, lineno), "layer", where)] = (
                ids, routing_weights(field(r, "gating_probs", path, lineno), len(ids), where))
    if not rows:
        raise TraceError(f"{files[0]}: no routing records")
    layers = sorted({layer for row in rows.values() for layer in row})
    incomplete = [key for key, row in rows.items() if len(row) != len(layers)]
    for key in incomplete:  # the logger missed a record: drop the token rather than invent routing
        del rows[key]
    if not rows:
        raise TraceError(f"{files[0]}: no token has a record for every layer {layers}")
    n_layers, n_experts = shape_for(str(files[0].parent), num_layers, num_experts)
    ids = np.zeros((len(rows), len(layers), top_k), np.int16)
    weights = np.zeros((len(rows), len(layers), top_k), np.float16)
    seq, pos = np.zeros(len(rows), np.int32), np.zeros(len(rows), np.int32)
    for i, (key, row) in enumerate(rows.items()):
        seq[i], pos[i] = seqs[key[:3]], key[3]
        for j, layer in enumerate(layers):
            ids[i, j], weights[i, j] = row[layer]
    return Trace("mixtral-8x7b", n_layers, n_experts, top_k, layers, seq, pos, np.full(len(rows), DECODE, np.uint8),
                 ids, weights, source=", ".join(str(f) for f in files),
                 prompts=[f"{json.loads(d)} problem {json.loads(p)}" for (_, d, p) in seqs],
                 notes=["imported from the Mixtral logger format; prefill and decode are not told apart (phase=1)",
                        f"dropped {len(incomplete)} token(s) missing a layer's record: "
                        + ", ".join(f"{k[0]} problem {json.loads(k[2])} token {k[3]}" for k in incomplete[:5])])


def _import_vllm(files: list[Path], num_layers: int | None, num_experts: int | None,
                 warmup: int | None = None) -> Trace:
    streams: dict[int, tuple[list, list]] = {}
    notes, model, top_k = [], "", None
    for path in files:
        records = read_jsonl(path)
        lineno, meta = next(records, (1, {}))
        if meta.get("type") != "meta":
            raise TraceError(f"{path}:{lineno}: expected the vLLM-MoE-Logger meta line first")
        model = meta.get("model_id", model)
        if not isinstance(model, str):
            raise TraceError(f"{path}:{lineno}: model_id must be text, got {json.dumps(model)[:40]}")
        if meta.get("top_k") is not None:
            top_k = same_top_k(index(meta["top_k"], "top_k", f"{path}:{lineno}"), top_k, f"{path}:{lineno}")
        by_layer: dict[int, tuple[list, list]] = {}
        for lineno, r in records:
            if r.get("type") != "route":
                continue
            where = f"{path}:{lineno}"
            ids = expert_ids(field(r, "topk_ids", path, lineno), where)
            top_k = same_top_k(len(ids), top_k, where)
            stream = by_layer.setdefault(index(field(r, "layer", path, lineno), "layer", where), ([], []))
            stream[0].append(ids)
            stream[1].append(routing_weights(field(r, "topk_weights", path, lineno), len(ids), where))
        streams.update(by_layer)
    if not streams or not all(ids for ids, _ in streams.values()):
        raise TraceError(f"{files[0]}: no route records after the meta line",
                         hint="a vLLM-MoE-Logger trace holds {\"type\": \"route\", ...} records")
    warm = _warmups(streams, warmup)
    for layer, (ids, weights) in list(streams.items()):
        how = "as --warmup asked" if warmup is not None else "a run of identical records"
        notes.append(f"layer {layer}: dropped {warm[layer]} warm-up records ({how}), kept {len(ids) - warm[layer]}"
                     if warm[layer] else f"layer {layer}: no warm-up pass found, kept all {len(ids)} records")
        streams[layer] = (ids[warm[layer]:], weights[warm[layer]:])
    layers = sorted(streams)
    n = min(len(streams[layer][0]) for layer in layers)
    if n == 0:
        raise TraceError(f"{files[0]}: only warm-up records (every route record repeats the first)")
    if len(layers) > 1:
        notes.append(f"layers aligned by record order ({n} rows; the alignment is not verified by the source)")
    n_layers, n_experts = shape_for(model or str(files[0].parent), num_layers, num_experts)
    ids = np.stack([np.asarray(streams[layer][0][:n], np.int16) for layer in layers], axis=1)
    weights = np.stack([np.asarray(streams[layer][1][:n], np.float16) for layer in layers], axis=1)
    notes.append("no sequence boundaries in the source: one stream of tokens (seq=0, pos=row)")
    return Trace(model, n_layers, n_experts, ids.shape[-1], layers, np.zeros(n, np.int32),
                 np.arange(n, dtype=np.int32), np.full(n, DECODE, np.uint8), ids, weights,
                 source=", ".join(str(f) for f in files), notes=notes)
