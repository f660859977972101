"""Cache keys: two programs that compute the same thing get the same key."""

from __future__ import annotations

import numpy as np
from jax._src import core as _core


class _Unkeyable(Exception):
    pass


def structural_key(closed) -> tuple | None:
    """A hashable key equal for two jaxprs that compute the same thing from the same inputs:
    the same equations, parameters, literals and wiring. Constants are not part of it (see
    `open_consts`). `None` when a parameter cannot be compared by value."""
    try:
        return _jaxpr_key(closed.jaxpr)
    except _Unkeyable:
        return None


def _aval_key(aval) -> tuple:
    return (tuple(getattr(aval, "shape", ())), str(getattr(aval, "dtype", type(aval).__name__)), getattr(aval, "weak_type", False))


def _jaxpr_key(jaxpr) -> tuple:
    ids: dict = {}

    def var(v):
        if isinstance(v, _core.Literal):
            return ("lit", _value_key(v.val), _aval_key(v.aval))
        if v not in ids:
            ids[v] = len(ids)
        return ids[v]

    head = (tuple(var(v) for v in jaxpr.constvars), tuple((var(v), _aval_key(v.aval)) for v in jaxpr.invars))
    eqns = tuple(
        (str(e.primitive), tuple(var(v) for v in e.invars), tuple((var(v), _aval_key(v.aval)) for v in e.outvars),
         tuple(sorted((k, _param_key(p)) for k, p in e.params.items())))
        for e in jaxpr.eqns
    )  # fmt: skip
    return head, eqns, tuple(var(v) for v in jaxpr.outvars)


def _value_key(value) -> tuple:
    """By type and exact bits: `-0.0` differs from `0.0`, `1` from `True`."""
    a = np.asarray(value)
    return (type(value).__name__, str(a.dtype), a.shape, a.tobytes())


def _param_key(p):
    if isinstance(p, _core.ClosedJaxpr):
        return ("closed", _jaxpr_key(p.jaxpr), tuple(_value_key(np.asarray(c)) for c in p.consts))
    if isinstance(p, _core.Jaxpr):
        return ("jaxpr", _jaxpr_key(p))
    if isinstance(p, tuple | list):
        return (type(p).__name__, tuple(_param_key(q) for q in p))
    if isinstance(p, dict):
        return ("dict", tuple(sorted((k, _param_key(v)) for k, v in p.items())))
    if isinstance(p, bool | int | float | complex | np.generic | np.ndarray):
        return _value_key(p)
    if isinstance(p, _core.Tracer):
        raise _Unkeyable
    try:
        hash(p)
    except TypeError:
        raise _Unkeyable from None
    return (type(p), p)
