"""Which values depend on which sources, and the user line that made them so.

Below, what cannot be replayed: custom rules bound to the trace that made them, and effects
that must happen once a call (`check_rules`, `once_only`). The stages evaluate the traced
program again, in other traces (stage 1's backward pass, stage 3 under `jax.vjp`). A
`custom_vjp` or `custom_jvp` rule is kept in the program as a Python function, called only
when the program is differentiated; one that closes over a value computed in the traced
function (`scale = stop_gradient(cos(x))`, then a backward rule returning `ct * scale`)
holds a tracer of a trace that has ended, and fails there. And what stage 1 evaluates,
stage 3 evaluates again: an `io_callback` would run twice (and stage 1's draw is not the one
the value sees), a write to a `jax.Ref` from outside would happen twice.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import linecache
import os
import sysconfig
import traceback
from collections.abc import Sequence
from typing import Any

from . import _internals as _core
from . import _replay


@dataclasses.dataclass(frozen=True)
class Location:
    """The operation that made a value depend on a source, and where the user wrote it:
    the innermost frame of the user's own code (`file`, `line`), and, when the operation
    itself is in an installed package (a loss from a library), that line too (`library`)."""

    primitive: str
    file: str | None
    line: int | None
    function: str | None
    derivative: bool = False  # an operation of the derivative, not one the user wrote
    library: tuple[str, int] | None = None  # the package's `(file, line)`, when it is not the user's

    def __str__(self) -> str:
        return f"{'the derivative' + chr(39) + 's ' if self.derivative else ''}`{self.primitive}` {self.where()}"

    def where(self) -> str:
        """`at file:line` with the line's code (the path relative to the working directory
        when it is below it), then the library's line; or that there is none."""
        if self.file is None:
            return "(no user source line)"
        code = linecache.getline(self.file, self.line or 0).strip()
        shown = f" `{code}`" if code else ""
        inside = f" (in {_shown_path(self.library[0])}:{self.library[1]})" if self.library else ""
        return f"at {_shown_path(self.file)}:{self.line}{shown}{inside}"


def _shown_path(path: str) -> str:
    """`path` relative to the working directory when it is below it; as it is otherwise."""
    try:
        here = os.getcwd()
        full = os.path.abspath(path)
        return os.path.relpath(full, here) if os.path.commonpath([full, here]) == here else path
    except (OSError, ValueError):  # (no working directory; another drive)
        return path


def _package_dirs(*names: str) -> set[str]:
    """The folders the packages `names` are installed in, wherever the environment puts them
    (a site-packages, or a folder on `PYTHONPATH`, as on an accelerator's image)."""
    found = set()
    for name in names:
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            found.add(os.path.dirname(os.path.abspath(location)) + os.sep)
    return found


_INSTALLED = tuple(
    {p for p in (sysconfig.get_path("purelib"), sysconfig.get_path("platlib")) if p}
    | _package_dirs("numpy", "jax", "equinox")
)


def _installed(path: str) -> bool:
    """Whether `path` is in an installed package (site-packages), not the user's own code."""
    return (
        path.startswith(_INSTALLED)
        or f"{os.sep}site-packages{os.sep}" in path
        or f"{os.sep}dist-packages{os.sep}" in path
    )


def _location(eqn) -> Location:
    frames = list(_core.user_frames(eqn.source_info.traceback))
    name = str(eqn.primitive)
    if name in ("jit", "pjit") and "name" in eqn.params:
        name = f"jit({eqn.params['name']})"
    if not frames:
        return Location(name, None, None, None)
    first = frames[0]
    mine = next((f for f in frames if not _installed(f.file_name)), first)
    library = (first.file_name, first.start_line) if mine is not first else None
    return Location(name, mine.file_name, mine.start_line, mine.function_name, library=library)


_DEFERAX = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def raised_at(error: BaseException) -> Location:
    """Where the user's code raised `error` (as `_location` for an equation): the innermost
    frame of its traceback that is neither JAX's nor deferax's own, the user's own code
    (`file`, `line`), and the installed package's line when the innermost is one. Named as
    the error's type."""
    frames = [
        f
        for f in reversed(traceback.extract_tb(error.__traceback__))
        if _core.is_user_file(f.filename) and not os.path.abspath(f.filename).startswith(_DEFERAX)
    ]
    name = type(error).__name__
    if not frames:
        return Location(name, None, None, None)
    first = frames[0]
    mine = next((f for f in frames if not _installed(f.filename)), first)
    library = (first.filename, first.lineno or 0) if mine is not first else None
    return Location(name, mine.filename, mine.lineno, mine.name, library=library)


# Primitives whose body is a plain jaxpr called once with the equation's inputs: the taint
# analysis looks inside them for precision. Every other primitive with a body (scan, cond,
# while, custom rules, ...) is treated conservatively: any marked input marks every output.
_CALL_PARAMS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}


def _inner_jaxpr(eqn):
    """The body to look inside, or None: a call that takes a `jax.Ref` is treated as a
    whole (what it writes there is followed at the call)."""
    key = _CALL_PARAMS.get(str(eqn.primitive))
    if key is None or key not in eqn.params or written(eqn):
        return None
    inner = eqn.params[key]
    return getattr(inner, "jaxpr", inner)


# State: a `jax.Ref` is a variable that equations write (`r[...] = v` is a `swap`) and read
# (`r[...]` is a `get`). Every analysis follows it as a value that each writing equation
# updates: what is written there (or anything else the writer takes, for a call or a loop
# that is not looked inside) reaches what is read from it later.


def is_ref(v) -> bool:
    return not isinstance(v, _core.Literal) and is_ref_type(v.aval)


def is_ref_type(aval) -> bool:
    """Whether `aval` is the type of a `jax.Ref`."""
    return isinstance(aval, _core.AbstractRef)


def uses_refs(closed) -> bool:
    """Whether the program holds a `jax.Ref` anywhere: an input, a constant, or one that
    an equation (at any depth) makes or takes."""

    def holds(jaxpr) -> bool:
        return any(is_ref(v) for v in [*jaxpr.constvars, *jaxpr.invars]) or any(
            any(is_ref(v) for v in [*e.invars, *e.outvars])
            or any(holds(sub) for sub in _core.jaxprs_in_params(e.params))
            for e in jaxpr.eqns
        )

    return holds(closed.jaxpr)


def written(eqn) -> list:
    """The `jax.Ref`s among `eqn`'s inputs that it may write: all of them, but for a read."""
    if str(eqn.primitive) == "get":
        return []
    return [v for v in eqn.invars if is_ref(v)]


def _mark(
    jaxpr, in_marks: Sequence[frozenset], eqn_labels=None, effects=None
) -> tuple[list[frozenset], list[list[frozenset]]]:
    """Forward dependency analysis over `jaxpr`.

    Returns the marks (sets of source labels) of the outputs, and for each equation the
    marks of its inputs. A call-like equation is analysed inside; any other equation marks
    every output with the union of its inputs' marks (conservative, so always sound).
    `eqn_labels` maps the index of a top-level equation to a label that its outputs carry
    as well (an expensive call: its outputs are sources). `effects`, a list, receives
    `(marks, equation)` for each operation with an effect, at any depth (one with a body
    other than a call's: the union of its inputs' marks).
    """
    empty: frozenset = frozenset()
    marks: dict = dict(zip(jaxpr.invars, in_marks, strict=True))
    eqn_labels = eqn_labels or {}

    def read(v):
        return empty if isinstance(v, _core.Literal) else marks.get(v, empty)

    eqn_ins = []
    for i, eqn in enumerate(jaxpr.eqns):
        ins = [read(v) for v in eqn.invars]
        inner = _inner_jaxpr(eqn)
        if i in eqn_labels:
            outs = [frozenset().union(*ins) | {eqn_labels[i]}] * len(eqn.outvars)
        elif inner is not None and len(inner.invars) == len(ins):
            outs = _mark(inner, ins, effects=effects)[0]
        else:
            outs = [frozenset().union(*ins)] * len(eqn.outvars)
            if effects is not None and eqn.effects:
                effects.append((frozenset().union(*ins), eqn))
        marks.update(zip(eqn.outvars, outs, strict=True))
        for ref in written(eqn):
            marks[ref] = read(ref).union(*ins)
        eqn_ins.append(ins)
    return [read(v) for v in jaxpr.outvars], eqn_ins


def _in_marks(in_labels: Sequence[object]) -> list[frozenset]:
    return [frozenset() if lab is None else frozenset([lab]) for lab in in_labels]


def dependencies(closed, in_labels: Sequence[object], eqn_labels=None) -> list[frozenset]:
    """For each output of `closed`, the set of labels of the inputs it depends on.

    `in_labels[i]` labels input `i`; `None` means "not a source". The analysis is
    syntactic and conservative: an output is reported dependent whenever some chain of
    operations connects it to the input, whatever the values.
    """
    return _mark(closed.jaxpr, _in_marks(in_labels), eqn_labels)[0]


def effect_dependencies(closed, in_labels: Sequence[object]) -> list[tuple[frozenset, Location]]:
    """The operations of `closed` with an effect (a `jax.debug.callback`, an `io_callback`:
    what they do shows outside the outputs), each with the labels of the inputs it takes
    and where the user wrote it."""
    effects: list = []
    _mark(closed.jaxpr, _in_marks(in_labels), effects=effects)
    return [(marks, _location(eqn)) for marks, eqn in effects]


# Primitives whose body deferax cannot read: a host callback, a foreign function. What they
# compute, and what they keep between calls (a factorisation in a Python object), is unknown.
_OPAQUE = ("pure_callback", "io_callback", "ffi_call", "custom_call")


def opaque_call(closed, also: Sequence[str] = ()) -> Location | None:
    """The first operation of `closed`, at any depth, whose body cannot be read (a host
    callback, a foreign function, or a primitive named in `also`); None if there is none."""

    def find(jaxpr):
        for eqn in jaxpr.eqns:
            if str(eqn.primitive) in _OPAQUE or str(eqn.primitive) in also:
                return _location(eqn)
            for sub in _core.jaxprs_in_params(eqn.params):
                found = find(sub)
                if found is not None:
                    return found
        return None

    return find(closed.jaxpr)


def escaping(closed, in_labels: Sequence[object]) -> frozenset:
    """The labels of the inputs that reach a `jax.Ref` the program gets from outside (an
    input or a constant) through what it writes there: that outlives the call."""
    jaxpr = closed.jaxpr
    outside = {v for v in [*jaxpr.constvars, *jaxpr.invars] if is_ref(v)}
    eqn_ins = _mark(jaxpr, _in_marks(in_labels))[1]
    writes = [ins for eqn, ins in zip(jaxpr.eqns, eqn_ins, strict=True) if outside.intersection(written(eqn))]
    return frozenset().union(*(m for ins in writes for m in ins))


def input_marks(closed, in_labels: Sequence[object], eqn_labels=None) -> list[list[frozenset]]:
    """For each top-level equation, the labels each of its inputs depends on."""
    return _mark(closed.jaxpr, _in_marks(in_labels), eqn_labels)[1]


def needed_equations(jaxpr, targets) -> list[bool]:
    """For each top-level equation, whether computing the variables `targets` needs it: it
    makes one of them, or something a needed equation takes, or writes a `jax.Ref` that a
    needed equation reads later."""
    needed = {v for v in targets if not isinstance(v, _core.Literal)}
    flags = [False] * len(jaxpr.eqns)
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if any(v in needed for v in [*eqn.outvars, *written(eqn)]):
            flags[i] = True
            needed.update(v for v in eqn.invars if not isinstance(v, _core.Literal))
    return flags


def first_culprit(
    closed,
    in_labels: Sequence[object],
    output: int,
    sources: frozenset,
    seed: object,
    eqn_labels=None,
    named_by: Sequence[Location] = (),
) -> Location | None:
    """The operation that makes `output` (a cotangent) depend on one of `sources`.

    `seed` labels the cotangent fed into the backward pass. The culprit is the first
    equation that flows into `output` and combines a value derived from a source (a
    residual of the forward pass) with a value derived from the seed: in the transposed
    program that is where, say, `y**2` multiplies the incoming cotangent by `2*y`. Its
    source information points at the user's line that did the nonlinear operation. If no
    such equation exists, the first equation that touches a source and flows into the
    output is named instead.

    The operation is the derivative's (the `mul` of `y / w`'s derivative): it is named by
    the first of the user's operations `named_by` on the same line, or said to be the
    derivative's where none is.
    """
    jaxpr = closed.jaxpr
    eqn_ins = _mark(jaxpr, _in_marks(in_labels), eqn_labels)[1]
    relevant = needed_equations(jaxpr, [jaxpr.outvars[output]])
    fallback = None
    for eqn, ins, rel in zip(jaxpr.eqns, eqn_ins, relevant, strict=True):
        if not rel:
            continue
        from_source = [bool(m & sources) and seed not in m for m in ins]
        from_seed = [seed in m for m in ins]
        if any(from_source) and any(from_seed):
            return _named(_location(eqn), named_by)
        if fallback is None and any(m & sources for m in ins):
            fallback = _named(_location(eqn), named_by)
    return fallback


def _named(location: Location, named_by: Sequence[Location]) -> Location:
    for use in named_by:
        if location.file is not None and (use.file, use.line) == (location.file, location.line):
            return use
    return dataclasses.replace(location, derivative=True)


_RULES = {"custom_vjp_call": "custom_vjp", "custom_vjp_call_jaxpr": "custom_vjp", "custom_jvp_call": "custom_jvp"}


@dataclasses.dataclass(frozen=True)
class Rules:
    """A program's custom rules, checked (`check_rules`)."""

    program: Any  # the program, its `custom_vjp` backward rules replayed from their first run
    stranded: tuple[str, Location] | None  # `(kind, location)` of the first that cannot run outside its trace


def check_rules(closed, in_labels: Sequence[object], eqn_labels=None) -> Rules:
    """The custom rules of `closed` (at any depth) that the stages may run, checked to run
    outside the trace that made them. The stages differentiate its first output (the value)
    with respect to the inputs labelled in `in_labels` and the outputs of the equations in
    `eqn_labels` (see `dependencies`): a rule runs where an input depends on them (JAX
    evaluates the function of any other), a backward rule where the value reads an output.

    Each is differentiated on abstract values in a fresh trace, with the inputs perturbed and
    the outputs read that the stages perturb and read (all of them inside another construct):
    a rule holding a tracer of an ended trace fails there, or takes it in as a constant (one
    holding a value of an enclosing `jit`, still tracing, is fine). In the program returned, a
    `custom_vjp`'s backward rule is replayed from its first run (`_replay`), this one or, for
    a rule seen to run alone before, the stages' first trace of it, so that its Python runs as
    often as in plain JAX. Inside another construct only this run is kept: JAX compiles a
    `jit`'s body once a program object, and a body rebuilt every call would be compiled every
    call."""
    found = [(eqn, _RULES[str(eqn.primitive)]) for eqn in _equations(closed.jaxpr) if str(eqn.primitive) in _RULES]
    if not found:
        return Rules(closed, None)
    jaxpr = closed.jaxpr
    marks = dict(zip(map(id, jaxpr.eqns), input_marks(closed, in_labels, eqn_labels), strict=True))
    read = _read_by_value(jaxpr)
    replayed = {}
    for eqn, kind in found:
        top = id(eqn) in marks
        perturbed = _perturbed(eqn, marks.get(id(eqn)))
        if not any(perturbed):
            continue
        alone, rule = _replay.differentiable_alone(eqn, perturbed, [not top or v in read for v in eqn.outvars])
        if not alone:
            return Rules(closed, (kind, _location(eqn)))
        if rule is None and kind == "custom_vjp" and top:
            rule = _replay.Replayed(eqn.params["bwd"])  # (not run here: the stages' first trace of it is kept)
        if rule is not None:
            replayed[id(eqn)] = rule
    return Rules(_replay.replaying(closed, replayed), None)


def _read_by_value(jaxpr) -> set:
    """The variables of `jaxpr` that its first output (the value) depends on."""
    value = [v for v in jaxpr.outvars[:1] if not isinstance(v, _core.Literal)]
    read = set(value)
    for eqn, needed in zip(jaxpr.eqns, needed_equations(jaxpr, value), strict=True):
        read.update(v for v in eqn.invars if needed and not isinstance(v, _core.Literal))
    return read


def _equations(jaxpr):
    """The equations of `jaxpr`, at any depth but inside a custom rule's own function, which
    is never differentiated (its rules are)."""
    for eqn in jaxpr.eqns:
        yield eqn
        if str(eqn.primitive) not in _RULES:
            for sub in _core.jaxprs_in_params(eqn.params):
                yield from _equations(sub)


def _perturbed(eqn, marks) -> list[bool]:
    """Which of a rule's explicit inputs (after the values a `custom_vjp`'s function closes
    over, which JAX never perturbs) the stages perturb: those of a floating dtype that depend
    on a differentiated value (`marks`, for a top-level equation), every one of them in
    another construct (`marks` None)."""
    held = eqn.params.get("num_consts", 0) if "fwd_jaxpr_thunk" in eqn.params else 0
    depends = [True] * len(eqn.invars) if marks is None else [bool(m) for m in marks]
    return [d and _core.is_inexact(v.aval) for v, d in zip(eqn.invars[held:], depends[held:], strict=True)]


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
