"""Rewriting chosen equations of a traced program into other code (recognised calls).

An equation is rewritten where it sits at the top level of the program or in a nested
`jit`/`checkpoint` (inlined first, as the sites are); anywhere else (a `scan`, `cond` or
`while` body, a custom rule) it is left as it is and reported. Its operands are handed
over as NumPy arrays where they are known at trace time (computed from constants alone,
with no effect on the way), and as `jax.ShapeDtypeStruct`s otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _internals as _core
from ._dependence import Location, _installed, _location
from ._program import _INLINE, computing, contains, inline, interpret, kind_of


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


def rewrite(closed, chosen: Callable[[Any], bool], decide: Callable[[Found], Any]):
    """`(program, nested)`: `closed` with each equation of a primitive `p` for which
    `chosen(p)` holds replaced by `decide(found)`'s function, called on the equation's
    inputs under the new trace and returning its outputs as a list; where `decide`
    returns None the equation stays (where it does for every one, `closed` is returned as
    it was traced, its nested `jit`s kept). `nested`: the chosen equations left inside
    other constructs, a `Nested` each. `decide` is called in program order."""
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
    known = _known(closed)
    operands = (v for i in candidates for v in jaxpr.eqns[i].invars)
    # (a value NumPy cannot hold, a PRNG key, is handed over as its structure)
    wanted = list(
        dict.fromkeys(v for v in operands if not isinstance(v, _core.Literal) and v in known and _numpy(v.aval))
    )
    values = _values(closed, wanted)

    def operand(v):
        if isinstance(v, _core.Literal):
            return np.asarray(v.val)
        return values[v] if v in values else _struct(v.aval)

    reached, read = _reached(jaxpr), _read(jaxpr)
    handlers = {}
    for i in candidates:
        eqn = jaxpr.eqns[i]
        found = Found(
            eqn.primitive,
            dict(eqn.params),
            tuple(operand(v) for v in eqn.invars),
            tuple(_struct(v.aval) for v in eqn.outvars),
            next(locations),
            eqn.primitive.multiple_results,
            tuple(v.aval for v in eqn.invars),
            tuple(not isinstance(v, _core.Literal) and v in reached for v in eqn.invars),
            tuple(not isinstance(v, _core.DropVar) and v in read for v in eqn.outvars),
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
