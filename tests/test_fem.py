"""A finite-element compliance through `dx.sparse_solve` (the SIMP MBB beam of
`examples/topology_mbb.py`, 12 x 4 Q4 elements): its value and gradient against a reference
built here from first principles (the element stiffness by Gauss quadrature, a dense global
assembly, SciPy's solve and the analytic SIMP sensitivity, all in float64), eagerly and under
`jit`; and the solves counted through a solver of our own: a compliance (its cotangent a
multiple of the right-hand side, the matrix symmetric) is solved once on every schedule,
while a loss that is not self-adjoint solves its adjoint too."""

import gc

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import deferax as dx
from deferax._sparse import _factorisations

from .helpers import load_example

NELX, NELY = 12, 4
E_MIN, PENAL, NU = 1e-9, 3.0, 0.3


@pytest.fixture(scope="module")
def beam():
    return load_example("topology_mbb", "topology_mbb_fem").MBB(NELX, NELY)


DENSITIES = np.random.default_rng(3).uniform(0.1, 1.0, NELX * NELY)


# ----------------------------------------------------------------------------- the reference


def gauss_element_stiffness(nu=NU):
    """The unit square Q4 element's 8 x 8 stiffness (plane stress, E = 1), by 2 x 2 Gauss
    quadrature of `B^T D B`; nodes counter-clockwise from the lower left, dofs (x, y) each."""
    d = np.array([[1, nu, 0], [nu, 1, 0], [0, 0, (1 - nu) / 2]]) / (1 - nu**2)
    corners = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]])
    ke = np.zeros((8, 8))
    g = 1 / np.sqrt(3)
    for xi in (-g, g):
        for eta in (-g, g):
            # shape functions' derivatives in the element's coordinates (side 1: d/dx = 2 d/dxi)
            dn_dxi = corners[:, 0] * (1 + corners[:, 1] * eta) / 4
            dn_deta = corners[:, 1] * (1 + corners[:, 0] * xi) / 4
            dx_, dy_ = 2 * dn_dxi, 2 * dn_deta
            b = np.zeros((3, 8))
            b[0, 0::2], b[1, 1::2] = dx_, dy_
            b[2, 0::2], b[2, 1::2] = dy_, dx_
            ke += b.T @ d @ b / 4  # (the Jacobian's determinant: 1/4; weights 1)
    return ke


def reference(beam, x):
    """The compliance and its gradient in float64: the global stiffness assembled densely
    element by element, the fixed dofs removed, SciPy's dense solve, and the analytic SIMP
    sensitivity `-p x^(p-1) (1 - E_min) u_e^T KE u_e`."""
    ke = gauss_element_stiffness()
    x = np.asarray(x, np.float64)
    ndof = 2 * (NELX + 1) * (NELY + 1)
    k = np.zeros((ndof, ndof))
    for e, dofs in enumerate(beam.edofs):
        k[np.ix_(dofs, dofs)] += (E_MIN + x[e] ** PENAL * (1 - E_MIN)) * ke
    free = beam.free
    f = np.zeros(ndof)
    f[1] = -1.0
    u = np.zeros(ndof)
    u[free] = scipy.linalg.solve(k[np.ix_(free, free)], f[free], assume_a="pos")
    ue = u[beam.edofs]
    sensitivity = -PENAL * x ** (PENAL - 1) * (1 - E_MIN) * np.einsum("ei,ij,ej->e", ue, ke, ue)
    return float(f @ u), sensitivity


def test_the_element_stiffness_is_the_quadratures(beam):
    np.testing.assert_allclose(beam.ke, gauss_element_stiffness(), rtol=0, atol=1e-14)
    c, dc = reference(beam, DENSITIES)
    assert c > 0 and (dc < 0).all()  # (stiffer anywhere: less compliance)
    # the sensitivity against central differences of the reference itself
    for e in (0, 17, NELX * NELY - 1):
        h = 1e-5
        plus, minus = DENSITIES.copy(), DENSITIES.copy()
        plus[e] += h
        minus[e] -= h
        fd = (reference(beam, plus)[0] - reference(beam, minus)[0]) / (2 * h)
        assert abs(fd - dc[e]) <= 1e-5 * abs(dc[e])


# ----------------------------------------------------------------------------- value and gradient


def close(got, want, rtol=1e-9):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    assert np.max(np.abs(got - want)) <= rtol * np.max(np.abs(want)), np.max(np.abs(got - want))


HOW = {
    "eager": lambda f: dx.filter_value_and_grad(f),
    "jit": lambda f: jax.jit(dx.filter_value_and_grad(f)),
    "filter_jit": lambda f: eqx.filter_jit(dx.filter_value_and_grad(f)),
}


@pytest.mark.parametrize("how", sorted(HOW))
def test_the_compliance_gradient_is_the_simp_sensitivity(beam, how):
    c, dc = HOW[how](beam.compliance)(jnp.asarray(DENSITIES))
    want_c, want_dc = reference(beam, DENSITIES)
    assert abs(float(c) - want_c) <= 1e-10 * want_c
    close(dc, want_dc)
    np.testing.assert_allclose(np.asarray(dc), want_dc, rtol=1e-7)  # (entry by entry, too)


# ----------------------------------------------------------------------------- solves counted


CALLS: list[tuple[str, bool, int]] = []  # (what, transpose, right-hand sides) for each call of `Counting`


class Counting(dx.AbstractSparseSolver):
    """SciPy's `splu` (the symmetric ordering), recording each factorisation and solve."""

    def factor(self, matrix):
        from scipy.sparse.linalg import splu

        CALLS.append(("factor", False, 0))
        return splu(matrix, permc_spec="MMD_AT_PLUS_A")

    def solve(self, factorisation, rhs, transpose):
        CALLS.append(("solve", transpose, 1 if rhs.ndim == 1 else rhs.shape[1]))
        return factorisation.solve(np.ascontiguousarray(rhs), trans="T" if transpose else "N")


def counted(fn, x):
    """`fn(x)` after one untimed call (compiled), with the solver's calls and deferax's
    recorded steps."""
    fn(x)
    gc.collect()  # (an eager forward's factorisation is kept until its output is collected)
    _factorisations.FACTORISATIONS.clear()
    CALLS.clear()
    with dx.record() as timeline:
        out = jax.block_until_ready(fn(x))
    return out, list(CALLS), timeline.counts(steps=True)


SCHEDULES = {
    "default": lambda f: dx.filter_value_and_grad(f),
    "default+jit": lambda f: jax.jit(dx.filter_value_and_grad(f)),
    "standard": lambda f: dx.filter_value_and_grad(f, schedule="standard"),
    "standard+jit": lambda f: jax.jit(dx.filter_value_and_grad(f, schedule="standard")),
    "jax.grad+jit": lambda f: jax.jit(jax.value_and_grad(f)),
}


def losses(beam, w):
    """Losses of `u = K^-1 f`: self-adjoint ones (their cotangent a multiple of `f`) and others."""

    def solve(x):
        return dx.sparse_solve(beam.values(x), beam.pattern, jnp.asarray(beam.f), solver=Counting())

    def compliance(x):
        return jnp.dot(jnp.asarray(beam.f), solve(x))

    def compliance_squared(x):  # (a multiple of `f` that depends on `u`: a basis of one row, `f`)
        return 0.5 * jnp.dot(jnp.asarray(beam.f), solve(x)) ** 2

    def overlap(x):  # `w . u`, `w` not a multiple of `f`
        return jnp.dot(w, solve(x))

    def energy(x):  # `u . u`: its cotangent `2 u`
        return jnp.sum(solve(x) ** 2)

    return dict(compliance=compliance, compliance_squared=compliance_squared, overlap=overlap, energy=energy)


def plain(beam, w, name, x):
    """The same loss in plain JAX: a dense `jnp.linalg.solve` in place of the site."""
    u = jnp.linalg.solve(beam.pattern.todense(beam.values(x)), jnp.asarray(beam.f))
    f = jnp.asarray(beam.f)
    return {
        "compliance": lambda: jnp.dot(f, u),
        "compliance_squared": lambda: 0.5 * jnp.dot(f, u) ** 2,
        "overlap": lambda: jnp.dot(w, u),
        "energy": lambda: jnp.sum(u**2),
    }[name]()


@pytest.mark.parametrize("how", sorted(SCHEDULES))
@pytest.mark.parametrize("loss", ["compliance", "compliance_squared", "overlap", "energy"])
def test_a_self_adjoint_loss_skips_the_adjoint_solve(beam, how, loss):
    w = jnp.asarray(np.random.default_rng(5).normal(size=beam.pattern.n))
    fn = losses(beam, w)[loss]
    x = jnp.asarray(DENSITIES)
    (value, grad), calls, steps = counted(SCHEDULES[how](fn), x)
    forward = [("factor", False, 0), ("solve", False, 1)]
    if loss.startswith("compliance"):
        assert calls == forward  # the adjoint of a multiple of `f` is that multiple of `u`: no solve
        assert steps == {"factor": 1, "solve": 1}
    else:
        assert calls == [*forward, ("solve", True, 1)]
        assert steps == {"factor": 1, "solve": 2}
    want_value, want_grad = jax.value_and_grad(lambda x: plain(beam, w, loss, x))(x)
    close(value, want_value)
    close(grad, want_grad)


def test_the_schedules_are_the_ones_named(beam):
    """What the default runs in the counts above: the compliance deferred (one job), its
    square deferred-basis (k = 1: a basis cotangent `f`), the energy standard."""
    x = jnp.asarray(DENSITIES)
    fns = losses(beam, jnp.zeros(beam.pattern.n))
    expected = dict(compliance="deferred", compliance_squared="deferred-basis", overlap="deferred", energy="standard")
    for name, schedule in expected.items():
        assert dx.explain(dx.filter_value_and_grad(fns[name]), x).sites[0].schedule == schedule, name


def test_a_non_symmetric_stiffness_solves_its_adjoint(beam):
    """The same pattern, one entry changed (`K != K^T`): the compliance is no longer
    self-adjoint, and its adjoint is solved with `K^T`."""

    k = int(np.flatnonzero(beam.pattern.rows != beam.pattern.cols)[3])  # (an entry off the diagonal)

    def values(x):
        return beam.values(x).at[k].multiply(1.5)

    def loss(x, solve):
        f = jnp.asarray(beam.f)
        return jnp.dot(f, solve(values(x), f))

    x = jnp.asarray(DENSITIES)
    fn = jax.jit(
        dx.filter_value_and_grad(lambda x: loss(x, lambda v, f: dx.sparse_solve(v, beam.pattern, f, solver=Counting())))
    )
    got, calls, _ = counted(fn, x)
    assert calls == [("factor", False, 0), ("solve", False, 1), ("solve", True, 1)]
    want = jax.value_and_grad(lambda x: loss(x, lambda v, f: jnp.linalg.solve(beam.pattern.todense(v), f)))(x)
    close(got[0], want[0])
    close(got[1], want[1])
