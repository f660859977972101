"""Tesseract components: a `tesseract_jax.apply_tesseract` call whose Tesseract is declared
pure (`dx.recognise_tesseract`) becomes a `dx.host` site (`apply` the forward, the
`vector_jacobian_product` endpoint the adjoint), so a loss linear in its output is deferred:
one `apply` and one VJP request per gradient, submitted together. The Tesseract is served
from its Python API in this process (no Docker). Values and gradients equal plain JAX's (the
same loss, without deferax) and the analytic function's; an undeclared Tesseract's calls are
left as they are."""

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx

from .helpers import assert_tree_allclose

if sys.version_info < (3, 12):
    pytest.skip("tesseract-jax needs Python >= 3.12: the Tesseract tests are skipped", allow_module_level=True)
pytest.importorskip("tesseract_jax", reason="tesseract-jax is not installed: the Tesseract tests are skipped")
from tesseract_core import Tesseract  # noqa: E402
from tesseract_jax import apply_tesseract  # noqa: E402

from . import _tesseract_sine as api  # noqa: E402

X = jnp.linspace(0.1, 1.0, 5)
W = jnp.arange(1.0, 6.0)
MODE = jnp.linspace(-1.0, 2.0, 5)
SCALE = np.float64(2.0)


@pytest.fixture
def declared():
    return dx.recognise_tesseract(Tesseract.from_tesseract_api(api))


@pytest.fixture
def undeclared():
    return Tesseract.from_tesseract_api(api)


def requests():
    out = dict(api.CALLS)
    api.CALLS.update(dict.fromkeys(api.CALLS, 0))
    return out


def y_of(xw, tesseract):
    x, w = xw
    return apply_tesseract(tesseract, {"x": x, "w": w, "scale": SCALE})["y"]


def linear(tesseract):
    return lambda xw: jnp.vdot(MODE, y_of(xw, tesseract))


def nonlinear(tesseract):
    return lambda xw: jnp.sum(y_of(xw, tesseract) ** 2)


def analytic(kind):
    """The function the Tesseract stands for, in jnp."""

    def y(xw):
        return SCALE * jnp.sin(xw[0]) * xw[1]

    return (lambda xw: jnp.vdot(MODE, y(xw))) if kind == "linear" else (lambda xw: jnp.sum(y(xw) ** 2))


LOSSES = {"linear": linear, "nonlinear": nonlinear}


@pytest.mark.parametrize("kind, schedule", [("linear", "deferred"), ("nonlinear", "standard")])
@pytest.mark.parametrize("jit", [False, True])
def test_declared_tesseract_becomes_a_host_site(declared, kind, schedule, jit):
    loss = LOSSES[kind](declared)
    fn = dx.filter_value_and_grad(loss)
    plan = dx.explain(fn, (X, W))
    (site,) = plan.sites
    assert site.name == "tesseract_jax.apply_tesseract (recognised)" and site.schedule == schedule
    assert plan.recognised[0].site == 0 and plan.recognised[0].reason is None
    fn = jax.jit(fn) if jit else fn
    for _ in range(2):  # (under jit: the compiled program, twice)
        requests()
        with dx.record() as timeline:
            got = fn((X, W))
        assert requests() == {"apply": 1, "vector_jacobian_product": 1, "jacobian_vector_product": 0}
        assert timeline.counts() == {"fwd": 1, "adjoint": 1}
        assert {c.schedule for c in timeline.calls} == {schedule}
    assert_tree_allclose(got, jax.value_and_grad(loss)((X, W)), rtol=1e-12, atol=1e-12)
    assert_tree_allclose(got, jax.value_and_grad(analytic(kind))((X, W)), rtol=1e-12, atol=1e-12)


def test_plain_jax_makes_the_same_requests(undeclared):
    """What the site replaces: plain tesseract-jax also sends one `apply` and one VJP request
    (its JVP transposed), the VJP after the loss is evaluated."""
    requests()
    jax.value_and_grad(linear(undeclared))((X, W))
    assert requests() == {"apply": 1, "vector_jacobian_product": 1, "jacobian_vector_product": 0}


@pytest.mark.parametrize("kind", ["linear", "nonlinear"])
def test_undeclared_tesseract_is_left_as_is(undeclared, kind):
    loss = LOSSES[kind](undeclared)
    fn = dx.filter_value_and_grad(loss)
    plan = dx.explain(fn, (X, W))
    assert plan.sites == ()
    (call,) = plan.recognised
    assert call.call == "tesseract_jax.apply_tesseract" and call.site is None
    assert call.reason.startswith("its Tesseract is not declared pure")
    assert "dx.recognise_tesseract(tesseract)" in str(plan)
    with dx.record() as timeline:
        got = jax.jit(fn)((X, W))
    assert len(timeline) == 0
    assert_tree_allclose(got, jax.value_and_grad(analytic(kind))((X, W)), rtol=1e-12, atol=1e-12)


def test_declaring_one_tesseract_leaves_another_alone(declared, undeclared):
    def loss(xw):
        return linear(declared)(xw) + nonlinear(undeclared)(xw)

    plan = dx.explain(loss, (X, W))
    assert [c.site for c in plan.recognised] == [0, None]
    got = dx.filter_value_and_grad(loss)((X, W))
    want = jax.value_and_grad(lambda xw: analytic("linear")(xw) + analytic("nonlinear")(xw))((X, W))
    assert_tree_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_a_constant_input_is_closed_over(declared):
    """`w` known at trace time: the site's input is `x` alone, and the VJP asks for `x` only."""

    def loss(x):
        return linear(declared)((x, np.asarray(W)))

    fn = dx.filter_value_and_grad(loss)
    assert dx.explain(fn, X).sites[0].in_shapes == "float64[5]"
    got = fn(X)
    assert_tree_allclose(got, jax.value_and_grad(lambda x: analytic("linear")((x, W)))(X), rtol=1e-12, atol=1e-12)


def test_a_traced_non_differentiable_input_is_left_as_is(declared):
    """`scale` is not `Differentiable` in the schema: plain tesseract-jax fails only if a
    gradient reaches it, which a site could not tell, so the call stays."""

    def loss(xs):
        x, scale = xs
        return jnp.vdot(MODE, apply_tesseract(declared, {"x": x, "w": W, "scale": scale})["y"])

    plan = dx.explain(loss, (X, SCALE))
    assert plan.sites == ()
    expected = r"its input `scale` depends on the loss's arguments but is not `Differentiable`"
    assert re.search(expected, plan.recognised[0].reason)


def test_recognise_tesseract_rejects_other_objects():
    expected = (
        r"`dx.recognise_tesseract`: `tesseract` must be a `tesseract_core.Tesseract` "
        r"\(the object passed to `tesseract_jax.apply_tesseract`\), but got 'model'"
    )
    with pytest.raises(TypeError, match=expected):
        dx.recognise_tesseract("model")
