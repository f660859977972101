"""`jax.custom_vjp` calls in an unchanged loss: each becomes a site (`custom_vjp `f`
(recognised)`), whose forward and the part of its backward that needs no computed residual
run at once where the loss's cotangent allows it, with plain JAX's values and gradients;
calls that cannot be split soundly, or would not gain, are left exactly as they are, and
`explain` says why."""

import os

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import deferax as dx

from .helpers import assert_tree_allclose

HERE = os.path.relpath(__file__)


# ----------------------------------------------------------------------------- the seed's program, unchanged
#
# A wave stepper (leapfrog on an n x n grid, `lax.scan` over the steps) is linear in its
# source pattern `x`, so its adjoint needs the cotangent only: the seed's `f_bwd(x, v)` never
# reads `f(x)`, and the loss is affine in `f(x)`.


def laplacian(u):
    p = jnp.pad(u, 1)
    return p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4 * u


def seed(n: int, steps: int, counter=None):
    """`(f, loss, x)`: the seed's `custom_vjp` around the stepper, an affine loss in its
    output, and an input. `counter` counts the forward and adjoint runs ("fwd", "bwd")."""
    r = jnp.arange(n, dtype=float) / n - 0.5
    c2 = jnp.where(r[:, None] ** 2 + r[None, :] ** 2 < 0.15**2, 0.12, 0.25)
    t = jnp.arange(steps, dtype=float)
    a = ((t - steps / 4) / (steps / 12)) ** 2
    g = (1 - 2 * a) * jnp.exp(-a)

    def forward(x):
        if counter is not None:
            counter.tick("fwd")

        def step(carry, gk):
            u, u_prev = carry
            return (2 * u - u_prev + c2 * laplacian(u) + gk * x, u), None

        zero = jnp.zeros_like(x)
        (u, _), _ = lax.scan(step, (zero, zero), g)
        return u

    def adjoint(ct):
        if counter is not None:
            counter.tick("bwd")

        def step(carry, gk):
            a, a_next, acc = carry
            return (2 * a - a_next + laplacian(c2 * a), a, acc + gk * a), None

        zero = jnp.zeros_like(ct)
        (_, _, acc), _ = lax.scan(step, (ct, zero, zero), g[::-1])
        return acc

    @jax.custom_vjp
    def f(x):
        return forward(x)

    def f_fwd(x):
        return f(x), x

    def f_bwd(x, v):
        return (adjoint(v),)

    f.defvjp(f_fwd, f_bwd)
    w = jax.random.normal(jax.random.key(1), (n, n))
    x = jax.random.normal(jax.random.key(0), (n, n))

    def loss(x):
        return jnp.sum(w * f(x)) + 1e-3 * jnp.sum(x**2)

    return f, loss, x


# Large enough for the estimate to split it (about 3e7 element operations a half), small
# enough to run in milliseconds.
SEED = (48, 600)


def _line_of(text: str) -> int:
    """The line of this file that holds `text`."""
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def test_the_seed_unchanged_is_a_deferred_site(counter):
    """The seed's program, unchanged: one site, deferred (the forward and the adjoint in one
    stage, at once), plain JAX's value and gradient, eagerly and under `jax.jit`, with the
    forward and the adjoint run once each, as in plain JAX."""
    _, loss, x = seed(*SEED, counter)
    plan = dx.explain(loss, x)
    [site] = plan.sites
    assert (site.name, site.schedule) == ("custom_vjp `f` (recognised)", "deferred")
    line = _line_of("return jnp.sum(w * f(x))")
    assert str(plan.recognised[0]).startswith(f"#0 custom_vjp `f` (recognised) at {HERE}:{line}")
    assert plan.stages == (("custom_vjp `f` (recognised): fwd + adjoint",),)
    counter.reset()
    want = jax.value_and_grad(loss)(x)
    jax.effects_barrier()
    assert counter.as_dict() == {"fwd": 1, "bwd": 1, "fused": 0}
    for jit in (False, True):
        step = dx.filter_value_and_grad(loss)
        step = jax.jit(step) if jit else step
        jax.block_until_ready(step(x))  # (a first call compiles)
        jax.effects_barrier()
        counter.reset()
        with dx.record() as timeline:
            got = jax.block_until_ready(step(x))
            jax.effects_barrier()
        assert counter.as_dict() == {"fwd": 1, "bwd": 1, "fused": 0}, jit
        assert timeline.counts() == {"fwd": 1, "adjoint": 1}, jit
        assert_tree_allclose(got, want, rtol=1e-12, atol=1e-12)


def _at_depth():
    """The seed's call inside each construct, with whether it is a site there."""
    return {
        "jit": (lambda f: jax.jit(f), True),
        "checkpoint": (lambda f: jax.checkpoint(f), True),
        "vmap": (lambda f: lambda x: jax.vmap(f)(jnp.stack([x, -x]))[0], True),
        "scan": (lambda f: lambda x: lax.scan(lambda c, _: (f(c), None), x, None, length=1)[0], False),
        "cond": (lambda f: lambda x: lax.cond(jnp.sum(x) > -1e9, f, lambda u: u, x), False),
    }


@pytest.mark.parametrize("construct", list(_at_depth()))
def test_the_seed_at_depth(construct):
    """Inside a nested `jit`, `checkpoint` or `vmap` the call is a site and deferred; inside
    `lax.scan` or `lax.cond` it is left as is, and `explain` says so. Plain JAX's value and
    gradient every time."""
    wrap, is_site = _at_depth()[construct]
    f, _, x = seed(*SEED)
    g = wrap(f)
    w = jax.random.normal(jax.random.key(2), x.shape)

    def loss(x):
        return jnp.sum(w * g(x))

    plan = dx.explain(loss, x)
    [call] = plan.recognised
    if is_site:
        assert [s.schedule for s in plan.sites] == ["deferred"] and call.site == 0
    else:
        assert plan.sites == () and call.reason.startswith(f"inside lax.{construct}: left as is")
        assert call.call == "custom_vjp `f`"
    want = jax.value_and_grad(loss)(x)
    for jit in (False, True):
        step = dx.filter_value_and_grad(loss)
        assert_tree_allclose((jax.jit(step) if jit else step)(x), want, rtol=1e-12, atol=1e-12)


def test_recognise_switches_it():
    """`recognise=False` leaves the call as traced; by default a small one is left in place by
    cost, which `recognise="always"` overrides."""
    _, loss, x = seed(*SEED)
    plan = dx.explain(dx.filter_value_and_grad(loss, recognise=False), x)
    assert plan.sites == () and plan.recognised == ()
    _, small, x8 = seed(8, 20)
    [call] = dx.explain(small, x8).recognised
    assert call.site is None and call.reason.startswith("left in place by cost: its function is estimated at about")
    assert '`recognise="always"` rewrites it anyway' in call.reason
    plan = dx.explain(dx.filter_value_and_grad(small, recognise="always"), x8)
    assert [s.schedule for s in plan.sites] == ["deferred"]
    assert_tree_allclose(
        dx.filter_value_and_grad(small, recognise="always")(x8), jax.value_and_grad(small)(x8), rtol=1e-12
    )
