"""Whether the Triton kernels' tests can run here: on a GPU compiled for it; on the CPU in Triton's interpreter,
which takes `int()` of one-element arrays — numpy 2.4 refuses that (deprecated since 1.25), so there every kernel
launch fails the same way, whatever the kernel. A test marked `compiles` runs Triton's compiler on the CPU, not its
interpreter, and runs wherever triton is installed (`skip_interpreted`)."""

import importlib.util

import numpy as np
import torch


def why_not(interpreter_only: bool = False) -> str | None:
    """The reason the tests are skipped here, or None where they run. `interpreter_only`: tests that count the CPU's
    stand-in for a GPU step, which run nowhere else."""
    if importlib.util.find_spec("triton") is None:
        return "needs triton (the GPU machine's)"
    if torch.cuda.is_available():
        return "needs triton's interpreter (counts the CPU's stand-in for a GPU step)" if interpreter_only else None
    try:
        int(np.array([1]))
    except TypeError:
        return (f"Triton's interpreter takes int() of one-element arrays, which numpy {np.__version__} refuses "
                "(numpy < 2.4 runs it)")
    return None


def skip_interpreted(request) -> None:
    """For an autouse fixture: skip the test with the reason where the interpreter cannot run it (a test marked
    `compiles` runs all the same)."""
    why = why_not()
    if why is not None and request.node.get_closest_marker("compiles") is None:
        import pytest

        pytest.skip(why)
