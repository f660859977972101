"""`host`: an `ExpensiveFn` whose implementations are host functions (NumPy, SciPy, C++, a
remote service), run on an executor through `jax.pure_callback`."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools as ft
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .. import _jaxpr, _runtime
from .._checks import _checks, _messages
from .._implementation._abstract import AbstractImplementation, Implementation
from .._implementation._expensive import ExpensiveFn
from .._jaxpr import is_concrete, shape_text, stacked, structs
from .._plan._cost import Cost
from . import _executor
from ._runner import Identity, Runner


def _raw(tree: PyTree) -> PyTree:
    """`tree` with each typed PRNG key (the extended dtype `key<fry>`, say) as its raw data
    (`jax.random.key_data`, `uint32`): what a host function gets, as `jax.pure_callback`
    hands a callback."""

    def raw(a):
        return jax.random.key_data(a) if jnp.issubdtype(jnp.result_type(a), jax.dtypes.prng_key) else a

    return jtu.tree_map(raw, tree)


_KEY_OUT = """{call}: {what} declares a typed PRNG key ({found}), but a host function returns NumPy arrays, \
which cannot
hold one (nor can `jax.pure_callback` return one). Declare the key's raw data, and wrap it after the call:

    data = sim(x)                       # out=jax.ShapeDtypeStruct((2,), jnp.uint32)
    key = jax.random.wrap_key_data(data)"""


def _check_declared(call: str, what: str, declared: PyTree) -> PyTree:
    _checks.check_declared_width(call, what, declared)
    keys = [s for s in jtu.tree_leaves(declared) if jnp.issubdtype(s.dtype, jax.dtypes.prng_key)]
    if keys:
        raise TypeError(_KEY_OUT.format(call=call, what=what, found=shape_text(keys[0])))
    return declared


def _identity(x: PyTree, y: PyTree, partial: PyTree) -> PyTree:
    """The default `combine`: the adjoint's result is the input cotangent."""
    return partial


class _Host(eqx.Module):
    """A host `ExpensiveFn`'s implementations, as JAX functions: each leaves the program
    through one `jax.pure_callback` (or calls the host functions directly when its
    arguments are concrete arrays). With `partials` (`with_partials`), `bwd`, `fused` and
    `fused_batch` return what `adjoint` would (`adjoint_out`), and `combine` makes `ct_x` of
    it inside the program."""

    runner: Runner = eqx.field(static=True)
    combine: Callable[..., Any]
    out: Any = eqx.field(static=True)  # (declared structures: configuration, as `ExpensiveFn.out`)
    adjoint_out: Any = eqx.field(static=True)
    partials: bool = eqx.field(static=True, default=False)
    # a JAX function of `x` that computes `y` and that JAX can differentiate to every order
    # (`with_higher_order`), or None: the site has first derivatives only
    higher_order: Any = eqx.field(static=True, default=None)

    def _out(self, x: PyTree) -> PyTree:
        declared = self.out(structs(x)) if callable(self.out) else self.out
        return _check_declared(self.runner.call, "`out=`", declared)

    def _adjoint_out(self, x: PyTree) -> PyTree:
        if self.adjoint_out is None:
            return structs(_raw(x))
        declared = self.adjoint_out(structs(x)) if callable(self.adjoint_out) else self.adjoint_out
        return _check_declared(self.runner.call, "`adjoint_out=`", declared)

    def _run(self, kind: str, args: tuple, result: PyTree) -> PyTree:
        runner = self.runner
        shapes = tuple(s.shape for s in jtu.tree_leaves(structs(args[0])))  # (as the site's `Spec` has them)
        args = _raw(args)
        arg_structs = structs(args)
        if is_concrete(args):
            args = jtu.tree_map(np.asarray, args)
            out = jtu.tree_map(jnp.asarray, runner(kind, result, arg_structs, shapes, *args))
            # (from a callback, `out` is dropped when it leaves as NumPy: nothing to adopt)
            if runner.adopt is not None and not _runtime.IN_CALLBACK.get():
                runner.adopt(kind, args, out)
            return out
        # (with the caller's context: the site's name and schedule, for the recording)
        callback = _jaxpr.carry_context(ft.partial(runner, kind, result, arg_structs, shapes))
        try:
            return jax.pure_callback(callback, result, *args, vmap_method="expand_dims")
        except ValueError as e:  # (JAX's own message names neither the site nor what is supported)
            if "do not support JVP" not in str(e):
                raise
            impl = {"jvp*k": "jvp", "fused*k": "fused", "fwd+adjoint": "adjoint", "fwd+adjoints": "adjoint"}
            impl = impl.get(kind, kind)
            raise TypeError(_messages.second_order(runner.call, impl)) from e

    def _combine(self, x: PyTree, y: PyTree, partial: PyTree) -> PyTree:
        """`combine(x, y, partial)`; a wrong result is reported as `combine`'s (it would
        otherwise be blamed on the `bwd` or `fused` made from it, which the user never wrote)."""
        if self.combine is _identity:
            return partial
        return _checks.checked_ct_x(self.runner.call, "combine", self.combine(x, y, partial), x)

    def _reverse_out(self, x: PyTree) -> PyTree:
        """The structure of what `bwd` and `fused` return besides `y`: `ct_x`, or with
        `partials` the adjoint's result."""
        return self._adjoint_out(x) if self.partials else structs(_raw(x))

    def _reverse(self, x: PyTree, y: PyTree, result: PyTree) -> PyTree:
        """`ct_x` from what `bwd` or `fused` returned besides `y`."""
        return self._combine(x, y, result) if self.partials else result

    def fwd(self, x: PyTree) -> PyTree:
        return self._run("fwd", (x,), self._out(x))

    def bwd(self, x: PyTree, y: PyTree, ct_y: PyTree) -> PyTree:
        if self.runner.adjoint is not None:
            return self._combine(x, y, self._run("adjoint", (x, ct_y), self._adjoint_out(x)))
        return self._reverse(x, y, self._run("bwd", (x, y, ct_y), self._reverse_out(x)))

    def fused(self, x: PyTree, ct_y: PyTree) -> tuple[PyTree, PyTree]:
        if self.runner.fused is not None:
            y, result = self._run("fused", (x, ct_y), (self._out(x), self._reverse_out(x)))
            return y, self._reverse(x, y, result)
        y, partial = self._run("fwd+adjoint", (x, ct_y), (self._out(x), self._adjoint_out(x)))
        return y, self._combine(x, y, partial)

    def jvp(self, x: PyTree, t_x: PyTree) -> tuple[PyTree, PyTree]:
        return self._run("jvp", (x, t_x), (self._out(x), self._out(x)))

    def jvp_batch(self, x: PyTree, t_xs: PyTree) -> tuple[PyTree, PyTree]:
        k = jtu.tree_leaves(t_xs)[0].shape[0]
        kind = "jvp_batch" if self.runner.jvp_batch is not None else "jvp*k"
        return self._run(kind, (x, t_xs), (self._out(x), stacked(self._out(x), k)))

    def fused_batch(self, x: PyTree, cts: PyTree) -> tuple[PyTree, PyTree]:
        """The forward and `k` adjoints: the user's `fused_batch` in one job when given (as
        the estimates assume: `batch_in_one_job`), else `fwd` and `k` `adjoint` jobs, else
        `fused` once per cotangent."""
        k = jtu.tree_leaves(cts)[0].shape[0]
        if self.runner.fused_batch is None and self.runner.fwd is not None and self.runner.adjoint is not None:
            y, partials = self._run("fwd+adjoints", (x, cts), (self._out(x), stacked(self._adjoint_out(x), k)))
            return y, jax.vmap(ft.partial(self._combine, x, y))(partials)
        kind = "fused_batch" if self.runner.fused_batch is not None else "fused*k"
        y, results = self._run(kind, (x, cts), (self._out(x), stacked(self._reverse_out(x), k)))
        if not self.partials:
            return y, results
        return y, jax.vmap(ft.partial(self._combine, x, y))(results)


_METHODS = {
    "fwd": _Host.fwd,
    "bwd": _Host.bwd,
    "fused": _Host.fused,
    "fused_batch": _Host.fused_batch,
    "jvp": _Host.jvp,
    "jvp_batch": _Host.jvp_batch,
}


class HostImplementation(AbstractImplementation):
    """One implementation of a host `ExpensiveFn` (`impl`: "fwd", "bwd", "fused", ...), as
    the `ExpensiveFn` calls it. Its jobs are recorded where they run, on the executor;
    under `jit`, the stages gather several sites' host work into one callback."""

    host: _Host
    impl: str = eqx.field(static=True)
    runs_on_host: ClassVar[bool] = True  # pyright: ignore[reportIncompatibleVariableOverride]  (an eqx.AbstractClassVar: pyright#4965)

    @property
    def batch_in_one_job(self) -> bool:
        runner = self.host.runner
        return (runner.jvp_batch if self.impl == "jvp_batch" else runner.fused_batch) is not None

    @property
    def jobs_at_once(self) -> int:
        runner = self.host.runner
        return _executor.jobs_at_once(runner.executor) if runner.thread_safe else 1

    @property
    def timings_key(self) -> Any:
        return self.host.runner.key

    @property
    def batch_jobs_are_fused(self) -> bool:  # (as `_Host.fused_batch` runs them)
        runner = self.host.runner
        return runner.fused_batch is None and (runner.fwd is None or runner.adjoint is None)

    def __call__(self, *args: Any) -> Any:
        return _METHODS[self.impl](self.host, *args)


_NO_OUT = """{call}: host functions cannot be traced by JAX, so the output's shape and dtype must be declared \
with `out=`,
a pytree of `jax.ShapeDtypeStruct` (or a function from the input's structure to one):

    {example}"""

_NO_PRIMAL = """{call}: nothing computes the output. Give the forward host function `fwd(x) -> y`, or `fused(x, \
ct_y) -> (y, ct_x)`:

    dx.host(simulate, adjoint=simulate_adjoint, out=...)"""

_BATCH_WITHOUT_FUSED = """{call}: `fused_batch` was given without `fused`. It serves the deferred-basis \
schedule; the deferred
schedule needs `fused(x, ct_y) -> (y, ct_x)` for one cotangent:

    dx.host(simulate, bwd=..., fused=simulate_and_adjoint, fused_batch=simulate_and_adjoints, out=...)"""


# `executor` and `timeout` typed `Any`: a wrong value must reach the checks below, whose messages name the function.
def host(
    fwd: Implementation | None = None,
    *,
    adjoint: Implementation | None = None,
    combine: Implementation | None = None,
    bwd: Implementation | None = None,
    fused: Implementation | None = None,
    fused_batch: Implementation | None = None,
    jvp: Implementation | None = None,
    jvp_batch: Implementation | None = None,
    out: Any = None,
    adjoint_out: Any = None,
    name: str | None = None,
    executor: Any = None,
    timeout: Any = None,
    vectorized: bool = False,
    linear_adjoint: bool = False,
    max_basis: int | None = None,
    max_tangents: int | None = None,
    prefer: str | None = None,
    thread_safe: bool = True,
    cost: Any = None,
    higher_order: Any = None,
) -> ExpensiveFn:
    """Make a [`deferax.ExpensiveFn`][] from host functions: NumPy, SciPy, a C++ solver, a job
    on a cluster.

    The host functions take and return NumPy arrays (pytrees of them); a typed PRNG key
    (`jax.random.key`) in the input reaches them as its raw data (`jax.random.key_data`,
    `uint32`), as `jax.pure_callback` hands one to a callback. They reach the JAX
    program through `jax.pure_callback`, so the result works under `jax.jit`, `jax.vmap`,
    `jax.grad` and on every schedule of [`deferax.filter_value_and_grad`][]; called on
    concrete arrays (outside `jit`), they are called directly and their exceptions are
    ordinary Python exceptions. Every call is submitted to `executor`.

    **Arguments:**

    - `fwd`: `fwd(x) -> y`, the forward solve.
    - `adjoint`: `adjoint(x, ct_y) -> partial`, the adjoint solve. It does not get `y`, so
      the deferred schedules run it *at the same time* as `fwd`: both are submitted to the
      executor together.
    - `combine`: `combine(x, y, partial) -> ct_x`, the cheap step that needs `y` (for
      example `ct_eps = -k0**2 * Re(E * lambda)`). A JAX function (it runs inside the
      program, not on the host). Default: `partial` is `ct_x`.
    - `bwd`: `bwd(x, y, ct_y) -> ct_x`, instead of `adjoint` for a derivative that needs
      `y` from the start. Such a function stays on the standard schedule.
    - `fused`: `fused(x, ct_y) -> (y, ct_x)`, optional: a host function that does both
      (sharing a factorisation, say). Used instead of `fwd` + `adjoint` on the deferred
      schedule.
    - `fused_batch`: `fused_batch(x, cts) -> (y, ct_xs)`, optional, with `fused`: the
      forward and `k` adjoints in one job (`cts` and `ct_xs` stack the `k` cotangents on a
      leading axis), for the deferred-basis schedule: one factorisation for the forward
      and all the adjoint right-hand sides. It takes the place of `fwd` and the `k`
      adjoints there, even where those are given too. Without it, that schedule submits
      `fwd` and the `k` adjoints together, or, with no `adjoint`, `fused` once per
      cotangent.
    - `jvp`: `jvp(x, t_x) -> (y, t_y)`, optional: the forward-mode derivative with the
      primal (a tangent solve). `jvp_batch`: `jvp_batch(x, t_xs) -> (y, t_ys)` for `k`
      tangents stacked on a leading axis (one factorisation for all); without it, the `k`
      calls of `jvp` are submitted to the executor together. See
      [Forward and reverse mode](../forward-reverse.md).
    - `out`: the structure of `y`: a pytree of `jax.ShapeDtypeStruct`, or a function from
      the input's structure to one. Required. Host results must match the declared shapes
      and dtypes exactly, as for `jax.pure_callback` (in JAX's default 32-bit mode, return
      `float32` arrays, or turn on `jax_enable_x64`).
    - `adjoint_out`: the structure of what `adjoint` returns, likewise; default: that of
      `x` (the right one when `combine` is the identity).
    - `name`: shown in errors and in [`deferax.explain`][]; default: `fwd.__name__`.
    - `executor`: any `concurrent.futures.Executor`: a `ThreadPoolExecutor`, a
      `ProcessPoolExecutor`, a Dask cluster's `distributed.Client(...).get_executor()`; or
      a Dask `distributed.Client` itself, whose jobs go through `client.get_executor()`
      and which tells the estimates how many worker threads the cluster has (an executor
      made by `get_executor()` does not: it counts as one worker). Default: a thread pool
      shared by all host functions. A pool of yours does not make its size public: it
      counts as the cores, or as `cost=dx.Cost(workers=n)` says. For a process pool or
      Dask, the host functions must be picklable; that is checked here. deferax keeps no
      executor beyond the sites made with it (and the compiled programs that contain them).
    - `timeout`: seconds to wait for the jobs of one call; then a [`deferax.HostError`][]
      is raised. Default: no limit.
    - `vectorized`: `False` (default): each host function is called on one example at a
      time; under `jax.vmap` the examples of a batch are submitted to the executor
      together, one job each. `True`: each host function takes a leading batch axis on
      every argument and returns one on every result (of length 1 when there is no batch),
      and gets a whole batch in one call.
    - `linear_adjoint`: declare that `adjoint` is linear in `ct_y` over the cotangent's
      numbers, complex ones included: `adjoint(x, c * ct) == c * adjoint(x, ct)` (true for a
      linear solve with the cotangent as right-hand side). Then, on the deferred-basis
      schedule, a basis cotangent that is a multiple of another (an overlap `|<m, E>|^2`
      gives `m` and `1j * m`) or zero is not solved again, and the estimates that choose
      the schedule count such a pair as one adjoint (`linear=True` in the site's
      [`deferax.Cost`][], added to the `cost` given); the site is planned like any other.
    - `max_basis`, `max_tangents`, `prefer`, `cost`: as for [`deferax.ExpensiveFn`][]
      (`cost`: a [`deferax.Cost`][]; with `fused_batch`, give its `setup`: the work one
      job does once for the forward and every adjoint).
    - `thread_safe`: `False` when the host functions share one workspace (a C or Fortran
      solver): their jobs are then submitted one at a time, never two at once (see
      [`deferax.set_concurrency`][]).
    - `higher_order`: optional: `higher_order(x) -> y`, a JAX function that computes the
      same `y` and that JAX can differentiate to every order: the host solve inside
      `jax.lax.custom_linear_solve` for a linear solve (as [`deferax.sparse_solve`][] does),
      or a `jax.custom_jvp` of yours whose rule JAX can differentiate. Second order needs
      it: where a derivative of the site is itself differentiated (`jax.hessian`, `jax.jvp`
      of `jax.grad`, a loss that takes a gradient inside `dx.filter_value_and_grad`, a
      gradient traced into a jaxpr and differentiated from there), JAX differentiates
      `higher_order` instead; without it, that is refused. It also gives forward mode where
      no `jvp` is given. It is not called otherwise: first derivatives keep the host
      functions above and their schedules.

    **Returns:**

    An [`deferax.ExpensiveFn`][]. With `fwd` and `adjoint` it has `fwd`, `bwd`
    (`combine(x, y, adjoint(x, ct_y))`), `fused` (forward and adjoint submitted together)
    and `fused_batch` (the forward once and `k` adjoints, all submitted together; a
    `fused_batch` given is one job instead).

    !!! Example

        ```python
        import jax, jax.numpy as jnp, numpy as np
        import deferax as dx

        jax.config.update("jax_enable_x64", True)  # NumPy computes in float64
        A = np.array([[2.0, 1.0], [1.0, 3.0]])

        solve = dx.host(
            lambda b: np.linalg.solve(A, b),                  # y = A^-1 b
            adjoint=lambda b, ct: np.linalg.solve(A.T, ct),   # ct_b = A^-T ct_y
            out=jax.ShapeDtypeStruct((2,), jnp.float64),
            name="solve",
        )
        dx.filter_value_and_grad(lambda b: jnp.sum(solve(b)))(jnp.array([1.0, 2.0]))
        ```
    """
    impls = {"fwd": fwd, "adjoint": adjoint, "combine": combine, "bwd": bwd, "fused": fused, "fused_batch": fused_batch}
    impls |= {"jvp": jvp, "jvp_batch": jvp_batch}
    name = _checks.default_name(impls) if name is None else name
    call = _checks.title(name)
    _checks.check_implementations(call, impls)
    if fwd is None and fused is None and jvp is None and jvp_batch is None:
        raise TypeError(_NO_PRIMAL.format(call=call))
    if out is None:
        raise TypeError(_NO_OUT.format(call=call, example=_messages.out_example("dx.host", impls)))
    _checks.check_adjoint_split(call, adjoint, bwd, combine=combine, adjoint_out=adjoint_out)
    if fused_batch is not None and fused is None:
        raise TypeError(_BATCH_WITHOUT_FUSED.format(call=call))
    if higher_order is not None and not callable(higher_order):
        raise TypeError(_BAD_HIGHER_ORDER.format(call=call, found=_messages.tree_text(higher_order)))
    executor = _checked_executor(call, executor)
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"{call}: `timeout` must be a positive number of seconds or None, but got {timeout!r}.")
        timeout = float(timeout)
    if executor is not None:
        _executor.check_picklable(call, executor, {k: v for k, v in impls.items() if v is not None and k != "combine"})
    if adjoint_out is not None:
        adjoint_why = "declared by `adjoint_out=`"
    else:
        adjoint_why = "shaped like the input `x`, the default of `adjoint_out=`"
    runner = Runner(
        call=call,
        name=name,
        fwd=fwd,
        adjoint=adjoint,
        bwd=bwd,
        fused=fused,
        executor=executor,
        timeout=timeout,
        vectorized=vectorized,
        linear_adjoint=linear_adjoint,
        adjoint_why=adjoint_why,
        jvp=jvp,
        jvp_batch=jvp_batch,
        thread_safe=thread_safe,
        fused_batch=fused_batch,
        key=Identity(fwd, adjoint, bwd, fused, fused_batch, jvp, jvp_batch),
        # (a wrong `cost` reaches the check of `ExpensiveFn`)
        workers=cost.workers if isinstance(cost, Cost) else None,
    )
    h = _Host(runner, combine if combine is not None else _identity, out, adjoint_out, higher_order=higher_order)
    deferrable = fused is not None or (fwd is not None and adjoint is not None)
    given = {
        "fwd": fwd is not None,
        "bwd": adjoint is not None or bwd is not None,
        "fused": deferrable,
        "fused_batch": deferrable,
        "jvp": jvp is not None,
        # with `jvp` alone, its calls for several tangents are submitted together
        "jvp_batch": jvp is not None or jvp_batch is not None,
    }
    implementations = {impl: HostImplementation(h, impl) if on else None for impl, on in given.items()}
    if linear_adjoint and (cost is None or isinstance(cost, Cost)):
        # A complex-linear adjoint answers a complex overlap's two basis cotangents with one
        # solve: the estimates count `ceil(k / 2)` adjoints (a wrong `cost` reaches the check)
        cost = dataclasses.replace(Cost() if cost is None else cost, linear=True)
    return ExpensiveFn(
        **implementations,
        name=name,
        out=out,
        max_basis=max_basis,
        max_tangents=max_tangents,
        prefer=prefer,
        thread_safe=thread_safe,
        cost=cost,
    )


_BAD_HIGHER_ORDER = """{call}: `higher_order` must be a JAX function of `x` that returns `y` (one JAX can \
differentiate to
every order), or None, but got {found}."""


def timing_its_own(fn: ExpensiveFn, key: Any, **hooks: Any) -> ExpensiveFn:
    """`fn`, made by `host`, with its jobs not timed by the runner: for host functions that
    time their own parts, finer, under the identity `key` and the same input shapes
    (`dx.sparse_solve`: a factorisation apart from each right-hand side). Each job gathers
    what they observe, and each request feeds it to the estimates as one sample. `hooks`:
    the runner's `scope`, `adopt` and `rows` (see `Runner`)."""
    return _with_runner(fn, timed=False, key=key, **hooks)


def with_partials(fn: ExpensiveFn, combine: Callable[..., Any], adjoint_out: Any) -> ExpensiveFn:
    """`fn`, made by `host` with `bwd` or `fused` (and no `adjoint`), whose host functions
    return the adjoint's result `partial` (structured as `adjoint_out` declares) in place of
    `ct_x`, and `combine(x, y, partial) -> ct_x`, a JAX function, makes the cotangent inside
    the program, as for `adjoint`. For a cotangent much larger than the adjoint's result,
    cheaper made there than sent back: `dx.sparse_solve`'s `lam` against `ct_values`."""
    impls = _implementations(fn)
    h = next(iter(impls.values())).host
    assert h.runner.adjoint is None, "with `adjoint`, `combine` applies to its result already"
    h = dataclasses.replace(h, combine=combine, adjoint_out=adjoint_out, partials=True)
    return dataclasses.replace(fn, **{impl: HostImplementation(h, impl) for impl in impls})


def with_higher_order(fn: ExpensiveFn, higher_order: Callable[[Any], Any]) -> ExpensiveFn:
    """`fn`, made by `host`, differentiable to every order: where an outer differentiation
    will differentiate its derivative (`jax.hessian`, `jax.jvp` of `jax.grad`), its JVP rule
    differentiates `higher_order(x)`, a JAX function that computes the same `y` (its own
    host calls inside, in a form JAX differentiates: `dx.sparse_solve`'s
    `jax.lax.custom_linear_solve`). Its first derivatives keep the site's schedules."""
    impls = _implementations(fn)
    h = dataclasses.replace(next(iter(impls.values())).host, higher_order=higher_order)
    return dataclasses.replace(fn, **{impl: HostImplementation(h, impl) for impl in impls})


def on_executor(fn: ExpensiveFn, executor: Any) -> ExpensiveFn:
    """`fn`, made by `host` with no executor, with its jobs submitted to `executor`, checked
    as `host` checks it (its host functions' pickling once per kind of executor). For a
    site kept in a cache (`dx.sparse_solve`'s): the cache holds no executor of the caller's."""
    runner = _runner_of(fn)
    executor = _checked_executor(runner.call, executor)
    if executor is None:
        return fn
    _check_picklable(runner, _executor.transport(executor))
    return _with_runner(fn, executor=executor)


_BAD_EXECUTOR = """{call}: `executor` must be a `concurrent.futures.Executor` (a `ThreadPoolExecutor`, a \
`ProcessPoolExecutor`,
`distributed.Client(...).get_executor()`), a Dask `distributed.Client`, or None for deferax's thread pool, but got \
{found!r}."""


def _checked_executor(call: str, executor: Any) -> Any:
    """`executor=` as jobs are submitted to it (a Dask `distributed.Client` wrapped), or the
    error that says what it may be."""
    executor = _executor.as_executor(executor)
    if executor is not None and not isinstance(executor, cf.Executor):
        raise TypeError(_BAD_EXECUTOR.format(call=call, found=executor))
    return executor


@_runtime.cached(maxsize=64)
def _check_picklable(runner: Runner, transport: tuple[str, str] | None) -> None:
    """Raise if a host function of `runner` (one with no executor) cannot travel by `transport`."""
    if transport is not None:
        names = ("fwd", "adjoint", "bwd", "fused", "fused_batch", "jvp", "jvp_batch")
        impls = {impl: getattr(runner, impl) for impl in names}
        _executor.check_transport(runner.call, *transport, {k: v for k, v in impls.items() if v is not None})


def _runner_of(fn: ExpensiveFn) -> Runner:
    return next(i.host.runner for i in _implementations(fn).values())


def _implementations(fn: ExpensiveFn) -> dict[str, HostImplementation]:
    impls = {impl: getattr(fn, impl) for impl in _METHODS}
    return {impl: i for impl, i in impls.items() if isinstance(i, HostImplementation)}


def _with_runner(fn: ExpensiveFn, **changes: Any) -> ExpensiveFn:
    """`fn`, made by `host`, with `changes` to its runner."""
    impls = _implementations(fn)
    h = next(iter(impls.values())).host
    h = dataclasses.replace(h, runner=dataclasses.replace(h.runner, **changes))
    return dataclasses.replace(fn, **{impl: HostImplementation(h, impl) for impl in impls})
