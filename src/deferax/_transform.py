"""`filter_value_and_grad` and `filter_grad`: Equinox's transforms, with the deferred VJP."""

from __future__ import annotations

import collections
import concurrent.futures
import functools as ft
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _errors, _jaxpr, _sites
from ._analysis import Analysis, analyse, fresh_pass, next_record
from ._expensive import _zero_cotangent
from ._plan import Plan

_SCHEDULES = ("auto", "standard", "deferred")
_WHERE = "`deferax.filter_value_and_grad`"


def _replay_primal(x, y, ct_x):
    return y


def _replay_fwd(x, y, ct_x):
    return y, (x, y, ct_x)


def _replay_bwd(residuals, ct_y):
    x, y, ct_x = residuals
    # The static check proved that `ct_y` equals the cotangent `fused` was given.
    return ct_x, jtu.tree_map(_zero_cotangent, y), jtu.tree_map(_zero_cotangent, ct_x)


_replay = jax.custom_vjp(_replay_primal)
_replay.defvjp(_replay_fwd, _replay_bwd)


class _Replay:
    """Stage 3: deferred sites return their precomputed output and cotangent; others run."""

    def __init__(self, analysis: Analysis, ys: dict, ct_xs: dict):
        self.analysis = analysis
        self.ys = ys
        self.ct_xs = ct_xs
        self.count = 0

    def call(self, fn, x):
        record = next_record(self.analysis.records, self.count, fn, x)
        self.count += 1
        if record.index in self.ys:
            return _replay(x, self.ys[record.index], self.ct_xs[record.index])
        return fn.standard(x)


class _Program(eqx.Module):
    """The user's function as a function of the array leaves of all its arguments."""

    static: Any = eqx.field(static=True)

    def __call__(self, leaves: list) -> Any:
        fun, x, args, kwargs = eqx.combine(jtu.tree_unflatten(self.static[0], leaves), self.static[1])
        return fun(x, *args, **kwargs)


def _split(fun, x, args, kwargs):
    dynamic, static = eqx.partition((fun, x, args, kwargs), eqx.is_array)
    leaves, treedef = jtu.tree_flatten(dynamic)
    return leaves, (treedef, static)


def _cache_key(leaves, split_static, has_aux, schedule):
    structs = tuple((jnp.shape(a), jnp.result_type(a), getattr(a, "weak_type", False)) for a in leaves)
    static_leaves, static_def = jtu.tree_flatten(split_static[1])
    key = (split_static[0], static_def, tuple(static_leaves), structs, has_aux, schedule)
    hash(key)
    return key


class _Compiled:
    """A cached analysis with the jitted cheap stages, for calls outside any transformation."""

    def __init__(self, analysis: Analysis, program: _Program, has_aux: bool, diff_mask: Any):
        self.analysis = analysis
        self.stage1 = jax.jit(ft.partial(_jaxpr.eval_jaxpr, analysis.jaxpr))
        self.stage3 = eqx.filter_jit(ft.partial(_stage3, analysis, program, has_aux, diff_mask))


_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 256


def _inputs(analysis: Analysis, flat_out: list):
    xs, impls, cts = jtu.tree_unflatten(analysis.out_tree, flat_out)
    return {site: (xs[i], impls[i], cts[i]) for i, site in enumerate(analysis.direct)}


def _stage1_args(analysis: Analysis, leaves: list, seed_dtype) -> list:
    ys = [jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), r.y_struct) for r in analysis.records]
    ts = [jnp.zeros((), jnp.result_type(float)) for _ in analysis.records]
    return jtu.tree_leaves((leaves, ys, ts, jnp.ones((), seed_dtype)))


def _run_fused(analysis: Analysis, inputs: dict, eager: bool):
    """Stage 2: one `fused(x, ct_y)` per deferred site; concurrently when running eagerly."""
    def one(site):
        x, impl, ct = inputs[site]
        fn = eqx.combine(impl, analysis.records[site].static)
        return fn.run_fused(x, ct)

    sites = analysis.deferred
    if eager and len(sites) > 1:
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(sites)) as pool:
            results = list(pool.map(one, sites))
    else:
        results = [one(site) for site in sites]
    ys = {site: r[0] for site, r in zip(sites, results, strict=True)}
    ct_xs = {site: r[1] for site, r in zip(sites, results, strict=True)}
    return ys, ct_xs


def _stage3(analysis: Analysis, program: _Program, has_aux: bool, diff_mask: Any, leaves, ys, ct_xs):
    """Value, aux and gradients, with the deferred sites' results replayed."""
    fun, x, args, kwargs = eqx.combine(jtu.tree_unflatten(program.static[0], leaves), program.static[1])
    diff_x, nondiff_x = eqx.partition(x, diff_mask)

    def loss(d):
        return fun(eqx.combine(d, nondiff_x), *args, **kwargs)

    with fresh_pass(), _sites.recording(_Replay(analysis, ys, ct_xs)):
        return jax.value_and_grad(loss, has_aux=has_aux)(diff_x)


def _value_and_grad(fun, has_aux: bool, schedule: str, x, args, kwargs):
    diff_mask = jtu.tree_map(eqx.is_inexact_array, x)
    if schedule == "standard":
        return eqx.filter_value_and_grad(fun, has_aux=has_aux)(x, *args, **kwargs), None
    leaves, static = _split(fun, x, args, kwargs)
    program = _Program(static=static)
    eager = _jaxpr.is_eager() and not any(isinstance(a, jax.core.Tracer) for a in leaves)
    compiled = None
    if eager:
        try:
            key = _cache_key(leaves, static, has_aux, schedule)
        except TypeError:
            key = None
        compiled = _CACHE.get(key) if key is not None else None
        if compiled is not None:
            _CACHE.move_to_end(key)
    if compiled is None:
        structs = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in leaves]
        analysis = analyse(program, structs, has_aux=has_aux, schedule=schedule, where=_WHERE)
        if eager and analysis.deferred:
            compiled = _Compiled(analysis, program, has_aux, diff_mask)
            if key is not None:
                _CACHE[key] = compiled
                if len(_CACHE) > _CACHE_SIZE:
                    _CACHE.popitem(last=False)
    else:
        analysis = compiled.analysis
    if not analysis.deferred:
        return eqx.filter_value_and_grad(fun, has_aux=has_aux)(x, *args, **kwargs), analysis.plan

    seed_dtype = _seed_dtype(analysis)
    stage1_in = _stage1_args(analysis, leaves, seed_dtype)
    if compiled is not None:
        inputs = _inputs(analysis, compiled.stage1(*stage1_in))
        ys, ct_xs = _run_fused(analysis, inputs, eager=True)
        result = compiled.stage3(leaves, ys, ct_xs)
    else:
        inputs = _inputs(analysis, _jaxpr.eval_jaxpr(analysis.jaxpr, *stage1_in))
        ys, ct_xs = _run_fused(analysis, inputs, eager=False)
        result = _stage3(analysis, program, has_aux, diff_mask, leaves, ys, ct_xs)
    value, grads = result
    return (value, grads), analysis.plan


def _seed_dtype(analysis: Analysis):
    return analysis.jaxpr.in_avals[-1].dtype


class _ValueAndGradWrapper(eqx.Module):
    _fun: Callable
    _has_aux: bool = eqx.field(static=True)
    _schedule: str = eqx.field(static=True)

    @property
    def __wrapped__(self):
        return self._fun

    def __call__(self, *args, **kwargs):
        if not args:
            raise TypeError(_errors.NO_ARGS.format(where=_WHERE))
        x, *rest = args
        return _value_and_grad(self._fun, self._has_aux, self._schedule, x, tuple(rest), kwargs)[0]

    def plan(self, *args, **kwargs) -> Plan:
        """The schedule that `self(*args, **kwargs)` would run (see [`deferax.explain`][])."""
        if not args:
            raise TypeError(_errors.NO_ARGS.format(where=_WHERE))
        x, *rest = args
        diff_x, nondiff_x = eqx.partition(x, eqx.is_inexact_array)
        leaves, static = _split(self._fun, x, tuple(rest), kwargs)
        structs = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in leaves]
        schedule = self._schedule
        return analyse(_Program(static=static), structs, has_aux=self._has_aux, schedule=schedule, where=_WHERE).plan

    def __get__(self, instance, owner):
        if instance is None:
            return self
        return eqx.Partial(self, instance)


class _GradWrapper(eqx.Module):
    _fun_value_and_grad: _ValueAndGradWrapper
    _has_aux: bool = eqx.field(static=True)

    @property
    def __wrapped__(self):
        return self._fun_value_and_grad.__wrapped__

    def __call__(self, /, *args, **kwargs):
        value, grad = self._fun_value_and_grad(*args, **kwargs)
        if self._has_aux:
            _, aux = value
            return grad, aux
        return grad

    def plan(self, *args, **kwargs) -> Plan:
        """The schedule that `self(*args, **kwargs)` would run (see [`deferax.explain`][])."""
        return self._fun_value_and_grad.plan(*args, **kwargs)

    def __get__(self, instance, owner):
        if instance is None:
            return self
        return eqx.Partial(self, instance)


def _check_schedule(schedule):
    if schedule not in _SCHEDULES:
        raise ValueError(_errors.BAD_SCHEDULE.format(where=_WHERE, found=schedule))


def filter_value_and_grad(fun=None, *, has_aux: bool = False, schedule: str = "auto"):
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

    **Returns:**

    A function with the signature of `fun` that returns `(value, grads)`, or
    `((value, aux), grads)` with `has_aux=True`.

    Called outside any JAX transformation, the cheap parts of the program (everything but
    the expensive calls) are compiled with `jax.jit` once per input structure, and the
    deferred sites' `fused` calls run eagerly, concurrently when there are several. Inside
    `jax.jit`, `eqx.filter_jit` or `jax.vmap` the whole schedule is traced into the
    surrounding program.
    """
    _check_schedule(schedule)
    if fun is None:
        return ft.partial(filter_value_and_grad, has_aux=has_aux, schedule=schedule)
    return eqx.module_update_wrapper(_ValueAndGradWrapper(fun, has_aux, schedule))


def filter_grad(fun=None, *, has_aux: bool = False, schedule: str = "auto"):
    """Equinox's `filter_grad`, running the deferred VJP where it is sound.

    As [`deferax.filter_value_and_grad`][], but returns only the gradients (and `aux`,
    as `(grads, aux)`, with `has_aux=True`).
    """
    _check_schedule(schedule)
    if fun is None:
        return ft.partial(filter_grad, has_aux=has_aux, schedule=schedule)
    value_and_grad = _ValueAndGradWrapper(fun, has_aux, schedule)
    return eqx.module_update_wrapper(_GradWrapper(value_and_grad, has_aux))


def explain(fun, *args, **kwargs) -> Plan:
    """Show which schedule each expensive call site of `fun` gets, and why.

    `fun` is a function made by [`deferax.filter_value_and_grad`][] or
    [`deferax.filter_grad`][] (its `has_aux` and `schedule` are used), or a plain loss
    function (analysed as `filter_value_and_grad(fun)` would). Nothing expensive runs: the
    program is only traced.

    **Returns:**

    A [`deferax.Plan`][]; `print(plan)` shows a table.

    !!! Example

        ```python
        plan = dx.explain(loss, model, data)
        print(plan)
        assert plan.sites[0].schedule == "deferred"
        ```
    """
    if isinstance(fun, _ValueAndGradWrapper | _GradWrapper):
        return fun.plan(*args, **kwargs)
    return _ValueAndGradWrapper(fun, False, "auto").plan(*args, **kwargs)
