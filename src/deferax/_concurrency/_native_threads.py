"""Native thread pools (OpenBLAS, MKL, OpenMP) while host jobs run at once on threads.

Each of these libraries starts one thread per core for every call. Two solves started
together on two Python threads would run twice as many threads as there are cores and
fight over them (measured with SciPy's `splu`: the pair slower than the two solves one
after the other). So while host jobs run at once in this process, each library is
limited to `cores // jobs` threads (at least one), and given back its own setting when
the last of them ends. A job that runs alone keeps the library's setting: it may use
every core, unless it runs inside `capped` (SciPy's SuperLU, which gains nothing from
BLAS threads: `_sparse/_solver.py`).

The limit is set around the whole batch by the thread that submits the jobs, not inside the
jobs: a library's thread count is one setting for the whole process (OpenBLAS's
`openblas_set_num_threads`). Batches submitted from several threads at once add up, under
one lock: the limit follows the number of jobs running over all of them, only ever goes
down until the last job ends, and is then restored by whichever thread ends it.

threadpoolctl finds the libraries loaded in the process and sets MKL, BLIS and OpenMP.
OpenBLAS on its own pthreads pool is set here through its C function directly:
threadpoolctl (3.8) lets only the first thread that sets it change it ("the controlling
thread", cleared when its `threadpool_limits` block ends) and silently ignores the others.
Through it, a limit set from a job's thread was ignored once the main thread had set one,
and a pool thread that had set one kept control for good, so that the main thread's
`threadpool_limits` did nothing afterwards. Setting the C function does not take that
control: the program's own `threadpool_limits` keeps working. OpenMP's setting (and that of
an OpenBLAS built on OpenMP, and of MKL on its Intel or GNU threading layer, as pypardiso's
MKL is) belongs to each thread: a limit set by the thread that submits the jobs does not reach
the threads that run them; only `capped`, entered inside a job, does. PARDISO (`_solvers/
_pardiso.py`) sets its own, for its calls alone: those of its pattern's analysis.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from .. import _runtime

_LOCK = _runtime.NATIVE_LOCK
_NATIVE = _runtime.NATIVE  # the jobs running, the caps and the settings saved, over all threads


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextlib.contextmanager
def shared(jobs: int) -> Iterator[None]:
    """Around `jobs` host jobs that run at once on threads of this process: while they (and
    the jobs of other batches) run, each native thread pool has at most `cores // running`
    threads."""
    with _LOCK:
        _NATIVE.running += jobs
        _update()
    try:
        yield
    finally:
        with _LOCK:
            _NATIVE.running -= jobs
            _update()


@contextlib.contextmanager
def capped(threads: int) -> Iterator[None]:
    """Inside, native thread pools have at most `threads` threads (for code known to gain
    nothing from more: SuperLU, whose calls into BLAS are too small to share). The setting
    is the process's: other code running at the same time gets the cap too."""
    with _LOCK:
        _NATIVE.caps.append(threads)
        _update()
    try:
        yield
    finally:
        with _LOCK:
            _NATIVE.caps.remove(threads)
            _update()


def _update() -> None:
    """Set the libraries to what the jobs and caps running now allow (under `_LOCK`): while
    any limit holds, the setting only goes down; when none is left, each library gets back
    its setting from before the first."""
    running, saved_all = _NATIVE.running, _NATIVE.saved
    limits = list(_NATIVE.caps) + ([max(1, cores() // running)] if running >= 2 else [])
    if not limits:
        for _, setter, before, now in saved_all:
            if now != before:
                setter(before)
        saved_all.clear()
        return
    known = {saved[0] for saved in saved_all}  # (a library loaded while limited joins them)
    for c in _libraries():
        if c.filepath not in known:
            saved_all.append([c.filepath, _setter(c), c.num_threads, c.num_threads])
    for saved in saved_all:
        _, setter, before, now = saved
        if min(before, *limits) < now:
            saved[3] = min(before, *limits)
            setter(saved[3])


def _libraries() -> list:
    """threadpoolctl's controllers of the native thread pools loaded in this process. Finding
    them takes a millisecond or two, so they are found again only when a module has been
    imported since (a library comes with the module that loads it: NumPy, SciPy, ...)."""
    found = _NATIVE.found
    if found is None or found[0] != len(sys.modules):
        from threadpoolctl import ThreadpoolController

        found = _NATIVE.found = (len(sys.modules), ThreadpoolController().lib_controllers)
    return found[1]


def _setter(controller: Any) -> Callable[[int], Any]:
    """What sets `controller`'s library's thread count from any thread: OpenBLAS on pthreads
    through its own C function (under whichever affixes the wheel's build gave it), the
    others through threadpoolctl."""
    if controller.internal_api == "openblas" and getattr(controller, "threading_layer", None) != "openmp":
        for prefix, suffix in itertools.product(("", "scipy_"), ("", "64_", "_64")):
            function = getattr(controller.dynlib, f"{prefix}openblas_set_num_threads{suffix}", None)
            if function is not None:
                return function
    return controller.set_num_threads
