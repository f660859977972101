"""The `fused` that the deferred schedule makes from `fwd` and `adjoint` (or a `bwd` that
does not read `y`), and its halves. Each half holds the `ExpensiveFn` that made it
(`ExpensiveFn.derived_fused`, in the module that imports this one) and calls it by name."""

from __future__ import annotations

from typing import Any, ClassVar

import equinox as eqx
from jaxtyping import PyTree

from .._jaxpr import zeros
from ._abstract import AbstractFused


class PrimalHalf(eqx.Module):
    """`fn.primal`, as a Module that compares by value (its compiled form is reused)."""

    fn: Any  # the `ExpensiveFn`
    impl: ClassVar[str] = "fwd"  # (for the recording)

    def __call__(self, x: PyTree) -> PyTree:
        return self.fn.primal(x)


class AdjointHalf(eqx.Module):
    """The part of the reverse-mode derivative that does not need `y`: `adjoint(x, ct)`, or
    `bwd(x, zeros, ct)` for a `bwd` that does not read `y`."""

    fn: Any  # the `ExpensiveFn`

    @property
    def impl(self) -> str:  # (for the recording)
        return "adjoint" if self.fn.adjoint is not None else "bwd"

    def __call__(self, x: PyTree, ct: PyTree) -> PyTree:
        fn = self.fn
        if fn.adjoint is not None:
            return fn.invoke("adjoint", x, ct)
        return fn.checked_ct_x("bwd", fn.invoke("bwd", x, zeros(fn.out_struct(x)), ct), x)


class CombineStep(eqx.Module):
    """`combine(x, y, partial)`, checked: the step after both halves, which needs `y`."""

    fn: Any  # the `ExpensiveFn`

    def __call__(self, x: PyTree, y: PyTree, partial: PyTree) -> PyTree:
        return self.fn.combined(x, y, partial)


class DerivedFused(AbstractFused):
    """The `fused` that the deferred schedule makes from `fwd` and `adjoint` (or a `bwd` that
    does not read `y`): the same two threads as [`deferax.Fused`][], each half called as the
    standard schedule would call it, so that it reads what it reads afresh (eagerly, on
    every call)."""

    fwd: PrimalHalf  # pyright: ignore[reportIncompatibleMethodOverride]  (an eqx.AbstractVar, frozen: a narrower type is sound)
    adjoint: AdjointHalf  # pyright: ignore[reportIncompatibleMethodOverride]  (an eqx.AbstractVar, frozen: a narrower type is sound)
    combine: CombineStep | None  # pyright: ignore[reportIncompatibleVariableOverride]  (an eqx.AbstractVar, frozen: a narrower type is sound)
    compiled: ClassVar[bool] = False  # pyright: ignore[reportIncompatibleVariableOverride]  (an eqx.AbstractClassVar: pyright#4965)

    def half_names(self) -> tuple[str, str]:
        return self.fwd.impl, self.adjoint.impl
