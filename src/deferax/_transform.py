"""`filter_value_and_grad` and `filter_grad`: Equinox's transforms, with the deferred VJP."""

from __future__ import annotations

import collections
import concurrent.futures
import functools as ft
import types
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

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


def _realify(tree, batch_dims: int = 0):
    """Flatten a pytree into one real vector (complex leaves count twice), per batch row."""
    parts = []
    for leaf in jtu.tree_leaves(tree):
        flat = jnp.reshape(leaf, (*leaf.shape[:batch_dims], -1))
        if jnp.iscomplexobj(flat):
            parts += [jnp.real(flat), jnp.imag(flat)]
        else:
            parts.append(flat)
    return jnp.concatenate(parts, axis=-1)


def _replay_basis_primal(x, y, basis, ct_xs, where):
    return y


def _replay_basis_fwd(x, y, basis, ct_xs, where):
    return y, (x, y, basis, ct_xs)


def _replay_basis_bwd(where, residuals, ct_y):
    """`ct_y = sum_j a_j basis_j`: find the `a_j` and combine the precomputed `ct_x`s."""
    x, y, basis, ct_xs = residuals
    matrix = _realify(basis, batch_dims=1)  # (k, m)
    target = _realify(ct_y)  # (m,)
    coefficients = jnp.linalg.lstsq(matrix.T, target)[0]
    residual = jnp.linalg.norm(matrix.T @ coefficients - target)
    scale = jnp.linalg.norm(target) + jnp.finfo(target.dtype).tiny
    tol = 1e-6 if target.dtype == jnp.float64 else 1e-3
    index, name = where
    coefficients = eqx.error_if(
        coefficients, residual > tol * scale, _errors.PROJECTION.format(index=index, name=name, k=matrix.shape[0], tol=tol)
    )
    ct_x = jtu.tree_map(lambda c: jnp.tensordot(coefficients.astype(c.dtype), c, axes=1), ct_xs)
    zeros = jtu.tree_map(_zero_cotangent, (y, basis, ct_xs))
    return (ct_x, *zeros)


_replay_basis = jax.custom_vjp(_replay_basis_primal, nondiff_argnums=(4,))
_replay_basis.defvjp(_replay_basis_fwd, _replay_basis_bwd)


class _Replay:
    """Stage 3: deferred sites return their precomputed output and cotangent; others run."""

    def __init__(self, analysis: Analysis, inputs: dict, ys: dict, ct_xs: dict):
        self.analysis = analysis
        self.inputs = inputs
        self.ys = ys
        self.ct_xs = ct_xs
        self.count = 0

    def call(self, fn, x):
        record = next_record(self.analysis.records, self.count, fn, x)
        self.count += 1
        site = record.index
        if site in self.analysis.basis:
            basis = self.inputs[site][2]
            return _replay_basis(x, self.ys[site], basis, self.ct_xs[site], (site, record.name))
        if site in self.analysis.early:
            return fn.standard_from(x, self.ys[site])
        if site in self.ys:
            return _replay(x, self.ys[site], self.ct_xs[site])
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


class _Identity:
    """Hashes and compares by identity, and keeps the object alive (so its id is not reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return isinstance(other, _Identity) and other.obj is self.obj


_CAPTURE_LIMIT = 256


def _captured(fun) -> tuple[_Identity, ...]:
    """Identities of the objects a plain function reaches through closures and globals.

    Whatever `fun` (and the plain functions it calls, found the same way) reads from a
    closure or a global name is compiled into the cached stages as a constant, as
    `eqx.filter_jit` would. Unlike Equinox's uncompiled `filter_value_and_grad`, the
    cache would then keep using an old array or `ExpensiveFn` after the name is rebound;
    keying on their identities makes a rebinding miss the cache instead.
    """
    found: list[_Identity] = []
    seen: set[int] = set()
    queue = [getattr(fun, "__func__", fun)]
    while queue and len(found) < _CAPTURE_LIMIT:
        fn = queue.pop()
        code = getattr(fn, "__code__", None)
        if code is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        names: list[str] = []
        codes = [code]
        while codes:  # names read by nested functions and lambdas too
            c = codes.pop()
            names += c.co_names
            codes += [k for k in c.co_consts if isinstance(k, types.CodeType)]
        module_globals = getattr(fn, "__globals__", {})
        values = [cell.cell_contents for cell in (fn.__closure__ or ()) if _filled(cell)]
        values += [module_globals[name] for name in names if name in module_globals]
        for value in values:
            if isinstance(value, types.FunctionType):
                queue.append(value)
            elif not isinstance(value, types.ModuleType | type | types.BuiltinFunctionType):
                found.append(_Identity(value))
    return tuple(found)


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell (a name not yet bound)
        return False
    return True


def _cache_key(leaves, split_static, has_aux, schedule, max_basis):
    structs = tuple((jnp.shape(a), jnp.result_type(a), getattr(a, "weak_type", False)) for a in leaves)
    static_leaves, static_def = jtu.tree_flatten(split_static[1])
    captured = tuple(_captured(leaf) for leaf in static_leaves if callable(leaf))
    key = (split_static[0], static_def, tuple(static_leaves), structs, captured, has_aux, schedule, max_basis)
    hash(key)
    return key


class _Compiled:
    """A cached analysis with the jitted cheap stages, for calls outside any transformation."""

    def __init__(self, analysis: Analysis, program: _Program, has_aux: bool, diff_mask: Any):
        self.analysis = analysis
        if analysis.deferred:
            self.stage1 = jax.jit(ft.partial(_stage1, analysis))
            self.stage3 = eqx.filter_jit(ft.partial(_stage3, analysis, program, has_aux, diff_mask))


_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 256


def _basis_cotangents(frontier, leaves, ys, ts, site):
    """The rows of the Jacobian of the frontier with respect to `ys[site]` (exact: the
    frontier is linear in it), one per real number of the frontier, stacked."""

    def frontier_of(y_site):
        ys_ = list(ys)
        ys_[site] = y_site
        return _jaxpr.eval_jaxpr(frontier, *jtu.tree_leaves((leaves, ys_, ts)))

    values, vjp = jax.vjp(frontier_of, ys[site])
    seeds = []
    for i, v in enumerate(values):
        units = [jnp.eye(v.size, dtype=v.dtype)]
        if jnp.iscomplexobj(v):
            units.append(1j * units[0])
        for unit in units:
            rows = unit.shape[0]
            seeds.append(
                [jnp.reshape(unit, (rows, *v.shape)) if j == i else jnp.zeros((rows, *w.shape), w.dtype) for j, w in enumerate(values)]
            )
    batch = [jnp.concatenate([s[j] for s in seeds]) for j in range(len(values))]
    (basis,) = jax.vmap(vjp)(batch)
    return basis


def _stage1(analysis: Analysis, leaves: list) -> dict:
    """Inputs and cotangents of the deferred sites, computed without any expensive call:
    every site's output is a stand-in (zeros), which the static check proved unused."""
    ys = [jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), r.y_struct) for r in analysis.records]
    ts = [jnp.zeros((), jnp.result_type(float)) for _ in analysis.records]
    seed = jnp.ones((), analysis.jaxpr.in_avals[-1].dtype)
    flat = _jaxpr.eval_jaxpr(analysis.jaxpr, *jtu.tree_leaves((leaves, ys, ts, seed)))
    xs, impls, cts = jtu.tree_unflatten(analysis.out_tree, flat)
    inputs = {}
    for i, site in enumerate(analysis.direct):
        if site in analysis.basis:
            inputs[site] = (xs[i], impls[i], _basis_cotangents(analysis.basis[site].frontier, leaves, ys, ts, site))
        elif site in analysis.deferred:
            inputs[site] = (xs[i], impls[i], cts[i])
        elif site in analysis.early:
            inputs[site] = (xs[i], impls[i], None)
    return inputs


def _stage2(analysis: Analysis, inputs: dict, eager: bool):
    """The expensive calls: one `fused` per deferred site (batched over the basis cotangents
    of a basis site), and the `fwd` of the standard sites that need no expensive output.

    Eagerly, they run concurrently on threads. Traced (under `jit` or `vmap`), each is part
    of the surrounding program, where XLA:CPU runs them one after another; when there are
    several and all of them run on the host anyway (`dx.host`), they leave the program
    through one callback that runs them concurrently.
    """
    sites = analysis.deferred + analysis.early
    fns = {site: eqx.combine(inputs[site][1], analysis.records[site].static) for site in sites}

    def impl(site):
        fn = fns[site]
        if site in analysis.early:
            return fn.fwd
        return fn.fused_batch if site in analysis.basis and fn.fused_batch is not None else fn.fused

    def one(site, inputs_):
        x, impl_arrays, ct = inputs_[site]
        fn = eqx.combine(impl_arrays, analysis.records[site].static)
        if site in analysis.basis:
            return fn.run_fused_batch(x, ct)
        if site in analysis.early:
            return fn.primal(x), None
        return fn.run_fused(x, ct)

    def run_all(inputs_):
        if len(sites) > 1:
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(sites)) as pool:
                return list(pool.map(lambda site: one(site, inputs_), sites))
        return [one(site, inputs_) for site in sites]

    on_host = all(getattr(getattr(impl(site), "__self__", None), "runs_on_host", False) for site in sites)
    if eager:
        results = run_all(inputs)
    elif len(sites) > 1 and on_host:
        mine = {site: inputs[site] for site in sites}
        # (traced in this thread: JAX's tracing state does not reach the pool's threads)
        shapes = jax.eval_shape(lambda i: [one(site, i) for site in sites], mine)

        def host(concrete):
            return jtu.tree_map(np.asarray, run_all(concrete))

        results = jax.pure_callback(host, shapes, mine, vmap_method="sequential")
    else:
        results = [one(site, inputs) for site in sites]
    ys = {site: r[0] for site, r in zip(sites, results, strict=True)}
    ct_xs = {site: r[1] for site, r in zip(sites, results, strict=True)}
    return ys, ct_xs


def _stage3(analysis: Analysis, program: _Program, has_aux: bool, diff_mask: Any, leaves, inputs, ys, ct_xs):
    """Value, aux and gradients, with the deferred sites' results replayed."""
    fun, x, args, kwargs = eqx.combine(jtu.tree_unflatten(program.static[0], leaves), program.static[1])
    diff_x, nondiff_x = eqx.partition(x, diff_mask)

    def loss(d):
        return fun(eqx.combine(d, nondiff_x), *args, **kwargs)

    with fresh_pass(), _sites.recording(_Replay(analysis, inputs, ys, ct_xs)):
        return jax.value_and_grad(loss, has_aux=has_aux)(diff_x)


def _value_and_grad(fun, has_aux: bool, schedule: str, max_basis: int, x, args, kwargs):
    if schedule == "standard":
        return eqx.filter_value_and_grad(fun, has_aux=has_aux)(x, *args, **kwargs), None
    diff_mask = jtu.tree_map(eqx.is_inexact_array, x)
    leaves, static = _split(fun, x, args, kwargs)
    program = _Program(static=static)
    eager = _jaxpr.is_eager() and not any(isinstance(a, jax.core.Tracer) for a in leaves)
    compiled = key = None
    if eager:
        try:
            key = _cache_key(leaves, static, has_aux, schedule, max_basis)
        except TypeError:  # an unhashable static part: analyse every call
            key = None
        compiled = _CACHE.get(key) if key is not None else None
        if compiled is not None:
            _CACHE.move_to_end(key)
    if compiled is None:
        structs = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in leaves]
        analysis = analyse(program, structs, has_aux=has_aux, schedule=schedule, max_basis=max_basis, where=_WHERE)
        if eager:
            compiled = _Compiled(analysis, program, has_aux, diff_mask)
            if key is not None:
                _CACHE[key] = compiled
                if len(_CACHE) > _CACHE_SIZE:
                    _CACHE.popitem(last=False)
    analysis = compiled.analysis if compiled is not None else analysis
    if not analysis.deferred:
        return eqx.filter_value_and_grad(fun, has_aux=has_aux)(x, *args, **kwargs), analysis.plan
    if eager:
        inputs = compiled.stage1(leaves)
        ys, ct_xs = _stage2(analysis, inputs, eager=True)
        result = compiled.stage3(leaves, inputs, ys, ct_xs)
    else:
        inputs = _stage1(analysis, leaves)
        ys, ct_xs = _stage2(analysis, inputs, eager=False)
        result = _stage3(analysis, program, has_aux, diff_mask, leaves, inputs, ys, ct_xs)
    return result, analysis.plan


class _ValueAndGradWrapper(eqx.Module):
    _fun: Callable
    _has_aux: bool = eqx.field(static=True)
    _schedule: str = eqx.field(static=True)
    _max_basis: int = eqx.field(static=True)

    @property
    def __wrapped__(self):
        return self._fun

    def __call__(self, *args, **kwargs):
        if not args:
            raise TypeError(_errors.NO_ARGS.format(where=_WHERE))
        x, *rest = args
        return _value_and_grad(self._fun, self._has_aux, self._schedule, self._max_basis, x, tuple(rest), kwargs)[0]

    def plan(self, *args, **kwargs) -> Plan:
        """The schedule that `self(*args, **kwargs)` would run (see [`deferax.explain`][])."""
        if not args:
            raise TypeError(_errors.NO_ARGS.format(where=_WHERE))
        x, *rest = args
        leaves, static = _split(self._fun, x, tuple(rest), kwargs)
        structs = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in leaves]
        return analyse(
            _Program(static=static),
            structs,
            has_aux=self._has_aux,
            schedule=self._schedule,
            max_basis=self._max_basis,
            where=_WHERE,
        ).plan

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


# Measured on a 2-core CPU (benchmarks/bench_basis.py): with k = 1 the forward and one
# adjoint overlap (ratio 0.52 against the standard schedule); with k = 2 the forward and two
# batched adjoints cost more than the standard schedule (1.16). Raise it where adjoints
# batch well (a GPU, a cluster, `dx.host(..., linear_adjoint=True)`).
DEFAULT_MAX_BASIS = 1


def _check_settings(schedule, max_basis):
    if schedule not in _SCHEDULES:
        raise ValueError(_errors.BAD_SCHEDULE.format(where=_WHERE, found=schedule))
    if not isinstance(max_basis, int) or isinstance(max_basis, bool) or max_basis < 0:
        raise ValueError(_errors.BAD_MAX_BASIS.format(where=_WHERE, found=max_basis))


def filter_value_and_grad(fun=None, *, has_aux: bool = False, schedule: str = "auto", max_basis: int = DEFAULT_MAX_BASIS):
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
      with coefficients that depend on outputs). Default 1: a function of one real number
      (a scalar output, a real overlap), which on a CPU costs the forward and one adjoint
      run together. A site's own `ExpensiveFn(max_basis=...)` takes precedence. Raise it
      when the `k` adjoints batch well (a GPU, a cluster, a solver that takes several
      right-hand sides): on a 2-core CPU, `k = 2` batched JAX adjoints made the step 16 %
      slower than the standard schedule (see the benchmarks page).

    **Returns:**

    A function with the signature of `fun` that returns `(value, grads)`, or
    `((value, aux), grads)` with `has_aux=True`.

    Called outside any JAX transformation, the cheap parts of the program (everything but
    the expensive calls) are compiled with `jax.jit` once per input structure, and the
    deferred sites' `fused` calls run eagerly, concurrently when there are several. Inside
    `jax.jit`, `eqx.filter_jit` or `jax.vmap` the whole schedule is traced into the
    surrounding program.
    """
    _check_settings(schedule, max_basis)
    if fun is None:
        return ft.partial(filter_value_and_grad, has_aux=has_aux, schedule=schedule, max_basis=max_basis)
    return eqx.module_update_wrapper(_ValueAndGradWrapper(fun, has_aux, schedule, max_basis))


def filter_grad(fun=None, *, has_aux: bool = False, schedule: str = "auto", max_basis: int = DEFAULT_MAX_BASIS):
    """Equinox's `filter_grad`, running the deferred VJP where it is sound.

    As [`deferax.filter_value_and_grad`][], but returns only the gradients (and `aux`,
    as `(grads, aux)`, with `has_aux=True`).
    """
    _check_settings(schedule, max_basis)
    if fun is None:
        return ft.partial(filter_grad, has_aux=has_aux, schedule=schedule, max_basis=max_basis)
    value_and_grad = _ValueAndGradWrapper(fun, has_aux, schedule, max_basis)
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
    return _ValueAndGradWrapper(fun, False, "auto", DEFAULT_MAX_BASIS).plan(*args, **kwargs)
