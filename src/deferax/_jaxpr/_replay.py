"""What cannot be replayed: custom rules bound to the trace that made them, and effects
that must happen once a call.

The stages evaluate the traced program again, in other traces (stage 1's backward pass,
stage 3 under `jax.vjp`). A `custom_vjp` or `custom_jvp` rule is kept in the program as a
Python function, called only when the program is differentiated; one that closes over a
value computed in the traced function (`scale = stop_gradient(cos(x))`, then a backward
rule returning `ct * scale`) holds a tracer of a trace that has ended, and fails there.
And what stage 1 evaluates, stage 3 evaluates again: an `io_callback` would run twice
(and stage 1's draw is not the one the value sees), a write to a `jax.Ref` from outside
would happen twice.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np

from .. import _runtime
from . import _internals as _core
from ._dependence import Location, _location, is_ref, written
from ._program import bind_equation

_RULES = {"custom_vjp_call": "custom_vjp", "custom_vjp_call_jaxpr": "custom_vjp", "custom_jvp_call": "custom_jvp"}


def stranded_rule(closed) -> tuple[str, Location] | None:
    """The first custom rule of `closed` (at any depth) that cannot be differentiated
    outside the trace that made it, as `(kind, location)`; `None` when there is none.

    Each rule is differentiated on abstract values in a fresh trace, as the stages would
    differentiate it: a rule holding a tracer of an ended trace fails there, or takes it in
    as a constant (one holding a value of an enclosing `jit`, still tracing, is fine)."""
    for eqn in _equations(closed.jaxpr):
        kind = _RULES.get(str(eqn.primitive))
        if kind is not None and not _differentiable_alone(eqn):
            return kind, _location(eqn)
    return None


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _core.jaxprs_in_params(eqn.params):
            yield from _equations(sub)


def _cotangent(aval):
    if jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact):
        return jax.numpy.zeros(aval.shape, aval.dtype)
    return np.zeros(aval.shape, jax.dtypes.float0)


def _differentiable_alone(eqn) -> bool:
    """Cheaply where a rule's trace is memoized on the equation (differentiation reuses it):
    a `custom_jvp` rule, a `custom_vjp`'s forward rule (traced as when every input has a
    tangent) take what they close over as constants. A `custom_vjp`'s backward rule by
    differentiating the equation in a fresh trace, once for a backward function seen to run
    alone before (the same function object holds the same values; one defined in the loss
    is new every trace, and checked every time)."""
    params = eqn.params
    try:
        if "jvp_jaxpr_fun" in params:
            _, consts, _ = params["jvp_jaxpr_fun"].call_wrapped(*([False] * len(eqn.invars)))
            return not any(_stale(c) for c in consts)
        if "fwd_jaxpr_thunk" in params:
            _, consts = params["fwd_jaxpr_thunk"].call_wrapped(
                *([True] * (len(eqn.invars) - params.get("num_consts", 0)))
            )
            if any(_stale(c) for c in consts):
                return False
    except Exception:  # noqa: BLE001 - whatever it raises here, it would raise in the stages
        return False
    backward = getattr(params.get("bwd"), "f", None)
    with contextlib.suppress(TypeError):  # (not every callable can be weakly referenced)
        if backward in _ALONE:
            return True

    # The closed-over constants come first among the operands. They are held fixed: JAX
    # differentiates a custom_vjp with respect to its explicit inputs only (and refuses the
    # constants), as the stages do (a constant reaching the call from a differentiated input
    # is refused there by JAX as it is under Equinox).
    held = params.get("num_consts", 0)

    def pullback(*args):
        consts = args[:held]
        outs, vjp = jax.vjp(lambda *a: bind_equation(eqn, (*consts, *a)), *args[held:])
        return vjp([_cotangent(jax.typeof(o)) for o in outs])

    structs = [
        v.aval if is_ref(v) else jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
        for v in eqn.invars
    ]
    try:
        closed = jax.make_jaxpr(pullback)(*structs)
    except Exception:  # noqa: BLE001 - whatever it raises there, it would raise in the stages
        return False
    # (a tracer of an ended trace may also be taken in as a constant, to fail when run)
    if any(_stale(c) for c in closed.consts):
        return False
    with contextlib.suppress(TypeError):
        _ALONE[backward] = True
    return True


_ALONE = _runtime.REPLAY_ALONE


def _stale(value) -> bool:
    """A tracer of a trace that has ended."""
    return isinstance(value, _core.Tracer) and _core.has_ended(value)


def _effect_of(eqn):
    """The innermost equation of `eqn` (itself, or one in its nested jaxprs) that makes an
    effect that must happen once."""
    for sub in _core.jaxprs_in_params(eqn.params):
        for inner in sub.eqns:
            if any(_core.must_happen_once(e) for e in inner.effects):
                return _effect_of(inner)
    return eqn


def once_only(closed, flags) -> tuple[str, Location] | None:
    """The first top-level equation flagged in `flags` with an effect that must happen once
    a call, as `(what, location)`: `"effect"` for an `io_callback` or an ordered effect
    (named by the innermost operation that makes it), `"ref"` for a write to a `jax.Ref`
    that the program gets from outside (an input or a constant)."""
    jaxpr = closed.jaxpr
    outside = {v for v in [*jaxpr.constvars, *jaxpr.invars] if is_ref(v)}
    for eqn, flag in zip(jaxpr.eqns, flags, strict=True):
        if not flag:
            continue
        if any(_core.must_happen_once(e) for e in eqn.effects):
            return "effect", _location(_effect_of(eqn))
        if outside.intersection(written(eqn)):
            return "ref", _location(eqn)
    return None
