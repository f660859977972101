"""Stage 1 of a deferred schedule: the deferred sites' operands and cotangents, from the
backward program the analysis traced, with zeros standing in for every expensive output
(the static check proved them unused) and nothing else of the program run (no user
effects). For a basis site, its `k` basis cotangents."""

from __future__ import annotations

import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _jaxpr
from .._analysis._analysis import Analysis
from .._misc import structs, zeros


def stage1(analysis: Analysis, ins: list) -> tuple[dict, dict]:
    """`(operands, cts)` of the sites that stage 2 runs, by position; for a basis site the
    cotangents are its `k` basis cotangents stacked on a leading axis."""
    ys = [zeros(structs(s.spec.y_avals())) for s in analysis.schedules]
    operands: dict = {}
    traced: dict = {}
    if analysis.backward is not None:
        seed = jnp.ones((), analysis.program.jaxpr.outvars[0].aval.dtype)
        outs = _jaxpr.interpret(analysis.backward, [*ins, *jtu.tree_leaves(ys), seed])
        for (kind, p, _), value in zip(analysis.backward_out, outs, strict=True):
            (traced if kind == "ct" else operands).setdefault(p, []).append(value)
    cts = {s.position: s.stage1_cotangents(ins, ys, traced.get(s.position)) for s in analysis.ahead}
    return operands, {p: c for p, c in cts.items() if c is not None}
