"""`dx.sparse_solve` for Lineax and optimistix: a sparse matrix as a Lineax operator
(`SparseOperator`: its entries a JAX array, its `SparsePattern` static) and a Lineax solver
for it (`SparseSolver`), so that `lx.linear_solve(operator, b, solver=SparseSolver())` solves
with deferax (and so does Lineax and optimistix code that takes a solver for such an
operator; an optimistix `Newton` whose Jacobian is a dense Lineax operator is refused).

Lineax differentiates a solve itself (a tangent is a solve with the operator, a cotangent a
solve with its transpose, both through the solver's `compute`); each `compute` here is one
solve, not differentiated by JAX: inside the program (sparsax's KLU) where `dx.sparse_solve`
would solve there, on the host otherwise, where the factorisation of a matrix is kept for
the next solves of the same matrix (those of second order's: `_second_order`), so that the
forward solve and its transposed and tangent solves factor once.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np

from .._checks._messages import tree_text
from . import _program, _second_order
from ._on_host import TREATMENTS, _Solve
from ._pattern import SparsePattern
from ._solve import in_program
from ._solver import AbstractSparseSolver

_BAD_OPERATOR = """`deferax.lineax.SparseSolver`: the operator must be a `deferax.lineax.SparseOperator` (a sparse \
matrix's entries and its `dx.SparsePattern`), but got {found}.
Make one with `deferax.lineax.SparseOperator(values, pattern)`; for a dense matrix use `lineax.LU()`."""

_BAD_VALUES = """`deferax.lineax.SparseOperator`: `values` must be a real or complex array of shape ({nnz},) (for \
{pattern!r}), but got {found}."""

_BAD_PATTERN = """`deferax.lineax.SparseOperator`: `pattern` must be a `dx.SparsePattern`, but got {found}."""

_BAD_VECTOR = """`deferax.lineax.SparseSolver`: the right-hand side must be an array of shape ({n},), but got \
{found}."""


_BAD_SOLVER = """`deferax.lineax.SparseSolver`: `solver` must be a `dx.AbstractSparseSolver` (e.g. `dx.SuperLU()`) \
or None (the automatic choice), but got {found}."""

_BAD_TREATMENT = """`deferax.lineax.SparseSolver`: `{what}` must be "raise", "nan" or "warn", but got {found!r}."""


class SparseOperator(lx.AbstractLinearOperator):
    """A square sparse matrix as a Lineax operator: `values[k]` at row `pattern.rows[k]`,
    column `pattern.cols[k]` (entries at one position add up).

    **Arguments:**

    - `values`: the entries, a real or complex JAX array of shape `(pattern.nnz,)`: the
      operator's only leaf, so Lineax differentiates with respect to it.
    - `pattern`: a [`deferax.SparsePattern`][].
    - `tags`: Lineax's tags (`lineax.symmetric_tag`, `lineax.positive_semidefinite_tag`, ...),
      which the solver believes without checking: with `symmetric_tag` the transposed solve
      is a solve with the matrix itself.
    """

    values: jax.Array
    pattern: SparsePattern = eqx.field(static=True)
    tags: frozenset = eqx.field(static=True)

    def __init__(self, values: Any, pattern: Any, tags: Any = frozenset()):
        if not isinstance(pattern, SparsePattern):
            raise TypeError(_BAD_PATTERN.format(found=tree_text(pattern)))
        values = jnp.asarray(values)
        if values.shape != (pattern.nnz,) or not jnp.issubdtype(values.dtype, jnp.inexact):
            raise ValueError(_BAD_VALUES.format(nnz=pattern.nnz, pattern=pattern, found=tree_text(values)))
        self.values, self.pattern = values, pattern
        self.tags = frozenset(tags) if isinstance(tags, set | frozenset | list | tuple) else frozenset([tags])

    def mv(self, vector):
        p = self.pattern
        return jax.ops.segment_sum(self.values * vector[p.cols], p.rows, p.n)

    def as_matrix(self):
        return self.pattern.todense(self.values)

    def transpose(self):
        p = self.pattern
        return SparseOperator(self.values, SparsePattern(p.cols, p.rows, p.n), _transposed(self.tags))

    def in_structure(self):
        return jax.ShapeDtypeStruct((self.pattern.n,), self.values.dtype)

    def out_structure(self):
        return jax.ShapeDtypeStruct((self.pattern.n,), self.values.dtype)


def _transposed(tags: frozenset) -> frozenset:
    swap = {lx.lower_triangular_tag: lx.upper_triangular_tag, lx.upper_triangular_tag: lx.lower_triangular_tag}
    return frozenset(swap.get(t, t) for t in tags)


class SparseSolver(lx.AbstractLinearSolver):
    """[`deferax.sparse_solve`][]'s solve as a Lineax solver, for a
    `deferax.lineax.SparseOperator`: `lx.linear_solve(operator, b, solver=SparseSolver())`
    (any other operator, a dense Jacobian of optimistix's `Newton` say, is refused with a
    message that says what to give).

    Where `dx.sparse_solve` would solve inside the program (a small real system, see "Small
    systems: inside the program"), so does this, with sparsax's KLU; otherwise it solves on
    the host with `solver` (default: the measured choice, `dx.AutoSparseSolver`), keeping each
    matrix's factorisation for the next solves of the same matrix: a value and gradient, and
    a Hessian-vector product, factor once.

    **Arguments:**

    - `solver`: a [`deferax.AbstractSparseSolver`][] for the host (default: automatic).
    - `nonfinite`, `singular`: as for [`deferax.sparse_solve`][] (`"raise"`, `"nan"` or `"warn"`).
    - `name`: shown in errors and by [`deferax.record`][].
    """

    # (typed `Any` so that a wrong value reaches `__check_init__`, whose message says what to give)
    solver: Any = eqx.field(static=True, default=None)
    nonfinite: str = eqx.field(static=True, default="raise")
    singular: str = eqx.field(static=True, default="raise")
    name: str = eqx.field(static=True, default="lineax")

    def __check_init__(self):
        if self.solver is not None and not isinstance(self.solver, AbstractSparseSolver):
            raise TypeError(_BAD_SOLVER.format(found=tree_text(self.solver)))
        for what in ("nonfinite", "singular"):
            if getattr(self, what) not in TREATMENTS:
                raise ValueError(_BAD_TREATMENT.format(what=what, found=getattr(self, what)))

    def init(self, operator, options):
        if not isinstance(operator, SparseOperator):
            raise TypeError(_BAD_OPERATOR.format(found=tree_text(operator)))
        symmetric = lx.symmetric_tag in operator.tags or lx.positive_semidefinite_tag in operator.tags
        return operator.values, operator.pattern, symmetric, False

    def compute(self, state, vector, options):
        values, pattern, symmetric, transposed = state
        if jnp.shape(vector) != (pattern.n,):
            raise ValueError(_BAD_VECTOR.format(n=pattern.n, found=tree_text(vector)))
        x = solve_once(values, pattern, vector, transposed and not symmetric, self)
        return x, lx.RESULTS.successful, {}

    def transpose(self, state, options):
        values, pattern, symmetric, transposed = state
        return (values, pattern, symmetric, not transposed), options

    def conj(self, state, options):
        values, pattern, symmetric, transposed = state
        return (jnp.conj(values), pattern, symmetric, transposed), options

    def assume_full_rank(self):
        return True


def solve_once(values: jax.Array, pattern: SparsePattern, b: jax.Array, transpose: bool, how: SparseSolver):
    """`A^-1 b` (`A^-T b` with `transpose`), one solve that JAX does not differentiate (Lineax
    does), where `dx.sparse_solve` would make it."""
    values, b = jnp.asarray(values), jnp.asarray(b)
    dtype = np.result_type(np.dtype(values.dtype), np.dtype(b.dtype))
    why_not = in_program(pattern, dtype, how.solver, None, None, "double", how.nonfinite, how.singular, "auto")
    call = f"`deferax.lineax.SparseSolver(name={how.name!r})`"
    if why_not is None:
        return _program.solve_once(values, b, pattern, transpose, call, how.nonfinite)
    from ._solvers._auto import AutoSparseSolver

    x64 = jax.dtypes.canonicalize_dtype(np.float64) == np.float64
    real_matrix = not jnp.issubdtype(values.dtype, jnp.complexfloating) and np.issubdtype(dtype, np.complexfloating)
    solver = AutoSparseSolver() if how.solver is None else how.solver
    solve = _Solve(
        pattern, solver, dtype, how.name, "double", "here", how.nonfinite, how.singular, False, x64, real_matrix
    )
    struct = jax.ShapeDtypeStruct(b.shape, np.dtype(dtype))
    run = _second_order.host_solve(solve, transpose, schedule="lineax", call=call)
    return jax.pure_callback(run, struct, values, b.astype(dtype), vmap_method="expand_dims")


def _register() -> None:
    """What Lineax asks of an operator (its structure, by its tags), for `SparseOperator`."""

    def tagged(tag):
        return lambda operator: tag in operator.tags

    for name, answer in (
        ("is_symmetric", lambda op: lx.symmetric_tag in op.tags or lx.positive_semidefinite_tag in op.tags),
        ("is_diagonal", tagged(lx.diagonal_tag)),
        ("is_tridiagonal", tagged(lx.tridiagonal_tag)),
        ("has_unit_diagonal", tagged(lx.unit_diagonal_tag)),
        ("is_lower_triangular", tagged(lx.lower_triangular_tag)),
        ("is_upper_triangular", tagged(lx.upper_triangular_tag)),
        ("is_positive_semidefinite", tagged(lx.positive_semidefinite_tag)),
        ("is_negative_semidefinite", tagged(lx.negative_semidefinite_tag)),
        ("linearise", lambda op: op),
        ("materialise", lambda op: op),
        ("diagonal", _diagonal),
        ("tridiagonal", _tridiagonal),
        ("conj", lambda op: SparseOperator(jnp.conj(op.values), op.pattern, op.tags)),
    ):
        getattr(lx, name).register(SparseOperator)(answer)


def _diagonal(operator):
    p = operator.pattern
    on = p.rows == p.cols
    return jax.ops.segment_sum(jnp.where(jnp.asarray(on), operator.values, 0), p.rows, p.n)


def _tridiagonal(operator):
    matrix = operator.as_matrix()
    return jnp.diagonal(matrix, -1), jnp.diagonal(matrix), jnp.diagonal(matrix, 1)


_register()
