"""The reverse-mode strategy of an `ExpensiveFn` (the `fn` of each function here, typed `Any`:
`_expensive` imports this module), behind its methods of the same names: the forward-basis
strategy (the primal and the `n` unit tangents in one call, `ct_x = J^T ct_y`) or the
standard schedule (`fwd`, then `bwd`), chosen by `prefer`, `max_tangents`, the estimates
where the costs are known, else a fixed rule."""

from __future__ import annotations

from typing import Any

from .._plan import _cost
from ._abstract import AbstractImplementation

# The most tangents the forward-basis strategy takes by default, when the function also has
# a reverse-mode implementation (`bwd` or `fused`) and its costs are not known (a `cost=`
# hint or timings of earlier calls decide instead); `ExpensiveFn(max_tangents=...)` sets it.
DEFAULT_MAX_TANGENTS = 8

STRATEGIES = ("standard", "forward-basis")


def forward_basis_estimates(fn: Any, shapes: tuple, n: int) -> _cost.Estimates | None:
    """The estimates of the standard schedule and the forward-basis strategy (the output
    and `n` unit tangents on the forward pass, one stage; `ct_x = J^T ct_y` after) on an
    input of leaves of `shapes` with `n` numbers; None without `jvp` or `jvp_batch`:

        forward-basis   = one job:  setup + fwd + n * tangent + stage
                          (`jvp_batch`, or a traced `jvp` batched with `vmap`)
                          or n jobs:  max(one job, all jobs / workers) + stage
                          (`dx.host`'s `jvp` without `jvp_batch`: setup + fwd + tangent each)

    A tangent costs what an adjoint does (`bwd`'s number): a tangent solve and an adjoint
    solve share the forward's factorisation alike; these are the deferred-basis estimates
    with `n` tangents in place of cotangents. With the equal-cost defaults the fixed rule
    decides, not this estimate (`strategy`): `n` unit tangents estimated as `n` adjoints
    would never be chosen, yet a tangent solve beside the forward is often nearly free."""
    if fn.jvp is None and fn.jvp_batch is None:
        return None
    batch = fn.jvp_batch
    one_job = not isinstance(batch, AbstractImplementation) or batch.batch_in_one_job
    fused_only = fn.fwd is None and fn.bwd is None and fn.adjoint is None
    workers = batch.jobs_at_once if isinstance(batch, AbstractImplementation) and not one_job else 1
    hint = _cost.Cost() if fn.cost is None else fn.cost
    workers = workers if hint.workers is None else hint.workers
    setup, fwd, bwd, stage, source = _cost.numbers(fn.timings_key, shapes, hint)
    # (no tangent: the output alone, one job; `jvp`'s separate jobs compute the output each)
    tangents = [setup + fwd + n * bwd] if one_job or n == 0 else [setup + fwd + bwd] * n
    return _cost.Estimates(
        standard=_cost.standard_seconds(setup, fwd, bwd, stage, hint, fused_only),
        deferred=None,
        source=source,
        forward_basis=_cost.at_once(tangents, workers, stage),
        note=hint.note,
    )


def by_estimate(fn: Any, estimates: _cost.Estimates | None) -> bool:
    """Whether `estimates` (what `forward_basis_estimates` returned) choose between the
    standard schedule and the forward-basis strategy: both are possible (`jvp` or
    `jvp_batch`, and `bwd` or `fused`), the user set neither `prefer` nor
    `max_tangents`, and the costs are known (a `cost=` hint or timings of earlier
    calls, not the equal-cost defaults)."""
    return (
        estimates is not None
        and estimates.source != "defaults"
        and fn.has_vjp
        and fn.prefer is None
        and fn.max_tangents is None
    )


def strategy(fn: Any, n: int, estimates: _cost.Estimates | None) -> str:
    """The reverse-mode strategy of a call whose input has `n` numbers, given its
    `estimates` (what `forward_basis_estimates` returned):

    - `"forward-basis"`: the primal and `n` tangents in one batched call during the
      forward pass (one stage), `ct_x = J^T ct_y` after; possible with `jvp` or
      `jvp_batch`. Chosen when the function has nothing else for reverse mode (within
      `max_tangents` if given); else when `n <= max_tangents` if given; else, where
      costs are known (`by_estimate`), when its estimate is below the standard
      schedule's; else, with the equal-cost defaults, by the fixed rule
      `n <= DEFAULT_MAX_TANGENTS` (fewest sequential expensive stages, then fewest
      expensive calls);
    - `"standard"`: `fwd` on the forward pass, `bwd` on the backward pass (two stages).

    `prefer` forces either. [`deferax.filter_value_and_grad`][] decides it once, in its
    plan; a site's JVP rule decides it only outside (`_site._primitive._jvp_strategy`)."""
    if fn.prefer in STRATEGIES:
        return fn.prefer
    if fn.jvp is None and fn.jvp_batch is None:
        return "standard"
    limit = fn.max_tangents if fn.max_tangents is not None else DEFAULT_MAX_TANGENTS
    if not fn.has_vjp:
        if fn.max_tangents is None or n <= limit:
            return "forward-basis"
        return "standard"  # reverse mode then fails with TOO_MANY_TANGENTS, forward mode works
    if by_estimate(fn, estimates):
        assert estimates is not None and estimates.forward_basis is not None  # (`forward_basis_estimates`')
        return "forward-basis" if estimates.forward_basis < estimates.standard else "standard"
    return "forward-basis" if n <= limit else "standard"
