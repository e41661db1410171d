"""The memory read rate a process meets now: two threads summing 1 GiB of fp32 (after one warm pass), best of three.

Why: on a virtual machine the memory rate moves between runs (a shared host: ~30 or ~47 GB/s on the Zen 4 this was
written on, from one process to the next), so two engines measured one after the other compare the minutes as much
as the code. compare.py records this probe in a process of its own right before each run, and moetier_run.py inside
moetier's process after its measured tokens, so a round's engines can be compared at the rate each one met.

    python bench/peers/probe.py          # prints GB/s
"""

from __future__ import annotations

import time


def read_rate(nbytes: int = 1 << 30, rounds: int = 3) -> float:
    """GB/s of a two-thread sum over a fresh buffer of `nbytes` (best of `rounds`)."""
    import torch

    torch.set_num_threads(2)
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()  # (the warm pass: pages faulted in)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


if __name__ == "__main__":
    print(f"{read_rate():.1f}")
