"""Which axis of a value indexes the examples of a batch: the per-example structure of a
program in one of its inputs.

A variable `v` is *batched at axis `a`* in a source input `y` batched at its axis `a_y` when
`v[..., b, ...]` (index `b` on axis `a`) depends on `y` only through `y[b]` (index `b` on
axis `a_y`): what `jax.vmap` of a function of one example would compute. The analysis is
syntactic and conservative: an operation it does not know, or one that mixes the examples
(a sum over the batch axis, a slice of it, a gather), makes its outputs `MIXED`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import _internals as _core
from ._dependence import _inner_jaxpr

MIXED = "mixed"  # depends on the source, not example by example

# Operations on operands of one shape, elementwise (the jaxpr makes every broadcast explicit;
# constants, frozen: no state).
_ELEMENTWISE = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "mul",
        "div",
        "neg",
        "max",
        "min",
        "abs",
        "sign",
        "exp",
        "exp2",
        "log",
        "log1p",
        "expm1",
        "sin",
        "cos",
        "tan",
        "tanh",
        "logistic",
        "sqrt",
        "rsqrt",
        "square",
        "integer_pow",
        "pow",
        "real",
        "imag",
        "conj",
        "complex",
        "convert_element_type",
        "copy",
        "copy_p",
        "reduce_precision",
        "select_n",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "is_finite",
        "stop_gradient",
    }
)
# Reductions over `axes`, scans along `axis`.
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"})
_ALONG_AXIS = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})


def example_axes(closed, axes: Sequence[int | None]) -> dict:
    """For each variable of the top-level jaxpr of `closed` that depends on the inputs with
    an axis in `axes` (None: not a source), its batch axis, or `MIXED`. Variables free of
    every source are absent."""
    jaxpr = getattr(closed, "jaxpr", closed)
    return _propagate(jaxpr, list(axes))


def _propagate(jaxpr, axes: list) -> dict:
    env: dict = {v: a for v, a in zip(jaxpr.invars, axes, strict=True) if a is not None}
    for eqn in jaxpr.eqns:
        ins = [None if isinstance(v, _core.Literal) else env.get(v) for v in eqn.invars]
        if all(a is None for a in ins):
            continue
        outs = _rule(eqn, ins)
        for v, a in zip(eqn.outvars, outs, strict=True):
            if a is not None:
                env[v] = a
    return env


def _rule(eqn, ins: list) -> list:
    """The outputs' axes from the inputs' (at least one input depends on a source)."""
    n_out = len(eqn.outvars)
    if MIXED in ins:
        return [MIXED] * n_out
    name, params = str(eqn.primitive), eqn.params
    shapes = [getattr(v.aval, "shape", ()) for v in eqn.invars]
    axis = _one_axis(ins)
    if name in _ELEMENTWISE:
        out_shape = eqn.outvars[0].aval.shape
        if axis is None or any(a is not None and s != out_shape for a, s in zip(ins, shapes, strict=True)):
            return [MIXED] * n_out
        return [axis] * n_out
    inner = _inner_jaxpr(eqn)
    if inner is not None and len(inner.invars) == len(ins) and len(inner.outvars) == n_out:
        env = _propagate(inner, ins)
        return [None if isinstance(v, _core.Literal) else env.get(v) for v in inner.outvars]
    if axis is None or n_out != 1:
        return [MIXED] * n_out
    out = _single(name, params, ins, shapes, axis, eqn)
    return [MIXED if out is None else out]


def _one_axis(ins: list) -> int | None:
    """The one batch axis of the inputs that depend on a source, or None if they differ."""
    found = {a for a in ins if a is not None}
    return found.pop() if len(found) == 1 else None


def _single(name: str, params: Any, ins: list, shapes: list, axis: int, eqn) -> int | None:
    """The output's axis of a one-output operation whose source-dependent inputs share
    `axis`; None where the examples mix (or the operation is not known)."""
    if name == "broadcast_in_dim":
        return int(params["broadcast_dimensions"][axis])
    if name == "transpose":
        return list(params["permutation"]).index(axis)
    if name in _REDUCTIONS:
        reduced = [int(a) for a in params["axes"]]
        return None if axis in reduced else axis - sum(a < axis for a in reduced)
    if name == "squeeze":
        dims = [int(d) for d in params["dimensions"]]
        return None if axis in dims else axis - sum(d < axis for d in dims)
    if name in _ALONG_AXIS or name == "concatenate":
        along = params["axis"] if name in _ALONG_AXIS else params["dimension"]
        if name == "concatenate" and any(a is None for a in ins):
            return None
        return None if int(along) == axis else axis
    if name == "slice":
        start, limit = params["start_indices"][axis], params["limit_indices"][axis]
        strides = params["strides"]
        whole = start == 0 and limit == shapes[0][axis] and (strides is None or strides[axis] == 1)
        return axis if whole else None
    if name == "pad":
        low, high, interior = params["padding_config"][axis]
        return axis if ins[1] is None and (low, high, interior) == (0, 0, 0) else None
    if name == "reshape":
        return _reshaped(shapes[0], tuple(params["new_sizes"]), axis) if params.get("dimensions") is None else None
    if name == "dot_general":
        return _dot_general(params["dimension_numbers"], ins, shapes)
    return None


def _reshaped(shape: tuple, new: tuple, axis: int) -> int | None:
    """Where `axis` of `shape` lands in `new`, if it stays one axis there."""
    before = 1
    for d in shape[:axis]:
        before *= d
    running = 1
    for j, d in enumerate(new):
        if running == before and d == shape[axis]:
            return j
        running *= d
    return None


def _dot_general(dimension_numbers, ins: list, shapes: list) -> int | None:
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (tuple(int(a) for a in t) for t in (lc, rc, lb, rb))
    left, right = ins
    n_left_free = len(shapes[0]) - len(lc) - len(lb)
    if left is not None and right is not None:  # both: the examples only on a shared batch dimension
        if left in lb and right in rb and lb.index(left) == rb.index(right):
            return lb.index(left)
        return None
    if left is not None:
        if left in lc:
            return None
        if left in lb:
            return lb.index(left)
        free = [d for d in range(len(shapes[0])) if d not in lc and d not in lb]
        return len(lb) + free.index(left)
    if right is None or right in rc:
        return None
    if right in rb:
        return rb.index(right)
    free = [d for d in range(len(shapes[1])) if d not in rc and d not in rb]
    return len(lb) + n_left_free + free.index(right)
