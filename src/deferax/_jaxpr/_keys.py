"""Cache keys: two programs that compute the same thing get the same key."""

from __future__ import annotations

import dataclasses
import struct
import types

import equinox as eqx
import jax.tree_util as jtu
import numpy as np

from .. import _runtime
from . import _internals as _core


class _Unkeyable(Exception):
    pass


_EVALUATED = _runtime.EVALUATED


def structural_key(closed) -> tuple | None:
    """A hashable key equal for two jaxprs that compute the same thing from the same inputs:
    the same equations, parameters, literals and wiring. Constants are not part of it (see
    `open_consts`). `None` when a parameter cannot be compared by value."""
    try:
        return _jaxpr_key(closed.jaxpr)
    except _Unkeyable:
        return None


def evaluation_key(closed) -> tuple | None:
    """As `structural_key`, for a program that is only ever evaluated, never differentiated
    (a recognised `custom_vjp`'s forward and the parts of its backward): a custom rule in it
    is keyed by what it computes when evaluated, its primal, and its derivative rules (a
    Python function made anew by every trace) are left out."""
    token = _EVALUATED.set(True)
    try:
        return _jaxpr_key(closed.jaxpr)
    except _Unkeyable:
        return None
    finally:
        _EVALUATED.reset(token)


# A custom rule's parameters that say what it computes when it is evaluated (its primal).
_EVALUATED_PARAMS = {"custom_vjp_call": ("call_jaxpr", "num_consts"), "custom_jvp_call": ("call_jaxpr", "num_consts")}


def _params_key(e) -> tuple:
    params = e.params
    kept = _EVALUATED_PARAMS.get(str(e.primitive)) if _EVALUATED.get() else None
    if kept is not None:
        params = {k: params[k] for k in kept if k in params}
    return tuple(sorted((k, _jvp_rule_key(e) if k == "jvp_jaxpr_fun" else _param_key(p)) for k, p in params.items()))


def _aval_key(aval) -> tuple:
    # (the dtype object itself, hashable and compared by value: `str(dtype)` cost a third
    # of the key of a small program)
    dtype = getattr(aval, "dtype", None)
    return (
        tuple(getattr(aval, "shape", ())),
        ("type", type(aval).__name__) if dtype is None else ("dtype", dtype),
        getattr(aval, "weak_type", False),
    )


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
        (
            e.primitive,  # (a singleton: by identity, finer than its name and cheaper)
            tuple(var(v) for v in e.invars),
            tuple((var(v), _aval_key(v.aval)) for v in e.outvars),
            _params_key(e),
        )
        for e in jaxpr.eqns
    )
    return head, eqns, tuple(var(v) for v in jaxpr.outvars)


def equation_key(eqn, inputs) -> tuple | None:
    """A key equal for two equations that compute the same thing from the same `inputs`
    (variables by identity, literals by value): the same operation and parameters. `None`
    for an equation with effects, or a parameter that cannot be compared by value."""
    if eqn.effects:
        return None
    try:
        params = tuple(sorted((k, _param_key(p)) for k, p in eqn.params.items()))
        ins = tuple(
            ("lit", _value_key(v.val), _aval_key(v.aval)) if isinstance(v, _core.Literal) else v for v in inputs
        )
    except _Unkeyable:
        return None
    return str(eqn.primitive), ins, params


_IN_RULE = _runtime.IN_RULE


def _jvp_rule_key(eqn) -> tuple:
    """A `custom_jvp` rule (`jax.nn.relu`, `jax.nn.softmax`, the user's own) by what it
    computes: its program traced now, as differentiation will trace it (the trace is
    memoized on the equation, so that is the very program used). A new function object
    each trace, it would otherwise never match. With `symbolic_zeros` the rule sees which
    tangents are zero, and a trace for one pattern says nothing of another: not keyed.

    The stages differentiate the program once: a rule inside a rule's program (`relu`'s
    rule calls `relu`) is evaluated, never differentiated, so it is not keyed (keying it
    would trace it again, and its own rule, without end)."""
    if _IN_RULE.get():
        return ("rule inside a rule",)
    if eqn.params.get("symbolic_zeros", True):
        raise _Unkeyable
    try:
        jaxpr, consts, out_zeros = eqn.params["jvp_jaxpr_fun"].call_wrapped(*([False] * len(eqn.invars)))
    except Exception:  # (another JAX's internals: nothing to key on)
        raise _Unkeyable from None
    if any(isinstance(c, _core.Tracer) for c in consts):
        raise _Unkeyable
    token = _IN_RULE.set(True)
    try:
        return ("jvp rule", _jaxpr_key(jaxpr), tuple(_value_key(c) for c in consts), tuple(out_zeros))
    finally:
        _IN_RULE.reset(token)


def _value_key(value) -> tuple:
    """By type and exact bits: `-0.0` differs from `0.0`, `1` from `True`."""
    kind = type(value)
    if kind is bool or kind is int:
        return (kind.__name__, value)
    if kind is float:
        return ("float", struct.pack("<d", value))
    try:
        a = np.asarray(value)
    except TypeError:  # an extended dtype (a PRNG key) has no bytes to compare
        raise _Unkeyable from None
    return (type(value).__name__, str(a.dtype), a.shape, a.tobytes())


# Parameter types keyed by value as they are (hashable, immutable): the common ones,
# answered before the checks below.
_PLAIN = (str, type(None), types.FunctionType, types.BuiltinFunctionType, jtu.PyTreeDef)


def _param_key(p):
    kind = type(p)
    if kind in _PLAIN:
        return (kind, p)
    if kind is bool or kind is int or kind is float:
        return _value_key(p)
    if kind is tuple:
        return ("tuple", tuple(_param_key(q) for q in p))
    if isinstance(p, np.dtype):
        return (kind, p)
    if _core.is_jaxpr(p):
        jaxpr, consts = _core.open_and_consts(p)
        return ("jaxpr", _jaxpr_key(jaxpr), tuple(_value_key(c) for c in consts))
    if isinstance(p, tuple | list):
        return (type(p).__name__, tuple(_param_key(q) for q in p))
    if isinstance(p, dict):
        return ("dict", tuple(sorted((k, _param_key(v)) for k, v in p.items())))
    if isinstance(p, bool | int | float | complex | np.generic | np.ndarray):
        return _value_key(p)
    rule = _core.custom_vmap_rule(p)
    if rule is not None:  # (a `custom_vmap`'s rule, by the function it wraps: `dx.sparse_solve` inside the program)
        return ("custom_vmap rule", _param_key(rule))
    if isinstance(p, _core.Tracer | _core.WrappedFun):
        # (a wrapped function, a `custom_vjp`'s backward rule, is made anew by every trace:
        # keyed by identity, it would never match again and only fill the cache)
        raise _Unkeyable
    frozen = dataclasses.is_dataclass(p) and not isinstance(p, type) and p.__dataclass_params__.frozen  # pyright: ignore[reportAttributeAccessIssue]  (set by @dataclass; typeshed omits it)
    if frozen and _compares_itself(kind):
        # (its own `__eq__` and `__hash__`, as `dx.SparsePattern`'s, which keeps read-only
        # copies of its index arrays and a hash made once: by itself, as any hashable
        # parameter below, not by the bytes of its fields on every call)
        return (kind, p)
    if isinstance(p, eqx.Module) or frozen:
        # field by field (an `ExpensiveFn` and its Module implementations are immutable
        # dataclasses): a number among them by its bits, as a literal, where `==` would take
        # 0.0 for -0.0 and 1 for True. (A mutable one can change after its program is
        # cached: by identity below, or not keyed at all.)
        # (read as stored: `eqx.Module.__getattribute__` only wraps a method bound to `p`)
        return (
            "dataclass",
            type(p),
            tuple((n, _param_key(object.__getattribute__(p, n))) for n in _field_names(type(p))),
        )
    try:
        hash(p)
    except TypeError:
        raise _Unkeyable from None
    return (type(p), p)


@_runtime.cached(maxsize=None)
def _compares_itself(cls: type) -> bool:
    """Whether the frozen dataclass `cls` compares and hashes by its own methods, not those
    `dataclasses` writes from its fields (declared with `eq=False`)."""
    return (
        not cls.__dataclass_params__.eq  # pyright: ignore[reportAttributeAccessIssue]
        and cls.__eq__ is not object.__eq__
        and cls.__hash__ not in (None, object.__hash__)
    )


@_runtime.cached(maxsize=None)
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))
