"""`Cholmod`: SuiteSparse's CHOLMOD Cholesky factorisation `A = L L^T` of a symmetric positive
definite matrix, on the host, through sparsax (its NumPy entry points) or cholespy; and the
checks by which a matrix is taken for one (`symmetric`, `positive_diagonal`)."""

from __future__ import annotations

import atexit
import collections
import importlib.util
import threading
import time
import weakref
from typing import Any

import equinox as eqx
import numpy as np

from ... import _record, _runtime
from .._solver import AbstractSparseSolver, SuperLU, _pattern_key
from . import _fill, _sparsax

_NOT_INSTALLED = """`dx.Cholmod(library={library!r})`: {missing} installed, and this solver calls it. Install it: \
`pip install {install}`, or leave `solver=` out (the default measures the solvers that are installed)."""
_BAD_LIBRARY = """`dx.Cholmod(library=...)`: expected "auto", "sparsax" or "cholespy", found {found!r}."""

_NOT_SPD = """`dx.Cholmod`: the matrix is not symmetric positive definite: {why}, and a Cholesky factorisation \
needs one.
Use an LU: leave `solver=` out (the default takes CHOLMOD where the matrix is symmetric positive definite, an LU \
elsewhere), or pass `solver=dx.KLU()` or `solver=dx.SuperLU()`."""


class NotPositiveDefinite(np.linalg.LinAlgError):
    """`Cholmod.factor`'s error for a matrix that is not symmetric positive definite (an LU
    may still factor it: `AutoSparseSolver` then does)."""


def available(library: str = "auto") -> bool:
    """Whether `library` ("sparsax", "cholespy", or "auto": either) can be imported."""
    sparsax, cholespy = _sparsax.available(), importlib.util.find_spec("cholespy") is not None
    return {"sparsax": sparsax, "cholespy": cholespy}.get(library, sparsax or cholespy)


def _library(library: str) -> str:
    """The library `Cholmod(library=library)` factors with: for "auto", sparsax where it is
    installed, else cholespy; raises `ImportError` where the library is not installed."""
    if library == "auto":
        library = "sparsax" if _sparsax.available() else "cholespy"
    if not available(library):
        missing = "no tested sparsax release (0.9 to 0.11) is" if library == "sparsax" else "cholespy is not"
        install = "'sparsax>=0.9,<0.12'" if library == "sparsax" else library
        raise ImportError(_NOT_INSTALLED.format(library=library, missing=missing, install=install))
    return library


def symmetric(matrix: Any) -> bool:
    """Whether the canonical CSC `matrix` (sorted, no duplicates) equals its transpose, entry
    for entry, exactly (an explicit zero counts as no entry)."""
    if not np.isrealobj(matrix.data):
        return False
    mirror = _mirror(matrix)
    if mirror is not None:  # (the same positions: entry against entry)
        return bool(np.array_equal(matrix.data, matrix.data[mirror]))
    return (matrix != matrix.T.tocsc()).nnz == 0  # (the patterns differ: by explicit zeros, or not)


def _mirror(matrix: Any) -> np.ndarray | None:
    """For a structurally symmetric CSC `matrix`, the index of each stored entry's mirror
    `(j, i)` among its stored entries; None for another pattern. Kept per pattern (the latest
    `_MIRRORS_KEPT`)."""
    key = _pattern_key(matrix)
    with _MIRRORS_LOCK:
        if key in _MIRRORS:
            _MIRRORS.move_to_end(key)
            return _MIRRORS[key]
    n = matrix.shape[0]
    cols = np.repeat(np.arange(n, dtype=np.int64), np.diff(matrix.indptr))
    position = cols * n + matrix.indices  # (column-major: sorted, as the matrix is canonical)
    mirrored = np.asarray(matrix.indices, np.int64) * n + cols
    found = np.searchsorted(position, mirrored)
    ok = found < position.size
    ok[ok] = position[found[ok]] == mirrored[ok]
    mirror = found if ok.all() else None
    with _MIRRORS_LOCK:
        _MIRRORS[key] = mirror
        while len(_MIRRORS) > _MIRRORS_KEPT:
            _MIRRORS.popitem(last=False)
    return mirror


# by pattern (`_pattern_key`): `_mirror`'s answer, the latest `_MIRRORS_KEPT` patterns
_MIRRORS: collections.OrderedDict[tuple, np.ndarray | None] = _runtime.store(collections.OrderedDict())
_MIRRORS_LOCK = threading.Lock()
_MIRRORS_KEPT = 64


def positive_diagonal(matrix: Any) -> bool:
    """Whether each diagonal entry of the canonical CSC `matrix` is positive: necessary for
    positive definiteness, and checked before a Cholesky factorisation is tried (CHOLMOD
    reports its failure on stdout). Its stored diagonal entries are found once a pattern
    (`_upper`): 0.15-0.19 ms in a job on the 180 x 60 beam, against 0.35 ms for
    `matrix.diagonal()` alone."""
    diagonal = _upper(matrix)[3]
    return diagonal.size == matrix.shape[0] and bool((matrix.data[diagonal] > 0).all())


def singular(matrix: Any) -> bool:
    """Whether `matrix` (canonical CSC, one that a Cholesky factorisation refused) is singular to
    working precision: SuperLU's LU (partial pivoting: every multiplier at most 1) meets a zero
    pivot, or one at most `n * eps * max|a_ij|`, as `numpy.linalg.matrix_rank` counts a singular
    value (with the largest entry for the largest singular value). For `A = P L U Q` with
    `|l_ij| <= 1`, the least singular value of `A` is at most `n` times the least pivot, so a
    matrix found singular is within `n^2 eps max|a_ij|` of a singular one; an indefinite
    nonsingular matrix's pivots are far from it. One LU, on the error path alone: a singular
    positive semidefinite matrix (a stiffness with a free body) fails a Cholesky as an
    indefinite one does, by a pivot of zero or of rounding's size, and only an LU tells them apart."""
    try:
        lu = SuperLU(permc_spec="MMD_AT_PLUS_A").factor(matrix)
    except np.linalg.LinAlgError:  # (a zero pivot)
        return True
    least = float(np.abs(lu.U.diagonal()).min(initial=np.inf))
    return bool(least <= matrix.shape[0] * np.finfo(matrix.dtype).eps * np.abs(matrix.data).max(initial=0.0))


def cholesky(matrix: Any, library: str = "auto") -> Any:
    """CHOLMOD's factorisation of `matrix`, taken as symmetric (only one triangle is read),
    through `library` (as `Cholmod`'s); raises `NotPositiveDefinite` where a pivot is not
    positive."""
    library = _library(library)
    if max(matrix.shape[0], matrix.nnz) > np.iinfo(np.int32).max:
        raise ValueError(
            f"`dx.Cholmod`: CHOLMOD is called with 32-bit indices, and this matrix has {matrix.nnz} entries."
        )
    # (the upper triangle's entries, diagonal included, as many as the lower's: `factor` checked the symmetry)
    entries = _fill.estimated_entries(matrix, triangle=_upper(matrix)[0].size)[0]
    # (cholespy raises ValueError "Matrix is not positive definite!", sparsax RuntimeError "... not positive definite")
    try:
        if library == "sparsax":
            made: Any = _SparsaxFactor(matrix, entries)
        else:
            made = _cholespy_factor(matrix, entries)
    except (ValueError, RuntimeError) as e:
        if "positive definite" not in str(e):
            raise
        raise NotPositiveDefinite(_NOT_SPD.format(why=f"CHOLMOD found a pivot that is not positive ({e})")) from None
    return made


def _cholespy_factor(matrix: Any, entries: int) -> _Factor:
    cholespy: Any = importlib.import_module("cholespy")  # (its names come from a compiled module)
    solver = cholespy.CholeskySolverD(  # (its float32 solver factors in float64 too)
        matrix.shape[0],
        # (cholespy takes writable C arrays only; the pattern's are read-only)
        np.require(matrix.indptr, np.int32, ("C", "W")),
        np.require(matrix.indices, np.int32, ("C", "W")),
        np.require(matrix.data, np.float64, ("C", "W")),
        cholespy.MatrixType.CSC,
    )
    made = _Factor(solver, np.dtype(matrix.dtype), entries)
    _MADE.add(made)
    return made


class _SparsaxFactor:
    """A Cholesky factorisation kept by sparsax, which keeps the factors of the values it
    factored last on each pattern (sparsax 0.9: one set of values a pattern; 0.11: eight):
    the upper triangle's coordinates and values, in float64, that find it; the matrix's dtype;
    the entries `L` is estimated to hold; and how many of its solves found the factors dropped
    and factored again (`refactored`; each is also a "factor" step of the timeline, `dx.record`).

    sparsax's calls were seen to hold Python's GIL, so they are made one at a time
    (`_SPARSAX_LOCK`): around each, sparsax's count of its factorisations says whether it
    factored."""

    def __init__(self, matrix: Any, entries: int):
        self.rows, self.cols, upper, _ = _upper(matrix)
        self.dtype, self.entries = np.dtype(matrix.dtype), entries
        self.values = np.ascontiguousarray(matrix.data[upper], np.float64)
        self.values.flags.writeable = False
        self.refactored = 0
        cpp = _sparsax.module()._cpp
        with _SPARSAX_LOCK:
            cpp.logdet_np(self.rows, self.cols, self.values, matrix.shape[0])  # (factors, and keeps the factors)

    def solve(self, rhs: np.ndarray) -> np.ndarray:
        cpp = _sparsax.module()._cpp
        rhs = np.ascontiguousarray(rhs, np.float64)
        with _SPARSAX_LOCK:
            before = cpp.factorization_count()
            start = time.perf_counter()
            out = cpp.solve_np(self.rows, self.cols, self.values, rhs, 0)
            again = cpp.factorization_count() - before
        if again:  # (the factors were dropped: this solve factored again, as the timeline shows)
            self.refactored += again
            _record.step("factor", start, time.perf_counter())
        return out


def _upper(matrix: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`(rows, cols, mask, diagonal)`: the int32 coordinates of the canonical CSC `matrix`'s
    entries on or above the diagonal, the mask that picks them from its stored entries, and
    the positions of its stored diagonal entries (all read-only); kept per pattern (the latest
    `_MIRRORS_KEPT`)."""
    key = _pattern_key(matrix)
    with _MIRRORS_LOCK:
        if key in _UPPER:
            _UPPER.move_to_end(key)
            return _UPPER[key]
    cols = np.repeat(np.arange(matrix.shape[0], dtype=np.int32), np.diff(matrix.indptr))
    mask = matrix.indices <= cols
    diagonal = np.flatnonzero(matrix.indices == cols)
    found = (np.ascontiguousarray(matrix.indices[mask], np.int32), np.ascontiguousarray(cols[mask]), mask, diagonal)
    for a in found:
        a.flags.writeable = False
    with _MIRRORS_LOCK:
        _UPPER[key] = found
        while len(_UPPER) > _MIRRORS_KEPT:
            _UPPER.popitem(last=False)
    return found


# by pattern (`_pattern_key`): `_upper`'s answer, the latest `_MIRRORS_KEPT` patterns
_UPPER: collections.OrderedDict[tuple, tuple] = _runtime.store(collections.OrderedDict())
_SPARSAX_LOCK = threading.Lock()


class _Factor:
    """A Cholesky factorisation (cholespy's solver object, which frees it when collected), in
    float64; the matrix's dtype, and the entries its factor `L` is estimated to hold."""

    def __init__(self, solver: Any, dtype: np.dtype, entries: int):
        self.solver, self.dtype, self.entries = solver, dtype, entries


# the factorisations alive, freed at the interpreter's exit before nanobind (cholespy's binding)
# counts the objects still alive and prints a warning for each ("nanobind: leaked 1 instances!")
_MADE: weakref.WeakSet[_Factor] = _runtime.store(weakref.WeakSet())


@atexit.register
def _free_at_exit() -> None:
    for made in list(_MADE):
        made.solver = None


class Cholmod(AbstractSparseSolver):
    """SuiteSparse's CHOLMOD (a supernodal Cholesky factorisation `A = L L^T`, with its
    fill-reducing ordering) on the host, for real symmetric positive definite matrices:
    finite-element stiffnesses, Laplacians, normal equations. It factors in about a quarter
    to half the time an LU takes (the 180 x 60 MBB beam's stiffness: see
    [Sparse linear solves](../linear-solve.md#which-solver)), and `A^T = A`, so the
    transposed solve is the same solve.

    **Arguments:**

    - `library`: which wheel's CHOLMOD: `"sparsax"` ([sparsax](https://pypi.org/project/sparsax/)'s
      NumPy entry points, 0.9 to 0.11, with the fast BLAS its wheel ships: the 180 x 60 beam
      factored and solved in 46 ms against cholespy's 105), `"cholespy"`
      ([cholespy](https://github.com/rgl-epfl/cholespy)), or `"auto"` (the default):
      sparsax where it is installed, else cholespy.

    `factor` checks that the matrix is symmetric (exactly, entry for entry) with a positive
    diagonal, then factors; it raises `numpy.linalg.LinAlgError` if the matrix is not symmetric
    positive definite (CHOLMOD's own check, on a pivot). It factors in float64, also a float32
    matrix (`precision="input"`), and solves in float64, the solution returned in the
    matrix's dtype; complex matrices are refused (a real one with a complex `b` is factored
    real: [`deferax.sparse_solve`][] solves `b`'s real and imaginary parts as two right-hand
    sides). With `dx.sparse_solve(..., singular="nan")`, a matrix it refuses gives NaN only
    where an LU finds it singular, and raises its error otherwise.

    sparsax keeps the factors itself, found again by the matrix's values: those it factored
    last on each pattern (one set of values a pattern in sparsax 0.9, the Python 3.11 release;
    eight in 0.11). A factorisation whose factors were dropped since (another matrix of the
    same pattern factored in between, as under `vmap` over the matrices) is factored again by
    the solve that needs it, with the right answer: [`deferax.AutoSparseSolver`][] times
    such solves, so measures the cost, and prefers cholespy or SuperLU where it is higher.

    Both hold Python's GIL while they factor, so two systems factor one after the other on
    deferax's threads (a process pool or Dask factors them at once). Its `nbytes` is an
    estimate, as neither says how many entries `L` holds: half those of SuperLU's `L + U` on
    the same pattern where [`deferax.AutoSparseSolver`][] or [`deferax.SuperLU`][] measured
    them in this process, else the matrix's lower triangle (a lower bound); an 8-byte entry
    and a 4-byte index each.
    """

    library: str = eqx.field(default="auto", static=True)

    def __check_init__(self):
        if self.library not in ("auto", "sparsax", "cholespy"):
            raise ValueError(_BAD_LIBRARY.format(found=self.library))

    def factor(self, matrix: Any) -> Any:
        library = _library(self.library)  # (not installed: raised before the checks)
        if not np.isrealobj(matrix.data):
            raise NotPositiveDefinite(_NOT_SPD.format(why=f"it is complex ({matrix.dtype})"))
        if not symmetric(matrix):
            raise NotPositiveDefinite(_NOT_SPD.format(why="it is not equal to its transpose"))
        if not positive_diagonal(matrix):
            raise NotPositiveDefinite(_NOT_SPD.format(why="a diagonal entry is not positive"))
        return cholesky(matrix, library)

    def solve(self, factorisation: Any, rhs: np.ndarray, transpose: bool) -> np.ndarray:
        f = factorisation  # (`A^T = A`: `transpose` changes nothing)
        if isinstance(f, _SparsaxFactor):
            return f.solve(rhs).astype(f.dtype, copy=False)
        rhs = np.require(rhs, np.float64, ("C", "W"))  # (cholespy takes writable C arrays only)
        out = np.empty_like(rhs)
        f.solver.solve(rhs, out)
        return out.astype(f.dtype, copy=False)

    def symmetric(self, factorisation: Any) -> bool:
        return True  # (`factor` checked it: `A^T = A`)

    def nbytes(self, factorisation: Any, dtype: np.dtype) -> int:
        """An estimate (neither library reports it): half the entries of SuperLU's factors on
        the same pattern where they were measured, else the matrix's lower triangle (a lower
        bound), an 8-byte entry and a 4-byte index each."""
        f = factorisation
        return f.entries * (8 + 4)
