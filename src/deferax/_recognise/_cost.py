"""Whether rewriting a call pays: "never slower", decided by cost as the schedules are.

The original call factors the matrix `F` times per value and gradient and makes `R` host
round trips; the rewritten one factors once, and a host site costs a round trip per stage
(two on the standard schedule, the most it gets). With `t` one factorisation's time and
`S` a round trip's (`_plan._cost.STAGE_SECONDS`):

    original   = F * t + R * S
    rewritten  = t + 2 * S

and the call is rewritten only when `rewritten < original`. `t` is measured once per
pattern: a factorisation (deferax's solver, SuperLU) of the pattern with random values,
the least of a few for a small one (not needed when `R >= 2` and `F >= 2`: then the
rewrite always pays).
"""

from __future__ import annotations

import time

import numpy as np

from .. import _runtime
from .._host._sparse_pattern import SparsePattern
from .._host._sparse_solver import SuperLU
from .._plan import _cost


@_runtime.cached(maxsize=256)
def factor_seconds(pattern: SparsePattern, complex_: bool) -> float | None:
    """One factorisation's time for `pattern` (random values), or None when it fails
    (a structurally singular pattern)."""
    import scipy.sparse

    rng = np.random.default_rng(0)
    values = rng.uniform(1.0, 2.0, pattern.nnz) * rng.choice([-1.0, 1.0], pattern.nnz)
    if complex_:
        values = values * np.exp(1j * rng.uniform(0, 2 * np.pi, pattern.nnz))
    matrix = scipy.sparse.csc_matrix((values, (pattern.rows, pattern.cols)), shape=(pattern.n, pattern.n))
    SuperLU().factor(scipy.sparse.identity(2, values.dtype.char, format="csc"))  # (imports and warms up the solver)
    best = np.inf
    for _ in range(3):
        start = time.perf_counter()
        try:
            SuperLU().factor(matrix)
        except RuntimeError:
            return None
        best = min(best, time.perf_counter() - start)
        if best > 0.01:  # (a large one once is enough)
            break
    return float(best)


def refusal(recognition, complex_: bool) -> str | None:
    """Why rewriting the call would not pay (None when it would)."""
    f, r, s = recognition.factorisations, recognition.round_trips, _cost.STAGE_SECONDS
    if f >= 2 and r >= 2:
        return None
    t = factor_seconds(recognition.pattern, complex_)
    if t is None:
        return "a trial factorisation of its pattern failed (the pattern is structurally singular)"
    if t + 2 * s < f * t + r * s:
        return None
    return (
        f"left in place by cost: one factorisation takes about {_ms(t)} here, so the {f - 1} it saves "
        f'cannot pay for a host site\'s round trips (about {_ms(s)} each); `recognise="always"` '
        "rewrites it anyway"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2g} ms"
