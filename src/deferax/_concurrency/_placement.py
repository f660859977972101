"""Where and how one site's stage-2 call runs: its slot of devices, whether its function is
thread-safe, and, for the one callback that gathers several sites under `jit`, its halves
traced ahead. Stage 2 makes one `Placement` a site and runs the site's call inside
`placed(placement)`; the two halves of a `Fused` (`_threads.concurrently`) read it there."""

from __future__ import annotations

import dataclasses
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
      halves run one after the other, under the lock (`_serial.one_at_a_time`).
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
