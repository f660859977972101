"""A user's program as its author wrote it: a `jax.custom_vjp` whose backward never reads
`f(x)`, in a loss whose cotangent does not need `f(x)` either.

`f` is a wave stepper (leapfrog on a 128 x 128 grid, 1500 `lax.scan` steps): linear in its
source pattern `x`, so its adjoint is a second stepper run backwards on the cotangent alone.
The `custom_vjp` is written the way JAX users write one: `f_fwd` returns `f(x)` and keeps `x`,
`f_bwd(x, v)` runs the adjoint. The loss is affine in `f(x)`.

Nothing here is deferax's: the loss is handed to `dx.filter_value_and_grad` unchanged.
deferax finds the call, traces `f_bwd` once, sees that none of it needs a residual computed by
`f_fwd`, and runs the forward and the adjoint at once on two threads (the "deferred"
schedule). Plain JAX runs them one after the other; the value and gradient are the same.

Run with `python examples/seed_custom_vjp.py`.
"""

import time

import jax
import jax.numpy as jnp
from jax import lax

import deferax as dx

N, STEPS = 128, 1500


def laplacian(u):
    p = jnp.pad(u, 1)
    return p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4 * u


r = jnp.arange(N) / N - 0.5
c2 = jnp.where(r[:, None] ** 2 + r[None, :] ** 2 < 0.15**2, 0.12, 0.25)  # a slow disc
t = jnp.arange(STEPS, dtype=jnp.float32)
a = ((t - 30.0) / 10.0) ** 2
g = (1 - 2 * a) * jnp.exp(-a)  # a Ricker pulse


def forward(x):
    """The final field of `u'' = c^2 lap(u) + g(t) x`, from rest."""

    def step(carry, gk):
        u, u_prev = carry
        return (2 * u - u_prev + c2 * laplacian(u) + gk * x, u), None

    zero = jnp.zeros_like(x)
    (u, _), _ = lax.scan(step, (zero, zero), g)
    return u


def adjoint(v):
    """The transposed stepper, run backwards from the cotangent `v`."""

    def step(carry, gk):
        b, b_next, acc = carry
        return (2 * b - b_next + laplacian(c2 * b), b, acc + gk * b), None

    zero = jnp.zeros_like(v)
    (_, _, acc), _ = lax.scan(step, (v, zero, zero), g[::-1])
    return acc


@jax.custom_vjp
def f(x):
    return forward(x)


def f_fwd(x):
    return f(x), x


def f_bwd(x, v):
    return (adjoint(v),)  # never reads f(x)


f.defvjp(f_fwd, f_bwd)

w = jax.random.normal(jax.random.key(1), (N, N))


def loss(x):
    return jnp.sum(w * f(x)) + 1e-3 * jnp.sum(x**2)  # affine in f(x)


def best_of(step, x, repeats=5):
    jax.block_until_ready(step(x))  # (compiled)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(x))
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    x = jax.random.normal(jax.random.key(0), (N, N))
    print(dx.explain(loss, x))
    print()

    plain = jax.jit(jax.value_and_grad(loss))
    deferred = jax.jit(dx.filter_value_and_grad(loss))
    (v1, g1), (v2, g2) = plain(x), deferred(x)
    assert jnp.allclose(v1, v2, rtol=1e-6) and jnp.allclose(g1, g2, rtol=1e-5, atol=1e-6)
    difference = float(jnp.max(jnp.abs(g1 - g2)))
    print(f"value {float(v2):.6g} (plain JAX: {float(v1):.6g}); gradient max difference {difference:.1e}")

    with dx.record() as timeline:
        jax.block_until_ready(deferred(x))
    print("runs of one jitted value and gradient:", timeline.counts())

    t_plain, t_deferred = best_of(plain, x), best_of(deferred, x)
    print(f"plain JAX {t_plain * 1e3:.1f} ms, deferax {t_deferred * 1e3:.1f} ms (best of 5, jitted)")


if __name__ == "__main__":
    main()
