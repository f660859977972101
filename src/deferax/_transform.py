"""`filter_value_and_grad` and `filter_grad`: Equinox's transforms, with the deferred VJP.

Each call traces the user's function once (`_trace`), into a program whose expensive calls
are `deferax_site` equations; the static check (`_analysis`) and the stages (`_stages`)
are derived from that program alone. Called outside any transformation, the analysis and
the compiled cheap stages are cached on the traced program itself (its equations and
parameters; its constants are arguments), so whatever the function reads is read afresh on
every call and a change of it either changes the program or reaches it as a new argument.
"""

from __future__ import annotations

import dataclasses
import functools as ft
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _jaxpr, _runtime, _site
from ._analysis._analysis import analyse
from ._checks import _checks, _messages
from ._concurrency._placement import operands
from ._jaxpr import is_concrete, shape_text, struct_of
from ._plan._plan import Plan
from ._recognise import BUILTINS, _registry
from ._site._spec import SITE
from ._stages import _run

_SCHEDULES = ("auto", "standard", "deferred")
_BAD_RECOGNISE = """`deferax.filter_value_and_grad`: `recognise` must be True (rewrite recognised calls where it \
pays), "always" (wherever it is sound) or False (never), but got {found!r}."""
_WHERE = "`deferax.filter_value_and_grad`"


@dataclasses.dataclass
class _Traced:
    """The user's function traced once on the differentiable leaves of its first argument."""

    program: Any  # ClosedJaxpr of (consts, leaves) -> (value, traced aux leaves)
    consts: list
    leaves: list
    diff_tree: Any
    aux: Any  # (treedef, leaves with None where traced) or None
    recognised: tuple = ()  # a `_registry.RegisteredCall` per call of a recognised library function

    def ins(self) -> list:
        return [*self.consts, *self.leaves]

    def has_diff(self) -> list[bool]:
        return [False] * len(self.consts) + [True] * len(self.leaves)

    def result(self, outs: list, grads: list, has_aux: bool):
        value = outs[0]
        grads = jtu.tree_unflatten(self.diff_tree, list(grads))
        if not has_aux:
            return value, grads
        treedef, static = self.aux
        it = iter(outs[1:])
        aux = jtu.tree_unflatten(treedef, [next(it) if leaf is _TRACED else leaf for leaf in static])
        return (value, aux), grads


_TRACED = object()


def _is_traced(leaf) -> bool:
    return isinstance(leaf, jax.Array)  # a tracer is one too


# What tracing on abstract values raises where the function needs a concrete value
# (`float(norm)` in a `while`, `np.array(x)`, SciPy on an array): Equinox's transform, called
# eagerly, gives it concrete values there (a `custom_vjp`'s forward runs on them, as jax-fem's
# Newton solves do), so such a function runs as Equinox runs it.
_NEEDS_CONCRETE = (
    jax.errors.ConcretizationTypeError,  # (`TracerBoolConversionError` among them)
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.NonConcreteBooleanIndexError,
)


class _Untraceable(Exception):
    """The function needed a concrete value where it was traced on abstract ones: `reason`
    says where (the plan's `fallback`)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _untraceable(error: BaseException) -> _Untraceable:
    location = _jaxpr.raised_at(error)
    return _Untraceable(
        f"it needs a concrete value {location.where()} (tracing it on abstract values raised `{location.primitive}`), "
        "so deferax cannot trace it to look for expensive calls; called outside `jit` it gets concrete values there, "
        "as in Equinox"
    )


def _trace(fun, x, args, kwargs, has_aux, explaining: bool = False, recognise: Any = True) -> _Traced:
    """Run `fun` once, on abstract values for the differentiable leaves of `x` and the
    arguments themselves for everything else (which stays concrete: `int(n)`, `if flag:`
    and NumPy work as in Equinox). `explaining`: `fun` was given to `explain` as the loss.
    `recognise`: rewrite recognised calls (`klujax.solve`, ...) into sites (`_recognise`);
    never under an enclosing differentiation, which would differentiate the sites twice.
    Raises `_Untraceable` where `fun` needs a concrete value of a differentiated leaf."""
    diff, nondiff = eqx.partition(x, eqx.is_inexact_array)
    leaves, diff_tree = jtu.tree_flatten(diff)
    box: dict = {}

    def flat(*leaves_):
        out = fun(eqx.combine(jtu.tree_unflatten(diff_tree, list(leaves_)), nondiff), *args, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple | list) and len(out) == 2):  # (as JAX and Equinox unpack it)
                raise TypeError(
                    f"{_WHERE}: with `has_aux=True` the differentiated function must return a pair `(value, aux)`, "
                    f"but it returned {_messages.tree_text(out)}."
                )
            value, aux = out
        else:
            value, aux = out, None
        _check_value(value, explaining)
        aux_leaves, aux_tree = jtu.tree_flatten(aux)
        box["aux"] = (aux_tree, [_TRACED if _is_traced(a) else a for a in aux_leaves])
        return [jnp.asarray(value), *[a for a in aux_leaves if _is_traced(a)]]

    structs = [struct_of(a, keep_weak_type=True) for a in leaves]
    try:
        # (a site differentiated inside `fun` has its derivative differentiated next)
        with _site.declared_outputs_checked(), _jaxpr.setting(_runtime.TO_BE_DIFFERENTIATED, True):
            closed, _ = _jaxpr.trace(flat, *structs)
    except _NEEDS_CONCRETE as error:
        raise _untraceable(error) from error
    recognised: tuple = ()
    if recognise is not False and not _jaxpr.under_differentiation():
        closed, recognised = _registry.recognise(closed, recognise, BUILTINS)
    closed = _jaxpr.inline(closed, (SITE,))
    program, consts = _jaxpr.open_consts(closed)
    return _Traced(program, consts, list(leaves), diff_tree, box["aux"] if has_aux else None, recognised)


_NOT_SCALAR = "{where}: the differentiated function must return a real scalar, but it returned {found}. Return \
one number (`jnp.sum(...)`, say), or `(value, aux)` with `has_aux=True`."

_EXPLAIN_NOT_LOSS = """`deferax.explain`: `fun` returned {found}, where a real scalar (a loss) was expected. Pass the \
loss function itself, or the function made from it by `dx.filter_value_and_grad` or `dx.filter_grad` (also under \
`jax.jit` or `eqx.filter_jit`), with the loss's arguments:

    dx.explain(loss, x)                                # or
    dx.explain(jax.jit(dx.filter_value_and_grad(loss)), x)"""


def _check_value(value, explaining: bool = False):
    if eqx.is_array_like(value):
        shape, dtype = jnp.shape(value), jnp.result_type(value)
        if shape == () and jnp.issubdtype(dtype, jnp.floating):
            return
        found = shape_text(jax.ShapeDtypeStruct(shape, dtype))
    else:  # a pytree: `(value, grads)` from a function that differentiates itself, say
        found = _messages.tree_text(value)
    if explaining:
        raise TypeError(_EXPLAIN_NOT_LOSS.format(found=found))
    raise TypeError(_NOT_SCALAR.format(where=_WHERE, found=found))


_DEFERRED_UNDER_DIFFERENTIATION = """{where}: schedule='deferred' was requested inside an enclosing differentiation \
(`jax.grad`,
`jax.jacrev`, `jax.jvp`, ...), which would differentiate the deferred calls themselves. These sites' deferred calls
run outside the program, through a callback that JAX cannot differentiate, or (in the program, on an accelerator) as
their implementations' halves, which JAX would differentiate in place of your rules (a `dx.fuse`, halves made from
`fwd` and `bwd` or `adjoint`, or a host function): {sites}. Use schedule='auto': under differentiation it keeps them
standard."""


def _value_and_grad(fun, has_aux: bool, schedule: str, max_basis: int | None, recognise, x, args, kwargs):
    if schedule == "standard":
        return eqx.filter_value_and_grad(fun, has_aux=has_aux)(x, *args, **kwargs)
    try:
        traced = _trace(fun, x, args, kwargs, has_aux, recognise=recognise)
    except _Untraceable as untraceable:
        _deferred_possible(schedule, untraceable)
        traced = None
    if traced is None:  # (outside the handler: what Equinox raises, under `jit` say, it raises alone)
        return eqx.filter_value_and_grad(fun, has_aux=has_aux)(x, *args, **kwargs)
    ins = traced.ins()
    differentiated = _jaxpr.under_differentiation()
    if schedule == "auto" and differentiated:
        # An enclosing `jax.grad`/`jax.jacfwd` would differentiate the deferred calls (a
        # `fused`, a callback) themselves: the standard schedule is what it can differentiate.
        schedule = "standard"
    eager = _jaxpr.is_eager() and is_concrete(ins)
    with operands(ins):
        analysis, compiled, unread = _run.analysis_of(
            traced.program, len(traced.consts), traced.has_diff(), schedule, max_basis, eager, _WHERE
        )
    if analysis.plan.fallback is not None:
        return eqx.filter_value_and_grad(fun, has_aux=has_aux)(x, *args, **kwargs)
    # (JAX-native halves in the program too: JAX would differentiate the implementations, not their rules)
    outside = (
        [s.spec.name for s in analysis.deferring if s.leaves_program or s.halves is not None] if differentiated else []
    )
    if outside:
        sites = ", ".join(f"`{name}`" for name in outside)
        raise ValueError(_DEFERRED_UNDER_DIFFERENTIATION.format(where=_WHERE, sites=sites))
    outs, grads = _run.run(analysis, compiled, traced.has_diff(), ins, eager, unread)
    return traced.result(outs, grads, has_aux)


_NO_ARGS = "{where}: the function must be called with at least one positional argument, passed by position (the \
argument that is differentiated)."


_UNTRACEABLE_DEFERRED = """{where}: schedule='deferred' was requested, but the function cannot be traced to find its \
call sites: {reason}. Use schedule='auto' to run it as `equinox.filter_value_and_grad` would, or compute what \
needs the concrete value from a non-differentiated argument (which stays concrete)."""


def _deferred_possible(schedule: str, untraceable: _Untraceable):
    if schedule == "deferred":
        raise ValueError(_UNTRACEABLE_DEFERRED.format(where=_WHERE, reason=untraceable.reason)) from untraceable


def _plan(fun, has_aux, schedule, max_basis, recognise, args, kwargs, explaining: bool = False) -> Plan:
    if not args:
        raise TypeError(_NO_ARGS.format(where=_WHERE))
    x, *rest = args
    try:
        traced = _trace(fun, x, tuple(rest), kwargs, has_aux, explaining, recognise=recognise)
    except _Untraceable as untraceable:
        _deferred_possible(schedule, untraceable)
        return Plan(sites=(), stages=(), requested=schedule, fallback=untraceable.reason)
    with operands(traced.ins()):
        plan = analyse(traced.program, len(traced.consts), schedule=schedule, max_basis=max_basis, where=_WHERE).plan
    return _registry.annotate(plan, traced.recognised)


class _ValueAndGradWrapper(eqx.Module):
    _fun: Callable
    _has_aux: bool = eqx.field(static=True)
    _schedule: str = eqx.field(static=True)
    _max_basis: int | None = eqx.field(static=True)
    _recognise: Any = eqx.field(static=True, default=True)

    @property
    def __wrapped__(self):
        return self._fun

    def __call__(self, *args, **kwargs):
        if not args:
            raise TypeError(_NO_ARGS.format(where=_WHERE))
        x, *rest = args
        with _runtime.leases_end_on_return():  # (its backward pass has run: an aux keeps no factorisation)
            return _value_and_grad(
                self._fun, self._has_aux, self._schedule, self._max_basis, self._recognise, x, tuple(rest), kwargs
            )

    def plan(self, *args, **kwargs) -> Plan:
        """The schedule that `self(*args, **kwargs)` would run (see [`deferax.explain`][])."""
        return _plan(self._fun, self._has_aux, self._schedule, self._max_basis, self._recognise, args, kwargs)

    def __get__(self, instance, owner):
        if instance is None:
            return self
        return eqx.Partial(self, instance)


class _GradWrapper(eqx.Module):
    _fun_value_and_grad: _ValueAndGradWrapper
    _has_aux: bool = eqx.field(static=True)

    @property
    def __wrapped__(self):
        return self._fun_value_and_grad.__wrapped__  # pyright: ignore[reportAttributeAccessIssue]  (a field: no `__get__`)

    def __call__(self, /, *args, **kwargs):
        value, grad = self._fun_value_and_grad(*args, **kwargs)
        if self._has_aux:
            _, aux = value
            return grad, aux
        return grad

    def plan(self, *args, **kwargs) -> Plan:
        """The schedule that `self(*args, **kwargs)` would run (see [`deferax.explain`][])."""
        return self._fun_value_and_grad.plan(*args, **kwargs)  # pyright: ignore[reportAttributeAccessIssue]  (a field: no `__get__`)

    def __get__(self, instance, owner):
        if instance is None:
            return self
        return eqx.Partial(self, instance)


# None: no limit on `k`; each site's schedule is chosen by the estimates of `_cost`, whose
# equal-cost defaults make `k = 1` deferred-basis and `k >= 2` standard (what the fixed
# limit of 1 chose before; measured on two 2-core CPUs, benchmarks/bench_basis.py: `k = 1`
# gained on both, `k = 2` lost on one).
DEFAULT_MAX_BASIS = None


def _check_settings(schedule, max_basis, recognise: bool | str = True):
    if not (recognise is True or recognise is False or (isinstance(recognise, str) and recognise == "always")):
        raise ValueError(_BAD_RECOGNISE.format(found=recognise))
    if schedule not in _SCHEDULES:
        raise ValueError(f"{_WHERE}: `schedule` must be one of 'auto', 'standard' or 'deferred', but got {schedule!r}.")
    if max_basis is not None and not _checks.is_count(max_basis):
        raise ValueError(
            _messages.BAD_MAX_BASIS.format(where=_WHERE, allowed="a non-negative int or None", found=max_basis)
        )


def filter_value_and_grad(
    fun=None,
    *,
    has_aux: bool = False,
    schedule: str = "auto",
    max_basis: int | None = DEFAULT_MAX_BASIS,
    recognise: bool | str = True,
):
    """Equinox's `filter_value_and_grad`, running the deferred VJP where it is sound.

    Differentiates `fun` with respect to the floating-point arrays of its first positional
    argument, exactly as `equinox.filter_value_and_grad` does: same arguments, same
    filtering, same return structure (`None` for what is not differentiated), usable as a
    decorator (with or without arguments) and on methods.

    **Arguments:**

    - `fun`: the function to differentiate; it returns a real scalar, or `(scalar, aux)`
      with `has_aux=True`.
    - `has_aux`: as in Equinox.
    - `schedule`: `"auto"` (default) defers every [`deferax.ExpensiveFn`][] call site for
      which the static check proves it sound and keeps the rest standard; `"standard"`
      behaves exactly like `equinox.filter_value_and_grad`; `"deferred"` defers every site or
      raises an error naming each site that cannot be deferred and why.
    - `max_basis`: the most basis cotangents `k` a site may need for the
      `"deferred-basis"` schedule (its cotangent is a combination of `k` fixed cotangents
      with coefficients that depend on outputs). Default `None`: no limit, each site's
      schedule is the one estimated fastest from its costs (its `cost=` hint, timings of
      earlier calls, or equal costs, which defer `k = 1` and keep `k >= 2` standard; see
      "How the schedule is chosen" in the docs). An int is a fixed rule: `k <= max_basis`
      is deferred-basis, beyond it standard, whatever the estimates. A site's own
      `ExpensiveFn(max_basis=...)` takes precedence.
    - `recognise`: rewrite the calls that `fun` already makes into sites: its
      `jax.custom_vjp` calls (each a site whose forward and the part of its backward that
      needs no residual computed by the forward may run at once), the sparse solves
      (`klujax.solve`, `jax.experimental.sparse.linalg.spsolve` on CPU) into
      [`deferax.sparse_solve`][] sites, so that one factorisation serves the forward and
      every adjoint, and primitives registered with [`deferax.register_recognition`][].
      `True` (default): where the rewrite provably equals the call and is estimated to pay
      (see "Faster without rewriting" in the docs); `"always"`: wherever it provably equals
      the call, whatever the cost; `False`: never (the program is left exactly as traced).

    **Returns:**

    A function with the signature of `fun` that returns `(value, grads)`, or
    `((value, aux), grads)` with `has_aux=True`.

    `fun` runs once per call (once per trace under `jit`; twice when a custom rule in it
    closes over a value it computed, or, in part, when it needs a concrete value of a
    differentiated input, such as a Newton loop in a `custom_vjp`: then the call runs as
    Equinox's would, see `fallback` in [`deferax.Plan`][]): every [`deferax.ExpensiveFn`][]
    call in it, directly, under `jax.vmap`, in a nested `jit` or under `jax.checkpoint`, is
    seen in that one trace, and is deferred when sound (a call under `vmap` as one batched
    `fused` call); calls inside `lax.scan`, `lax.cond` or `while_loop` stay standard.
    Called outside any JAX transformation, it has eager semantics: what `fun` reads is
    read afresh on every call. The cheap parts of the program (everything but the expensive
    calls) are compiled with `jax.jit`, cached on the traced program itself, and the
    deferred sites' `fused` calls run eagerly, concurrently when there are several. Inside
    `jax.jit`, `eqx.filter_jit` or `jax.vmap` the whole schedule is traced into the
    surrounding program.
    """
    _check_settings(schedule, max_basis, recognise)
    if fun is None:
        return ft.partial(
            filter_value_and_grad, has_aux=has_aux, schedule=schedule, max_basis=max_basis, recognise=recognise
        )
    return eqx.module_update_wrapper(_ValueAndGradWrapper(fun, has_aux, schedule, max_basis, recognise))


def filter_grad(
    fun=None,
    *,
    has_aux: bool = False,
    schedule: str = "auto",
    max_basis: int | None = DEFAULT_MAX_BASIS,
    recognise: bool | str = True,
):
    """Equinox's `filter_grad`, running the deferred VJP where it is sound.

    As [`deferax.filter_value_and_grad`][], but returns only the gradients (and `aux`,
    as `(grads, aux)`, with `has_aux=True`).
    """
    _check_settings(schedule, max_basis, recognise)
    if fun is None:
        return ft.partial(filter_grad, has_aux=has_aux, schedule=schedule, max_basis=max_basis, recognise=recognise)
    value_and_grad = _ValueAndGradWrapper(fun, has_aux, schedule, max_basis, recognise)
    return eqx.module_update_wrapper(_GradWrapper(value_and_grad, has_aux))


def explain(fun, *args, **kwargs) -> Plan:
    """Show which schedule each expensive call site of `fun` gets, and why.

    `fun` is a function made by [`deferax.filter_value_and_grad`][] or
    [`deferax.filter_grad`][] (its `has_aux`, `schedule` and `recognise` are used), or a plain loss
    function (analysed as `filter_value_and_grad(fun)` would), either of them also under
    `jax.jit` or `eqx.filter_jit` (the function they compile is explained). Nothing
    expensive runs: the program is only traced (a call that may be recognised is timed
    once per pattern: one factorisation, see "Faster without rewriting" in the docs).

    **Returns:**

    A [`deferax.Plan`][]; `print(plan)` shows a table.

    !!! Example

        ```python
        plan = dx.explain(loss, model, data)
        print(plan)
        assert plan.sites[0].schedule == "deferred"
        ```
    """
    compiled = _compiled_function(fun)
    with _jaxpr.setting(_runtime.EXPLAINING_JITTED, compiled is not fun):  # (halves placed as under `jit`)
        if isinstance(compiled, _ValueAndGradWrapper | _GradWrapper):
            return compiled.plan(*args, **kwargs)
        return _plan(compiled, False, "auto", DEFAULT_MAX_BASIS, True, args, kwargs, explaining=True)


def _identity(x):
    return x


# What `jax.jit` and `eqx.filter_jit` make: each keeps the function it compiles as `__wrapped__`.
_JITTED: tuple[type, ...] = (type(jax.jit(_identity)), type(eqx.filter_jit(_identity)))


def _compiled_function(fun):
    """The function that `fun` compiles, through any `jax.jit` and `eqx.filter_jit`
    (`fun` itself if it is neither). It traces what `fun` would: compiling changes where
    the program runs, not the program."""
    while isinstance(fun, _JITTED) and getattr(fun, "__wrapped__", None) is not None:
        fun = fun.__wrapped__
    return fun
