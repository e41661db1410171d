"""moetier: run Mixture-of-Experts language models on machines too small to hold all their experts."""

import os

# libgomp (the OpenMP runtime of torch's Linux wheels, which moetier's native kernels share) spins 300,000 times at
# each barrier before it sleeps. Beside another busy process a spinning thread holds a core the other thread of
# the region needs: resident decode ran 4.0x slower beside one CPU hog per core (bench/bench_contention.py, AMD
# EPYC Zen 4, 2 cores), 1.9x with 100,000 spins, at the same speed alone (passive waiting: 2.4x, and 12% slower
# alone). It is read when torch loads libgomp, so it is set before torch is imported; a value the user set wins.
os.environ.setdefault("GOMP_SPINCOUNT", "100000")

__all__ = ["Engine", "EngineConfig", "GenerationOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """`moetier.Engine` and the rest of `__all__`, imported when first asked for (PEP 562): importing a part of
    moetier — the command line refusing a typo, `moetier.paths` — does not load torch (~2.5 s)."""
    if name in __all__:
        from moetier.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'moetier' has no attribute {name!r}")
