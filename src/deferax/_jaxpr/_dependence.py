"""Which values depend on which sources, and the user line that made them so.

Below, what cannot be replayed: custom rules bound to the trace that made them, and effects
that must happen once a call (`stranded_rule`, `once_only`). The stages evaluate the traced
program again, in other traces (stage 1's backward pass, stage 3 under `jax.vjp`). A
`custom_vjp` or `custom_jvp` rule is kept in the program as a Python function, called only
when the program is differentiated; one that closes over a value computed in the traced
function (`scale = stop_gradient(cos(x))`, then a backward rule returning `ct * scale`)
holds a tracer of a trace that has ended, and fails there. And what stage 1 evaluates,
stage 3 evaluates again: an `io_callback` would run twice (and stage 1's draw is not the one
the value sees), a write to a `jax.Ref` from outside would happen twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import linecache
import os
import sysconfig
import traceback
from collections.abc import Sequence

import jax
import numpy as np

from .. import _runtime
from . import _internals as _core


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
        outs, vjp = jax.vjp(lambda *a: _core.bind_equation(eqn, (*consts, *a)), *args[held:])
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
