"""`AutoSparseSolver`: the default solver of `sparse_solve`, which answers each sparsity
pattern's first factorisations with the installed solvers in turn, timing each with its solves,
and then keeps the fastest."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import numpy as np

from ... import _runtime
from .._solver import AbstractSparseSolver, SuperLU, _pattern_key, _structure
from . import _cholmod, _fill, _klu, _pardiso
from ._cholmod import Cholmod
from ._klu import KLU
from ._pardiso import Pardiso

# The candidates, by the name `chosen` reports, and whether each can run here.
_CANDIDATES = (
    ("PARDISO Cholesky", Pardiso(), lambda: _pardiso.available()),
    ("PARDISO LU", Pardiso(), lambda: _pardiso.available()),
    ("CHOLMOD sparsax", Cholmod(library="sparsax"), lambda: _cholmod.available("sparsax")),
    ("CHOLMOD cholespy", Cholmod(library="cholespy"), lambda: _cholmod.available("cholespy")),
    ("KLU", KLU(), _klu.available),
    ("SuperLU MMD_AT_PLUS_A", SuperLU(permc_spec="MMD_AT_PLUS_A"), lambda: True),
    ("SuperLU COLAMD", SuperLU(permc_spec="COLAMD"), lambda: True),
)
# Which are tried, first preferred, for a symmetric positive definite matrix (as far as its
# entries and diagonal show: CHOLMOD's factorisation tells), and for any other (real or complex).
# On SPD matrices KLU and SuperLU with COLAMD took 1.3-3.2 times CHOLMOD's time in every
# measurement (docs/linear-solve.md, "Which solver"): not tried there. sparsax's CHOLMOD
# factors faster than cholespy's, but may factor again where it dropped the factors (`Cholmod`).
# PARDISO's Cholesky and LU factored the benchmarks' three matrices in a third to a half of the
# time of the fastest of the others, once their pattern's analysis was made (`Pardiso`).
_CHOLESKYS = ("PARDISO Cholesky", "CHOLMOD sparsax", "CHOLMOD cholespy")
_SPD = (*_CHOLESKYS, "SuperLU MMD_AT_PLUS_A")
_GENERAL = ("PARDISO LU", "KLU", "SuperLU MMD_AT_PLUS_A", "SuperLU COLAMD")
# For a matrix in single precision (`precision="input"`), those that factor in it: SuperLU's.
_SINGLE = ("SuperLU MMD_AT_PLUS_A", "SuperLU COLAMD")
# Each candidate answers this many of a pattern's factorisations before the choice is made; its
# first is not counted (it may import or compile: klujax's functions, SciPy), so this many less
# one are; a candidate whose counted time is past `_SLOW` times the fastest is not tried again.
_CALLS = 3
_SLOW = 1.5


@dataclasses.dataclass
class _Trial:
    """What one pattern's (and dtype's) factorisations measured, in the program that runs them:
    each candidate's factorisation times and solve times (its first factorisation and the
    solves with it left out), those that could not factor a matrix of it (CHOLMOD, on one that
    was not positive definite), how many factorisations each has made or is making, and the
    fastest, once every candidate of a set was measured (`decided`, by the set)."""

    factor: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    solve: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    failed: set[str] = dataclasses.field(default_factory=set)
    decided: dict[tuple[str, ...], str] = dataclasses.field(default_factory=dict)  # (`next`'s, once measured)

    def seconds(self, name: str) -> float | None:
        """A gradient's worth of `name`'s work: its median factorisation and two median solves
        (a forward and a transposed one); None before a counted factorisation."""
        factor = self.factor.get(name)
        if not factor:
            return None
        solve = self.solve.get(name)
        return float(np.median(factor)) + (2 * float(np.median(solve)) if solve else 0.0)

    def measured(self, among: tuple[str, ...]) -> dict[str, float]:
        out = {c: self.seconds(c) for c in among}
        return {c: s for c, s in out.items() if s is not None}

    def next(self, applicable: tuple[str, ...]) -> str:
        """The candidate to factor with now: one still to be measured (the least tried first),
        else the fastest (decided once for `applicable`: no candidate is measured again)."""
        decided = self.decided.get(applicable)
        if decided is not None:
            return decided
        measured = self.measured(applicable)
        best = min(measured.values()) if measured else None
        trying = [
            c
            for c in applicable
            if self.calls.get(c, 0) < _CALLS and not (c in measured and best is not None and measured[c] > _SLOW * best)
        ]
        if trying:
            return min(trying, key=lambda c: self.calls.get(c, 0))
        if not measured:
            return applicable[0]
        self.decided[applicable] = fastest = min(measured, key=measured.__getitem__)
        return fastest


# by (pattern, dtype): what its factorisations measured (`AutoSparseSolver`)
_TRIALS: dict[tuple, _Trial] = _runtime.store({})
_LOCK = threading.Lock()


class _Made:
    """A factorisation, the candidate that made it, and the trial its solves are timed for
    (None where they are not timed: a candidate's first factorisation, and those after its
    measuring calls)."""

    def __init__(self, name: str, solver: AbstractSparseSolver, factorisation: Any, trial: _Trial | None):
        self.name, self.solver, self.factorisation, self.trial = name, solver, factorisation, trial


def _candidate(name: str) -> AbstractSparseSolver:
    return next(solver for n, solver, _ in _CANDIDATES if n == name)


class AutoSparseSolver(AbstractSparseSolver):
    """The default solver of [`deferax.sparse_solve`][]: the fastest of the sparse direct
    solvers installed, measured on each sparsity pattern in the program that uses it.

    The candidates, for a matrix that is real, equal to its transpose entry for entry and
    with a positive diagonal: [`deferax.Pardiso`][]'s Cholesky, [`deferax.Cholmod`][]
    (CHOLMOD's Cholesky) through sparsax and through cholespy, and [`deferax.SuperLU`][] with
    `"MMD_AT_PLUS_A"`; for any other, and one whose Cholesky factorisation fails: PARDISO's LU,
    [`deferax.KLU`][] and SuperLU with `"MMD_AT_PLUS_A"` and `"COLAMD"`; for a matrix in single
    precision (`precision="input"`), SuperLU's two alone, the others factoring in double
    precision. Those whose library is not installed (pypardiso, sparsax, cholespy, klujax:
    `pip install deferax[sparse]`) are left out, and PARDISO's LU is not tried again on a
    pattern where it perturbed a pivot (the matrix is then factored by another candidate).

    Each factorisation is made once, by one candidate: a pattern's first factorisations (and
    dtype's) go to the candidates in turn, 3 each, and every one is timed with the solves
    made with it; then the one whose median factorisation and two median solves (a
    gradient's worth) took least answers every later factorisation (`chosen` says which,
    and each one's time). A candidate's first factorisation is not counted (klujax compiles
    its functions then), and one that took more than 1.5 times the fastest is not tried
    again. So no call factors twice, the first 4-12 calls of a pattern may take
    a slower solver, and the choice is measured where it will be used: among the program's
    own work, with its memory and threads (a factorisation timed alone can rank otherwise:
    docs/linear-solve.md, "Which solver"). Calls may be answered by different factorisations
    from one another: the same solution to rounding.

    A matrix that is not symmetric positive definite never reaches a Cholesky's answer: a
    Cholesky is tried only where the entries are symmetric with a positive diagonal, and where
    its factorisation reports a pivot that is not positive (an indefinite matrix), the matrix
    is factored by an LU instead, and no Cholesky is tried again on that pattern.

    Pass `solver=dx.Pardiso()`, `dx.Cholmod()`, `dx.KLU()` or `dx.SuperLU(...)` to choose yourself.
    """

    def factor(self, matrix: Any) -> Any:
        key = (_pattern_key(matrix), np.dtype(matrix.dtype).str)
        with _LOCK:
            trial = _TRIALS.setdefault(key, _Trial())
            spd_tried = not trial.failed.intersection(_CHOLESKYS)
        if np.dtype(matrix.dtype).itemsize < (8 if np.isrealobj(matrix.data) else 16):
            order = _SINGLE
        else:
            order = _SPD if spd_tried and _cholmod_may(matrix) else _GENERAL
        while True:
            with _LOCK:
                applicable = tuple(c for c in order if c not in trial.failed and _installed(c))
                name = trial.next(applicable)
                made = trial.calls.get(name, 0)
                measuring = made < _CALLS
                trial.calls[name] = made + 1
            solver = _candidate(name)
            start = time.perf_counter()
            try:
                factorisation = _factor(name, matrix)
            except _cholmod.NotPositiveDefinite:  # (not positive definite: for each Cholesky alike)
                with _LOCK:
                    trial.failed.update(_CHOLESKYS)
                continue
            except _pardiso.Perturbed:  # (singular or nearly: an LU that pivots by rows tells which)
                with _LOCK:
                    trial.failed.add(name)
                continue
            seconds = time.perf_counter() - start
            if isinstance(solver, SuperLU) and measuring:
                _fill.record(matrix, solver.ordering(False), int(factorisation.nnz))
            counted = measuring and made > 0
            if counted:
                with _LOCK:
                    trial.factor.setdefault(name, []).append(seconds)
            return _Made(name, solver, factorisation, trial if counted else None)

    def solve(self, factorisation: Any, rhs: np.ndarray, transpose: bool) -> np.ndarray:
        made = factorisation
        if made.trial is None:
            return made.solver.solve(made.factorisation, rhs, transpose)
        start = time.perf_counter()
        out = made.solver.solve(made.factorisation, rhs, transpose)
        seconds = time.perf_counter() - start
        with _LOCK:
            made.trial.solve.setdefault(made.name, []).append(seconds)
        return out

    def symmetric(self, factorisation: Any) -> bool:
        return factorisation.solver.symmetric(factorisation.factorisation)

    def nbytes(self, factorisation: Any, dtype: np.dtype) -> int:
        """The bytes of the factorisation as the solver that made it counts them."""
        return factorisation.solver.nbytes(factorisation.factorisation, dtype)

    def chosen(self, pattern: Any, dtype: Any = np.float64) -> tuple[str, dict[str, float]] | None:
        """`(solver, seconds)`: the solver chosen so far for the sparsity `pattern` (a
        [`deferax.SparsePattern`][], or a SciPy sparse matrix) with matrices of `dtype` (the
        dtype factored: float64 or complex128 by default, whatever the inputs'), and each
        candidate's time so far, in seconds: its median factorisation and two median solves;
        None before a counted factorisation (a candidate's second). The solver is one of
        `"PARDISO Cholesky"`, `"PARDISO LU"`, `"CHOLMOD sparsax"`, `"CHOLMOD cholespy"`,
        `"KLU"`, `"SuperLU MMD_AT_PLUS_A"` and `"SuperLU COLAMD"`."""
        with _LOCK:
            trial = _TRIALS.get((_pattern_key(_structure(pattern)), np.dtype(dtype).str))
            if trial is None:
                return None
            seconds = trial.measured(tuple(trial.factor))
        if not seconds:
            return None
        return min(seconds, key=seconds.__getitem__), seconds


@_runtime.cached(maxsize=None)
def _installed(name: str) -> bool:
    """Whether the candidate `name`'s library is installed (asked once: `find_spec` took 0.4
    ms a factorisation; `reset` asks again)."""
    return next(ok for n, _, ok in _CANDIDATES if n == name)()


def _cholmod_may(matrix: Any) -> bool:
    """Whether CHOLMOD may factor `matrix`: real, symmetric, with a positive diagonal."""
    return np.isrealobj(matrix.data) and _cholmod.symmetric(matrix) and _cholmod.positive_diagonal(matrix)


def _factor(name: str, matrix: Any) -> Any:
    """The candidate `name`'s factorisation of `matrix` (a Cholesky's without its checks:
    `factor` has made them)."""
    solver = _candidate(name)
    if isinstance(solver, Pardiso):
        return _pardiso.factor(matrix, spd=name == "PARDISO Cholesky")
    return _cholmod.cholesky(matrix, solver.library) if isinstance(solver, Cholmod) else solver.factor(matrix)
