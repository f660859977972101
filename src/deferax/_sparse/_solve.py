"""`sparse_solve`: `x = A^-1 b` for a sparse `A` given by its entries (a JAX array) on a static
pattern, as a host site that factors `A` once per call and solves the forward, adjoint and
tangent right-hand sides with that one factorisation.

The derivatives, for `A x = b` with `A[rows[k], cols[k]] += values[k]`:

    reverse:  lam = A^-T ct_x,   ct_b = lam,   ct_values[k] = -lam[rows[k]] * x[cols[k]]
    forward:  t_x = A^-1 (t_b - dA x),   (dA x)[i] = sum over rows[k] == i of t_values[k] * x[cols[k]]

with the plain transpose (no complex conjugate) as JAX's cotangents of complex arrays
follow; a real input's cotangent is the real part.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools as ft
import importlib.util
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Inexact

from .. import _runtime
from .._checks._messages import tree_text
from .._host import _executor
from .._host._host import host, on_executor, timing_its_own, with_higher_order, with_partials
from .._implementation._expensive import ExpensiveFn
from .._plan._cost import Cost
from . import _affinity, _factorisations, _program
from ._on_host import TREATMENTS, _Solve
from ._pattern import SparsePattern
from ._second_order import SecondOrder
from ._solver import AbstractSparseSolver
from ._solvers._auto import AutoSparseSolver


@_runtime.cached(maxsize=64)
def _solve_site(
    solve: _Solve, timeout: Any, name: str, max_basis: int | None, cost: Cost | None, not_kept: str | None
) -> ExpensiveFn:
    # (no executor here: this cache must not keep the caller's alive; `on_executor` adds it)
    c = Cost() if cost is None else cost
    # one factorisation answers every right-hand side; it waits for the backward pass where
    # it was made, unless `not_kept` says why not (`_factorisations.not_kept`): then the
    # backward factors again
    cost = Cost(
        fwd=c.fwd,
        bwd=c.bwd,
        setup=c.setup,
        keeps_setup=not_kept is None,
        linear=True,
        workers=c.workers,
        stage=c.stage,
        note=not_kept,
    )
    fn = host(
        solve.fwd,
        bwd=solve.bwd,
        fused=solve.fused,
        fused_batch=solve.fused_batch,
        jvp=solve.jvp,
        jvp_batch=solve.jvp_batch,
        out=jax.ShapeDtypeStruct((solve.pattern.n,), solve.dtype),
        name=name,
        timeout=timeout,
        max_basis=max_basis,
        # one adjoint solve beats `n` tangent solves: reverse mode always uses `bwd`
        max_tangents=0,
        cost=cost,
    )
    # (`_Solve` times its factorisations and solves, kept under itself, and counts the users of its factorisations)
    fn = timing_its_own(fn, solve, scope=solve.request, adopt=solve.adopt, rows=solve.rows)
    # the host returns the adjoint `lam`, and the entries' cotangents are made of it in the program
    fn = with_partials(fn, _Cotangents(solve.pattern), jax.ShapeDtypeStruct((solve.pattern.n,), solve.partial_dtype))
    # differentiated twice or more, `A^-1 b` as a linear solve whose derivatives are solves (`_second_order`)
    return with_higher_order(fn, SecondOrder(solve))


@dataclasses.dataclass(frozen=True)
class _Cotangents:
    """`combine(x, y, lam) -> (ct_values, ct_b)` for `x = (values, b)`, inside the program:
    `ct_values[k] = -lam[rows[k]] * y[cols[k]]` and `ct_b = lam`, each a real input's real
    part. Made there rather than on the host: the gathers took 1.9 ms in XLA against 4.4 ms in
    NumPy in a job on the 180 x 60 beam's 689,505 entries (cold caches after the
    factorisation), and the host sends back `lam` (n entries), not `ct_values` (nnz)."""

    pattern: SparsePattern

    def __call__(self, x: tuple, y: jax.Array, lam: jax.Array) -> tuple:
        return _cotangents(self.pattern, x, y, lam)


# (one compiled program a pattern and dtypes: one dispatch eagerly, rather than one an operation)
@ft.partial(jax.jit, static_argnums=0)
def _cotangents(pattern: SparsePattern, x: tuple, y: jax.Array, lam: jax.Array) -> tuple:
    values, b = x
    rows, cols = pattern._indices32()
    ct_values = -lam[rows] * y.astype(lam.dtype)[cols]
    return _like(ct_values, values.dtype), _like(lam, b.dtype)


def _like(a: jax.Array, dtype: Any) -> jax.Array:
    """`a` as a cotangent of dtype `dtype`: its real part for a real one."""
    return (a if jnp.issubdtype(dtype, jnp.complexfloating) else jnp.real(a)).astype(dtype)


_NOT_PATTERN = """`dx.sparse_solve(name={name!r})`: `pattern` must be a `dx.SparsePattern`, but got {found}.
Make one from the index arrays, or from a SciPy matrix:

    pattern = dx.SparsePattern(rows, cols, n)   # or: values, pattern = dx.SparsePattern.from_scipy(matrix)"""

_BAD_OPERAND = """`dx.sparse_solve(name={name!r})`: `{what}` must be {expected}, but got {found}.
{fix}"""

_FIX_VALUES = (
    "`values[k]` is the entry at `(pattern.rows[k], pattern.cols[k])`; for several systems, `jax.vmap` over `values`."
)

_FIX_B = "`b` is one right-hand side; for several, `jax.vmap` over `b` (the factorisation is shared)."

_NO_SCIPY = """`dx.sparse_solve(name={name!r})`: SciPy is not installed, and the solve needs it (the matrix \
is handed to the
solver as a `scipy.sparse.csc_matrix`; the default solver is SciPy's `splu`). Install it: `pip install scipy`."""


# `pattern`, `solver` and `symmetric` typed `Any` so that a wrong value reaches the checks below,
# whose messages name the call.
def sparse_solve(
    values: ArrayLike,
    pattern: Any,
    b: ArrayLike,
    *,
    solver: Any = None,
    executor: Any = None,
    timeout: float | None = None,
    name: str = "sparse_solve",
    max_basis: int | None = None,
    cost: Any = None,
    precision: str = "double",
    nonfinite: str = "raise",
    singular: str = "raise",
    symmetric: Any = False,
    where: str = "auto",
) -> Inexact[Array, " n"]:
    """Solve `A x = b` for a sparse matrix `A`, real or complex, whose entries are a JAX
    array on a static pattern: `A[pattern.rows[k], pattern.cols[k]] += values[k]`.

    Differentiable with respect to `values` and `b`, in reverse mode (`jax.grad`, and every
    schedule of [`deferax.filter_value_and_grad`][]) and forward mode (`jax.jvp`,
    `jax.jacfwd`), under `jax.jit` and `jax.vmap` (several right-hand sides, or several
    systems), and to every order (`jax.hessian`, `jax.jvp` of `jax.grad`: see the guide's
    "Second order"). The matrix is factored once per call and every right-hand side reuses it:

    | schedule | what runs |
    | --- | --- |
    | standard (`jax.grad`, or a site that cannot be deferred) | forward: factor, solve `b`; backward: solve `A^T \
lam = ct_x` with the forward's factorisation |
    | deferred | one job: factor, solve `b` and `ct_x` |
    | deferred-basis (`k` cotangents) | one job: factor, solve `b`, then the `k` adjoint right-hand sides in one solve |
    | forward mode | one job: factor, solve `b`, then the tangent right-hand sides in one solve |

    On the standard schedule, the factorisation waits on the host for the backward passes
    (all of `jax.jacrev`'s rows, or every call of an eager `jax.vjp` function) and is
    dropped when none can come any more: eagerly, when the forward's output is garbage
    collected; under `jit`, after the first backward pass (a forward pass that nothing
    differentiates keeps none). Those waiting take at most the
    factorisation budget's bytes (a quarter of the machine's memory by default,
    [`deferax.set_factorisation_budget`][]; the oldest are dropped first), and a backward
    pass that finds its factorisation dropped factors again. A factorisation past the budget
    on its own is not kept: its site is planned with a second factorisation in the backward
    pass, and [`deferax.explain`][] says so beside its estimates. Under `vmap` over `b`
    alone, the right-hand sides are one host job on every schedule: one factorisation, the
    right-hand sides solved together.

    The derivatives (JAX's convention for complex arrays: plain transposes, no conjugates;
    a real input's cotangent is the real part):
    `lam = A^-T ct_x`, `ct_b = lam`, `ct_values[k] = -lam[rows[k]] * x[cols[k]]`, and
    `t_x = A^-1 (t_b - dA x)`.

    **Arguments:**

    - `values`: the entries, shape `(nnz,)`, real or complex.
    - `pattern`: a [`deferax.SparsePattern`][] (static: its indices are part of the program).
    - `b`: the right-hand side, shape `(n,)`, real or complex. `x` has NumPy's result dtype
      of `values` and `b`.
    - `solver`: the sparse direct solver, a [`deferax.AbstractSparseSolver`][]; default
      [`deferax.AutoSparseSolver`][]: the fastest for the pattern of PARDISO's and CHOLMOD's
      Cholesky (symmetric positive definite matrices), PARDISO's LU, KLU and SuperLU with two
      orderings, as measured on the pattern's first factorisations in this program (those
      installed: SciPy's SuperLU always; pypardiso, sparsax and cholespy with
      `pip install deferax[sparse]`; klujax with `pip install klujax`, unless its module is
      splineax's fork). `dx.Pardiso()`, `dx.Cholmod()`, `dx.KLU()` or
      `dx.SuperLU(...)` chooses yourself.

    When the matrix equals its transpose (checked exactly on the host, entries at one
    position summed first), an adjoint right-hand side that is a multiple `c b` of `b` (a
    self-adjoint loss, such as a compliance `b . x`) is not solved: its solution is `c x`.
    - `executor`, `timeout`: where the jobs run and how long to wait, as for
      [`deferax.host`][] (default: deferax's thread pool). Given a Dask
      `distributed.Client`, each matrix's jobs go to one worker (by
      `client.get_executor(workers=...)`), where its factorisation waits for the backward
      pass. A process pool (or any executor that does not run its jobs on threads of this
      process) cannot send the backward job to the process that factored: no factorisation
      is kept there, and the backward pass factors again (the plan counts it, and
      [`deferax.explain`][] says so).
    - `name`: shown in errors and in [`deferax.explain`][].
    - `max_basis`: as for [`deferax.ExpensiveFn`][].
    - `precision`: `"double"` (the default) factors and solves in float64 (complex128 for
      complex inputs; a real matrix with a complex `b` is factored real, and `b`'s real and
      imaginary parts are solved as two right-hand sides), whatever the inputs' dtype, and
      rounds `x` and the cotangents and tangents to the inputs' dtype: a float32 program gets
      answers accurate to float32.
      `"input"` factors in the inputs' own dtype (at least float32), as SciPy would: half
      the memory and somewhat faster, but a factorisation in single precision loses
      digits with the matrix's condition number (a float32 finite-element stiffness came
      out 7-21 % off in value and 13-45 % in gradient). Either is the same for float64 inputs.
    - `nonfinite`: what a matrix with a NaN or infinite entry gives. `"raise"` (the
      default): an error that says how many there are and where the first sits (a
      `ValueError`, inside the [`deferax.HostError`][] of the job; for a system solved inside
      the program, see `where`, the same message); `"nan"`: the matrix is
      not factored, and `x` and every derivative (the cotangents of `values` and `b`, the
      tangent of `x`) are NaN, as a solve compiled into the program would give them, so that
      a NaN guard (`optax.apply_if_finite`, `jnp.isfinite(loss)`) sees the step; `"warn"`:
      as `"nan"`, with a `scipy.sparse.linalg.MatrixRankWarning`, as SciPy's `spsolve` warns.
    - `singular`: the same for a matrix that the solver finds singular (its `factor` raises
      `numpy.linalg.LinAlgError`: SuperLU's zero pivot). `"raise"` (the default) raises it.
      A matrix that [`deferax.Cholmod`][] refuses as not symmetric positive definite gives NaN
      only where an LU finds it singular; otherwise the error is raised (the solver is wrong for it).
    - `symmetric`: `True` takes the matrix as symmetric without checking it, as a library
      that assumes so (jax_fdm's `sparse_solve`): the adjoint solves with `A` itself,
      `lam = A^-1 ct_x`, and the self-adjoint shortcut above applies without the check.
      The reverse-mode derivatives are then right for a symmetric matrix only; for one
      that is not, they are what such a library gives (a recognised call of it keeps that
      answer). Forward mode is unchanged. Default `False`: the plain transpose.
    - `where`: `"auto"` (the default) solves a small real system inside the compiled program
      and any other on the host; `"host"` or `"program"` says which.
      Inside the program the solve is sparsax's KLU through XLA FFI (installed with `pip install deferax[sparse]`, on
      Linux and Windows): no host round trip, one factorisation per value and gradient
      (sparsax keeps the factorisation of the values it saw last, which the transposed and
      tangent solves find), the right-hand sides of `jax.jacrev` or a `vmap` over `b` solved as
      columns of one solve, in float64 (float32 inputs promoted, the results rounded back).
      `"auto"` takes it there when a trial factorisation of the pattern (on the first call)
      takes at most 8 ms, so that a host site's two round trips (about 1 ms each) would cost
      more than the host's solvers and its overlap with other sites can save, and only with
      what the program can do: real inputs, `jax_enable_x64` on, the default `solver`,
      `executor` and `cost`, `precision` in float64, `nonfinite` `"raise"` (a NaN or infinite
      entry raises the host path's error, naming the call: a `ValueError` on an eager call, inside
      a `jax.errors.JaxRuntimeError` from a compiled program) or `"nan"`, and
      `singular="raise"` (there sparsax's own error, `klu_factor failed`, stops the program).
      Such a solve is not a site: [`deferax.explain`][] does not list it, and [`deferax.record`][] sees no job.
    - `cost`: a [`deferax.Cost`][] with what a factorisation (`setup`) and one solve (`fwd`,
      `bwd`) take; default: as timed in earlier calls (in this process), else equal. The
      rest is known here: a factorisation serves every right-hand side of a job, the
      standard schedule's backward reuses the forward's on a thread pool, and a complex
      overlap's two basis cotangents are one adjoint solve.

    **Returns:**

    `x`, shape `(n,)`.

    !!! Example

        ```python
        import jax, jax.numpy as jnp, numpy as np
        import deferax as dx

        jax.config.update("jax_enable_x64", True)
        pattern = dx.SparsePattern(rows=np.array([0, 0, 1, 1]), cols=np.array([0, 1, 0, 1]), n=2)
        values = jnp.array([4.0, 1.0, 2.0, 3.0])
        b = jnp.array([1.0, 2.0])
        dx.filter_value_and_grad(lambda v: jnp.sum(dx.sparse_solve(v, pattern, b)))(values)
        ```
    """
    if importlib.util.find_spec("scipy") is None:
        raise ImportError(_NO_SCIPY.format(name=name))
    if not isinstance(pattern, SparsePattern):
        raise TypeError(_NOT_PATTERN.format(name=name, found=tree_text(pattern)))
    chosen = solver
    solver = AutoSparseSolver() if solver is None else solver
    if not isinstance(solver, AbstractSparseSolver):
        raise TypeError(
            f"`dx.sparse_solve(name={name!r})`: `solver` must be a `dx.AbstractSparseSolver` (e.g. `dx.SuperLU()`), "
            f"but got {solver!r}."
        )
    values, b = jnp.asarray(values), jnp.asarray(b)
    for what, a, shape, fix in (
        ("values", values, (pattern.nnz,), _FIX_VALUES),
        ("b", b, (pattern.n,), _FIX_B),
    ):
        if a.shape != shape or not jnp.issubdtype(a.dtype, jnp.inexact):
            expected = f"a real or complex array of shape {shape} (for {pattern!r})"
            raise ValueError(_BAD_OPERAND.format(name=name, what=what, expected=expected, found=tree_text(a), fix=fix))
    dtype = np.result_type(np.dtype(values.dtype), np.dtype(b.dtype))
    if cost is not None and not isinstance(cost, Cost):
        raise TypeError(f"`dx.sparse_solve(name={name!r})`: `cost` must be a `dx.Cost` or None, but got {cost!r}.")
    if precision not in ("double", "input"):
        raise ValueError(_BAD_PRECISION.format(name=name, found=precision))
    for what, treatment in (("nonfinite", nonfinite), ("singular", singular)):
        if treatment not in TREATMENTS:
            raise ValueError(_BAD_TREATMENT.format(name=name, what=what, found=treatment))
    if not isinstance(symmetric, bool):
        raise TypeError(f"`dx.sparse_solve(name={name!r})`: `symmetric` must be True or False, but got {symmetric!r}.")
    if where not in ("auto", "host", "program"):
        raise ValueError(_BAD_WHERE.format(name=name, found=where))
    if where != "host":
        why_not = in_program(pattern, dtype, chosen, executor, cost, precision, nonfinite, singular, where)
        if why_not is None:
            return _program.solve(values, b, pattern, symmetric, name, nonfinite)
        if where == "program":
            raise ValueError(_NOT_IN_PROGRAM.format(name=name, why=why_not))
    executor = _affinity.pinned(executor)
    if executor is None or (isinstance(executor, cf.Executor) and _executor.in_this_process(executor)):
        kept = "here"
    elif isinstance(executor, _affinity.Pinned):  # (each matrix's jobs on one worker)
        kept = "worker"
    else:  # (a process pool: a backward job may land in any of its processes)
        kept = "none"
    x64 = jax.dtypes.canonicalize_dtype(np.float64) == np.float64
    real_matrix = not jnp.issubdtype(values.dtype, jnp.complexfloating) and np.issubdtype(dtype, np.complexfloating)
    solve = _Solve(pattern, solver, dtype, name, precision, kept, nonfinite, singular, symmetric, x64, real_matrix)
    site = _solve_site(solve, timeout, name, max_basis, cost, _factorisations.not_kept(solve, executor))
    fn = on_executor(site, executor)
    return fn((values, b))


def in_program(
    pattern: SparsePattern,
    dtype: np.dtype,
    solver: Any,
    executor: Any,
    cost: Any,
    precision: str,
    nonfinite: str,
    singular: str,
    where: str,
) -> str | None:
    """Why a solve with these arguments runs on the host; None where it runs inside the
    program (`_program`): with the default solver, executor and cost, `nonfinite` other
    than "warn", the default `singular`, precision in float64, and a small real matrix."""
    for what, given in (("solver", solver), ("executor", executor), ("cost", cost)):
        if given is not None:
            return f"a `{what}` was given, which the host's solve uses"
    if precision == "input" and dtype != np.float64:
        return '`precision="input"` factors in single precision, which sparsax does not'
    if nonfinite == "warn" or singular != "raise":
        return f'`nonfinite={nonfinite!r}` and `singular={singular!r}` are kept on the host (inside the program: \
`nonfinite` "raise" or "nan", `singular="raise"`)'
    if nonfinite == "raise" and len(jax.devices()) > 1:
        # (the program's error, raised by a callback on one device, left the others waiting in a collective)
        return _SEVERAL_DEVICES
    return _program.refusal(pattern, dtype, by_cost=where == "auto")


_SEVERAL_DEVICES = """`nonfinite='raise'` is kept on the host in a process of several devices (raised inside a \
program whose inputs were sharded, the error stopped one device and left the others waiting: a hang); \
`nonfinite="nan"` runs inside"""

_BAD_WHERE = """`dx.sparse_solve(name={name!r})`: `where` must be "auto", "host" or "program", but got {found!r}.
"auto" (the default) solves a small real system inside the program and any other on the host."""

_NOT_IN_PROGRAM = """`dx.sparse_solve(name={name!r})`: `where="program"`, but this solve cannot run inside the \
program: {why}.
`where="auto"` (the default) runs it on the host."""


_BAD_PRECISION = """`dx.sparse_solve(name={name!r})`: `precision` must be "double" or "input", but got {found!r}.
"double" (the default) factors in float64 whatever the inputs' dtype; "input" factors in the inputs' own dtype."""


_BAD_TREATMENT = """`dx.sparse_solve(name={name!r})`: `{what}` must be "raise", "nan" or "warn", but got {found!r}.
"raise" (the default) raises an error; "nan" gives NaN for `x` and every derivative; "warn" gives NaN with a warning."""
