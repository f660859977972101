"""Stage 1 of a deferred schedule: the deferred sites' operands and cotangents, from the
backward program the analysis traced, with zeros standing in for every expensive output
(the static check proved them unused) and nothing else of the program run (no user
effects). For a basis site, its `k` basis cotangents."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _jaxpr
from .._analysis._analysis import Analysis
from .._misc import structs, zeros


def stage1(analysis: Analysis, ins: list) -> tuple[dict, dict]:
    """`(operands, cts)` of the sites that stage 2 runs, by position; for a basis site the
    cotangents are its `k` basis cotangents stacked on a leading axis."""
    ys = [zeros(structs(analysis.spec(k).y_avals())) for k in range(len(analysis.sites))]
    operands: dict = {}
    cts: dict = {}
    if analysis.backward is not None:
        seed = jnp.ones((), analysis.program.jaxpr.outvars[0].aval.dtype)
        outs = _jaxpr.interpret(analysis.backward, [*ins, *jtu.tree_leaves(ys), seed])
        for (kind, k, _), value in zip(analysis.backward_out, outs, strict=True):
            (cts if kind == "ct" else operands).setdefault(k, []).append(value)
    for k, basis in analysis.basis.items():
        cts[k] = _basis_cotangents(basis.program, basis.variables, ins, ys, k)
    return operands, cts


def _basis_cotangents(program, variables, ins, ys, k):
    """The basis cotangents of a basis site: for each real number of each frontier variable
    (a complex number counts twice: its real, then its imaginary direction), the cotangent
    of the site's output that the variable's *direct* dependence on it gives, stacked.

    The frontier is linear in the output, so these are exact rows of a fixed Jacobian.
    "Direct": a frontier variable computed from another one sees it as a constant (its
    contribution travels through the other's cotangent in stage 3), so that
    `ct_y = sum_j ct_z[j] * row_j` holds with `ct_z` the variables' cotangents.
    """
    n_in = len(ins) + len(jtu.tree_leaves(ys))
    ns = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in program.jaxpr.invars[n_in:]]
    wanted = set(variables)

    def frontier_of(y_k):
        ys_ = list(ys)
        ys_[k] = y_k
        seen = {}

        def record(v):
            def f(value):
                seen[v] = value
                return jax.lax.stop_gradient(value)

            return f

        _jaxpr.interpret(program, [*ins, *jtu.tree_leaves(ys_), *ns], wrap={v: record(v) for v in wanted})
        return [seen[v] for v in variables]

    values, vjp = jax.vjp(frontier_of, ys[k])
    seeds = []
    for i, v in enumerate(values):
        units = [jnp.eye(v.size, dtype=v.dtype)]
        if jnp.iscomplexobj(v):
            units.append(1j * units[0])
        for unit in units:
            rows = unit.shape[0]
            seeds.append(
                [
                    jnp.reshape(unit, (rows, *v.shape)) if j == i else jnp.zeros((rows, *w.shape), w.dtype)
                    for j, w in enumerate(values)
                ]
            )
    batch = [jnp.concatenate([s[j] for s in seeds]) for j in range(len(values))]
    (basis,) = jax.vmap(vjp)(batch)
    return basis
