"""Sparse direct solvers for [`deferax.sparse_solve`][]: `AbstractSparseSolver`, the hook, and
`SuperLU`, SciPy's `splu` (the others, and the default that measures them, in `_solvers/`).

They run on the host (NumPy and SciPy in, NumPy out). SciPy is imported when a solve first
runs, not when deferax is imported.
"""

from __future__ import annotations

import abc
import weakref
from typing import Any

import equinox as eqx
import numpy as np

from .. import _runtime
from .._concurrency import _native_threads


class AbstractSparseSolver(eqx.Module):
    """A sparse direct solver: factor a matrix once, then solve with it and with its
    transpose for any number of right-hand sides.

    [`deferax.sparse_solve`][] calls `factor` once per matrix and `solve` for the forward
    right-hand side, the adjoint ones (`transpose=True`) and the tangent ones; it keeps the
    factorisation between the forward and the backward pass. Both methods run on the host,
    on the executor of the solve, with NumPy and SciPy values.

    Subclass it to plug in another solver (UMFPACK, PARDISO, a GPU solver). A solver is
    part of the program's static configuration: it must be hashable and compare by value
    (an `eqx.Module` with static fields is), and picklable for a process pool or Dask.

    !!! Example

        ```python
        import scipy.linalg

        import deferax as dx


        class DenseLU(dx.AbstractSparseSolver):  # for small systems: LAPACK on the dense matrix
            def factor(self, matrix):
                return scipy.linalg.lu_factor(matrix.toarray())

            def solve(self, factorisation, rhs, transpose):
                return scipy.linalg.lu_solve(factorisation, rhs, trans=1 if transpose else 0)
        ```
    """

    @abc.abstractmethod
    def factor(self, matrix: Any) -> Any:
        """Factor `matrix`, a square `scipy.sparse.csc_matrix`, and return the factorisation
        (any object). Raise `numpy.linalg.LinAlgError` for a singular matrix.

        `matrix` is float64 (for real values, whatever `b`) or complex128 whatever the dtype of
        the program's values, unless the solve asked for `precision="input"` (then float32 or
        complex64 for single-precision inputs): a solver must factor in the dtype it is given,
        not lower. Its entries are finite (`dx.sparse_solve` rejects NaN and infinity before it
        calls `factor`)."""

    @abc.abstractmethod
    def solve(self, factorisation: Any, rhs: np.ndarray, transpose: bool) -> np.ndarray:
        """Solve `A x = rhs` (or `A^T x = rhs` with `transpose`: the plain transpose, not the
        conjugate one) for `rhs` of shape `(n,)` or `(n, k)` (`k` right-hand sides, in the
        matrix's dtype), and return `x` with `rhs`'s shape and the matrix's dtype."""

    def symmetric(self, factorisation: Any) -> bool:
        """Whether the factored matrix equals its transpose, so that `solve` with `transpose`
        is the same solve (a Cholesky factorisation's is): then a deferred site's forward and
        adjoint right-hand sides are solved in one call. Default False (deferax then solves
        each as asked)."""
        return False

    def nbytes(self, factorisation: Any, dtype: np.dtype) -> int:
        """The memory `factorisation` holds, in bytes, for the budget of the factorisations
        kept between the forward and the backward pass ([`deferax.set_factorisation_budget`][]);
        `dtype` is the matrix's. Default: for SciPy's `splu` object, as [`deferax.SuperLU`][]
        counts it; else the `nbytes` of the NumPy arrays it is or holds (a tuple or list of
        them, as `scipy.linalg.lu_factor` returns), else 0. Override it for a factorisation
        held elsewhere (a C library's handle, a GPU's memory): one reported as 0 bytes is
        kept whatever its size."""
        if all(hasattr(factorisation, a) for a in ("nnz", "perm_r", "perm_c", "solve")):  # (`splu`'s)
            return _superlu_nbytes(factorisation, dtype)
        parts = factorisation if isinstance(factorisation, tuple | list) else (factorisation,)
        return sum(int(p.nbytes) for p in parts if isinstance(p, np.ndarray))


def _superlu_nbytes(factorisation: Any, dtype: np.dtype) -> int:
    """SuperLU's factors' stored entries (`nnz`: those of `L` and `U`, with their supernodes'
    padding), each in `dtype` with a 4-byte index, and its two permutations; read without
    copying the factors out (as its `L` and `U` would)."""
    perms = factorisation.perm_r.nbytes + factorisation.perm_c.nbytes
    return int(factorisation.nnz) * (np.dtype(dtype).itemsize + 4) + int(perms)


_ORDERINGS = ("COLAMD", "MMD_AT_PLUS_A", "MMD_ATA", "NATURAL")

_BAD_ORDERING = """`dx.SuperLU`: `permc_spec` must be None (chosen from the pattern) or one of {orderings}, \
but got {{found!r}}.""".format(orderings=", ".join(map(repr, _ORDERINGS)))


# The orderings tried on a pattern's first factorisation when none is given, first preferred on a tie.
_TRIED = ("COLAMD", "MMD_AT_PLUS_A")


# the digests of CSC structures whose arrays cannot change (a `SparsePattern`'s, shared by every
# matrix made from it), by the identities of those arrays
_DIGESTS: dict[tuple[int, int], tuple[tuple, tuple]] = _runtime.store({})


def _pattern_key(matrix: Any) -> tuple:
    """The identity of the CSC `matrix`'s pattern (its shape and a digest of its structure,
    whatever its index dtype), by which the ordering chosen for it is kept. Computed once for
    the read-only structure that `dx.sparse_solve` shares between the matrices of a pattern
    (O(nnz) otherwise)."""
    import hashlib

    arrays = (matrix.indptr, matrix.indices)
    owners = tuple(_fixed_owner(a) for a in arrays)
    ident = (id(owners[0]), id(owners[1]))
    known = _DIGESTS.get(ident)
    if known is not None and all(r() is o for r, o in zip(known[0], owners, strict=True)):
        return known[1]
    # (the indices digested as int32 where they fit, as `SparsePattern._csc` holds them, else int64:
    # a SciPy matrix's int64 indices and a pattern's int32 ones are one structure, one key)
    fits = max(matrix.shape[0], matrix.indices.size) <= np.iinfo(np.int32).max
    digest = hashlib.blake2b(digest_size=16)
    for a in arrays:
        digest.update(np.ascontiguousarray(a, np.int32 if fits else np.int64).tobytes())
    key = (matrix.shape, digest.hexdigest())
    if all(o is not None for o in owners):
        refs = tuple(weakref.ref(o, lambda _, ident=ident: _DIGESTS.pop(ident, None)) for o in owners)
        _DIGESTS[ident] = (refs, key)
    return key


def _structure(pattern: Any) -> Any:
    """The CSC matrix whose pattern is `pattern`'s (a `SparsePattern`, or a SciPy sparse matrix),
    for `_pattern_key`."""
    import scipy.sparse

    if not scipy.sparse.issparse(pattern):
        ones = np.ones(pattern.rows.size, np.int8)
        pattern = scipy.sparse.csc_matrix((ones, (pattern.rows, pattern.cols)), shape=(pattern.n, pattern.n))
    return scipy.sparse.csc_matrix(pattern)


def _fixed_owner(a: Any) -> np.ndarray | None:
    """The read-only array that owns `a`'s memory and that `a` is the whole of (`a` itself, or
    the array SciPy took a view of), whose contents therefore never change; None otherwise."""
    owner = a.base if isinstance(a, np.ndarray) and isinstance(a.base, np.ndarray) else a
    if not isinstance(owner, np.ndarray) or owner.base is not None or owner.flags.writeable:
        return None
    return owner if owner.dtype == a.dtype and owner.shape == a.shape else None


def _structurally_symmetric(matrix: Any) -> bool:
    """Whether the CSC `matrix` has an entry at `(j, i)` for each at `(i, j)` (O(nnz))."""
    pattern = matrix.copy()
    pattern.data = np.ones_like(pattern.data, dtype=np.int8)
    return (pattern != pattern.T).nnz == 0


_SINGULAR = """the matrix is singular: {solver} found {why}.
Check that `values` has no zero (or cancelling) entries on the pivots and that the pattern covers every row and \
column."""


class SuperLU(AbstractSparseSolver):
    """SciPy's sparse LU factorisation, `scipy.sparse.linalg.splu` (SuperLU), one of the
    candidates of [`deferax.AutoSparseSolver`][] (the default solver of
    [`deferax.sparse_solve`][]), and the solver there when SciPy alone is installed.

    **Arguments:**

    - `permc_spec`: the column ordering, as for `splu`: `"COLAMD"`, `"MMD_AT_PLUS_A"`,
      `"MMD_ATA"` or `"NATURAL"`; or None (the default): chosen for each sparsity pattern on
      its first factorisation, which factors with both `"COLAMD"` and `"MMD_AT_PLUS_A"` and
      keeps the one whose factors hold fewer entries (less fill: less memory, and on the
      patterns measured, the faster factorisation and solves); later factorisations of the
      pattern use it at once (`chosen` says which, and the fill of each). On a 180 x 60
      finite-element stiffness `"MMD_AT_PLUS_A"` wins (factored in about 125 ms against
      COLAMD's 255 ms); on the 108 x 108 FDFD operator of a waveguide bend, structurally
      symmetric too, COLAMD does (10-13 % less fill, about twice as fast).

    SuperLU releases Python's GIL while it factors and solves: several systems (one a
    wavelength, say) are factored at once on deferax's threads. It runs with one BLAS
    thread: its calls into BLAS are too small to share between threads, and OpenBLAS's
    threads only wait for one another (a 108 x 108 complex Helmholtz `splu` and 5 solves
    took 0.06 to 0.11 s on one thread, 0.09 to 0.27 s on OpenBLAS's default 2, on 2 cores).
    """

    permc_spec: str | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        if self.permc_spec not in (None, *_ORDERINGS):
            raise ValueError(_BAD_ORDERING.format(found=self.permc_spec))

    def ordering(self, symmetric: bool) -> str:
        """The column ordering the rule of thumb gives a matrix whose pattern is structurally
        symmetric (`symmetric`, as [`deferax.SparsePattern`][]'s `structurally_symmetric`) or
        not: `permc_spec` when given. With `permc_spec=None` the ordering is measured instead
        (`chosen`); this one is preferred where the two fill alike."""
        if self.permc_spec is not None:
            return self.permc_spec
        return "MMD_AT_PLUS_A" if symmetric else "COLAMD"

    def chosen(self, pattern: Any) -> tuple[str, dict[str, int]] | None:
        """`(ordering, fill)`: the column ordering chosen for the sparsity `pattern` (a
        [`deferax.SparsePattern`][], or a SciPy sparse matrix) and the entries of the
        factors each ordering tried gave; None before its first factorisation, or for a
        solver with its own `permc_spec`."""
        if self.permc_spec is not None:
            return None
        return _runtime.ORDERINGS.get(_pattern_key(_structure(pattern)))

    def factor(self, matrix: Any) -> Any:
        try:
            if self.permc_spec is not None:
                return self._splu(matrix, self.permc_spec)
            key = _pattern_key(matrix)
            known = _runtime.ORDERINGS.get(key)
            if known is not None:
                return self._splu(matrix, known[0])
            # the pattern's first factorisation: each ordering tried, the one with less fill kept
            preferred = self.ordering(_structurally_symmetric(matrix))
            best, fill = None, {}
            for permc_spec in sorted(_TRIED, key=lambda o: o != preferred):
                lu = self._splu(matrix, permc_spec)
                fill[permc_spec] = int(lu.nnz)
                if best is None or lu.nnz < best[1].nnz:
                    best = (permc_spec, lu)
                del lu  # (the other's memory released before the next is made)
            assert best is not None
            _runtime.ORDERINGS[key] = (best[0], fill)
            return best[1]
        except RuntimeError as e:  # SuperLU reports a zero pivot as "Factor is exactly singular"
            if "singular" not in str(e):
                raise
            raise np.linalg.LinAlgError(_SINGULAR.format(solver="SuperLU", why=f"a zero pivot ({e})")) from None

    @staticmethod
    def _splu(matrix: Any, permc_spec: str) -> Any:
        from scipy.sparse.linalg import splu  # (`dx.sparse_solve` has checked that SciPy is there)

        with _native_threads.capped(1):
            return splu(matrix, permc_spec=permc_spec)

    def solve(self, factorisation: Any, rhs: np.ndarray, transpose: bool) -> np.ndarray:
        with _native_threads.capped(1):
            return factorisation.solve(np.ascontiguousarray(rhs), trans="T" if transpose else "N")

    def nbytes(self, factorisation: Any, dtype: np.dtype) -> int:
        """Its factors' stored entries (`nnz`: those of `L` and `U`, with their supernodes'
        padding), each in `dtype` with a 4-byte index, and its two permutations."""
        return _superlu_nbytes(factorisation, dtype)


@_runtime.cached(maxsize=256)
def trial_seconds(pattern: Any, complex_: bool = False) -> float | None:
    """One `SuperLU()` factorisation's time for `pattern` (a `dx.SparsePattern`), the least of
    two to five; None where it fails (a structurally singular pattern). Its values are
    random (with random phases if `complex_`), with a dominant diagonal where the pattern
    holds every diagonal entry: the fill of the ordering, not of the pivoting that random
    values force (on a 150 x 150 convection-diffusion grid, 0.04 s against 146 s)."""
    import time

    import scipy.sparse

    rng = np.random.default_rng(0)
    values = rng.uniform(1.0, 2.0, pattern.nnz) * rng.choice([-1.0, 1.0], pattern.nnz)
    if complex_:
        values = values * np.exp(1j * rng.uniform(0, 2 * np.pi, pattern.nnz))
    diagonal = pattern.rows == pattern.cols
    if np.unique(pattern.rows[diagonal]).size == pattern.n:
        off = np.bincount(pattern.rows, np.abs(values) * ~diagonal, pattern.n)
        values = np.where(diagonal, off[pattern.rows] + 1.0, values)
    matrix = scipy.sparse.csc_matrix((values, (pattern.rows, pattern.cols)), shape=(pattern.n, pattern.n))
    SuperLU().factor(scipy.sparse.identity(2, values.dtype.char, format="csc"))  # (imports and warms up the solver)
    times: list[float] = []
    while len(times) < 2 or (len(times) < 5 and sum(times) < 0.05):
        start = time.perf_counter()
        try:
            SuperLU().factor(matrix)
        except (RuntimeError, np.linalg.LinAlgError):  # (SciPy's error, or deferax's zero pivot)
            return None
        times.append(time.perf_counter() - start)
    return min(times)
