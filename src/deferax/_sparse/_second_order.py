"""The sparse solve differentiated more than once (`jax.hessian`, `jax.jvp` of `jax.grad`,
`jax.grad` of `jax.grad`): `x = A^-1 b` as `jax.lax.custom_linear_solve`, whose every
derivative is another solve with `A` or `A^T` (JAX's rules: a tangent solves
`A t_x = t_b - dA x`, a transpose solves with `A^T`) and whose dependence on the entries
is the product `A x` (`matvec`, in JAX, which JAX differentiates to any order).

Each solve leaves the program through one host callback (`solve_rows`), which finds the
matrix's factorisation in the store or makes it. The site's JVP rule uses this
formulation only where an outer differentiation will differentiate its derivative
(`_site._primitive`); a first derivative keeps the site's own schedules.

A second-order program solves one matrix several times, one callback after another (a
Hessian-vector product: `x`, its tangent, the adjoint and the adjoint's tangent), with
nothing in between that could say which is the last: the factorisations these callbacks
make are kept for the next ones, the latest `PINNED` matrices' (within the store's budget),
so that a Hessian-vector product factors once.
"""

from __future__ import annotations

import collections
import dataclasses
import functools as ft
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _record, _runtime
from ._factorisations import FACTORISATIONS

# The factorisations of this many matrices solved in second order are kept for the next
# solves (the latest first), besides those the first-order schedules keep.
PINNED = 8

# the keys pinned, the latest last, each with the store's token (`Store.pin`); `reset` empties
# it, as it empties the store
_PINS: collections.OrderedDict[Any, Any] = _runtime.store(collections.OrderedDict())
_PINS_LOCK = threading.Lock()


def _pin(key: Any) -> None:
    """One user of `key`'s factorisation held for the next second-order solves, the oldest
    pin let go past `PINNED`."""
    with _PINS_LOCK:
        token = _PINS.pop(key, None)
        if token is not None and FACTORISATIONS.pinned(key, token):
            _PINS[key] = token  # (now the latest)
            return
        token = FACTORISATIONS.pin(key)  # (a token dropped with its factorisation: a new pin)
        if token is None:  # (not kept: past the budget on its own)
            return
        _PINS[key] = token
        old = _PINS.popitem(last=False) if len(_PINS) > PINNED else None
    if old is not None:
        FACTORISATIONS.unpin(*old)


@dataclasses.dataclass(frozen=True)
class SecondOrder:
    """`x = A^-1 b` for `x = (values, b)`, differentiable to every order (see the module's
    docstring); `solve`: the `_on_host._Solve` whose host functions the first-order site
    calls (the same solver, precision and treatment of NaN and singular matrices)."""

    solve: Any

    def __call__(self, x: tuple) -> jax.Array:
        values, b = x
        solve = self.solve
        pattern = solve.pattern
        dtype = jnp.dtype(solve.dtype)
        b = jnp.asarray(b).astype(dtype)
        fixed = jax.lax.stop_gradient(values)  # (the derivatives with respect to `values` come from `matvec`)

        def matvec(x):
            return jax.ops.segment_sum(values.astype(dtype) * x[pattern.cols], pattern.rows, pattern.n)

        def host(transpose: bool):
            def solve_(_, r):
                struct = jax.ShapeDtypeStruct(r.shape, r.dtype)
                call = host_solve(solve, transpose)
                return jax.pure_callback(call, struct, fixed, r, vmap_method="expand_dims")

            return solve_

        return jax.lax.custom_linear_solve(
            matvec, b, solve=host(False), transpose_solve=host(not solve.symmetric), symmetric=solve.symmetric
        )


def host_solve(solve: Any, transpose: bool, schedule: str = "second order", call: str | None = None):
    """The host callback of one solve, recorded (`dx.record`) as the site's call of
    `"solve"` or `"transposed solve"` on `schedule`; an error it raises names `call` (default:
    `dx.sparse_solve(name=...)`)."""
    call = f"`dx.sparse_solve(name={solve.name!r})`" if call is None else call

    def run(values: Any, r: Any) -> np.ndarray:  # (NumPy arrays, or JAX's eagerly)
        with _record.site(solve.name, schedule):
            job = ft.partial(solve_rows, solve, np.asarray(values), np.asarray(r), transpose)
            try:
                return _record.recorded("transposed solve" if transpose else "solve", job, False)
            except (ValueError, np.linalg.LinAlgError) as error:
                raise type(error)(f"{call}: {error}") from error

    return run


def solve_rows(solve: Any, values: np.ndarray, r: np.ndarray, transpose: bool) -> np.ndarray:
    """`A^-1 r` (or `A^-T r`) on the host for entries `values` of shape `(..., nnz)` and
    right-hand sides `r` of shape `(..., n)`, their leading axes broadcast (a `vmap`'s, as
    `jax.pure_callback` gives them with `vmap_method="expand_dims"`): the right-hand sides of
    one matrix in one call of the solver, its factorisation found in the store or made
    there, and kept (`_pin`)."""
    nnz, n = solve.pattern.nnz, solve.pattern.n
    batch = np.broadcast_shapes(values.shape[:-1], r.shape[:-1])
    matrices = values.reshape(-1, nnz)
    rhs = np.broadcast_to(r, (*batch, n)).reshape(-1, n)
    out = np.empty(rhs.shape, np.dtype(solve.dtype))
    if len(matrices) == 1:  # (one matrix: every right-hand side in one solve)
        out[:] = _solve_one(solve, matrices[0], rhs, transpose)
        return out.reshape((*batch, n))
    # several matrices (a `vmap` over systems): each run of rows on one of them in one solve
    each = np.broadcast_to(values, (*batch, nnz)).reshape(-1, nnz)
    starts = [i for i in range(len(each)) if i == 0 or not np.array_equal(each[i], each[i - 1])]
    for start, end in zip(starts, [*starts[1:], len(each)], strict=True):
        out[start:end] = _solve_one(solve, each[start], rhs[start:end], transpose)
    return out.reshape((*batch, n))


def _solve_one(solve: Any, values: np.ndarray, rhs: np.ndarray, transpose: bool) -> np.ndarray:
    key = solve._key(values)
    lu = solve._acquire(values, key)  # (a user while it solves)
    try:
        _pin(key)
        return solve._solve(lu, rhs, transpose).astype(solve.dtype)
    finally:
        FACTORISATIONS.release(key)
