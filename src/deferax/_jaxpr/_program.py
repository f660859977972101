"""Tracing a function once, and reading, rewriting and interpreting the program.

Below, rewriting chosen equations of a traced program into other code (recognised calls,
`rewrite`). An equation is rewritten where it sits at the top level of the program or in a
nested `jit`/`checkpoint` (inlined first, as the sites are); anywhere else (a `scan`, `cond`
or `while` body, a custom rule) it is left as it is and reported. Its operands are handed
over as NumPy arrays where they are known at trace time (computed from constants alone,
with no effect on the way), and as `jax.ShapeDtypeStruct`s otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _internals as _core
from ._dependence import Location, _installed, _location, needed_equations
from ._keys import equation_key


def trace(fun, *structs):
    """`(closed_jaxpr, out_shape)` of `fun` on abstract arguments, traced afresh every time
    (`jax.make_jaxpr` caches traces on the function object: a fresh wrapper defeats it)."""
    return jax.make_jaxpr(lambda *a: fun(*a), return_shape=True)(*structs)


def interpret(closed, args, handlers=None, wrap=None):
    """Evaluate a closed jaxpr on flat `args` under the current trace.

    `handlers` maps an equation index to `handler(eqn, invals) -> outvals`, which replaces
    the equation; `wrap` maps a variable to `fn(value) -> value`, applied where it is made.
    """
    jaxpr = closed.jaxpr
    handlers = handlers or {}
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, _core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for v in jaxpr.invars:
        if wrap and v in wrap:
            env[v] = wrap[v](env[v])
    for i, eqn in enumerate(jaxpr.eqns):
        ins = [read(v) for v in eqn.invars]
        outs = handlers[i](eqn, ins) if i in handlers else _core.bind_equation(eqn, ins)
        if wrap:
            outs = [wrap[v](o) if v in wrap else o for v, o in zip(eqn.outvars, outs, strict=True)]
        env.update(zip(eqn.outvars, outs, strict=True))
    # (an output that is a constant of the program is an array, as `jax.jit` returns it, not
    # the literal's Python scalar: `eqx.filter_jit` would take that for static)
    return [jnp.asarray(v.val) if isinstance(v, _core.Literal) else env[v] for v in jaxpr.outvars]


def substitute(closed, eqn_indices):
    """The same program with the outputs of the equations at `eqn_indices` as extra inputs
    (after the existing ones, in order) and those equations removed. The remaining
    variables are the same objects as in `closed`."""
    jaxpr = closed.jaxpr
    chosen = set(eqn_indices)
    extra = []
    for i in eqn_indices:
        extra += [_core.Var(v.aval) if isinstance(v, _core.DropVar) else v for v in jaxpr.eqns[i].outvars]
    eqns = [e for i, e in enumerate(jaxpr.eqns) if i not in chosen]
    effects = _core.join_effects(*(e.effects for e in eqns)) if eqns else _core.no_effects
    info = jaxpr.debug_info.with_unknown_names() if jaxpr.debug_info is not None else None
    new = jaxpr.replace(invars=[*jaxpr.invars, *extra], eqns=eqns, effects=effects, debug_info=info)
    return _core.close(new, closed.consts)


def contains(eqn, primitives) -> bool:
    """Whether `eqn` is, or holds in a nested jaxpr at any depth, a primitive named in
    `primitives` (or, for a callable, one of which `primitives(primitive)` is true)."""
    if primitives(eqn.primitive) if callable(primitives) else str(eqn.primitive) in primitives:
        return True
    return any(contains(e, primitives) for sub in _core.jaxprs_in_params(eqn.params) for e in sub.eqns)


# Call-like primitives whose body can be inlined into the surrounding jaxpr: a nested
# `jit`/`eqx.filter_jit` and `jax.checkpoint` (whose rematerialisation is then decided at
# the top level). Their body runs once on the equation's inputs.
_INLINE = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
}


def inline(closed, primitives):
    """`closed` with every nested jit/checkpoint that contains one of `primitives` inlined
    (recursively), so that those primitives' equations sit at the top level (`primitives`:
    names, or a test of a primitive object, as for `contains`)."""

    def body(eqn):
        key = _INLINE.get(str(eqn.primitive))
        if key is None or key not in eqn.params or not contains(eqn, primitives):
            return None
        inner = eqn.params[key]
        return _core.open_and_consts(inner)

    if not any(body(e) is not None for e in closed.jaxpr.eqns):
        return closed

    def flatten(closed_, args):
        handlers = {}
        for i, eqn in enumerate(closed_.jaxpr.eqns):
            found = body(eqn)
            if found is not None:
                handlers[i] = lambda eqn, ins, found=found: flatten(_core.close(*found), ins)
        return interpret(closed_, args, handlers)

    avals = [v.aval for v in closed.jaxpr.invars]
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    return jax.make_jaxpr(lambda *args: flatten(closed, args))(*structs)


def open_consts(closed):
    """The same program with its constants turned into leading inputs, so that programs
    derived from it take them as arguments (and a compiled one can be reused when only
    their values change)."""
    return _core.constvars_as_inputs(closed), list(closed.consts)


def prune(closed, used_outputs: Sequence[bool]):
    """Keep only the outputs flagged in `used_outputs` and the top-level equations they
    need (a write to a `jax.Ref` that a needed equation reads later included), whatever
    their effects (a `jax.debug.print` whose result nothing needs is dropped). Inputs are
    kept."""
    jaxpr = closed.jaxpr
    outvars = [v for v, u in zip(jaxpr.outvars, used_outputs, strict=True) if u]
    kept = [e for e, n in zip(jaxpr.eqns, needed_equations(jaxpr, outvars), strict=True) if n]
    effects = _core.join_effects(*(e.effects for e in kept)) if kept else _core.no_effects
    info = jaxpr.debug_info.with_unknown_names() if jaxpr.debug_info is not None else None
    pruned = jaxpr.replace(eqns=kept, outvars=outvars, effects=effects, debug_info=info)
    return _core.close(pruned, closed.consts)


def computing(closed, variables):
    """The program that computes `variables` (variables of `closed`) as its outputs: only the
    equations they need, nothing else (no effect of the others). Inputs are kept."""
    info = closed.jaxpr.debug_info.with_unknown_names() if closed.jaxpr.debug_info is not None else None
    outputs = _core.close(closed.jaxpr.replace(outvars=list(variables), debug_info=info), closed.consts)
    return prune(outputs, [True] * len(variables))


def top_level(closed, name: str) -> list[int]:
    """Indices of the top-level equations of primitive `name`."""
    return [i for i, e in enumerate(closed.jaxpr.eqns) if str(e.primitive) == name]


def nested_in(eqn, name: str) -> list:
    """The equations of primitive `name` inside `eqn`'s nested jaxprs, at any depth."""
    found = []
    for sub in _core.jaxprs_in_params(eqn.params):
        for e in sub.eqns:
            if str(e.primitive) == name:
                found.append(e)
            found.extend(nested_in(e, name))
    return found


def kind_of(eqn) -> str:
    """A readable name for the construct an equation is (for explain)."""
    name = str(eqn.primitive)
    return {
        "scan": "lax.scan",
        "cond": "lax.cond",
        "while": "lax.while_loop",
        "custom_jvp_call": "a custom_jvp rule",
        "custom_vjp_call": "a custom_vjp rule",
        "custom_vjp_call_jaxpr": "a custom_vjp rule",
    }.get(name, f"`{name}`")


def merge_duplicates(closed, keep=()):
    """The same program with every top-level equation that repeats an earlier one (the same
    operation and parameters on the same inputs, and no effects) removed, its outputs
    replaced by the earlier one's: the same function of the same values computed twice is
    then one variable. Equations of the primitives in `keep` (or holding one), and host
    callbacks, are kept: they run as often as the program says."""
    jaxpr = closed.jaxpr
    alias: dict = {}
    first: dict = {}
    eqns = []

    def read(v):
        return v if isinstance(v, _core.Literal) else alias.get(v, v)

    for eqn in jaxpr.eqns:
        inputs = [read(v) for v in eqn.invars]
        mergeable = not contains(eqn, (*keep, "pure_callback")) and not any(
            isinstance(v, _core.DropVar) for v in eqn.outvars
        )
        key = equation_key(eqn, inputs) if mergeable else None
        if key is not None and key in first:
            alias.update(zip(eqn.outvars, first[key].outvars, strict=True))
            continue
        eqn = eqn.replace(invars=inputs)
        if key is not None:
            first[key] = eqn
        eqns.append(eqn)
    if not alias:
        return closed
    return _core.close(jaxpr.replace(eqns=eqns, outvars=[read(v) for v in jaxpr.outvars]), closed.consts)


@dataclasses.dataclass(frozen=True, eq=False)
class Found:
    """One equation of a chosen primitive, as its rewriter sees it."""

    primitive: Any
    params: dict
    operands: tuple  # per operand: a NumPy array (known at trace time) or a ShapeDtypeStruct
    outs: tuple  # a ShapeDtypeStruct per output
    location: Location
    multiple_results: bool
    in_avals: tuple = ()  # the type of each operand
    differentiated: tuple = ()  # per operand: whether it may depend on the program's (differentiated) inputs
    used: tuple = ()  # per output: whether the program reads it
    # per operand: `(source, how)`, the value it is made from through `stop_gradient`s and changes
    # of shape or dtype (`source`: `("input", i)` for the program's input `i`, `("value", id)`
    # for another, equal for operands made of one value), and those equations (`how`: a
    # `(primitive name, parameters' text)` each, the last first); None for a literal
    sources: tuple = ()


@dataclasses.dataclass(frozen=True)
class Nested:
    """An equation of a chosen primitive inside a construct that is not inlined."""

    primitive: Any
    location: Location
    kind: str  # the construct (`lax.scan`, ...)
    params: dict = dataclasses.field(default_factory=dict)


def _struct(aval) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def _known(closed) -> set:
    """The variables computed from concrete constants alone (no input, no effect)."""
    jaxpr = closed.jaxpr
    known = {v for v, c in zip(jaxpr.constvars, closed.consts, strict=True) if not isinstance(c, _core.Tracer)}
    for eqn in jaxpr.eqns:
        if not eqn.effects and all(isinstance(v, _core.Literal) or v in known for v in eqn.invars):
            known.update(v for v in eqn.outvars if not isinstance(v, _core.DropVar))
    return known


def _numpy(aval) -> bool:
    """Whether a value of type `aval` can be a NumPy array (not an extended dtype: a PRNG key)."""
    return not jax.numpy.issubdtype(aval.dtype, jax.dtypes.extended)


def _reached(jaxpr) -> set:
    """The variables that may depend on the program's inputs (its differentiated leaves):
    every output of an equation that reads one (more than depend on them, never fewer)."""
    reached = set(jaxpr.invars)
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, _core.Literal) and v in reached for v in eqn.invars):
            reached.update(v for v in eqn.outvars if not isinstance(v, _core.DropVar))
    return reached


# The one-operand equations an operand is seen through (`Found.sources`): a `stop_gradient`,
# and a change of shape or dtype of a whole value.
_THROUGH = frozenset({"stop_gradient", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type"})


def _made_by(jaxpr) -> dict:
    """Each output of a `_THROUGH` equation of one operand, and that equation."""
    return {
        eqn.outvars[0]: eqn
        for eqn in jaxpr.eqns
        if eqn.primitive.name in _THROUGH and len(eqn.invars) == 1 and not isinstance(eqn.invars[0], _core.Literal)
    }


def _source(v, made_by: dict, inputs: dict) -> tuple[tuple, tuple] | None:
    """`(what v is made from, how)` (`Found.sources`)."""
    if isinstance(v, _core.Literal):
        return None
    how = []
    while v in made_by:
        eqn = made_by[v]
        how.append((eqn.primitive.name, repr(sorted(eqn.params.items(), key=lambda item: item[0]))))
        v = eqn.invars[0]
    return (("input", inputs[v]) if v in inputs else ("value", id(v))), tuple(how)


def _read(jaxpr) -> set:
    """The variables that an equation or the program's outputs read."""
    read = {v for v in jaxpr.outvars if not isinstance(v, _core.Literal)}
    for eqn in jaxpr.eqns:
        read.update(v for v in eqn.invars if not isinstance(v, _core.Literal))
    return read


def _values(closed, variables: list) -> dict:
    """The values of `variables` (known ones), computed now, eagerly, even under a trace."""
    if not variables:
        return {}
    program = computing(closed, variables)
    zeros = [np.zeros(v.aval.shape, v.aval.dtype) for v in program.jaxpr.invars]  # (not read)
    with jax.ensure_compile_time_eval():
        out = interpret(program, zeros)
    return {v: np.asarray(o) for v, o in zip(variables, out, strict=True)}


def rewrite(
    closed,
    chosen: Callable[[Any], bool],
    decide: Callable[[Found], Any],
    claims: Callable[[Any, dict], bool] | None = None,
):
    """`(program, nested)`: `closed` with each equation of a primitive `p` for which
    `chosen(p)` holds replaced by `decide(found)`'s function, called on the equation's
    inputs under the new trace and returning its outputs as a list; where `decide`
    returns None the equation stays (where it does for every one, `closed` is returned as
    it was traced, its nested `jit`s kept). `nested`: the chosen equations left inside
    other constructs, a `Nested` each. `decide` is called in program order, for the
    equations that `claims(primitive, params)` (default: all) says are its business: the
    known operands of the others are not computed (they may be a library's handles)."""
    if not any(contains(e, chosen) for e in closed.jaxpr.eqns):
        return closed, []
    traced = closed
    locations = iter(_locations(closed.jaxpr.eqns, chosen, None))
    closed = inline(closed, chosen)
    jaxpr = closed.jaxpr
    nested: list[Nested] = []
    candidates = []
    for i, eqn in enumerate(jaxpr.eqns):
        if chosen(eqn.primitive):
            candidates.append(i)
        elif contains(eqn, chosen):
            outer = _location(eqn)
            nested.extend(
                Nested(e.primitive, _at(e, outer), kind_of(eqn), dict(e.params)) for e in _all_chosen(eqn, chosen)
            )
    if not candidates:
        return traced, nested
    claimed = {i for i in candidates if claims is None or claims(jaxpr.eqns[i].primitive, jaxpr.eqns[i].params)}
    known = _known(closed)
    operands = (v for i in candidates if i in claimed for v in jaxpr.eqns[i].invars)
    # (a value NumPy cannot hold, a PRNG key, is handed over as its structure)
    wanted = list(
        dict.fromkeys(v for v in operands if not isinstance(v, _core.Literal) and v in known and _numpy(v.aval))
    )
    values = _values(closed, wanted)

    def operand(v):
        if isinstance(v, _core.Literal):
            return np.asarray(v.val)
        return values[v] if v in values else _struct(v.aval)

    reached, read, made_by = _reached(jaxpr), _read(jaxpr), _made_by(jaxpr)
    inputs = {v: i for i, v in enumerate(jaxpr.invars)}
    handlers = {}
    for i in candidates:
        eqn, location = jaxpr.eqns[i], next(locations)
        if i not in claimed:
            continue
        found = Found(
            eqn.primitive,
            dict(eqn.params),
            tuple(operand(v) for v in eqn.invars),
            tuple(_struct(v.aval) for v in eqn.outvars),
            location,
            eqn.primitive.multiple_results,
            tuple(v.aval for v in eqn.invars),
            tuple(not isinstance(v, _core.Literal) and v in reached for v in eqn.invars),
            tuple(not isinstance(v, _core.DropVar) and v in read for v in eqn.outvars),
            tuple(_source(v, made_by, inputs) for v in eqn.invars),
        )
        fn = decide(found)
        if fn is not None:
            handlers[i] = lambda eqn, ins, fn=fn: fn(*ins)
    if not handlers:  # (the program as it was traced, its nested `jit`s kept)
        return traced, nested
    structs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in jaxpr.invars]
    return jax.make_jaxpr(lambda *args: interpret(closed, args, handlers))(*structs), nested


def _locations(eqns, chosen, outer: Location | None) -> list[Location]:
    """The location of each chosen equation that inlining brings to the top level, in the
    order it brings them. An equation traced inside a library's `jit` knows only the
    library's lines: the user's is the enclosing call's."""
    found = []
    for eqn in eqns:
        if chosen(eqn.primitive):
            found.append(_at(eqn, outer))
        elif contains(eqn, chosen) and _INLINE.get(str(eqn.primitive)) in eqn.params:
            body, _ = _core.open_and_consts(eqn.params[_INLINE[str(eqn.primitive)]])
            here = _location(eqn)
            found.extend(_locations(body.eqns, chosen, outer if outer is not None else here))
    return found


def _at(eqn, outer: Location | None) -> Location:
    """Where `eqn` is, the user's line being `outer`'s when its own innermost line is a
    library's: a library's `jit` body may come from its cache, traced from another caller,
    whose lines its equations keep."""
    inner = _location(eqn)
    if outer is not None and (inner.library is not None or inner.file is None or _installed(inner.file)):
        library = (inner.file, inner.line) if inner.file is not None else outer.library
        inner = dataclasses.replace(outer, primitive=inner.primitive, library=library)
    return inner


def _all_chosen(eqn, chosen) -> list:
    found = []
    for sub in _core.jaxprs_in_params(eqn.params):
        for e in sub.eqns:
            if chosen(e.primitive):
                found.append(e)
            else:
                found.extend(_all_chosen(e, chosen))
    return found
