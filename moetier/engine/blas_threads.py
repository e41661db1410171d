"""NumPy's BLAS held to one thread while an engine runs.

A policy's or a predictor's few small products in the hot loop (flashmoe-ml's networks, llapor's projection, the
grouped predictor's sums) run on NumPy's OpenBLAS, whose threads, once woken, spin on the very cores torch's threads
compute on; each of the step's OpenMP regions then waits at its barrier for a thread the spinning displaced. On two
cores (Zen 4) flashmoe-ml decoded demo-deep at a 15% budget in 98–132 ms a token with NumPy's two BLAS threads and
27–37 ms with one (`OPENBLAS_NUM_THREADS`, alternated three rounds); comoe, whose arrays make no products that
large, was level, and so were llapor's and comoe-mlp's prefetching (28–30 against 27–34 ms, two rounds). Only the
"blas" libraries are limited (threadpoolctl): NumPy's OpenBLAS, not torch's OpenMP pool, which computes the model.
Restored when the engine closes."""

from __future__ import annotations

from threadpoolctl import threadpool_limits


class OneBlasThread:
    """NumPy's BLAS libraries at one thread from construction until `restore`."""

    def __init__(self) -> None:
        self.limits = threadpool_limits(limits=1, user_api="blas")

    def restore(self) -> None:
        if self.limits is not None:
            self.limits.restore_original_limits()
            self.limits = None
