"""`AutoSparseSolver`: the default solver of `sparse_solve`, which measures the installed
solvers on each sparsity pattern's first factorisations and keeps the fastest."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import numpy as np

from ... import _runtime
from .._sparse_solver import AbstractSparseSolver, SuperLU, _pattern_key, _structure
from . import _cholmod, _fill, _klu
from ._cholmod import Cholmod
from ._klu import KLU

# The candidates, by the name `chosen` reports, and whether each can run here.
_CANDIDATES = (
    ("CHOLMOD", Cholmod(), _cholmod.available),
    ("KLU", KLU(), _klu.available),
    ("SuperLU MMD_AT_PLUS_A", SuperLU(permc_spec="MMD_AT_PLUS_A"), lambda: True),
    ("SuperLU COLAMD", SuperLU(permc_spec="COLAMD"), lambda: True),
)
# Which are tried, first preferred, for a symmetric positive definite matrix (as far as its
# entries and diagonal show: CHOLMOD's factorisation tells), and for any other (real or complex).
# On SPD matrices KLU and SuperLU with COLAMD took 1.3-3.2 times CHOLMOD's time in every
# measurement (docs/linear-solve.md, "Which solver"): not tried there, so the first call pays less.
_SPD = ("CHOLMOD", "SuperLU MMD_AT_PLUS_A")
_GENERAL = ("KLU", "SuperLU COLAMD", "SuperLU MMD_AT_PLUS_A")
# After the first trial of a pattern, the candidates within this factor of the fastest are timed
# once more on its next factorisation (one sample each is noisy); then the choice is made.
_CLOSE = 1.25
_ROUNDS = 2


@dataclasses.dataclass
class _Trial:
    """What the factorisations of one pattern (and dtype) measured: each candidate's fastest
    factorisation in seconds, those that could not factor a matrix of it (CHOLMOD, on one that
    was not positive definite), and the rounds of trials run."""

    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    failed: set[str] = dataclasses.field(default_factory=set)
    rounds: int = 0

    def best(self, among: tuple[str, ...]) -> str | None:
        timed = [c for c in among if c in self.seconds]
        return min(timed, key=lambda c: self.seconds[c]) if timed else None

    def contenders(self, applicable: tuple[str, ...]) -> tuple[str, ...]:
        """The candidates to time on this factorisation: none (the choice is made) or several."""
        best = self.best(applicable)
        unmeasured = tuple(c for c in applicable if c not in self.seconds)
        if unmeasured:  # (every candidate once: a pattern's first factorisation, or a class of matrix new to it)
            return unmeasured + ((best,) if best is not None else ())
        if self.rounds >= _ROUNDS or best is None:
            return ()
        close = tuple(c for c in applicable if self.seconds[c] <= _CLOSE * self.seconds[best])
        return close if len(close) > 1 else ()


# by (pattern, dtype): what its factorisations measured (`AutoSparseSolver`)
_TRIALS: dict[tuple, _Trial] = _runtime.store({})
_LOCK = threading.Lock()


class _Made:
    """A factorisation and the candidate that made it."""

    def __init__(self, name: str, solver: AbstractSparseSolver, factorisation: Any):
        self.name, self.solver, self.factorisation = name, solver, factorisation


def _candidate(name: str) -> AbstractSparseSolver:
    return next(solver for n, solver, _ in _CANDIDATES if n == name)


class AutoSparseSolver(AbstractSparseSolver):
    """The default solver of [`deferax.sparse_solve`][]: the fastest of the sparse direct
    solvers installed, measured on each sparsity pattern.

    The candidates, for a matrix that is real, equal to its transpose entry for entry and
    with a positive diagonal: [`deferax.Cholmod`][] (CHOLMOD's Cholesky) and
    [`deferax.SuperLU`][] with `"MMD_AT_PLUS_A"`; for any other, and one whose Cholesky
    factorisation fails: [`deferax.KLU`][] and SuperLU with `"COLAMD"` and
    `"MMD_AT_PLUS_A"`. Those whose library is not installed (cholespy, klujax) are left out.
    The first factorisation of a pattern (and dtype) in the process factors
    with each candidate in turn, timing each (KLU twice, its first call compiling its JAX
    functions), and keeps the fastest one's factorisation; the next factorisation times once
    more those within 1.25 of the fastest, and from then on the fastest is used at once
    (`chosen` says which, and each one's time). So the first call or two of a pattern pay for
    the trial, once per process, and later calls may be answered by another factorisation than
    the first call's: the same solution to rounding.

    A matrix that is not symmetric positive definite never reaches CHOLMOD's answer: CHOLMOD
    is tried only where the entries are symmetric with a positive diagonal, and where its
    factorisation reports a pivot that is not positive (an indefinite matrix), the matrix is
    factored by the fastest LU instead, and CHOLMOD is not tried again on that pattern.

    Pass `solver=dx.Cholmod()`, `dx.KLU()` or `dx.SuperLU(...)` to choose yourself.
    """

    def factor(self, matrix: Any) -> Any:
        key = (_pattern_key(matrix), np.dtype(matrix.dtype).str)
        with _LOCK:
            trial = _TRIALS.setdefault(key, _Trial())
            spd_tried = "CHOLMOD" not in trial.failed
        order = _SPD if spd_tried and _cholmod_may(matrix) else _GENERAL
        while True:
            with _LOCK:
                applicable = tuple(c for c in order if c not in trial.failed and _installed(c))
                contenders = trial.contenders(applicable)
                if contenders:
                    trial.rounds += 1
                best = trial.best(applicable)
            if not contenders:
                assert best is not None
                try:
                    return _Made(best, _candidate(best), _factor(best, matrix))
                except _cholmod.NotPositiveDefinite:
                    self._failed(trial, best)
                    continue
            made = self._trial(matrix, trial, contenders)
            if made is not None:
                return made

    @staticmethod
    def _failed(trial: _Trial, name: str) -> None:
        with _LOCK:
            trial.failed.add(name)
            trial.seconds.pop(name, None)

    def _trial(self, matrix: Any, trial: _Trial, contenders: tuple[str, ...]) -> _Made | None:
        """Factor with each of `contenders`, timing each, and return the fastest one's
        factorisation (None if all failed as not positive definite)."""
        best: tuple[float, _Made] | None = None
        for name in contenders:
            solver = _candidate(name)
            try:
                seconds, made = _timed(name, matrix, repeat=2 if name == "KLU" and name not in trial.seconds else 1)
            except _cholmod.NotPositiveDefinite:
                self._failed(trial, name)
                continue
            if isinstance(solver, SuperLU):
                _fill.record(matrix, solver.ordering(False), int(made.nnz))
            with _LOCK:
                trial.seconds[name] = min(seconds, trial.seconds.get(name, np.inf))
            if best is None or seconds < best[0]:
                best = (seconds, _Made(name, solver, made))
            del made  # (the other factorisations' memory released before the next is made)
        return None if best is None else best[1]

    def solve(self, factorisation: Any, rhs: np.ndarray, transpose: bool) -> np.ndarray:
        return factorisation.solver.solve(factorisation.factorisation, rhs, transpose)

    def nbytes(self, factorisation: Any, dtype: np.dtype) -> int:
        """The bytes of the factorisation as the solver that made it counts them."""
        return factorisation.solver.nbytes(factorisation.factorisation, dtype)

    def chosen(self, pattern: Any, dtype: Any = np.float64) -> tuple[str, dict[str, float]] | None:
        """`(solver, seconds)`: the solver chosen so far for the sparsity `pattern` (a
        [`deferax.SparsePattern`][], or a SciPy sparse matrix) with matrices of `dtype` (the
        dtype factored: float64 or complex128 by default, whatever the inputs'), and the
        fastest factorisation each candidate measured, in seconds; None before its first
        factorisation. The solver is one of `"CHOLMOD"`, `"KLU"`, `"SuperLU MMD_AT_PLUS_A"`
        and `"SuperLU COLAMD"`."""
        with _LOCK:
            trial = _TRIALS.get((_pattern_key(_structure(pattern)), np.dtype(dtype).str))
            if trial is None or not trial.seconds:
                return None
            seconds = dict(trial.seconds)
        return min(seconds, key=seconds.__getitem__), seconds


def _installed(name: str) -> bool:
    return next(ok for n, _, ok in _CANDIDATES if n == name)()


def _cholmod_may(matrix: Any) -> bool:
    """Whether CHOLMOD may factor `matrix`: real, symmetric, with a positive diagonal."""
    return np.isrealobj(matrix.data) and _cholmod.symmetric(matrix) and _cholmod.positive_diagonal(matrix)


def _factor(name: str, matrix: Any) -> Any:
    """The candidate `name`'s factorisation of `matrix` (CHOLMOD's without its checks: `factor`
    has made them)."""
    return _cholmod.cholesky(matrix) if name == "CHOLMOD" else _candidate(name).factor(matrix)


def _timed(name: str, matrix: Any, repeat: int) -> tuple[float, Any]:
    """`(seconds, factorisation)`: the fastest of `repeat` factorisations of `matrix` by the
    candidate `name`, and the last."""
    seconds = np.inf
    made = None
    for _ in range(repeat):
        made = None  # (the previous one's memory released first)
        start = time.perf_counter()
        made = _factor(name, matrix)
        seconds = min(seconds, time.perf_counter() - start)
    return seconds, made
