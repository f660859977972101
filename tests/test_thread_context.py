"""The caller's switches (typechecking, JAX configuration set by a context manager) hold in
every thread deferax runs work on: the threads of several sites and of a `dx.fuse`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import deferax as dx

from .helpers import P0, W, assert_tree_allclose

# --------------------------------------------------------------------------- the caller's switches hold in every thread


def test_typechecking_off_holds_in_the_threads_of_several_sites():
    from jaxtyping import Array, Float

    def fused(x: Float[Array, " 4"], ct: Float[Array, " 4"]):
        return jnp.sin(x), ct * jnp.cos(x)

    fs = [dx.ExpensiveFn(fwd=jnp.sin, fused=fused, name=f"typed{i}") for i in range(3)]

    def loss(p):
        return sum(jnp.sum(f(p * (i + 1))) for i, f in enumerate(fs))

    reference = lambda p: sum(jnp.sum(jnp.sin(p * (i + 1))) for i in range(3))  # noqa: E731
    p = P0[:3]  # the annotation says 4: refused when checked
    with dx.typechecking(False):
        assert_tree_allclose(dx.filter_value_and_grad(loss)(p), eqx.filter_value_and_grad(reference)(p))
    with pytest.raises(dx.AnnotationError):
        dx.filter_value_and_grad(loss)(p)


def test_jax_config_context_holds_in_the_threads_of_several_sites():
    promotions = []

    def fused(x, ct):
        promotions.append(jax.config.jax_numpy_dtype_promotion)
        return jnp.sin(x), ct * jnp.cos(x)

    fs = [dx.ExpensiveFn(fwd=jnp.sin, fused=fused, name=f"s{i}") for i in range(3)]
    loss = lambda p: sum(jnp.sum(f(p * (i + 1))) for i, f in enumerate(fs))  # noqa: E731
    reference = lambda p: sum(jnp.sum(jnp.sin(p * (i + 1))) for i in range(3))  # noqa: E731
    with jax.numpy_dtype_promotion("standard"):
        got = dx.filter_value_and_grad(loss)(P0)
    assert promotions == ["standard"] * 3  # each site's `fused` once, on the pool's threads
    assert_tree_allclose(got, jax.value_and_grad(reference)(P0))


def test_jax_config_context_holds_in_the_threads_of_fuse():
    """`dx.fuse` runs its two halves on threads: they see the caller's dtype promotion."""
    seen = []

    def fwd(x):
        seen.append(jax.config.jax_numpy_dtype_promotion)
        return jnp.sin(x)

    def adjoint(x, ct):
        seen.append(jax.config.jax_numpy_dtype_promotion)
        return ct * jnp.cos(x)

    f = dx.ExpensiveFn(fwd=jnp.sin, fused=dx.fuse(fwd, adjoint), name="fused")
    with jax.numpy_dtype_promotion("standard"):
        got = dx.filter_value_and_grad(lambda p: jnp.sum(W * f(p)))(P0)
    assert seen == ["standard", "standard"]  # traced once each, on the pool's threads
    assert_tree_allclose(got, eqx.filter_value_and_grad(lambda p: jnp.sum(W * jnp.sin(p)))(P0))
