"""The sparse direct solvers beside SuperLU: `dx.Cholmod` (CHOLMOD through sparsax and through
cholespy), `dx.KLU` (klujax's handle API), `dx.Pardiso` (MKL's PARDISO, Cholesky and LU) and
`dx.AutoSparseSolver`, which measures them on each pattern. Each one's
value and gradient through `dx.sparse_solve` against a dense `jnp.linalg.solve` in plain JAX
(real, complex, float32, SPD and not), eagerly and under `jit`; the SPD fallback; the choice
reported and overridden; one factorisation a gradient; errors; pickling and a process pool."""

import concurrent.futures as cf
import copy
import itertools
import multiprocessing
import os
import pickle
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse
import scipy.sparse.linalg

import deferax as dx

from .helpers import assert_tree_allclose

pytest.importorskip("klujax")
pytest.importorskip("cholespy")
sparsax = pytest.importorskip("sparsax")
pytest.importorskip("pypardiso")


def spd(m=6):
    """A 2D Laplacian plus a positive shift with random positive weights on the edges: real,
    symmetric positive definite, entries at one position added twice (each edge's share)."""
    rng = np.random.default_rng(0)
    n = m * m
    rows, cols, vals = list(range(n)), list(range(n)), list(0.1 + rng.uniform(size=n))
    for i in range(n):
        for j in (i + 1, i + m):
            if j < n and (j != i + 1 or j % m):
                w = rng.uniform(0.5, 1.5)
                rows += [i, j, i, j]
                cols += [j, i, i, j]
                vals += [-w, -w, w, w]
    b = rng.normal(size=n)
    return jnp.asarray(vals), dx.SparsePattern(np.array(rows), np.array(cols), n), jnp.asarray(b)


def unsymmetric(m=6, complex_=False):
    """An upwinded convection-diffusion operator (not symmetric); complex with a lossy diagonal."""
    ones = np.ones(m)
    d1 = scipy.sparse.diags([-1.2 * ones[1:], 2.0 * ones, -0.8 * ones[1:]], [-1, 0, 1])
    matrix = scipy.sparse.kronsum(d1, d1) + 0.1 * scipy.sparse.eye(m * m)
    values, pattern = dx.SparsePattern.from_scipy(matrix)
    b = np.random.default_rng(1).normal(size=m * m)
    if complex_:
        values = values * (1.0 + 0.3j * np.random.default_rng(2).uniform(-1, 1, values.size))
        b = b + 0.5j
    return jnp.asarray(values), pattern, jnp.asarray(b)


def indefinite(n=30):
    """Real symmetric, a positive diagonal, indefinite (the tridiagonal `[1, 1, 1]`: eigenvalues
    `1 + 2 cos(k pi / (n + 1))`, some negative), so only CHOLMOD's own pivot check finds it."""
    i = np.arange(n)
    rows = np.concatenate([i, i[:-1], i[1:]])
    cols = np.concatenate([i, i[1:], i[:-1]])
    values = np.concatenate([np.ones(n), np.ones(n - 1), np.ones(n - 1)])
    return jnp.asarray(values), dx.SparsePattern(rows, cols, n), jnp.asarray(np.linspace(-1.0, 1.0, n))


def spd_complex_b(m=6):
    """`spd`'s real matrix with a complex right-hand side."""
    values, pattern, b = spd(m)
    return values, pattern, jax.lax.complex(b, 0.5 * jnp.roll(b, 1))


def laplacian_alone(m=8):
    """`spd`'s matrix without its positive shift, entries rounded to float32 (the same matrix in
    the float32 suite): a weighted graph Laplacian, symmetric with a positive diagonal, positive
    semidefinite and singular (constants in its null space), whose rounding leaves a pivot of
    about 1e-16: CHOLMOD's is not positive (at m = 8, through both wheels), SuperLU's not
    exactly zero."""
    values, pattern, b = spd(m)
    values = values.at[: pattern.n].set(0.0).astype(jnp.float32).astype(values.dtype)
    return values, pattern, b


def path_laplacian(n=5):
    """The Laplacian of a path with unit weights: symmetric, a positive diagonal, singular, and
    every ordering's elimination meets an exactly zero pivot (integers and halves)."""
    i = np.arange(n)
    rows = np.concatenate([i, i[:-1], i[1:]])
    cols = np.concatenate([i, i[1:], i[:-1]])
    diagonal = np.full(n, 2.0)
    diagonal[[0, -1]] = 1.0
    values = np.concatenate([diagonal, -np.ones(n - 1), -np.ones(n - 1)])
    return jnp.asarray(values), dx.SparsePattern(rows, cols, n), jnp.asarray(np.linspace(-1.0, 1.0, n))


SOLVERS = {
    "Cholmod sparsax": dx.Cholmod(library="sparsax"),
    "Cholmod cholespy": dx.Cholmod(library="cholespy"),
    "KLU": dx.KLU(),
    "Pardiso": dx.Pardiso(),
    "Auto": dx.AutoSparseSolver(),
}
CHOLMODS = ("Cholmod sparsax", "Cholmod cholespy")
CASES = {
    "spd": (spd, (*CHOLMODS, "KLU", "Pardiso", "Auto")),
    "real": (unsymmetric, ("KLU", "Pardiso", "Auto")),
    "complex": (lambda: unsymmetric(complex_=True), ("KLU", "Pardiso", "Auto")),
    "indefinite": (indefinite, ("KLU", "Pardiso", "Auto")),
    "spd, complex b": (spd_complex_b, (*CHOLMODS, "KLU", "Pardiso", "Auto")),
}


def losses(solve, w):
    """A loss linear in `x` (deferred), and one that is not (the standard schedule)."""

    def linear(v, b):
        x = solve(v, b)
        return jnp.real(jnp.sum(w.astype(x.dtype) * x))

    return {
        "linear": linear,
        "power": lambda v, b: jnp.sum(jnp.abs(solve(v, b)) ** 2) + jnp.sum(jnp.abs(v) ** 2),
    }


@pytest.mark.parametrize("case,name", [(c, s) for c, (_, names) in CASES.items() for s in names])
@pytest.mark.parametrize("jit", [False, True])
def test_value_and_gradient_against_a_dense_solve(case, name, jit):
    values, pattern, b = CASES[case][0]()
    w = jnp.cos(jnp.arange(pattern.n, dtype=jnp.float64))
    solver = SOLVERS[name]
    ours = losses(lambda v, b: dx.sparse_solve(v, pattern, b, solver=solver), w)
    dense = losses(lambda v, b: jnp.linalg.solve(pattern.todense(v).astype(b.dtype), b), w)
    for loss in ours:
        reference = jax.value_and_grad(lambda vb, f=dense[loss]: f(*vb))((values, b))
        for transform in (jax.value_and_grad, dx.filter_value_and_grad):
            run = transform(lambda vb, f=ours[loss]: f(*vb))
            run = jax.jit(run) if jit else run
            for _ in range(3):  # (the automatic solver's trial on the first two, its choice on the third)
                assert_tree_allclose(run((values, b)), reference, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", [*CHOLMODS, "KLU", "Pardiso", "Auto"])
def test_float32_inputs_are_factored_in_float64(name):
    values, pattern, b = spd() if name in CHOLMODS else unsymmetric()
    v32, b32 = values.astype(jnp.float32), b.astype(jnp.float32)
    solver = SOLVERS[name]
    loss = lambda v, b: jnp.sum(dx.sparse_solve(v, pattern, b, solver=solver) ** 2)  # noqa: E731
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(v32, b32)
    assert value.dtype == jnp.float32 and all(g.dtype == jnp.float32 for g in grads)
    # the float64 solve of the same (float32) entries, rounded
    v64, b64 = v32.astype(jnp.float64), b32.astype(jnp.float64)
    ref = jax.value_and_grad(lambda v, b: jnp.sum(jnp.linalg.solve(pattern.todense(v), b) ** 2), argnums=(0, 1))
    ref_value, ref_grads = ref(v64, b64)
    rounded = (ref_value.astype(jnp.float32), tuple(g.astype(jnp.float32) for g in ref_grads))
    assert_tree_allclose((value, grads), rounded, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", [*CHOLMODS, "KLU", "Pardiso"])
def test_precision_input_is_factored_in_float64_by_cholmod_klu_and_pardiso(name):
    # (SuperLU factors in float32 there: on this nearly singular matrix 2e-3 off, see docs/linear-solve.md)
    pattern = dx.SparsePattern(np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1]), 2)
    v32 = jnp.array([3.0, 1.0, 1.0, 1.0 / 3.0 + 1e-5], jnp.float32)  # symmetric positive definite
    b32 = jnp.array([1.0, 0.0], jnp.float32)
    exact = np.linalg.solve(np.asarray(v32, np.float64).reshape(2, 2), [1.0, 0.0])
    x = dx.sparse_solve(v32, pattern, b32, solver=SOLVERS[name], precision="input")
    assert x.dtype == jnp.float32
    assert np.max(np.abs(np.asarray(x, np.float64) - exact) / np.abs(exact)) < 1e-6
    x = dx.sparse_solve(v32, pattern, b32, solver=dx.SuperLU(), precision="input")
    assert np.max(np.abs(np.asarray(x, np.float64) - exact) / np.abs(exact)) > 1e-4


def test_precision_input_is_single_precision_with_the_automatic_solver():
    """`precision="input"` asks for a factorisation in single precision: the automatic solver
    keeps to SuperLU's, the candidates that make one (CHOLMOD and KLU factor in float64)."""
    pattern = dx.SparsePattern(np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1]), 2)
    v32 = jnp.array([3.0, 1.0, 1.0, 1.0 / 3.0 + 1e-5], jnp.float32)  # SPD, nearly singular
    b32 = jnp.array([1.0, 0.0], jnp.float32)
    exact = np.linalg.solve(np.asarray(v32, np.float64).reshape(2, 2), [1.0, 0.0])
    for _ in range(8):  # (the measuring calls and the chosen one's)
        x = dx.sparse_solve(v32, pattern, b32, solver=dx.AutoSparseSolver(), precision="input")
        assert np.max(np.abs(np.asarray(x, np.float64) - exact) / np.abs(exact)) > 1e-4
        x = dx.sparse_solve(v32, pattern, b32, solver=dx.AutoSparseSolver())  # (float64: CHOLMOD or SuperLU)
        assert np.max(np.abs(np.asarray(x, np.float64) - exact) / np.abs(exact)) < 1e-6
    assert set(dx.AutoSparseSolver().chosen(pattern, np.float32)[1]) == {"SuperLU MMD_AT_PLUS_A", "SuperLU COLAMD"}


def test_transpose_is_the_plain_transpose_for_complex_matrices():
    values, pattern, b = unsymmetric(complex_=True)
    matrix = pattern._csc(np.asarray(values))
    for solver in (dx.KLU(), dx.Pardiso(), dx.AutoSparseSolver()):
        factors = solver.factor(matrix)
        rhs = np.asarray(b)
        np.testing.assert_allclose(matrix.T @ solver.solve(factors, rhs, True), rhs, atol=1e-12)
        np.testing.assert_allclose(matrix @ solver.solve(factors, rhs, False), rhs, atol=1e-12)
        k = np.stack([rhs, 2 * rhs, 1j * rhs], axis=1)  # (n, k): several right-hand sides at once
        np.testing.assert_allclose(matrix.T @ solver.solve(factors, k, True), k, atol=1e-12)


def test_an_indefinite_symmetric_matrix_gets_an_lu_and_the_right_answer(capfd, monkeypatch):
    from deferax._sparse._solvers import _auto, _pardiso

    values, pattern, b = indefinite()
    matrix = pattern._csc(np.asarray(values))
    assert np.linalg.eigvalsh(matrix.toarray()).min() < 0 and (matrix.diagonal() > 0).all()
    for library in ("sparsax", "cholespy"):
        with pytest.raises(
            Exception, match="not symmetric positive definite: CHOLMOD found a pivot that is not positive"
        ):
            dx.Cholmod(library=library).factor(matrix)
    assert "CHOLMOD warning: not positive definite" in "".join(capfd.readouterr())  # (cholespy's CHOLMOD prints)
    with pytest.raises(Exception, match="not symmetric positive definite: PARDISO's Cholesky found a pivot"):
        _pardiso.factor(matrix, spd=True)
    # (where its Cholesky fails, its LU, which perturbs pivots here: the matrix needs rows swapped; SuperLU's)
    with pytest.raises(np.linalg.LinAlgError, match="PARDISO perturbed 4 pivots of this matrix"):
        _pardiso.factor(matrix, spd=False)
    lu = dx.Pardiso().factor(matrix)
    assert not dx.Pardiso().symmetric(lu) and isinstance(lu, _pardiso._Fallback)
    np.testing.assert_allclose(matrix @ dx.Pardiso().solve(lu, np.asarray(b), False), b, atol=1e-12)
    # the automatic solver tries a Cholesky (symmetric entries, a positive diagonal), which fails: an LU
    used = []
    factor = _auto._factor
    monkeypatch.setattr(_auto, "_factor", lambda name, matrix: used.append(name) or factor(name, matrix))
    x = dx.sparse_solve(values, pattern, b, solver=dx.AutoSparseSolver())
    cholesky = ("CHOLMOD", "PARDISO Cholesky")
    assert used[0] == "PARDISO Cholesky" and not any(u.startswith(cholesky) for u in used[1:])
    np.testing.assert_allclose(matrix @ np.asarray(x), np.asarray(b), atol=1e-12)
    for i in range(12):  # no CHOLMOD tried again; the LUs measured in turn
        x = dx.sparse_solve(values * (1.5 + i), pattern, b, solver=dx.AutoSparseSolver())
        np.testing.assert_allclose((1.5 + i) * matrix @ np.asarray(x), np.asarray(b), atol=1e-12)
    assert not any(u.startswith(cholesky) for u in used[1:]) and len(used) == 15
    assert used.count("PARDISO LU") == 1  # (its pivots perturbed: not tried again on the pattern)
    label, seconds = dx.AutoSparseSolver().chosen(pattern)
    assert set(seconds) == {"KLU", "SuperLU COLAMD", "SuperLU MMD_AT_PLUS_A"}
    assert label == min(seconds, key=seconds.__getitem__)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_matrix_symmetric_but_for_one_entry_never_reaches_a_cholesky(monkeypatch, jit):
    """Once a Cholesky (CHOLMOD's or PARDISO's) is the pattern's choice, a matrix of it that is symmetric but for one
    off-diagonal entry (0.1 % off its mirror, still positive definite) is factored by an LU:
    CHOLMOD reads one triangle (sparsax's own solve does, and answers for the symmetric
    matrix of its upper triangle). Value and gradient against a dense solve, eagerly and under
    `jit`, on the standard and the deferred schedule."""
    from deferax._sparse._solvers import _auto

    values, pattern, b = spd(m=30)
    solver = dx.AutoSparseSolver()
    cholesky = ("CHOLMOD", "PARDISO Cholesky")
    for i in range(10):  # (each candidate measured, then the fastest: a Cholesky, at this size)
        dx.sparse_solve(values * (1.0 + 0.01 * i), pattern, b, solver=solver)
    assert solver.chosen(pattern)[0].startswith(cholesky)
    off = int(np.flatnonzero(pattern.rows < pattern.cols)[7])  # (one of the two entries at its position)
    nearly = values.at[off].multiply(1.002)
    matrix = pattern._csc(np.asarray(nearly)).toarray()
    assert not np.array_equal(matrix, matrix.T) and np.linalg.eigvalsh((matrix + matrix.T) / 2).min() > 0
    used = []
    factor = _auto._factor
    monkeypatch.setattr(_auto, "_factor", lambda name, matrix: used.append(name) or factor(name, matrix))
    for name, loss in losses(lambda v, b: dx.sparse_solve(v, pattern, b, solver=solver), b).items():
        reference = losses(lambda v, b: jnp.linalg.solve(pattern.todense(v), b), b)[name]
        fn = dx.filter_value_and_grad(loss)
        got = (jax.jit(fn) if jit else fn)(nearly, b)
        want = jax.value_and_grad(reference, argnums=(0, 1))(nearly, b)
        assert_tree_allclose(got, (want[0], want[1][0]), rtol=1e-9, atol=1e-11)
    assert used and not any(u.startswith(cholesky) for u in used)
    upper = np.triu(matrix) + np.triu(matrix, 1).T  # (what one triangle says: 5e-5 off, past the tolerance above)
    assert np.abs(np.linalg.solve(upper, b) - np.linalg.solve(matrix, b)).max() > 1e-6


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_spd_matrix_gets_the_fastest_of_cholmod_and_superlu_one_factorisation_a_call(jit):
    values, pattern, b = spd(m=30)
    solver = dx.AutoSparseSolver()
    assert solver.chosen(pattern) is None
    grad = jax.grad(lambda v: jnp.sum(dx.sparse_solve(v, pattern, b, solver=solver) ** 2))
    grad = jax.jit(grad) if jit else grad
    reference = jax.grad(lambda v: jnp.sum(jnp.linalg.solve(pattern.todense(v), b) ** 2))
    for i in range(8):  # (each candidate's first 3 factorisations, then the fastest)
        v = values * (1.0 + 0.01 * i)
        with dx.record() as timeline:
            got = jax.block_until_ready(grad(v))
        assert timeline.counts(steps=True) == {"factor": 1, "solve": 2}
        assert_tree_allclose(got, reference(v), rtol=1e-9, atol=1e-12)
    label, seconds = solver.chosen(pattern)
    assert set(seconds) == {"PARDISO Cholesky", "CHOLMOD sparsax", "CHOLMOD cholespy", "SuperLU MMD_AT_PLUS_A"}
    assert label == min(seconds, key=seconds.__getitem__)
    assert solver.chosen(pattern, np.complex128) is None  # (kept by dtype too)


def test_the_choice_is_the_fastest_in_the_program_and_a_slow_candidate_is_dropped(monkeypatch):
    """Candidates made slow on purpose: each is tried while it is measured, the fastest is
    kept, and one past 1.5 times the fastest on a counted factorisation is not tried again."""
    from deferax._sparse._solvers import _auto

    values, pattern, b = unsymmetric()
    delay = {"PARDISO LU": 0.007, "KLU": 0.005, "SuperLU MMD_AT_PLUS_A": 0.05, "SuperLU COLAMD": 0.006}
    used = []
    factor = _auto._factor

    def slow(name, matrix):
        used.append(name)
        import time

        time.sleep(delay[name])
        return factor(name, matrix)

    monkeypatch.setattr(_auto, "_factor", slow)
    for i in range(16):
        x = dx.sparse_solve(values * (1.0 + i), pattern, b, where="host")  # (the default solver, on the host)
        np.testing.assert_allclose((1.0 + i) * pattern._csc(np.asarray(values)) @ np.asarray(x), b, atol=1e-12)
    assert used[:8] == ["PARDISO LU", "KLU", "SuperLU MMD_AT_PLUS_A", "SuperLU COLAMD"] * 2
    assert used.count("SuperLU MMD_AT_PLUS_A") == 2  # (50 ms against 5-6: not a third time)
    label, seconds = dx.AutoSparseSolver().chosen(pattern)
    assert label == min(seconds, key=seconds.__getitem__) != "SuperLU MMD_AT_PLUS_A"
    assert (
        seconds["SuperLU MMD_AT_PLUS_A"] > 0.05 > max(seconds["KLU"], seconds["SuperLU COLAMD"], seconds["PARDISO LU"])
    )
    assert used[-4:] == [label] * 4  # (the choice made: the fastest from then on)


def test_the_choice_is_overridden_by_solver():
    values, pattern, b = unsymmetric()
    for solver in (dx.KLU(), dx.SuperLU(permc_spec="COLAMD")):
        dx.sparse_solve(values, pattern, b, solver=solver)
    assert dx.AutoSparseSolver().chosen(pattern) is None  # (no trial: the solver given was used)
    with pytest.raises(Exception, match="not symmetric positive definite: it is not equal to its transpose"):
        dx.sparse_solve(values, pattern, b, solver=dx.Cholmod())


@pytest.mark.parametrize("name", [*CHOLMODS, "KLU", "Pardiso", "Auto"])
@pytest.mark.parametrize("jit", [False, True])
def test_one_factorisation_a_gradient(name, jit):
    values, pattern, b = spd() if name in CHOLMODS else unsymmetric(complex_=True)
    solver = SOLVERS[name]
    grad = jax.grad(lambda v: jnp.sum(jnp.abs(dx.sparse_solve(v, pattern, b, solver=solver)) ** 2))
    grad = jax.jit(grad) if jit else grad
    sparsax.clear_cache()  # (sparsax 0.11 keeps eight sets of factors: another test's equal matrices would be found)
    for i in range(10):  # (the automatic solver's trial too: one candidate a call)
        # (new values each time: on jax 0.12 a reference cycle can keep the previous call's
        # factorisation alive past the call, and equal values would find it)
        before = sparsax.factorization_count()
        with dx.record() as timeline:
            grad(values * (1.01 + 0.01 * i))
        assert timeline.counts() == {"fwd": 1, "bwd": 1}
        assert timeline.counts(steps=True) == {"factor": 1, "solve": 2}
        # (sparsax's own count: its solves found the factors it kept)
        assert sparsax.factorization_count() - before == (name == "Cholmod sparsax")
    if name == "Auto":
        chosen = dx.AutoSparseSolver().chosen(pattern, np.complex128)
        assert chosen is not None and chosen[0] in ("PARDISO LU", "KLU", "SuperLU COLAMD", "SuperLU MMD_AT_PLUS_A")


def test_nbytes():
    values, pattern, b = spd(m=20)
    matrix = pattern._csc(np.asarray(values))
    lower = int(np.count_nonzero(matrix.tocoo().row >= matrix.tocoo().col))
    for cholmod in (dx.Cholmod(library="sparsax"), dx.Cholmod(library="cholespy")):
        assert cholmod.nbytes(cholmod.factor(matrix), np.dtype(np.float64)) == lower * 12  # (a lower bound)
    assert dx.KLU().nbytes(dx.KLU().factor(matrix), np.dtype(np.float64)) == matrix.nnz * 12
    auto = dx.AutoSparseSolver()
    made = [auto.factor(matrix) for _ in range(8)][-1]  # (its trial measures SuperLU's fill: the estimates use it)
    assert "SuperLU MMD_AT_PLUS_A" in auto.chosen(pattern)[1]
    fill = dx.SuperLU(permc_spec="MMD_AT_PLUS_A").factor(matrix).nnz
    assert dx.KLU().nbytes(dx.KLU().factor(matrix), np.dtype(np.float64)) == fill * 12
    cholmod = dx.Cholmod().nbytes(dx.Cholmod().factor(matrix), np.dtype(np.float64))
    assert cholmod == (fill + pattern.n) // 2 * 12
    assert auto.nbytes(made, np.dtype(np.float64)) > 0
    # PARDISO's: the factors' entries its analysis counts (at least the lower triangle's, at most
    # the dense triangle's), a 12-byte entry each, and the lower triangle's entries, 8 bytes each
    pardiso = dx.Pardiso().factor(matrix)
    entries = (dx.Pardiso().nbytes(pardiso, np.dtype(np.float64)) - lower * 8) / 12
    assert entries == int(entries) and lower <= entries <= pattern.n * (pattern.n + 1) // 2


def test_solvers_pickle_and_run_on_a_process_pool():
    for solver in SOLVERS.values():
        assert pickle.loads(pickle.dumps(solver)) == solver and hash(solver) == hash(copy.deepcopy(solver))
    values, pattern, b = unsymmetric(complex_=True)
    w = jnp.cos(jnp.arange(pattern.n, dtype=jnp.float64))
    dense = losses(lambda v, b: jnp.linalg.solve(pattern.todense(v), b), w)["power"]
    with cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        for solver in (dx.KLU(), dx.Pardiso(), dx.AutoSparseSolver()):
            ours = losses(lambda v, b, s=solver: dx.sparse_solve(v, pattern, b, solver=s, executor=pool), w)["power"]
            got = jax.value_and_grad(ours, argnums=(0, 1))(values, b)
            assert_tree_allclose(got, jax.value_and_grad(dense, argnums=(0, 1))(values, b), rtol=1e-9, atol=1e-11)


def test_errors():
    values, pattern, b = unsymmetric(complex_=True)
    matrix = pattern._csc(np.asarray(values))
    spd_values, spd_pattern, _ = spd()
    minus = spd_pattern._csc(-np.asarray(spd_values))
    for library in ("auto", "sparsax", "cholespy"):
        with pytest.raises(
            np.linalg.LinAlgError, match=r"not symmetric positive definite: it is complex \(complex128\)"
        ):
            dx.Cholmod(library=library).factor(matrix)
        with pytest.raises(np.linalg.LinAlgError, match="positive definite: a diagonal entry is not positive"):
            dx.Cholmod(library=library).factor(minus)
    with pytest.raises(
        ValueError,
        match=r"`dx.Cholmod\(library=...\)`: expected \"auto\", \"sparsax\" or \"cholespy\", found 'umfpack'",
    ):
        dx.Cholmod(library="umfpack")
    singular = scipy.sparse.csc_matrix(np.array([[1.0, 2.0], [2.0, 4.0]]))
    with pytest.raises(np.linalg.LinAlgError, match="the matrix is singular: KLU found a zero pivot"):
        dx.KLU().factor(singular)


@pytest.mark.parametrize("library", ["sparsax", "cholespy"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_cholmod_solves_a_complex_b_with_one_real_factorisation(library, jit):
    """A real SPD matrix with a complex `b`: `dx.Cholmod` factors the real matrix once a value
    and gradient and solves `b`'s real and imaginary parts as two right-hand sides; value and
    gradients (of the real entries: the real part; of `b`) against a dense complex solve in
    plain JAX, on the standard and the deferred schedule."""
    values, pattern, b = spd_complex_b()
    solver = dx.Cholmod(library=library)
    w = jnp.cos(jnp.arange(pattern.n)).astype(values.dtype)
    ours = losses(lambda v, b: dx.sparse_solve(v, pattern, b, solver=solver), w)
    dense = losses(lambda v, b: jnp.linalg.solve(pattern.todense(v).astype(b.dtype), b), w)
    # (the deferred linear loss solves `b` and its adjoint in one call: the matrix equals its transpose)
    expected = {
        (jax.value_and_grad, "linear"): ({"fwd": 1, "bwd": 1}, {"factor": 1, "solve": 2}),
        (jax.value_and_grad, "power"): ({"fwd": 1, "bwd": 1}, {"factor": 1, "solve": 2}),
        (dx.filter_value_and_grad, "linear"): ({"fused": 1}, {"factor": 1, "solve": 1}),
        (dx.filter_value_and_grad, "power"): ({"fwd": 1, "bwd": 1}, {"factor": 1, "solve": 2}),
    }
    calls = itertools.count()
    for (transform, name), (jobs, steps) in expected.items():
        run = transform(lambda vb, f=ours[name]: f(*vb))
        run = jax.jit(run) if jit else run
        for _ in range(2):
            # (new values each call: no factorisation found again, also one leased eagerly to an
            # output that a reference cycle keeps past its call, as on jax 0.12)
            scale = 1.0 + 0.01 * next(calls)
            with dx.record() as timeline:
                got = jax.block_until_ready(run((values * scale, b)))
            assert (timeline.counts(), timeline.counts(steps=True)) == (jobs, steps), (transform, name)
            want = jax.value_and_grad(lambda vb, f=dense[name]: f(*vb))((values * scale, b))
            assert got[1][0].dtype == values.dtype and got[1][1].dtype == b.dtype
            assert_tree_allclose(got, want, rtol=1e-9, atol=1e-11)


_NOT_SPD_RAISED = (
    "`ExpensiveFn(name='sparse_solve')`: the host function `{fn}` raised NotPositiveDefinite: `dx.Cholmod`: the "
    "matrix is not symmetric positive definite: CHOLMOD found a pivot that is not positive ("
)
_NOT_SINGULAR_NOTE = (
    "`singular={singular!r}` gives NaN for a singular matrix, and this one is not singular (an LU factors it): "
    "the solver is wrong for it, and `singular=` does not apply."
)


@pytest.mark.parametrize("library", ["sparsax", "cholespy"])
@pytest.mark.parametrize("singular", ["nan", "warn"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_cholmod_with_singular_nan_raises_for_a_nonsingular_matrix_that_is_not_spd(library, singular, jit):
    """`singular="nan"` (or `"warn"`) is about singular matrices: a nonsingular symmetric
    indefinite matrix given to `dx.Cholmod` raises its not-SPD error, as with the default
    `singular="raise"`, eagerly and under `jit`, in the forward (`fwd`) and the deferred job
    (`fused`), and gives no NaN."""
    values, pattern, b = indefinite()
    solver = dx.Cholmod(library=library)

    def solve(v):
        return dx.sparse_solve(v, pattern, b, solver=solver, singular=singular)

    error = jax.errors.JaxRuntimeError if jit else dx.HostError
    wrap = jax.jit if jit else (lambda f: f)
    for fn, call in (("fwd", solve), ("fused", dx.filter_grad(lambda v: jnp.dot(b, solve(v))))):
        message = (
            re.escape(_NOT_SPD_RAISED.format(fn=fn))
            + "(?s:.*)"
            + re.escape(_NOT_SINGULAR_NOTE.format(singular=singular))
        )
        with pytest.raises(error, match=message):
            jax.block_until_ready(wrap(call)(values))
    with pytest.raises(error, match=re.escape(_NOT_SPD_RAISED.format(fn="fwd"))) as raised:  # (the default)
        jax.block_until_ready(wrap(lambda v: dx.sparse_solve(v, pattern, b, solver=solver))(values))
    assert "`singular=" not in str(raised.value)


@pytest.mark.parametrize("case", ["zero pivot", "rounding"])
@pytest.mark.parametrize("library", ["sparsax", "cholespy"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_cholmod_with_singular_nan_gives_nan_for_a_singular_matrix(case, library, jit):
    """A singular positive semidefinite matrix that `dx.Cholmod` refuses (a pivot that is not
    positive) gives NaN with `singular="nan"`: the value and both gradients, eagerly and under
    `jit`; an exactly zero pivot (the path's Laplacian), and one of rounding's size (a weighted
    Laplacian: SuperLU's smallest pivot about 1e-16, under `n eps max|a_ij|`). With the default
    `singular="raise"`, CHOLMOD's not-SPD error."""
    from deferax._sparse._solvers import _cholmod

    values, pattern, b = path_laplacian() if case == "zero pivot" else laplacian_alone()
    matrix = pattern._csc(np.asarray(values, np.float64))
    assert np.linalg.matrix_rank(matrix.toarray()) < pattern.n and (matrix.diagonal() > 0).all()
    with pytest.raises(_cholmod.NotPositiveDefinite, match="CHOLMOD found a pivot that is not positive"):
        dx.Cholmod(library=library).factor(matrix)  # (the premise: CHOLMOD refuses it)
    if case == "rounding":  # (the premise: no exactly zero pivot in an LU)
        pivots = np.abs(scipy.sparse.linalg.splu(matrix, permc_spec="MMD_AT_PLUS_A").U.diagonal())
        assert 0 < pivots.min() < 1e-13
    solver = dx.Cholmod(library=library)
    loss = jax.value_and_grad(
        lambda v, b: jnp.sum(dx.sparse_solve(v, pattern, b, solver=solver, singular="nan") ** 2), argnums=(0, 1)
    )
    value, grads = (jax.jit(loss) if jit else loss)(values, b)
    assert bool(jnp.isnan(value)) and all(bool(jnp.isnan(g).all()) for g in grads)
    error = jax.errors.JaxRuntimeError if jit else dx.HostError
    with pytest.raises(error, match=re.escape(_NOT_SPD_RAISED.format(fn="fwd"))):
        solve = lambda v: dx.sparse_solve(v, pattern, b, solver=solver)  # noqa: E731
        jax.block_until_ready((jax.jit(solve) if jit else solve)(values))


def test_klu_leaves_the_process_jax_config_as_it_was():
    # importing klujax turns x64 on and sets the platform for the process: deferax puts both back
    code = """
import jax, numpy as np, scipy.sparse
import deferax as dx
assert "klujax" not in __import__("sys").modules
m = scipy.sparse.csc_matrix(np.array([[4.0, 1.0], [2.0, 3.0]]))
f = dx.KLU().factor(m)
x = dx.KLU().solve(f, np.array([1.0, 2.0]), False)
assert "klujax" in __import__("sys").modules
print(jax.config.jax_enable_x64, repr(jax.config.read("jax_platform_name")), np.allclose(m @ x, [1.0, 2.0]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "''", "True"], out.stderr


def test_klu_on_two_threads_at_once_imports_klujax_once(tmp_path):
    # The second thread comes while the first imports klujax (made slow here: a klujax that
    # sleeps before running the real one), and waits for it, not taking the module half made.
    import klujax

    (tmp_path / "klujax.py").write_text(
        f"import time\ntime.sleep(0.5)\nexec(compile(open({klujax.__file__!r}).read(), {klujax.__file__!r}, 'exec'))\n"
    )
    code = """
import threading, time, numpy as np, scipy.sparse
import deferax as dx
m = scipy.sparse.csc_matrix(np.array([[4.0, 1.0], [2.0, 3.0]]))
errors = []
def run():
    try:
        dx.KLU().solve(dx.KLU().factor(m), np.array([1.0, 2.0]), False)
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=run) for _ in range(2)]
threads[0].start()
time.sleep(0.2)
threads[1].start()
[t.join() for t in threads]
print(errors)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_cholmod_s_library_missing_is_named(monkeypatch):
    from deferax._sparse._solvers import _cholmod, _sparsax

    values, pattern, b = spd()
    matrix = pattern._csc(np.asarray(values))
    monkeypatch.setattr(_sparsax, "available", lambda: False)
    with pytest.raises(
        ImportError, match=r"`dx.Cholmod\(library='sparsax'\)`: no tested sparsax release \(0.9 to 0.11\)"
    ):
        dx.Cholmod(library="sparsax").factor(matrix)
    f = dx.Cholmod().factor(matrix)  # ("auto": cholespy, where sparsax is not)
    assert not isinstance(f, _cholmod._SparsaxFactor)
    np.testing.assert_allclose(matrix @ dx.Cholmod().solve(f, np.asarray(b), False), b, atol=1e-12)
    monkeypatch.setattr(_cholmod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ImportError, match=r"`dx.Cholmod\(library='cholespy'\)`: cholespy is not installed.*pip install"
    ):
        dx.Cholmod().factor(matrix)


def test_sparsax_s_dropped_factors_are_factored_again_and_counted():
    """sparsax keeps the factors of the latest values of a pattern (one set in 0.9, eight in
    0.11): a factorisation made before nine others of its pattern is factored again by its
    solve, with the right answer, and the solve says so."""
    values, pattern, b = spd(m=10)
    cholmod = dx.Cholmod(library="sparsax")
    matrices = [pattern._csc(np.asarray(values) * (1.0 + 0.1 * k)) for k in range(10)]
    sparsax.clear_cache()  # (nothing kept from another test)
    made = [cholmod.factor(m) for m in matrices]
    before = sparsax.factorization_count()
    x = cholmod.solve(made[0], np.asarray(b), False)
    np.testing.assert_allclose(matrices[0] @ x, b, atol=1e-12)
    assert made[0].refactored == 1 == sparsax.factorization_count() - before
    x = cholmod.solve(made[0], np.stack([b, 2 * b], axis=1), True)  # (its factors are the latest now)
    np.testing.assert_allclose(matrices[0] @ x, np.stack([b, 2 * b], axis=1), atol=1e-12)
    assert made[0].refactored == 1 == sparsax.factorization_count() - before


def test_sparsax_s_cholmod_on_four_threads_at_once():
    values, pattern, b = spd(m=20)
    cholmod = dx.Cholmod(library="sparsax")

    def run(k):
        out = []
        for i in range(5):
            m = pattern._csc(np.asarray(values) * (1.0 + k + 0.01 * i))
            out.append(float(np.abs(m @ cholmod.solve(cholmod.factor(m), np.asarray(b), False) - b).max()))
        return max(out)

    with cf.ThreadPoolExecutor(4) as pool:
        assert max(pool.map(run, range(4))) < 1e-11


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_sparsax_s_factorisations_are_all_in_the_timeline_under_vmap_over_matrices(jit):
    """Ten SPD matrices of one pattern under `vmap`, differentiated: sparsax 0.9 keeps one
    set of factors a pattern, 0.11 eight, so the backward pass may factor some again. Every
    factorisation sparsax makes is a "factor" step of the timeline, and the gradients are a
    dense solve's."""
    values, pattern, b = spd(m=8)
    scales = jnp.linspace(1.0, 2.0, 10)
    cholmod = dx.Cholmod(library="sparsax")

    def loss(v, solve):
        return jnp.sum(jax.vmap(lambda s: jnp.sum(solve(s * v, b) ** 2))(scales))

    grad = jax.grad(lambda v: loss(v, lambda m, r: dx.sparse_solve(m, pattern, r, solver=cholmod)))
    grad = jax.jit(grad) if jit else grad
    reference = jax.grad(lambda v: loss(v, lambda m, r: jnp.linalg.solve(pattern.todense(m), r)))
    sparsax.clear_cache()  # (sparsax 0.11 keeps eight sets of factors: an earlier test's equal matrices would be found)
    before = sparsax.factorization_count()
    with dx.record() as timeline:
        got = jax.block_until_ready(grad(values))
    made = sparsax.factorization_count() - before
    assert made >= 10 and timeline.counts(steps=True)["factor"] == made
    assert_tree_allclose(got, reference(values), rtol=1e-9, atol=1e-12)


def test_the_diagonal_check_agrees_with_the_dense_diagonal():
    """`positive_diagonal` finds the stored diagonal once a pattern: each matrix is checked
    against its dense diagonal, on one pattern with changing values (a negative entry, an
    explicit zero, duplicates that sum positive) and on one missing a diagonal entry."""
    from deferax._sparse._solvers import _cholmod

    values, pattern, _ = spd()
    diagonal = np.flatnonzero(pattern.rows == pattern.cols)
    cases = {"as made": np.asarray(values)}
    for name, k, v in (("one negative", 3, -1.0), ("an explicit zero", 5, 0.0), ("a tiny positive", 7, 1e-300)):
        changed = np.asarray(values).copy()
        at = diagonal[pattern.rows[diagonal] == k]
        changed[at] = 0.0
        changed[at[0]] = v
        cases[name] = changed
    dup = np.asarray(values).copy()  # (two entries at `(2, 2)`, -1 and 3: their sum is positive)
    at = np.flatnonzero((pattern.rows == 2) & (pattern.cols == 2))
    dup[at] = 0.0
    dup[at[0]], dup[at[-1]] = -1.0, 3.0
    assert at.size >= 2
    cases["duplicates summing positive"] = dup
    for name, v in cases.items():
        matrix = pattern._csc(v)
        assert _cholmod.positive_diagonal(matrix) == bool((matrix.toarray().diagonal() > 0).all()), name
    assert not _cholmod.positive_diagonal(pattern._csc(cases["one negative"]))
    assert _cholmod.positive_diagonal(pattern._csc(dup))
    missing = scipy.sparse.csc_matrix(np.array([[2.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 1.0, 2.0]]))
    missing.eliminate_zeros()
    assert missing[1, 1] == 0 and not _cholmod.positive_diagonal(missing)


def test_the_automatic_choice_is_the_fastest_measured_and_kept():
    """`_Trial.next`: each candidate measured in turn, then the one whose median factorisation
    and two median solves are least (computed here from the times), kept for its set of
    candidates; another set (CHOLMOD failed) is decided on its own."""
    from deferax._sparse._solvers._auto import _CALLS, _Trial

    trial = _Trial()
    among = ("A", "B", "C")
    times = {"A": ([0.30, 0.10], [0.02, 0.02]), "B": ([0.12, 0.20], [0.01, 0.03]), "C": ([0.15, 0.16], [0.001])}
    for c, (factor, solve) in times.items():
        trial.factor[c], trial.solve[c], trial.calls[c] = list(factor), list(solve), _CALLS
    want = min(among, key=lambda c: np.median(times[c][0]) + 2 * np.median(times[c][1]))
    assert want == "C" and trial.next(among) == "C"
    trial.factor["C"] += [10.0, 10.0]  # (later times, which would make B the fastest, change nothing: kept)
    assert trial.next(among) == "C" and trial.decided == {among: "C"}
    assert trial.next(("A", "B")) == min(("A", "B"), key=lambda c: np.median(times[c][0]) + 2 * np.median(times[c][1]))
    fresh = _Trial()
    assert fresh.next(among) == "A" and not fresh.decided  # (none measured: the first is tried, nothing decided)


class _Dist:
    """A stand-in for `importlib.metadata`'s distribution of splineax-klujax, whose record
    lists `klujax.py` with the hash `digest`."""

    version = "0.5.0.post7"

    def __init__(self, digest):
        import importlib.metadata

        self.files = [importlib.metadata.PackagePath("klujax.py")]
        self.files[0].hash = importlib.metadata.FileHash(f"sha256={digest}")


@pytest.mark.parametrize("fork", [True, False], ids=["splineax's fork", "klujax's own"])
def test_klu_is_left_out_where_the_klujax_module_is_splineax_s_fork(monkeypatch, fork):
    """splineax installs its fork of klujax (splineax-klujax) under klujax's module name; a
    deferax host job that called it hung. Where the module file on the path is the fork's (its
    hash in splineax-klujax's record), `dx.KLU` refuses with a message that says so and what to
    do, and `dx.AutoSparseSolver` never tries KLU (its answers still a dense solve's); where
    the record's hash is another file's (klujax's own module installed after the fork), KLU runs."""
    import base64
    import hashlib
    import importlib.metadata
    import importlib.util

    from deferax._sparse._solvers import _auto, _klu

    with open(importlib.util.find_spec("klujax").origin, "rb") as f:
        digest = base64.urlsafe_b64encode(hashlib.sha256(f.read() if fork else b"another file").digest())
    distribution = importlib.metadata.distribution
    monkeypatch.setattr(
        importlib.metadata,
        "distribution",
        lambda name: _Dist(digest.rstrip(b"=").decode()) if name == "splineax-klujax" else distribution(name),
    )
    _klu._fork.cache_clear()
    values, pattern, b = unsymmetric(m=8)
    matrix = pattern._csc(np.asarray(values))
    used = []
    factor = _auto._factor
    monkeypatch.setattr(_auto, "_factor", lambda name, matrix: used.append(name) or factor(name, matrix))
    for i in range(12):  # (past the candidates' trials)
        x = dx.sparse_solve(values * (1.0 + i), pattern, b, solver=dx.AutoSparseSolver(), where="host")
        np.testing.assert_allclose((1.0 + i) * matrix @ np.asarray(x), np.asarray(b), atol=1e-12)
    assert ("KLU" in used) != fork and _klu.available() != fork
    if fork:
        message = (
            "`dx.KLU`: the module `klujax` installed here is splineax-klujax's (0.5.0.post7, the fork that splineax "
            "installs under klujax's name), not klujax's, and a deferax host job that called it hung"
        )
        with pytest.raises(ImportError, match=re.escape(message)):
            dx.KLU().factor(matrix)
    else:
        np.testing.assert_allclose(matrix @ dx.KLU().solve(dx.KLU().factor(matrix), np.asarray(b), False), b)
