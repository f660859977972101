"""A custom rule run outside the trace that made it, as the stages run it: whether it can
be (`differentiable_alone`, which `_dependence.check_rules` asks of each rule), and a
`custom_vjp`'s backward rule replayed from one run, so that its Python runs once.

JAX calls a `custom_vjp`'s backward rule, a Python function, each time it differentiates
the call, and plain JAX differentiates a program once: the rule's Python runs once a call
eagerly, once a trace under `jit`. deferax differentiates a call more than once: alone, on
abstract values, to find whether it can run outside the trace that made it, before the
stages differentiate the program (stage 3, and the analysis's backward pass where a site's
cotangent goes through the call). A rule with a side effect in its Python (a counter, a log,
a file) would see each run.

So the first run is kept: the call's backward rule is replaced by a `Replayed` one, which
traces the user's rule at its first call under a trace, for the arguments it is called with,
and evaluates that program in its place at every later call with arguments of the same kinds.
Called with other kinds (another pattern of perturbed inputs, which changes the residuals; a
symbolic zero where an array was), or eagerly before any trace, it calls the rule itself, as
JAX would. The rule then runs once, on abstract values, as the forward rule does (JAX keeps
the forward's trace on the equation), and the program evaluated in its place gives what
running it again would: JAX assumes as much of every rule under `jit`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .. import _runtime
from . import _internals as _core


def differentiable_alone(eqn, perturbed: Sequence[bool], read: Sequence[bool]) -> tuple[bool, Replayed | None]:
    """`(alone, replayed)`: whether the rule `eqn` runs outside the trace that made it, with
    its explicit inputs `perturbed` and its outputs `read`, and the backward rule replayed
    from the run that found it so (None where none ran).

    Cheaply where a rule's trace is memoized on the equation (differentiation reuses it): a
    `custom_jvp` rule, a `custom_vjp`'s forward rule (traced for the inputs `perturbed`, as
    stage 3 traces it) take what they close over as constants. A `custom_vjp`'s backward rule
    by differentiating the equation in a fresh trace, once for a backward function seen to run
    alone before (the same function object holds the same values; one defined in the loss is
    new every trace, and checked every time)."""
    params = eqn.params
    # The closed-over constants come first among the operands. They are held fixed: JAX
    # differentiates a custom_vjp with respect to its explicit inputs only (and refuses the
    # constants), as the stages do (a constant reaching the call from a differentiated input
    # is refused there by JAX as it is under Equinox).
    held = params.get("num_consts", 0)
    try:
        if "jvp_jaxpr_fun" in params:
            _, consts, _ = params["jvp_jaxpr_fun"].call_wrapped(*([False] * len(eqn.invars)))
            return not any(_stale(c) for c in consts), None
        if "fwd_jaxpr_thunk" in params:
            _, consts = params["fwd_jaxpr_thunk"].call_wrapped(*perturbed)
            if any(_stale(c) for c in consts):
                return False, None
            if not any(read):  # (no cotangent reaches the backward rule: JAX never calls it)
                return True, None
    except Exception:  # noqa: BLE001 - whatever it raises here, it would raise in the stages
        return False, None
    backward = getattr(params.get("bwd"), "f", None)
    with contextlib.suppress(TypeError):  # (not every callable can be weakly referenced)
        if backward in _ALONE:
            return True, None
    replayed = Replayed(params["bwd"])
    checked = _with_rule(eqn, replayed)

    def pullback(*args):
        consts, explicit = args[:held], args[held:]
        varied = [a for a, p in zip(explicit, perturbed, strict=True) if p]

        def call(*varied_):
            it = iter(varied_)
            full = [next(it) if p else a for a, p in zip(explicit, perturbed, strict=True)]
            return _core.bind_equation(checked, (*consts, *full))

        # (an output the value does not read gets a symbolic zero cotangent, as from JAX)
        outs, vjp = jax.vjp(lambda *a: [o for o, r in zip(call(*a), read, strict=True) if r], *varied)
        return vjp([_core.zero_like(o) for o in outs])

    # (a `jax.Ref` by its abstract value: a struct would make it an array)
    structs = [
        v.aval if isinstance(v.aval, _core.AbstractRef) else _core.struct_of(v.aval, keep_weak_type=True)
        for v in eqn.invars
    ]
    try:
        closed = jax.make_jaxpr(pullback)(*structs)
    except Exception:  # noqa: BLE001 - whatever it raises there, it would raise in the stages
        return False, None
    # (a tracer of an ended trace may also be taken in as a constant, to fail when run)
    if any(_stale(c) for c in closed.consts):
        return False, None
    with contextlib.suppress(TypeError):
        _ALONE[backward] = True
    return True, replayed


_ALONE = _runtime.REPLAY_ALONE


def _stale(value) -> bool:
    """A tracer of a trace that has ended."""
    return isinstance(value, _core.Tracer) and _core.has_ended(value)


# ----------------------------------------------------------------------------- a backward rule replayed

_NUMBERS = (bool, int, float, complex)
_ARRAY = object()  # (where an array of the rule's result goes, among the leaves kept as they are)


def _kind(value) -> tuple | None:
    """What an argument of the rule must be for a trace of the rule to stand for the call: an
    array by its type (its weak type aside: the program is evaluated on it, not traced), a
    `float0` array by its shape (it holds nothing), a Python number or a symbolic zero by
    itself. None for anything else: the rule itself is called."""
    if isinstance(value, _NUMBERS):
        return ("number", type(value), value)
    if isinstance(value, _core.Zero | _core.SymbolicZero):
        return ("zero", type(value), value.aval)
    if isinstance(value, jax.Array | np.ndarray | np.generic):
        aval = jax.typeof(value)
        if aval.dtype == jax.dtypes.float0:
            return ("float0", aval.shape)
        return ("array", aval.update(weak_type=False))
    return None


def _is_array(leaf) -> bool:
    """A leaf of the rule's result that the trace computes (a `float0` array holds nothing)."""
    return isinstance(leaf, jax.Array | np.ndarray | np.generic) and leaf.dtype != jax.dtypes.float0


@dataclasses.dataclass(frozen=True)
class _Traced:
    """The rule traced for one kind of call: `program` takes the array arguments and returns
    the array leaves of the result; `leaves` are the result's leaves with `_ARRAY` in their
    places (the others, a `Zero` for an input with no cotangent, kept as they are), `tree`
    its structure."""

    program: Any
    leaves: list
    tree: Any

    def __call__(self, args: tuple, kinds: tuple) -> Any:
        arrays = iter(_core.evaluate(self.program, [a for a, k in zip(args, kinds, strict=True) if k[0] == "array"]))
        return jax.tree.unflatten(self.tree, [next(arrays) if leaf is _ARRAY else leaf for leaf in self.leaves])


def _trace(rule, args: tuple, kinds: tuple) -> _Traced | None:
    """`rule` (JAX's `WrappedFun`) traced on the types of the array arguments `args`, the
    others given as they are; None where a `jax.ShapeDtypeStruct` cannot say an array's type
    (sharded, or varying along a `shard_map`'s axes)."""
    types = [k[1] for k in kinds if k[0] == "array"]
    structs = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in types]
    if any(_core.shaped(s) != t for s, t in zip(structs, types, strict=True)):
        return None
    found: dict = {}

    def call(*arrays):
        given = iter(arrays)
        full = [
            next(given) if k[0] == "array" else np.zeros(k[1], jax.dtypes.float0) if k[0] == "float0" else a
            for a, k in zip(args, kinds, strict=True)
        ]
        leaves, found["tree"] = jax.tree.flatten(rule.call_wrapped(*full))
        found["leaves"] = [_ARRAY if _is_array(leaf) else leaf for leaf in leaves]
        return [leaf for leaf in leaves if _is_array(leaf)]

    program = jax.make_jaxpr(call)(*structs)
    return _Traced(program, found["leaves"], found["tree"])


class Replayed:
    """A `custom_vjp_call`'s backward rule `rule` (JAX's `WrappedFun`), traced at its first
    call under a trace and evaluated from that trace at every later call with arguments of
    the same kinds; the rule itself where there is no such trace."""

    def __init__(self, rule):
        self.rule = rule
        self.traced: dict[tuple, _Traced | None] = {}

    def __call__(self, *args):
        kinds = tuple(_kind(a) for a in args)
        if any(k is None for k in kinds):
            return self.rule.call_wrapped(*args)
        if kinds not in self.traced:
            if not any(isinstance(a, _core.Tracer) for a in args):  # (eagerly, with nothing traced: as JAX)
                return self.rule.call_wrapped(*args)
            self.traced[kinds] = _trace(self.rule, args, kinds)
        traced = self.traced[kinds]
        return self.rule.call_wrapped(*args) if traced is None else traced(args, kinds)


def _with_rule(eqn, rule: Replayed):
    """The `custom_vjp_call` equation `eqn` with the backward rule `rule`."""
    return eqn.replace(params={**eqn.params, "bwd": _core.rule_like(rule, rule.rule)})


def replaying(closed, rules: dict[int, Replayed]):
    """`closed` with each `custom_vjp_call` equation whose `id` is a key of `rules` (at any
    depth) given the backward rule there; `closed` itself where `rules` is empty."""
    if not rules:
        return closed
    done: dict[int, Any] = {}  # (a program met twice, as a `jit` body called twice, is rebuilt once)

    def rebuild(jaxpr):
        if id(jaxpr) not in done:
            eqns = []
            for eqn in jaxpr.eqns:
                params = _core.with_jaxprs(eqn.params, rebuild)
                new = eqn if all(params[k] is p for k, p in eqn.params.items()) else eqn.replace(params=params)
                eqns.append(_with_rule(new, rules[id(eqn)]) if id(eqn) in rules else new)
            same = all(a is b for a, b in zip(eqns, jaxpr.eqns, strict=True))
            done[id(jaxpr)] = jaxpr if same else jaxpr.replace(eqns=eqns)
        return done[id(jaxpr)]

    jaxpr, consts = _core.open_and_consts(closed)
    new = rebuild(jaxpr)
    return closed if new is jaxpr else _core.close(new, consts)
