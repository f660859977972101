"""Every JAX name the jaxpr code uses, from its public home where one exists.

This is the one file that imports `jax._src`, and the one that knows how JAX releases
differ. Across the tested range (see `pyproject.toml`):

- jax 0.9 has `DropVar`, `jaxprs_in_params` and `no_effects` in `jax._src.core` only
  (jax 0.10 exported them from `jax.extend.core`).
- jax 0.12 merged `ClosedJaxpr` into `Jaxpr` (a `Jaxpr` carries its constants, and
  `.jaxpr` of one returns itself); the old `ClosedJaxpr(jaxpr, consts)` constructor
  survives there only as a deprecated alias. `close` and `is_jaxpr` work on every version.
- The names below without a public home (the trace context, the traces it is nested in and
  a tracer's trace, `join_effects`, `user_frames`, `is_user_file`,
  the configuration states, `convert_constvars_jaxpr` before 0.12, the type of a
  `jax.Ref`'s value, the effects of an `io_callback`, `partial_eval_jaxpr_nounits`) are
  taken from `jax._src`, so a JAX upgrade that moves them breaks this file only.
- A `scan` equation counts its constants and carried values as `num_consts` and `num_carry`
  up to jax 0.11, and as the groups of `ft_in` (a `FlatTree`) in jax 0.12 (`scan_sizes`).
- A `custom_vjp_call` equation's parameters (`call_jaxpr`, `fwd_jaxpr_thunk`, `bwd`,
  `out_trees`, `num_consts`, `symbolic_zeros`) are JAX's own record of the call, read by
  `custom_vjp_parts` below: on jax 0.9-0.10 `out_trees()` returns `(out_tree, res_tree,
  input_fwds)`, `input_fwds` giving, for each residual, the operand (constants first) it
  is, or None for one the forward computes. Its `bwd` is a `WrappedFun` that JAX calls with
  the flat residuals and output cotangents, and that returns the flat input cotangents (with
  `Zero`s), paired with the rule's logs where JAX has `defvjp_with_logs` (`bwd_cotangents`);
  `rule_like` wraps a function to stand in its place (`_replay`).
- Inside `jax.shard_map`, the manual mesh axes a value varies along are `aval.vma` on jax 0.9
  and `aval.manual_axis_type.varying` (a `jax._src.core.ManualAxisType`, which has no public
  home) from jax 0.10; `varying_axes` and `with_varying` read and write either.
- A forward rule that closes over a tracer of the trace the call was staged in (a value
  computed in the loss): up to jax 0.12.0 `fwd_jaxpr_thunk` returns that tracer among its
  constants; jax 0.12.1 raises `UnexpectedTracerError` instead. `_custom_vjp._forward`
  reads both as a rule that closes over a value of the loss.

Below the names: which traces the code running now is under (`is_eager`,
`under_differentiation`), the caller's JAX configuration carried to other threads (`carry_context`,
`local_config`, `apply_config`), and defining a primitive with the helpers its rules need
(`define_primitive`, `is_zero`, `instantiate`, ...), and evaluating one equation
(`bind_equation`). Last, helpers on JAX values that the whole package shares (`struct_of`,
`structs`, `shape_text`, `zeros`, `zero_like`, `stacked`, `is_inexact`, `is_concrete`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax._src import config as config
from jax._src import core as _core
from jax._src import custom_batching as _custom_batching
from jax._src import custom_derivatives as _custom_derivatives
from jax._src import effects as _effects
from jax._src import source_info_util as _source_info_util
from jax._src.callback import IOEffect as _IOEffect
from jax._src.callback import OrderedIOEffect as _OrderedIOEffect
from jax._src.state.types import AbstractRef as AbstractRef
from jax.core import ShapedArray as ShapedArray
from jax.core import Tracer as Tracer
from jax.custom_derivatives import SymbolicZero as SymbolicZero
from jax.extend.core import Jaxpr as Jaxpr
from jax.extend.core import Literal as Literal
from jax.extend.core import Primitive as Primitive
from jax.extend.core import Var as Var
from jax.extend.core import jaxpr_as_fun as _jaxpr_as_fun
from jax.extend.linear_util import WrappedFun as WrappedFun
from jax.extend.linear_util import wrap_init as _wrap_init
from jax.extend.source_info_util import current_name_stack as current_name_stack
from jax.extend.source_info_util import user_context as user_context
from jax.interpreters.ad import JVPTrace as JVPTrace
from jax.interpreters.ad import Zero as Zero
from jax.interpreters.ad import is_undefined_primal as is_undefined_primal
from jax.interpreters.partial_eval import dce_jaxpr as dce_jaxpr
from jaxtyping import PyTree

try:  # jax >= 0.10
    from jax.extend.core import DropVar as DropVar
    from jax.extend.core import jaxprs_in_params as jaxprs_in_params
    from jax.extend.core import no_effects as no_effects
except ImportError:  # jax 0.9 (the bottom of the range): in jax._src.core only
    DropVar = _core.DropVar
    jaxprs_in_params = _core.jaxprs_in_params
    no_effects = _core.no_effects

# jax 0.12: one `Jaxpr` type, closed when constants are attached.
_MERGED = hasattr(_core.Jaxpr, "with_consts")
_CLOSED: type = _core.Jaxpr if _MERGED else _core.ClosedJaxpr

user_frames = _source_info_util.user_frames  # innermost first, JAX's own frames left out
join_effects = _core.join_effects
EvalTrace = _core.EvalTrace


def is_user_file(path: str) -> bool:
    """Whether `path` is neither JAX's own code nor Python's (JAX's test, as in `user_frames`)."""
    return _source_info_util.is_user_filename(path)


def current_trace():
    """The trace that operations run now are recorded on."""
    return _core.trace_ctx.trace


def enclosing_traces() -> Iterator[Any]:
    """The current trace, then each trace it is nested in, outwards (JAX's `parent_trace` links)."""
    trace = current_trace()
    while trace is not None:
        yield trace
        trace = getattr(trace, "parent_trace", None)


def under_differentiation() -> bool:
    """Whether an enclosing `jax.grad`, `jax.jvp`, `jax.linearize` ... is tracing the code
    running now (its trace is on the stack of the current one)."""
    differentiating = (JVPTrace, linearize_trace_type())
    return any(isinstance(trace, differentiating) for trace in enclosing_traces())


def is_eager() -> bool:
    """True when no transformation is active: operations run at once on concrete values."""
    return isinstance(current_trace(), EvalTrace)


def manual_axes() -> tuple[str, ...]:
    """The mesh axes the code running now is manual over: inside `jax.shard_map`, its axes
    (each shard runs the code on its own block); `()` elsewhere."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(getattr(mesh, "manual_axes", ()) or ())


def scan_sizes(eqn) -> tuple[int, int]:
    """`(constants, carried values)`: how many of a `scan` equation's operands are each, the
    stacked inputs after them (jax <= 0.11: `num_consts`, `num_carry`; jax 0.12: one entry
    an operand in each group of `ft_in`, constants, carry, stacked inputs)."""
    params = eqn.params
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    # (a `FlatTree` of the operands: its three groups, with the operands' positions as values)
    consts, carry, _ = params["ft_in"].update(list(range(len(eqn.invars)))).unpack()
    return len(list(consts)), len(list(carry))


def has_ended(tracer: Tracer) -> bool:
    """Whether `tracer`'s trace has ended: it is neither the current trace nor one that the
    current trace is nested in (JAX keeps a tracer's trace as its private `_trace`)."""
    return not any(trace is tracer._trace for trace in enclosing_traces())


def must_happen_once(effect) -> bool:
    """Whether an effect is I/O or ordered (an `io_callback`, an ordered `jax.debug.print`):
    running its operation twice, or out of order, would show."""
    return isinstance(effect, _IOEffect | _OrderedIOEffect) or _effects.ordered_effects.contains(effect)


def linearize_trace_type() -> type:
    from jax._src.interpreters import ad

    return ad.LinearizeTrace


def close(jaxpr, consts: Sequence[Any]):
    """The closed program of `jaxpr`, its leading `len(consts)` inputs (its constvars)
    bound to `consts`."""
    if _MERGED:
        return jaxpr.with_consts(list(consts))
    return _core.ClosedJaxpr(jaxpr, list(consts))


def is_jaxpr(p) -> bool:
    """Whether `p` is a program, open or closed (as a parameter of an equation)."""
    return isinstance(p, _core.Jaxpr | _CLOSED)


def custom_vmap_rule(p) -> Any:
    """The batching rule a `jax.custom_batching.custom_vmap` call's `rule` parameter wraps (the
    function given to `def_vmap`, the same in every trace), or None for any other parameter:
    the wrapper itself is made anew by every trace."""
    closed_rule = getattr(_custom_batching, "ClosedRule", None)  # (its name in jax 0.9 to 0.12)
    return p.rule if closed_rule is not None and isinstance(p, closed_rule) else None


def open_and_consts(p) -> tuple[Any, list]:
    """`(jaxpr, consts)` of a program parameter: an open one has no constants."""
    if isinstance(p, _CLOSED):
        return p.jaxpr, list(p.consts)
    return p, []


def constvars_as_inputs(closed):
    """The open program of `closed` with its constants as leading inputs."""
    if _MERGED:
        return closed.with_consts([])
    from jax._src.interpreters import partial_eval as pe

    return close(pe.convert_constvars_jaxpr(closed.jaxpr), [])


def custom_vjp_call_primitive():
    """The primitive a `jax.custom_vjp` call binds (`custom_vjp_call`)."""
    from jax.extend.core import primitives

    return primitives.custom_vjp_call_p


def linear_solve_primitive():
    """The primitive `jax.lax.custom_linear_solve` binds (`custom_linear_solve`)."""
    return jax.lax.linear_solve_p


def custom_vjp_parts(params: dict, perturbed: Sequence[bool]) -> tuple[Any, list, list[int | None], Any]:
    """`(fwd_jaxpr, fwd_consts, input_fwds, res_tree)` of a `custom_vjp_call` equation's
    forward rule, traced for the explicit inputs `perturbed` (the closed-over constants
    are never perturbed). The forward's program takes the explicit inputs and returns
    `(*computed residuals, *outputs)`; `input_fwds[j]` is the operand (constants first)
    that residual `j` is, or None for a computed one."""
    fwd_jaxpr, fwd_consts = params["fwd_jaxpr_thunk"].call_wrapped(*perturbed)
    _, res_tree, input_fwds = params["out_trees"]()
    return fwd_jaxpr, list(fwd_consts), list(input_fwds), res_tree


def backward_rule(f) -> Any:
    """The backward rule given to a `jax.custom_vjp` function `f` (`f.defvjp(f_fwd, f_bwd)`:
    `f_bwd`); None for anything else, or before `defvjp`."""
    return f.bwd if isinstance(f, jax.custom_vjp) else None


def function_name(program) -> str | None:
    """The name of the function `program` was traced from (`f` of "f at file.py:3"), if its
    debug info holds one."""
    info = program.jaxpr.debug_info
    return info.func_name if info is not None and info.func_src_info else None


def rule_like(fn, rule: WrappedFun) -> WrappedFun:
    """`fn` wrapped as JAX wraps a custom rule, named as `rule` (a `custom_vjp_call`'s `bwd`)."""
    return _wrap_init(fn, debug_info=rule.debug_info)


def with_jaxprs(params: dict, rebuild) -> dict:
    """An equation's `params` with each program among them (one, or one of a tuple: a `cond`'s
    branches) replaced by `rebuild(jaxpr)` of its open jaxpr, its constants kept; a program
    that `rebuild` returns as it was stays the same object."""

    def one(p):
        if isinstance(p, tuple):  # (a tuple of programs; another, as `scatter`'s dimension numbers, stays as it is)
            items = [one(q) for q in p]
            return p if all(a is b for a, b in zip(items, p, strict=True)) else tuple(items)
        if not is_jaxpr(p):
            return p
        jaxpr, consts = open_and_consts(p)
        new = rebuild(jaxpr)
        if new is jaxpr:
            return p
        return close(new, consts) if isinstance(p, _CLOSED) else new

    return {name: one(p) for name, p in params.items()}


def evaluate(closed, args: Sequence[Any]) -> list:
    """Evaluate a closed program on `args` under the current trace (as `core.eval_jaxpr`)."""
    return list(_jaxpr_as_fun(closed)(*args))


def split_known(closed, unknowns: Sequence[bool]):
    """`(known, unknown, out_unknowns)`: `closed` split by data dependence on the inputs
    flagged in `unknowns` (JAX's partial evaluation): `known` takes the other inputs and
    returns the outputs that do not depend on them, then the residuals; `unknown` takes the
    residuals, then the flagged inputs, and returns the rest."""
    from jax._src.interpreters import partial_eval as pe

    known, unknown, out_unknowns, _ = pe.partial_eval_jaxpr_nounits(closed, list(unknowns), instantiate=False)
    return known, unknown, list(out_unknowns)


def rule_functions(wrapped) -> list:
    """The user's functions behind a custom rule's wrapped callable (`bwd` of a
    `custom_vjp_call`): the function JAX wrapped (`WrappedFun.f`), and, for a rule JAX made
    from another (batched by `vmap`), those of the wrapped callables it closes over."""
    found, todo, seen = [], [wrapped], set()
    while todo:
        w = todo.pop()
        if id(w) in seen:
            continue
        seen.add(id(w))
        f = w.f if isinstance(w, WrappedFun) else w
        if not callable(f):
            continue
        found.append(f)
        for cell in getattr(f, "__closure__", None) or ():
            try:
                inner = cell.cell_contents
            except ValueError:  # (an empty cell)
                continue
            if isinstance(inner, WrappedFun):
                todo.append(inner)
    return found


# A `custom_vjp_call`'s flattened backward rule returns its inputs' cotangents alone up to
# jax 0.11, and `(cotangents, logs)` from the release that brought `defvjp_with_logs` (0.12).
_BWD_RETURNS_LOGS = hasattr(_custom_derivatives.custom_vjp, "defvjp_with_logs")


def bwd_cotangents(outs):
    """The inputs' cotangents among what a `custom_vjp_call`'s `bwd` parameter returned."""
    return outs[0] if _BWD_RETURNS_LOGS else outs


def local_config() -> dict:
    """The JAX configuration values set in this thread only (by a context manager such as
    `jax.numpy_dtype_promotion("strict")`)."""
    values = {}
    for name, state in config.config_states.items():
        value = state.get_local()
        if value is not config.config_ext.unset:
            values[name] = value
    return values


@contextlib.contextmanager
def apply_config(values: dict):
    """Set, in this thread, every JAX configuration value of `values` that differs here."""
    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            state = config.config_states[name]
            if state.value != value:
                stack.enter_context(state(value))
        yield


@contextlib.contextmanager
def setting(var: contextvars.ContextVar, value):
    """Inside: the context variable `var` is `value` (in this thread, and in what
    `carry_context` carries from here)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def carry_context(fn):
    """`fn` to run on another thread with the caller's context: its context variables (the
    typechecking switch) and its thread-local JAX configuration (`jax.numpy_dtype_promotion`,
    ... set with context managers)."""
    context = contextvars.copy_context()
    local = local_config()

    def run(*args):
        with apply_config(local):
            return context.copy().run(fn, *args)

    return run


def bind_equation(eqn, args):
    """Evaluate one equation on `args` under the current trace, as `core.eval_jaxpr` does."""
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = current_name_stack() + eqn.source_info.name_stack
    with user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        out = eqn.primitive.bind(*args, **bind_params)
    return out if eqn.primitive.multiple_results else [out]


def define_primitive(name, *, impl, abstract_eval, jvp=None, batch=None, transpose=None):
    """A JAX primitive with multiple results and the rules given.

    `impl(*args, **params)` runs it on concrete arrays, and is traced to lower it into a
    compiled program; `abstract_eval(*avals, **params)` returns the output avals;
    `jvp(primals, tangents, **params)`, `batch(args, dims, **params)` and
    `transpose(cts, *args, **params)` follow JAX's conventions.
    """
    from jax.interpreters import ad, batching, mlir

    p = Primitive(name)
    p.multiple_results = True
    p.def_impl(impl)
    p.def_abstract_eval(abstract_eval)
    mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=True))
    if jvp is not None:
        ad.primitive_jvps[p] = jvp
    if batch is not None:
        batching.primitive_batchers[p] = batch
    if transpose is not None:
        ad.primitive_transposes[p] = transpose
    return p


def is_zero(t) -> bool:
    """A symbolic zero tangent or cotangent."""
    return type(t) is Zero


def instantiate(t, aval):
    """A symbolic zero as an array of zeros (varying along the manual axes `aval` varies
    along, inside `jax.shard_map`); anything else unchanged."""
    if type(t) is Zero:
        if aval.dtype == jax.dtypes.float0:
            return np.zeros(aval.shape, jax.dtypes.float0)
        return vary(jax.numpy.zeros(aval.shape, aval.dtype), varying_axes(aval))
    return t


# Inside `jax.shard_map` with `check_vma=True` (the default), a value's type names the manual
# mesh axes along which it varies from shard to shard, its "vma": `aval.manual_axis_type.varying`
# from jax 0.10 on, `aval.vma` in jax 0.9. A primitive's abstract evaluation must type its
# outputs with theirs: typed invariant, an output that varies is taken for replicated (its
# cotangent is then reduced over the shards twice, or one shard's value stands for all).
# The operands of one equation share their vma (as for JAX's own primitives, `pvary` casts an
# invariant operand first, `vary`), and a transpose returns each cotangent with its operand's
# (`to_varying`): JAX transposes `pvary` to the `psum` that makes the cotangent of a replicated
# input the sum of every shard's. Outside `shard_map`, or with `check_vma=False`, every value
# is invariant and all of this is a no-op.


def varying_axes(aval) -> frozenset:
    """The manual mesh axes along which a value of type `aval` varies (empty outside `jax.shard_map`)."""
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", None) or ())  # jax 0.9


def unreduced_axes(aval) -> frozenset:
    """The mesh axes along which a value of type `aval` is an unreduced partial sum (each
    shard holds a term of it: `jax.lax.pcast(x, axes, to="unreduced")`, `P(unreduced=...)`)."""
    found = set(getattr(getattr(aval, "manual_axis_type", None), "unreduced", None) or ())
    found |= set(getattr(getattr(getattr(aval, "sharding", None), "spec", None), "unreduced", None) or ())
    return frozenset(found)


def aval_of(x):
    """The type of an operand of a primitive, in a transpose rule too (where a linear
    operand is an undefined primal, known by its type alone)."""
    return x.aval if is_undefined_primal(x) else jax.typeof(x)


def with_varying(avals: Sequence[Any], operands: Sequence[Any]) -> list:
    """The output types `avals` (a primitive's abstract evaluation) varying along every
    manual axis that one of the operand types `operands` varies along: what an output
    computed from them may do. Unchanged where none varies."""
    axes = frozenset().union(*(varying_axes(a) for a in operands))
    if not axes:
        return list(avals)
    mesh = next(a.sharding.mesh for a in operands if varying_axes(a))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if hasattr(ShapedArray, "manual_axis_type"):  # jax >= 0.10
        mat = _core.ManualAxisType(varying=axes)
        return [a.update(sharding=sharding, manual_axis_type=mat) for a in avals]
    return [a.update(sharding=sharding, vma=axes) for a in avals]  # jax 0.9


def vary(x, axes) -> Any:
    """`x` cast to vary along the manual axes `axes` too (`jax.lax.pcast(..., to="varying")`,
    JAX's `pvary`; a no-op for values that already do)."""
    missing = tuple(a for a in axes if a not in varying_axes(jax.typeof(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def to_varying(x, axes) -> Any:
    """A cotangent `x` typed to vary along exactly the manual axes `axes` (its operand's):
    summed over the shards along the axes it varies along and the operand does not (the
    operand is the same on all of them: its cotangent is the sum of theirs), cast along
    those the operand varies along and it does not."""
    extra = tuple(a for a in varying_axes(jax.typeof(x)) if a not in axes)
    if extra:
        x = jax.lax.psum(x, extra)
    return vary(x, axes)


def zero_tangent(aval):
    """A symbolic zero tangent for a value of type `aval`."""
    return Zero(aval.to_tangent_aval())


def shaped(struct):
    """The aval of a `jax.ShapeDtypeStruct`."""
    return ShapedArray(struct.shape, struct.dtype, weak_type=getattr(struct, "weak_type", False))


def is_not_mapped(dim) -> bool:
    """In a batching rule: whether an operand has no batch dimension."""
    return dim is None


def move_to_front(x, dim):
    """Move a batch dimension to axis 0 (a no-op when already there)."""
    return jax.numpy.moveaxis(x, dim, 0)


def is_primitive(obj: object) -> bool:
    """Whether `obj` is a JAX primitive (what an equation binds)."""
    return isinstance(obj, Primitive)


# Helpers on JAX values that the rest of the package shares: their structures and text, zeros, stacking.


def is_concrete(tree: PyTree) -> bool:
    """True when no leaf is a tracer: the arrays are values, not part of a trace."""
    return not any(isinstance(leaf, Tracer) for leaf in jtu.tree_leaves(tree))


def struct_of(a: Any, *, keep_weak_type: bool = False) -> jax.ShapeDtypeStruct:
    """The `jax.ShapeDtypeStruct` of one array (or array-like, or abstract value); with
    `keep_weak_type`, weakly typed as `a` is (a Python scalar promoted by JAX)."""
    weak = keep_weak_type and bool(getattr(a, "weak_type", False))
    return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a), weak_type=weak)


def structs(tree: PyTree) -> PyTree[jax.ShapeDtypeStruct]:
    """The `jax.ShapeDtypeStruct` of every leaf of `tree`."""
    return jtu.tree_map(struct_of, tree)


def stacked(struct: PyTree[jax.ShapeDtypeStruct], k: int) -> PyTree[jax.ShapeDtypeStruct]:
    """`struct` with a leading axis of length `k` on every leaf (`k` of them, stacked)."""
    return jtu.tree_map(lambda s: jax.ShapeDtypeStruct((k, *s.shape), s.dtype), struct)


def zeros(struct: PyTree[jax.ShapeDtypeStruct]) -> PyTree:
    """JAX zeros shaped like `struct`."""
    return jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), struct)


def zero_like(a: Any) -> Any:
    """A zero tangent (or cotangent) for `a`: zeros of its dtype, `float0` for an integer."""
    if jnp.issubdtype(jnp.result_type(a), jnp.inexact):
        return jnp.zeros(jnp.shape(a), jnp.result_type(a))
    return np.zeros(jnp.shape(a), jax.dtypes.float0)


def is_inexact(a: Any) -> bool:
    """Whether `a` (an array, a structure or an abstract value) is floating-point or complex: differentiable."""
    return bool(jnp.issubdtype(jnp.result_type(a), jnp.inexact))


def shape_text(a: Any) -> str:
    """`float64[3, 4]` for an array or a `jax.ShapeDtypeStruct` (`key<fry>[]` for a typed PRNG key)."""
    dtype = a.dtype if jnp.issubdtype(a.dtype, jax.dtypes.extended) else np.dtype(a.dtype)
    return f"{dtype.name}{list(a.shape)}"
