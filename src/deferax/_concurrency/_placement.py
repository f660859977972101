"""Where and how one site's stage-2 call runs: its slot of devices, whether its function is
thread-safe, and, for the one callback that gathers several sites under `jit`, its halves
traced ahead. Stage 2 makes one `Placement` a site and runs the site's call inside
`placed(placement)`; the two halves of a `Fused` (`_threads.concurrently`) read it there.

Below, whether deferax may run two implementation calls at once (`set_concurrency`), the
lock that keeps implementations that are not thread-safe apart, and whether a call takes it
(`serialised`, `one_at_a_time`)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any

import jax

from .. import _jaxpr, _runtime
from ._devices import pair


@dataclasses.dataclass(frozen=True)
class Placement:
    """How one site's call runs.

    - `slot`: the site's place among the sites of one step: its halves go to the `slot`-th
      pair of devices, round robin.
    - `serial`: the function is not thread-safe (`ExpensiveFn(thread_safe=False)`): its
      halves run one after the other, under the lock (`one_at_a_time`, below).
    - `traced`: while the gathered callback's shapes are traced, the list that the halves
      traced for this site are appended to (`prepare` reads it).
    - `prepared`: inside the gathered callback, the halves traced for this site, run as
      they were traced.
    """

    slot: int = 0
    serial: bool = False
    traced: list | None = None
    prepared: Any = None

    def devices(self) -> tuple[jax.Device | None, jax.Device | None]:  # pyright: ignore[reportInvalidTypeForm]  (jax.Device: compiled, no stub)
        """`(forward's device, adjoint's device)`; `(None, None)` on one device."""
        return pair(self.slot)

    def preparing(self) -> Placement:
        """This placement, keeping the halves traced under it (in `traced`)."""
        return dataclasses.replace(self, traced=[])

    def prepared_halves(self) -> Any:
        """The halves traced under `preparing()`, if they can run from the gathered callback:
        traced once, and closing over no value of the surrounding trace; else None."""
        if self.traced is None or len(self.traced) != 1:
            return None
        fwd, adjoint = self.traced[0]
        return None if fwd.consts or adjoint.consts else (fwd, adjoint)

    def running(self, prepared: Any) -> Placement:
        """This placement, running the `prepared` halves (inside the gathered callback)."""
        return dataclasses.replace(self, prepared=prepared)


_DEFAULT = Placement()
_PLACEMENT = _runtime.PLACEMENT


def placed(placement: Placement):
    """Inside: the calls run with `placement`."""
    return _jaxpr.setting(_PLACEMENT, placement)


def current() -> Placement:
    """The placement of the call running here (the default outside stage 2)."""
    placement = _PLACEMENT.get()
    return _DEFAULT if placement is None else placement


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
