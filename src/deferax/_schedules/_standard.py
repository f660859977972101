"""The standard schedule: `fwd` on the forward pass, `bwd` on the backward pass, as the
site's own rules run it; or, where its jobs run ahead of the value (`runs`), its `fwd` in
stage 2 (`_jobs.ForwardJob`) and its `bwd` after the value or, at once with other sites', in
stage 2b (`_together.JointBackward`)."""

from __future__ import annotations

from typing import ClassVar

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
