"""`jax.experimental.sparse.linalg.spsolve`: its primitive `spsolve_p`, recognised on CPU.

It binds `spsolve[reorder, tol](data, indices, indptr, b)` for a CSR matrix. On CPU it is a
SciPy callback; its JVP binds the forward again and its transpose solves a transposed CSR:
2 factorisations and 2 host round trips per value and gradient under `jit` (3 eagerly),
where the rewritten call factors once. Its callbacks are not counted against the site's
round trips (a plain `pure_callback` costs less than a site's stage, which also hands the
job to an executor: at n = 400 the rewrite measured 2-4x slower), so the call is rewritten
only where the factorisation it saves pays for the site's stages. SciPy needs a CSR matrix in canonical form (its
indices sorted within each row, no duplicate) there: any other fails in the callback, so
such calls are left as they are. On another backend (cuSolver's QR on a GPU) the call
runs on the device and is left as it is.
"""

from __future__ import annotations

import jax
import numpy as np

from .._sparse._pattern import SparsePattern
from . import _registry

NAME = "jax.experimental.sparse.linalg.spsolve"


def rule(operands, params):
    data, indices, indptr, b = operands
    backend = jax.default_backend()
    if backend != "cpu":
        return f"on the {backend} backend it runs on the device (cuSolver); only the CPU backend's is recognised"
    if not (isinstance(indices, np.ndarray) and isinstance(indptr, np.ndarray)):
        return (
            "its `indices` and `indptr` are not known at trace time (they depend on an argument "
            "of the loss, or on a value traced by an enclosing transformation); make them "
            "constants to have it recognised"
        )
    n, nnz = b.shape[0], data.shape[0]
    indices, indptr = indices.astype(np.int64), indptr.astype(np.int64)
    if indptr[0] != 0 or indptr[-1] != nnz or np.any(np.diff(indptr) < 0):
        return f"its `indptr` is not a valid CSR row pointer for {nnz} entries"
    if indices.size and (indices.min() < 0 or indices.max() >= n):
        return f"its column indices reach outside [0, {n})"
    rows = np.repeat(np.arange(n), np.diff(indptr))
    same_row = rows[1:] == rows[:-1]
    if np.any(same_row & (indices[1:] <= indices[:-1])):
        return (
            "its CSR matrix is not in canonical form (column indices sorted within each row, "
            "no duplicates), which the CPU solve fails on; sort and sum them first"
        )
    # SciPy's `spsolve` warns "Matrix is exactly singular" and returns NaN for a singular matrix,
    # and for one with a NaN entry (a NaN pivot); with an infinite entry its answer depends on
    # its pivots (NaN, or a finite limit): the rewritten call gives NaN, with the warning
    pattern = SparsePattern(rows, indices, n)
    return _registry.Recognition(pattern, _apply, factorisations=2, round_trips=0, nonfinite="warn", singular="warn")


def _apply(solve, data, indices, indptr, b):
    return solve(data, b)


def register():
    from jax.experimental.sparse import linalg

    _registry.register_recognition(linalg.spsolve_p, rule, name=NAME)
