"""Defining a primitive and the helpers its rules need."""

from __future__ import annotations

import jax
import numpy as np

from . import _internals as _core


def define_primitive(name, *, impl, abstract_eval, jvp=None, batch=None, transpose=None):
    """A JAX primitive with multiple results and the rules given.

    `impl(*args, **params)` runs it on concrete arrays, and is traced to lower it into a
    compiled program; `abstract_eval(*avals, **params)` returns the output avals; `jvp(primals, tangents, \
**params)`, `batch(args,
    dims, **params)` and `transpose(cts, *args, **params)` follow JAX's conventions.
    """
    from jax.interpreters import ad, batching, mlir

    p = _core.Primitive(name)
    p.multiple_results = True
    p.def_impl(impl)
    p.def_abstract_eval(abstract_eval)
    mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=True))
    if jvp is not None:
        ad.primitive_jvps[p] = jvp
    if batch is not None:
        batching.primitive_batchers[p] = batch
    if transpose is not None:
        ad.primitive_transposes[p] = transpose
    return p


def is_zero(t) -> bool:
    """A symbolic zero tangent or cotangent."""
    return type(t) is _core.Zero


def instantiate(t, aval):
    """A symbolic zero as an array of zeros; anything else unchanged."""
    if type(t) is _core.Zero:
        if aval.dtype == jax.dtypes.float0:
            return np.zeros(aval.shape, jax.dtypes.float0)
        return jax.numpy.zeros(aval.shape, aval.dtype)
    return t


def zero_tangent(aval):
    """A symbolic zero tangent for a value of type `aval`."""
    return _core.Zero(aval.to_tangent_aval())


def shaped(struct):
    """The aval of a `jax.ShapeDtypeStruct`."""
    return _core.ShapedArray(struct.shape, struct.dtype, weak_type=getattr(struct, "weak_type", False))


def is_not_mapped(dim) -> bool:
    """In a batching rule: whether an operand has no batch dimension."""
    return dim is None


def move_to_front(x, dim):
    """Move a batch dimension to axis 0 (a no-op when already there)."""
    return jax.numpy.moveaxis(x, dim, 0)


def is_primitive(obj: object) -> bool:
    """Whether `obj` is a JAX primitive (what an equation binds)."""
    return isinstance(obj, _core.Primitive)
