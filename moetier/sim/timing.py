"""One simulated step drawn: per layer, the dense work, the reads on the link and the expert compute (a Gantt
chart of a simulation's LayerTimelines)."""

from __future__ import annotations

from moetier.sim.executor import LayerTimeline


def plot_timeline(timeline: list[LayerTimeline], path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.45 * len(timeline) + 1.5))
    t0 = timeline[0].start
    for i, tl in enumerate(timeline):
        ms = lambda t: (t - t0) * 1e3  # noqa: E731
        ax.barh(i + 0.25, ms(tl.dense_end) - ms(tl.start), left=ms(tl.start), height=0.3, color="0.6",
                label="dense + executor" if i == 0 else None)
        for j, (_, s, e, lane) in enumerate(tl.computes):
            ax.barh(i + 0.25, ms(e) - ms(s), left=ms(s), height=0.3, color="tab:blue" if lane == "fast" else
                    "tab:green", label=f"expert compute ({lane})" if i == 0 and j == 0 else None)
        for j, (_, s, e) in enumerate(tl.reads):
            ax.barh(i - 0.15, ms(e) - ms(s), left=ms(s), height=0.3, color="tab:orange", edgecolor="white",
                    label="expert read" if j == 0 and not any(t.reads for t in timeline[:i]) else None)
    ax.set_yticks(range(len(timeline)), [f"layer {tl.layer}" for tl in timeline])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of the step")
    ax.set_title(title)
    ax.legend(loc="lower left")  # the diagonal of layers leaves that corner empty
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
