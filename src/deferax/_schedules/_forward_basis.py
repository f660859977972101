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
from ._standard import Standard, standard


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


def where_chosen(schedule: AbstractSchedule) -> AbstractSchedule:
    """A differentiated standard site on the forward-basis strategy where it is chosen
    (`choose`); any other schedule as it is."""
    st = standard(schedule)
    return choose(st) if st is not None and st.differentiated else schedule


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
