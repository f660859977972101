"""Mistakes users make, and what deferax says: explaining a jitted step, a layer whose
configuration disagrees with its input, saving and loading a model that holds an
`ExpensiveFn`."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import deferax as dx

from .helpers import assert_tree_allclose


def match(text):
    return re.escape(text)


class Scale(eqx.Module):
    """A 'solver' configured for inputs of one size."""

    weights: jax.Array

    def __call__(self, x):
        return self.weights * x


def sin_fn():
    return dx.ExpensiveFn(fwd=jnp.sin, bwd=lambda x, y, ct: ct * jnp.cos(x), name="sin")


# ----------------------------------------------------------------------------- `dx.explain` of a jitted step


def test_explain_sees_through_jit():
    """`dx.explain(jax.jit(dx.filter_value_and_grad(loss)), x)`, as written after the
    inverse-design tutorial, explains the wrapped function: with its own settings."""
    f = sin_fn()

    def loss(x):
        return jnp.sum(jnp.cos(x) * f(x))

    x = jnp.arange(3.0)
    for schedule, expected in (("auto", "deferred"), ("standard", "standard")):
        step = dx.filter_value_and_grad(loss, schedule=schedule)
        want = str(dx.explain(step, x))
        assert f"schedule={schedule!r}" in want
        for wrapped in (
            jax.jit(step),
            eqx.filter_jit(step),
            jax.jit(eqx.filter_jit(step)),
            eqx.filter_jit(dx.filter_grad(loss, schedule=schedule)),
            jax.jit(dx.filter_grad(loss, schedule=schedule)),
        ):
            plan = dx.explain(wrapped, x)
            assert str(plan) == want
            assert [site.schedule for site in plan.sites] == [expected]
    # a jitted loss is the loss
    assert str(dx.explain(jax.jit(loss), x)) == str(dx.explain(loss, x))
    assert str(dx.explain(eqx.filter_jit(loss), x)) == str(dx.explain(loss, x))


def test_explain_sees_through_jit_with_aux():
    f = sin_fn()

    def loss(x):
        y = f(x)
        return jnp.sum(jnp.cos(x) * y), y

    step = dx.filter_value_and_grad(loss, has_aux=True)
    x = jnp.arange(3.0)
    assert str(dx.explain(jax.jit(step), x)) == str(dx.explain(step, x))
    assert dx.explain(eqx.filter_jit(step), x).sites[0].schedule == "deferred"


def test_explain_of_a_function_returning_gradients_says_what_to_pass():
    """A function that is neither the loss nor a deferax wrapper (one that calls the
    jitted step, a `vmap` of it) returns `(value, grads)`: the message says what to pass."""
    f = sin_fn()
    step = jax.jit(dx.filter_value_and_grad(lambda x: jnp.sum(f(x))))
    text = (
        "`deferax.explain`: `fun` returned (float64[], float64[3]), where a real scalar (a loss) was expected. Pass "
        "the loss function itself, or the function made from it by `dx.filter_value_and_grad` or `dx.filter_grad` "
        "(also under `jax.jit` or `eqx.filter_jit`), with the loss's arguments:\n\n"
        "    dx.explain(loss, x)                                # or\n"
        "    dx.explain(jax.jit(dx.filter_value_and_grad(loss)), x)"
    )
    with pytest.raises(TypeError, match=match(text)):
        dx.explain(lambda x: step(x), jnp.arange(3.0))
    batched = "`deferax.explain`: `fun` returned (float64[2], float64[2, 3]), where a real scalar"
    with pytest.raises(TypeError, match=match(batched)):
        dx.explain(jax.vmap(step), jnp.ones((2, 3)))


def test_value_and_grad_of_a_pair_without_has_aux():
    """A loss returning a pair without `has_aux=True`: the message, not a raw JAX error."""
    f = sin_fn()
    step = dx.filter_value_and_grad(lambda x: (jnp.sum(f(x)), x))
    text = (
        "`deferax.filter_value_and_grad`: the differentiated function must return a real scalar, but it returned "
        "(float64[], float64[3]). Return one number (`jnp.sum(...)`, say), or `(value, aux)` with `has_aux=True`."
    )
    with pytest.raises(TypeError, match=match(text)):
        step(jnp.arange(3.0))


# ----------------------------------------------------------------------------- a layer that does not fit its input


def test_failing_trace_is_shown_first():
    """A solver built for n = 6 fed 8 numbers: the broadcasting error itself, naming the
    site, not a request to declare `out=`."""
    f = dx.ExpensiveFn(fwd=Scale(jnp.ones(6)), bwd=lambda x, y, ct: ct, name="solver")
    x = jnp.ones(8)
    error = "mul got incompatible shapes for broadcasting: (6,), (8,)"
    note = (
        "`ExpensiveFn(name='solver')`: raised by `fwd`, traced (with `jax.eval_shape`) on the input float64[8] to "
        "infer the output's shape. Check that its configuration (the sizes of the arrays it holds) fits this input."
    )
    calls = {
        "filter_value_and_grad": dx.filter_value_and_grad(lambda x: jnp.sum(f(x))),
        "filter_jit": eqx.filter_jit(lambda x: f(x)),
        "grad": jax.grad(lambda x: jnp.sum(f(x))),
        "explain": lambda x: dx.explain(lambda x: jnp.sum(f(x)), x),
    }
    for call in calls.values():
        with pytest.raises(TypeError, match="^" + match(error)) as info:
            call(x)
        assert "out=" not in str(info.value)
        assert getattr(info.value, "__notes__", []).count(note) == 1, info.value.__notes__
    # the right input works
    assert_tree_allclose(calls["grad"](jnp.ones(6)), jnp.ones(6))


def test_failing_trace_of_jvp_is_shown_first():
    f = dx.ExpensiveFn(jvp=lambda x, t: (Scale(jnp.ones(6))(x), t), name="solver")
    with pytest.raises(TypeError, match="^" + match("mul got incompatible shapes")) as info:
        jax.jit(f)(jnp.ones(8))
    assert any("raised by `jvp`, traced (with `jax.eval_shape`)" in n for n in info.value.__notes__)


@pytest.mark.parametrize(
    "fwd, error",
    [
        (lambda x: np.sin(np.asarray(x)), "TracerArrayConversionError"),
        (lambda x: np.zeros(int(x[0])), "ConcretizationTypeError"),
        (lambda x: x * [1.0, 2.0, 3.0][x.shape[0] - 3 + jnp.argmax(x)], "TracerIntegerConversionError"),
    ],
)
def test_untraceable_fwd_still_asks_for_out(fwd, error):
    """A host (NumPy) function that JAX cannot trace: then, and only then, `out=`."""
    f = dx.ExpensiveFn(fwd=fwd, bwd=lambda x, y, ct: ct, name="host")
    text = f"`ExpensiveFn(name='host')`: the output shape is unknown. With nothing to infer it from (`fwd` is not \
JAX-traceable: {error}), declare it with `out=`"
    with pytest.raises(TypeError, match=match(text)):
        jax.jit(f)(jnp.ones(3))


def test_compiled_host_function_rejecting_a_tracer_asks_for_out():
    """A compiled extension that rejects a tracer with a plain `TypeError` (SciPy's `splu`
    solve: "argument 1 must be numpy.ndarray, not DynamicJaxprTracer") cannot be traced either."""
    scipy_sparse = pytest.importorskip("scipy.sparse")
    linalg = pytest.importorskip("scipy.sparse.linalg")
    lu = linalg.splu(scipy_sparse.csc_matrix(np.diag([2.0, 3.0, 4.0])))
    f = dx.ExpensiveFn(fwd=lu.solve, bwd=lambda x, y, ct: ct, name="splu")
    text = "`ExpensiveFn(name='splu')`: the output shape is unknown. With nothing to infer it from (`fwd` is not \
JAX-traceable: TypeError), declare it with `out=`"
    with pytest.raises(TypeError, match=match(text)):
        jax.jit(f)(jnp.ones(3))


# ----------------------------------------------------------------------------- saving and loading


A = np.array([[3.0, 1.0, 0.0, 0.0], [1.0, 4.0, 1.0, 0.0], [0.0, 1.0, 5.0, 1.0], [0.0, 0.0, 1.0, 6.0]])


def solve_fwd(b):
    return np.linalg.solve(A, b)


def solve_adjoint(b, ct):
    return np.linalg.solve(A.T, ct)


def sin_fwd(x):
    return {"s": jnp.sin(x)}


def sin_bwd(x, y, ct):
    return ct["s"] * jnp.cos(x)


def scale_bwd(x, y, ct):
    return ct * jnp.arange(1.0, 5.0)


class Model(eqx.Module):
    linear: eqx.nn.Linear
    solve: dx.ExpensiveFn
    sin: dx.ExpensiveFn
    scale: dx.ExpensiveFn

    def __init__(self, key):
        self.linear = eqx.nn.Linear(3, 4, key=key)
        self.solve = dx.host(solve_fwd, adjoint=solve_adjoint, out=jax.ShapeDtypeStruct((4,), jnp.float64))
        # `out=` as a dict, and no `out=` at all
        self.sin = dx.ExpensiveFn(fwd=sin_fwd, bwd=sin_bwd, out={"s": jax.ShapeDtypeStruct((4,), jnp.float64)})
        self.scale = dx.ExpensiveFn(fwd=Scale(jnp.arange(1.0, 5.0)), bwd=scale_bwd)

    def __call__(self, x):
        return self.scale(self.sin(self.solve(self.linear(x)))["s"])


def reference(model, x):
    """The model in plain JAX: each site replaced by the function it stands for."""
    return jnp.arange(1.0, 5.0) * jnp.sin(jnp.linalg.solve(jnp.asarray(A), model.linear(x)))


def loss(model, x):
    return jnp.sum(model(x) ** 2)


def test_save_and_load_round_trip(tmp_path):
    model = Model(jax.random.key(0))
    x = jnp.array([0.5, -1.0, 2.0])
    path = tmp_path / "model.eqx"
    eqx.tree_serialise_leaves(path, model)
    skeleton = eqx.filter_eval_shape(Model, jax.random.key(1))
    loaded = eqx.tree_deserialise_leaves(path, skeleton)

    arrays = eqx.filter(model, eqx.is_array)
    assert jtu.tree_structure(eqx.filter(loaded, eqx.is_array)) == jtu.tree_structure(arrays)
    assert_tree_allclose(eqx.filter(loaded, eqx.is_array), arrays, rtol=0, atol=0)

    value, grads = dx.filter_value_and_grad(loss)(model, x)
    value_l, grads_l = dx.filter_value_and_grad(loss)(loaded, x)
    assert_tree_allclose(value_l, value)
    assert_tree_allclose(eqx.filter(grads_l, eqx.is_array), eqx.filter(grads, eqx.is_array))
    ref_value, ref_grads = eqx.filter_value_and_grad(lambda m, x: jnp.sum(reference(m, x) ** 2))(model, x)
    assert_tree_allclose(value_l, ref_value)
    assert_tree_allclose(grads_l.linear, ref_grads.linear)


def test_save_and_load_a_bare_host_layer(tmp_path):
    """A `dx.host` layer alone (every one has `out=`), and an `ExpensiveFn` without one."""
    layer = dx.host(np.sin, bwd=lambda x, y, ct: ct * np.cos(x), out=jax.ShapeDtypeStruct((3,), jnp.float64))
    plain = dx.ExpensiveFn(fwd=Scale(jnp.array([1.0, 2.0, 3.0])))
    for fn in (layer, plain):
        path = tmp_path / "fn.eqx"
        eqx.tree_serialise_leaves(path, fn)
        loaded = eqx.tree_deserialise_leaves(path, fn)
        x = jnp.array([0.1, 0.2, 0.3])
        assert_tree_allclose(loaded(x), fn(x))


def test_declared_out_is_static_configuration():
    """`out=` is configuration, not a leaf: a jitted step is traced once for equal models."""
    traces = []

    @eqx.filter_jit
    def step(model, x):
        traces.append(None)
        return loss(model, x)

    x = jnp.array([0.5, -1.0, 2.0])
    step(Model(jax.random.key(0)), x)
    step(Model(jax.random.key(0)), x)
    assert len(traces) == 1
    assert not any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jtu.tree_leaves(Model(jax.random.key(0))))
