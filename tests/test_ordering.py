"""`dx.SuperLU()`'s column ordering, chosen for each sparsity pattern on its first factorisation:
both COLAMD and `MMD_AT_PLUS_A` tried, the one whose factors hold fewer entries kept (fill
counted by SciPy's `splu` here, independently), reused for the pattern's later
factorisations, overridable, and forgotten by `_runtime.reset`. Solutions and gradients
against SciPy in float64."""

import itertools

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
        return jnp.sum(dx.sparse_solve(values, pattern, b, solver=dx.SuperLU()) ** 2)

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


def test_the_pattern_digest_is_computed_once_for_a_patterns_matrices(monkeypatch):
    """`dx.sparse_solve`'s matrices of one pattern share its read-only structure: its digest
    (the key of the ordering chosen) is computed once, not once a factorisation; a user's
    writable matrix is digested every time (it may change in place), and a changed structure
    gets another key."""
    import hashlib

    from deferax._sparse import _solver

    made = []
    blake2b = hashlib.blake2b
    monkeypatch.setattr(hashlib, "blake2b", lambda **kw: made.append(1) or blake2b(**kw))
    a = laplacian(6)
    values, pattern = dx.SparsePattern.from_scipy(a)
    first = pattern._csc(values)
    key = _solver._pattern_key(first)
    assert key == _solver._pattern_key(scipy.sparse.csc_matrix(a))  # (the same structure, the same key)
    made.clear()
    for scale in (1.0, 2.0, 3.0):
        assert _solver._pattern_key(pattern._csc(scale * values)) == key
    assert made == []
    mine = scipy.sparse.csc_matrix(a)  # (writable: digested each time)
    _solver._pattern_key(mine)
    _solver._pattern_key(mine)
    assert len(made) == 2
    mine.indices[[0, 1]] = mine.indices[[1, 0]]  # (changed in place: another structure)
    assert _solver._pattern_key(mine) != key


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.complex128])
def test_a_patterns_matrix_is_scipys_coo_conversion(dtype):
    """The matrix `dx.sparse_solve` factors, assembled from the pattern's structure computed
    once, is SciPy's COO-to-CSC conversion of the same entries: duplicates summed, indices
    sorted (as its flags claim), in the entries' dtype; for a pattern with and without
    repeated positions."""
    rng = np.random.default_rng(0)
    n = 30
    rows, cols = rng.integers(0, n, 200), rng.integers(0, n, 200)  # (repeated positions)
    for r, c in ((rows, cols), np.divmod(rng.permutation(n * n)[:150], n)):
        values = rng.normal(size=r.size).astype(dtype)
        if np.iscomplexobj(values):
            values = values + 1j * rng.normal(size=r.size).astype(dtype)
        pattern = dx.SparsePattern(r, c, n)
        for scale in (1.0, -2.5):  # (a second matrix of the pattern, from the structure kept)
            v = (scale * values).astype(dtype)
            got = pattern._csc(v)
            want = scipy.sparse.csc_matrix((v, (r, c)), shape=(n, n))
            want.sum_duplicates()
            assert got.dtype == dtype
            assert got.has_canonical_format and got.has_sorted_indices
            np.testing.assert_array_equal(got.indptr, want.indptr)
            np.testing.assert_array_equal(got.indices, want.indices)
            tol = 1e-5 if dtype == np.float32 else 1e-12
            np.testing.assert_allclose(got.data, want.data, rtol=tol, atol=tol)
            sorted_within = all(np.all(np.diff(got.indices[a:b]) > 0) for a, b in itertools.pairwise(got.indptr))
            assert sorted_within


@pytest.mark.parametrize("solver", [dx.SuperLU(), dx.AutoSparseSolver()], ids=["SuperLU", "Auto"])
def test_chosen_answers_for_a_scipy_matrix_of_either_index_dtype(solver):
    """`chosen` of a SciPy matrix answers as for the `SparsePattern` made from it, whether its
    indices are int64 (`coo_array(...).tocsr()` keeps them) or int32 (`csr_matrix` makes them):
    the pattern's key is its structure, not its index dtype."""
    a = laplacian(6).tocoo()
    wide = scipy.sparse.coo_array((a.data, (a.row.astype(np.int64), a.col.astype(np.int64))), shape=a.shape).tocsr()
    narrow = scipy.sparse.csr_matrix((a.data, (a.row.astype(np.int32), a.col.astype(np.int32))), shape=a.shape)
    assert (wide.indices.dtype, wide.indptr.dtype) == (np.int64, np.int64)  # (the premise)
    assert (narrow.indices.dtype, narrow.indptr.dtype) == (np.int32, np.int32)
    values, pattern = dx.SparsePattern.from_scipy(wide)
    b = jnp.asarray(np.linspace(-1.0, 1.0, pattern.n))
    assert solver.chosen(wide) is None and solver.chosen(narrow) is None
    for scale in range(1, 9):  # (the automatic solver's candidates in turn)
        dx.sparse_solve(jnp.asarray(values) * scale, pattern, b, solver=solver)
    chosen = solver.chosen(pattern)
    assert chosen is not None
    assert solver.chosen(wide) == chosen and solver.chosen(narrow) == chosen
    assert solver.chosen(wide.tocsc()) == chosen and solver.chosen(wide.tocoo()) == chosen
