"""What a trace says about locality: per-layer popularity and entropy, reuse distances, reuse at t+1, and how
well one layer's experts tell the next layer's."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moetier.trace.format import Trace

DISTANCE_BINS = [1, 2, 4, 8, 16, 32, 64]  # upper edges of the reuse-distance histogram, in tokens


def popularity(trace: Trace) -> np.ndarray:
    """[L, E] share of routed slots per expert."""
    n, cols, k = trace.topk_ids.shape
    return np.stack([np.bincount(trace.topk_ids[:, j].ravel(), minlength=trace.num_experts) / (n * k)
                     for j in range(cols)])


def entropy_bits(p: np.ndarray) -> np.ndarray:
    return -(p * np.log2(np.where(p > 0, p, 1))).sum(-1)


def reuse_next(trace: Trace) -> np.ndarray:
    """[L] share of the experts used at token t used again at t+1 (same sequence, same layer)."""
    same = trace.seq[1:] == trace.seq[:-1]
    a, b = trace.topk_ids[:-1][same], trace.topk_ids[1:][same]  # [M, L, k]
    if not len(a):
        return np.full(len(trace.layers), np.nan)
    return (a[..., :, None] == b[..., None, :]).any(-1).mean(axis=(0, 2))


def reuse_distances(trace: Trace) -> np.ndarray:
    """Counts per bin of tokens since the same expert was last used in the same layer (whole stream);
    bins: <=1, <=2, <=4, ..., <=64, >64, first use."""
    counts = np.zeros(len(DISTANCE_BINS) + 2, np.int64)
    for j in range(len(trace.layers)):
        last = np.full(trace.num_experts, -1, np.int64)
        for t, row in enumerate(trace.topk_ids[:, j]):
            prev = last[row]
            seen = prev >= 0
            counts[-1] += int((~seen).sum())
            counts[:-1] += np.bincount(np.searchsorted(DISTANCE_BINS, t - prev[seen]), minlength=len(counts) - 1)
            last[row] = t
    return counts


def next_layer_predictability(trace: Trace) -> list[dict]:
    """For consecutive layers in the trace: given the experts at layer l, the share of layer l' experts that
    are among the k most frequent co-occurring ones (fitted on the trace itself: an upper bound for a
    frequency predictor), beside k/E for no information."""
    out = []
    k = trace.top_k
    for j in range(len(trace.layers) - 1):
        a, b = trace.topk_ids[:, j].astype(np.int64), trace.topk_ids[:, j + 1].astype(np.int64)
        co = np.zeros((trace.num_experts, trace.num_experts))
        np.add.at(co, (np.repeat(a, k, axis=1).ravel(), np.tile(b, (1, k)).ravel()), 1)
        scores = co[a].sum(1)  # [N, E]: votes of this token's layer-l experts
        predicted = np.argsort(-scores, axis=1)[:, :k]
        recall = (predicted[:, :, None] == b[:, None, :]).any(1).mean()
        out.append({"from": trace.layers[j], "to": trace.layers[j + 1], "recall": float(recall),
                    "uniform": k / trace.num_experts})
    return out


def summarize(trace: Trace) -> dict:
    pop = popularity(trace)
    return {
        "model": trace.model, "tokens": trace.num_tokens, "layers": trace.layers, "top_k": trace.top_k,
        "num_experts": trace.num_experts, "synthetic": trace.synthetic,
        "entropy_bits": entropy_bits(pop).tolist(), "entropy_bits_max": float(np.log2(trace.num_experts)),
        "experts_used": (pop > 0).sum(1).tolist(),
        "top_share": np.sort(pop, axis=1)[:, ::-1][:, :trace.top_k].sum(1).tolist(),
        "reuse_next": reuse_next(trace).tolist(), "reuse_next_uniform": trace.top_k / trace.num_experts,
        "reuse_distance_bins": [f"<={d}" for d in DISTANCE_BINS] + [f">{DISTANCE_BINS[-1]}", "first"],
        "reuse_distance_counts": reuse_distances(trace).tolist(),
        "next_layer": next_layer_predictability(trace),
    }


def format_table(s: dict) -> str:
    lines = [f"{s['model']}: {s['tokens']} tokens, {len(s['layers'])} layer(s), top-{s['top_k']} of "
             f"{s['num_experts']}{' (synthetic)' if s['synthetic'] else ''}",
             f"{'layer':>5} {'entropy':>8} {'of max':>7} {'used':>5} {'top-k share':>11} {'reuse t+1':>9}"]
    for j, layer in enumerate(s["layers"]):
        lines.append(f"{layer:>5} {s['entropy_bits'][j]:8.2f} {s['entropy_bits_max']:7.2f} {s['experts_used'][j]:>5} "
                     f"{s['top_share'][j]:11.1%} {s['reuse_next'][j]:9.1%}")
    lines.append(f"reuse t+1 under uniform random routing: {s['reuse_next_uniform']:.1%}")
    total = sum(s["reuse_distance_counts"])
    lines.append("reuse distance (tokens): " + "  ".join(
        f"{b} {c / total:.1%}" for b, c in zip(s["reuse_distance_bins"], s["reuse_distance_counts"])))
    for nl in s["next_layer"]:
        lines.append(f"layer {nl['from']} -> {nl['to']}: co-occurrence top-k recall {nl['recall']:.1%} "
                     f"(no information: {nl['uniform']:.1%})")
    return "\n".join(lines)


def plot(trace: Trace, s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    pop = popularity(trace)
    im = axes[0, 0].imshow(pop * trace.num_experts, aspect="auto", cmap="viridis", interpolation="nearest")
    axes[0, 0].set(title="expert popularity (1 = uniform)", xlabel="expert", ylabel="layer",
                   yticks=range(len(trace.layers)), yticklabels=trace.layers)
    fig.colorbar(im, ax=axes[0, 0])
    x = range(len(trace.layers))
    axes[0, 1].bar(x, s["entropy_bits"])
    axes[0, 1].axhline(s["entropy_bits_max"], color="k", ls="--", label="uniform")
    axes[0, 1].set(title="usage entropy per layer (bits)", xticks=x, xticklabels=trace.layers, xlabel="layer")
    axes[0, 1].legend()
    counts = np.asarray(s["reuse_distance_counts"], float)
    axes[1, 0].bar(range(len(counts)), counts / counts.sum())
    axes[1, 0].set(title="reuse distance (tokens since last use)", xticks=range(len(counts)),
                   xticklabels=s["reuse_distance_bins"], ylabel="share of accesses")
    axes[1, 1].bar(x, s["reuse_next"])
    axes[1, 1].axhline(s["reuse_next_uniform"], color="k", ls="--", label="uniform random routing")
    axes[1, 1].set(title="share of experts reused at t+1", xticks=x, xticklabels=trace.layers, xlabel="layer")
    axes[1, 1].legend()
    fig.suptitle(f"{s['model']} — {s['tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
