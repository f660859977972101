"""The standard schedule: `fwd` on the forward pass, `bwd` on the backward pass, as the
site's own rules run it; or, where its jobs run ahead of the value (`runs`), its `fwd` in
stage 2 (`_jobs.ForwardJob`) and its `bwd` after the value or, at once with other sites', in
stage 2b (`_together.JointBackward`).

Below, the forward-basis strategy of a standard site (`ForwardBasis`): the output and `n`
unit tangents in one call on the forward pass (`jvp_batch`, or `jvp` batched), `ct_x = J^T
ct_y` after. The site's own JVP rule runs it (`_site/_forward_basis.py`); here is what the
plan says of it, and where it is chosen (`choose`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import equinox as eqx

from .._plan._cost import Estimates
from .._plan._plan import Schedule
from .._site import Spec
from ._abstract import AbstractSchedule, stage_label
from ._jobs import ForwardJob

# Where a standard site's jobs run: its `fwd` on the forward pass and its `bwd` on the
# backward pass; its `fwd` in stage 2, ahead of the value; or that, and its `bwd` in stage 2b
# at once with the other together sites'.
RUNS = ("in turn", "ahead", "together")


class Standard(AbstractSchedule):
    """A site on the standard schedule. `k`: the number of basis cotangents its cotangent is
    a combination of, where the analysis counted them. `differentiated`: whether its input
    depends on a differentiated argument; without, no backward pass runs for it (and its
    forward keeps nothing for one). `runs`: where its jobs run (`RUNS`): for a site
    whose input needs no expensive output, "ahead" or "together" (`ahead_job`)."""

    spec: Spec
    position: int | None
    reason: str
    location: str | None = None
    k: int | None = None
    n: None = None
    estimates: Estimates | None = None
    differentiated: bool = True
    runs: str = "in turn"
    label: ClassVar[Schedule] = "standard"  # pyright: ignore[reportIncompatibleVariableOverride]  (an eqx.AbstractClassVar: pyright#4965)
    defers: ClassVar[bool] = False  # pyright: ignore[reportIncompatibleVariableOverride]

    def __check_init__(self):
        assert self.runs in RUNS and (self.runs == "in turn" or self.position is not None)

    @property
    def from_backward(self) -> tuple[str, ...]:
        return () if self.runs == "in turn" else ("op",)

    @property
    def stage3_runs(self) -> bool:
        return self.runs == "in turn" or (self.runs == "ahead" and self.differentiated)

    def stage_rows(self) -> tuple[str | None, str | None, str | None]:
        backward = stage_label(self.spec, "bwd") if self.differentiated else None
        if self.runs == "in turn":
            return None, stage_label(self.spec, "fwd"), backward
        # (a together site's backward row: the analysis puts it in the stage of the jobs at once)
        return stage_label(self.spec, "fwd"), None, backward

    def strategy_chosen(self) -> Standard | ForwardBasis:
        return choose(self) if self.differentiated else self

    def with_jobs_ahead(self) -> Standard:
        return dataclasses.replace(self, runs="ahead")

    def ahead_job(self) -> ForwardJob | None:
        if self.runs == "in turn":
            return None
        assert self.position is not None  # (a top-level site: `__check_init__`)
        together = self.runs == "together"
        return ForwardJob(
            spec=self.spec,
            position=self.position,
            label=self.label,
            differentiated=self.differentiated,
            together=together,
        )


def standard(schedule: AbstractSchedule) -> Standard | None:
    """`schedule` as a standard site's, where it is one (its label says: the standard schedule
    is this class alone); else None."""
    return schedule if schedule.label == "standard" else None  # pyright: ignore[reportReturnType]  (the label is the class's)


class ForwardBasis(AbstractSchedule):
    """A site differentiated from `n` tangents, and why it is not deferred."""

    spec: Spec
    position: int | None
    reason: str
    location: str | None
    k: None = None
    n: int = eqx.field(kw_only=True)
    estimates: Estimates | None = eqx.field(kw_only=True)
    label: ClassVar[Schedule] = "forward-basis"  # pyright: ignore[reportIncompatibleVariableOverride]  (an eqx.AbstractClassVar: pyright#4965)
    defers: ClassVar[bool] = False  # pyright: ignore[reportIncompatibleVariableOverride]
    from_backward: ClassVar[tuple[str, ...]] = ()  # pyright: ignore[reportIncompatibleVariableOverride]

    @staticmethod
    def estimate(spec: Spec) -> Estimates | None:
        """The standard schedule's and the forward-basis strategy's estimates (None for a
        site without `jvp` or `jvp_batch`, or whose costs are unknown)."""
        return spec.static.forward_basis_estimates(spec.x_shapes, spec.n_tangents)

    @property
    def stage3_runs(self) -> bool:
        return True

    def stage_rows(self) -> tuple[str | None, str | None, str | None]:
        return None, stage_label(self.spec, "jvp") + f" ({self.n} tangents)", None


def choose(site: Standard) -> Standard | ForwardBasis:
    """A standard site, on the forward-basis strategy where `strategy` chooses it. Where the
    estimates choose (`by_estimate`), the forward-basis estimate is put beside the others
    and the reason says which was estimated faster."""
    spec = site.spec
    n = spec.n_tangents
    estimates = ForwardBasis.estimate(spec)
    decided = spec.static.by_estimate(estimates)
    if decided and site.estimates is not None:  # (the standard estimate is the same)
        assert estimates is not None  # (`by_estimate` decides only with estimates)
        estimates = Estimates(
            estimates.standard, site.estimates.deferred, estimates.source, estimates.forward_basis, estimates.note
        )
    shown = estimates if decided else site.estimates
    if spec.static.strategy(n, estimates) == "forward-basis":
        reason = site.reason + _why(spec, decided)
        return ForwardBasis(
            spec=spec, position=site.position, reason=reason, location=site.location, n=n, estimates=shown
        )
    if not decided:
        return site
    reason = site.reason + f"; the forward-basis strategy with its n={n} tangents is estimated slower: {estimates}"
    return Standard(spec=spec, position=site.position, reason=reason, location=site.location, k=site.k, estimates=shown)


def _why(spec: Spec, decided: bool) -> str:
    """Why a site not deferred is differentiated on the forward-basis strategy (`decided`:
    by the estimates)."""
    static, n = spec.static, spec.n_tangents
    if static.prefer == "forward-basis":
        return ""
    if not static.has_vjp:
        return f"; reverse mode from its forward-mode implementation: the output and n={n} tangents in one call"
    if decided:
        return f"; forward-basis: the output and n={n} tangents in one call, estimated faster than `fwd` then `bwd`"
    return f"; forward-basis: the output and n={n} tangents in one call, one stage where `fwd` then `bwd` take two"
