"""The standard schedule with its `fwd` run in stage 2, alongside the deferred calls: a
standard site whose input needs no expensive output. Stage 3 gives it its output and runs
`bwd` on the backward pass as the site's own rules would."""

from __future__ import annotations

import dataclasses
import functools as ft
from typing import Any, ClassVar

import equinox as eqx
import jax.tree_util as jtu

from .. import _site
from .._implementation._abstract import AbstractImplementation
from .._misc import zero_like
from .._plan._cost import Estimates
from .._plan._plan import Schedule
from .._site import Spec
from ._abstract import AbstractAhead, stage_label
from ._returning import returning
from ._standard import Standard


def _standard_cotangents(spec: Spec, args, ct_y):
    operands, y = args
    diff_cts = _site.cotangents(spec, operands[: spec.n_fn], operands[spec.n_fn :], y, ct_y)
    return _site.operand_cotangents(spec, operands, diff_cts), jtu.tree_map(zero_like, y)


def given(spec: Spec):
    """The standard schedule of a site whose output `y` was computed in stage 2:
    `given(spec)(operands, y)` returns `y`; the backward pass runs `bwd` (or `fused`) as
    the site's own rules would."""
    return returning(1, ft.partial(_standard_cotangents, spec))


def standard_fields(standard: Any, why: str = "") -> dict:
    """The fields of a standard site's schedule (`Standard`, `Early`, `Together`), taken from
    another one, `standard`, with `why` added to its reason."""
    return {
        "spec": standard.spec,
        "position": standard.position,
        "reason": standard.reason + why,
        "location": standard.location,
        "k": standard.k,
        "estimates": standard.estimates,
        "differentiated": standard.differentiated,
    }


class AbstractForwardAhead(AbstractAhead):
    """A standard site whose `fwd` runs in stage 2 (`Early`, and `Together`, whose `bwd` also
    runs ahead): its stage-2 call is its `fwd` on the operands stage 1 computed, with no
    cotangent; on the backward pass, or in stage 2b, its `bwd` (none where its input depends on
    no differentiated argument: `differentiated`)."""

    differentiated: eqx.AbstractVar[bool]

    def stage_rows(self) -> tuple[str | None, str | None, str | None]:
        return stage_label(self.spec, "fwd"), None, stage_label(self.spec, "bwd") if self.differentiated else None

    def stage1_cotangents(self, ins: list, ys: list, traced: list | None) -> Any:
        return None

    @property
    def impl(self) -> Any:
        return self.spec.static.fwd

    @property
    def leaves_program(self) -> bool:
        return isinstance(self.impl, AbstractImplementation)

    def call(self, operands: list, cts: Any) -> tuple:
        # (its forward keeps what its backward pass uses, where one follows)
        return _site.outputs(dataclasses.replace(self.spec, backward=self.differentiated), *operands), None


class Early(AbstractForwardAhead):
    """A standard site whose `fwd` runs in stage 2 (its fields as `Standard`'s)."""

    spec: Spec
    position: int
    reason: str
    location: str | None = None
    k: int | None = None
    n: None = None
    estimates: Estimates | None = None
    differentiated: bool = True
    label: ClassVar[Schedule] = "standard"  # pyright: ignore[reportIncompatibleVariableOverride]  (an eqx.AbstractClassVar: pyright#4965)
    defers: ClassVar[bool] = False  # pyright: ignore[reportIncompatibleVariableOverride]
    from_backward: ClassVar[tuple[str, ...]] = ("op",)  # pyright: ignore[reportIncompatibleVariableOverride]

    @staticmethod
    def of(standard: Standard) -> Early:
        assert standard.position is not None  # (a top-level site)
        return Early(**standard_fields(standard))

    def stage3(self, y: list, ct_x: Any) -> tuple:
        spec = self.spec
        return (lambda eqn, ops: given(spec)(ops, y)), {}
