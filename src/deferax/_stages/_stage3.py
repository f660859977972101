"""Stage 3 of a deferred schedule: value, aux and gradients, the program evaluated under
`jax.vjp` with the deferred sites replaying their stage-2 results, the early sites given
their output, and every other site on the standard schedule."""

from __future__ import annotations

import functools as ft

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _jaxpr, _site
from .._analysis._analysis import Analysis
from .._misc import zero_like
from .._site._spec import Spec


def _returning(index: int, backward):
    """A function that returns its argument `index`, whose backward pass is
    `backward(args, ct)`: the cotangents of all its arguments, from all of them (kept as
    residuals) and the cotangent of the result."""

    @jax.custom_vjp
    def call(*args):
        return args[index]

    def fwd(*args):
        return args[index], args

    call.defvjp(fwd, backward)
    return call


def _replayed_cotangents(args, ct_y):
    _, y, ct_operands = args
    # The static check proved that `ct_y` equals the cotangent `fused` was given.
    return ct_operands, jtu.tree_map(zero_like, y), jtu.tree_map(zero_like, ct_operands)


# `replay(operands, y, ct_operands)`: a deferred site's output `y`, computed in stage 2; the
# backward pass gives the operands the cotangents stage 2 computed with them.
replay = _returning(1, _replayed_cotangents)


def _standard_cotangents(spec: Spec, args, ct_y):
    operands, y = args
    diff_cts = _site.cotangents(spec, operands[: spec.n_fn], operands[spec.n_fn :], y, ct_y)
    return _site.operand_cotangents(spec, operands, diff_cts), jtu.tree_map(zero_like, y)


def given(spec: Spec):
    """The standard schedule of a site whose output `y` was computed in stage 2:
    `given(spec)(operands, y)` returns `y`; the backward pass runs `bwd` (or `fused`) as
    the site's own rules would."""
    return _returning(1, ft.partial(_standard_cotangents, spec))


def _frontier_cotangents(spec: Spec, rows: slice, args, ct_z):
    _, operands, ct_xs = args
    a = _site.flatten_tangent(ct_z, ct_z)  # the order of the basis rows

    def combine(c):
        c = c[rows]
        coefficients = jnp.reshape(a, (-1,) + (1,) * (c.ndim - 1)).astype(c.dtype)
        return jnp.sum(jnp.where(c == 0, jnp.zeros((), c.dtype), coefficients * c), axis=0)

    diff_cts = [combine(c) for c in ct_xs]
    return (ct_z, _site.operand_cotangents(spec, operands, diff_cts), jtu.tree_map(zero_like, ct_xs))


def frontier_cotangent(spec: Spec, rows: slice):
    """Where a frontier variable `z` of a basis site is made: `frontier_cotangent(spec,
    rows)(z, operands, ct_xs)` is `z` itself, whose backward pass also gives the site's
    operands their cotangent. The coefficients are `z`'s own cotangent, exactly (no
    projection): `ct_x = sum_j ct_z[j] * ct_x_j` over the precomputed input cotangents of
    this variable's basis cotangents, with a zero entry of `ct_x_j` contributing zero
    whatever `ct_z[j]` is: an infinite slope then gives `inf` where the standard
    schedule's adjoint would, not NaN everywhere."""
    return _returning(0, ft.partial(_frontier_cotangents, spec, rows))


def _frontier_wraps(analysis: Analysis, k: int, operands: dict, ct_xs: list) -> dict:
    """The stage-3 wrappers of site `k`'s frontier variables (`operands[k]` is filled in
    when the site is evaluated, before any of its frontier variables is made)."""
    spec = analysis.spec(k)
    wraps, start = {}, 0
    for v in analysis.basis[k].variables:
        size = _jaxpr.frontier_size([v])
        rows = slice(start, start + size)
        wraps[v] = lambda z, rows=rows: frontier_cotangent(spec, rows)(z, operands[k], ct_xs)
        start += size
    return wraps


def _replacements(analysis: Analysis, results) -> tuple[dict, dict]:
    """`(handlers, wraps)` for `_jaxpr.interpret`: what stage 3 runs in place of the deferred
    and early sites, and the wrappers of the basis sites' frontier variables. Made afresh
    for each trace: the basis sites' operands recorded here are that trace's tracers, and
    nothing may keep them alive after it (jax >= 0.11 checks for leaked tracers)."""
    handlers, wraps, operands = {}, {}, {}
    if results is None:
        return handlers, wraps
    cts, ys, diff_cts = results
    for k in analysis.deferred + analysis.early:
        spec = analysis.spec(k)
        if k in analysis.early:
            handlers[analysis.sites[k]] = lambda eqn, ops, spec=spec, k=k: given(spec)(ops, ys[k])
        elif k in analysis.basis:
            # the output is a constant here; the operands get their cotangent where the
            # frontier variables are made
            handlers[analysis.sites[k]] = lambda eqn, ops, k=k: (operands.__setitem__(k, ops), ys[k])[1]
            for v, wrap in _frontier_wraps(analysis, k, operands, diff_cts[k]).items():
                # A variable on several sites' frontiers (`sum(f(x)) + sum(f(2 * x))`
                # before a square): each site's wrapper in turn, all given its cotangent.
                before = wraps.get(v)
                wraps[v] = wrap if before is None else (lambda z, wrap=wrap, before=before: wrap(before(z)))
        else:
            handlers[analysis.sites[k]] = lambda eqn, ops, spec=spec, k=k: replay(
                ops, ys[k], _site.operand_cotangents(spec, ops, diff_cts[k])
            )
    return handlers, wraps


def stage3(analysis: Analysis, has_diff: list[bool], ins: list, results) -> tuple:
    """`(outputs, grads)`: the program's outputs (value first) and the gradient of the value
    with respect to the inputs flagged in `has_diff`."""
    diff = [a for a, d in zip(ins, has_diff, strict=True) if d]

    def program(diff_):
        it = iter(diff_)
        full = [next(it) if d else a for a, d in zip(ins, has_diff, strict=True)]
        outs = _jaxpr.interpret(analysis.program, full, *_replacements(analysis, results))
        return outs[0], outs[1:]

    with _site.planned(analysis.strategies):  # (the sites' JVP rules run here: as planned)
        value, vjp, aux = jax.vjp(program, diff, has_aux=True)
        (grads,) = vjp(jnp.ones((), value.dtype))
    return [value, *aux], grads
