"""`Cholmod`: SuiteSparse's CHOLMOD Cholesky factorisation `A = L L^T` of a symmetric positive
definite matrix, through cholespy, on the host; and the checks by which a matrix is taken for
one (`symmetric`, `positive_diagonal`)."""

from __future__ import annotations

import atexit
import collections
import importlib.util
import threading
import weakref
from typing import Any

import numpy as np

from ... import _runtime
from .._sparse_solver import AbstractSparseSolver, _pattern_key
from . import _fill

_NO_CHOLESPY = """`dx.Cholmod`: cholespy is not installed, and this solver calls it. Install it: `pip install \
cholespy`, or leave `solver=` out (the default measures the solvers that are installed)."""

_NOT_SPD = """`dx.Cholmod`: the matrix is not symmetric positive definite: {why}, and a Cholesky factorisation \
needs one.
Use an LU: leave `solver=` out (the default takes CHOLMOD where the matrix is symmetric positive definite, an LU \
elsewhere), or pass `solver=dx.KLU()` or `solver=dx.SuperLU()`."""


class NotPositiveDefinite(np.linalg.LinAlgError):
    """`Cholmod.factor`'s error for a matrix that is not symmetric positive definite (an LU
    may still factor it: `AutoSparseSolver` then does)."""


def available() -> bool:
    """Whether cholespy can be imported."""
    return importlib.util.find_spec("cholespy") is not None


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
    """Whether each diagonal entry is positive: necessary for positive definiteness, and
    checked before a Cholesky factorisation is tried (CHOLMOD reports its failure on stdout)."""
    return bool((matrix.diagonal() > 0).all())


def cholesky(matrix: Any) -> Any:
    """CHOLMOD's factorisation of `matrix`, taken as symmetric (only its lower triangle is
    read); raises `NotPositiveDefinite` where a pivot is not positive."""
    cholespy: Any = importlib.import_module("cholespy")  # (its names come from a compiled module)

    if max(matrix.shape[0], matrix.nnz) > np.iinfo(np.int32).max:
        raise ValueError(f"`dx.Cholmod`: cholespy takes 32-bit indices, and this matrix has {matrix.nnz} entries.")
    try:
        solver = cholespy.CholeskySolverD(  # (its float32 solver factors in float64 too)
            matrix.shape[0],
            # (cholespy takes writable C arrays only; the pattern's are read-only)
            np.require(matrix.indptr, np.int32, ("C", "W")),
            np.require(matrix.indices, np.int32, ("C", "W")),
            np.require(matrix.data, np.float64, ("C", "W")),
            cholespy.MatrixType.CSC,
        )
    except ValueError as e:  # (cholespy's "Matrix is not positive definite!")
        if "positive definite" not in str(e):
            raise
        raise NotPositiveDefinite(_NOT_SPD.format(why=f"CHOLMOD found a pivot that is not positive ({e})")) from None
    made = _Factor(solver, np.dtype(matrix.dtype), _fill.estimated_entries(matrix, cholesky=True)[0])
    _MADE.add(made)
    return made


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
    fill-reducing ordering) through [cholespy](https://github.com/rgl-epfl/cholespy), on the
    host, for real symmetric positive definite matrices: finite-element stiffnesses,
    Laplacians, normal equations. It factors in about half the time an LU takes (the 180 x 60
    MBB beam's stiffness: see [Sparse linear solves](../linear-solve.md#which-solver)), and
    `A^T = A`, so the transposed solve is the same solve.

    `factor` checks that the matrix is symmetric (exactly, entry for entry) with a positive
    diagonal, then factors; it raises `numpy.linalg.LinAlgError` if the matrix is not symmetric
    positive definite (CHOLMOD's own check, on a pivot; CHOLMOD also prints a warning then).
    It factors in float64, also a float32 matrix (`precision="input"`: cholespy's
    single-precision solver factors in float64 too), and solves in float64, the solution
    returned in the matrix's dtype; complex matrices are refused.

    Needs cholespy (`pip install cholespy`). cholespy holds Python's GIL while it factors, so
    two systems factor one after the other on deferax's threads (a process pool or Dask
    factors them at once). Its `nbytes` is an estimate, as cholespy does not say how many
    entries `L` holds: half those of SuperLU's `L + U` on the same pattern where
    [`deferax.AutoSparseSolver`][] or [`deferax.SuperLU`][] measured them in this process, else
    the matrix's lower triangle (a lower bound); an 8-byte entry and a 4-byte index each.
    """

    def factor(self, matrix: Any) -> Any:
        if not available():
            raise ImportError(_NO_CHOLESPY)
        if not np.isrealobj(matrix.data):
            raise NotPositiveDefinite(_NOT_SPD.format(why=f"it is complex ({matrix.dtype})"))
        if not symmetric(matrix):
            raise NotPositiveDefinite(_NOT_SPD.format(why="it is not equal to its transpose"))
        if not positive_diagonal(matrix):
            raise NotPositiveDefinite(_NOT_SPD.format(why="a diagonal entry is not positive"))
        return cholesky(matrix)

    def solve(self, factorisation: Any, rhs: np.ndarray, transpose: bool) -> np.ndarray:
        f = factorisation  # (`A^T = A`: `transpose` changes nothing)
        rhs = np.require(rhs, np.float64, ("C", "W"))  # (cholespy takes writable C arrays only)
        out = np.empty_like(rhs)
        f.solver.solve(rhs, out)
        return out.astype(f.dtype, copy=False)

    def nbytes(self, factorisation: Any, dtype: np.dtype) -> int:
        """An estimate (cholespy does not report it): half the entries of SuperLU's factors on
        the same pattern where they were measured, else the matrix's lower triangle (a lower
        bound), an 8-byte entry and a 4-byte index each."""
        f = factorisation
        return f.entries * (8 + 4)
