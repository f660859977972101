"""Several backward passes of one forward pass (`jax.jacrev`, a `jax.vjp` function called
several times) share `dx.sparse_solve`'s one factorisation, counted through the solver
hook, and leave nothing kept behind; derivatives of derivatives through a host site raise
an error that names the site and says what is supported."""

import gc
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx
from deferax._host import _sparse_solve


@pytest.fixture(autouse=True)
def no_factorisations_kept():
    _sparse_solve.FACTORISATIONS._entries.clear()
    yield
    _sparse_solve.FACTORISATIONS._entries.clear()


class Tally:
    def __init__(self):
        self.factor = 0
        self.lock = threading.Lock()


class CountingSolver(dx.AbstractSparseSolver):
    """SuperLU, counting its factorisations."""

    tally: Tally = eqx.field(static=True)

    def factor(self, matrix):
        with self.tally.lock:
            self.tally.factor += 1
        return dx.SuperLU().factor(matrix)

    def solve(self, factorisation, rhs, transpose):
        return dx.SuperLU().solve(factorisation, rhs, transpose)


N = 8


def system():
    """A dense, well conditioned, non-symmetric `N x N` system as a sparse pattern."""
    rng = np.random.default_rng(0)
    a = rng.normal(size=(N, N)) + N * np.eye(N)
    rows, cols = np.nonzero(a)
    pattern = dx.SparsePattern(rows, cols, N)
    return jnp.asarray(a[rows, cols]), pattern, jnp.asarray(rng.normal(size=N))


VALUES, PATTERN, B = system()


def sparse(tally):
    return lambda v, b: dx.sparse_solve(v, PATTERN, b, solver=CountingSolver(tally))


def dense(v, b):
    return jnp.linalg.solve(PATTERN.todense(v), b)


def kept() -> int:
    gc.collect()
    return len(_sparse_solve.FACTORISATIONS)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jacrev_factors_once_and_keeps_nothing(jit):
    """`jax.jacrev` runs one forward pass and `N` backward passes (its backward pass
    vmapped): one factorisation for all, every time, released once the Jacobian is made."""
    tally = Tally()
    jac = jax.jacrev(sparse(tally), argnums=(0, 1))
    jac = jax.jit(jac) if jit else jac
    want = jax.jacrev(dense, argnums=(0, 1))(VALUES, B)
    for _ in range(4):
        tally.factor = 0
        got = jax.block_until_ready(jac(VALUES, B))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12)
        assert tally.factor == 1
        assert kept() == 0


def test_a_vjp_function_called_several_times_factors_once():
    """The factorisation stays while the `jax.vjp` function (its residual, the forward's
    output) is alive, and is released when it is garbage collected."""
    tally = Tally()
    x, vjp = jax.vjp(sparse(tally), VALUES, B)
    _, vjp_dense = jax.vjp(dense, VALUES, B)
    for i in range(3):
        ct = jnp.eye(N)[i] + 0.5
        got = vjp(ct)
        for g, w in zip(got, vjp_dense(ct), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12)
    assert tally.factor == 1
    assert kept() == 1
    del x, vjp
    assert kept() == 0


def test_a_jitted_vjp_function_called_several_times_is_right():
    """Under `jit`, the forward's factorisation is released by its first backward request;
    a later one factors again (the result stays right, nothing is kept)."""
    tally = Tally()
    _, vjp = jax.jit(lambda v, b: jax.vjp(sparse(tally), v, b))(VALUES, B)
    _, vjp_dense = jax.vjp(dense, VALUES, B)
    for i in range(3):
        ct = jnp.eye(N)[i]
        for g, w in zip(vjp(ct), vjp_dense(ct), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12)
    assert 1 <= tally.factor <= 3
    del vjp
    assert kept() == 0


def test_vmap_over_b_then_jacrev_factors_once():
    """A forward request of several rows on one matrix (`vmap` over `b`) leaves one user
    for its backward passes, not one per row."""
    tally = Tally()
    bs = jnp.stack([B, 2 * B, B + 1])
    jac = jax.jit(jax.jacrev(lambda v: jax.vmap(lambda b: sparse(tally)(v, b))(bs)))
    got = jac(VALUES)
    np.testing.assert_allclose(got, jax.jacrev(lambda v: jax.vmap(lambda b: dense(v, b))(bs))(VALUES), rtol=1e-11)
    assert tally.factor == 1
    assert kept() == 0
