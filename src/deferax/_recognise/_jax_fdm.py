"""jax_fdm's `sparse_solve` (`jax_fdm.equilibrium.sparse`), recognised: a `jax.custom_vjp`
call matched by its backward rule's identity (`sparse_solve_bwd`), rewritten into
`dx.sparse_solve` on the CSC pattern.

Its forward solves `A x = b` (`b` of shape `(n, 3)`, a column a coordinate) with SciPy's
`spsolve` in a `pure_callback`; its backward solves again, `lam = A^-1 g` (jax_fdm takes `A`
as symmetric and does not transpose it), then `ct_b = lam`, and the cotangent of the
matrix's entries from JAX's `CSC` product `A @ x`, which in some JAX versions (0.10, not
0.12: `_transposed_layout` finds out) lays it out as for the transposed pattern:
`ct_data[k] = -lam[cols[k]] * x[rows[k]]`, summed over the columns. (For jax_fdm's
matrices, symmetric with mirrored entries made alike from the force densities, that is the
true gradient; for another matrix it is not.) Plain JAX factors twice a value and gradient,
with two host callbacks; the rewritten call factors once, its columns one job, and gives
jax_fdm's answer for any matrix: its adjoint solves with `A` itself (`symmetric=True`), and
the entries' cotangent is moved to the mirror entry where JAX lays it out so (the pattern must
then be structurally symmetric, without duplicates: other calls are left as they are). SciPy returns NaN with a
warning for a singular matrix, as the rewritten call does. Only the CPU backend's solve is a
SciPy callback; on a GPU it is cuSolver's, and the call is left as it is.
"""

from __future__ import annotations

import functools as ft
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jaxpr, _runtime
from .._sparse._pattern import SparsePattern
from . import _registry

MODULE = "jax_fdm.equilibrium.sparse"


def rule_for(params: dict) -> Callable | None:
    """The rule for a `custom_vjp` call whose backward rule is jax_fdm's `sparse_solve_bwd`
    (None for any other, or where jax_fdm is not imported)."""
    module = sys.modules.get(MODULE)
    bwd = getattr(module, "sparse_solve_bwd", None)
    if bwd is None or not any(f is bwd for f in _jaxpr.rule_functions(params.get("bwd"))):
        return None
    return rule


def rule(found, mode) -> Any:
    n_consts = found.params.get("num_consts", 0)
    operands = found.operands[n_consts:]
    if len(operands) != 4:
        return f"jax_fdm's `sparse_solve` called with {len(operands)} arrays, not a CSC matrix's three and `b`"
    data, indices, indptr, b = operands
    backend = jax.default_backend()
    if backend != "cpu":
        return f"on the {backend} backend jax_fdm solves on the device (cuSolver); only its CPU solve is recognised"
    if not (isinstance(indices, np.ndarray) and isinstance(indptr, np.ndarray)):
        return (
            "its matrix's `indices` and `indptr` are not known at trace time (they depend on an argument of the "
            "loss, or on a value traced by an enclosing transformation); make them constants to have it recognised"
        )
    nnz = data.shape[0] if data.ndim == 1 else -1
    indices, indptr = indices.astype(np.int64), indptr.astype(np.int64)
    n = indptr.size - 1
    if b.ndim not in (1, 2) or b.shape[0] != n or indptr[0] != 0 or indptr[-1] != nnz or np.any(np.diff(indptr) < 0):
        return f"its CSC matrix (`indptr` of {indptr.size}, {nnz} entries) does not fit `b` of shape {tuple(b.shape)}"
    if indices.size and (indices.min() < 0 or indices.max() >= n):
        return f"its row indices reach outside [0, {n}), so its matrix is not square"
    # (SciPy infers the matrix's shape from the largest row index: a last row with no entry
    # makes it non-square, which SciPy refuses; so does a structurally singular pattern, which
    # the trial factorisation of the cost check finds)
    if indices.size == 0 or indices.max() != n - 1:
        return f"its matrix has no entry in row {n - 1}, so SciPy takes it as non-square and fails"
    cols = np.repeat(np.arange(n), np.diff(indptr))
    mirror = None
    if _transposed_layout():
        mirror = _mirror(indices, cols, n)
        if mirror is None:
            return (
                "its pattern is not structurally symmetric without duplicates, so jax_fdm's cotangent of the entries "
                "(laid out for the transposed pattern, as this JAX's CSC product lays it) has no entry to go to"
            )
    pattern = SparsePattern(indices, cols, n)
    # SciPy's `spsolve` returns NaN with a warning for a singular matrix and for one with a
    # NaN pivot; jax_fdm's backward solves with `A` itself (`symmetric=True`). Its two
    # callbacks are not counted as round trips, as for JAX's `spsolve` (a plain `pure_callback`
    # costs less than a site's stage: on a small net the rewrite measured 2-3x slower), so the
    # factorisation it saves must pay for the site's stages.
    apply = ft.partial(_apply, mirror=mirror)
    return _registry.Recognition(
        pattern, apply, factorisations=2, round_trips=0, nonfinite="warn", singular="warn", symmetric=True
    )


@_runtime.cached(maxsize=None)
def _transposed_layout() -> bool:
    """Whether this JAX's `CSC @ x` lays the cotangent of the matrix's entries out as for the
    transposed pattern (jax 0.10 does, jax 0.12 does not): jax_fdm's backward takes it from
    that product. Found on a 2 x 2 matrix, once a process."""
    from jax.experimental.sparse import CSC

    rows, cols = np.array([0, 1, 0, 1]), np.array([0, 0, 1, 1])  # (every entry of a 2 x 2, by column)
    x, ct = np.array([1.0, 10.0]), np.array([1.0, 100.0])
    with jax.ensure_compile_time_eval():
        matrix = lambda d: CSC((d, jnp.asarray(rows), jnp.array([0, 2, 4])), shape=(2, 2))  # noqa: E731
        _, vjp = jax.vjp(lambda d: matrix(d) @ jnp.asarray(x), jnp.ones(4))
        (got,) = vjp(jnp.asarray(ct))
    return not np.allclose(np.asarray(got), ct[rows] * x[cols])


def _mirror(rows: np.ndarray, cols: np.ndarray, n: int) -> np.ndarray | None:
    """`m` with `(rows[m[k]], cols[m[k]]) == (cols[k], rows[k])`, or None where an entry has no
    mirror or a position is repeated."""
    at = rows * n + cols
    order = np.argsort(at)
    if np.any(np.diff(at[order]) == 0):
        return None
    mirrored = cols * n + rows
    found = np.searchsorted(at[order], mirrored)
    if np.any(found >= at.size) or np.any(at[order][np.minimum(found, at.size - 1)] != mirrored):
        return None
    return order[found]


@ft.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _mirrored_cotangent(data, mirror):
    """`data`, whose cotangent goes to the mirror entry (jax_fdm's layout)."""
    return data


def _mirrored_fwd(data, mirror):
    return data, None


def _mirrored_bwd(mirror, _, ct):
    return (ct[mirror.array],)


_mirrored_cotangent.defvjp(_mirrored_fwd, _mirrored_bwd)


def _apply(solve, *operands, mirror):
    """`x = A^-1 b`, the columns of `b` one batch on one factorisation."""
    data, _, _, b = operands[-4:]
    if mirror is not None:
        data = _mirrored_cotangent(data, _registry.Static(mirror))
    if b.ndim == 1:
        return [solve(data, b).astype(b.dtype)]
    return [jax.vmap(solve, in_axes=(None, 1), out_axes=1)(data, b).astype(b.dtype)]
