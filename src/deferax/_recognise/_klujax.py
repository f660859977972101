"""`klujax.solve`: its primitives `solve_f64` and `solve_c128`, recognised.

They bind `(Ai, Aj, Ax[n_lhs, nnz], b[n_lhs, n, n_rhs]) -> x[n_lhs, n, n_rhs]` (klujax's
`solve` and its batching rule bring every call to that layout): `n_lhs` systems, each with
`n_rhs` right-hand sides. In plain JAX a value and gradient factors each matrix at least
twice (its transpose binds the same primitive on `(Aj, Ai)`, which factors again; its JVP
solves once more). KLU refuses a pattern with a duplicate entry (the factorisation fails),
and rows or columns outside `[0, n)`: such calls are left as they are.

The handle-based primitives (`solve_with_symbol*`, `solve_with_numeric*`, `factor*`,
`refactor*`, ...) carry their factorisation as hidden state: they are never recognised.
"""

from __future__ import annotations

import jax
import numpy as np

from .._sparse._pattern import SparsePattern
from . import _registry

NAME = "klujax.solve"

_HANDLES = """klujax's handle-based API (`{name}`) keeps its factorisation as hidden state (a handle), \
which a rewrite cannot see: never recognised. `klujax.solve` is."""


def rule(operands, params):
    Ai, Aj, Ax, b = operands
    if not (isinstance(Ai, np.ndarray) and isinstance(Aj, np.ndarray)):
        return (
            "its indices `Ai`, `Aj` are not known at trace time (they depend on an argument of the "
            "loss, or on a value traced by an enclosing transformation); make them constants "
            "(NumPy arrays, or arrays the loss closes over) to have it recognised"
        )
    n = b.shape[1]
    rows, cols = Ai.astype(np.int64), Aj.astype(np.int64)
    if rows.size and (min(rows.min(), cols.min()) < 0 or max(rows.max(), cols.max()) >= n):
        return f"its indices reach outside [0, {n}), which KLU rejects"
    if np.unique(rows * n + cols).size != rows.size:
        return (
            "its pattern has duplicate entries, which KLU cannot factor (the call fails); sum "
            "them first (`klujax.coalesce`)"
        )
    # KLU factors a matrix with a NaN or infinite entry and returns NaN (where the solution
    # depends on it), and fails on a singular one ("klu_factor failed (singular matrix?)")
    pattern = SparsePattern(rows, cols, n)
    return _registry.Recognition(pattern, _apply, factorisations=2, round_trips=0, nonfinite="nan", singular="raise")


def _apply(solve, Ai, Aj, Ax, b):
    """`x[l, :, r] = A_l^-1 b[l, :, r]`: one site, batched over the systems and the
    right-hand sides (which share their system's factorisation)."""
    n_lhs, _, n_rhs = b.shape
    if n_lhs == 1 and n_rhs == 1:
        return solve(Ax[0], b[0, :, 0])[None, :, None]
    per_rhs = jax.vmap(solve, in_axes=(None, 1), out_axes=1) if n_rhs > 1 else _one_rhs(solve)
    if n_lhs == 1:
        return per_rhs(Ax[0], b[0])[None]
    return jax.vmap(per_rhs)(Ax, b)


def _one_rhs(solve):
    return lambda values, b: solve(values, b[:, 0])[:, None]


# klujax's handle-based API (a factorisation kept as hidden state between calls): never rewritten.
_HANDLE_PRIMITIVES = (
    "solve_with_symbol tsolve_with_symbol solve_with_numeric tsolve_with_numeric factor refactor refactor_and_solve"
)


def _never(name):
    return lambda operands, params: _HANDLES.format(name=name)


def register():
    import klujax

    for p in (klujax.solve_f64, klujax.solve_c128):
        _registry.register_recognition(p, rule, name=NAME)
    for base in _HANDLE_PRIMITIVES.split():
        for suffix in ("_f64", "_c128"):
            p = getattr(klujax, base + suffix, None)
            if p is not None:
                _registry.register_recognition(p, _never(f"klujax.{base}"), name=f"klujax.{base}")
