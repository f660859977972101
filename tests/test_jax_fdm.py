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

from .helpers import assert_tree_allclose, hlo_ops


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


@pytest.mark.parametrize("network", [arch, cable_net])
def test_form_finding_gets_plain_jax_value_and_gradient(network, solves):
    """Under `jit` (both networks) and outside it (the arch: op by op, as slow as plain JAX's
    first call there)."""
    loss, params = problem(network())
    dense, _ = problem(network(), sparse=False)
    plan = dx.explain(loss, params)
    assert (plan.sites, plan.fallback) == ((), None)
    # jax_fdm's custom_vjp is listed and left as it is: its backward solves through a callback
    # (SciPy in a `pure_callback`), which may read what its forward wrote
    assert [(r.site, "callback" in (r.reason or "")) for r in plan.recognised] == [(None, True)] * len(plan.recognised)
    assert len(plan.recognised) >= 1, plan
    plain = jax.jit(jax.value_and_grad(loss))
    expected = plain(params)
    # the dense model, differentiated by JAX, agrees (jax_fdm's custom_vjp is right)
    assert_tree_allclose(jax.jit(jax.value_and_grad(dense))(params), expected, rtol=1e-9, atol=1e-11)
    steps = [jax.jit(dx.filter_value_and_grad(loss))] + ([dx.filter_value_and_grad(loss)] if network is arch else [])
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
    """With no site, the jitted step is Equinox's: the same operations, the same callbacks."""
    loss, params = problem(cable_net())
    got = hlo_ops(dx.filter_value_and_grad(loss), params)
    assert got == hlo_ops(lambda p: eqx.filter_value_and_grad(loss)(p), params)
    assert got == hlo_ops(jax.value_and_grad(loss), params)
    assert got["custom_call @xla_ffi_python_cpu_callback"] == 2  # (the two solves' callbacks)
