"""The forward-basis strategy: the output and `n` unit tangents in one call on the forward
pass (`jvp_batch`, or `jvp` batched), `ct_x = J^T ct_y` after. The site's own JVP rule
runs it (`_site/_forward_basis.py`); this is what the plan says of it."""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx

from .._plan._cost import Estimates
from .._plan._plan import Schedule
from .._site import Spec
from ._abstract import AbstractSchedule, stage_label


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
