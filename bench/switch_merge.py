"""Switch-Base-N as moetier merges it: a Switch-shaped checkpoint (Switch-Base-N's 12 + 12 blocks, every other one
sparse, N top-1 experts a sparse block) written by transformers at a reduced width, converted to a store and merged
by `moetier merge`'s own code (moetier/merge/merge.py) on a calibration trace — what CoMoE's Tables I–II
(bench/comoe_tables.py) take their merged deployments from, in place of a stand-in.

No Switch weights can be fetched here, so the experts are random: which experts group together (Eq. 29 by Eq. 27's
similarity) is what the real merge decides on weights that carry no training, and the merged model's quality is not
asked. What the tables take from the merge is what does not need trained weights: how many experts each layer keeps
(the retention's, on the calibration routing: a fixed ratio, or Eq. 31–33's entropy) and each expert's principal,
through which the replayed trace's tokens are routed. The width is reduced (an expert of 2·32·64 parameters against
Switch-Base's 2·768·3072) so that Switch-Base-256's 3,072 experts take 50 MB; sizes at the real width are the
shape's (moetier/sim/shapes.py) with the merge's per-layer counts, and the stores' own bytes are reported beside.

The calibration routing is the head of the trace the tables replay (its first sequences, from the same synthetic
model: skew and locality fitted to the real OLMoE trace), the replayed requests the rest; router inputs are random
vectors at the reduced width (S_func runs the experts on them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moetier.trace.format import Trace

WIDTH = dict(d_model=32, d_ff=64, d_kv=8, num_heads=4, vocab_size=128)  # Switch-Base: 768, 3072, 64, 12, 32128


@dataclass(frozen=True)
class SwitchMerge:
    experts: int  # N of Switch-Base-N
    kept: dict[int, int]  # MoE layer -> experts the merge kept
    groups: dict[int, tuple[int, ...]]  # MoE layer -> each expert's principal (moetier_merged.groups)
    store_bytes: int  # the reduced-width original store's expert bytes
    merged_bytes: int  # the reduced-width merged store's expert bytes
    method: str  # the retention that ran (moetier_merged.method)


def build_checkpoint(experts: int, out: Path, seed: int = 0) -> Path:
    """A random Switch-shaped checkpoint of `experts` experts a sparse block, by transformers' own class."""
    import torch
    from transformers import AutoConfig, SwitchTransformersForConditionalGeneration
    from transformers.utils import logging

    logging.disable_progress_bar()  # (one shard: the merges' own bar says how far they are)
    torch.manual_seed(seed)
    config = AutoConfig.for_model("switch_transformers", num_layers=12, num_decoder_layers=12, num_experts=experts,
                                  num_sparse_encoder_layers=6, num_sparse_decoder_layers=6, decoder_start_token_id=0,
                                  eos_token_id=1, pad_token_id=0, **WIDTH)
    SwitchTransformersForConditionalGeneration(config).save_pretrained(out)
    return out


def with_router_inputs(trace: Trace, hidden: int, seed: int) -> Trace:
    """`trace` with random router inputs [N, L, hidden] in each of its tables (S_func's calibration vectors)."""
    rng = np.random.default_rng(seed)
    draw = lambda t: rng.standard_normal((t.num_tokens, len(t.layers), hidden)).astype(np.float16)  # noqa: E731
    encoder = dataclasses.replace(trace.encoder, gate_inputs=draw(trace.encoder)) if trace.encoder else None
    return dataclasses.replace(trace, gate_inputs=draw(trace), encoder=encoder)


def split_sequences(trace: Trace, calibration: int) -> tuple[Trace, Trace]:
    """The first `calibration` sequences (the merge's calibration) and the rest (the replayed requests)."""
    head = trace.take(np.flatnonzero(trace.seq < calibration), f"sequences 0..{calibration - 1}: calibration")
    tail = trace.take(np.flatnonzero(trace.seq >= calibration), f"sequences from {calibration}: the requests")
    return head, tail


def merge_switch(experts: int, calibration: Trace, retention, scope: str, work: Path) -> SwitchMerge:
    """Build, convert and merge Switch-Base-`experts` at the reduced width in `work`, calibrated on `calibration`."""
    from moetier.merge.merge import MergeSettings, merge_store
    from moetier.store.convert import convert
    from moetier.store.store import Store

    hf = build_checkpoint(experts, work / f"switch-base-{experts}-hf")
    store = convert(hf, work / f"switch-base-{experts}", overwrite=True, progress=False)
    settings = MergeSettings(retention, align=False, refit="none", scope=scope)  # (neither changes groups or bytes)
    report = merge_store(store, work / f"switch-base-{experts}-merged", with_router_inputs(calibration,
                         WIDTH["d_model"], experts), settings, overwrite=True, progress=False,
                         calibration="synthetic, fitted to the OLMoE trace")
    spec = Store(report.path).spec
    return SwitchMerge(experts, dict(zip(spec.moe_layers, report.kept)), dict(zip(spec.moe_layers,
                       spec.expert_groups)), report.bytes_before, report.bytes_after, settings.retention.name)
