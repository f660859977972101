"""`Pardiso`: Intel oneMKL's PARDISO on the host (a parallel supernodal factorisation after a
nested-dissection ordering): its Cholesky for real symmetric positive definite matrices, its LU
for any other, real or complex. It is called through `ctypes` in the MKL runtime that
pypardiso's wheels install (pypardiso finds it; its own wrapper takes real matrices only).

PARDISO's analysis (the ordering and the symbolic factorisation: 45-70 ms on the 22,000-unknown
matrices of `benchmarks/bench_peers.py`) depends on the pattern alone, and one handle holds up
to `_SLOTS` numeric factorisations of matrices of its pattern (PARDISO's `maxfct` and `mnum`).
So each pattern is analysed once (`_Analysis`, kept for the latest `_KEPT` patterns), and a
factorisation is the numeric phase alone: 13-26 ms on those matrices, against 48 ms for
CHOLMOD and 50-120 ms for KLU and SuperLU, on 2 cores.

PARDISO does not pivot across its supernodes: where a pivot is too small it perturbs it (and
the answer is then not a solution of the matrix given). No perturbed factorisation is used
(`Perturbed`, a `numpy.linalg.LinAlgError`): the matrix is analysed again on its own values,
and where a pivot is still perturbed (a singular matrix, or one that needs rows swapped across
supernodes), `Pardiso` factors it with SuperLU and `AutoSparseSolver` with another candidate.
An LU's solutions are checked too (`_Factor`).
"""

from __future__ import annotations

import collections
import ctypes
import glob
import importlib.util
import os
import site
import sys
import threading
import weakref
from typing import Any

import numpy as np

from ... import _runtime
from ..._concurrency import _native_threads
from .._solver import AbstractSparseSolver, SuperLU, _pattern_key
from . import _cholmod

_NOT_INSTALLED = """`dx.Pardiso`: {why}, and this solver calls PARDISO in it. Install it: `pip install pypardiso` \
(Linux and Windows on x86-64), or leave `solver=` out (the default measures the solvers that are installed)."""

# PARDISO's matrix types: real symmetric positive definite, real and complex unsymmetric
_SPD, _REAL, _COMPLEX = 2, 11, 13
# Each handle's numeric factorisations at most (`maxfct`); a pattern with more alive at once
# gets another handle (and analysis).
_SLOTS = 16
# The patterns whose analyses are kept (the latest); one dropped is freed with its last factorisation.
_KEPT = 8

# PARDISO's error codes, and what each says
_CODES = (
    (-1, "the input is inconsistent"),
    (-2, "not enough memory"),
    (-3, "a reordering problem"),
    (-4, "a zero pivot"),
    (-5, "an internal error"),
    (-6, "the preordering failed"),
    (-7, "the diagonal matrix is singular"),
    (-8, "a 32-bit integer overflowed"),
)


_PERTURBED = """`dx.Pardiso`: PARDISO perturbed {count} pivots of this matrix, so its factors would solve another: \
the matrix is singular, or needs pivoting across the factors' blocks, which PARDISO does not do.
An LU that pivots by rows factors it or finds it singular: `solver=dx.SuperLU()` or `dx.KLU()`, or leave `solver=` \
out (the default then takes one)."""


class Perturbed(np.linalg.LinAlgError):
    """PARDISO perturbed a pivot of the matrix (singular, or needing pivoting PARDISO does not
    do): the factorisation is refused."""


def available() -> bool:
    """Whether MKL's PARDISO can be called: pypardiso is installed and finds MKL's runtime."""
    try:
        _pardiso()
    except ImportError:
        return False
    return True


@_runtime.cached(maxsize=1)
def _pardiso() -> Any:
    """MKL's `pardiso` function, found where pypardiso finds MKL's runtime; raises `ImportError`
    where it cannot be."""
    if sys.platform == "darwin" or importlib.util.find_spec("pypardiso") is None:
        raise ImportError(_NOT_INSTALLED.format(why="pypardiso is not installed"))
    try:
        library = _mkl_runtime()
        function, threads = library.pardiso, library.MKL_Set_Num_Threads_Local
    except (ImportError, OSError, AttributeError) as e:
        raise ImportError(_NOT_INSTALLED.format(why=f"MKL's runtime could not be loaded ({e})")) from None
    int32 = ctypes.POINTER(ctypes.c_int32)
    # (pt, maxfct, mnum, mtype, phase, n, a, ia, ja, perm, nrhs, iparm, msglvl, b, x, error)
    function.argtypes = [ctypes.POINTER(ctypes.c_int64), *[int32] * 5, ctypes.c_void_p, *[int32] * 6]
    function.argtypes += [ctypes.c_void_p, ctypes.c_void_p, int32]
    function.restype = None
    threads.argtypes, threads.restype = [ctypes.c_int], ctypes.c_int
    function.threads = threads  # pyright: ignore[reportAttributeAccessIssue]  (`_Handle.call`'s)
    return function


def _mkl_runtime() -> Any:
    """MKL's runtime library, loaded: from where pypardiso's `PYPARDISO_MKL_RT` says, else the
    first that loads of those MKL's wheel puts in the environment's library folder (shortest
    name first, as pypardiso tries them), else from where pypardiso's own search finds it.
    That search (`PyPardisoSolver()`) globs the environment's whole tree: 0.66 to 1.4 s each
    time on this machine, which every test after `_runtime.reset` paid."""
    given = os.environ.get("PYPARDISO_MKL_RT")
    if given:
        return ctypes.CDLL(given)
    for prefix in dict.fromkeys(p for p in (sys.prefix, site.USER_BASE) if p):
        found = glob.glob(os.path.join(prefix, "lib", "*mkl_rt*")) + glob.glob(
            os.path.join(prefix, "Library", "bin", "*mkl_rt*")
        )
        for path in sorted(found, key=len):
            try:
                return ctypes.CDLL(path)
            except OSError:  # (a static library, a file of another platform: the next)
                pass
    import pypardiso

    return pypardiso.PyPardisoSolver().libmkl


class _Handle:
    """One PARDISO handle (`pt`) and its settings (`iparm`), for one pattern and matrix type.

    Each of its calls runs on `threads` MKL threads, set for the calling thread alone
    (`mkl_set_num_threads_local`): PARDISO plans its factorisation for the threads of its
    analysis, and a factorisation on fewer crashed the process (a segmentation fault: analysed
    on 2 threads, factored on 1). deferax's limit on native threads while host jobs run at once
    (`_concurrency._native_threads`), threadpoolctl's and the program's own would otherwise
    change it between the phases."""

    def __init__(self, mtype: int, n: int, indptr: np.ndarray, indices: np.ndarray):
        self.mtype, self.n, self.indptr, self.indices = mtype, n, indptr, indices
        self.threads = _native_threads.cores()
        self.pardiso = _pardiso()  # (kept: freed after `_runtime.reset`, it needs no search)
        self.pt = np.zeros(64, np.int64)
        self.iparm = np.zeros(64, np.int32)
        settings = {0: 1, 1: 2, 9: 8 if mtype == _SPD else 13, 17: -1, 34: 1}
        if mtype != _SPD:  # (scaling and weighted matching, PARDISO's advice for unsymmetric matrices)
            settings |= {10: 1, 12: 1}
        for i, value in settings.items():  # (zero-based indices; 34: zero-based `ia` and `ja`)
            self.iparm[i] = value

    def call(self, phase: int, mnum: int, data: np.ndarray | None, rhs: np.ndarray | None = None) -> np.ndarray | None:
        """One call of `pardiso` (the caller holds the handle's lock); `x` where `rhs` is given."""
        i32 = ctypes.c_int32
        x = None if rhs is None else np.zeros_like(rhs)
        error = i32(0)
        nrhs = 1 if rhs is None or rhs.ndim == 1 else rhs.shape[1]
        pointer = ctypes.POINTER(i32)
        pardiso = self.pardiso
        before = pardiso.threads(self.threads)
        try:
            pardiso(
                self.pt.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)),
                ctypes.byref(i32(_SLOTS)),
                ctypes.byref(i32(mnum)),
                ctypes.byref(i32(self.mtype)),
                ctypes.byref(i32(phase)),
                ctypes.byref(i32(self.n)),
                None if data is None else data.ctypes.data,
                self.indptr.ctypes.data_as(pointer),
                self.indices.ctypes.data_as(pointer),
                None,
                ctypes.byref(i32(nrhs)),
                self.iparm.ctypes.data_as(pointer),
                ctypes.byref(i32(0)),
                None if rhs is None else rhs.ctypes.data,
                None if x is None else x.ctypes.data,
                ctypes.byref(error),
            )
        finally:
            pardiso.threads(before)
        if error.value:
            why = dict(_CODES).get(error.value, "an error")
            if error.value == -4 and self.mtype == _SPD:
                raise _cholmod.NotPositiveDefinite(
                    _cholmod._NOT_SPD.format(why=f"PARDISO's Cholesky found a pivot that is not positive ({why})")
                )
            if error.value in (-4, -7):
                raise np.linalg.LinAlgError(f"`dx.Pardiso`: the matrix is singular: PARDISO reported {why}.")
            kind = MemoryError if error.value == -2 else RuntimeError
            raise kind(f"`dx.Pardiso`: PARDISO's phase {phase} failed with error {error.value}: {why}.")
        return x


def _free_all(handle: _Handle) -> None:
    """Free everything the handle holds (its analysis and factorisations)."""
    handle.call(-1, 1, None)


class _Analysis:
    """A pattern's analysis in one PARDISO handle, and which of its `_SLOTS` numeric
    factorisations are free; the handle is freed when this is collected (its factorisations
    hold it). Its calls are made one at a time (`lock`): PARDISO's on one handle may not overlap."""

    def __init__(self, mtype: int, matrix: Any, pick: np.ndarray | None, data: np.ndarray):
        rows = np.asarray(matrix.indices)
        indptr = np.asarray(matrix.indptr)
        if pick is not None:  # (the lower triangle's entries, by column: the upper triangle's by row)
            cols = np.repeat(np.arange(matrix.shape[0]), np.diff(indptr))
            indptr = np.r_[0, np.cumsum(np.bincount(cols[pick], minlength=matrix.shape[0]))]
            rows = rows[pick]
        # (the CSC arrays read as CSR are the transpose's: `solve` swaps its transposes)
        self.handle = _Handle(
            mtype, matrix.shape[0], np.ascontiguousarray(indptr, np.int32), np.ascontiguousarray(rows, np.int32)
        )
        self.pick, self.lock = pick, threading.Lock()
        self.free = list(range(_SLOTS, 0, -1))
        self.ended: collections.deque[int] = collections.deque()  # (slots whose factorisations were collected)
        self.stale = False  # (an LU of it was found inaccurate: no more matrices are factored on it)
        with self.lock:
            self.handle.call(11, 1, data)
        self.entries = int(self.handle.iparm[17])  # (the factors' entries, as the analysis counts them)
        weakref.finalize(self, _free_all, self.handle)

    def take(self) -> int | None:
        with self.lock:
            self._free_ended()
            return self.free.pop() if self.free else None

    def release(self, slot: int) -> None:
        """Free the numeric factorisation in `slot` (phase 0), for another: now where the lock
        is free, else at the next `take`. (A finalizer, which the collector may run on a thread
        that holds the lock: it never waits for it.)"""
        self.ended.append(slot)
        if self.lock.acquire(blocking=False):
            try:
                self._free_ended()
            finally:
                self.lock.release()

    def _free_ended(self) -> None:
        while self.ended:
            slot = self.ended.popleft()
            self.handle.call(0, slot, None)
            self.free.append(slot)


class _Factor:
    """A numeric factorisation in `slot` of `analysis`'s handle, with the entries it factored
    (which PARDISO's solve reads); freed when collected.

    An LU's solutions are checked: PARDISO's ordering, scaling and matching come from the
    pattern's analysis, made on an earlier matrix, and pivots that were large there may be
    small here, so that the factors, though no pivot was perturbed, solve another matrix (seen:
    NaN, and residuals of 1e140, on a well-conditioned matrix). Where a solution's backward
    error (`_backward_error`) is past `_ACCURATE`, the solve is made again by SuperLU's LU, which
    pivots by rows, and the pattern is analysed again for its next matrix. A Cholesky's
    factorisation of a positive definite matrix needs no pivoting, and is not checked."""

    def __init__(self, analysis: _Analysis, slot: int, data: np.ndarray, dtype: np.dtype):
        self.analysis, self.slot, self.data, self.dtype = analysis, slot, data, dtype
        self.spd = analysis.handle.mtype == _SPD
        self.norm = 0.0 if self.spd else float(np.linalg.norm(data))  # (Frobenius: `_backward_error`'s)
        self.fallback: _Fallback | None = None
        with analysis.lock:
            try:
                analysis.handle.call(22, slot, data)
                perturbed = int(analysis.handle.iparm[13])
            except BaseException:
                analysis.free.append(slot)
                raise
        weakref.finalize(self, analysis.release, slot)
        if perturbed:
            raise Perturbed(_PERTURBED.format(count=perturbed))

    def solve(self, rhs: np.ndarray, transpose: bool) -> np.ndarray:
        if self.fallback is not None:  # (PARDISO's factors were found wrong once: not tried again)
            return self.fallback.solve(rhs, transpose)
        handle = self.analysis.handle
        # (`k` right-hand sides: `rhs` is `(n, k)`, each column contiguous for PARDISO)
        b = np.asfortranarray(rhs, self.data.dtype)
        with self.analysis.lock:
            # (the handle holds `A^T`, as the CSC arrays read as CSR: its plain transpose is `A`)
            handle.iparm[11] = 0 if transpose or self.spd else 2
            x = handle.call(33, self.slot, self.data, b)
        assert x is not None
        if not self.spd and not _backward_error(self._matrix(), b, x, self.norm, transpose) <= _ACCURATE:
            self.analysis.stale = True  # (the pattern's next matrix is analysed afresh)
            if self.fallback is None:
                self.fallback = _Fallback(self._matrix(), self.dtype)
            return self.fallback.solve(b, transpose)
        return x.astype(self.dtype, copy=False)

    def _matrix(self) -> Any:
        """The matrix factored (an LU's), as a CSC matrix on its entries."""
        import scipy.sparse

        handle = self.analysis.handle
        return scipy.sparse.csc_matrix((self.data, handle.indices, handle.indptr), shape=(handle.n, handle.n))

    @property
    def nbytes(self) -> int:
        return self.analysis.entries * (self.data.dtype.itemsize + 4) + self.data.nbytes


# The largest backward error of an LU's solution taken from PARDISO (`_Factor`). PARDISO's
# solutions on the benchmarks' three matrices (each a new matrix of an analysed pattern) had
# 1e-18 to 4e-18 (normwise, `_backward_error`'s); those on a pattern analysed for another
# matrix that did not suit this one, NaN, or about 1.
_ACCURATE = 1e-12


def _backward_error(matrix: Any, b: np.ndarray, x: np.ndarray, norm: float, transpose: bool) -> float:
    """The normwise backward error of the solutions `x` (a column each) of `matrix x = b` (of
    its transpose, with `transpose`): `|b - A x| / (|A| |x| + |b|)` in 2-norms, `|A|` taken as
    its Frobenius norm `norm` (at least its 2-norm); NaN for a solution that is not finite.

    For several columns, that of one combination of them, each column weighted by a random
    number over its own scale `|A| |x_j| + |b_j|`: one product with the matrix, not one a
    column (0.2-0.4 ms each at n = 22,500). Its error is at most `sqrt(k)` times the largest
    column's, and falls far below it only where the columns' residuals cancel, which random
    weights do not make them do."""
    operator = matrix.T if transpose else matrix
    b2, x2 = (b[:, None], x[:, None]) if b.ndim == 1 else (b, x)
    with np.errstate(all="ignore"):  # (a solution that is not one may overflow: an error of NaN)
        scales = norm * _norms(x2) + _norms(b2)
        if not np.all(np.isfinite(scales)):
            return float("nan")
        chosen = _WEIGHTS[: x2.shape[1]] if x2.shape[1] <= _WEIGHTS.size else np.ones(x2.shape[1])
        weights = chosen / np.where(scales > 0, scales, 1.0)
        residual = np.einsum("ij,j->i", b2, weights) - operator @ np.einsum("ij,j->i", x2, weights)
        # (over the weights chosen, not `weights * scales`: a scale past 1e154 would square to inf)
        error = float(np.sqrt(np.sum((residual * residual.conj()).real))) / float(np.sqrt(np.sum(chosen**2)))
    return error if np.isfinite(error) else float("nan")


def _norms(a: np.ndarray) -> np.ndarray:
    """The 2-norms of the columns of `a`, summed by NumPy (not BLAS: see `_runner._multiples`)."""
    real, imag = np.real(a), np.imag(a)
    squares = np.einsum("ij,ij->j", real, real)  # (any layout: 0.03 ms for two columns at n = 22,500)
    return np.sqrt(squares + np.einsum("ij,ij->j", imag, imag) if np.iscomplexobj(a) else squares)


# the weights of `_backward_error`'s combination: fixed, so that a check is repeatable
_WEIGHTS = np.random.default_rng(0).standard_normal(64)
_WEIGHTS.flags.writeable = False


# by (pattern, matrix type): the analyses of the latest `_KEPT` patterns
_ANALYSES: collections.OrderedDict[tuple, list[_Analysis]] = _runtime.store(collections.OrderedDict())
_LOCK = threading.Lock()


def factor(matrix: Any, spd: bool) -> _Factor:
    """PARDISO's factorisation of the canonical CSC `matrix`: its Cholesky (`spd`: the caller
    checked that the matrix is real and symmetric, so one triangle is read) or its LU. Raises
    `NotPositiveDefinite` where the Cholesky finds a pivot that is not positive, and
    `Perturbed` where the LU perturbed one."""
    _pardiso()
    complex_ = not np.isrealobj(matrix.data)
    mtype = _SPD if spd else _COMPLEX if complex_ else _REAL
    work = np.dtype(np.complex128 if complex_ else np.float64)
    if max(matrix.shape[0], matrix.nnz) > np.iinfo(np.int32).max:
        raise ValueError(
            f"`dx.Pardiso`: PARDISO is called with 32-bit indices, and this matrix has {matrix.nnz} entries."
        )
    key = (_pattern_key(matrix), mtype)
    with _LOCK:
        analyses = _ANALYSES.setdefault(key, [])
        _ANALYSES.move_to_end(key)
        while len(_ANALYSES) > _KEPT:
            _ANALYSES.popitem(last=False)
    pick = analyses[0].pick if analyses else None
    if spd and pick is None:
        pick = _lower(matrix)
    data = np.ascontiguousarray(matrix.data if pick is None else matrix.data[pick], work)
    for analysis in list(analyses):
        slot = None if analysis.stale else analysis.take()
        if slot is None:
            continue
        try:
            return _Factor(analysis, slot, data, np.dtype(matrix.dtype))
        except Perturbed:  # (its pivots, chosen on an earlier matrix, do not suit this one: analysed afresh)
            analysis.stale = True
            break
    analysis = _Analysis(mtype, matrix, pick, data)
    slot = analysis.take()
    assert slot is not None
    with _LOCK:
        analyses[:] = [a for a in analyses if not a.stale] + [analysis]
    return _Factor(analysis, slot, data, np.dtype(matrix.dtype))


def _lower(matrix: Any) -> np.ndarray:
    """The mask of the canonical CSC `matrix`'s stored entries on or below the diagonal (from
    `_cholmod._upper`'s, kept per pattern)."""
    _, _, upper, diagonal = _cholmod._upper(matrix)
    lower = ~upper
    lower[diagonal] = True
    return lower


class Pardiso(AbstractSparseSolver):
    """Intel oneMKL's PARDISO on the host, through the MKL runtime of
    [pypardiso](https://pypi.org/project/pypardiso/)'s wheels (`pip install pypardiso`;
    x86-64 Linux and Windows): a parallel supernodal factorisation after a nested-dissection
    ordering (METIS), on every core. Real symmetric positive definite matrices get its
    Cholesky (where the matrix equals its transpose, entry for entry, with a positive
    diagonal, and no pivot turns out not positive), any other real or complex matrix its LU;
    the transposed solve is the plain transpose, for complex matrices too.

    Its analysis of a pattern is made on the pattern's first matrix and kept; each later
    matrix of it is the numeric factorisation alone. On the 22,000-unknown matrices of the
    benchmarks that took 13 ms (the beam's stiffness, Cholesky) to 25 ms (a convection-diffusion
    operator and a complex Helmholtz one, LU) on 2 cores, against 48 ms for CHOLMOD and 50 to 120 ms
    for KLU and SuperLU ([Sparse linear solves](../linear-solve.md#which-solver)).

    PARDISO pivots only inside its supernodes and perturbs a pivot that is too small, which
    would answer a nearby matrix rather than the one given (a singular matrix, or one that
    needs rows swapped across supernodes: the tridiagonal `[1, 1, 1]`): such a matrix is
    analysed again on its own values, and where a pivot is still perturbed, factored by
    SuperLU's LU, which pivots by rows (and raises `numpy.linalg.LinAlgError` for a singular
    matrix, so that [`deferax.sparse_solve`][]'s `singular` applies). An LU's solutions are
    checked as well (`|b - A x| <= 1e-12 (|A|_F |x| + |b|)`, all of a solve's right-hand sides
    through one random combination: 0.4 ms a solve on the benchmarks' real operator, 1.2 ms
    on the complex one with two right-hand sides): PARDISO's pivots, chosen on an earlier
    matrix of the pattern, may not suit a later one; a solution that fails is solved by
    SuperLU instead, and the pattern analysed again for its next matrix.
    It factors in float64 (complex128), also a single-precision matrix (`precision="input"`),
    and returns the solutions in the matrix's dtype. Its `nbytes` is the entries of the
    factors that PARDISO's analysis reports, an entry and a 4-byte index each, and the
    matrix's entries, which its solves read.
    """

    def factor(self, matrix: Any) -> Any:
        _pardiso()  # (not installed: raised before the checks)
        if np.isrealobj(matrix.data) and _cholmod.symmetric(matrix) and _cholmod.positive_diagonal(matrix):
            try:
                return factor(matrix, spd=True)
            except _cholmod.NotPositiveDefinite:
                pass
        try:
            return factor(matrix, spd=False)
        except Perturbed:  # (SuperLU's LU pivots by rows: it factors the matrix, or finds it singular)
            return _Fallback(matrix, np.dtype(matrix.dtype))

    def solve(self, factorisation: Any, rhs: np.ndarray, transpose: bool) -> np.ndarray:
        return factorisation.solve(rhs, transpose)  # (a `_Factor`, or a `_Fallback`: SuperLU's)

    def symmetric(self, factorisation: Any) -> bool:
        return factorisation.spd  # (a Cholesky's matrix was checked to equal its transpose)

    def nbytes(self, factorisation: Any, dtype: np.dtype) -> int:
        return factorisation.nbytes


class _Fallback:
    """SuperLU's LU of a matrix PARDISO answered wrongly (a pivot perturbed, or a solution
    whose backward error was past `_ACCURATE`), in float64 or complex128; the matrix's dtype."""

    spd = False

    def __init__(self, matrix: Any, dtype: np.dtype):
        self.work = np.promote_types(matrix.dtype, np.float64)
        self.lu, self.dtype = SuperLU(permc_spec="MMD_AT_PLUS_A").factor(matrix.astype(self.work)), dtype

    def solve(self, rhs: np.ndarray, transpose: bool) -> np.ndarray:
        return SuperLU().solve(self.lu, np.asarray(rhs, self.work), transpose).astype(self.dtype, copy=False)

    @property
    def nbytes(self) -> int:
        return SuperLU().nbytes(self.lu, self.work)
