"""`dx.SuperLU()`'s column ordering, chosen for each sparsity pattern on its first factorisation:
both COLAMD and `MMD_AT_PLUS_A` tried, the one whose factors hold fewer entries kept (fill
counted by SciPy's `splu` here, independently), reused for the pattern's later
factorisations, overridable, and forgotten by `_runtime.reset`. Solutions and gradients
against SciPy in float64."""

import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse
import scipy.sparse.linalg

import deferax as dx
from deferax import _runtime


def laplacian(m: int) -> scipy.sparse.csc_matrix:
    """The 5-point Laplacian on an m x m grid: structurally symmetric (the rule of thumb says
    `MMD_AT_PLUS_A`), yet COLAMD fills less at m = 15."""
    d = scipy.sparse.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    return scipy.sparse.csc_matrix(scipy.sparse.kronsum(d, d))


def arrow(n: int) -> scipy.sparse.csc_matrix:
    """A lower bidiagonal matrix with a dense first row: not symmetric (the rule of thumb says
    COLAMD), yet `MMD_AT_PLUS_A` fills far less."""
    a = scipy.sparse.diags([-np.ones(n - 1), 4.0 * np.ones(n)], [-1, 0]).tolil()
    a[0, :] = 1.0
    a[0, 0] = 4.0
    return scipy.sparse.csc_matrix(a)


def fill(matrix, permc_spec: str) -> int:
    return int(scipy.sparse.linalg.splu(matrix, permc_spec=permc_spec).nnz)


@pytest.fixture
def splu_calls(monkeypatch):
    seen = []
    splu = scipy.sparse.linalg.splu
    monkeypatch.setattr(
        scipy.sparse.linalg, "splu", lambda m, permc_spec: seen.append(permc_spec) or splu(m, permc_spec=permc_spec)
    )
    return seen


@pytest.mark.parametrize(
    ("matrix", "symmetric", "winner"),
    [(laplacian(15), True, "COLAMD"), (arrow(200), False, "MMD_AT_PLUS_A")],
    ids=["laplacian-colamd", "arrow-mmd"],
)
def test_the_ordering_with_less_fill_is_chosen(matrix, symmetric, winner):
    fills = {o: fill(matrix, o) for o in ("COLAMD", "MMD_AT_PLUS_A")}
    assert min(fills, key=fills.__getitem__) == winner  # (the premise: the rule of thumb's is not the winner)
    assert dx.SuperLU().ordering(symmetric) != winner
    solver = dx.SuperLU()
    assert solver.chosen(matrix) is None
    lu = solver.factor(matrix)
    assert solver.chosen(matrix) == (winner, fills)
    assert int(lu.nnz) == fills[winner]  # (the factorisation returned is the winner's)
    b = np.arange(matrix.shape[0], dtype=np.float64)
    np.testing.assert_allclose(solver.solve(lu, b, False), scipy.sparse.linalg.spsolve(matrix, b), rtol=1e-10)


def test_the_choice_is_kept_for_the_pattern_and_used_by_sparse_solve(splu_calls):
    matrix = laplacian(15).tocoo()
    pattern = dx.SparsePattern(matrix.row, matrix.col, matrix.shape[0])
    b = jnp.asarray(np.linspace(-1.0, 1.0, matrix.shape[0]))

    def loss(values):
        return jnp.sum(dx.sparse_solve(values, pattern, b) ** 2)

    grad = dx.filter_value_and_grad(loss)
    values = jnp.asarray(matrix.data)
    for scale in (1.0, 2.0, 3.0):  # (three matrices of one pattern)
        value, g = grad(values * scale)
        a = scipy.sparse.csc_matrix((np.asarray(values) * scale, (matrix.row, matrix.col)), shape=matrix.shape)
        x = scipy.sparse.linalg.spsolve(a, np.asarray(b))
        lam = scipy.sparse.linalg.spsolve(a.T.tocsc(), 2 * x)
        np.testing.assert_allclose(float(value), float(np.sum(x**2)), rtol=1e-10)
        np.testing.assert_allclose(np.asarray(g), -lam[matrix.row] * x[matrix.col], rtol=1e-8, atol=1e-12)
    # both tried once (the rule of thumb's first), then COLAMD alone for each matrix
    assert splu_calls[:2] == ["MMD_AT_PLUS_A", "COLAMD"] and set(splu_calls[2:]) == {"COLAMD"}
    assert dx.SuperLU().chosen(pattern)[0] == "COLAMD"
    _runtime.reset()  # (the choices are the process's state: forgotten as the rest)
    assert dx.SuperLU().chosen(pattern) is None


def test_an_ordering_given_is_used_alone(splu_calls):
    matrix = laplacian(15)
    solver = dx.SuperLU(permc_spec="MMD_AT_PLUS_A")
    lu = solver.factor(matrix)
    assert splu_calls == ["MMD_AT_PLUS_A"] and int(lu.nnz) == fill(matrix, "MMD_AT_PLUS_A")
    assert solver.chosen(matrix) is None and dx.SuperLU().chosen(matrix) is None
    assert repr(solver) == "SuperLU(permc_spec='MMD_AT_PLUS_A')"
