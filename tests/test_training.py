"""Training with optax: `dx.trainable` keeps an `ExpensiveFn`'s configuration arrays out of
the optimizer, and a jitted adamw step on the deferred schedule matches the same step in
plain JAX."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import deferax as dx

from .helpers import Counter, assert_tree_allclose

L = jnp.asarray(np.diag(np.full(5, 3.0)) + np.diag(np.full(4, -1.0), 1) + np.diag(np.full(4, -1.0), -1))
SOURCE = jnp.linspace(0.5, 1.5, 5)


class Solve(eqx.Module):
    laplacian: jax.Array
    source: jax.Array
    counter: Counter = eqx.field(static=True)

    def __call__(self, k):
        self.counter.tick("fwd")
        return jnp.linalg.solve(self.laplacian + jnp.diag(k), self.source)


class Adjoint(eqx.Module):
    laplacian: jax.Array
    counter: Counter = eqx.field(static=True)

    def __call__(self, k, ct):
        self.counter.tick("adjoint")
        return jnp.linalg.solve((self.laplacian + jnp.diag(k)).T, ct)


def plain_solve(k):
    return jnp.linalg.solve(L + jnp.diag(k), SOURCE)


class Model(eqx.Module):
    linear: eqx.nn.Linear
    solver: dx.ExpensiveFn

    def __call__(self, z):
        return self.solver(jax.nn.softplus(self.linear(z)))


class Plain(eqx.Module):  # the same model with the plain function in place of the ExpensiveFn
    linear: eqx.nn.Linear

    def __call__(self, z):
        return plain_solve(jax.nn.softplus(self.linear(z)))


W = jnp.array([1.0, -1.0, 2.0, 0.5, -0.5])
ZS = jax.random.normal(jax.random.key(1), (4, 3))


def loss(model, zs):
    return jnp.mean(jax.vmap(model)(zs) @ W)  # linear in the solver's output: deferred


def make(counter):
    solver = dx.ExpensiveFn(
        fwd=Solve(L, SOURCE, counter), adjoint=Adjoint(L, counter), combine=lambda k, u, lam: -u * lam, name="rod"
    )
    return Model(eqx.nn.Linear(3, 5, key=jax.random.key(0)), solver)


def test_trainable_marks_the_arrays_a_model_learns():
    model = make(Counter())
    spec = dx.trainable(model)
    assert spec.linear.weight is True and spec.linear.bias is True
    # laplacian and source (fwd), laplacian (adjoint), the combine function: none is a parameter
    assert jax.tree_util.tree_leaves(spec.solver) == [False] * 4
    mixed = {"w": jnp.ones(2), "i": jnp.arange(3), "n": 3, "c": jnp.ones(2, jnp.complex64)}
    assert dx.trainable(mixed) == {"w": True, "i": False, "n": False, "c": True}


def test_adamw_moves_the_configuration_without_trainable_and_not_with_it():
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 counts
        adamw_steps()


def adamw_steps():
    counter = Counter()
    model = make(counter)
    optimizer = optax.adamw(1e-2, weight_decay=0.1)

    # naive: every floating-point array is a parameter; the configuration's gradient is zero ...
    naive = eqx.filter(model, eqx.is_inexact_array)
    grads = dx.filter_grad(loss)(model, ZS)
    assert float(jnp.max(jnp.abs(grads.solver.fwd.source))) == 0.0
    state = optimizer.init(naive)
    for _ in range(3):
        updates, state = optimizer.update(grads, state, naive)
        naive = eqx.apply_updates(naive, updates)
    assert float(jnp.max(jnp.abs(naive.solver.fwd.source - SOURCE))) > 1e-4  # ... yet weight decay shrinks it

    # with dx.trainable: the configuration is not the optimizer's, and a step matches plain JAX
    params, static = eqx.partition(model, dx.trainable(model))
    plain_params = Plain(model.linear)
    state, plain_state = optimizer.init(params), optimizer.init(plain_params)

    @eqx.filter_jit
    def step(params, state):
        value, grads = dx.filter_value_and_grad(lambda p: loss(eqx.combine(p, static), ZS))(params)
        updates, state = optimizer.update(grads, state, params)
        return eqx.apply_updates(params, updates), state, value

    @eqx.filter_jit
    def plain_step(params, state):
        value, grads = eqx.filter_value_and_grad(lambda p: loss(p, ZS))(params)
        updates, state = optimizer.update(grads, state, params)
        return eqx.apply_updates(params, updates), state, value

    for _ in range(3):
        counter.reset()
        params, state, value = step(params, state)
        jax.effects_barrier()
        assert counter.counts == {"fwd": 1, "adjoint": 1}  # the batch of 4: one forward, one adjoint
        plain_params, plain_state, plain_value = plain_step(plain_params, plain_state)
        np.testing.assert_allclose(value, plain_value, rtol=1e-10)
    assert_tree_allclose(params.linear, plain_params.linear, rtol=1e-9, atol=1e-12)
    trained = eqx.combine(params, static)
    assert jnp.array_equal(trained.solver.fwd.source, SOURCE) and jnp.array_equal(trained.solver.adjoint.laplacian, L)
    assert float(jnp.max(jnp.abs(params.linear.weight - model.linear.weight))) > 1e-3
