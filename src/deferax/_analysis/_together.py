"""Whether standard sites' backward jobs run at once (`Together`, `_schedules/_together.py`):
the conditions, the estimates that choose it (`_cost.together`), and the texts that say
with which sites, or why not. `check` is the analysis's `_Check` of the program."""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import _jaxpr
from .._implementation._abstract import AbstractImplementation
from .._plan import _cost
from .._schedules._early import Early
from .._schedules._forward_basis import ForwardBasis
from .._schedules._standard import Standard
from .._schedules._together import Together, leaves_both


def jobs_leave(check, p: int) -> bool:
    """Whether site `p`'s standard jobs could run at once with others': host functions, not
    differentiated by JAX."""
    spec = check.specs[p]
    return leaves_both(spec) and not spec.static.autodiff


def may_run_together(check, ready) -> bool:
    """Whether standard sites' backward jobs may run at once (`Together`), or the plan says
    why not: two sites or more, of which one at least has host functions, every site's
    operands need no expensive output (so every output is known in stage 2), none is
    called inside `lax.scan` or the like, and the schedule is chosen (`"auto"`)."""
    n = len(check.sites)
    return (
        check.schedule == "auto"
        and check.fallback is None
        and not check.nested
        and n >= 2
        and len(ready) == n
        and any(jobs_leave(check, p) for p in range(n))
    )


def in_turn(check, schedules, upstream) -> None:
    """Why the standard host sites' backward jobs run in turn where `may_run_together`
    found a site that takes an expensive output, or one called inside `lax.scan` or the
    like, added to their reasons."""
    n = len(check.sites)
    if check.schedule != "auto" or check.fallback is not None or n + len(check.nested) < 2:
        return
    eligible = [p for p, s in schedules.items() if isinstance(s, Standard | Early) and jobs_leave(check, p)]
    why = [
        f"the input of site #{p} `{check.specs[p].name}` depends on an expensive output"
        for p in range(n)
        if upstream[p]
    ]
    if check.nested:
        kinds = ", ".join(sorted({_jaxpr.kind_of(check.program.jaxpr.eqns[i]) for i in check.nested}))
        why.append(f"the expensive call inside {kinds} runs on the program's own passes")
    if not eligible or not why:
        return
    for p in eligible:
        schedules[p] = _with_reason(schedules[p], "; backward jobs in turn: " + "; ".join(why))


def choose(check, schedules, once) -> None:
    """The standard sites whose backward jobs run at once, where every other site runs in
    stage 2 and the estimates say it is faster (`_cost.together`); the reasons say
    with which sites, or why not."""
    n = len(check.sites)
    group, blocking = [], []
    for p in range(n):
        s, spec = schedules[p], check.specs[p]
        if s.defers:
            continue
        if isinstance(s, Standard | Early) and jobs_leave(check, p) and not once.get(p):
            group.append(p)
        elif isinstance(s, ForwardBasis):
            blocking.append(f"site #{p} `{spec.name}` is on the forward-basis strategy")
        elif spec.static.autodiff:
            blocking.append(f"site #{p} `{spec.name}` is differentiated by JAX")
        elif once.get(p):
            blocking.append(f"for site #{p} `{spec.name}`, {once[p]}")
        else:
            blocking.append(f"site #{p} `{spec.name}` runs inside the program, where XLA runs its jobs in turn")
    if len(group) < 2 and not blocking:
        return
    if blocking:
        why = "; backward jobs in turn: " + "; ".join(blocking)
        for p in group:
            schedules[p] = _with_reason(schedules[p], why)
        return
    estimates = _cost.together([_cost_of(check, p) for p in group])
    members = ", ".join(f"#{p}" for p in group)
    if estimates.faster:
        for p in group:
            schedules[p] = Together.of(schedules[p], f"; backward jobs at once with {members}: {estimates.text()}")
        return
    if estimates.workers == 1:
        why = f"; backward jobs in turn: one worker runs one job at a time ({estimates.text()})"
    else:
        why = f"; backward jobs in turn: {estimates.text()} with {members}"
    for p in group:
        schedules[p] = _with_reason(schedules[p], why)


def _cost_of(check, p: int) -> tuple:
    """`(key, shapes, hint, workers)` of site `p`, for `_cost.together`."""
    static = check.specs[p].static
    workers = [i.jobs_at_once for i in (static.fwd, static.bwd) if isinstance(i, AbstractImplementation)]
    shapes = tuple(s.shape for s in check.specs[p].x_structs)
    return static.timings_key, shapes, static.cost, min(workers, default=1)


def _with_reason(schedule: Any, why: str) -> Any:
    """A `Standard` or `Early` site with `why` added to its reason."""
    return dataclasses.replace(schedule, reason=schedule.reason + why)
