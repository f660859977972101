"""SAX, klujax's main user, as a real client: a circuit's loss passed unchanged to
`dx.filter_value_and_grad` gives plain JAX's value and gradient, and `explain` says why its
solves are left alone (SAX's klu backend factors through klujax's handle-based API, whose
factorisation is hidden state: never recognised).

SAX 0.18 requires jax < 0.10, so these tests run on CI's jax 0.9.2 leg only; elsewhere
they are skipped with the reason printed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx

from .helpers import assert_tree_allclose

sax = pytest.importorskip("sax", reason="sax is not installed (it requires jax < 0.10): its tests are skipped")
klujax = pytest.importorskip("klujax", reason="klujax is not installed: the SAX tests are skipped")


@pytest.fixture(autouse=True)
def standard_promotion():
    """SAX's models mix Python complex scalars with float64 arrays, which the suite's strict
    dtype promotion refuses: these tests run SAX as its users do."""
    with jax.numpy_dtype_promotion("standard"):
        yield


MODELS = {"coupler": sax.models.coupler_ideal, "straight": sax.models.straight}
WL = jnp.linspace(1.51, 1.59, 5)


def mach_zehnder():
    """Two ideal couplers and two arms; the loss is the bar port's power over 5 wavelengths
    as a function of the top arm's length."""
    netlist = {
        "instances": {"lft": "coupler", "top": "straight", "btm": "straight", "rgt": "coupler"},
        "connections": {
            "lft,out0": "btm,in0",
            "btm,out0": "rgt,in0",
            "lft,out1": "top,in0",
            "top,out0": "rgt,in1",
        },
        "ports": {"in0": "lft,in0", "in1": "lft,in1", "out0": "rgt,out0", "out1": "rgt,out1"},
    }
    circuit, _ = sax.circuit(netlist, MODELS, backend="klu")

    def loss(length):
        s = circuit(wl=WL, top={"length": length}, btm={"length": 10.0})
        return jnp.sum(jnp.abs(s["in0", "out0"]) ** 2)

    return loss, jnp.asarray(25.0)


def ring_chain(n_rings):
    """`n_rings` all-pass ring resonators in a row (a coupler and a lossy ring waveguide
    each: 6 ports a ring, so `6 * n_rings` unknowns in SAX's sparse system); the loss is the
    through port's power over 5 wavelengths as a function of every ring's length."""
    instances, connections = {}, {}
    for i in range(n_rings):
        instances[f"c{i}"] = "coupler"
        instances[f"r{i}"] = "straight"
        connections[f"c{i},out1"] = f"r{i},in0"
        connections[f"r{i},out0"] = f"c{i},in1"
        if i + 1 < n_rings:
            connections[f"c{i},out0"] = f"c{i + 1},in0"
    netlist = {
        "instances": instances,
        "connections": connections,
        "ports": {"in0": "c0,in0", "out0": f"c{n_rings - 1},out0"},
    }
    circuit, _ = sax.circuit(netlist, MODELS, backend="klu")

    def loss(lengths):
        settings = {f"r{i}": {"length": lengths[i], "loss_dB_cm": 3.0} for i in range(n_rings)}
        s = circuit(wl=WL, **settings)
        return jnp.sum(jnp.abs(s["in0", "out0"]) ** 2)

    lengths = jnp.asarray(40.0 + np.random.default_rng(0).uniform(-0.5, 0.5, n_rings))
    return loss, lengths


@pytest.fixture(scope="module")
def circuits():
    """Each circuit built once (SAX analyses a netlist when it builds the circuit)."""
    with jax.numpy_dtype_promotion("standard"):
        return {"mach_zehnder": mach_zehnder(), "ring_chain": ring_chain(50)}


@pytest.mark.parametrize(
    "name, jit",
    [("mach_zehnder", False), ("mach_zehnder", True), ("ring_chain", True)],
    ids=["mach_zehnder-eager", "mach_zehnder-jit", "ring_chain-jit"],
)
def test_an_unchanged_sax_loss_gives_plain_jax_value_and_gradient(circuits, name, jit):
    """(The ring chain runs jitted only: SAX evaluates each of its 100 instances op by op
    when eager, a minute on CI's machines, and the eager path is the Mach-Zehnder's.)"""
    loss, x = circuits[name]
    plain, ours, grad = jax.value_and_grad(loss), dx.filter_value_and_grad(loss), dx.filter_grad(loss)
    if jit:
        plain, ours, grad = jax.jit(plain), jax.jit(ours), jax.jit(grad)
    want, got = plain(x), ours(x)
    assert bool(jnp.all(jnp.isfinite(want[1]))) and float(jnp.max(jnp.abs(want[1]))) > 1e-6  # a real gradient
    assert_tree_allclose(got, want, rtol=1e-10, atol=1e-10)
    if name == "mach_zehnder":
        assert_tree_allclose(grad(x), want[1], rtol=1e-10, atol=1e-10)


def handle_based_solves(jaxpr):
    """The output shapes of klujax's handle-based solves in `jaxpr` and the programs nested in it."""
    found = []
    for eqn in jaxpr.eqns:
        if "with_symbol" in eqn.primitive.name:
            found.append(eqn.outvars[0].aval.shape)
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += handle_based_solves(inner)
    return found


def test_the_ring_chain_is_a_few_hundred_unknowns(circuits):
    """The ring chain's system is large enough for the solve to matter: SAX's klu backend
    solves for every instance port, 6 per ring."""
    loss, x = circuits["ring_chain"]
    shapes = handle_based_solves(jax.make_jaxpr(loss)(x).jaxpr)
    assert shapes and all(300 in shape for shape in shapes), shapes


@pytest.mark.parametrize("recognise", [True, "always"])
@pytest.mark.parametrize("name", ["mach_zehnder", "ring_chain"])
def test_explain_says_the_handle_based_solve_is_left_alone(circuits, name, recognise):
    loss, x = circuits[name]
    plan = dx.explain(dx.filter_value_and_grad(loss, recognise=recognise), x)
    assert plan.sites == ()
    assert plan.recognised, "SAX's solve is not listed among the calls looked at"
    for call in plan.recognised:
        assert call.site is None
        assert call.call.startswith("klujax.solve_with_symbol")
        assert "handle-based" in call.reason and "hidden state" in call.reason and "never recognised" in call.reason
    text = " ".join(str(plan).split())  # explain wraps its lines
    assert "klujax.solve_with_symbol" in text and "not recognised: klujax's handle-based API" in text
