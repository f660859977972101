"""`dx.sparse_solve` at the edges of floating point: float32 and complex64 inputs factored in
double precision (against a float64 solve of the same inputs and a dense complex128 solve),
the single-precision option, NaN and infinity in the entries, and basis cotangents scaled
near the ends of float64's range (against plain JAX)."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx
from deferax._sparse import _factorisations

from .helpers import assert_tree_allclose, load_example


@pytest.fixture(scope="module")
def beam():
    """The MBB beam of `examples/topology_mbb.py`, 60 x 20 elements (2,540 unknowns)."""
    return load_example("topology_mbb").MBB(60, 20)


def stiffness_values(beam):
    """A SIMP stiffness with densities in [0.01, 1] (Young's moduli from 1e-6 to 1, so
    ill-conditioned), its entries rounded to float32."""
    x = np.random.default_rng(0).uniform(0.01, 1.0, beam.nelx * beam.nely)
    return beam.values(jnp.asarray(x, jnp.float32))


def compliance(beam, **options):
    def loss(values):
        f = jnp.asarray(beam.f, values.dtype)
        return jnp.dot(f, dx.sparse_solve(values, beam.pattern, f, **options))

    return loss


def scipy_reference(beam, values):
    """The compliance `f . u` of the same entries and its gradient with respect to them, in
    SciPy and float64, independent of deferax: `K u = f`, `K^T lam = f`, and
    `d(f . u) / d values[k] = -lam[rows[k]] u[cols[k]]`."""
    import scipy.sparse
    import scipy.sparse.linalg

    p = beam.pattern
    k = scipy.sparse.csc_matrix((np.asarray(values, np.float64), (p.rows, p.cols)), shape=(p.n, p.n))
    u = scipy.sparse.linalg.spsolve(k, beam.f)
    lam = scipy.sparse.linalg.spsolve(k.T.tocsc(), beam.f)
    return float(beam.f @ u), -lam[p.rows] * u[p.cols]


def relative(a, b):
    a, b = np.asarray(a, np.complex128), np.asarray(b, np.complex128)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class Seen(list):
    """A list that hashes by identity (a solver's static field must be hashable)."""

    __hash__ = object.__hash__


class DtypeSolver(dx.AbstractSparseSolver):
    """SuperLU, recording the dtypes it is handed."""

    seen: Seen = eqx.field(static=True)

    def factor(self, matrix):
        self.seen.append(("factor", matrix.dtype))
        return dx.SuperLU().factor(matrix)

    def solve(self, factorisation, rhs, transpose):
        self.seen.append(("solve", rhs.dtype))
        return dx.SuperLU().solve(factorisation, rhs, transpose)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("schedule", ["auto", "standard"])
def test_float32_stiffness_is_factored_in_float64(beam, schedule, jit):
    values = stiffness_values(beam)
    want_c, want_g = scipy_reference(beam, values)  # the same float32 entries, solved in float64
    fn = dx.filter_value_and_grad(compliance(beam), schedule=schedule)
    c, g = (eqx.filter_jit(fn) if jit else fn)(values)
    assert c.dtype == jnp.float32 and g.dtype == jnp.float32
    assert relative(c, want_c) < 1e-5
    assert relative(g, want_g) < 1e-5
    # the same entries factored in single precision are off by ten times the tolerance above, or
    # more: the test can tell (how far depends on the ordering and on the BLAS kernels: 7e-4 in
    # value with MMD and OpenBLAS's Haswell kernels, 5e-3 with COLAMD)
    c32, g32 = dx.filter_value_and_grad(compliance(beam, precision="input"), schedule=schedule)(values)
    assert c32.dtype == jnp.float32 and g32.dtype == jnp.float32
    assert relative(c32, want_c) > 1e-4 and relative(g32, want_g) > 1e-4


def test_jax_grad_and_forward_mode_in_float32(beam):
    values = stiffness_values(beam)
    want_c, want_g = scipy_reference(beam, values)
    c, g = jax.value_and_grad(compliance(beam))(values)
    assert g.dtype == jnp.float32 and relative(g, want_g) < 1e-5 and relative(c, want_c) < 1e-5
    tangent = jnp.asarray(np.random.default_rng(1).normal(size=values.shape), jnp.float32)
    _, t = jax.jvp(compliance(beam), (values,), (tangent,))
    want_t = want_g @ np.asarray(tangent, np.float64)  # (the compliance's tangent: its gradient . the tangent)
    assert t.dtype == jnp.float32 and relative(t, want_t) < 1e-5


def test_the_solver_is_handed_float64_unless_asked_for_the_inputs_precision():
    pattern = dx.SparsePattern(np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1]), 2)
    values, b = jnp.array([4.0, 1.0, 2.0, 3.0], jnp.float32), jnp.array([1.0, 2.0], jnp.float32)
    seen = Seen()
    x = dx.sparse_solve(values, pattern, b, solver=DtypeSolver(seen))
    assert x.dtype == jnp.float32
    assert seen == [("factor", np.float64), ("solve", np.float64)]
    seen.clear()
    dx.sparse_solve(values, pattern, b, solver=DtypeSolver(seen), precision="input")
    assert seen == [("factor", np.float32), ("solve", np.float32)]
    seen.clear()
    dx.sparse_solve(values.astype(jnp.complex64), pattern, b.astype(jnp.complex64), solver=DtypeSolver(seen))
    assert seen == [("factor", np.complex128), ("solve", np.complex128)]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_complex64_helmholtz_against_a_dense_complex128_solve(jit):
    """A complex Helmholtz-like operator near resonance in complex64: the power coupled into
    a mode (deferred-basis, k = 2) against plain JAX's dense solve of the same entries in
    complex128."""
    m = 12
    lap = np.diag(-2.0 * np.ones(m)) + np.diag(np.ones(m - 1), 1) + np.diag(np.ones(m - 1), -1)
    a = np.kron(lap, np.eye(m)) + np.kron(np.eye(m), lap)
    a = a + np.diag((0.58 + 1e-4j) * np.ones(m * m))  # close to an eigenvalue of the Laplacian: ill-conditioned
    values, pattern = dx.SparsePattern.from_scipy(__import__("scipy.sparse").sparse.coo_matrix(a))
    values = jnp.asarray(values, jnp.complex64)
    b = jnp.zeros(m * m, jnp.complex64).at[m // 2].set(1.0)
    mode = jnp.asarray(np.cos(np.arange(m * m)), jnp.complex64)

    def power(v):
        return jnp.abs(jnp.vdot(mode, dx.sparse_solve(v, pattern, b))) ** 2

    def reference(v):
        x = jnp.linalg.solve(pattern.todense(v), b.astype(jnp.complex128))
        return jnp.abs(jnp.vdot(mode.astype(jnp.complex128), x)) ** 2

    assert dx.explain(power, values).sites[0].schedule == "deferred-basis"
    want_p, want_g = jax.value_and_grad(reference)(values.astype(jnp.complex128))
    fn = dx.filter_value_and_grad(power)
    p, g = (eqx.filter_jit(fn) if jit else fn)(values)
    assert p.dtype == jnp.float32 and g.dtype == jnp.complex64
    assert relative(p, want_p) < 1e-5 and relative(g, want_g) < 1e-5
    p32, g32 = dx.filter_value_and_grad(
        lambda v: jnp.abs(jnp.vdot(mode, dx.sparse_solve(v, pattern, b, precision="input"))) ** 2
    )(values)
    assert relative(g32, want_g) > 1e-5  # (single precision loses digits here)


def test_a_bad_precision_is_rejected():
    pattern = dx.SparsePattern(np.array([0]), np.array([0]), 1)
    msg = (
        "`dx.sparse_solve(name='fe')`: `precision` must be \"double\" or \"input\", but got 'single'.\n"
        '"double" (the default) factors in float64'
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        dx.sparse_solve(jnp.ones(1), pattern, jnp.ones(1), name="fe", precision="single")


# ----------------------------------------------------------------------------- NaN and inf


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_in_values_is_named_not_called_singular(bad):
    pattern = dx.SparsePattern(np.array([0, 0, 1, 1, 1]), np.array([0, 1, 0, 1, 1]), 2)
    values = jnp.array([4.0, 1.0, 2.0, 3.0, 0.5]).at[2].set(bad).at[4].set(bad)
    b = jnp.array([1.0, 2.0])
    msg = (
        "`ExpensiveFn(name='fe')`: the host function `{impl}` raised ValueError: `values` holds 2 NaN or infinite "
        f"entries of 5 (the first: `values[2] = {bad}`, at row 1, column 0), so the matrix cannot be factored."
    )
    with pytest.raises(dx.HostError, match=re.escape(msg.format(impl="fwd"))) as info:
        dx.sparse_solve(values, pattern, b, name="fe", where="host")
    assert "singular" not in str(info.value)
    with pytest.raises(dx.HostError, match=re.escape(msg.format(impl="fused"))):
        dx.filter_grad(lambda v: jnp.sum(dx.sparse_solve(v, pattern, b, name="fe", where="host")))(values)
    with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(msg.format(impl="fwd"))):  # (JAX wraps it)
        jax.jit(lambda v: dx.sparse_solve(v, pattern, b, name="fe", where="host"))(values).block_until_ready()
    assert len(_factorisations.FACTORISATIONS) == 0


def test_a_zero_pivot_is_still_singular():
    pattern = dx.SparsePattern(np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1]), 2)
    with pytest.raises(dx.HostError, match=re.escape("the matrix is singular: SuperLU found a zero pivot")):
        dx.sparse_solve(jnp.array([1.0, 2.0, 2.0, 4.0]), pattern, jnp.array([1.0, 0.0]), where="host")


# ----------------------------------------------------------------------------- extreme scales

N = 6
RNG = np.random.default_rng(3)
A = np.eye(N) * 4.0 + RNG.uniform(-1, 1, (N, N))
ROWS, COLS = np.nonzero(np.ones((N, N)))
PATTERN = dx.SparsePattern(ROWS, COLS, N)
VALUES = jnp.asarray(A[ROWS, COLS])
B = jnp.asarray(RNG.normal(size=N))
W = RNG.normal(size=N) + 1j * RNG.normal(size=N)


def solve_dense(values):
    return jnp.linalg.solve(PATTERN.todense(values), B)


def host_solver():
    """`A(v) x = B` on the host with a linear adjoint (no `combine`: `adjoint` returns `ct_v`)."""

    def matrix(v):
        a = np.zeros((N, N), np.asarray(v).dtype)
        np.add.at(a, (ROWS, COLS), v)
        return a

    def fwd(v):
        return np.linalg.solve(matrix(v), np.asarray(B))

    def adjoint(v, ct):
        lam = np.linalg.solve(matrix(v).T, ct)
        return lam  # combined with x below

    def combine(v, x, lam):
        return -lam[ROWS] * x[COLS]

    out = jax.ShapeDtypeStruct((N,), jnp.float64)
    return dx.host(fwd, adjoint=adjoint, combine=combine, out=out, adjoint_out=out, linear_adjoint=True, name="solver")


@pytest.mark.parametrize("scale", [1e-170, 1e150])
@pytest.mark.parametrize("loss_kind", ["real", "complex"])
@pytest.mark.parametrize("site", ["sparse_solve", "host"])
def test_basis_cotangents_at_extreme_scales_match_plain_jax(scale, loss_kind, site):
    """`log|w . x|` with `w` scaled by 1e-170 (its squares underflow) or 1e+150 (their
    products overflow): the gradient does not depend on the scale, and must not vanish."""
    w = jnp.asarray(W.real if loss_kind == "real" else W) * scale
    solve = (lambda v: dx.sparse_solve(v, PATTERN, B, where="host")) if site == "sparse_solve" else host_solver()

    def loss(v, solve):
        return jnp.log(jnp.abs(jnp.dot(w, solve(v).astype(w.dtype))))

    want = jax.grad(loss)(VALUES, solve_dense)
    assert float(jnp.max(jnp.abs(want))) > 1e-3
    fn = dx.filter_value_and_grad(lambda v: loss(v, solve), max_basis=2)
    assert dx.explain(fn, VALUES).sites[0].schedule == "deferred-basis"  # (k = 1 real, k = 2 complex)
    value, grad = fn(VALUES)
    assert_tree_allclose(value, loss(VALUES, solve_dense), rtol=1e-10)
    assert_tree_allclose(grad, want, rtol=1e-8, atol=1e-12)
