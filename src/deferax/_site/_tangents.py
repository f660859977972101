"""Tangents of a pytree `x` as the forward-basis strategy indexes them: `n` counts the real
numbers of the differentiable leaves of `x` (a complex number counts as two), and unit
tangent `i` is a one at number `i` and zeros elsewhere."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np


def n_inputs(x: Any) -> int:
    """The real numbers of the differentiable leaves of `x` (complex counts twice)."""
    total = 0
    for leaf in jtu.tree_leaves(x):
        dtype = jnp.result_type(leaf)
        if jnp.issubdtype(dtype, jnp.inexact):
            size = int(np.prod(jnp.shape(leaf), dtype=int))
            total += 2 * size if jnp.issubdtype(dtype, jnp.complexfloating) else size
    return total


def unit_tangents(x: Any) -> Any:
    """The `n` unit tangents of `x`, stacked on a leading axis: for each real number of each
    differentiable leaf, a one there (a one, then `1j`, for a complex entry) and zeros
    elsewhere; integer leaves get `float0` zeros."""
    n = n_inputs(x)
    out, offset = [], 0
    for leaf in jtu.tree_leaves(x):
        dtype, shape = jnp.result_type(leaf), jnp.shape(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            out.append(np.zeros((n, *shape), jax.dtypes.float0))
            continue
        size = int(np.prod(shape, dtype=int))
        eye = jnp.eye(n, size, k=-offset, dtype=dtype)  # rows offset..offset+size-1 hold the identity
        if jnp.issubdtype(dtype, jnp.complexfloating):
            eye = eye + 1j * jnp.eye(n, size, k=-(offset + size), dtype=dtype)
            offset += 2 * size
        else:
            offset += size
        out.append(jnp.reshape(eye, (n, *shape)))
    return jtu.tree_unflatten(jtu.tree_structure(x), out)


def flatten_tangent(t_x: Any, x: Any) -> jax.Array:
    """A tangent of `x` as the real vector of length `n` that `unit_tangents` indexes."""
    parts = []
    for t, leaf in zip(jtu.tree_leaves(t_x), jtu.tree_leaves(x), strict=True):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            continue
        flat = jnp.ravel(t)
        parts += [jnp.real(flat), jnp.imag(flat)] if jnp.iscomplexobj(flat) else [flat]
    if not parts:
        return jnp.zeros((0,))
    dtype = jnp.result_type(*[jnp.real(p) for p in parts])
    return jnp.concatenate([p.astype(dtype) for p in parts])


def tangent_struct(y_struct: Any) -> Any:
    """The structure of a tangent of `y`: `float0` for integer leaves (JAX's convention)."""
    return jtu.tree_map(
        lambda s: s if jnp.issubdtype(s.dtype, jnp.inexact) else jax.ShapeDtypeStruct(s.shape, jax.dtypes.float0),
        y_struct,
    )
