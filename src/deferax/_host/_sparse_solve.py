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
import importlib.util
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Inexact

from .. import _record, _runtime
from .._implementation._expensive import ExpensiveFn
from .._plan import _cost
from .._plan._cost import Cost
from . import _affinity, _executor
from ._host import host, on_executor, timing_its_own
from ._runner import _multiples
from ._sparse_solver import AbstractSparseSolver, SuperLU

_BAD_PATTERN = """`dx.SparsePattern`: {what}, but got {found}.
A pattern is the row and column index of each stored entry of an `n x n` matrix:

    dx.SparsePattern(rows=np.array([0, 1, 1]), cols=np.array([0, 0, 1]), n=2)"""


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
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)  # (set in `__post_init__`)

    def __post_init__(self):
        n = self.n
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
            raise ValueError(_BAD_PATTERN.format(what="`n` must be a positive int", found=repr(n)))
        for what, given in (("rows", self.rows), ("cols", self.cols)):
            a = np.asarray(given)
            if a.ndim != 1 or not (np.issubdtype(a.dtype, np.integer) or a.size == 0):
                raise ValueError(
                    _BAD_PATTERN.format(
                        what=f"`{what}` must be a 1-D integer array", found=f"{a.dtype.name}{list(a.shape)}"
                    )
                )
            if a.size and (a.min() < 0 or a.max() >= n):
                raise ValueError(
                    _BAD_PATTERN.format(
                        what=f"every entry of `{what}` must be in [0, n) = [0, {n})",
                        found=f"entries from {a.min()} to {a.max()}",
                    )
                )
            a = a.astype(np.int64)  # (a copy: the caller's array may change, the pattern may not)
            a.setflags(write=False)
            object.__setattr__(self, what, a)
        if self.rows.shape != self.cols.shape:
            raise ValueError(
                _BAD_PATTERN.format(
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

    @property
    def structurally_symmetric(self) -> bool:
        """Whether an entry at `(i, j)` always has one at `(j, i)` (finite-element and most
        frequency-domain matrices): [`deferax.SuperLU`][] then orders its columns for `A + A^T`."""
        return self._transposition() is not None

    def _transposition(self) -> tuple[np.ndarray, np.ndarray, int] | None:
        """`(inverse, transposed, m)`: the `m` distinct positions, each entry's position
        among them (`inverse`) and each position's mirror (`transposed`); None when some
        position has no mirror. Computed once per pattern."""
        if "_transposed" not in self.__dict__:
            n = self.n
            positions, inverse = np.unique(self.rows * n + self.cols, return_inverse=True)
            mirrors = (positions % n) * n + positions // n
            transposed = np.searchsorted(positions, mirrors)
            found = transposed < positions.size
            found[found] = positions[transposed[found]] == mirrors[found]
            value = (inverse.ravel(), transposed, positions.size) if found.all() else None
            object.__setattr__(self, "_transposed", value)
        return self.__dict__["_transposed"]

    def _symmetric(self, values: np.ndarray) -> bool:
        """Whether the matrix with entries `values` equals its transpose, exactly (entries at
        one position summed first)."""
        t = self._transposition()
        if t is None:
            return False
        inverse, transposed, m = t
        summed = np.bincount(inverse, weights=np.real(values), minlength=m)
        if np.iscomplexobj(values):
            summed = summed + 1j * np.bincount(inverse, weights=np.imag(values), minlength=m)
        return bool(np.array_equal(summed, summed[transposed]))

    @classmethod
    def from_scipy(cls, matrix: Any) -> tuple[np.ndarray, SparsePattern]:
        """`(values, pattern)` of a square SciPy sparse matrix (any format), in COO order."""
        coo = matrix.tocoo()
        if coo.shape[0] != coo.shape[1]:
            raise ValueError(_BAD_PATTERN.format(what="the matrix must be square", found=f"shape {coo.shape}"))
        return np.asarray(coo.data), cls(coo.row, coo.col, coo.shape[0])

    def todense(self, values: ArrayLike) -> Inexact[Array, "n n"]:
        """The dense matrix, in JAX (differentiable): for checks and small references."""
        values = jnp.asarray(values)
        return jnp.zeros((self.n, self.n), values.dtype).at[self.rows, self.cols].add(values)


# ----------------------------------------------------------------------------- the factorisations kept


class _Entry:
    """A factorisation (a future: the first caller computes it, the others wait), the number
    of users that still need it (calls running, and forward passes whose backward passes
    may still come), how many of those are `holds` (see `Store`), and its bytes."""

    def __init__(self):
        self.future: cf.Future = cf.Future()
        self.users = 0
        self.holds = 0
        self.nbytes = 0  # (the factorisation's, once made)


class Store:
    """The factorisations that forward passes leave for their backward passes, by matrix.

    The key is the matrix itself (the solve's configuration and the bytes of `values`), so a
    backward pass finds its forward's factorisation without any handle in the program, and a
    batch of right-hand sides on one matrix (`vmap` over `b`) factors it once. A call that
    uses a factorisation is a user while it runs; a forward request (one host call, all the
    rows of a `vmap` batch) leaves one more user per matrix for the backward passes:

    - eagerly (the forward's output a concrete array), a *lease* on that output: the user is
      removed when the output is garbage collected, as then no backward pass can run (it
      needs the output as a residual). Backward passes do not remove it: a `jax.vjp`
      function called several times uses one factorisation.
    - otherwise (inside `jax.jit`, or from a callback), a *hold*, removed by the first
      backward request on that matrix once all its rows are done: a `jax.jacrev` (the
      backward pass vmapped, one request of `n` rows) factors once.

    A factorisation with no users left is dropped. The store is bounded by `budget` bytes
    (each factorisation's as its solver reports them, `AbstractSparseSolver.nbytes`) and by
    `limit` factorisations: beyond either, the oldest are dropped whatever their users
    (forward passes whose backward pass never comes, or has not come yet), and one past the
    budget on its own is not kept at all (its callers use it, and let it go). A backward
    pass that finds nothing factors again: the result is always right. The bytes kept
    (`nbytes`) never exceed the budget: a factorisation counts once made, and is fitted in
    (or dropped) before anyone can use it.

    A lease ends in a finalizer, which runs wherever the garbage collector runs, also on a
    thread inside this store's lock: it only queues the release (`_ended`), which the next
    call takes in under the lock (taking the lock there deadlocked that thread).
    """

    def __init__(self, limit: int, budget: int | None = None):
        self.limit = limit
        self.budget = default_budget() if budget is None else budget
        self._entries: collections.OrderedDict[Any, _Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._ended: collections.deque[tuple[Any, _Entry]] = collections.deque()  # (leases ended, not yet taken in)

    def __len__(self) -> int:
        with self._lock:
            self._take_ended()
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        """The bytes of the factorisations kept (made; those being made count once made)."""
        with self._lock:
            self._take_ended()
            return self._nbytes()

    def _nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def set_budget(self, budget: int) -> None:
        """Bound the store by `budget` bytes from now on, dropping the oldest factorisations
        kept until the others fit."""
        with self._lock:
            self._take_ended()
            self.budget = budget
            self._fit()

    def acquire(self, key: Any, make: Any, size: Any = None) -> Any:
        """The factorisation for `key` (made with `make()` unless kept or being made), with
        one more user. `size(factorisation)`: its bytes, for the budget (default 0)."""
        with self._lock:
            self._take_ended()
            entry = self._entries.get(key)
            owner = entry is None
            if owner:
                entry = self._entries[key] = _Entry()
            entry.users += 1
            self._entries.move_to_end(key)
            self._trim()
        if owner:
            try:
                made = make()
                nbytes = 0 if size is None else int(size(made))
            except BaseException as e:  # (the callers waiting for it raise it too)
                entry.future.set_exception(e)
                with self._lock:
                    if self._entries.get(key) is entry:
                        del self._entries[key]
                raise
            with self._lock:  # (counted, and fitted in or dropped, before anyone can use it)
                entry.nbytes = nbytes
                if self._entries.get(key) is entry:
                    if nbytes > self.budget:  # (alone past the budget: its callers use it, none keeps it)
                        del self._entries[key]
                    else:
                        self._fit(entry)
                entry.future.set_result(made)
        return entry.future.result()

    def release(self, key: Any, n: int = 1, *, hold: bool = False) -> None:
        """`n` users fewer for `key`, and with `hold`, one more (a forward request's) if it
        has one; the factorisation is dropped when none is left."""
        with self._lock:
            self._take_ended()
            entry = self._entries.get(key)
            if entry is not None:
                if hold and entry.holds > 0:
                    entry.holds -= 1
                    n += 1
                entry.users -= n
                if entry.users <= 0:
                    del self._entries[key]

    def hold(self, key: Any, n: int) -> None:
        """A forward request's `n` users of `key` (its rows) become one hold."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.users -= n - 1
                entry.holds += 1

    def lease(self, key: Any, owner: Any) -> None:
        """A hold of `key` becomes a lease on `owner`: released when `owner` is collected."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.holds == 0:
                return
            entry.holds -= 1
        weakref.finalize(owner, self._drop_lease, key, entry)

    def _drop_lease(self, key: Any, entry: _Entry) -> None:
        self._ended.append((key, entry))  # (no lock here: see the class's docstring)

    def _take_ended(self) -> None:
        """The releases of the leases that have ended (under the lock)."""
        while self._ended:
            key, entry = self._ended.popleft()
            if self._entries.get(key) is entry:  # (not a later factorisation of the same matrix)
                entry.users -= 1
                if entry.users <= 0:
                    del self._entries[key]

    def _trim(self) -> None:
        done = [k for k, e in self._entries.items() if e.future.done()]
        for key in done[: max(0, len(self._entries) - self.limit)]:
            del self._entries[key]

    def _fit(self, new: _Entry | None = None) -> None:
        """Drop the oldest factorisations made (not `new`, nor one being made) until those kept
        fit the budget (under the lock)."""
        total = self._nbytes()
        for key, entry in list(self._entries.items()):
            if total <= self.budget:
                return
            if entry is not new and entry.future.done():
                del self._entries[key]
                total -= entry.nbytes


# The store's default budget: this fraction of the machine's memory (`os.sysconf`), or
# `FALLBACK_BUDGET` bytes where it cannot be read.
BUDGET_FRACTION = 0.25
FALLBACK_BUDGET = 4 * 2**30


def machine_memory() -> int | None:
    """The machine's physical memory in bytes, None where `os.sysconf` cannot say (Windows)."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return memory if memory > 0 else None


def default_budget() -> int:
    """A quarter of the machine's memory (`BUDGET_FRACTION`), else `FALLBACK_BUDGET`."""
    memory = machine_memory()
    return FALLBACK_BUDGET if memory is None else int(memory * BUDGET_FRACTION)


# The factorisations kept for backward passes that have not come yet: at most this many
# (the workers of as many matrices are remembered on Dask, `_affinity.REMEMBERED`), and at
# most the budget's bytes (`set_factorisation_budget`).
FACTORISATIONS = Store(limit=_affinity.REMEMBERED)
# (a test's budget is not the next one's: reset puts the default back)
_runtime.on_reset(lambda: FACTORISATIONS.set_budget(default_budget()))


# `nbytes` typed `Any` so that a wrong value reaches the check below, whose message names the call.
def set_factorisation_budget(nbytes: Any) -> int:
    """Bound the memory of the factorisations that [`deferax.sparse_solve`][] keeps between
    the forward and the backward pass, in this process, to `nbytes` bytes.

    On the standard schedule, the forward pass's factorisation waits on the host for the
    backward pass. The store that keeps them holds at most `nbytes` bytes, the oldest
    dropped first; a factorisation past the budget on its own is not kept at all, and its
    backward pass factors again (two factorisations a gradient, the same result). Its site
    is then planned so: [`deferax.explain`][] says so beside its estimates, which count the
    second factorisation (the deferred schedules, one job, may then be estimated faster).
    A factorisation's bytes are its solver's report
    ([`deferax.AbstractSparseSolver`][]'s `nbytes`: for [`deferax.SuperLU`][], its factors'
    entries, an index each, and its permutations).

    **Arguments:**

    - `nbytes`: the budget in bytes, a non-negative int (0: never keep one), or None for the
      default: a quarter of the machine's memory (`os.sysconf`), 4 GiB where it cannot be read.

    **Returns:**

    The budget before, in bytes.

    The budget is this process's: the workers of a Dask cluster keep their factorisations
    under their own default budget (call this there, in a worker plugin, to change it).
    Programs already compiled under `jax.jit` keep the plan they were traced with; the
    store keeps to the new budget at once.

    !!! Example

        ```python
        import deferax as dx

        before = dx.set_factorisation_budget(2 * 2**30)  # 2 GiB
        dx.set_factorisation_budget(before)
        ```
    """
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int | np.integer) or nbytes < 0):
        raise ValueError(_BAD_BUDGET.format(found=nbytes, default=_bytes_text(default_budget())))
    before = FACTORISATIONS.budget
    FACTORISATIONS.set_budget(default_budget() if nbytes is None else int(nbytes))
    return before


def factorisation_budget() -> int:
    """The bytes that [`deferax.sparse_solve`][]'s factorisations kept for backward passes may
    take in this process (see [`deferax.set_factorisation_budget`][])."""
    return FACTORISATIONS.budget


_BAD_BUDGET = """`dx.set_factorisation_budget`: `nbytes` must be a non-negative int (bytes), or None for \
the default ({default}, a quarter of this machine's memory), but got {found!r}.
Give a number of bytes, for example `dx.set_factorisation_budget(2 * 2**30)` for 2 GiB."""


def _bytes_text(nbytes: int) -> str:
    """`nbytes` for a message: "100 bytes", "9.62 KB", "44.3 MB", "6.32 GB"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} bytes"


# ----------------------------------------------------------------------------- the host functions


_NOT_FINITE = """`values` holds {count} NaN or infinite entries of {nnz} (the first: `values[{first}] = {value}`, \
at row {row}, column {col}), so the matrix cannot be factored.
Find where they come from, for example with `jax.config.update("jax_debug_nans", True)`, or \
`jnp.isfinite(values).all()` before the solve."""


@dataclasses.dataclass(frozen=True)
class _Solve:
    """The host functions of one sparse solve (pattern, solver, dtype and precision): NumPy in
    and out. Compares by value, so equal solves share compiled programs and factorisations.
    The factorisations and solves are timed, for the choice of schedule (`_cost`, under the
    solve itself).

    `dtype` is the solution's (the inputs' result dtype); the solver factors and solves in
    `work`, at least float64 (complex128) unless `precision="input"`, and the results are
    rounded to `dtype` only where they leave the host."""

    pattern: SparsePattern
    solver: AbstractSparseSolver
    dtype: np.dtype
    name: str = "sparse_solve"
    precision: str = "double"
    # Where a forward's factorisation waits for the backward pass: "here", in this process's
    # store, where `request` counts its users (the jobs run on threads of this process);
    # "worker", in the store of the worker that made it, where each job of the matrix is sent
    # (a Dask client, `_affinity.Pinned`): a forward adds a user, its backward removes two;
    # "none", nowhere (a process pool, whose jobs go to any of its processes: a factorisation
    # kept in one would wait there for a backward pass that lands in another, `limit` of
    # them a process): each job factors and lets it go.
    kept: str = "here"

    @property
    def work(self) -> np.dtype:
        """The dtype the solver factors and solves in."""
        least = np.float64 if self.precision == "double" else np.float32
        return np.promote_types(self.dtype, least)

    def _factor(self, values: np.ndarray) -> Any:
        import scipy.sparse

        bad = ~np.isfinite(values)
        if bad.any():  # (SuperLU would report a zero pivot, or return NaN without a word)
            first = int(np.argmax(bad))
            raise ValueError(
                _NOT_FINITE.format(
                    count=int(bad.sum()),
                    nnz=values.size,
                    first=first,
                    value=values[first],
                    row=self.pattern.rows[first],
                    col=self.pattern.cols[first],
                )
            )
        p = self.pattern
        matrix = scipy.sparse.csc_matrix((values.astype(self.work), (p.rows, p.cols)), shape=(p.n, p.n))
        start = time.perf_counter()
        lu = self.solver.factor(matrix)
        end = time.perf_counter()
        _cost.observe(self, self._shapes, setup=end - start)
        _record.step("factor", start, end)
        return lu

    @property
    def _shapes(self) -> tuple:  # (the site's input shapes, by which its timings are kept)
        return ((self.pattern.nnz,), (self.pattern.n,))

    def _key(self, values: np.ndarray) -> Any:
        return (self, values.dtype.str, values.tobytes())

    def _nbytes(self, lu: Any) -> int:
        """The bytes of the factorisation `lu`, as its solver reports them (the first one's
        kept for the plan: `nbytes_of`)."""
        nbytes = int(self.solver.nbytes(lu, self.work))
        with _MEASURED_LOCK:
            _MEASURED.setdefault(self, nbytes)
            while len(_MEASURED) > _MEASURED_KEPT:
                _MEASURED.popitem(last=False)
        return nbytes

    def _acquire(self, values: np.ndarray) -> Any:
        """The factorisation of the matrix, kept or made, with one more user (see `Store`)."""
        return FACTORISATIONS.acquire(self._key(values), lambda: self._factor(values), self._nbytes)

    @contextlib.contextmanager
    def _factorised(self, values: np.ndarray, uses: int) -> Iterator[Any]:
        """The factorisation of the matrix, kept or made; inside, it is used, and after,
        `uses` users fewer for it (this use, and a forward pass's for a backward pass)."""
        key = self._key(values)
        try:
            yield self._acquire(values)
        finally:
            FACTORISATIONS.release(key, uses)

    def _solve(self, lu: Any, rhs: np.ndarray, transpose: bool) -> np.ndarray:
        """`A^-1 rhs` (or `A^-T rhs`) for `rhs` of shape `(n,)` or `(k, n)`: one call of the solver."""
        rhs = np.asarray(rhs, self.work)
        start = time.perf_counter()
        out = self.solver.solve(lu, rhs.T if rhs.ndim == 2 else rhs, transpose)
        end = time.perf_counter()
        _record.step("solve", start, end)
        per_rhs = (end - start) / (rhs.shape[0] if rhs.ndim == 2 else 1)
        _cost.observe(self, self._shapes, **{"bwd" if transpose else "fwd": per_rhs})
        return np.asarray(out, self.work).T if rhs.ndim == 2 else np.asarray(out, self.work)

    def _cotangents(self, x: tuple, y: np.ndarray, lam: np.ndarray) -> tuple:
        """`(ct_values, ct_b)` from `lam = A^-T ct_y` (one, or `k` stacked)."""
        values, b = x
        ct_values = -lam[..., self.pattern.rows] * y[self.pattern.cols]
        return _like(ct_values, values.dtype), _like(lam, b.dtype)

    def _product(self, t_values: np.ndarray, y: np.ndarray) -> np.ndarray:
        """`dA y` for the entries' tangent `t_values` (one, or `k` stacked)."""
        terms = np.asarray(t_values, self.work) * y[self.pattern.cols]
        out = np.zeros((*terms.shape[:-1], self.pattern.n), self.work)
        np.add.at(out, (..., self.pattern.rows), terms)  # pyright: ignore[reportArgumentType]  (NumPy's stub omits `...`)
        return out

    def fwd(self, x: tuple) -> np.ndarray:
        values, b = x
        if self.kept == "none":
            with self._factorised(values, uses=1) as lu:
                return self._solve(lu, b, False).astype(self.dtype)
        # a user until `request` ends (in a Dask worker, for `bwd` to remove)
        lu = self._acquire(values)
        return self._solve(lu, b, False).astype(self.dtype)

    def bwd(self, x: tuple, y: np.ndarray, ct_y: np.ndarray) -> tuple:
        if self.kept != "here":  # (a Dask worker's store: this use, and the forward's; or this use alone)
            with self._factorised(x[0], uses=2 if self.kept == "worker" else 1) as lu:
                return self._cotangents(x, y, self._adjoints(lu, x, y, ct_y[None])[0])
        lu = self._acquire(x[0])  # a user until `request` ends
        return self._cotangents(x, y, self._adjoints(lu, x, y, ct_y[None])[0])

    def _adjoints(self, lu: Any, x: tuple, y: np.ndarray, cts: np.ndarray) -> np.ndarray:
        """`lam = A^-T ct` for each row of `cts`, solved once per row that is not a multiple
        of another (or zero). For a matrix equal to its transpose, a row that is a multiple
        `c b` of the right-hand side (a self-adjoint loss: compliance) is `c y`, not solved."""
        values, b = x
        stacked = [np.asarray(b, cts.dtype), *cts]  # (`b` first: a cotangent may be a multiple of it)
        recipe, unique = _multiples(stacked, jax.ShapeDtypeStruct((), self.dtype))
        recipe = recipe[1:]  # (the cotangents')
        used = sorted({u for u, _ in recipe if u is not None})
        reuse = bool(used) and used[0] == 0 and unique[0] == 0 and self.pattern._symmetric(np.asarray(values))
        to_solve = used[1:] if reuse else used
        solved = {}
        if to_solve:
            rhs = np.stack([stacked[unique[u]] for u in to_solve])
            solved = dict(zip(to_solve, self._solve(lu, rhs, True), strict=True))
        if reuse:  # (`A^-T c b = c A^-1 b = c y` for a matrix equal to its transpose)
            solved[0] = np.asarray(y, self.work)
            if not to_solve:  # (no adjoint solve: the cost model times it as free)
                _cost.observe(self, self._shapes, bwd=0.0)
        zero = np.zeros(self.pattern.n, self.work)
        return np.stack([c * solved[u] if u is not None else zero for u, c in recipe])

    @contextlib.contextmanager
    def request(self, kind: str, elements: list) -> Iterator[None]:
        """Around one host request of `fwd` or `bwd` (each of `elements` a row's arguments,
        `(x,)` or `(x, y, ct_y)`): its rows' uses of each matrix become, after a forward,
        one hold for the backward passes; after a backward, nothing (with the forward's
        hold, if it has one: the rows of one request are all of one backward pass). See `Store`."""
        if self.kept != "here" or kind not in ("fwd", "bwd"):
            yield
            return
        rows = collections.Counter(self._key(args[0][0]) for args in elements)
        try:
            yield
        except BaseException:
            for key, n in rows.items():
                FACTORISATIONS.release(key, n)
            raise
        for key, n in rows.items():
            if kind == "fwd":
                FACTORISATIONS.hold(key, n)
            else:
                FACTORISATIONS.release(key, n, hold=True)

    def adopt(self, kind: str, args: tuple, out: Any) -> None:
        """An eager forward's hold becomes a lease on its output `out` (see `Store`)."""
        if self.kept == "here" and kind == "fwd":
            FACTORISATIONS.lease(self._key(args[0][0]), out)

    def fused(self, x: tuple, ct_y: np.ndarray) -> tuple:
        y, ct_xs = self.fused_batch(x, ct_y[None])
        return y, tuple(c[0] for c in ct_xs)

    def fused_batch(self, x: tuple, cts: np.ndarray) -> tuple:
        values, b = x
        # The adjoint is linear in the cotangent: a row that is a multiple of another
        # (a complex overlap's `m` and `1j * m`) or zero is not solved (`_adjoints`).
        with self._factorised(values, uses=1) as lu:
            y = self._solve(lu, b, False)
            lam = self._adjoints(lu, x, y, np.asarray(cts))
        return y.astype(self.dtype), self._cotangents(x, y, lam)

    def jvp(self, x: tuple, t_x: tuple) -> tuple:
        y, t_ys = self.jvp_batch(x, tuple(t[None] for t in t_x))
        return y, t_ys[0]

    def jvp_batch(self, x: tuple, t_xs: tuple) -> tuple:
        values, b = x
        t_values, t_b = t_xs
        with self._factorised(values, uses=1) as lu:
            y = self._solve(lu, b, False)
            t_y = self._solve(lu, np.asarray(t_b, self.work) - self._product(t_values, y), False)
        return y.astype(self.dtype), t_y.astype(self.dtype)


def _like(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`a` as a cotangent of dtype `dtype`: its real part for a real one."""
    return np.asarray(a if np.issubdtype(dtype, np.complexfloating) else np.real(a), dtype)


# by solve: the bytes of its first factorisation (in this process), for the plan; the
# latest `_MEASURED_KEPT` solves
_MEASURED: collections.OrderedDict[_Solve, int] = _runtime.store(collections.OrderedDict())
_MEASURED_LOCK = threading.Lock()
_MEASURED_KEPT = 256


@_runtime.cached(maxsize=64)
def _positions(pattern: SparsePattern) -> int:
    """The number of distinct positions of `pattern`'s entries."""
    return int(np.unique(pattern.rows * pattern.n + pattern.cols).size)


def nbytes_of(solve: _Solve) -> tuple[int, bool]:
    """`(bytes, measured)`: the bytes of `solve`'s factorisation, as its first one in this
    process measured; before any, the least any factorisation takes (its factors hold an
    entry at least at each position of the matrix's), not `measured`."""
    with _MEASURED_LOCK:
        measured = _MEASURED.get(solve)
    if measured is not None:
        return measured, True
    return _positions(solve.pattern) * solve.work.itemsize, False


_NOT_KEPT_PROCESSES = """its jobs run on {where}, which cannot send the backward job to the process that \
factored: the factorisation is not kept for the backward pass, which factors again"""
_NOT_KEPT_BUDGET = """its factorisation ({nbytes}) is past the factorisation budget ({budget}, \
`dx.set_factorisation_budget`): it is not kept for the backward pass, which factors again"""


def _not_kept(solve: _Solve, executor: Any) -> str | None:
    """Why the standard schedule's backward pass factors again, for the plan; None when it
    finds the forward's factorisation."""
    if solve.kept == "none":  # (not an executor: `on_executor` says so next)
        return _NOT_KEPT_PROCESSES.format(where=_executor.name(executor)) if isinstance(executor, cf.Executor) else None
    if solve.kept == "worker":  # (its workers' budgets are theirs: kept as far as this process knows)
        return None
    nbytes, measured = nbytes_of(solve)
    budget = FACTORISATIONS.budget
    if nbytes <= budget:
        return None
    shown = _bytes_text(nbytes) if measured else f"at least {_bytes_text(nbytes)}, its matrix's entries"
    return _NOT_KEPT_BUDGET.format(nbytes=shown, budget=_bytes_text(budget))


@_runtime.cached(maxsize=64)
def _solve_site(
    solve: _Solve, timeout: Any, name: str, max_basis: int | None, cost: Cost | None, not_kept: str | None
) -> ExpensiveFn:
    # (no executor here: this cache must not keep the caller's alive; `on_executor` adds it)
    c = Cost() if cost is None else cost
    # one factorisation answers every right-hand side; it waits for the backward pass where
    # it was made, unless `not_kept` says why not (`_not_kept`): then the backward factors again
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
    return timing_its_own(fn, solve, scope=solve.request, adopt=solve.adopt)


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
    precision: str = "double",
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

    On the standard schedule, the factorisation waits on the host for the backward passes
    (all of `jax.jacrev`'s rows, or every call of an eager `jax.vjp` function) and is
    dropped when none can come any more: eagerly, when the forward's output is garbage
    collected; under `jit`, after the first backward pass. Those waiting take at most the
    factorisation budget's bytes (a quarter of the machine's memory by default,
    [`deferax.set_factorisation_budget`][]; the oldest are dropped first), and a backward
    pass that finds its factorisation dropped factors again. A factorisation past the budget
    on its own is not kept: its site is planned with a second factorisation in the backward
    pass, and [`deferax.explain`][] says so beside its estimates. Under `vmap` over `b`
    alone, the right-hand sides share one factorisation.

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
      [`deferax.SuperLU`][] (SciPy's `splu`, imported when it first runs), whose column
      ordering is chosen for each pattern on its first factorisation: `"COLAMD"` or
      `"MMD_AT_PLUS_A"`, whichever fills less (`dx.SuperLU(permc_spec=...)` chooses it
      yourself).

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
      complex inputs), whatever the inputs' dtype, and rounds `x` and the cotangents and
      tangents to the inputs' dtype: a float32 program gets answers accurate to float32.
      `"input"` factors in the inputs' own dtype (at least float32), as SciPy would: half
      the memory and somewhat faster, but a factorisation in single precision loses
      digits with the matrix's condition number (a float32 finite-element stiffness came
      out 7-21 % off in value and 13-45 % in gradient). Either is the same for float64 inputs.
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
        raise TypeError(_NOT_PATTERN.format(name=name, found=_found(pattern)))
    solver = SuperLU() if solver is None else solver
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
            raise ValueError(_BAD_OPERAND.format(name=name, what=what, expected=expected, found=_found(a), fix=fix))
    dtype = np.result_type(np.dtype(values.dtype), np.dtype(b.dtype))
    if cost is not None and not isinstance(cost, Cost):
        raise TypeError(f"`dx.sparse_solve(name={name!r})`: `cost` must be a `dx.Cost` or None, but got {cost!r}.")
    if precision not in ("double", "input"):
        raise ValueError(_BAD_PRECISION.format(name=name, found=precision))
    executor = _affinity.pinned(executor)
    if executor is None or (isinstance(executor, cf.Executor) and _executor.in_this_process(executor)):
        kept = "here"
    elif isinstance(executor, _affinity.Pinned):  # (each matrix's jobs on one worker)
        kept = "worker"
    else:  # (a process pool: a backward job may land in any of its processes)
        kept = "none"
    solve = _Solve(pattern, solver, dtype, name, precision, kept)
    site = _solve_site(solve, timeout, name, max_basis, cost, _not_kept(solve, executor))
    fn = on_executor(site, executor)
    return fn((values, b))


_BAD_PRECISION = """`dx.sparse_solve(name={name!r})`: `precision` must be "double" or "input", but got {found!r}.
"double" (the default) factors in float64 whatever the inputs' dtype; "input" factors in the inputs' own dtype."""


def _found(a: Any) -> str:
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        return f"{np.dtype(a.dtype).name}{list(a.shape)}"
    return repr(a) if len(repr(a)) <= 80 else type(a).__name__
