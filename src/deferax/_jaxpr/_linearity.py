"""Where a program stops being linear in an input: the linear frontier."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from . import _internals as _core
from ._dependence import Location, _inner_jaxpr, _location, written

# Operations that are linear in their (single) data operand and need no coefficient.
_LINEAR_UNARY = {
    "neg",
    "reshape",
    "transpose",
    "squeeze",
    "expand_dims",
    "broadcast_in_dim",
    "reduce_sum",
    "slice",
    "rev",
    "real",
    "imag",
    "conj",
    "convert_element_type",
    "copy",
    "copy_p",
    "fft",
    "cumsum",
    "reduce_precision",
}
# Sums of data operands (every operand may be linear).
_ADDITIVE = {"add", "sub", "add_any", "concatenate", "complex"}
# Products: linear when exactly one operand depends on the source and the other is free
# of every source (a coefficient).
_PRODUCT = {"mul", "dot_general"}
# Linear in the first operand, with the others as free indices or coefficients.
_LINEAR_FIRST = {"div", "dynamic_slice", "gather", "pad"}

CONST, LINEAR, NONLINEAR = 0, 1, 2


def _classify(eqn, classes: list[int], free: list[bool]) -> list[int]:
    """Linearity class of each output of `eqn`, from its inputs' classes.

    `classes[i]` says how input `i` depends on the source (not at all, linearly with a
    coefficient free of every source, or otherwise); `free[i]` whether it depends on no
    source at all (the chosen one or any other).
    """
    name = str(eqn.primitive)
    n_out = len(eqn.outvars)
    if max(classes, default=CONST) == CONST:
        return [CONST] * n_out
    if NONLINEAR in classes:
        return [NONLINEAR] * n_out
    if not all(jax.numpy.issubdtype(v.aval.dtype, jax.numpy.inexact) for v in eqn.outvars):
        return [NONLINEAR] * n_out
    inner = _inner_jaxpr(eqn)
    if inner is not None and len(inner.invars) == len(classes):
        return _linearity(inner, classes, free)[0]
    if name in _ADDITIVE:
        return [LINEAR] * n_out
    if name in _LINEAR_UNARY:
        return [LINEAR if len(classes) == 1 else NONLINEAR] * n_out
    if name in _PRODUCT and len(classes) == 2:
        ok = (classes[0] == LINEAR and free[1]) or (classes[1] == LINEAR and free[0])
        return [LINEAR if ok else NONLINEAR] * n_out
    if name == "select_n":
        ok = free[0] and all(c in (CONST, LINEAR) for c in classes[1:])
        return [LINEAR if ok else NONLINEAR] * n_out
    if name in _LINEAR_FIRST:
        ok = classes[0] == LINEAR and all(f for f in free[1:])
        return [LINEAR if ok else NONLINEAR] * n_out
    return [NONLINEAR] * n_out


def _linearity(jaxpr, in_classes, in_free):
    """The classes of the outputs, the frontier variables (with repeats), and the equations
    that take them (where the program stops being linear)."""
    cls: dict = dict(zip(jaxpr.invars, in_classes, strict=True))
    fr: dict = dict(zip(jaxpr.invars, in_free, strict=True))
    frontier: list = []
    uses: list = []

    def read(v, table, default):
        return default if isinstance(v, _core.Literal) else table.get(v, default)

    for eqn in jaxpr.eqns:
        classes = [read(v, cls, CONST) for v in eqn.invars]
        free = [read(v, fr, True) for v in eqn.invars]
        outs = _classify(eqn, classes, free)
        if (NONLINEAR in outs or written(eqn)) and LINEAR in classes:
            frontier.extend(v for v, c in zip(eqn.invars, classes, strict=True) if c == LINEAR)
            uses.append(eqn)
        all_free = all(free)
        for v, c in zip(eqn.outvars, outs, strict=True):
            cls[v] = c
            fr[v] = all_free
        for ref in written(eqn):  # (a write is not linear in what it writes: that is on the frontier)
            cls[ref] = NONLINEAR if max(classes, default=CONST) != CONST else read(ref, cls, CONST)
            fr[ref] = all_free and read(ref, fr, True)
    frontier.extend(v for v in jaxpr.outvars if read(v, cls, CONST) == LINEAR)
    return [read(v, cls, CONST) for v in jaxpr.outvars], frontier, uses


def linear_frontier(closed, source: Sequence[bool], stand_ins: Sequence[bool]):
    """Where the program stops being linear in a source input.

    Returns the distinct variables of the top-level jaxpr that depend linearly on the inputs
    flagged in `source`, with coefficients free of every input flagged in `stand_ins`, and
    that are consumed by an operation that is not linear in them (or are outputs). The
    program's outputs depend on the source only through these variables, so the cotangent
    of the source is a combination of the fixed Jacobian rows of these variables. They
    never hold more numbers than the source: where they would, the source inputs are
    returned instead.
    """
    jaxpr = closed.jaxpr
    _, frontier, _ = _linearity(jaxpr, *_start(source, stand_ins))
    distinct = list(dict.fromkeys(frontier))
    sources = {v for v, s in zip(jaxpr.invars, source, strict=True) if s}
    # A frontier variable that the source reaches only through other frontier variables is
    # a linear function of them (say `0.3 * z` next to `z`): it adds no basis cotangent.
    found = [v for v in distinct if _reached_directly(jaxpr, sources, v, set(distinct) - {v})]
    # Views that overlap (`y[:3]` and `y[1:]`) can hold more numbers than the source: then
    # the source itself (what of it the program uses) is the frontier.
    used = {v for e in jaxpr.eqns for v in e.invars if not isinstance(v, _core.Literal)} | set(jaxpr.outvars)
    whole = [
        v for v in jaxpr.invars if v in sources and v in used and jax.numpy.issubdtype(v.aval.dtype, jax.numpy.inexact)
    ]
    return whole if frontier_size(found) > frontier_size(whole) else found


def _start(source: Sequence[bool], stand_ins: Sequence[bool]):
    return [LINEAR if s else CONST for s in source], [not t for t in stand_ins]


def nonlinear_uses(closed, source: Sequence[bool], stand_ins: Sequence[bool]) -> list[Location]:
    """Where the program stops being linear in a source input, as the user wrote it: the
    top-level operations that take a value linear in the source and are not linear in it
    (`y ** 2` is `integer_pow`, `w / y` is `div`, `log(sum(y))` is `log`), in order."""
    return [_location(eqn) for eqn in _linearity(closed.jaxpr, *_start(source, stand_ins))[2]]


def _reached_directly(jaxpr, sources, target, blockers) -> bool:
    reached = set(sources)
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, _core.Literal) and v in reached and v not in blockers for v in eqn.invars):
            reached.update([*eqn.outvars, *written(eqn)])
    return target in reached and target not in blockers


def frontier_size(variables) -> int:
    """The number of real numbers the frontier variables hold (a complex number is two)."""
    total = 0
    for v in variables:
        aval = v.aval
        n = 1
        for d in aval.shape:
            n *= d
        total += 2 * n if jax.numpy.issubdtype(aval.dtype, jax.numpy.complexfloating) else n
    return total
