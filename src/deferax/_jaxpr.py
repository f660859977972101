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


def _mark(jaxpr, in_marks: Sequence[frozenset]) -> tuple[list[frozenset], list[list[frozenset]]]:
    """Forward dependency analysis over `jaxpr`.

    Returns the marks (sets of source labels) of the outputs, and for each equation the
    marks of its inputs. A call-like equation is analysed inside; any other equation marks
    every output with the union of its inputs' marks (conservative, so always sound).
    """
    empty: frozenset = frozenset()
    marks: dict = dict(zip(jaxpr.invars, in_marks, strict=True))

    def read(v):
        return empty if isinstance(v, _core.Literal) else marks.get(v, empty)

    eqn_ins = []
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        inner = _inner_jaxpr(eqn)
        if inner is not None and len(inner.invars) == len(ins):
            outs = _mark(inner, ins)[0]
        else:
            outs = [frozenset().union(*ins)] * len(eqn.outvars)
        marks.update(zip(eqn.outvars, outs, strict=True))
        eqn_ins.append(ins)
    return [read(v) for v in jaxpr.outvars], eqn_ins


def _in_marks(in_labels: Sequence[object]) -> list[frozenset]:
    return [frozenset() if lab is None else frozenset([lab]) for lab in in_labels]


def dependencies(closed, in_labels: Sequence[object]) -> list[frozenset]:
    """For each output of `closed`, the set of labels of the inputs it depends on.

    `in_labels[i]` labels input `i`; `None` means "not a source". The analysis is
    syntactic and conservative: an output is reported dependent whenever some chain of
    operations connects it to the input, whatever the values.
    """
    return _mark(closed.jaxpr, _in_marks(in_labels))[0]


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
    eqn_ins = _mark(jaxpr, _in_marks(in_labels))[1]
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


# ----------------------------------------------------------------------------- linearity


# Operations that are linear in their (single) data operand and need no coefficient.
_LINEAR_UNARY = {
    "neg", "reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "reduce_sum",
    "slice", "rev", "real", "imag", "conj", "convert_element_type", "copy", "copy_p", "fft",
    "cumsum", "reduce_precision",
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
    cls: dict = dict(zip(jaxpr.invars, in_classes, strict=True))
    fr: dict = dict(zip(jaxpr.invars, in_free, strict=True))
    frontier: list = []

    def read(v, table, default):
        return default if isinstance(v, _core.Literal) else table.get(v, default)

    for eqn in jaxpr.eqns:
        classes = [read(v, cls, CONST) for v in eqn.invars]
        free = [read(v, fr, True) for v in eqn.invars]
        outs = _classify(eqn, classes, free)
        if NONLINEAR in outs:
            frontier.extend(v for v, c in zip(eqn.invars, classes, strict=True) if c == LINEAR)
        all_free = all(free)
        for v, c in zip(eqn.outvars, outs, strict=True):
            cls[v] = c
            fr[v] = all_free
    frontier.extend(v for v in jaxpr.outvars if read(v, cls, CONST) == LINEAR)
    return [read(v, cls, CONST) for v in jaxpr.outvars], frontier


def linear_frontier(closed, source: Sequence[bool], stand_ins: Sequence[bool]):
    """Where the program stops being linear in a source input.

    Returns the distinct variables of the top-level jaxpr that depend linearly on the inputs
    flagged in `source`, with coefficients free of every input flagged in `stand_ins`, and
    that are consumed by an operation that is not linear in them (or are outputs). The
    program's outputs depend on the source only through these variables, so the cotangent
    of the source is a combination of the fixed Jacobian rows of these variables.
    """
    jaxpr = closed.jaxpr
    classes = [LINEAR if s else CONST for s in source]
    free = [not t for t in stand_ins]
    _, frontier = _linearity(jaxpr, classes, free)
    distinct = list(dict.fromkeys(frontier))
    sources = {v for v, s in zip(jaxpr.invars, source, strict=True) if s}
    # A frontier variable that the source reaches only through other frontier variables is
    # a linear function of them (say `0.3 * z` next to `z`): it adds no basis cotangent.
    return [v for v in distinct if _reached_directly(jaxpr, sources, v, set(distinct) - {v})]


def _reached_directly(jaxpr, sources, target, blockers) -> bool:
    reached = set(sources)
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, _core.Literal) and v in reached and v not in blockers for v in eqn.invars):
            reached.update(eqn.outvars)
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


def with_outputs(closed, variables):
    """A closed jaxpr with the same inputs that returns `variables` instead of its outputs."""
    from jax._src.interpreters import partial_eval as pe

    jaxpr = closed.jaxpr
    info = jaxpr.debug_info.with_unknown_names() if jaxpr.debug_info is not None else None
    narrowed = jaxpr.replace(outvars=list(variables), debug_info=info)
    pruned, _ = pe.dce_jaxpr(narrowed, [True] * len(variables), instantiate=True)
    return _core.ClosedJaxpr(pruned, closed.consts)
