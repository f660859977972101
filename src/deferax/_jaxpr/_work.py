"""How much work a program does, estimated from its equations: whether a recognised
`custom_vjp`'s forward and the part of its backward that can start early are worth
running at once (`_recognise/_custom_vjp.py`).

The unit is one operation on one element. An equation counts the larger of its input and
output sizes (an element-wise operation, a reduction, a copy); a matrix product its
multiply-adds; a convolution likewise. A loop counts its body once a trip: a `scan` its
`length`, a `while_loop` `WHILE_TRIPS` (its trip count is not known from the program). A
`cond` counts its costliest branch. A host callback or a foreign function counts as
infinite: what it does cannot be read, and the caller decides.
"""

from __future__ import annotations

import math

from . import _internals as _core
from ._dependence import _OPAQUE  # (primitives whose body cannot be read)

WHILE_TRIPS = 100  # the trips a `while_loop` is assumed to make


def work(closed) -> float:
    """The estimated operations of `closed` (a program, open or closed)."""
    jaxpr, _ = _core.open_and_consts(closed)
    return float(sum(_equation(e) for e in jaxpr.eqns))


def _size(v) -> int:
    return math.prod(getattr(v.aval, "shape", ()) or (1,))


def _equation(eqn) -> float:
    name = str(eqn.primitive)
    if name in _OPAQUE:
        return math.inf
    params = eqn.params
    if name == "scan":
        return float(params["length"]) * work(params["jaxpr"])
    if name == "while":
        return WHILE_TRIPS * (work(params["cond_jaxpr"]) + work(params["body_jaxpr"]))
    if name == "cond":
        return max((work(b) for b in params["branches"]), default=0.0)
    inner = list(_core.jaxprs_in_params(params))
    if inner:  # (a call, `checkpoint`, a custom rule: its body once)
        return sum(work(sub) for sub in inner)
    if name == "dot_general":
        (contracting, _), _ = params["dimension_numbers"]
        shape = eqn.invars[0].aval.shape
        return float(_size(eqn.outvars[0]) * math.prod(shape[d] for d in contracting))
    if name == "conv_general_dilated":
        kernel = eqn.invars[1].aval.shape
        per_output = math.prod(kernel) // max(1, kernel[params["dimension_numbers"].rhs_spec[0]])
        return float(_size(eqn.outvars[0]) * per_output)
    sizes = [_size(v) for v in [*eqn.invars, *eqn.outvars] if not isinstance(v, _core.Literal)]
    return float(max(sizes, default=1))
