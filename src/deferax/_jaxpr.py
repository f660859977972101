"""Everything that reads jaxprs or touches JAX internals lives here.

`jax.extend.core` and `jax._src` carry no compatibility promise across JAX releases, so a
JAX upgrade should have to touch this file only. The tested JAX range is pinned in
`pyproject.toml`.
"""

from __future__ import annotations

import dataclasses
import linecache
from collections.abc import Sequence

import jax
from jax._src import core as _core
from jax._src import source_info_util as _source_info_util
from jax._src.interpreters import ad as _ad


def current_trace() -> object:
    """The innermost trace that JAX is recording into right now."""
    return _core.trace_ctx.trace


def is_eager() -> bool:
    """True when no transformation is active: operations run at once on concrete values."""
    return isinstance(_core.trace_ctx.trace, _core.EvalTrace)


def trace_kind(trace: object) -> str:
    """A short human name for a trace, for `explain`."""
    name = type(trace).__name__
    return {
        "BatchTrace": "vmap",
        "DynamicJaxprTrace": "a nested jit, scan, cond, while_loop or checkpoint",
        "JVPTrace": "jvp",
        "LinearizeTrace": "a nested grad",
    }.get(name, name)


def in_forward_mode() -> bool:
    """True when a forward-mode derivative (`jax.jvp`, `jax.jacfwd`) is being traced.

    With direct linearisation (the default in the tested JAX range) reverse mode uses a
    `LinearizeTrace`, so a `JVPTrace` anywhere in the stack means forward mode.
    """
    trace = _core.trace_ctx.trace
    while trace is not None:
        if isinstance(trace, _ad.JVPTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def eval_jaxpr(closed: jax.extend.core.ClosedJaxpr, *args):
    """Evaluate a closed jaxpr on flat arguments (under whatever trace is current)."""
    return _core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


@dataclasses.dataclass(frozen=True)
class Location:
    """The operation that made a value depend on a source, and where the user wrote it."""

    primitive: str
    file: str | None
    line: int | None
    function: str | None

    def __str__(self) -> str:
        if self.file is None:
            return f"`{self.primitive}` (no user source line)"
        code = linecache.getline(self.file, self.line or 0).strip()
        shown = f" `{code}`" if code else ""
        return f"`{self.primitive}` at {self.file}:{self.line}{shown}"


def _location(eqn) -> Location:
    frame = _source_info_util.user_frame(eqn.source_info.traceback)
    name = str(eqn.primitive)
    if name in ("jit", "pjit") and "name" in eqn.params:
        name = f"jit({eqn.params['name']})"
    if frame is None:
        return Location(name, None, None, None)
    return Location(name, frame.file_name, frame.start_line, frame.function_name)


# Primitives whose body is a plain jaxpr called once with the equation's inputs: the taint
# analysis looks inside them for precision. Every other primitive with a body (scan, cond,
# while, custom rules, ...) is treated conservatively: any marked input marks every output.
_CALL_PARAMS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}


def _inner_jaxpr(eqn):
    key = _CALL_PARAMS.get(str(eqn.primitive))
    if key is None or key not in eqn.params:
        return None
    inner = eqn.params[key]
    return getattr(inner, "jaxpr", inner)


def _propagate(jaxpr, in_marks: Sequence[frozenset]) -> list[frozenset]:
    """Forward dependency analysis: which sources each output of `jaxpr` depends on."""
    marks: dict = {}
    empty: frozenset = frozenset()

    def read(v):
        if isinstance(v, _core.Literal):
            return empty
        return marks.get(v, empty)

    for v, m in zip(jaxpr.invars, in_marks, strict=True):
        marks[v] = m
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        inner = _inner_jaxpr(eqn)
        if inner is not None and len(inner.invars) == len(ins):
            outs = _propagate(inner, ins)
        else:
            union = frozenset().union(*ins) if ins else empty
            outs = [union] * len(eqn.outvars)
        for v, m in zip(eqn.outvars, outs, strict=True):
            marks[v] = m
    return [read(v) for v in jaxpr.outvars]


def dependencies(closed, in_labels: Sequence[object]) -> list[frozenset]:
    """For each output of `closed`, the set of labels of the inputs it depends on.

    `in_labels[i]` labels input `i`; `None` means "not a source". The analysis is
    syntactic and conservative: an output is reported dependent whenever some chain of
    operations connects it to the input, whatever the values.
    """
    jaxpr = closed.jaxpr
    marks = [frozenset() if lab is None else frozenset([lab]) for lab in in_labels]
    return _propagate(jaxpr, marks)


def _forward_state(jaxpr, marks):
    state: dict = dict(zip(jaxpr.invars, marks, strict=True))
    eqn_ins = []
    for eqn in jaxpr.eqns:
        ins = [frozenset() if isinstance(v, _core.Literal) else state.get(v, frozenset()) for v in eqn.invars]
        inner = _inner_jaxpr(eqn)
        if inner is not None and len(inner.invars) == len(ins):
            outs = _propagate(inner, ins)
        else:
            union = frozenset().union(*ins) if ins else frozenset()
            outs = [union] * len(eqn.outvars)
        for v, m in zip(eqn.outvars, outs, strict=True):
            state[v] = m
        eqn_ins.append(ins)
    return eqn_ins


def _relevant_eqns(jaxpr, output: int) -> list[bool]:
    target = jaxpr.outvars[output]
    relevant = set() if isinstance(target, _core.Literal) else {target}
    flags = [False] * len(jaxpr.eqns)
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if any(v in relevant for v in eqn.outvars):
            flags[i] = True
            relevant.update(v for v in eqn.invars if not isinstance(v, _core.Literal))
    return flags


def first_culprit(closed, in_labels: Sequence[object], output: int, sources: frozenset, seed: object) -> Location | None:
    """The operation that makes `output` (a cotangent) depend on one of `sources`.

    `seed` labels the cotangent fed into the backward pass. The culprit is the first
    equation that flows into `output` and combines a value derived from a source (a
    residual of the forward pass) with a value derived from the seed: in the transposed
    program that is where, say, `y**2` multiplies the incoming cotangent by `2*y`. Its
    source information points at the user's line that did the nonlinear operation. If no
    such equation exists, the first equation that touches a source and flows into the
    output is named instead.
    """
    jaxpr = closed.jaxpr
    marks = [frozenset() if lab is None else frozenset([lab]) for lab in in_labels]
    eqn_ins = _forward_state(jaxpr, marks)
    relevant = _relevant_eqns(jaxpr, output)
    fallback = None
    for eqn, ins, rel in zip(jaxpr.eqns, eqn_ins, relevant, strict=True):
        if not rel:
            continue
        from_source = [bool(m & sources) and seed not in m for m in ins]
        from_seed = [seed in m for m in ins]
        if any(from_source) and any(from_seed):
            return _location(eqn)
        if fallback is None and any(m & sources for m in ins):
            fallback = _location(eqn)
    return fallback
