"""`_Solve`: the host functions of one sparse solve (`fwd`, `bwd`, `fused`, `jvp` and their
batches), NumPy in and out, which factor the matrix once per call with the solver and keep the
forward's factorisation for the backward pass in the store (`_factorisations.FACTORISATIONS`).
The derivatives they compute are in `_solve`'s docstring. The reverse ones return the
adjoint `lam` (`partial`, in `partial_dtype`), from which `_solve`'s `combine` makes the
cotangents of the entries and of `b` inside the program."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools as ft
import time
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from .. import _record, _runtime
from .._checks import _checks
from .._host._runner import StackedRows, _multiples
from .._plan import _cost
from ._factorisations import FACTORISATIONS, record_nbytes
from ._pattern import SparsePattern
from ._solver import AbstractSparseSolver
from ._solvers import _cholmod

_BACKWARD = _runtime.BACKWARD

_NOT_FINITE = """`values` holds {count} NaN or infinite entries of {nnz} (the first: `values[{first}] = {value}`, \
at row {row}, column {col}), so the matrix cannot be factored.
Find where they come from, for example with `jax.config.update("jax_debug_nans", True)`, or \
`jnp.isfinite(values).all()` before the solve."""


def not_finite_message(values: np.ndarray, pattern: SparsePattern) -> str:
    """The error for a matrix whose `values` hold a NaN or infinite entry: how many, and
    where the first sits (the host's solve and the program's raise it alike)."""
    bad = ~np.isfinite(values)
    first = int(np.argmax(bad))
    return _NOT_FINITE.format(
        count=int(bad.sum()),
        nnz=values.size,
        first=first,
        value=values[first],
        row=pattern.rows[first],
        col=pattern.cols[first],
    )


# What a matrix with a NaN or infinite entry (`nonfinite`), or one that the solver finds singular
# (`singular`), gives: an error (`"raise"`), or NaN for the solution and every derivative (`"nan"`),
# with a warning (`"warn"`).
TREATMENTS = ("raise", "nan", "warn")

_GIVES_NAN = """{call}: {why}, so its solution and derivatives are NaN (`{what}={treatment!r}`)."""

_NOT_SINGULAR = """`singular={singular!r}` gives NaN for a singular matrix, and this one is not singular (an LU \
factors it): the solver is wrong for it, and `singular=` does not apply."""


@dataclasses.dataclass(frozen=True)
class _Unfactored:
    """What stands for the factorisation of a matrix that gives NaN (`nonfinite` or
    `singular` not `"raise"`): every solve with it is NaN, and the solver never sees it."""

    why: str


class _Entries:
    """A matrix's entries, as part of the key of its factorisation in the store: their words
    (8 bytes each, or bytes), hashed once by NumPy (their sum, wrapping: one pass over the
    memory; keys with equal hashes, entries in another order among them, are told apart by
    their words). A second pass (their exclusive or) cost the beam's jitted gradient 0.7 ms
    (its two keys: 2.16 ms with it, 1.47 ms without), the words read fresh from memory.

    The words are the entries' own memory where it is a JAX array's (`_frozen`: what a host
    callback and an eager call receive), which nothing can change and the key keeps alive;
    else a copy (also of a row of a batch of matrices, which would keep the batch alive). A
    copy of the 180 x 60 beam's 5.5 MB took 0.45 ms alone; in its jitted gradient a key took
    1.8 ms with the copy and 0.9 ms without (two keys a gradient on the standard schedule).
    Two equal keys compare the words once and then share them, so a key looked up again (the
    store's every step of a job finds the forward's key) compares by identity: each
    comparison of the beam's entries took 0.5 ms, five of them a backward job."""

    __slots__ = ("words", "_hash")

    def __init__(self, values: np.ndarray):
        owned = values if _frozen(values) and values.flags.c_contiguous else values.copy()
        flat = owned.reshape(-1)
        words = flat.view(np.uint64 if flat.nbytes % 8 == 0 else np.uint8)
        self.words = words
        self._hash = hash((words.size, int(words.sum(dtype=words.dtype))))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Entries):
            return NotImplemented
        if self.words is other.words:
            return True
        if self._hash != other._hash or self.words.dtype != other.words.dtype:
            return False
        if not np.array_equal(self.words, other.words):  # (bit for bit)
            return False
        self.words = other.words  # (equal words, shared: the next comparison is by identity)
        return True


def _frozen(a: np.ndarray) -> bool:
    """Whether `a` views a JAX array's memory, all of it (`np.asarray` of one, or a view of
    that of as many bytes: a broadcast row): a JAX array is never written to, and the view
    keeps it alive. A row of a batch of matrices (`vmap`) is not: its key would keep the
    whole batch alive."""
    base: Any = a
    while isinstance(base, np.ndarray):
        if base.flags.writeable:
            return False
        base = base.base
    return isinstance(base, memoryview) and isinstance(base.obj, jax.Array) and base.nbytes == a.nbytes


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
    # How a matrix with a NaN or infinite entry, and one the solver finds singular, are
    # treated (`TREATMENTS`): `dx.sparse_solve`'s own errors by default; a recognised call
    # gets what its original library does.
    nonfinite: str = "raise"
    singular: str = "raise"
    # Whether the matrix is taken as symmetric without a check (`dx.sparse_solve`'s
    # `symmetric`): the adjoint solves with `A` itself, as a library that assumes it does.
    symmetric: bool = False
    # Whether the program that calls the host functions has `jax_enable_x64` on (they may run
    # in a process where it is off): the dtypes it can hold.
    x64: bool = True
    # Whether `values` are real while `b` is complex: the matrix is factored real (`matrix_dtype`,
    # as `dx.Cholmod` needs), and a complex right-hand side is solved as its real and imaginary parts.
    real_matrix: bool = False

    @property
    def work(self) -> np.dtype:
        """The dtype the solver solves in (of the right-hand sides and solutions)."""
        least = np.float64 if self.precision == "double" else np.float32
        return np.promote_types(self.dtype, least)

    @property
    def matrix_dtype(self) -> np.dtype:
        """The dtype the solver factors in: `work`, or its real counterpart (`real_matrix`)."""
        return np.finfo(self.work).dtype if self.real_matrix else self.work

    def _factor(self, values: np.ndarray) -> Any:
        if not np.isfinite(values).all():  # (SuperLU would report a zero pivot, or return NaN without a word)
            bad = ~np.isfinite(values)
            first = int(np.argmax(bad))
            if self.nonfinite != "raise":
                why = f"`values` holds {int(bad.sum())} NaN or infinite entries (the first: `values[{first}]`)"
                return self._unfactored("nonfinite", why)
            raise ValueError(not_finite_message(values, self.pattern))
        matrix = self.pattern._csc(values.astype(self.matrix_dtype, copy=False))
        start = time.perf_counter()
        try:
            lu = self.solver.factor(matrix)
        except np.linalg.LinAlgError as e:
            if self.singular == "raise":
                raise
            if isinstance(e, _cholmod.NotPositiveDefinite):  # (a wrong solver, unless the matrix is singular too)
                if not _cholmod.singular(matrix):
                    raise _cholmod.NotPositiveDefinite(f"{e}\n{_NOT_SINGULAR.format(singular=self.singular)}") from None
                why = f"its solver raised NotPositiveDefinite: {_first_line(e)}, and an LU finds it singular"
                return self._unfactored("singular", why)
            return self._unfactored("singular", f"its solver raised LinAlgError: {_first_line(e)}")
        end = time.perf_counter()
        _cost.observe(self, self._shapes, setup=end - start)
        _record.step("factor", start, end)
        return lu

    def _unfactored(self, what: str, why: str) -> _Unfactored:
        """The stand-in for a matrix that gives NaN, warned of where `what` (`"nonfinite"` or
        `"singular"`) says `"warn"` (as SciPy's `spsolve` warns)."""
        treatment = getattr(self, what)
        if treatment == "warn":
            from scipy.sparse.linalg import MatrixRankWarning

            message = _GIVES_NAN.format(call=_checks.title(self.name), why=why, what=what, treatment=treatment)
            warnings.warn(message, MatrixRankWarning, stacklevel=2)
        return _Unfactored(why)

    @property
    def _shapes(self) -> tuple:  # (the site's input shapes, by which its timings are kept)
        return ((self.pattern.nnz,), (self.pattern.n,))

    def _key(self, values: np.ndarray) -> Any:
        """The key of the factorisation of the matrix with entries `values` in the store:
        the one its request made (`request`, `Store.made`), else made (a hash of every byte
        of the entries: `_Entries`)."""
        made = FACTORISATIONS.made(values)
        if made is not None and made[0] is self:
            return made
        return (self, values.dtype.str, _Entries(values))

    def _row_keys(self, elements: list) -> list:
        """`_key` of each row's matrix (`elements[i][0][0]`), made once for a run of rows with
        equal values (`jax.jacrev`, `vmap` over `b`: every row broadcasts one matrix), each
        row compared with the one before it rather than copied and hashed (a key hashes
        every byte of the entries)."""
        keys: list = []
        previous = None
        for args in elements:
            v = args[0][0]
            if previous is not None and (_same_memory(v, previous) or np.array_equal(v, previous)):
                keys.append(keys[-1])
            else:
                keys.append(self._key(v))
            previous = v
        return keys

    def _nbytes(self, lu: Any) -> int:
        """The bytes of the factorisation `lu`, as its solver reports them (the first one's
        kept for the plan: `nbytes_of`)."""
        if isinstance(lu, _Unfactored):  # (nothing held; not this solve's bytes, for the plan)
            return 0
        nbytes = int(self.solver.nbytes(lu, self.matrix_dtype))
        record_nbytes(self, nbytes)
        return nbytes

    def _acquire(self, values: np.ndarray, key: Any = None, users: int = 1) -> Any:
        """The factorisation of the matrix, kept or made, with `users` more users (see
        `_factorisations.Store`); `key`: `_key(values)`, where it was made already."""
        key = self._key(values) if key is None else key
        return FACTORISATIONS.acquire(key, lambda: self._factor(values), self._nbytes, users)

    @contextlib.contextmanager
    def _factorised(self, values: np.ndarray, uses: int, users: int = 1) -> Iterator[Any]:
        """The factorisation of the matrix, kept or made, with `users` more users; inside, it
        is used, and after, `uses` users fewer for it (these, and a forward pass's for a
        backward pass)."""
        key = self._key(values)
        try:
            yield self._acquire(values, key, users)
        finally:
            FACTORISATIONS.release(key, uses)

    def _solve(self, lu: Any, rhs: np.ndarray, transpose: bool, both: bool = False) -> np.ndarray:
        """`A^-1 rhs` (or `A^-T rhs`) for `rhs` of shape `(n,)` or `(k, n)`: one call of the
        solver. Its time a right-hand side is kept as a forward's (a transposed one's as a
        backward's); with `both` (a symmetric matrix's forward and adjoint right-hand sides
        solved together), as both."""
        rhs = np.asarray(rhs, self.work)
        if isinstance(lu, _Unfactored):
            return np.full(rhs.shape, complex(np.nan, np.nan) if self.work.kind == "c" else np.nan, self.work)
        start = time.perf_counter()
        if self.real_matrix:  # (a real factorisation: the parts of `k` complex right-hand sides, `2k` real ones)
            real, imag = np.real(rhs), np.imag(rhs)
            parts = np.concatenate([real, imag]) if rhs.ndim == 2 else np.stack([real, imag])
            solved = np.asarray(self.solver.solve(lu, parts.T, transpose)).T
            out = (solved[: len(parts) // 2] + 1j * solved[len(parts) // 2 :]).T
            out = out if rhs.ndim == 2 else out[:, 0]
        else:
            out = self.solver.solve(lu, rhs.T if rhs.ndim == 2 else rhs, transpose)
        end = time.perf_counter()
        _record.step("solve", start, end)
        per_rhs = (end - start) / (rhs.shape[0] if rhs.ndim == 2 else 1)
        kinds = ("fwd", "bwd") if both else ("bwd",) if transpose else ("fwd",)
        _cost.observe(self, self._shapes, **dict.fromkeys(kinds, per_rhs))
        return np.asarray(out, self.work).T if rhs.ndim == 2 else np.asarray(out, self.work)

    @property
    def partial_dtype(self) -> np.dtype:
        """The dtype of the adjoint `lam` the reverse functions return: `work` where the
        program can hold it (`x64`), else the solution's."""
        return self.work if self.x64 else np.dtype(self.dtype)

    def _partial(self, lam: np.ndarray) -> np.ndarray:
        return np.asarray(lam, self.partial_dtype)

    def _product(self, t_values: np.ndarray, y: np.ndarray) -> np.ndarray:
        """`dA y` for the entries' tangent `t_values` (one, or `k` stacked; `y` broadcast against it)."""
        terms = np.asarray(t_values, self.work) * y[..., self.pattern.cols]
        out = np.zeros((*terms.shape[:-1], self.pattern.n), self.work)
        np.add.at(out, (..., self.pattern.rows), terms)  # pyright: ignore[reportArgumentType]  (NumPy's stub omits `...`)
        return out

    # Each host function below has a version for the rows of a `vmap` batch on one matrix
    # (`rows`: one job, one factorisation, the rows' right-hand sides solved together): its
    # `x` is `(values, bs)` with the rows' `b` stacked, and so are its other arguments; it
    # returns a list of the rows' results. The one-row functions are that with one row.

    def fwd(self, x: tuple) -> np.ndarray:
        values, b = x
        return self.fwd_rows((values, b[None])).tree[0]

    def fwd_rows(self, x: tuple, keep: bool = True) -> StackedRows:
        """The forward of the rows; with `keep`, its factorisation waits for the backward pass
        (without, no backward pass follows: it is let go)."""
        values, bs = x
        if self.kept == "none" or not keep:
            with self._factorised(values, uses=1) as lu:
                return StackedRows(self._solve(lu, bs, False).astype(self.dtype))
        # a user a row until `request` ends (in a Dask worker, for `bwd` to remove)
        lu = self._acquire(values, users=len(bs))
        return StackedRows(self._solve(lu, bs, False).astype(self.dtype))

    def bwd(self, x: tuple, y: np.ndarray, ct_y: np.ndarray) -> np.ndarray:
        values, b = x
        return self.bwd_rows((values, b[None]), y[None], ct_y[None]).tree[0]

    def bwd_rows(self, x: tuple, ys: np.ndarray, cts: np.ndarray) -> StackedRows:
        values, bs = x
        rows = len(bs)
        if self.kept != "here":  # (a Dask worker's store: these uses, and the forward's; or these uses alone)
            with self._factorised(values, uses=2 * rows if self.kept == "worker" else rows, users=rows) as lu:
                lams = self._adjoints(lu, x, ys, cts[:, None])
        else:
            lu = self._acquire(values, users=rows)  # a user a row until `request` ends
            lams = self._adjoints(lu, x, ys, cts[:, None])
        return StackedRows(self._partial(lams[:, 0]))  # (all rows at once)

    def _adjoints(self, lu: Any, x: tuple, ys: np.ndarray, cts: np.ndarray) -> np.ndarray:
        """`lam = A^-T ct` for each row `ct` of `cts[i]` (`i`: a row of the batch, with its
        `b` and solution `ys[i]`), all solved in one call of the solver (`_adjoint_rhs`); `A^-1
        ct` where the matrix is taken as symmetric (`symmetric`)."""
        values, bs = x
        cts = np.asarray(cts)
        if cts.shape[1] == 1 and len(bs) > 1 and not self.symmetric and not self.pattern._symmetric(np.asarray(values)):
            # (one cotangent a row, `jax.jacrev` or `vmap`, on a matrix not equal to its transpose:
            # no cotangent can take its row's solution, so all are solved in one call untested)
            return self._solve(lu, cts[:, 0], True)[:, None]
        plans, rhs = self._adjoint_rhs(x, cts, True if self.symmetric else None)
        solved = self._solve(lu, rhs, not self.symmetric) if len(rhs) else rhs
        return self._adjoint_rows(plans, solved, ys, cts.shape)

    def _adjoint_rhs(self, x: tuple, cts: np.ndarray, symmetric: bool | None) -> tuple[list, np.ndarray]:
        """`(plans, rhs)`: the right-hand sides the adjoints of `cts` (as `_adjoints`'s) need
        solved, stacked, once each that is not a multiple of another of its row (or zero), and
        each row's plan to make its adjoints from their solutions (`_adjoint_rows`). For a
        matrix equal to its transpose (`symmetric`: known, or None to check where it matters),
        a cotangent that is a multiple `c b` of its row's right-hand side (a self-adjoint loss:
        compliance) is `c y`, not solved."""
        values, bs = x
        plans, rhs = [], []
        for b, row in zip(bs, cts, strict=True):
            stacked = [np.asarray(b, row.dtype), *row]  # (`b` first: a cotangent may be a multiple of it)
            recipe, unique = _multiples(stacked, jax.ShapeDtypeStruct((), self.dtype))
            recipe = recipe[1:]  # (the cotangents')
            used = sorted({u for u, _ in recipe if u is not None})
            reuse = bool(used) and used[0] == 0 and unique[0] == 0
            if reuse:
                symmetric = self.pattern._symmetric(np.asarray(values)) if symmetric is None else symmetric
                reuse = symmetric
            to_solve = used[1:] if reuse else used
            plans.append((recipe, reuse, {u: len(rhs) + j for j, u in enumerate(to_solve)}))
            rhs += [stacked[unique[u]] for u in to_solve]
        if not rhs and any(reuse for _, reuse, _ in plans):  # (no adjoint solve: the cost model times it as free)
            _cost.observe(self, self._shapes, bwd=0.0)
        return plans, np.stack(rhs).astype(self.work, copy=False) if rhs else np.zeros((0, self.pattern.n), self.work)

    def _adjoint_rows(self, plans: list, solved: np.ndarray, ys: np.ndarray, shape: tuple) -> np.ndarray:
        """The adjoints, shaped as the cotangents (`shape`), from `_adjoint_rhs`'s `plans` and
        the solutions of its right-hand sides (`solved`)."""
        zero = np.zeros(self.pattern.n, self.work)
        lams = []
        for y, (recipe, reuse, at) in zip(ys, plans, strict=True):
            lam = {u: solved[i] for u, i in at.items()}
            if reuse:  # (`A^-T c b = c A^-1 b = c y` for a matrix equal to its transpose)
                lam[0] = np.asarray(y, self.work)
            lams.append([c * lam[u] if u is not None else zero for u, c in recipe])
        return np.asarray(lams, self.work).reshape((*shape[:2], self.pattern.n))

    def rows(self, kind: str, elements: list) -> list | None:
        """The jobs of one host request of `kind` (each of `elements` a row's arguments): one
        a matrix, for the rows of a `vmap` batch that share it (`vmap` over `b`: one
        factorisation for all, their right-hand sides solved together), as `(rows, fn,
        args)`, `fn(*args)` returning the results of the elements `rows`; None where no two
        rows share a matrix (a job a row). A forward that no backward pass follows
        (`_runtime.BACKWARD`, from the site's equation) keeps no factorisation."""
        fn = {
            "fwd": self.fwd_rows,
            "bwd": self.bwd_rows,
            "fused": self.fused_rows,
            "fused_batch": self.fused_batch_rows,
            "jvp": self.jvp_rows,
            "jvp_batch": self.jvp_batch_rows,
        }.get(kind)
        alone = kind == "fwd" and not _BACKWARD.get()
        if alone:
            fn = ft.partial(self.fwd_rows, keep=False)
        if fn is None or (len(elements) < 2 and not alone):
            return None
        groups: dict[Any, list[int]] = {}
        for i, key in enumerate(self._row_keys(elements)):
            groups.setdefault(key, []).append(i)
        if len(groups) == len(elements) and not alone:
            return None
        jobs = []
        for members in groups.values():
            values = elements[members[0]][0][0]
            rows = [elements[i] for i in members]
            bs = _stack(*(args[0][1] for args in rows))
            # (the rows' other arguments, each stacked: `y` and `ct_y`, a cotangent, tangents)
            rest = [jax.tree.map(_stack, *(args[j] for args in rows)) for j in range(1, len(rows[0]))]
            jobs.append((members, fn, ((values, bs), *rest)))
        return jobs

    @contextlib.contextmanager
    def request(self, kind: str, elements: list) -> Iterator[None]:
        """Around one host request of `fwd` or `bwd` (each of `elements` a row's arguments,
        `(x,)` or `(x, y, ct_y)`): its rows' uses of each matrix become, after a forward,
        one hold for the backward passes; after a backward, nothing (with the forward's
        hold, if it has one: the rows of one request are all of one backward pass). See
        `_factorisations.Store`."""
        if self.kept != "here" or kind not in ("fwd", "bwd") or (kind == "fwd" and not _BACKWARD.get()):
            yield  # (a forward that no backward pass follows lets its factorisation go itself: `rows`)
            return
        keys = self._row_keys(elements)
        rows = collections.Counter(keys)
        try:
            with FACTORISATIONS.requested([args[0][0] for args in elements], keys):  # (for the jobs' `_key`)
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
        """An eager forward's hold becomes a lease on its output `out` (see `_factorisations.Store`)."""
        if self.kept == "here" and kind == "fwd":
            FACTORISATIONS.lease(self._key(args[0][0]), out)

    def fused(self, x: tuple, ct_y: np.ndarray) -> tuple:
        y, lams = self.fused_batch(x, ct_y[None])
        return y, lams[0]

    def fused_rows(self, x: tuple, cts: np.ndarray) -> list:
        return [(y, lams[0]) for y, lams in self.fused_batch_rows(x, cts[:, None])]

    def fused_batch(self, x: tuple, cts: np.ndarray) -> tuple:
        values, b = x
        return self.fused_batch_rows((values, b[None]), cts[None])[0]

    def fused_batch_rows(self, x: tuple, cts: np.ndarray) -> list:
        values, bs = x
        # The adjoint is linear in the cotangent: a row that is a multiple of another
        # (a complex overlap's `m` and `1j * m`) or zero is not solved (`_adjoints`).
        with self._factorised(values, uses=1) as lu:
            if self.symmetric or (not isinstance(lu, _Unfactored) and self.solver.symmetric(lu)):
                # (`A^T = A`: the forward and adjoint right-hand sides in one call of the solver)
                plans, rhs = self._adjoint_rhs(x, np.asarray(cts), True)
                solved = self._solve(lu, np.concatenate([np.asarray(bs, self.work), rhs]), False, both=len(rhs) > 0)
                ys = solved[: len(bs)]
                lams = self._adjoint_rows(plans, solved[len(bs) :], ys, cts.shape)
            else:
                ys = self._solve(lu, bs, False)
                lams = self._adjoints(lu, x, ys, cts)
        return [(y.astype(self.dtype), self._partial(lam)) for y, lam in zip(ys, lams, strict=True)]

    def jvp(self, x: tuple, t_x: tuple) -> tuple:
        y, t_ys = self.jvp_batch(x, tuple(t[None] for t in t_x))
        return y, t_ys[0]

    def jvp_rows(self, x: tuple, t_xs: tuple) -> list:
        return [(y, t_ys[0]) for y, t_ys in self.jvp_batch_rows(x, tuple(t[:, None] for t in t_xs))]

    def jvp_batch(self, x: tuple, t_xs: tuple) -> tuple:
        values, b = x
        return self.jvp_batch_rows((values, b[None]), tuple(t[None] for t in t_xs))[0]

    def jvp_batch_rows(self, x: tuple, t_xs: tuple) -> list:
        values, bs = x
        t_values, t_b = t_xs  # (each row's `k` tangents)
        with self._factorised(values, uses=1) as lu:
            ys = self._solve(lu, bs, False)
            rhs = np.asarray(t_b, self.work) - self._product(t_values, ys[:, None, :])
            t_ys = self._solve(lu, rhs.reshape(-1, self.pattern.n), False).reshape(rhs.shape)
        return [(y.astype(self.dtype), t_y.astype(self.dtype)) for y, t_y in zip(ys, t_ys, strict=True)]


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether `a` and `b` are views of the same entries (rows of one broadcast array)."""
    return (
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.strides == b.strides
        and a.shape == b.shape
        and a.dtype == b.dtype
    )


def _stack(*a: np.ndarray) -> np.ndarray:
    """The rows `a` stacked; views of one array (an argument not batched, broadcast) stay one
    broadcast view, not copied a row each."""
    if all(_same_memory(a[0], b) for b in a[1:]):
        return np.broadcast_to(a[0], (len(a), *np.shape(a[0])))
    return np.stack(a)


def _first_line(e: BaseException) -> str:
    return str(e).split("\n", 1)[0].rstrip(".")
