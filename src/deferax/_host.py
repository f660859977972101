"""`host`: an `ExpensiveFn` whose implementations are host functions (NumPy, SciPy, C++, a
remote service), run on an executor through `jax.pure_callback`."""

from __future__ import annotations

import concurrent.futures as cf
import functools as ft
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from . import _errors, _executor, _jaxpr
from ._concurrent import is_concrete
from ._expensive import ExpensiveFn, _struct, check_ct_x, check_declared_width, check_signature
from ._host_jobs import Runner

NO_OUT = """{call}: host functions cannot be traced by JAX, so the output's shape and dtype must be declared with `out=`,
a pytree of `jax.ShapeDtypeStruct` (or a function from the input's structure to one):

    {example}"""

NO_PRIMAL = """{call}: nothing computes the output. Give the forward host function `fwd(x) -> y`, or `fused(x, ct_y) -> (y, ct_x)`:

    dx.host(simulate, adjoint=simulate_adjoint, out=...)"""


BAD_EXECUTOR = """{call}: `executor` must be a `concurrent.futures.Executor` (a `ThreadPoolExecutor`, a `ProcessPoolExecutor`,
`distributed.Client(...).get_executor()`) or None for deferax's thread pool, but got {found!r}."""

BATCH_WITHOUT_FUSED = """{call}: `fused_batch` was given without `fused`. It serves the deferred-basis schedule; the deferred
schedule needs `fused(x, ct_y) -> (y, ct_x)` for one cotangent:

    dx.host(simulate, bwd=..., fused=simulate_and_adjoint, fused_batch=simulate_and_adjoints, out=...)"""

BAD_TIMEOUT = "{call}: `timeout` must be a positive number of seconds or None, but got {found!r}."

KEY_OUT = """{call}: {what} declares a typed PRNG key ({found}), but a host function returns NumPy arrays, which cannot
hold one (nor can `jax.pure_callback` return one). Declare the key's raw data, and wrap it after the call:

    data = sim(x)                       # out=jax.ShapeDtypeStruct((2,), jnp.uint32)
    key = jax.random.wrap_key_data(data)"""


def _raw(tree: PyTree) -> PyTree:
    """`tree` with each typed PRNG key (the extended dtype `key<fry>`, say) as its raw data
    (`jax.random.key_data`, `uint32`): what a host function gets, as `jax.pure_callback`
    hands a callback."""
    return jtu.tree_map(lambda a: jax.random.key_data(a) if jax.dtypes.issubdtype(jnp.result_type(a), jax.dtypes.prng_key) else a, tree)


def _check_declared(call: str, what: str, declared: PyTree) -> PyTree:
    check_declared_width(call, what, declared)
    keys = [s for s in jtu.tree_leaves(declared) if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key)]
    if keys:
        raise TypeError(KEY_OUT.format(call=call, what=what, found=_errors.shape_text(keys[0])))
    return declared


def _identity(x: PyTree, y: PyTree, partial: PyTree) -> PyTree:
    """The default `combine`: the adjoint's result is the input cotangent."""
    return partial


class _Host(eqx.Module):
    """A host `ExpensiveFn`'s implementations, as JAX functions: each leaves the program
    through one `jax.pure_callback` (or calls the host functions directly when its
    arguments are concrete arrays)."""

    # Read by the deferred schedule: under `jit`, the expensive calls of several sites whose
    # implementations run on the host are gathered into one callback that runs them together.
    runs_on_host = True

    call: str = eqx.field(static=True)
    host_fwd: Callable[..., Any] | None = eqx.field(static=True)
    host_adjoint: Callable[..., Any] | None = eqx.field(static=True)
    host_bwd: Callable[..., Any] | None = eqx.field(static=True)
    host_fused: Callable[..., Any] | None = eqx.field(static=True)
    host_fused_batch: Callable[..., Any] | None = eqx.field(static=True)
    host_jvp: Callable[..., Any] | None = eqx.field(static=True)
    host_jvp_batch: Callable[..., Any] | None = eqx.field(static=True)
    executor: cf.Executor | None = eqx.field(static=True)
    timeout: float | None = eqx.field(static=True)
    vectorized: bool = eqx.field(static=True)
    linear_adjoint: bool = eqx.field(static=True)
    thread_safe: bool = eqx.field(static=True)
    combine: Callable[..., Any]
    out: Any
    adjoint_out: Any

    def _runner(self) -> Runner:
        why = "declared by `adjoint_out=`" if self.adjoint_out is not None else "shaped like the input `x`, the default of `adjoint_out=`"
        return Runner(
            self.call, self.host_fwd, self.host_adjoint, self.host_bwd, self.host_fused,
            self.executor, self.timeout, self.vectorized, self.linear_adjoint, why,
            self.host_jvp, self.host_jvp_batch, self.thread_safe, self.host_fused_batch,
        )  # fmt: skip

    def _out(self, x: PyTree) -> PyTree:
        declared = self.out(_struct(x)) if callable(self.out) else self.out
        return _check_declared(self.call, "`out=`", declared)

    def _adjoint_out(self, x: PyTree) -> PyTree:
        if self.adjoint_out is None:
            return _struct(_raw(x))
        declared = self.adjoint_out(_struct(x)) if callable(self.adjoint_out) else self.adjoint_out
        return _check_declared(self.call, "`adjoint_out=`", declared)

    def _run(self, kind: str, args: tuple, result: PyTree) -> PyTree:
        runner = self._runner()
        args = _raw(args)
        arg_structs = _struct(args)
        if is_concrete(args):
            return jtu.tree_map(jnp.asarray, runner(kind, result, arg_structs, *jtu.tree_map(np.asarray, args)))
        # (with the caller's context: the site's name and schedule, for the recording)
        return jax.pure_callback(_jaxpr.carry_context(ft.partial(runner, kind, result, arg_structs)), result, *args, vmap_method="broadcast_all")

    def _combine(self, x: PyTree, y: PyTree, partial: PyTree) -> PyTree:
        """`combine(x, y, partial)`; a wrong result is reported as `combine`'s (it would
        otherwise be blamed on the `bwd` or `fused` made from it, which the user never wrote)."""
        if self.combine is _identity:
            return partial
        return check_ct_x(self.call, "combine", self.combine(x, y, partial), x)

    def fwd(self, x: PyTree) -> PyTree:
        return self._run("fwd", (x,), self._out(x))

    def bwd(self, x: PyTree, y: PyTree, ct_y: PyTree) -> PyTree:
        if self.host_adjoint is not None:
            return self._combine(x, y, self._run("adjoint", (x, ct_y), self._adjoint_out(x)))
        return self._run("bwd", (x, y, ct_y), _struct(_raw(x)))

    def fused(self, x: PyTree, ct_y: PyTree) -> tuple[PyTree, PyTree]:
        if self.host_fused is not None:
            return self._run("fused", (x, ct_y), (self._out(x), _struct(_raw(x))))
        y, partial = self._run("fwd+adjoint", (x, ct_y), (self._out(x), self._adjoint_out(x)))
        return y, self._combine(x, y, partial)

    def jvp(self, x: PyTree, t_x: PyTree) -> tuple[PyTree, PyTree]:
        return self._run("jvp", (x, t_x), (self._out(x), self._out(x)))

    def jvp_batch(self, x: PyTree, t_xs: PyTree) -> tuple[PyTree, PyTree]:
        k = jtu.tree_leaves(t_xs)[0].shape[0]
        stacked = jtu.tree_map(lambda s: jax.ShapeDtypeStruct((k, *s.shape), s.dtype), self._out(x))
        kind = "jvp_batch" if self.host_jvp_batch is not None else "jvp*k"
        return self._run(kind, (x, t_xs), (self._out(x), stacked))

    def fused_batch(self, x: PyTree, cts: PyTree) -> tuple[PyTree, PyTree]:
        k = jtu.tree_leaves(cts)[0].shape[0]
        batched = lambda struct: jtu.tree_map(lambda s: jax.ShapeDtypeStruct((k, *s.shape), s.dtype), struct)  # noqa: E731
        if self.host_fwd is not None and self.host_adjoint is not None:
            y, partials = self._run("fwd+adjoints", (x, cts), (self._out(x), batched(self._adjoint_out(x))))
            return y, jax.vmap(lambda p: self._combine(x, y, p))(partials)
        kind = "fused_batch" if self.host_fused_batch is not None else "fused*k"
        return self._run(kind, (x, cts), (self._out(x), batched(_struct(_raw(x)))))


# Typed `Any` where a wrong value must reach the checks below, whose messages name the function.
def host(
    fwd: Any = None,
    *,
    adjoint: Any = None,
    combine: Any = None,
    bwd: Any = None,
    fused: Any = None,
    fused_batch: Any = None,
    jvp: Any = None,
    jvp_batch: Any = None,
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
      and all the adjoint right-hand sides. Without it, that schedule submits `fused` once
      per cotangent.
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
      `ProcessPoolExecutor`, a Dask cluster's `distributed.Client(...).get_executor()`.
      Default: a thread pool shared by all host functions. For a process pool or Dask,
      the host functions must be picklable; that is checked here.
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
      gives `m` and `1j * m`) or zero is not solved again.
    - `max_basis`, `max_tangents`, `prefer`, `cost`: as for [`deferax.ExpensiveFn`][]
      (`cost`: a [`deferax.Cost`][]; with `fused_batch`, give its `setup`: the work one
      job does once for the forward and every adjoint).
    - `thread_safe`: `False` when the host functions share one workspace (a C or Fortran
      solver): their jobs are then submitted one at a time, never two at once (see
      [`deferax.set_concurrency`][]).

    **Returns:**

    An [`deferax.ExpensiveFn`][]. With `fwd` and `adjoint` it has `fwd`, `bwd`
    (`combine(x, y, adjoint(x, ct_y))`), `fused` (forward and adjoint submitted together)
    and `fused_batch` (the forward once and `k` adjoints, all submitted together).

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
    impls = {
        "fwd": fwd, "adjoint": adjoint, "combine": combine, "bwd": bwd, "fused": fused, "fused_batch": fused_batch,
        "jvp": jvp, "jvp_batch": jvp_batch,
    }  # fmt: skip
    if name is None:
        first = next((f for f in (fwd, fused, jvp, jvp_batch, adjoint, bwd) if f is not None), None)
        name = getattr(first, "__name__", None) or type(first).__name__
    call = f"`ExpensiveFn(name={name!r})`"
    for impl, fn in impls.items():
        if fn is not None and not callable(fn):
            raise TypeError(_errors.NOT_CALLABLE.format(call=call, impl=impl, found=fn))
        if fn is not None:
            check_signature(call, impl, fn)
    if fwd is None and fused is None and jvp is None and jvp_batch is None:
        raise TypeError(NO_PRIMAL.format(call=call))
    if out is None:
        raise TypeError(NO_OUT.format(call=call, example=_errors.out_example("dx.host", impls)))
    if adjoint is not None and bwd is not None:
        raise TypeError(_errors.BOTH_ADJOINTS.format(call=call))
    for what, value in (("combine", combine), ("adjoint_out", adjoint_out)):
        if value is not None and adjoint is None:
            raise TypeError(_errors.ONLY_WITH_ADJOINT.format(call=call, what=what))
    if fused_batch is not None and fused is None:
        raise TypeError(BATCH_WITHOUT_FUSED.format(call=call))
    if executor is not None and not isinstance(executor, cf.Executor):
        raise TypeError(BAD_EXECUTOR.format(call=call, found=executor))
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(BAD_TIMEOUT.format(call=call, found=timeout))
        timeout = float(timeout)
    if executor is not None:
        _executor.check_picklable(call, executor, {k: v for k, v in impls.items() if v is not None and k != "combine"})
    h = _Host(
        call=call,
        host_fwd=fwd,
        host_adjoint=adjoint,
        host_bwd=bwd,
        host_fused=fused,
        host_fused_batch=fused_batch,
        host_jvp=jvp,
        host_jvp_batch=jvp_batch,
        executor=executor,
        timeout=timeout,
        vectorized=vectorized,
        linear_adjoint=linear_adjoint,
        thread_safe=thread_safe,
        combine=combine if combine is not None else _identity,
        out=out,
        adjoint_out=adjoint_out,
    )
    deferrable = fused is not None or (fwd is not None and adjoint is not None)
    return ExpensiveFn(
        fwd=h.fwd if fwd is not None else None,
        bwd=h.bwd if (adjoint is not None or bwd is not None) else None,
        fused=h.fused if deferrable else None,
        fused_batch=h.fused_batch if deferrable else None,
        jvp=h.jvp if jvp is not None else None,
        # with `jvp` alone, its calls for several tangents are submitted together
        jvp_batch=h.jvp_batch if (jvp is not None or jvp_batch is not None) else None,
        name=name,
        out=out,
        # A complex-linear adjoint answers a complex overlap's two basis cotangents with one
        # solve, so k = 2 costs what k = 1 does: allow it unless told otherwise.
        max_basis=max_basis if max_basis is not None or not linear_adjoint else 2,
        max_tangents=max_tangents,
        prefer=prefer,
        thread_safe=thread_safe,
        cost=cost,
    )
