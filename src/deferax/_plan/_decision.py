"""The analysis's decision for one call site, before it becomes a row of the plan."""

from __future__ import annotations

from typing import Any, Literal

import equinox as eqx

from ._cost import Estimates

Schedule = Literal["standard", "deferred", "deferred-basis", "forward-basis"]


class Basis(eqx.Module):
    """A site on the basis schedule: its cotangent is a combination of `k` fixed cotangents.

    **Fields:**

    - `k`: the number of basis cotangents (the real numbers of the frontier).
    - `variables`: the frontier variables, variables of the program that stage 3 evaluates.
    - `program`: what stage 1 evaluates for them: the program with every expensive output
      an input, computing the frontier variables.
    """

    k: int
    variables: tuple
    program: Any


class Decision(eqx.Module):
    """The schedule decided for one call site, and why.

    **Fields:**

    - `schedule`: as `deferax.Site.schedule`.
    - `reason`: why the site is not deferred; None for a deferred one.
    - `location`: the operation and user line that make its cotangent depend on an output.
    - `k`: the number of basis cotangents its cotangent is a combination of, where known.
    - `n`: for the forward-basis strategy, the number of tangents.
    - `basis`: for the deferred-basis schedule, the frontier that stage 1 evaluates.
    - `estimates`: for a site that could be deferred, the estimated wall time of the
      standard and the deferred (or deferred-basis) schedule; the forward-basis strategy's
      beside them where it was chosen by estimate.
    """

    schedule: Schedule
    reason: str | None = None
    location: str | None = None
    k: int | None = None
    n: int | None = None
    basis: Basis | None = None
    estimates: Estimates | None = None

    @property
    def deferred(self) -> bool:
        return self.schedule in ("deferred", "deferred-basis")
