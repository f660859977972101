"""The standard schedule with the jobs of independent sites at once: for two or more
standard sites of which none needs an expensive output (`Standard` with `runs="together"`),
each `fwd` runs in stage 2 (its `_jobs.ForwardJob`), and each `bwd` in stage 2b, all at once
(its `_jobs.BackwardJob`).

The sites of one program that run so are one group, `JointBackward`: its members, the
backward program that gives their outputs' cotangents, and its jobs. Stage 2b evaluates that
program (the backward program the analysis traced, `G(ins, ys, seed)`, pruned) with the
real outputs from stage 2: the cotangent of each site's output, exactly (`G` is the VJP of
the program with respect to the sites' outputs, evaluated at the real outputs; every
expensive output is known there, since every top-level site runs in stage 2 and none is
nested in `lax.scan` or the like). Then the sites' `bwd` jobs run at once, eagerly on the
site pool, under `jit` from one callback when all of them leave the program. Stage 3
replays the outputs and the input cotangents, as for a deferred site: no `bwd` runs there.
Each site's `fwd` and `bwd` run once a step, as on the standard schedule; only their
order changes. The cost model chooses it, from the estimates here (`together`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import _jaxpr
from .._implementation._abstract import AbstractImplementation
from .._plan import _cost
from .._site import Spec
from ._abstract import AbstractAhead
from ._jobs import BackwardJob


def both_leave_program(spec: Spec) -> bool:
    """Whether a site's `fwd` and `bwd` both leave the program (host functions): XLA runs
    the implementations traced into it one after another, so only those can run at once."""
    static = spec.static
    return isinstance(static.fwd, AbstractImplementation) and isinstance(static.bwd, AbstractImplementation)


class JointBackward(eqx.Module):
    """The together sites of one program, as one group: their `bwd` jobs run at once in
    stage 2b, from their outputs' cotangents, which its backward program gives from the real
    outputs of every site.

    **Fields:**

    - `members`: the together sites' forward jobs (`_jobs.ForwardJob`), in program order.
    - `program`: the backward program, pruned to the members' cotangents:
      `(consts, leaves, ys, seed) -> cts`, with `ys` every top-level site's output leaves.
    - `outs`: for each output of `program`, `("ct", position, leaf)`.
    - `order`: the positions of every top-level site, in program order (`ys`'s order).
    - `seed`: the dtype of the loss's value (the seed's: the cotangent of the value).
    """

    members: tuple[AbstractAhead, ...]
    program: Any
    outs: tuple
    order: tuple[int, ...]
    seed: Any

    def cotangents(self, ins: list, ys: dict) -> dict:
        """The cotangents of the members' outputs, by position: `program` evaluated with the
        real outputs of every site (`ys`, by position, from stage 2)."""
        seed = jnp.ones((), self.seed)
        leaves = [y for p in self.order for y in ys[p]]
        outs = _jaxpr.interpret(self.program, [*ins, *leaves, seed])
        cts: dict = {}
        for (_, p, j), value in zip(self.outs, outs, strict=True):
            y = ys[p][j]
            if value.dtype == jax.dtypes.float0:  # (an integer output's: its implementations get zeros)
                value = jnp.zeros(jnp.shape(y), jnp.result_type(y))
            cts.setdefault(p, []).append(value)
        return cts

    def run(self, operands: dict, ys: dict, cts: dict, stage2: Callable[..., list]) -> dict:
        """The members' `bwd` jobs, at once, run by `stage2(jobs, operands, given)` (stage 2's
        runner) from their outputs `ys` and the cotangents `cts` of them (`cotangents`): the
        cotangents of the differentiable leaves of each one's input, by position."""
        jobs = tuple(BackwardJob(spec=s.spec, position=s.position, label=s.label) for s in self.members)
        given = {j.position: (ys[j.position], cts[j.position]) for j in jobs}
        results = stage2(jobs, operands, given)
        return {j.position: r[0] for j, r in zip(jobs, results, strict=True)}


# ----------------------------------------------------------------------------- the estimates


class TogetherEstimates(eqx.Module):
    """The estimates of standard sites that may run their jobs at once (`together`).

    **Fields:**

    - `in_turn`: each site's forward, then each one's backward, one after another (the sum
      of their standard estimates).
    - `at_once`: the forward jobs at once, then the backward jobs at once.
    - `workers`: the jobs that run at once (the fewest of the sites').
    - `source`: as [`deferax.Estimates`][]'s.
    - `stage`: one stage's overhead in these numbers.
    """

    in_turn: float
    at_once: float
    workers: int
    source: str
    stage: float = 0.0

    @property
    def faster(self) -> bool:
        """Whether the jobs at once are estimated faster, on more than one worker (on one,
        what they save is a host round trip: within what the estimate can tell)."""
        return self.workers > 1 and self.at_once < self.in_turn

    def text(self) -> str:
        """`"estimated X s at once against Y s in turn"`."""
        unit = "" if self.source == "defaults" else " s"
        return f"estimated {self.at_once:.4g}{unit} at once against {self.in_turn:.4g}{unit} in turn"


def together(sites: list[tuple[Hashable, tuple, _cost.Cost | None, int]], still: int = 0) -> TogetherEstimates:
    """The estimates of standard sites (`(key, shapes, hint, workers)` each, as for `_deferred.estimate`)
    whose forward jobs run at once in one stage and whose backward jobs run at once in the
    next, from the same numbers (`_cost.numbers`) (the last `still` sites have no backward
    job: nothing differentiates them):

        in turn    = sum of each site's standard estimate
                     = sum (setup + fwd + (setup, unless kept) + bwd + 2 * stage)
        at once    = max(longest forward job, all forward jobs / workers)
                     + max(longest backward job, all backward jobs / workers) + 3 * stage

    (two stages of jobs, and one more for the backward program evaluated ahead of the
    value, with the real outputs). `workers`: the fewest of the sites' (a hint's first).
    A site whose numbers are seconds beside one on the equal-cost defaults puts every site
    on the defaults (seconds are not mixed with their units)."""
    hints = [_cost.Cost() if hint is None else hint for _, _, hint, _ in sites]
    numbers = [_cost.numbers(key, shapes, hint) for (key, shapes, _, _), hint in zip(sites, hints, strict=True)]
    if len({n[4] == "defaults" for n in numbers}) > 1:
        numbers = [
            _cost.numbers(key, shapes, hint, True) for (key, shapes, _, _), hint in zip(sites, hints, strict=True)
        ]
    workers = min(w if hint.workers is None else hint.workers for (_, _, _, w), hint in zip(sites, hints, strict=True))
    forward, backward, in_turn = [], [], 0.0
    for i, ((setup, fwd, bwd, stage, _), hint) in enumerate(zip(numbers, hints, strict=True)):
        forward.append(setup + fwd)
        in_turn += setup + fwd + stage
        if i < len(sites) - still:
            again = 0.0 if hint.keeps_setup else setup
            backward.append(again + bwd)
            in_turn += again + bwd + stage
    stage = max(n[3] for n in numbers)
    at_once = sum(max(max(jobs), sum(jobs) / workers) for jobs in (forward, backward) if jobs) + 3 * stage
    sources = {n[4] for n in numbers}
    source = "measured" if "measured" in sources else "hint" if "hint" in sources else "defaults"
    return TogetherEstimates(in_turn=in_turn, at_once=at_once, workers=workers, source=source, stage=stage)
