"""A real third-party program: jax_fdm's form finding (the force density method for cable nets
and shells), unchanged, in a loss. Its sparse solve is SciPy's `spsolve` in a `pure_callback`
inside a `jax.custom_vjp` whose backward pass solves once more: a loss with no site. Through
deferax it gets plain JAX's value and gradient, runs the solves plain JAX runs, and compiles to
the program Equinox compiles."""

import collections

import equinox as eqx
import jax
import jax.numpy as jnp
import jax_fdm.equilibrium.sparse  # in the tests extra
import numpy as np
import pytest
from jax_fdm.datastructures import FDNetwork
from jax_fdm.equilibrium import (
    EquilibriumModel,
    EquilibriumModelSparse,
    EquilibriumParametersState,
    EquilibriumStructure,
    EquilibriumStructureSparse,
)

import deferax as dx

from .helpers import assert_tree_allclose, hlo_ops, tree_allclose


@pytest.fixture(scope="module", autouse=True)
def standard_promotion():
    """jax_fdm is written for JAX's default dtype promotion (the other tests run strict)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def arch(segments: int = 10):
    """jax_fdm's arch example: a 5 m line of `segments` edges, anchored at both ends, every
    edge at force density -1 (compression), a point load of -0.2 on each free node."""
    xs = [-2.5 + 5.0 * i / segments for i in range(segments + 1)]
    network = FDNetwork.from_nodes_and_edges([[x, 0.0, 0.0] for x in xs], [(i, i + 1) for i in range(segments)])
    network.node_anchor(key=0)
    network.node_anchor(key=segments)
    network.edges_forcedensities(-1.0, keys=network.edges())
    network.nodes_loads([0.0, 0.0, -0.2], keys=network.nodes_free())
    return network


def cable_net(n: int = 6):
    """A square `n x n` grid of cables anchored on its boundary, force density 1, a load of
    -0.1 on each free node."""
    key = lambda i, j: i * n + j  # noqa: E731
    nodes = [[float(i), float(j), 0.0] for i in range(n) for j in range(n)]
    edges = [(key(i, j), key(i + 1, j)) for i in range(n - 1) for j in range(n)]
    edges += [(key(i, j), key(i, j + 1)) for i in range(n) for j in range(n - 1)]
    network = FDNetwork.from_nodes_and_edges(nodes, edges)
    for i in range(n):
        for j in range(n):
            if i in (0, n - 1) or j in (0, n - 1):
                network.node_anchor(key=key(i, j))
    network.edges_forcedensities(1.0, keys=network.edges())
    network.nodes_loads([0.0, 0.0, -0.1], keys=network.nodes_free())
    return network


def problem(network, sparse: bool = True):
    """`(loss, params)`: how far the form found is from a target height (a shallow dome on
    the network's footprint), plus its load path, as a function of jax_fdm's parameters
    (force densities, supports, node loads: `params`, a dict of arrays); the sparse model (the
    SciPy solve) or the dense one (`jnp.linalg.solve`, differentiated by JAX: the independent
    reference)."""
    model = (EquilibriumModelSparse if sparse else EquilibriumModel)(tmax=1)
    structure = (EquilibriumStructureSparse if sparse else EquilibriumStructure).from_network(network)
    state = EquilibriumParametersState.from_datastructure(network, dtype=jnp.float64)
    params = {"q": state.q, "xyz_fixed": state.xyz_fixed, "loads": state.loads.nodes}
    xy = state.xyz_fixed.mean(axis=0)[:2]

    def loss(params):
        loads = state.loads._replace(nodes=params["loads"])  # (edge and face loads: 0.0, as jax_fdm keeps them)
        state_ = model(EquilibriumParametersState(params["q"], params["xyz_fixed"], loads), structure)
        target = 1.0 - 0.1 * jnp.sum((state_.xyz[:, :2] - xy) ** 2, axis=1)
        return jnp.sum((state_.xyz[:, 2] - target) ** 2) + 1e-2 * jnp.sum(jnp.abs(state_.forces * state_.lengths))

    return loss, params


@pytest.fixture
def solves(monkeypatch):
    """How often SciPy's `spsolve` really runs inside jax_fdm's callback."""
    runs = collections.Counter()
    scipy_spsolve = jax_fdm.equilibrium.sparse.spsolve_scipy

    def counted(*args, **kwargs):
        runs["spsolve"] += 1
        return scipy_spsolve(*args, **kwargs)

    monkeypatch.setattr(jax_fdm.equilibrium.sparse, "spsolve_scipy", counted)
    return runs


def factorisations(step, params):
    """`(result, factorisations)` of one call of `step` (deferax's, by its timeline)."""
    with dx.record() as timeline:
        got = jax.block_until_ready(step(params))
    return got, timeline.counts(steps=True).get("factor", 0)


@pytest.mark.parametrize("network", [arch, cable_net])
def test_form_finding_as_it_is_gets_plain_jax_value_and_gradient(network, solves):
    """With `recognise=False`, jax_fdm's custom_vjp is left as it is: plain JAX's program, its
    two SciPy solves a step. Under `jit` (both networks) and outside it (the arch: op by op,
    as slow as plain JAX's first call there)."""
    loss, params = problem(network())
    dense, _ = problem(network(), sparse=False)
    plan = dx.explain(dx.filter_value_and_grad(loss, recognise=False), params)
    assert (plan.sites, plan.fallback) == ((), None)
    plain = jax.jit(jax.value_and_grad(loss))
    expected = plain(params)
    # the dense model, differentiated by JAX, agrees (jax_fdm's custom_vjp is right)
    assert_tree_allclose(jax.jit(jax.value_and_grad(dense))(params), expected, rtol=1e-9, atol=1e-11)
    fn = dx.filter_value_and_grad(loss, recognise=False)
    steps = [jax.jit(fn)] + ([fn] if network is arch else [])
    for step in steps:
        for _ in range(2):
            solves.clear()
            got = jax.block_until_ready(step(params))
            assert solves == {"spsolve": 2}  # the forward solve and the adjoint's, as plain JAX
            assert_tree_allclose(got, expected, rtol=1e-12, atol=1e-12)
    solves.clear()
    jax.block_until_ready(plain(params))
    assert solves == {"spsolve": 2}


def test_form_finding_compiles_to_equinox_s_program():
    """With no site (`recognise=False`), the jitted step is Equinox's: the same operations, the
    same callbacks."""
    loss, params = problem(cable_net())
    got = hlo_ops(dx.filter_value_and_grad(loss, recognise=False), params)
    assert got == hlo_ops(lambda p: eqx.filter_value_and_grad(loss)(p), params)
    assert got == hlo_ops(jax.value_and_grad(loss), params)
    assert got["custom_call @xla_ffi_python_cpu_callback"] == 2  # (the two solves' callbacks)


# ----------------------------------------------------------------------------- recognised: one factorisation


def affine(network):
    """`(loss, params)`: a loss affine in the form found (a weighted sum of the heights)."""
    model = EquilibriumModelSparse(tmax=1)
    structure = EquilibriumStructureSparse.from_network(network)
    state = EquilibriumParametersState.from_datastructure(network, dtype=jnp.float64)
    weights = jnp.linspace(0.5, 1.5, len(list(network.nodes())))

    def loss(q):
        return jnp.sum(weights * model(state._replace(q=q), structure).xyz[:, 2])

    return loss, state.q


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("network", [arch, cable_net])
def test_form_finding_is_recognised_with_one_factorisation_a_gradient(network, jit, solves):
    """Unchanged, jax_fdm's `sparse_solve` (matched by its backward rule) becomes a
    `dx.sparse_solve` site: its three columns one job on one factorisation, where plain JAX
    runs SciPy's `spsolve` twice (two factorisations); plain JAX's value and gradient, and the
    dense model's, differentiated by JAX."""
    loss, params = problem(network())
    dense, _ = problem(network(), sparse=False)
    step = dx.filter_value_and_grad(loss, recognise="always")  # (these nets are small: see the next test)
    plan = dx.explain(step, params)
    (site,) = plan.sites
    assert site.name == "custom_vjp `sparse_solve` (recognised)"
    assert [(r.site, r.reason) for r in plan.recognised] == [(0, None)]
    assert plan.fallback is None
    expected = jax.jit(jax.value_and_grad(loss))(params)
    assert_tree_allclose(jax.jit(jax.value_and_grad(dense))(params), expected, rtol=1e-9, atol=1e-11)
    step = jax.jit(step) if jit else step
    for _ in range(3):
        solves.clear()
        got, factored = factorisations(step, params)
        assert (solves, factored) == ({}, 1)  # (jax_fdm's SciPy callback never runs)
        assert_tree_allclose(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_affine_form_finding_loss_is_deferred(jit, solves):
    """A loss affine in the form found: the forward and the adjoint in one job, one
    factorisation, plain JAX's value and gradient (and the dense model's)."""
    loss, q = affine(cable_net())
    step = dx.filter_value_and_grad(loss, recognise="always")
    assert [s.schedule for s in dx.explain(step, q).sites] == ["deferred"]
    expected = jax.value_and_grad(loss)(q)
    dense = EquilibriumModel(tmax=1)
    structure = EquilibriumStructure.from_network(cable_net())
    state = EquilibriumParametersState.from_datastructure(cable_net(), dtype=jnp.float64)
    weights = jnp.linspace(0.5, 1.5, 36)
    reference = jax.value_and_grad(lambda q: jnp.sum(weights * dense(state._replace(q=q), structure).xyz[:, 2]))
    assert_tree_allclose(reference(q), expected, rtol=1e-9, atol=1e-11)
    step = jax.jit(step) if jit else step
    for _ in range(3):
        solves.clear()
        got, factored = factorisations(step, q)
        assert (solves, factored) == ({}, 1)
        assert_tree_allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_by_default_a_small_net_is_left_in_place_by_cost_and_a_large_one_is_rewritten(monkeypatch):
    """The rewrite saves a factorisation and costs a site's stages: where one factorisation
    takes less than those (the small nets here), the call is left as it is, and `explain` says
    so; where it takes more, it is rewritten. (The factorisation time is set, not measured: a
    loaded machine measures more.)"""
    from deferax._recognise import _cost as recognise_cost

    loss, params = problem(cable_net())
    for seconds, rewritten in ((1e-5, False), (0.05, True)):
        monkeypatch.setattr(recognise_cost, "trial_seconds", lambda pattern, complex_, s=seconds: s)
        plan = dx.explain(loss, params)
        ((site, reason),) = [(r.site, r.reason) for r in plan.recognised]
        assert (site is not None, len(plan.sites)) == (rewritten, int(rewritten))
        assert rewritten or reason.startswith("left in place by cost: one factorisation takes about 0.01 ms here")


def csc(dense):
    """`(data, indices, indptr)` of a dense matrix's nonzero entries, column by column."""
    import scipy.sparse

    m = scipy.sparse.csc_matrix(np.asarray(dense))
    return jnp.asarray(m.data), m.indices, m.indptr


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_nonsymmetric_matrix_keeps_jax_fdm_s_own_gradient(jit):
    """jax_fdm's backward takes `A` as symmetric (it solves with `A`, not `A^T`): for a matrix
    that is not, its gradient is not the true one, and the rewritten call gives jax_fdm's,
    not the true one (which the test tells apart)."""
    from jax.experimental.sparse import CSC

    a = np.array([[4.0, 1.0, 0.0], [2.0, 5.0, 1.0], [0.0, 3.0, 6.0]])
    data, indices, indptr = csc(a)
    b = jnp.array([[1.0, 0.5, 0.0], [2.0, -1.0, 1.0], [0.5, 0.0, 2.0]])
    w = jnp.array([[1.0, -2.0, 0.5], [0.3, 1.0, 1.0], [2.0, 0.0, -1.0]])

    def loss(data, b):
        x = jax_fdm.equilibrium.sparse.sparse_solve(CSC((data, indices, indptr), shape=(3, 3)), b)
        return jnp.sum(w * x) + jnp.sum(x**2)

    def true(data, b):
        dense = jnp.zeros((3, 3)).at[indices, np.repeat(np.arange(3), np.diff(indptr))].add(data)
        x = jnp.linalg.solve(dense, b)
        return jnp.sum(w * x) + jnp.sum(x**2)

    fn = dx.filter_value_and_grad(loss, recognise="always")
    assert dx.explain(fn, data, b).recognised[0].site == 0
    expected = jax.value_and_grad(loss, argnums=(0, 1))(data, b)
    wrong = jax.value_and_grad(true, argnums=(0, 1))(data, b)
    assert not tree_allclose(expected[1], wrong[1], rtol=1e-3)  # (the matrix is far from symmetric)
    assert_tree_allclose(expected[0], wrong[0], rtol=1e-12)
    fn = dx.filter_value_and_grad(lambda x: loss(*x), recognise="always")
    got = (jax.jit(fn) if jit else fn)((data, b))
    assert_tree_allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_a_singular_matrix_gives_nan_with_scipy_s_warning_as_jax_fdm_does():
    """SciPy's `spsolve` warns "Matrix is exactly singular" and returns NaN; the rewritten
    call gives NaN for the value and every gradient, with a `MatrixRankWarning`, and no error."""
    from jax.experimental.sparse import CSC
    from scipy.sparse.linalg import MatrixRankWarning

    a = np.array([[1.0, 2.0, 0.0], [2.0, 4.0, 0.0], [0.0, 0.0, 1.0]])  # (rows 0 and 1 alike)
    data, indices, indptr = csc(a)
    b = jnp.ones((3, 3))

    def loss(data):
        return jnp.sum(jax_fdm.equilibrium.sparse.sparse_solve(CSC((data, indices, indptr), shape=(3, 3)), b))

    for fn in (jax.value_and_grad(loss), dx.filter_value_and_grad(loss, recognise="always")):
        with pytest.warns(MatrixRankWarning):
            value, grad = jax.block_until_ready(fn(data))
        assert bool(jnp.isnan(value)) and bool(jnp.all(jnp.isnan(grad)))
