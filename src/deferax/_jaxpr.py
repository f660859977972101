"""Everything that reads jaxprs or touches JAX internals lives here.

`jax.extend.core` and `jax._src` carry no compatibility promise across JAX releases, so a
JAX upgrade should have to touch this file only. The tested JAX range is pinned in
`pyproject.toml`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import linecache
from collections.abc import Sequence

import jax
from jax._src import core as _core
from jax._src import source_info_util as _source_info_util
from jax._src.interpreters import ad as _ad


def is_eager() -> bool:
    """True when no transformation is active: operations run at once on concrete values."""
    return isinstance(_core.trace_ctx.trace, _core.EvalTrace)


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


def _mark(jaxpr, in_marks: Sequence[frozenset], eqn_labels=None) -> tuple[list[frozenset], list[list[frozenset]]]:
    """Forward dependency analysis over `jaxpr`.

    Returns the marks (sets of source labels) of the outputs, and for each equation the
    marks of its inputs. A call-like equation is analysed inside; any other equation marks
    every output with the union of its inputs' marks (conservative, so always sound).
    `eqn_labels` maps the index of a top-level equation to a label that its outputs carry
    as well (an expensive call: its outputs are sources).
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
            outs = _mark(inner, ins)[0]
        else:
            outs = [frozenset().union(*ins)] * len(eqn.outvars)
        marks.update(zip(eqn.outvars, outs, strict=True))
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


def input_marks(closed, in_labels: Sequence[object], eqn_labels=None) -> list[list[frozenset]]:
    """For each top-level equation, the labels each of its inputs depends on."""
    return _mark(closed.jaxpr, _in_marks(in_labels), eqn_labels)[1]


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


def first_culprit(closed, in_labels: Sequence[object], output: int, sources: frozenset, seed: object, eqn_labels=None) -> Location | None:
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
    eqn_ins = _mark(jaxpr, _in_marks(in_labels), eqn_labels)[1]
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


# ----------------------------------------------------------------------------- primitives


def define_primitive(name, *, impl, abstract_eval, jvp=None, batch=None, transpose=None, lower=None):
    """A JAX primitive with multiple results and the rules given.

    `impl(*args, **params)` runs it on concrete arrays; `lower(*args, **params)` is traced
    to lower it into a compiled program (default: `impl`); `abstract_eval(*avals,
    **params)` returns the output avals; `jvp(primals, tangents, **params)`, `batch(args,
    dims, **params)` and `transpose(cts, *args, **params)` follow JAX's conventions.
    """
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    p = Primitive(name)
    p.multiple_results = True
    p.def_impl(impl)
    p.def_abstract_eval(abstract_eval)
    mlir.register_lowering(p, mlir.lower_fun(lower or impl, multiple_results=True))
    if jvp is not None:
        ad.primitive_jvps[p] = jvp
    if batch is not None:
        batching.primitive_batchers[p] = batch
    if transpose is not None:
        ad.primitive_transposes[p] = transpose
    return p


def is_undefined_primal(x) -> bool:
    """In a transpose rule: whether `x` is a linear input (its cotangent is wanted)."""
    return _ad.is_undefined_primal(x)


def is_zero(t) -> bool:
    """A symbolic zero tangent or cotangent."""
    return type(t) is _ad.Zero


def instantiate(t, aval):
    """A symbolic zero as an array of zeros; anything else unchanged."""
    if type(t) is _ad.Zero:
        return jax.numpy.zeros(aval.shape, aval.dtype)
    return t


def zero_tangent(aval):
    """A symbolic zero tangent for a value of type `aval`."""
    return _ad.Zero(aval.to_tangent_aval())


def shaped(struct):
    """The aval of a `jax.ShapeDtypeStruct`."""
    return _core.ShapedArray(struct.shape, struct.dtype, weak_type=getattr(struct, "weak_type", False))


def is_not_mapped(dim) -> bool:
    """In a batching rule: whether an operand has no batch dimension."""
    return dim is None


def move_to_front(x, dim):
    """Move a batch dimension to axis 0 (a no-op when already there)."""
    from jax._src.interpreters import batching

    return batching.moveaxis(x, dim, 0)


# ----------------------------------------------------------------------------- one trace


def trace(fun, *structs):
    """`(closed_jaxpr, out_shape)` of `fun` on abstract arguments, traced afresh every time
    (`jax.make_jaxpr` caches traces on the function object: a fresh wrapper defeats it)."""
    return jax.make_jaxpr(lambda *a: fun(*a), return_shape=True)(*structs)


def bind_equation(eqn, args):
    """Evaluate one equation on `args` under the current trace, as `core.eval_jaxpr` does."""
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = _source_info_util.current_name_stack() + eqn.source_info.name_stack
    with _source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        out = eqn.primitive.bind(*args, **bind_params)
    return out if eqn.primitive.multiple_results else [out]


def interpret(closed, args, handlers=None, skip=frozenset()):
    """Evaluate a closed jaxpr on flat `args` under the current trace.

    `handlers` maps an equation index to `handler(eqn, invals) -> outvals`, which replaces
    the equation; equations whose index is in `skip` are not evaluated (their outputs must
    be unused).
    """
    jaxpr = closed.jaxpr
    handlers = handlers or {}
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, _core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for i, eqn in enumerate(jaxpr.eqns):
        if i in skip:
            continue
        ins = [read(v) for v in eqn.invars]
        outs = handlers[i](eqn, ins) if i in handlers else bind_equation(eqn, ins)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def contains(eqn, primitives) -> bool:
    """Whether `eqn` is, or holds in a nested jaxpr at any depth, a primitive named in `primitives`."""
    if str(eqn.primitive) in primitives:
        return True
    return any(contains(e, primitives) for sub in _core.jaxprs_in_params(eqn.params) for e in sub.eqns)


# Call-like primitives whose body can be inlined into the surrounding jaxpr: a nested
# `jit`/`eqx.filter_jit` and `jax.checkpoint` (whose rematerialisation is then decided at
# the top level). Their body runs once on the equation's inputs.
_INLINE = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr", "remat2": "jaxpr"}


def inline(closed, primitives):
    """`closed` with every nested jit/checkpoint that contains one of `primitives` inlined
    (recursively), so that those primitives' equations sit at the top level. Returns the
    closed jaxpr and, for explain, the kinds of call that were inlined."""
    inlined: list[str] = []

    def body(eqn):
        key = _INLINE.get(str(eqn.primitive))
        if key is None or key not in eqn.params or not contains(eqn, primitives):
            return None
        inner = eqn.params[key]
        return (inner.jaxpr, inner.consts) if hasattr(inner, "jaxpr") else (inner, [])

    if not any(body(e) is not None for e in closed.jaxpr.eqns):
        return closed, inlined

    def flat(*args):
        return _flatten(closed.jaxpr, closed.consts, args)

    def _flatten(jaxpr, consts, args):
        env: dict = {}

        def read(v):
            return v.val if isinstance(v, _core.Literal) else env[v]

        env.update(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            found = body(eqn)
            if found is not None:
                inlined.append(str(eqn.primitive))
                outs = _flatten(found[0], found[1], ins)
            else:
                outs = bind_equation(eqn, ins)
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(v) for v in jaxpr.outvars]

    avals = [v.aval for v in closed.jaxpr.invars]
    new = jax.make_jaxpr(flat)(*[jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals])
    return new, inlined


def open_consts(closed):
    """The same program with its constants turned into leading inputs, so that programs
    derived from it take them as arguments (and a compiled one can be reused when only
    their values change)."""
    from jax._src.interpreters import partial_eval as pe

    return _core.ClosedJaxpr(pe.convert_constvars_jaxpr(closed.jaxpr), []), list(closed.consts)


def prune(closed, used_outputs: Sequence[bool]):
    """Keep only the outputs flagged in `used_outputs` and the top-level equations they
    need, whatever their effects (a `jax.debug.print` whose result nothing needs is
    dropped). Inputs are kept."""
    jaxpr = closed.jaxpr
    outvars = [v for v, u in zip(jaxpr.outvars, used_outputs, strict=True) if u]
    needed = {v for v in outvars if not isinstance(v, _core.Literal)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            kept.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, _core.Literal))
    kept.reverse()
    effects = _core.join_effects(*(e.effects for e in kept)) if kept else _core.no_effects
    info = jaxpr.debug_info.with_unknown_names() if jaxpr.debug_info is not None else None
    pruned = jaxpr.replace(eqns=kept, outvars=outvars, effects=effects, debug_info=info)
    return _core.ClosedJaxpr(pruned, closed.consts)


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
        "scan": "lax.scan", "cond": "lax.cond", "while": "lax.while_loop", "custom_jvp_call": "a custom_jvp rule",
        "custom_vjp_call": "a custom_vjp rule", "custom_vjp_call_jaxpr": "a custom_vjp rule",
    }.get(name, f"`{name}`")  # fmt: skip


# ----------------------------------------------------------------------------- cache keys


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
    import numpy as np

    a = np.asarray(value)
    return (type(value).__name__, str(a.dtype), a.shape, a.tobytes())


def _param_key(p):
    import numpy as np

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


# ----------------------------------------------------------------------------- configuration across threads


def local_config() -> dict:
    """The JAX configuration values in force in this thread (those a context manager such
    as `jax.numpy_dtype_promotion("strict")` may have set here only)."""
    from jax._src import config

    values = {}
    for name, state in config.config_states.items():
        if hasattr(state, "swap_local"):
            try:
                values[name] = state.value
            except Exception:  # noqa: BLE001 - a state without a readable value is not carried
                continue
    return values


@contextlib.contextmanager
def apply_config(values: dict):
    """Set, in this thread, every JAX configuration value of `values` that differs here."""
    from jax._src import config

    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            state = config.config_states[name]
            if state.value != value:
                stack.enter_context(state(value))
        yield


def carry_context(fn):
    """`fn` to run on another thread with the caller's context: its context variables (the
    typechecking switch) and its thread-local JAX configuration (`jax.numpy_dtype_promotion`,
    ... set with context managers)."""
    import contextvars

    context = contextvars.copy_context()
    config = local_config()

    def run(*args):
        with apply_config(config):
            return context.copy().run(fn, *args)

    return run
