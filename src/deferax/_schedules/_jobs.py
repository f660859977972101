"""The jobs of a standard site that runs ahead of the value: its forward job in stage 2
(`ForwardJob`), and, with the together group, its backward job in stage 2b (`BackwardJob`).
Its schedule stays `Standard` (`_standard.py`), which says where its jobs run (`runs`)."""

from __future__ import annotations

import dataclasses
import functools as ft
from typing import Any, ClassVar

import jax.tree_util as jtu

from .. import _site
from .._jaxpr import zero_like
from .._site import Spec
from ._abstract import AbstractAhead, AbstractJob, returning, stage_label
from ._deferred import replay


def _standard_cotangents(spec: Spec, args, ct_y):
    operands, y = args
    diff_cts = _site.cotangents(spec, operands[: spec.n_fn], operands[spec.n_fn :], y, ct_y)
    return _site.operand_cotangents(spec, operands, diff_cts), jtu.tree_map(zero_like, y)


def given(spec: Spec):
    """The standard schedule of a site whose output `y` was computed in stage 2:
    `given(spec)(operands, y)` returns `y`; the backward pass runs `bwd` (or `fused`) as
    the site's own rules would."""
    return returning(1, ft.partial(_standard_cotangents, spec))


class ForwardJob(AbstractAhead):
    """A standard site's `fwd` in stage 2, on the operands stage 1 computed, with no
    cotangent. Its `bwd` runs after the value, on the backward pass (stage 3 gives the site
    the output stage 2 computed, `given`), or, for a together site (`together`), in stage 2b
    (stage 3 replays the cotangents stage 2b computed); none where nothing differentiates the
    site (`differentiated`)."""

    spec: Spec
    position: int
    label: str
    differentiated: bool
    together: bool
    defers: ClassVar[bool] = False  # pyright: ignore[reportIncompatibleVariableOverride]  (an eqx.AbstractClassVar: pyright#4965)

    def stage2_row(self) -> str:
        return stage_label(self.spec, "fwd")

    def stage1_cotangents(self, ins: list, ys: list, traced: list | None) -> Any:
        return None

    @property
    def impl(self) -> Any:
        return self.spec.static.fwd

    def call(self, operands: list, cts: Any) -> tuple:
        # (its forward keeps what its backward pass uses, where one follows)
        return _site.outputs(dataclasses.replace(self.spec, backward=self.differentiated), *operands), None

    def stage3(self, y: list, ct_x: Any) -> tuple:
        spec = self.spec
        if self.together:
            return (lambda eqn, ops: replay(ops, y, _site.operand_cotangents(spec, ops, ct_x))), {}
        return (lambda eqn, ops: given(spec)(ops, y)), {}


class BackwardJob(AbstractJob):
    """A together site's `bwd` in stage 2b, as stage 2 runs a site's call: `call(operands,
    (y, ct_y))` gives `(ct_x, None)`, the cotangents of the differentiable leaves of `x`."""

    spec: Spec
    position: int
    label: str

    @property
    def impl(self) -> Any:
        return self.spec.static.bwd

    def call(self, operands: list, cts: Any) -> tuple:
        spec = self.spec
        y, ct_y = cts
        fn_leaves, x_leaves = operands[: spec.n_fn], operands[spec.n_fn :]
        return _site.cotangents(spec, fn_leaves, x_leaves, y, ct_y), None
