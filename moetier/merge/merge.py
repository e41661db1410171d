"""`moetier merge`: a model with similar experts merged into fewer (CoMoE §III-B, Eq. 25–33), written as a store of
its own that every command runs like any other model.

From a store and a calibration trace of it (routing and router inputs on calibration text, `TraceRecorder` with
gate inputs), for each MoE layer: the experts' activation frequencies (Eq. 28), their similarities (Eq. 25–27,
moetier/merge/similarity.py), the principals kept and every other expert's group (Eq. 29, 31–33,
moetier/merge/plan.py), and each group averaged into one expert with the members' frequencies as weights (Eq. 30;
in fp32, rounded once to the store's precision; a group whose members were never routed to is averaged evenly).
The merged expert keeps its principal's id; the others are absent from the new store, and the model's config
records each expert's principal (`moetier_merged.groups`), from which the router sends a token to the merged
expert with its group's summed probability (moetier/model/router.py: MergedRouter). Dense weights, shared experts
and dense layers are copied unchanged. Only the store's own precision is written: quantize the merged store as any
other (`moetier quantize`).

Eq. 30 as written averages the members' weights unit by unit, but an expert's hidden units have no order of their
own: permuting them (gate and up rows with the same down columns) leaves what it computes unchanged, and experts
trained apart put alike units in different places. The paper's basis ([18], "Merge, then Compress") therefore
permutes each member's units to match its principal's before averaging; so does this (`align`, on by default): each
member's units are matched one to one to the principal's by the cosine of their weights (gate row, up row and
down column; an assignment problem, solved exactly), which changes nothing a member computes alone and makes the
average one of alike units. `--no-align` averages as Eq. 30 is written; docs/merging.md measures both. Experts wider
than ALIGN_MAX_UNITS are averaged unaligned (the store's config says which was done)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moetier.atomic import check_replaceable
from moetier.errors import MoetierError
from moetier.merge.plan import LayerMerge, Retention, activation_frequency, combined_similarity, plan_layer
from moetier.merge.refit import REFITS, group_tokens, refit_expert
from moetier.merge.similarity import expert_output, functional_similarity, parameter_similarity
from moetier.progress import tqdm
from moetier.store.format import Manifest, is_store
from moetier.store.store import Store
from moetier.store.writer import StoreWriter, store_bytes
from moetier.trace.format import Trace

FUNC_TOKENS = 128  # calibration tokens per layer for S_func: each expert runs on all of them
PARAM_CHUNK = 1 << 18  # parameters of each expert per step of the cosine's Gram matrix
MEMBERS = ("average", "principal")
SCOPES = ("all", "encoder")
TUNE_MAX_PARAMS = 1 << 20  # the default refit tunes every weight of experts this small (the demo models' 49-393 K;
# OLMoE's 6.3 M, Mixtral's 176 M take the closed-form `down`): 100 Adam steps over each group's tokens, minutes
ALIGN_MAX_UNITS = 4096  # an exact assignment is O(I^3): ~0.4 s at 2048 units, hours for a Mixtral's 14,336


@dataclass(frozen=True)
class MergeSettings:
    retention: Retention  # how many principals: a ratio, adaptive, or above θ_act (ActivationThreshold)
    alpha: float = 0.5  # Eq. 27: the weight of parameter similarity against functional
    align: bool = True  # permute each member's hidden units to its principal's before averaging
    members: str = "average"  # Eq. 30; "principal": the principal's own weights (a baseline: pruning, rerouted)
    refit: str | None = None  # then fit each merged expert to its group's outputs: one of REFITS
    # (moetier/merge/refit.py); None: for averaged members "all" where the experts are small enough to tune in
    # minutes (TUNE_MAX_PARAMS), else "down"; "none" for a principal's own weights
    scope: str | None = None  # which MoE layers merge: all, or an encoder-decoder's encoder alone (CoMoE
    # §III-B 3's encoder-focused aggregation); None: "encoder" for an encoder-decoder, "all" otherwise

    def __post_init__(self) -> None:
        if self.members not in MEMBERS:
            raise MoetierError(f"--members must be one of {', '.join(MEMBERS)}, got {self.members!r}")
        if self.refit is None and self.members == "principal":
            object.__setattr__(self, "refit", "none")
        if self.refit is not None and self.refit not in REFITS:
            raise MoetierError(f"--refit must be one of {', '.join(REFITS)}, got {self.refit!r}")
        if self.members == "principal" and self.refit != "none":
            raise MoetierError(f"--members principal keeps each principal's own weights; --refit {self.refit} would "
                               f"change them", hint="drop --refit (or --members principal)")
        if not 0 <= self.alpha <= 1:
            raise MoetierError(f"--alpha must be in [0, 1], got {self.alpha}")
        if self.scope is not None and self.scope not in SCOPES:
            raise MoetierError(f"--scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")

    def refit_for(self, spec) -> str:
        """The refit that runs for a model of `spec`: as given, or by the experts' size — `all` (every weight
        tuned: +3.3% perplexity on demo-deep's held-out prose at half the experts, against +7.3% with `down`) where
        an expert has at most TUNE_MAX_PARAMS parameters, `down` (closed form) beyond, where tuning takes hours on
        a CPU."""
        if self.refit is not None:
            return self.refit
        return "all" if spec.expert_params <= TUNE_MAX_PARAMS else "down"

    def scope_for(self, spec) -> str:
        """The scope that runs for a model of `spec`: as given, or the model's default."""
        if self.scope == "encoder" and spec.encoder_decoder is None:
            raise MoetierError("--scope encoder merges an encoder-decoder's encoder; this model is a decoder alone",
                               hint="use --scope all (the default for it)")
        return self.scope or ("encoder" if spec.encoder_decoder is not None else "all")


@dataclass(frozen=True)
class MergeReport:
    path: Path
    kept: tuple[int, ...]  # experts per MoE layer after merging
    num_experts: int
    bytes_before: int  # expert bytes at the store's precision
    bytes_after: int


def check_mergeable(store: Store) -> None:
    """Refuse, before any work, what merging is not defined for here."""
    spec = store.spec
    if spec.expert_groups:
        raise MoetierError(f"{store.path.name} is merged already", hint="merge the original model instead")
    if spec.activation not in ("swiglu", "relu"):
        raise MoetierError(f"merging averages SwiGLU or ReLU experts; {store.path.name}'s ({store.manifest.family}) "
                           f"are {spec.activation} with biases and clamping", hint="merge a model of another family")
    if spec.router.kind not in ("softmax", "top1"):
        raise MoetierError(f"merging sums each group's softmax probabilities; {store.path.name}'s router is "
                           f"{spec.router.kind!r}", hint="merge a model whose router takes a softmax over every "
                                                         "expert (Mixtral, Qwen, OLMoE, DeepSeek-V2, Switch)")


def check_trace(store: Store, trace: Trace) -> None:
    spec = store.spec
    if (trace.num_experts, trace.top_k, tuple(trace.all_layers)) != (spec.num_experts, spec.top_k,
                                                                      spec.moe_layers):
        raise MoetierError("the calibration trace is not of this model (its layers, experts or top-k differ)",
                           hint="record it from the model being merged")
    if any(table.gate_inputs is None for table, _ in layer_tables(trace)):
        raise MoetierError("the calibration trace has no router inputs (S_func runs the experts on them)",
                           hint="record it with --gate-inputs")


def layer_tables(trace: Trace) -> list[tuple[Trace, int]]:
    """(table, column) of each MoE layer the trace routes, in order: an encoder-decoder's encoder layers in its
    encoder's table, then the trace's own columns."""
    encoder = [(trace.encoder, j) for j in range(len(trace.encoder.layers))] if trace.encoder is not None else []
    return [*encoder, *((trace, j) for j in range(len(trace.layers)))]


def layer_merge(store: Store, layer: int, column: int, trace: Trace, settings: MergeSettings) -> LayerMerge:
    """One layer's principals and groups from the routing and router inputs at `column` of `trace` (the layer's
    table: layer_tables)."""
    counts = np.bincount(trace.topk_ids[:, column].ravel(), minlength=store.spec.num_experts)  # [E] (Eq. 28's
    # numerator)
    similarity = layer_similarity(store, layer, column, trace, settings.alpha)
    return plan_layer(counts, similarity, settings.retention, store.spec.top_k)


def kept_whole(store: Store, column: int, trace: Trace) -> LayerMerge:
    """A layer outside the merge's scope: every expert its own group (copied as it is)."""
    counts = np.bincount(trace.topk_ids[:, column].ravel(), minlength=store.spec.num_experts)
    experts = tuple(range(store.spec.num_experts))
    return LayerMerge(experts, experts, tuple(float(x) for x in activation_frequency(counts)))


def layer_similarity(store: Store, layer: int, column: int, trace: Trace, alpha: float) -> np.ndarray:
    """Eq. 27's S = α·S_param + (1 − α)·S_func [E, E] of one layer's experts, S_func on the trace's router inputs
    at `column` (what merging groups by, and what similar-expert substitution substitutes by)."""
    spec = store.spec
    experts = [store.read_expert(layer, e) for e in range(spec.num_experts)]
    param = parameter_similarity(_chunks(experts))  # [E, E]
    rows = np.linspace(0, trace.num_tokens - 1, min(FUNC_TOKENS, trace.num_tokens)).round().astype(int)
    x = torch.from_numpy(trace.gate_inputs[rows, column].astype(np.float32))  # [N, H]
    func = functional_similarity(torch.stack([expert_output(w, x, spec.activation) for w in experts]))  # [E, N, H]
    return combined_similarity(param.numpy(), func.numpy(), alpha)


def _chunks(experts: list[dict[str, torch.Tensor]]):
    """[E, p] slices of every expert's parameters, tensor by tensor (Eq. 25's vectors, a piece at a time)."""
    for name in experts[0]:
        flat = [w[name].reshape(-1) for w in experts]
        for start in range(0, flat[0].numel(), PARAM_CHUNK):
            yield torch.stack([f[start:start + PARAM_CHUNK].float() for f in flat])


def unit_features(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """[I, ·] each hidden unit's weights: its gate and up rows and its down column (ReLU: its up row and down
    column), fp32."""
    down = tensors["down_proj"].float().T  # [I, H]
    if "gate_up_proj" in tensors:
        gate, up = tensors["gate_up_proj"].float().chunk(2)  # [I, H] each
        return torch.cat([gate, up, down], dim=1)
    return torch.cat([tensors["up_proj"].float(), down], dim=1)


def permuted(tensors: dict[str, torch.Tensor], perm: torch.Tensor) -> dict[str, torch.Tensor]:
    """The expert with its hidden units reordered (unit r of the result is unit perm[r]): computes the same."""
    out = dict(tensors, down_proj=tensors["down_proj"][:, perm])
    if "gate_up_proj" in tensors:
        gate, up = tensors["gate_up_proj"].chunk(2)
        out["gate_up_proj"] = torch.cat([gate[perm], up[perm]])
    else:
        out["up_proj"] = tensors["up_proj"][perm]
    return out


def aligned(member: dict[str, torch.Tensor], principal: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`member` with its units matched one to one to `principal`'s, maximising the summed cosine of their weights."""
    from scipy.optimize import linear_sum_assignment

    a = torch.nn.functional.normalize(unit_features(principal), dim=1)
    b = torch.nn.functional.normalize(unit_features(member), dim=1)
    rows, cols = linear_sum_assignment((a @ b.T).numpy(), maximize=True)  # principal unit rows[i] <- member cols[i]
    return permuted(member, torch.from_numpy(cols[np.argsort(rows)]))


def averaged(experts: dict[int, dict[str, torch.Tensor]], frequency: tuple[float, ...]) -> dict[str, torch.Tensor]:
    """Eq. 30: Σ f_j·e_j / Σ f_j over the group `experts` ({id: tensors}), in fp32, rounded once to their dtype."""
    ids = sorted(experts)
    weights = torch.tensor([frequency[e] for e in ids], dtype=torch.float64)
    weights = weights / weights.sum() if weights.sum() > 0 else torch.full_like(weights, 1 / len(ids))
    out = {}
    for name, first in experts[ids[0]].items():
        acc = torch.zeros(first.shape, dtype=torch.float32)
        for e, w in zip(ids, weights.tolist()):
            acc += float(w) * experts[e][name].float()
        out[name] = acc.to(first.dtype)
    return out


def _refitted(kind: str, expert: dict[str, torch.Tensor], src: Store, layer: int, column: int, group: list[int],
              trace: Trace) -> dict[str, torch.Tensor]:
    """`expert` (its group's merge) fitted to the group's outputs on the trace's tokens as `kind` says."""
    rows, shares = group_tokens(trace.topk_ids[:, column], trace.topk_weights[:, column], sorted(group))
    x = torch.from_numpy(trace.gate_inputs[rows, column].astype(np.float32))  # [N, H]
    members = {e: src.read_expert(layer, e) for e in group}  # as stored: outputs do not depend on unit order
    return refit_expert(kind, expert, members, x, shares, src.spec.activation)


def merge_store(source: Path | str, out: Path | str, trace: Trace, settings: MergeSettings, overwrite: bool = False,
                progress: bool = True, calibration: str = "") -> MergeReport:
    """Write `source` with each MoE layer's experts merged by `settings` into a new store at `out` (atomic: nothing
    is left there on failure; an existing folder is replaced only if it is a store and `overwrite`)."""
    src, out = Store(source), Path(out)
    check_mergeable(src)
    check_trace(src, trace)
    check_replaceable(out, "store", is_store, overwrite, (src.path,))  # before any work
    m, spec, layout = src.manifest, src.spec, src.native_layout
    align = settings.align and spec.moe_intermediate_size <= ALIGN_MAX_UNITS
    scope, refit, tables = settings.scope_for(spec), settings.refit_for(spec), layer_tables(trace)
    encoder = spec.encoder_decoder.encoder_layers if spec.encoder_decoder is not None else spec.num_layers
    merges = [layer_merge(src, layer, j, table, settings) if scope == "all" or layer < encoder
              else kept_whole(src, j, table)  # (the decoder's, under encoder-focused aggregation)
              for layer, (table, j) in zip(tqdm(spec.moe_layers, desc="similarity", unit="layer",
                                                 disable=not progress), tables)]
    kept = tuple(len(x.principals) for x in merges)
    files = sum(len(src.read_file(name)) for name in m.tokenizer_files)
    config = dict(m.config, moetier_merged={
        "groups": [list(x.group_of) for x in merges], "from": str(src.path.resolve()),
        "method": settings.retention.name, "alpha": settings.alpha,
        "threshold": getattr(settings.retention, "theta", None),
        "aligned": align, "members": settings.members, "refit": refit, "scope": scope,
        "calibration": calibration, "calibration_tokens": int(trace.num_tokens), "kept": list(kept)})
    with StoreWriter(out, overwrite, (src.path,), store_bytes(src.dense_bytes, sum(kept), layout.blob_bytes, files)) \
            as writer, tqdm(total=sum(kept), unit="expert", desc=f"merge {out.name}", disable=not progress) as bar:
        writer.write_dense(src.load_dense())
        for name in m.tokenizer_files:
            (writer.tmp / name).write_bytes(src.read_file(name))  # verified against the source's checksums
            writer.add_file(name)
        for (table, column), layer, merge in zip(tables, spec.moe_layers, merges):
            for p in merge.principals:
                ids = merge.members(p) if settings.members == "average" else [p]
                members = {e: src.read_expert(layer, e) for e in ids}
                if align:
                    members = {e: w if e == p else aligned(w, members[p]) for e, w in members.items()}
                expert = averaged(members, merge.frequency)
                if refit != "none" and len(merge.members(p)) > 1:
                    expert = _refitted(refit, expert, src, layer, column, merge.members(p), table)
                writer.add_expert(layer, p, layout, expert)
                bar.update()
        manifest = Manifest(family=m.family, config=config, precisions={layout.name: layout},
                            native_precision=layout.name, blobs=tuple(writer.blobs), source="",
                            tokenizer_files=m.tokenizer_files)
        path = writer.commit(manifest)
    per = layout.blob_bytes
    return MergeReport(path, kept, spec.num_experts, per * spec.num_expert_keys, per * sum(kept))
