"""Small helpers used across the package: structures of values and their text, zeros, stacking."""

from __future__ import annotations

from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree


def is_concrete(tree: PyTree) -> bool:
    """True when no leaf is a tracer: the arrays are values, not part of a trace."""
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in jtu.tree_leaves(tree))


def struct_of(a: Any, *, keep_weak_type: bool = False) -> jax.ShapeDtypeStruct:
    """The `jax.ShapeDtypeStruct` of one array (or array-like, or abstract value); with
    `keep_weak_type`, weakly typed as `a` is (a Python scalar promoted by JAX)."""
    weak = keep_weak_type and bool(getattr(a, "weak_type", False))
    return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a), weak_type=weak)


def structs(tree: PyTree) -> PyTree[jax.ShapeDtypeStruct]:
    """The `jax.ShapeDtypeStruct` of every leaf of `tree`."""
    return jtu.tree_map(struct_of, tree)


def stacked(struct: PyTree[jax.ShapeDtypeStruct], k: int) -> PyTree[jax.ShapeDtypeStruct]:
    """`struct` with a leading axis of length `k` on every leaf (`k` of them, stacked)."""
    return jtu.tree_map(lambda s: jax.ShapeDtypeStruct((k, *s.shape), s.dtype), struct)


def zeros(struct: PyTree[jax.ShapeDtypeStruct]) -> PyTree:
    """JAX zeros shaped like `struct`."""
    return jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), struct)


def zero_like(a: Any) -> Any:
    """A zero tangent (or cotangent) for `a`: zeros of its dtype, `float0` for an integer."""
    if jnp.issubdtype(jnp.result_type(a), jnp.inexact):
        return jnp.zeros(jnp.shape(a), jnp.result_type(a))
    return np.zeros(jnp.shape(a), jax.dtypes.float0)


def is_inexact(a: Any) -> bool:
    """Whether `a` (an array, a structure or an abstract value) is floating-point or complex: differentiable."""
    return bool(jnp.issubdtype(jnp.result_type(a), jnp.inexact))


def shape_text(a: Any) -> str:
    """`float64[3, 4]` for an array or a `jax.ShapeDtypeStruct` (`key<fry>[]` for a typed PRNG key)."""
    dtype = a.dtype if jnp.issubdtype(a.dtype, jax.dtypes.extended) else np.dtype(a.dtype)
    return f"{dtype.name}{list(a.shape)}"
