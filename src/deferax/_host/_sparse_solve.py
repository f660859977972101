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

import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import functools as ft
import importlib.util
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Inexact

from .._checks import _messages
from .._implementation._expensive import ExpensiveFn
from .._plan import _cost
from .._plan._cost import Cost
from . import _affinity
from ._host import host, timing_its_own
from ._runner import _multiples
from ._sparse_solver import AbstractSparseSolver, SuperLU


@dataclasses.dataclass(frozen=True, eq=False)
class SparsePattern:
    """Where the stored entries of a square sparse matrix are: the static half of
    [`deferax.sparse_solve`][]'s matrix (its `values` are the other, a JAX array).

    Entry `k` of `values` sits at row `rows[k]`, column `cols[k]`; entries at the same
    position add up (as in SciPy's COO format). A pattern is hashable and compares by
    value, so a program built for one pattern is reused for an equal one.

    **Arguments:**

    - `rows`, `cols`: integer index arrays of equal length `nnz`, each entry in `[0, n)`.
    - `n`: the size of the matrix.
    """

    rows: np.ndarray
    cols: np.ndarray
    n: int

    def __post_init__(self):
        n = self.n
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
            raise ValueError(_messages.SPARSE_BAD_PATTERN.format(what="`n` must be a positive int", found=repr(n)))
        for what, given in (("rows", self.rows), ("cols", self.cols)):
            a = np.asarray(given)
            if a.ndim != 1 or not (np.issubdtype(a.dtype, np.integer) or a.size == 0):
                raise ValueError(
                    _messages.SPARSE_BAD_PATTERN.format(
                        what=f"`{what}` must be a 1-D integer array", found=f"{a.dtype.name}{list(a.shape)}"
                    )
                )
            if a.size and (a.min() < 0 or a.max() >= n):
                raise ValueError(
                    _messages.SPARSE_BAD_PATTERN.format(
                        what=f"every entry of `{what}` must be in [0, n) = [0, {n})",
                        found=f"entries from {a.min()} to {a.max()}",
                    )
                )
            a = a.astype(np.int64)  # (a copy: the caller's array may change, the pattern may not)
            a.setflags(write=False)
            object.__setattr__(self, what, a)
        if self.rows.shape != self.cols.shape:
            raise ValueError(
                _messages.SPARSE_BAD_PATTERN.format(
                    what="`rows` and `cols` must have the same length",
                    found=f"{self.rows.size} rows and {self.cols.size} cols",
                )
            )
        object.__setattr__(self, "n", int(n))
        object.__setattr__(self, "_hash", hash((self.n, self.rows.tobytes(), self.cols.tobytes())))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SparsePattern):
            return NotImplemented
        return self is other or (
            self._hash == other._hash
            and self.n == other.n
            and np.array_equal(self.rows, other.rows)
            and np.array_equal(self.cols, other.cols)
        )

    def __repr__(self) -> str:
        return f"SparsePattern(n={self.n}, nnz={self.nnz})"

    @property
    def nnz(self) -> int:
        """The number of stored entries (the length of `values`)."""
        return int(self.rows.size)

    @classmethod
    def from_scipy(cls, matrix: Any) -> tuple[np.ndarray, SparsePattern]:
        """`(values, pattern)` of a square SciPy sparse matrix (any format), in COO order."""
        coo = matrix.tocoo()
        if coo.shape[0] != coo.shape[1]:
            raise ValueError(
                _messages.SPARSE_BAD_PATTERN.format(what="the matrix must be square", found=f"shape {coo.shape}")
            )
        return np.asarray(coo.data), cls(coo.row, coo.col, coo.shape[0])

    def todense(self, values: ArrayLike) -> Inexact[Array, "n n"]:
        """The dense matrix, in JAX (differentiable): for checks and small references."""
        values = jnp.asarray(values)
        return jnp.zeros((self.n, self.n), values.dtype).at[self.rows, self.cols].add(values)


# ----------------------------------------------------------------------------- the factorisations kept


class _Entry:
    """A factorisation (a future: the first caller computes it, the others wait) and the
    number of calls that still need it (forward passes whose backward pass has not come)."""

    def __init__(self):
        self.future: cf.Future = cf.Future()
        self.users = 0


class Store:
    """The factorisations that forward passes leave for their backward passes, by matrix.

    The key is the matrix itself (the solve's configuration and the bytes of `values`), so a
    backward pass finds its forward's factorisation without any handle in the program, and a
    batch of right-hand sides on one matrix (`vmap` over `b`) factors it once. A forward
    adds a user; its backward pass takes the factorisation and removes two (its own use
    and the forward's); a factorisation with no users left is dropped. Forward passes whose
    backward pass never comes are dropped, oldest first, beyond `limit` factorisations. A
    backward pass that finds nothing factors again: the result is always right.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._entries: collections.OrderedDict[Any, _Entry] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def acquire(self, key: Any, make: Any) -> Any:
        """The factorisation for `key` (made with `make()` unless kept or being made), with
        one more user."""
        with self._lock:
            entry = self._entries.get(key)
            owner = entry is None
            if owner:
                entry = self._entries[key] = _Entry()
            entry.users += 1
            self._entries.move_to_end(key)
            self._trim()
        if owner:
            try:
                entry.future.set_result(make())
            except BaseException as e:  # (the callers waiting for it raise it too)
                entry.future.set_exception(e)
                with self._lock:
                    if self._entries.get(key) is entry:
                        del self._entries[key]
        return entry.future.result()

    def release(self, key: Any, n: int = 1) -> None:
        """`n` users fewer for `key`; the factorisation is dropped when none is left."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.users -= n
                if entry.users <= 0:
                    del self._entries[key]

    def _trim(self) -> None:
        done = [k for k, e in self._entries.items() if e.future.done()]
        for key in done[: max(0, len(self._entries) - self.limit)]:
            del self._entries[key]


# At most this many factorisations are kept for backward passes that have not come yet.
FACTORISATIONS = Store(limit=8)


# ----------------------------------------------------------------------------- the host functions


@dataclasses.dataclass(frozen=True)
class _Solve:
    """The host functions of one sparse solve (pattern, solver and dtype): NumPy in and out.
    Compares by value, so equal solves share compiled programs and factorisations. The
    factorisations and solves are timed, for the choice of schedule (`_cost`, under the solve itself)."""

    pattern: SparsePattern
    solver: AbstractSparseSolver
    dtype: np.dtype
    name: str = "sparse_solve"

    def _factor(self, values: np.ndarray) -> Any:
        import scipy.sparse

        p = self.pattern
        matrix = scipy.sparse.csc_matrix((values.astype(self.dtype), (p.rows, p.cols)), shape=(p.n, p.n))
        start = time.perf_counter()
        lu = self.solver.factor(matrix)
        _cost.observe(self, self._shapes, setup=time.perf_counter() - start)
        return lu

    @property
    def _shapes(self) -> tuple:  # (the site's input shapes, by which its timings are kept)
        return ((self.pattern.nnz,), (self.pattern.n,))

    def _key(self, values: np.ndarray) -> Any:
        return (self, values.dtype.str, values.tobytes())

    @contextlib.contextmanager
    def _factorised(self, values: np.ndarray, uses: int) -> Iterator[Any]:
        """The factorisation of the matrix, kept or made; inside, it is used, and after,
        `uses` users fewer for it (this use, and a forward pass's for a backward pass)."""
        key = self._key(values)
        try:
            yield FACTORISATIONS.acquire(key, lambda: self._factor(values))
        finally:
            FACTORISATIONS.release(key, uses)

    def _solve(self, lu: Any, rhs: np.ndarray, transpose: bool) -> np.ndarray:
        """`A^-1 rhs` (or `A^-T rhs`) for `rhs` of shape `(n,)` or `(k, n)`: one call of the solver."""
        rhs = np.asarray(rhs, self.dtype)
        start = time.perf_counter()
        out = self.solver.solve(lu, rhs.T if rhs.ndim == 2 else rhs, transpose)
        per_rhs = (time.perf_counter() - start) / (rhs.shape[0] if rhs.ndim == 2 else 1)
        _cost.observe(self, self._shapes, **{"bwd" if transpose else "fwd": per_rhs})
        return np.asarray(out, self.dtype).T if rhs.ndim == 2 else np.asarray(out, self.dtype)

    def _cotangents(self, x: tuple, y: np.ndarray, lam: np.ndarray) -> tuple:
        """`(ct_values, ct_b)` from `lam = A^-T ct_y` (one, or `k` stacked)."""
        values, b = x
        ct_values = -lam[..., self.pattern.rows] * y[self.pattern.cols]
        return _like(ct_values, values.dtype), _like(lam, b.dtype)

    def _product(self, t_values: np.ndarray, y: np.ndarray) -> np.ndarray:
        """`dA y` for the entries' tangent `t_values` (one, or `k` stacked)."""
        terms = np.asarray(t_values, self.dtype) * y[self.pattern.cols]
        out = np.zeros((*terms.shape[:-1], self.pattern.n), self.dtype)
        np.add.at(out, (..., self.pattern.rows), terms)
        return out

    def fwd(self, x: tuple) -> np.ndarray:
        values, b = x
        lu = FACTORISATIONS.acquire(self._key(values), lambda: self._factor(values))  # it stays for `bwd`
        return self._solve(lu, b, False)

    def bwd(self, x: tuple, y: np.ndarray, ct_y: np.ndarray) -> tuple:
        with self._factorised(x[0], uses=2) as lu:  # this use, and the forward's
            lam = self._solve(lu, ct_y, True)
        return self._cotangents(x, y, lam)

    def fused(self, x: tuple, ct_y: np.ndarray) -> tuple:
        y, ct_xs = self.fused_batch(x, ct_y[None])
        return y, tuple(c[0] for c in ct_xs)

    def fused_batch(self, x: tuple, cts: np.ndarray) -> tuple:
        values, b = x
        # The adjoint is linear in the cotangent: a row that is a multiple of another
        # (a complex overlap's `m` and `1j * m`) or zero is not solved.
        recipe, unique = _multiples(list(cts), jax.ShapeDtypeStruct((), self.dtype))
        with self._factorised(values, uses=1) as lu:
            y = self._solve(lu, b, False)
            solved = self._solve(lu, cts[unique], True) if unique else np.zeros((0, self.pattern.n), self.dtype)
        lam = np.stack([c * solved[u] if u is not None else np.zeros(self.pattern.n, self.dtype) for u, c in recipe])
        return y, self._cotangents(x, y, lam)

    def jvp(self, x: tuple, t_x: tuple) -> tuple:
        y, t_ys = self.jvp_batch(x, tuple(t[None] for t in t_x))
        return y, t_ys[0]

    def jvp_batch(self, x: tuple, t_xs: tuple) -> tuple:
        values, b = x
        t_values, t_b = t_xs
        with self._factorised(values, uses=1) as lu:
            y = self._solve(lu, b, False)
            t_y = self._solve(lu, np.asarray(t_b, self.dtype) - self._product(t_values, y), False)
        return y, t_y


def _like(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`a` as a cotangent of dtype `dtype`: its real part for a real one."""
    return np.asarray(a if np.issubdtype(dtype, np.complexfloating) else a.real, dtype)


@ft.lru_cache(maxsize=64)
def _solve_site(
    solve: _Solve, executor: Any, timeout: Any, name: str, max_basis: int | None, cost: Cost | None
) -> ExpensiveFn:
    c = Cost() if cost is None else cost
    # one factorisation answers every right-hand side; it waits for the backward pass in
    # this process (not in a process pool's or Dask's workers: there the backward factors again)
    keeps = executor is None or isinstance(executor, cf.ThreadPoolExecutor)
    cost = Cost(fwd=c.fwd, bwd=c.bwd, setup=c.setup, keeps_setup=keeps, linear=True, workers=c.workers, stage=c.stage)
    fn = host(
        solve.fwd,
        bwd=solve.bwd,
        fused=solve.fused,
        fused_batch=solve.fused_batch,
        jvp=solve.jvp,
        jvp_batch=solve.jvp_batch,
        out=jax.ShapeDtypeStruct((solve.pattern.n,), solve.dtype),
        name=name,
        executor=executor,
        timeout=timeout,
        max_basis=max_basis,
        # one adjoint solve beats `n` tangent solves: reverse mode always uses `bwd`
        max_tangents=0,
        cost=cost,
    )
    return timing_its_own(fn, solve)  # (`_Solve` times its factorisations and solves, kept under itself)


# `pattern` and `solver` typed `Any` so that a wrong value reaches the checks below, whose
# messages name the call.
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
) -> Inexact[Array, " n"]:
    """Solve `A x = b` for a sparse matrix `A`, real or complex, whose entries are a JAX
    array on a static pattern: `A[pattern.rows[k], pattern.cols[k]] += values[k]`.

    Differentiable with respect to `values` and `b`, in reverse mode (`jax.grad`, and every
    schedule of [`deferax.filter_value_and_grad`][]) and forward mode (`jax.jvp`,
    `jax.jacfwd`), under `jax.jit` and `jax.vmap` (several right-hand sides, or several
    systems). The matrix is factored once per call and every right-hand side reuses it:

    | schedule | what runs |
    | --- | --- |
    | standard (`jax.grad`, or a site that cannot be deferred) | forward: factor, solve `b`; backward: solve `A^T \
lam = ct_x` with the forward's factorisation |
    | deferred | one job: factor, solve `b` and `ct_x` |
    | deferred-basis (`k` cotangents) | one job: factor, solve `b`, then the `k` adjoint right-hand sides in one solve |
    | forward mode | one job: factor, solve `b`, then the tangent right-hand sides in one solve |

    On the standard schedule, the factorisation waits on the host for the backward pass
    and is dropped when it has been used; at most 8 wait at any time (the oldest are
    dropped when forward passes have no backward pass), and a backward pass that finds its
    factorisation dropped factors again. Under `vmap` over `b` alone, the right-hand sides
    share one factorisation.

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
      [`deferax.SuperLU`][] (SciPy's `splu`, imported when it first runs).
    - `executor`, `timeout`: where the jobs run and how long to wait, as for
      [`deferax.host`][] (default: deferax's thread pool). With a process pool or Dask,
      a factorisation is kept in the worker that made it; a backward pass that runs on
      another worker factors again.
    - `name`: shown in errors and in [`deferax.explain`][].
    - `max_basis`: as for [`deferax.ExpensiveFn`][].
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
        raise ImportError(_messages.SPARSE_NO_SCIPY.format(name=name))
    if not isinstance(pattern, SparsePattern):
        raise TypeError(_messages.SPARSE_NOT_PATTERN.format(name=name, found=_found(pattern)))
    solver = SuperLU() if solver is None else solver
    if not isinstance(solver, AbstractSparseSolver):
        raise TypeError(_messages.SPARSE_BAD_SOLVER.format(name=name, found=solver))
    values, b = jnp.asarray(values), jnp.asarray(b)
    for what, a, shape, fix in (
        ("values", values, (pattern.nnz,), _messages.SPARSE_FIX_VALUES),
        ("b", b, (pattern.n,), _messages.SPARSE_FIX_B),
    ):
        if a.shape != shape or not jnp.issubdtype(a.dtype, jnp.inexact):
            expected = f"a real or complex array of shape {shape} (for {pattern!r})"
            raise ValueError(
                _messages.SPARSE_BAD_OPERAND.format(name=name, what=what, expected=expected, found=_found(a), fix=fix)
            )
    dtype = np.result_type(np.dtype(values.dtype), np.dtype(b.dtype))
    if cost is not None and not isinstance(cost, Cost):
        raise TypeError(_messages.SPARSE_BAD_COST.format(name=name, found=cost))
    fn = _solve_site(_Solve(pattern, solver, dtype, name), _affinity.pinned(executor), timeout, name, max_basis, cost)
    return fn((values, b))


def _found(a: Any) -> str:
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        return f"{np.dtype(a.dtype).name}{list(a.shape)}"
    return repr(a) if len(repr(a)) <= 80 else type(a).__name__
