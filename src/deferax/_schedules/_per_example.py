"""The basis of a site under `vmap`, counted per example.

A site called under `jax.vmap` over a batch of `B` examples has one output `y` with the
examples on its leading axis. Its linear frontier (`_jaxpr.linear_frontier`) often holds
`B` times as many numbers as one example needs: an MSE over a linear readout has one
prediction per example, so `k = B` in all, but the prediction of example `b` is reached by
`y[b]` only. When every frontier variable is *batched like the output* (it has an axis of
size `B` whose index `b` depends on `y[b]` alone, `_jaxpr.example_axes`), the basis is
counted per example: `k` is the frontier's size over `B`, and each example's `fused` job
gets only its own `k` rows, not all `B * k` of which the others' are zero there.

The analysis finds the axes (`example_axes`) and counts `k` (`count`); the
deferred-basis schedule (`_deferred_basis.DeferredBasis`) runs the stages:

- Stage 1 makes the `k` per-example basis cotangents with one seed each, a unit at the same
  index of every example (`seeds`): the row of example `b` is the cotangent at `y[b]`.
- Stage 2 is as for any basis site: the cotangents are stacked `(k, B, ...)`, and each example's job
  gets its slice `(k, ...)`; the input cotangents come back `(k, B, ...)`.
- Stage 3 combines them with each example's own coefficients (`coefficients`): the
  frontier variable's cotangent at that example.

Only a site under one `vmap` level whose differentiable inputs are all batched is counted
this way: an input shared by the examples gets the sum of their cotangents, which the
examples' different coefficients cannot be taken out of.
"""

from __future__ import annotations

import jax.numpy as jnp

from .. import _jaxpr, _site


def example_axes(spec: _site.Spec, tail, frontier) -> tuple[int, ...] | None:
    """For each frontier variable of site `spec`, the axis that indexes the examples, or
    None when the basis cannot be counted per example. `tail`: `(program, source,
    stand_ins)` as the analysis's `_tail` gives it (the source flags are the site's output
    leaves, batched at 0)."""
    if len(spec.axes) != 1 or not frontier:
        return None
    ((level, size),) = spec.axes
    x_axes = level[spec.n_fn : spec.n_fn + spec.n_x]
    if any(a is None for a, d in zip(x_axes, spec.diff, strict=True) if d):
        return None
    program, source, _ = tail
    found = _jaxpr.example_axes(program, [0 if s else None for s in source])
    axes = []
    for v in frontier:
        a = found.get(v)
        if not isinstance(a, int) or v.aval.shape[a] != size:
            return None
        axes.append(a)
    return tuple(axes)


def count(frontier, axes: tuple[int, ...] | None) -> int:
    """The number of basis cotangents: the frontier's real numbers, per example where
    `axes` is given."""
    total = _jaxpr.frontier_size(frontier)
    if axes is None:
        return total
    return sum(rows(v, a) for v, a in zip(frontier, axes, strict=True))


def rows(v, axis: int | None) -> int:
    """How many basis cotangents frontier variable `v` gives (per example: its numbers
    at one example)."""
    n = _jaxpr.frontier_size([v])
    return n if axis is None else n // v.aval.shape[axis]


def seeds(values: list, axes: tuple[int, ...]) -> list:
    """The seeds of the per-example basis cotangents, stacked on a leading axis for each
    frontier value: for each value, each index `r` of one example's numbers (C order, the
    example axis left out; a complex value's real directions, then its imaginary ones),
    a unit at `r` in every example at once. The examples' rows do not mix (each example's
    frontier is reached by its own output only), so one seed gives every example its row."""
    one = [jnp.zeros(v.shape[:a] + v.shape[a + 1 :], v.dtype) for v, a in zip(values, axes, strict=True)]
    units = _site.unit_tangents(one)  # (the real basis of one example's numbers)
    return [
        jnp.broadcast_to(jnp.expand_dims(u, a + 1), (u.shape[0], *v.shape))
        for u, v, a in zip(units, values, axes, strict=True)
    ]


def coefficients(ct_z, axis: int):
    """The coefficients of a frontier variable's per-example basis cotangents: its
    cotangent `ct_z` as `(k, B)`, in the order of `seeds` (index `r` of an example's
    numbers, real parts then imaginary parts, by example)."""
    per_example = jnp.moveaxis(ct_z, axis, 0)
    flat = jnp.reshape(per_example, (per_example.shape[0], -1))
    if jnp.iscomplexobj(flat):
        flat = jnp.concatenate([jnp.real(flat), jnp.imag(flat)], axis=1)
    return flat.T


def text(k: int, axes: tuple[int, ...] | None) -> str:
    """How the plan's stages name a basis site's cotangents."""
    return f"k={k} cotangents" + (" per example" if axes is not None else "")
