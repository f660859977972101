"""`deferax.lineax`: a sparse matrix as a Lineax operator and `dx.sparse_solve`'s solve as a
Lineax solver. Lineax differentiates the solve (a cotangent is a solve with the transpose, a
tangent one with the matrix); each is checked against a dense solve in plain JAX, with the
factorisations counted: one per value and gradient, and per Hessian-vector product, inside
the program (sparsax's count) and on the host (deferax's record)."""

import re

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
import scipy.sparse
import sparsax  # (in the tests extra)

import deferax as dx
from deferax.lineax import SparseOperator, SparseSolver

from .helpers import assert_tree_allclose


def operator(m, complex_=False):
    d = scipy.sparse.diags([-1.3, 4.5, -0.7], [-1, 0, 1], shape=(m, m))
    e = scipy.sparse.diags([-1.1, -0.9], [-1, 1], shape=(m, m))
    a = scipy.sparse.kron(scipy.sparse.identity(m), d) + scipy.sparse.kron(e, scipy.sparse.identity(m))
    values, pattern = dx.SparsePattern.from_scipy(a.tocsc())
    values = values * (1.0 + 0.05 * np.random.default_rng(0).normal(size=values.size))
    if complex_:
        values = values + 0.3j * np.random.default_rng(1).normal(size=values.size)
    return jnp.asarray(values), pattern


M = 5
VALUES, PATTERN = operator(M)
B = jnp.asarray(np.random.default_rng(2).normal(size=M * M))


def loss_of(solve):
    return lambda v, b: jnp.sum(jnp.abs(solve(v, b)) ** 3)


def with_lineax(solver):
    return loss_of(lambda v, b: lx.linear_solve(SparseOperator(v, PATTERN), b, solver=solver).value)


DENSE = loss_of(lambda v, b: jnp.linalg.solve(PATTERN.todense(v), b))


def counted(fn, *args):
    """`fn(*args)`, sparsax's factorisations and deferax's host steps while it ran."""
    sparsax.clear_cache()
    before = sparsax.factorization_count()
    with dx.record() as timeline:
        out = jax.block_until_ready(fn(*args))
    return out, sparsax.factorization_count() - before, timeline.counts(steps=True)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("where", ["program", "host", "complex"])
def test_value_and_gradient_equal_a_dense_solve_with_one_factorisation(where, jit):
    values = operator(M, complex_=True)[0] if where == "complex" else VALUES
    b = B.astype(jnp.complex128) + 0.5j if where == "complex" else B
    solver = SparseSolver(solver=dx.SuperLU()) if where == "host" else SparseSolver()
    fn = jax.value_and_grad(with_lineax(solver), argnums=(0, 1))
    fn = jax.jit(fn) if jit else fn
    got, factorised, steps = counted(fn, values, b)
    want = jax.value_and_grad(DENSE, argnums=(0, 1))(values, b)
    assert_tree_allclose(got, want, rtol=1e-10, atol=1e-11)
    if where == "program":  # (inside the program: sparsax's KLU, the transposed solve on its kept factors)
        assert (factorised, steps) == (1, {})
    else:  # (on the host: one factorisation, the forward's and the transposed solve on it)
        assert steps == {"factor": 1, "solve": 2}


@pytest.mark.parametrize("where", ["program", "host"])
def test_a_hessian_vector_product_factors_once(where):
    solver = SparseSolver(solver=dx.SuperLU()) if where == "host" else SparseSolver()
    tangents = (jnp.cos(jnp.arange(PATTERN.nnz)), jnp.sin(jnp.arange(PATTERN.n)))

    def hvp(loss):
        grad = jax.grad(loss, argnums=(0, 1))
        return jax.jit(lambda v, b: jax.jvp(grad, (v, b), tangents))

    got, factorised, steps = counted(hvp(with_lineax(solver)), VALUES, B)
    assert_tree_allclose(got, hvp(DENSE)(VALUES, B), rtol=1e-9, atol=1e-10)
    if where == "program":
        assert (factorised, steps) == (1, {})
    else:
        assert steps["factor"] == 1, steps


def test_vmap_over_right_hand_sides_and_matrices():
    solver = SparseSolver(solver=dx.SuperLU())
    rhs = jnp.stack([B, 2.0 * B, B[::-1]])
    solve = jax.vmap(lambda b: lx.linear_solve(SparseOperator(VALUES, PATTERN), b, solver=solver).value)
    got, _, steps = counted(jax.jit(solve), rhs)
    assert_tree_allclose(got, jnp.linalg.solve(PATTERN.todense(VALUES), rhs.T).T, rtol=1e-12, atol=1e-13)
    assert steps == {"factor": 1, "solve": 1}  # (the three right-hand sides in one solve)
    matrices = jnp.stack([VALUES, 1.1 * VALUES])
    many = jax.vmap(lambda v: lx.linear_solve(SparseOperator(v, PATTERN), B, solver=SparseSolver()).value)
    want = jnp.stack([jnp.linalg.solve(PATTERN.todense(v), B) for v in matrices])
    assert_tree_allclose(jax.jit(many)(matrices), want, rtol=1e-12, atol=1e-13)


def test_the_transposed_operator_and_a_symmetric_tag():
    solver = SparseSolver(solver=dx.SuperLU())
    op = SparseOperator(VALUES, PATTERN)
    got = lx.linear_solve(op.T, B, solver=solver).value
    assert_tree_allclose(got, jnp.linalg.solve(PATTERN.todense(VALUES).T, B), rtol=1e-12, atol=1e-13)
    symmetric = (VALUES + VALUES[PATTERN._transposition()[0]]) / 2 if PATTERN._transposition() else None
    assert symmetric is not None
    tagged = SparseOperator(symmetric, PATTERN, lx.symmetric_tag)
    assert lx.is_symmetric(tagged) and not lx.is_symmetric(op)
    loss = loss_of(lambda v, b: lx.linear_solve(SparseOperator(v, PATTERN, lx.symmetric_tag), b, solver=solver).value)
    with dx.record() as timeline:
        got = jax.grad(loss, argnums=1)(symmetric, B)
    assert timeline.counts() == {"solve": 2}  # (the transposed solve is a solve with the matrix itself)
    want = jax.grad(DENSE, argnums=1)(symmetric, B)
    assert_tree_allclose(got, want, rtol=1e-10, atol=1e-11)


def test_lineax_s_questions_about_the_operator():
    op = SparseOperator(VALUES, PATTERN)
    dense = PATTERN.todense(VALUES)
    assert_tree_allclose(lx.diagonal(op), jnp.diagonal(dense))
    lower, diagonal, upper = lx.tridiagonal(op)
    assert_tree_allclose(
        (lower, diagonal, upper), (jnp.diagonal(dense, -1), jnp.diagonal(dense), jnp.diagonal(dense, 1))
    )
    assert_tree_allclose(op.mv(B), dense @ B, rtol=1e-13, atol=1e-14)
    assert_tree_allclose(op.T.as_matrix(), dense.T)
    assert not (lx.is_diagonal(op) or lx.is_positive_semidefinite(op) or lx.is_lower_triangular(op))
    assert lx.is_upper_triangular(SparseOperator(VALUES, PATTERN, lx.lower_triangular_tag).T)
    assert lx.materialise(op) is op and lx.linearise(op) is op
    assert_tree_allclose(
        lx.conj(SparseOperator(VALUES.astype(jnp.complex128) + 1j, PATTERN)).values, VALUES.astype(jnp.complex128) - 1j
    )


def test_float32_is_solved_in_float64_and_rounded():
    values, b = VALUES.astype(jnp.float32), B.astype(jnp.float32)
    fn = jax.jit(jax.value_and_grad(with_lineax(SparseSolver()), argnums=(0, 1)))
    got = fn(values, b)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(got))
    want = jax.value_and_grad(DENSE, argnums=(0, 1))(values.astype(jnp.float64), b.astype(jnp.float64))
    assert_tree_allclose(got, jax.tree.map(lambda w: w.astype(jnp.float32), want), rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("where", ["program", "host"])
def test_a_nan_entry_raises_naming_the_solver_or_gives_nan(where):
    bad = VALUES.at[3].set(jnp.nan)
    host = dx.SuperLU() if where == "host" else None
    call = re.escape("`deferax.lineax.SparseSolver(name='lineax')`")
    message = call + r".*`values` holds 1 NaN or infinite entries of \d+ \(the first: `values\[3\] = nan`"
    solve = jax.jit(lambda v: lx.linear_solve(SparseOperator(v, PATTERN), B, solver=SparseSolver(solver=host)).value)
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        jax.block_until_ready(solve(bad))
    # `nonfinite="nan"`: NaN for `x` (Lineax's own checks are off with `throw=False`; its
    # backward pass refuses a NaN cotangent whatever the solver does)
    nan = SparseSolver(solver=host, nonfinite="nan")
    got = jax.jit(lambda v: lx.linear_solve(SparseOperator(v, PATTERN), B, solver=nan, throw=False).value)(bad)
    assert bool(jnp.all(jnp.isnan(got)))


def test_bad_operators_and_vectors_say_what_was_expected():
    with pytest.raises(TypeError, match=re.escape("`deferax.lineax.SparseOperator`: `pattern` must be a")):
        SparseOperator(VALUES, "pattern")
    with pytest.raises(ValueError, match=rf"`values` must be a real or complex array of shape \({PATTERN.nnz},\)"):
        SparseOperator(VALUES[:-1], PATTERN)
    with pytest.raises(TypeError, match=re.escape("`deferax.lineax.SparseSolver`: `solver` must be a")):
        SparseSolver(solver="superlu")
    expected = '`nonfinite` must be "raise", "nan" or "warn", but got \'nans\''
    with pytest.raises(ValueError, match=re.escape(expected)):
        SparseSolver(nonfinite="nans")
    with pytest.raises(ValueError, match=re.escape("`singular` must be")):
        SparseSolver(singular="none")
    dense = lx.MatrixLinearOperator(PATTERN.todense(VALUES))
    expected = "`deferax.lineax.SparseSolver`: the operator must be a `deferax.lineax.SparseOperator`"
    with pytest.raises(TypeError, match=re.escape(expected) + r".*MatrixLinearOperator"):
        lx.linear_solve(dense, B, solver=SparseSolver())


def test_without_lineax_the_import_says_what_to_install(monkeypatch):
    import importlib
    import sys

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lineax" else object())
    monkeypatch.delitem(sys.modules, "deferax.lineax")
    with pytest.raises(
        ImportError, match=re.escape("`deferax.lineax` needs Lineax, which is not installed: `pip install lineax`")
    ):
        importlib.import_module("deferax.lineax")


class KLU(lx.AbstractLinearSolver):
    """A stand-in for splineax's `KLU` (splineax and the tests extra's klujax cannot be installed
    together; CI's check beside splineax runs the real one): Lineax's LU, in splineax's module."""

    def init(self, operator, options):
        return lx.LU().init(operator, options)

    def compute(self, state, vector, options):
        return lx.LU().compute(state, vector, options)

    def transpose(self, state, options):
        return lx.LU().transpose(state, options)

    def conj(self, state, options):
        return lx.LU().conj(state, options)

    def assume_full_rank(self):
        return True


KLU.__module__ = "splineax.solvers"


def test_a_lineax_solve_with_a_splineax_solver_is_listed_and_left_as_it_is():
    """splineax's solvers factor in `init` behind handles: never rewritten, and `explain` says
    so and names the solver to choose instead; Lineax's own solvers and deferax's are not
    listed. Values and gradients are the program's own."""

    def loss_with(solver):
        def loss(v, b):
            op = lx.MatrixLinearOperator(PATTERN.todense(v)) if not isinstance(solver, SparseSolver) else None
            op = op if op is not None else SparseOperator(v, PATTERN)
            return jnp.sum(lx.linear_solve(op, b, solver=solver).value ** 2)

        return loss

    loss = loss_with(KLU())
    fn = dx.filter_value_and_grad(loss, recognise="always")
    with dx.record() as timeline:
        got = fn(VALUES, B)
    assert timeline.counts() == {}
    assert_tree_allclose(got, jax.value_and_grad(loss)(VALUES, B), rtol=1e-12, atol=1e-13)
    plan = dx.explain(fn, VALUES, B)
    (call,) = plan.recognised
    assert call.call == "lineax.linear_solve with splineax.KLU" and call.site is None
    assert call.reason.startswith("splineax's `KLU` factors in Lineax's `init`, before the solve, and keeps")
    assert "`deferax.lineax.SparseSolver()` with a `deferax.lineax.SparseOperator`" in call.reason
    for other in (lx.LU(), SparseSolver()):
        assert dx.explain(dx.filter_value_and_grad(loss_with(other)), VALUES, B).recognised == ()
