"""`dx.sparse_solve` on symmetric matrices: the column ordering chosen from the pattern, and
a self-adjoint loss (a compliance `b . x`) solved once, its adjoint taken from the forward,
on every schedule; values and gradients against plain JAX (a dense `jnp.linalg.solve`) and
the analytic SIMP sensitivity, solves and factorisations counted."""

import gc
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx
from deferax._sparse import _factorisations
from deferax._sparse._solvers import _cholmod

from .helpers import assert_tree_allclose, load_example


@pytest.fixture(scope="module")
def beam():
    return load_example("topology_mbb").MBB(12, 4)


DENSITIES = jnp.asarray(np.random.default_rng(0).uniform(0.05, 1.0, 48))


def close(got, want, tol=1e-9):
    """Each leaf within `tol` of the largest entry of the reference's (the SIMP stiffness is
    badly conditioned: a dense LU and SuperLU differ in the small entries' last digits)."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and np.max(np.abs(a - b)) <= tol * np.max(np.abs(b)), (a, b)


def dense(pattern, values, b):
    return jnp.linalg.solve(pattern.todense(values), b)


def counted(fn, *args):
    fn(*args)  # (compiled; SciPy imported)
    gc.collect()  # (an eager forward's factorisation is kept until its output is collected)
    _factorisations.FACTORISATIONS.clear()
    with dx.record() as timeline:
        out = fn(*args)
    return out, timeline.counts(steps=True)


TRANSFORMS = {
    "dx": dx.filter_value_and_grad,
    "dx+jit": lambda f: jax.jit(dx.filter_value_and_grad(f)),
    "jax.grad": jax.value_and_grad,
    "jax.grad+jit": lambda f: jax.jit(jax.value_and_grad(f)),
}


@pytest.mark.parametrize("how", sorted(TRANSFORMS))
def test_a_compliance_is_solved_once(beam, how):
    def compliance(x):  # (`beam.compliance` on the host, where the shortcut is)
        f = jnp.asarray(beam.f)
        return jnp.dot(f, dx.sparse_solve(beam.values(x), beam.pattern, f, where="host"))

    (c, g), steps = counted(TRANSFORMS[how](compliance), DENSITIES)
    assert steps == {"factor": 1, "solve": 1}
    want_c, want_g = beam.sensitivity(DENSITIES)
    assert abs(float(c) - want_c) <= 1e-10 * abs(want_c)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-9, atol=1e-12 * np.max(np.abs(want_g)))


@pytest.mark.parametrize("how", sorted(TRANSFORMS))
def test_an_unsymmetric_matrix_on_a_symmetric_pattern_is_solved_twice(beam, how):
    def values(x):
        return beam.values(x).at[5].multiply(1.01)  # one entry changed: A != A^T, the pattern as before

    def loss(x):
        f = jnp.asarray(beam.f)
        return jnp.dot(f, dx.sparse_solve(values(x), beam.pattern, f, where="host"))

    def reference(x):
        f = jnp.asarray(beam.f)
        return jnp.dot(f, dense(beam.pattern, values(x), f))

    got, steps = counted(TRANSFORMS[how](loss), DENSITIES)
    assert steps == {"factor": 1, "solve": 2}
    close(got, jax.value_and_grad(reference)(DENSITIES))


def test_a_cotangent_that_is_not_the_right_hand_side_is_solved(beam):
    w = jnp.asarray(np.random.default_rng(1).normal(size=beam.pattern.n))

    def loss(x, solve):
        f = jnp.asarray(beam.f)
        u = solve(beam.values(x), f)
        return jnp.dot(f, u) ** 2 + jnp.dot(w, u) ** 2  # k = 2: one row is `f` (reused), one is `w`

    def sparse(v, b):
        return dx.sparse_solve(v, beam.pattern, b, where="host")

    fn = dx.filter_value_and_grad(lambda x: loss(x, sparse), max_basis=2)
    assert dx.explain(fn, DENSITIES).sites[0].schedule == "deferred-basis"
    got, steps = counted(fn, DENSITIES)
    # `f` (the forward) and `w` in one call (`A^T = A`: CHOLMOD's solve serves both); the row `f` of the adjoint is `x`
    assert steps == {"factor": 1, "solve": 1}
    want = jax.value_and_grad(lambda x: loss(x, lambda v, b: dense(beam.pattern, v, b)))(DENSITIES)
    close(got, want)
    got, steps = counted(jax.value_and_grad(lambda x: loss(x, sparse)), DENSITIES)
    assert steps == {"factor": 1, "solve": 2}  # standard: the forward, and one adjoint (of a combined cotangent)
    close(got, want)


CALLS: list[tuple[int, bool]] = []  # (`_Counting`'s solves: the columns of each, and `transpose`)


class _Counting(dx.AbstractSparseSolver):
    """SuperLU, each solve's columns counted; `says_symmetric`: what its `symmetric` answers."""

    says_symmetric: bool = False

    def factor(self, matrix):
        return dx.SuperLU().factor(matrix)

    def solve(self, factorisation, rhs, transpose):
        CALLS.append((1 if rhs.ndim == 1 else rhs.shape[1], transpose))
        return dx.SuperLU().solve(factorisation, rhs, transpose)

    def symmetric(self, factorisation):
        return self.says_symmetric


@pytest.mark.parametrize(
    "how, calls",
    [
        ("the solver says so", [(2, False)]),
        ("symmetric=True", [(2, False)]),
        ("neither", [(1, False), (1, True)]),
    ],
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_symmetric_matrix_solves_forward_and_adjoint_in_one_call(beam, how, calls, jit):
    """A deferred site whose solver reports the factored matrix symmetric (CHOLMOD's does), or
    that is declared symmetric, solves `b` and the adjoint's right-hand side as two columns of
    one call; otherwise as two calls, the adjoint transposed. Values and gradients against a
    dense solve."""
    w = jnp.asarray(np.random.default_rng(2).normal(size=beam.pattern.n))
    solver = _Counting(says_symmetric=how == "the solver says so")

    def loss(x, solve):
        return jnp.dot(w, solve(beam.values(x), jnp.asarray(beam.f)))

    def sparse(v, b):
        return dx.sparse_solve(v, beam.pattern, b, solver=solver, symmetric=how == "symmetric=True")

    fn = dx.filter_value_and_grad(lambda x: loss(x, sparse))
    fn = jax.jit(fn) if jit else fn
    assert dx.explain(fn, DENSITIES).sites[0].schedule == "deferred"
    got, steps = counted(fn, DENSITIES)
    CALLS.clear()
    got = fn(DENSITIES * 1.01)  # (a new matrix: nothing kept)
    assert CALLS == calls
    want = jax.value_and_grad(lambda x: loss(x, lambda v, b: dense(beam.pattern, v, b)))(DENSITIES * 1.01)
    close(got, want)


def test_cholmod_solves_a_deferred_site_in_one_call(beam):
    """CHOLMOD (each library installed) on the SPD stiffness: one factorisation and one solve
    call for a deferred site's forward and adjoint, against a dense solve."""
    w = jnp.asarray(np.random.default_rng(3).normal(size=beam.pattern.n))
    libraries = [lib for lib in ("sparsax", "cholespy") if _cholmod.available(lib)]
    assert libraries, "neither CHOLMOD library is installed (both are test dependencies)"
    for library in libraries:

        def loss(x, solve):
            return jnp.dot(w, solve(beam.values(x), jnp.asarray(beam.f)))

        def sparse(v, b, library=library):
            return dx.sparse_solve(v, beam.pattern, b, solver=dx.Cholmod(library=library))

        (value, grad), steps = counted(dx.filter_value_and_grad(lambda x: loss(x, sparse)), DENSITIES)
        assert steps == {"factor": 1, "solve": 1}, library
        want = jax.value_and_grad(lambda x: loss(x, lambda v, b: dense(beam.pattern, v, b)))(DENSITIES)
        close((value, grad), want)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_complex_symmetric_helmholtz_overlap_with_the_source(jit):
    """A complex symmetric (not Hermitian) matrix, `A = A^T`, as a reciprocal medium gives:
    with JAX's plain transposes, a loss `b . x` is self-adjoint too."""
    m = 6
    lap = np.diag(-2.0 * np.ones(m)) + np.diag(np.ones(m - 1), 1) + np.diag(np.ones(m - 1), -1)
    a = np.kron(lap, np.eye(m)) + np.kron(np.eye(m), lap)
    rows, cols = np.nonzero(a)
    pattern = dx.SparsePattern(rows, cols, m * m)
    base = jnp.asarray(a[rows, cols], jnp.complex128)
    diagonal = jnp.asarray(np.flatnonzero(rows == cols))
    b = jnp.zeros(m * m, jnp.complex128).at[3].set(1.0)

    def loss(eps, solve):
        values = base.at[diagonal].add(jnp.asarray(2.0 + 0.1j) * eps.astype(jnp.complex128))
        z = jnp.dot(b, solve(values, b))
        return jnp.real(z) + jnp.imag(z)  # (its cotangent: the complex multiple `(1 - 1j) b` of `b`)

    eps = jnp.asarray(np.random.default_rng(2).uniform(1.0, 2.0, m * m))
    fn = dx.filter_value_and_grad(lambda e: loss(e, lambda v, r: dx.sparse_solve(v, pattern, r, where="host")))
    got, steps = counted(jax.jit(fn) if jit else fn, eps)
    assert steps == {"factor": 1, "solve": 1}
    want = jax.value_and_grad(lambda e: loss(e, lambda v, r: dense(pattern, v, r)))(eps)
    close(got, want)


def test_a_zero_right_hand_side_is_not_taken_for_a_multiple(beam):
    def loss(x):
        zero = jnp.zeros(beam.pattern.n)
        return jnp.sum(dx.sparse_solve(beam.values(x), beam.pattern, zero, where="host") ** 2) + jnp.sum(x**2)

    got = dx.filter_value_and_grad(loss)(DENSITIES)
    assert_tree_allclose(got, (jnp.sum(DENSITIES**2), 2 * DENSITIES))


@pytest.mark.parametrize("epsilons", [0, 1, 10, 1000])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_float32_cotangent_near_a_multiple_of_b_is_solved(epsilons, jit):
    """An adjoint right-hand side equal to `2 b` but for one entry `epsilons` float32 epsilons
    larger: the shortcut `lam = 2 x` is taken only where each entry is `2 b`'s up to rounding,
    so every entry of the gradient is at float32's accuracy against a float64 dense solve of
    the same float32 inputs, and the adjoint is solved (a second column) past rounding. (Before,
    100 epsilons on the whole row took the 1000-epsilon row for a multiple, and the gradient's
    entries near the moved one were hundreds of epsilons off.)"""
    n = 400
    rng = np.random.default_rng(5)
    scale = rng.uniform(0.9, 1.1, (n, n))
    band = 4.0 * np.eye(n) - np.eye(n, k=1) - np.eye(n, k=-1) + 0.5 * np.eye(n, k=7) + 0.5 * np.eye(n, k=-7)
    a = band * (scale + scale.T)
    rows, cols = np.nonzero(a)
    pattern = dx.SparsePattern(rows, cols, n)
    values = jnp.asarray(a[rows, cols], jnp.float32)  # (symmetric: the shortcut's case)
    b = jnp.asarray(rng.uniform(1.0, 2.0, n), jnp.float32)
    eps = np.finfo(np.float32).eps
    m = 123
    weight = (2 * b).at[m].multiply(np.float32(1 + epsilons * eps))  # (float32: 2 b, one entry moved)
    assert (float(weight[m]) - 2 * float(b[m])) / (2 * float(b[m])) == pytest.approx(epsilons * eps, rel=0.5)

    columns = []

    class Columns(dx.AbstractSparseSolver):  # (SuperLU, counting the right-hand sides it solves)
        def factor(self, matrix):
            return dx.SuperLU().factor(matrix)

        def solve(self, factorisation, rhs, transpose):
            columns.append(1 if rhs.ndim == 1 else rhs.shape[1])
            return dx.SuperLU().solve(factorisation, rhs, transpose)

    def loss(values, b):
        return jnp.dot(weight, dx.sparse_solve(values, pattern, b, solver=Columns(), where="host"))

    fn = dx.filter_value_and_grad(lambda vb: loss(*vb))
    (value, (g_values, g_b)), steps = counted(jax.jit(fn) if jit else fn, (values, b))
    assert steps == {"factor": 1, "solve": 1 if epsilons <= 1 else 2}
    assert columns[-steps["solve"] :] == [1] * steps["solve"]  # (`b` alone, then the adjoint alone)

    # the same float32 inputs in float64, densely
    dense_a = np.zeros((n, n))
    np.add.at(dense_a, (rows, cols), np.asarray(values, np.float64))
    x = np.linalg.solve(dense_a, np.asarray(b, np.float64))
    lam = np.linalg.solve(dense_a.T, np.asarray(weight, np.float64))
    for got, want in ((value, weight.astype(np.float64) @ x), (g_b, lam), (g_values, -lam[rows] * x[cols])):
        got = np.asarray(got, np.float64)
        assert got.dtype == np.float64 and np.asarray(got).shape == np.shape(want)
        np.testing.assert_array_less(np.abs(got - want), 8 * eps * np.abs(want) + 1e-30)


# ----------------------------------------------------------------------------- the ordering


def test_structural_symmetry_of_patterns():
    sym = dx.SparsePattern(np.array([0, 0, 1, 1, 0]), np.array([0, 1, 0, 1, 1]), 2)  # a duplicate of (0, 1)
    assert sym.structurally_symmetric
    assert not dx.SparsePattern(np.array([0, 0, 1]), np.array([0, 1, 1]), 2).structurally_symmetric
    assert sym._symmetric(np.array([1.0, 2.0, 3.0, 4.0, 1.0]))  # (0, 1) sums to 3, as (1, 0)
    assert not sym._symmetric(np.array([1.0, 2.0, 3.0, 4.0, 1.5]))
    assert not sym._symmetric(np.array([1.0, 2.0, 3.0 + 1e-16j, 4.0, 1.0]))


def test_the_ordering_is_chosen_from_the_pattern(beam, monkeypatch):
    import scipy.sparse.linalg

    seen = []
    splu = scipy.sparse.linalg.splu
    monkeypatch.setattr(
        scipy.sparse.linalg, "splu", lambda m, permc_spec: seen.append(permc_spec) or splu(m, permc_spec=permc_spec)
    )
    assert dx.SuperLU().ordering(True) == "MMD_AT_PLUS_A" and dx.SuperLU().ordering(False) == "COLAMD"
    assert dx.SuperLU(permc_spec="NATURAL").ordering(True) == "NATURAL"
    # the first factorisation of a pattern tries both orderings (the rule of thumb's first),
    # later ones use the one chosen; an ordering given is used alone
    beam.compliance(DENSITIES, solver=dx.SuperLU())
    beam.compliance(DENSITIES * 0.5, solver=dx.SuperLU())
    unsymmetric = dx.SparsePattern(np.array([0, 0, 1]), np.array([0, 1, 1]), 2)
    dx.sparse_solve(jnp.array([2.0, 1.0, 3.0]), unsymmetric, jnp.array([1.0, 1.0]), solver=dx.SuperLU())
    beam.compliance(DENSITIES, solver=dx.SuperLU(permc_spec="COLAMD"))
    assert seen == ["MMD_AT_PLUS_A", "COLAMD", "COLAMD", "COLAMD", "MMD_AT_PLUS_A", "COLAMD"]
    # (on this 12 x 4 beam COLAMD fills less; on the 180 x 60 one, `MMD_AT_PLUS_A`)
    chosen, fills = dx.SuperLU().chosen(beam.pattern)
    assert chosen == "COLAMD" and fills["COLAMD"] < fills["MMD_AT_PLUS_A"]
    # the solver used outside `dx.sparse_solve`, on a matrix: chosen for the matrix's pattern
    import scipy.sparse

    seen.clear()
    dx.SuperLU().factor(scipy.sparse.csc_matrix(np.array([[2.0, 1.0], [1.0, 3.0]])))
    dx.SuperLU().factor(scipy.sparse.csc_matrix(np.array([[2.0, 1.0], [0.0, 3.0]])))
    assert seen == ["MMD_AT_PLUS_A", "COLAMD", "COLAMD"]  # (the second's pattern is `unsymmetric`'s: chosen)


def test_a_bad_ordering_is_rejected():
    msg = (
        "`dx.SuperLU`: `permc_spec` must be None (chosen from the pattern) or one of 'COLAMD', 'MMD_AT_PLUS_A', "
        "'MMD_ATA', 'NATURAL', but got 'AMD'."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        dx.SuperLU(permc_spec="AMD")
