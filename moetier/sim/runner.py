"""Where a sweep's cells run: in this process, in local worker processes (the default for a sweep), or as Ray tasks
on a cluster (`--ray ADDRESS`, `auto` for the one this machine belongs to, `local` to start one here; Ray is an
optional extra: pip install 'moetier[ray]'). Every runner gives the results in the cells' order, so the table, the
JSON and the plot are the same wherever the cells ran.

A cell is `fn(cell)`; `fn` may be a closure over the trace and the cost model (local workers are forked and inherit
it; Ray ships it with cloudpickle)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from moetier.errors import MoetierError
from moetier.portable import usable_cores


class InProcess:
    name = "in-process"

    def map(self, fn: Callable[[Any], Any], cells: Sequence, progress: Callable[[], None]) -> list:
        out = []
        for cell in cells:
            out.append(fn(cell))
            progress()
        return out


class LocalProcesses:
    """Forked workers, one per free core (fork: the cell function and what it closes over are inherited, not
    pickled; only the cells' indices and results cross)."""

    name = "local processes"

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or usable_cores()

    def map(self, fn: Callable[[Any], Any], cells: Sequence, progress: Callable[[], None]) -> list:
        if self.workers < 2 or len(cells) < 2:
            return InProcess().map(fn, cells, progress)
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(min(self.workers, len(cells)), mp_context=context, initializer=_adopt,
                                 initargs=(fn, cells)) as pool:
            futures = [pool.submit(_run_index, i) for i in range(len(cells))]
            for future in futures:
                future.add_done_callback(lambda _: progress())
            return [f.result() for f in futures]


_WORK: tuple | None = None  # a forked worker's (fn, cells), set once by its initializer


def _adopt(fn, cells) -> None:
    global _WORK
    _WORK = (fn, cells)


def _run_index(i: int):
    fn, cells = _WORK
    return fn(cells[i])


class RayTasks:
    """Each cell a Ray task. `address`: "auto" (the cluster this machine is part of), "local" (start one here, as
    the tests do) or a cluster's address (host:port, ray://host:port)."""

    name = "ray"

    def __init__(self, address: str) -> None:
        try:
            import ray
        except ImportError:
            raise MoetierError("--ray needs Ray, an optional extra", hint="pip install 'moetier[ray]'") from None
        self.ray = ray
        if not ray.is_initialized():
            kwargs = dict(include_dashboard=False, log_to_driver=False)
            if address == "local":
                ray.init(num_cpus=usable_cores(), **kwargs)
            else:
                ray.init(address=address, **kwargs)

    def map(self, fn: Callable[[Any], Any], cells: Sequence, progress: Callable[[], None]) -> list:
        ray = self.ray
        task = ray.remote(fn)
        refs = [task.remote(cell) for cell in cells]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for _ in done:
                progress()
        return ray.get(refs)


def make_runner(ray: str | None, workers: int | None = None):
    """The runner for `--ray` (None: local processes) and `--workers` (1: this process)."""
    if ray is not None:
        return RayTasks(ray)
    if workers == 1:
        return InProcess()
    return LocalProcesses(workers)
