"""Whether deferax may run two implementation calls at once: `set_concurrency`, the lock
that keeps implementations that are not thread-safe apart, and whether a call takes it."""

from __future__ import annotations

import contextlib
import threading

from .. import _runtime

# Held around every call of an implementation declared not thread-safe that deferax runs
# on its own threads (JAX-native halves and host jobs alike): no two such calls overlap.
_LOCK = threading.RLock()


def set_concurrency(enabled: bool) -> None:
    """Allow (`True`, the default) or forbid deferax to run two implementation calls at the
    same time, for every function.

    Concurrency is the point of the deferred schedules (a forward and an adjoint together,
    several sites together), but an implementation that keeps one shared workspace (many C
    and Fortran solvers) gives wrong results when entered twice at once. Forbid it for one
    function with `ExpensiveFn(thread_safe=False)` or `dx.host(..., thread_safe=False)`,
    or for all of them here; the schedules stay the same, their calls run one at a time.
    It is read when the calls run, so it holds for steps compiled (`jax.jit`,
    `eqx.filter_jit`) before it was called too.

    The setting is the process's, for every thread: the calls run on deferax's threads and
    on those XLA runs a compiled step's callbacks on, which the caller's context does not
    reach. (Unlike [`deferax.set_typechecking`][], which holds in the caller's context: the
    checks run while a step is traced, in the caller's thread.)
    """
    _runtime.SWITCHES.concurrent = bool(enabled)


def serialised(serial: bool) -> bool:
    """Whether a call of an implementation runs alone, under `_LOCK`: for a function
    that is not thread-safe (`serial`) or while concurrency is switched off (read now, when
    the call runs, also from a program compiled before `set_concurrency` was called). The
    one place that decides it."""
    return serial or not _runtime.SWITCHES.concurrent


def one_at_a_time(serial: bool):
    """Inside: `_LOCK` is held where `serialised(serial)`."""
    return _LOCK if serialised(serial) else contextlib.nullcontext()
