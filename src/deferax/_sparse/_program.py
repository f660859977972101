"""The sparse solve inside the compiled program: sparsax's KLU through XLA FFI, for a real
matrix so small that a host site's two round trips would cost more than they save.

`sparse_solve` runs a small real system here, and any other on the host (`_on_host`).
Here the matrix is factored once a value and gradient: sparsax keeps the factorisation of the
values it saw last (keyed by the values, a bounded cache of its own), and the transposed and
tangent solves find it. `jax.lax.custom_linear_solve` gives every derivative as another solve
(reverse and forward mode, `vmap`, `jax.jacrev`); right-hand sides batched over one matrix
(`jax.jacrev`'s rows, `vmap` over `b`) are one multi-column solve.

The choice, where it is made (`refusal`): a trial factorisation of the pattern on the host
(`_solver.trial_seconds`) that takes at most `_ROUND_TRIPS` host round trips' time.
Past it, the host's solvers (CHOLMOD on SPD matrices, the fastest of KLU and SuperLU by
measurement), its budget of kept factorisations and its overlap with other sites are worth
the round trips.
"""

from __future__ import annotations

import functools as ft

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np

from .. import _runtime
from .._concurrency import _placement
from .._jaxpr import is_concrete
from .._plan import _cost
from ._on_host import not_finite_message
from ._pattern import SparsePattern
from ._solver import trial_seconds
from ._solvers import _sparsax

# A pattern whose trial factorisation takes at most this many round trips' time solves here.
_ROUND_TRIPS = 8


def refusal(pattern: SparsePattern, dtype: np.dtype, by_cost: bool) -> str | None:
    """Why a solve of `pattern` in `dtype` (the inputs' result dtype) cannot run inside the
    program, or (`by_cost`) should not; None where it runs there."""
    if _sparsax.module() is None:
        return "sparsax (a tested release) is not installed"
    if not jnp.issubdtype(dtype, jnp.floating):  # (JAX's: bfloat16 is real too, and not NumPy's `np.floating`)
        return "sparsax solves real matrices only"
    platform = _placement.platform()
    if platform != "cpu":
        return f"sparsax's solve is CPU code, and the program runs on {platform}"
    if jax.dtypes.canonicalize_dtype(np.float64) != np.float64:
        return "sparsax factors in float64, which needs `jax_enable_x64`"
    if not by_cost:
        return None
    t = trial_seconds(pattern)  # (`_solver.trial_seconds`)
    if t is None:
        return "a trial factorisation of its pattern failed (the pattern is structurally singular)"
    if t > _ROUND_TRIPS * _cost.round_trip_seconds():
        return f"a factorisation takes about {t * 1e3:.2g} ms here, which pays for a host site's round trips"
    return None


def solve(values: jax.Array, b: jax.Array, pattern: SparsePattern, symmetric: bool, name: str, nonfinite: str):
    """`x = A^-1 b` inside the program, in float64, rounded to the inputs' result dtype. A NaN
    or infinite entry of `values` raises the host path's error (`nonfinite="raise"`: `_raise_if_not_finite`)
    or gives NaN for all of `x` and every derivative, as the host path's `nonfinite="nan"` does
    (KLU alone gives NaN only where the solution depends on the entry: a block of a
    block-diagonal matrix, and a loss of the other blocks would be finite)."""
    dtype = jnp.result_type(values, b)
    values, b = values.astype(jnp.float64), b.astype(jnp.float64)
    fixed = jax.lax.stop_gradient(values)  # (the derivatives with respect to `values` come from `matvec`)
    broken = ~jnp.all(jnp.isfinite(fixed))
    if nonfinite == "raise":
        b = _raise_if_not_finite(b, fixed, broken, pattern, name)

    forward, transposed = _solver(pattern, 0), _solver(pattern, 0 if symmetric else 1)

    def matvec(x):
        return jax.ops.segment_sum(values * x[pattern.cols], pattern.rows, pattern.n)

    def poisoned(solver):  # (each solve, and so `x`, its tangent and the cotangents: NaN)
        return lambda _, r: jnp.where(broken, jnp.nan, solver(fixed, r))

    x = jax.lax.custom_linear_solve(matvec, b, solve=poisoned(forward), transpose_solve=poisoned(transposed))
    return x.astype(dtype)


def solve_once(values: jax.Array, b: jax.Array, pattern: SparsePattern, transpose: bool, name: str, nonfinite: str):
    """`A^-1 b` (`A^-T b` with `transpose`) inside the program, one solve that JAX does not
    differentiate (a Lineax solver's `compute`: Lineax differentiates the solve), in float64
    and rounded to the inputs' result dtype; a NaN or infinite entry raises (`nonfinite="raise"`,
    naming `name`) or gives NaN for all of `x`."""
    dtype = jnp.result_type(values, b)
    values, b = jax.lax.stop_gradient(values.astype(jnp.float64)), b.astype(jnp.float64)
    broken = ~jnp.all(jnp.isfinite(values))
    if nonfinite == "raise":
        b = _raise_if_not_finite(b, values, broken, pattern, name)
    x = _solver(pattern, 1 if transpose else 0)(values, b)
    return jnp.where(broken, jnp.nan, x).astype(dtype)


def _raise_if_not_finite(b: jax.Array, values: jax.Array, broken: jax.Array, pattern: SparsePattern, name: str):
    """`b`, where every entry of `values` is finite; else the host path's error, naming the
    call: raised here where `values` are concrete (an eager call), and from the program where
    they are traced, by a host callback on a branch that runs only then (`jax.lax.cond`, its
    predicate taken over a `vmap`'s whole batch, as `equinox.error_if` does), so that a program
    of finite entries runs no callback. (One that ran on every call, beside sparsax's solve,
    hung programs run from four threads at once; this one, never run there, does not: a test
    runs four threads.) The tangent of `b` passes through as it is."""
    if is_concrete(values):
        if not np.isfinite(np.asarray(values)).all():
            raise ValueError(_in_program(name, not_finite_message(np.asarray(values), pattern)))
        return b
    return _checked(b, values, eqxi.unvmap_any(broken), pattern, name)


@ft.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _checked(b: jax.Array, values: jax.Array, broken: jax.Array, pattern: SparsePattern, name: str) -> jax.Array:
    def fail(b, values):
        def raises(values):  # (under `vmap`, `values` of every example: the first example holding one named)
            values = np.asarray(values).reshape(-1, pattern.nnz)
            bad = values[np.argmax(~np.isfinite(values).all(axis=1))]
            raise ValueError(_in_program(name, not_finite_message(bad, pattern)))

        return jax.pure_callback(raises, jax.ShapeDtypeStruct(b.shape, b.dtype), values, vmap_method="expand_dims")

    return jax.lax.cond(broken, fail, lambda b, _: b, b, values)


@_checked.defjvp
def _checked_jvp(pattern, name, primals, tangents):
    b, values, broken = primals
    return _checked(b, values, broken, pattern, name), tangents[0]


def _in_program(name: str, message: str) -> str:
    """The message of a solve inside the program; `name` a solve's name, or the call itself
    where it is not `dx.sparse_solve`'s (in backquotes: `deferax.lineax.SparseSolver(...)`)."""
    call = name if name.startswith("`") else f"`dx.sparse_solve(name={name!r})`"
    return f"{call}, solved inside the program: {message}"


@_runtime.cached(maxsize=256)
def _solver(pattern: SparsePattern, trans: int):
    """`(values, r) -> A^-1 r` (`trans` 0) or `A^-T r` (1), with `r` of shape `(n,)` or `(n, k)`;
    under `vmap` over `r` alone, one solve of the right-hand sides as columns. One a pattern
    (the same function in every trace: the eager cache finds its programs again)."""
    sparsax = _sparsax.module()
    rows, cols = pattern._indices32()

    @jax.custom_batching.custom_vmap
    def one(v, r):
        return sparsax._lu_solve_ffi(rows, cols, v, r, trans)

    @one.def_vmap
    def _batched(axis_size, in_batched, v, r):
        v_batched, r_batched = in_batched
        if v_batched:  # (several matrices: one after another, each with its right-hand sides)
            r = r if r_batched else jnp.broadcast_to(r, (axis_size, *r.shape))
            return jax.lax.map(lambda vr: one(*vr), (v, r)), True
        columns = jnp.moveaxis(r, 0, -1).reshape(r.shape[1], -1)
        return jnp.moveaxis(one(v, columns).reshape(*r.shape[1:], axis_size), -1, 0), True

    return one
