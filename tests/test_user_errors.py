"""Mistakes users make, and what deferax says: explaining a jitted step, a layer whose
configuration disagrees with its input, saving and loading a model that holds an
`ExpensiveFn`."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

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
