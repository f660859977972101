"""Whether standard sites' backward jobs run at once (`runs="together"`, `_schedules/_together.py`):
the conditions, the estimates that choose it (`_schedules._together.together`), and the
texts that say with which sites, or why not: functions of what they read of the program
(`Facts`, which the analysis gives) and of the schedules chosen so far, returning the
schedules they choose."""

from __future__ import annotations

import dataclasses
from typing import Any

from .._implementation._abstract import AbstractImplementation
from .._schedules._standard import Standard, standard
from .._schedules._together import both_leave_program, together
from .._site import Spec


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the choice of backward jobs at once reads of the program."""

    specs: tuple[Spec, ...]  # each top-level site's, by position
    schedule: str  # the schedule requested: "auto", "standard" or "deferred"
    fallback: str | None  # why the program runs as Equinox would, if it does
    nested: tuple[str, ...]  # for each site called inside `lax.scan` or the like: what it is inside
    max_basis: int | None  # the transform's `max_basis`
    why_not_deferred: dict[int, str]  # each basis site's reason to stay standard, by position


def jobs_leave_program(facts: Facts, p: int) -> bool:
    """Whether site `p`'s standard jobs could run at once with others': host functions, not
    differentiated by JAX."""
    spec = facts.specs[p]
    return both_leave_program(spec) and not spec.static.autodiff


def may_run_together(facts: Facts, ready) -> bool:
    """Whether standard sites' backward jobs may run at once (`runs="together"`), or the plan says
    why not: two sites or more, of which one at least has host functions, every site's
    operands need no expensive output (so every output is known in stage 2), none is
    called inside `lax.scan` or the like, and the schedule is chosen (`"auto"`)."""
    n = len(facts.specs)
    return (
        facts.schedule == "auto"
        and facts.fallback is None
        and not facts.nested
        and n >= 2
        and len(ready) == n
        and any(jobs_leave_program(facts, p) for p in range(n))
    )


def in_turn(facts: Facts, schedules: dict, upstream) -> dict:
    """Why the standard host sites' backward jobs run in turn where `may_run_together`
    found a site that takes an expensive output, or one called inside `lax.scan` or the
    like, added to their reasons (of two sites or more, counting those inside)."""
    schedules = dict(schedules)  # (the caller's are left as they are)
    n = len(facts.specs)
    if facts.schedule != "auto" or facts.fallback is not None:
        return schedules
    eligible = [
        p
        for p, s in schedules.items()
        if (st := standard(s)) is not None and st.differentiated and jobs_leave_program(facts, p)
    ]
    why = [
        f"the input of site #{p} `{facts.specs[p].name}` depends on an expensive output"
        for p in range(n)
        if upstream[p]
    ]
    if facts.nested:
        kinds = ", ".join(sorted(set(facts.nested)))
        why.append(f"the expensive call inside {kinds} runs on the program's own passes")
    if not eligible or not why:
        return schedules
    for p in eligible:
        schedules[p] = _with_reason(schedules[p], "; backward jobs in turn: " + "; ".join(why))
    return schedules


def choose(facts: Facts, schedules: dict, once) -> dict:
    """The standard sites whose backward jobs run at once, where every other site runs in
    stage 2 and the estimates say it is faster (`_schedules._together.together`); the reasons say
    with which sites, or why not. A site that nothing differentiates has no backward job:
    its forward job runs in stage 2 beside theirs (`runs="ahead"`)."""
    schedules = dict(schedules)  # (the caller's are left as they are)
    n = len(facts.specs)
    group, blocking, still = [], [], []
    for p in range(n):
        s, spec = schedules[p], facts.specs[p]
        if s.defers:
            continue
        if _still(s) and not spec.static.autodiff and not once.get(p):
            still.append(p)  # (no backward job: its `fwd` runs in stage 2 beside the others')
        elif standard(s) is not None and jobs_leave_program(facts, p) and not once.get(p):
            group.append(p)
        elif s.label == "forward-basis":
            blocking.append(f"site #{p} `{spec.name}` is on the forward-basis strategy")
        elif spec.static.autodiff:
            blocking.append(f"site #{p} `{spec.name}` is differentiated by JAX")
        elif once.get(p):
            blocking.append(f"for site #{p} `{spec.name}`, {once[p]}")
        else:
            blocking.append(f"site #{p} `{spec.name}` runs inside the program, where XLA runs its jobs in turn")
    if not group or (len(group) + len(still) < 2 and not blocking):
        return schedules
    if blocking:
        why = "; backward jobs in turn: " + "; ".join(blocking)
        for p in group:
            schedules[p] = _with_reason(schedules[p], why)
        return schedules
    estimates = together([_cost_of(facts, p) for p in [*group, *still]], still=len(still))
    members = ", ".join(f"#{p}" for p in sorted([*group, *still]))
    jobs = "jobs" if still else "backward jobs"  # (those that nothing differentiates have a forward job only)
    if estimates.faster:
        for p in group:
            why = f"; {jobs} at once with {members}: {estimates.text()}"
            schedules[p] = _with_reason(schedules[p], why, runs="together")
        for p in still:  # (in stage 2, at once with the others' forward jobs: every output is known in stage 2b)
            why = f"; its forward job at once with {members}: {estimates.text()}"
            schedules[p] = _with_reason(schedules[p], why, runs="ahead")
        return schedules
    if estimates.workers == 1:
        why = f"; {jobs} in turn: one worker runs one job at a time ({estimates.text()})"
    else:
        why = f"; {jobs} in turn: {estimates.text()} with {members}"
    for p in group:
        schedules[p] = _with_reason(schedules[p], why)
    return schedules


def against_basis(facts: Facts, schedules: dict, candidates, stays_standard) -> dict:
    """Sites put on the deferred-basis schedule by their estimates (no `max_basis`) go back
    to the standard schedule where the standard sites' jobs at once are estimated faster than
    those sites deferred on their basis beside the others in turn or at once: the bend's two
    wavelengths, each a factorisation, a forward and one adjoint solve at once (`choose` then
    groups them), rather than a factorisation, a forward and `k / 2` adjoint solves each.
    Every site must then be able to run at once with the others (else nothing changes), and
    stay on the standard strategy (`stays_standard` of its `Standard` schedule: not moved to
    the forward-basis one, which runs in turn)."""
    schedules = dict(schedules)  # (the caller's are left as they are)
    n = len(facts.specs)
    basis = [
        p
        for p in candidates
        if schedules[p].label == "deferred-basis" and _limit(facts, p) is None and jobs_leave_program(facts, p)
    ]
    if not basis:
        return schedules
    # (a site that nothing differentiates has no backward job to run at once)
    in_turn_sites = [p for p in range(n) if p not in basis and not schedules[p].defers and not _still(schedules[p])]
    if any(not (standard(schedules[p]) is not None and jobs_leave_program(facts, p)) for p in in_turn_sites):
        return schedules  # (a site that cannot run at once: `choose` would keep the group in turn)
    jointly = together([_cost_of(facts, p) for p in sorted([*basis, *in_turn_sites])])
    estimates = [schedules[p].estimates for p in basis]
    if not jointly.faster or any(e is None or e.deferred is None or e.source != jointly.source for e in estimates):
        return schedules  # (no gain; or estimates in other units than the jobs at once: not compared)
    # each basis site's estimate is its share of the stage they all run in, plus that stage
    deferred = sum(e.deferred for e in estimates) - (len(basis) - 1) * jointly.stage  # pyright: ignore[reportOptionalOperand, reportOptionalMemberAccess]  (checked above)
    if len(in_turn_sites) > 1:
        now = together([_cost_of(facts, p) for p in in_turn_sites])
        deferred += now.at_once if now.faster else now.in_turn
    elif in_turn_sites:
        deferred += sum(schedules[p].estimates.standard for p in in_turn_sites if schedules[p].estimates is not None)
    if jointly.at_once >= deferred:
        return schedules
    unit = "" if jointly.source == "defaults" else " s"
    switched = {}
    for p in basis:
        s = schedules[p]
        why = (
            f"; deferring its k={s.k} fixed cotangents is estimated slower than the standard sites' jobs at "
            f"once ({deferred:.4g}{unit} against {jointly.at_once:.4g}{unit})"
        )
        reason = facts.why_not_deferred[p] + why
        switched[p] = Standard(
            spec=s.spec, position=p, reason=reason, location=s.location, k=s.k, estimates=s.estimates
        )
    if all(stays_standard(s) for s in switched.values()):
        schedules.update(switched)
    return schedules


def _still(schedule: Any) -> bool:
    """Whether a site's schedule says that nothing differentiates it."""
    st = standard(schedule)
    return st is not None and not st.differentiated


def _limit(facts: Facts, p: int) -> int | None:
    """The `max_basis` that decides site `p`'s basis schedule (None: its estimates do)."""
    limit = facts.specs[p].static.max_basis
    return limit if limit is not None else facts.max_basis


def _cost_of(facts: Facts, p: int) -> tuple:
    """`(key, shapes, hint, workers)` of site `p`, for `together`."""
    static = facts.specs[p].static
    workers = [i.jobs_at_once for i in (static.fwd, static.bwd) if isinstance(i, AbstractImplementation)]
    shapes = tuple(s.shape for s in facts.specs[p].x_structs)
    return static.timings_key, shapes, static.cost, min(workers, default=1)


def _with_reason(schedule: Any, why: str, **changes: Any) -> Any:
    """A standard site with `why` added to its reason (and `changes`: where its jobs run)."""
    return dataclasses.replace(schedule, reason=schedule.reason + why, **changes)
