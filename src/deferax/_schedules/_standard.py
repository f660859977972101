"""The standard schedule: `fwd` on the forward pass, `bwd` on the backward pass, as the
site's own rules run it."""

from __future__ import annotations

from typing import ClassVar

from .._plan._cost import Estimates
from .._plan._plan import Schedule
from .._site import Spec
from ._abstract import AbstractSchedule, stage_label


class Standard(AbstractSchedule):
    """A site on the standard schedule. `k`: the number of basis cotangents its cotangent is
    a combination of, where the analysis counted them. `differentiated`: whether its input
    depends on a differentiated argument; without, no backward pass runs for it (and its
    forward keeps nothing for one)."""

    spec: Spec
    position: int | None
    reason: str
    location: str | None = None
    k: int | None = None
    n: None = None
    estimates: Estimates | None = None
    differentiated: bool = True
    label: ClassVar[Schedule] = "standard"  # pyright: ignore[reportIncompatibleVariableOverride]  (an eqx.AbstractClassVar: pyright#4965)
    defers: ClassVar[bool] = False  # pyright: ignore[reportIncompatibleVariableOverride]
    from_backward: ClassVar[tuple[str, ...]] = ()  # pyright: ignore[reportIncompatibleVariableOverride]

    def stage_rows(self) -> tuple[str | None, str | None, str | None]:
        return None, stage_label(self.spec, "fwd"), stage_label(self.spec, "bwd") if self.differentiated else None
