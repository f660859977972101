"""The standard schedule with the jobs of independent sites at once: for two or more
standard sites of which none needs an expensive output, each `fwd` runs in stage 2 (as
`Early`'s), and each `bwd` in stage 2b, all at once.

Stage 2b evaluates the backward program the analysis traced, `G(ins, ys, seed)`, with the
real outputs from stage 2: the cotangent of each site's output, exactly (`G` is the VJP of
the program with respect to the sites' outputs, evaluated at the real outputs; every
expensive output is known there, since every top-level site runs in stage 2 and none is
nested in `lax.scan` or the like). Then the sites' `bwd` jobs run at once, eagerly on the
site pool, under `jit` from one callback when all of them leave the program. Stage 3
replays the outputs and the input cotangents, as for a deferred site: no `bwd` runs there.
Each site's `fwd` and `bwd` run once a step, as on the standard schedule; only their
order changes. The cost model chooses it (`_cost.together`)."""

from __future__ import annotations

from typing import Any, ClassVar

import equinox as eqx

from .. import _site
from .._implementation._abstract import AbstractImplementation
from .._plan._cost import Estimates
from .._plan._plan import Schedule
from .._site import Spec
from ._deferred import replay
from ._early import AbstractForwardAhead, standard_fields


def both_leave_program(spec: Spec) -> bool:
    """Whether a site's `fwd` and `bwd` both leave the program (host functions): XLA runs
    the implementations traced into it one after another, so only those can run at once."""
    static = spec.static
    return isinstance(static.fwd, AbstractImplementation) and isinstance(static.bwd, AbstractImplementation)


class Together(AbstractForwardAhead):
    """A standard site whose `fwd` runs in stage 2 and whose `bwd` runs in stage 2b, at once
    with the other such sites' (its fields as `Standard`'s; `reason` also says with which
    sites, and the estimates that chose it)."""

    spec: Spec
    position: int
    reason: str
    location: str | None = None
    k: int | None = None
    n: None = None
    estimates: Estimates | None = None
    differentiated: bool = True  # (always: a site with no backward pass has no backward job)
    label: ClassVar[Schedule] = "standard"  # pyright: ignore[reportIncompatibleVariableOverride]  (an eqx.AbstractClassVar: pyright#4965)
    defers: ClassVar[bool] = False  # pyright: ignore[reportIncompatibleVariableOverride]
    from_backward: ClassVar[tuple[str, ...]] = ("op",)  # pyright: ignore[reportIncompatibleVariableOverride]

    @staticmethod
    def of(standard: Any, why: str) -> Together:
        """`standard` (a `Standard` or `Early` site), its backward job run at once with
        others, `why` added to its reason."""
        return Together(**standard_fields(standard, why))

    # (its stage rows are `Early`'s: the analysis puts its backward row in the stage of the
    # backward jobs at once)

    def backward(self) -> BackwardJob:
        """Its job in stage 2b."""
        return BackwardJob(schedule=self)

    def stage3(self, y: list, ct_x: Any) -> tuple:
        spec = self.spec
        return (lambda eqn, ops: replay(ops, y, _site.operand_cotangents(spec, ops, ct_x))), {}


class BackwardJob(eqx.Module):
    """A together site's `bwd` in stage 2b, as stage 2 runs a site's call: `call(operands,
    (y, ct_y))` gives `(ct_x, None)`, the cotangents of the differentiable leaves of `x`."""

    schedule: Together

    @property
    def spec(self) -> Spec:
        return self.schedule.spec

    @property
    def position(self) -> int:
        return self.schedule.position

    @property
    def label(self) -> str:
        return self.schedule.label

    @property
    def impl(self) -> Any:
        return self.spec.static.bwd

    @property
    def leaves_program(self) -> bool:
        return isinstance(self.impl, AbstractImplementation)

    def call(self, operands: list, cts: Any) -> tuple:
        spec = self.spec
        y, ct_y = cts
        fn_leaves, x_leaves = operands[: spec.n_fn], operands[spec.n_fn :]
        return _site.cotangents(spec, fn_leaves, x_leaves, y, ct_y), None
