"""Where and how one site's stage-2 call runs: its slot of devices, whether its function is
thread-safe, and, for the one callback that gathers several sites under `jit`, its halves
traced ahead. Stage 2 makes one `Placement` a site and runs the site's call inside
`placed(placement)`; the two halves of a `Fused` (`_threads.concurrently`) read it there.

Where the two halves of a JAX-native site run (`halves_run`), one decision with its reason,
which `concurrently` follows and `explain` shows:

- `"threads"`: eagerly, each half compiled and started from its own thread (on a CPU, two
  cores; on several devices, a pair of them);
- `"callback"`: under a trace, on one CPU device: one host callback starts both halves on
  two threads (the only way two pieces of one XLA:CPU program use two cores);
- `"program"`: inside the compiled program (or, eagerly, one after the other where the
  inputs are): on an accelerator, which runs one program at a time and where JAX work
  started from a callback is 200 times slower and can hang; with inputs sharded over
  several devices; inside `shard_map`; under a trace on several devices that
  `dx.set_devices` did not name. A loop of each half is stepped in one loop where they
  are of equal length (`_jaxpr.together`);
- `"devices"`: under a trace on the devices `dx.set_devices` named: a `shard_map` over
  them runs the forward on one device and the adjoint on the next, in the program.

Below, whether deferax may run two implementation calls at once (`set_concurrency`), the
lock that keeps implementations that are not thread-safe apart, and whether a call takes it
(`serialised`, `one_at_a_time`)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, NamedTuple

import jax
import jax.core
import jax.tree_util as jtu

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


class Halves(NamedTuple):
    """Where the two halves of a JAX-native site run (`where`), and why (`why`)."""

    where: str  # "threads", "callback", "program" or "devices"
    why: str

    @property
    def leave_program(self) -> bool:
        """Whether the halves leave the compiled program (through a host callback)."""
        return self.where == "callback"


def platform() -> str:
    """The platform the halves run on: `dx.set_devices`'s devices', else the default backend's
    (a test may pretend another, `_runtime.SWITCHES.platform`)."""
    if _runtime.SWITCHES.platform is not None:
        return _runtime.SWITCHES.platform
    chosen = _runtime.SWITCHES.devices
    return chosen[0].platform if chosen else jax.default_backend()


def spans(tree: Any) -> int:
    """The most devices one concrete array of `tree` spans (0 for none)."""
    arrays = [a for a in jtu.tree_leaves(tree) if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)]
    return max((len(a.sharding.device_set) for a in arrays), default=0)


def operands(tree: Any):
    """Inside: the analysis of a call on `tree` (its inputs) places halves as for them
    (`halves_run` without operands reads it: where they are sharded, in the program)."""
    return _jaxpr.setting(_runtime.SPANS, spans(tree))


def halves_run(tree: Any = None, *, eager: bool | None = None) -> Halves:
    """Where the two halves of a JAX-native site run, called on `tree` (its operands: concrete
    eagerly, tracers under a trace), or, without them, for a call `eager` or not."""
    eager = _jaxpr.is_concrete(tree) and _jaxpr.is_eager() if eager is None else eager
    manual = _jaxpr.manual_axes()
    where = platform()
    chosen = _runtime.SWITCHES.devices
    devices = chosen if chosen is not None else jax.local_devices()
    if manual:
        axes = ", ".join(map(repr, manual))
        return Halves("program", f"inside `shard_map` over {axes}: each shard runs its own halves")
    spanned = (spans(tree) if tree is not None else _runtime.SPANS.get()) if eager else 0
    if spanned > 1:
        return Halves("program", f"its inputs are sharded over {spanned} devices: the halves run where they are")
    if eager:
        if len(devices) > 1:
            return Halves("threads", f"on two of {len(devices)} {where} devices, from two threads")
        if where == "cpu":
            return Halves("threads", "on two threads (two CPU cores)")
        return Halves(
            "program",
            f"one {where} device runs one program at a time: one half after the other "
            "(under `jit`, a loop of each stepped in one where they are of equal length)",
        )
    if chosen is not None and len(chosen) > 1:
        return Halves("devices", f"on two of the {len(chosen)} devices named by `dx.set_devices`, in the program")
    if where != "cpu":
        return Halves(
            "program",
            f"one {where} device runs one program at a time (no JAX work from a host callback there): "
            "in the program, a loop of each half stepped in one where they are of equal length",
        )
    if len(jax.local_devices()) > 1:
        return Halves(
            "program",
            f"{len(jax.local_devices())} CPU devices: a callback starting JAX work could stall the program's "
            "collectives; `dx.set_devices` puts the halves on two devices in the program",
        )
    return Halves("callback", "one host callback starts both halves on two threads (two CPU cores)")


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
