"""Several backward passes of one forward pass (`jax.jacrev`, a `jax.vjp` function called
several times) share `dx.sparse_solve`'s one factorisation, counted through the solver
hook, and leave nothing kept behind; derivatives of derivatives through a host site raise
an error that names the site and says what is supported (`dx.sparse_solve` has them:
tests/test_second_order.py)."""

import gc
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx
from deferax._sparse import _factorisations

from .helpers import CountingLU, Tally

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
    return lambda v, b: dx.sparse_solve(v, PATTERN, b, solver=CountingLU(tally))


def dense(v, b):
    return jnp.linalg.solve(PATTERN.todense(v), b)


def kept() -> int:
    gc.collect()
    return len(_factorisations.FACTORISATIONS)


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


# ----------------------------------------------------------------------------- second order


SECOND_ORDER = {
    "hessian": jax.hessian,
    "jacfwd(grad)": lambda f: jax.jacfwd(jax.grad(f)),
    "grad(grad)": lambda f: jax.grad(lambda v: jnp.sum(jax.grad(f)(v) ** 2)),
}


def host_solve():
    a = np.array([[2.0, 1.0], [1.0, 3.0]])
    return dx.host(
        lambda b: np.linalg.solve(a, b),
        adjoint=lambda b, ct: np.linalg.solve(a.T, ct),
        jvp=lambda b, t: (np.linalg.solve(a, b), np.linalg.solve(a, t)),
        out=jax.ShapeDtypeStruct((2,), jnp.float64),
        name="my_solve",
    )


def second_order(name):
    """The refusal of a second derivative through the host site `name`, in full."""
    return (
        f"`ExpensiveFn(name={name!r})`: second order is not supported for this site: a derivative of its derivative "
        "is asked for (`jax.hessian`,\n`jax.jacfwd(jax.grad(f))`, `jax.grad(jax.grad(f))`), and its derivatives are "
        "host functions, which JAX cannot\ndifferentiate. A host site has first-order derivatives: reverse mode "
        "(`jax.grad`, `jax.vjp`, `jax.jacrev`,\n`dx.filter_value_and_grad`) and, with `jvp`, forward mode (`jax.jvp`, "
        "`jax.jacfwd`). For second order, give\n`dx.host(..., higher_order=f)`: `f(x) -> y` in JAX, which JAX can "
        "differentiate (for a linear solve, the host solve\ninside `jax.lax.custom_linear_solve`); for a sparse linear "
        "solve, use `dx.sparse_solve`, which has every order; or\nmake the site traceable (`dx.ExpensiveFn` with JAX "
        "implementations), or take finite differences of the gradient."
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("order", list(SECOND_ORDER))
def test_second_order_through_a_host_site_names_the_site(order, jit):
    solve = host_solve()
    fn = SECOND_ORDER[order](lambda b: jnp.sum(solve(b) ** 3))
    fn = jax.jit(fn) if jit else fn
    with pytest.raises(TypeError, match=re.escape(second_order("my_solve"))):
        fn(jnp.array([0.3, 0.7]))


def sine(calls, **derivatives):
    def fwd(x):
        calls.append("fwd")
        return np.sin(x)

    return dx.host(fwd, out=lambda s: s, name="sim", **derivatives)


HOST_DERIVATIVES = {
    "bwd": {"bwd": lambda x, y, ct: ct * np.cos(x)},
    "adjoint": {"adjoint": lambda x, ct: ct * np.cos(x)},
    "bwd+jvp": {"bwd": lambda x, y, ct: ct * np.cos(x), "jvp": lambda x, t: (np.sin(x), np.cos(x) * t)},
}
SECOND_ORDER_TOO = {
    **SECOND_ORDER,
    "jacrev(grad)": lambda f: jax.jacrev(jax.grad(f)),
    "jacfwd(vmap(grad))": lambda f: lambda x: jax.jacfwd(jax.vmap(jax.grad(f)))(x[None]),
    "jacfwd(dx.filter_grad)": lambda f: jax.jacfwd(dx.filter_grad(f)),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("order", list(SECOND_ORDER_TOO))
@pytest.mark.parametrize("given", list(HOST_DERIVATIVES))
def test_second_order_is_refused_up_front_whatever_derivative_is_given(given, order, jit):
    """`jax.hessian` (and every derivative of a derivative) through a host site with `bwd`
    alone used to be answered, eagerly, with "give `jvp(x, t_x)`" (forward mode), and once
    `jvp` was given, refused again as second order: it is refused as second order at once,
    before any host function runs."""
    calls = []
    sim = sine(calls, **HOST_DERIVATIVES[given])
    fn = SECOND_ORDER_TOO[order](lambda x: jnp.sum(sim(x) ** 2))
    fn = jax.jit(fn) if jit else fn
    with pytest.raises(TypeError, match=re.escape(second_order("sim"))) as info:
        fn(jnp.array([0.1, 0.2, 0.3]))
    assert "give" not in str(info.value).lower().split("for second order")[0]
    assert calls == []


def test_forward_mode_alone_still_asks_for_jvp():
    """First order in forward mode through a site with `bwd` alone: "give `jvp`" is the right answer there."""
    sim = sine([], **HOST_DERIVATIVES["bwd"])
    asks_for_jvp = r"forward-mode differentiation .* needs a\nforward-mode implementation.*Give\n`jvp"
    with pytest.raises(TypeError, match=asks_for_jvp):
        jax.jacfwd(sim)(jnp.array([0.1, 0.2]))
    np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(sim(x) ** 2))(jnp.array([0.1])), [np.sin(0.2)])


def test_differentiating_a_vjp_function_names_its_host_function():
    """What the rules cannot see in advance (forward mode through a `jax.vjp` function, whose
    backward pass calls `bwd` on traced cotangents) is refused where JAX meets the callback,
    naming the host function."""
    sim = sine([], **HOST_DERIVATIVES["bwd"])
    x = jnp.array([0.1, 0.2])
    _, vjp = jax.vjp(sim, x)
    text = second_order("sim").replace(
        "a derivative of its derivative is asked for",
        "its host function `bwd` is being differentiated, for a derivative of its derivative",
    )
    with pytest.raises(TypeError, match=re.escape(text)):
        jax.jvp(vjp, (x,), (x,))


@pytest.mark.parametrize("order", list(SECOND_ORDER))
def test_second_order_through_a_traceable_site_matches_plain_jax(order):
    """What the message recommends works: an `ExpensiveFn` with JAX implementations."""
    ref = lambda b: jnp.sin(b) * b  # noqa: E731
    fn = dx.ExpensiveFn(
        fwd=ref,
        bwd=lambda b, y, ct: ct * (jnp.cos(b) * b + jnp.sin(b)),
        jvp=lambda b, t: jax.jvp(ref, (b,), (t,)),
        name="traceable",
    )
    x = jnp.array([0.3, 0.7])
    got = SECOND_ORDER[order](lambda b: jnp.sum(fn(b) ** 3))(x)
    want = SECOND_ORDER[order](lambda b: jnp.sum(ref(b) ** 3))(x)
    np.testing.assert_allclose(got, want, rtol=1e-12)
