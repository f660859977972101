"""Native thread pools (OpenBLAS, MKL, OpenMP) while host jobs run at once on threads.

Each of these libraries starts one thread per core for every call. Two solves started
together on two Python threads would run twice as many threads as there are cores and
fight over them (measured with SciPy's `splu`: the pair slower than the two solves one
after the other). So while host jobs run at once in this process, each library is
limited to `cores // jobs` threads (at least one), and given back its own setting when
the last of them ends. A job that runs alone keeps the library's setting: it may use
every core.

The limit is set by the thread that submits the jobs, not inside the jobs: a library's
thread count is one setting for the whole process (OpenBLAS's `openblas_set_num_threads`),
so one thread sets it around the whole batch. Batches submitted from several threads at
once add up: the limit follows the number of jobs running over all of them, and only ever
goes down until the last job ends.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

_LOCK = threading.Lock()
_running = 0  # host jobs running at once on threads of this process, over all batches
_saved: list[tuple[Any, int]] = []  # (a library's threadpoolctl controller, its setting before deferax limited it)
_found: tuple[int, list] | None = None  # (how many modules were imported, the libraries loaded then)


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextlib.contextmanager
def shared(jobs: int) -> Iterator[None]:
    """Around `jobs` host jobs that run at once on threads of this process: while they (and
    the jobs of other batches) run, each native thread pool has at most `cores // running`
    threads."""
    _enter(jobs)
    try:
        yield
    finally:
        _leave(jobs)


def _enter(jobs: int) -> None:
    global _running
    with _LOCK:
        _running += jobs
        if _running < 2:
            return
        if not _saved:
            _saved.extend((c, c.num_threads) for c in _libraries())
        share = max(1, cores() // _running)
        for c, before in _saved:
            if min(before, share) < c.num_threads:
                c.set_num_threads(min(before, share))


def _leave(jobs: int) -> None:
    global _running
    with _LOCK:
        _running -= jobs
        if _running == 0:
            for c, before in _saved:
                c.set_num_threads(before)
            _saved.clear()


def _libraries() -> list:
    """threadpoolctl's controllers of the native thread pools loaded in this process. Finding
    them takes a millisecond or two, so they are found again only when a module has been
    imported since (a library comes with the module that loads it: NumPy, SciPy, ...)."""
    global _found
    if _found is None or _found[0] != len(sys.modules):
        from threadpoolctl import ThreadpoolController

        _found = (len(sys.modules), ThreadpoolController().lib_controllers)
    return _found[1]
