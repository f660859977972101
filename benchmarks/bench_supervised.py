"""A supervised training step with an expensive physics layer under `vmap`.

The model an ML engineer writes: a typed MLP encoder (`dx.TypedModule`), a `dx.host`
physics layer `y = tanh(P h)` whose forward and adjoint each sleep 5 ms a call (a solver's
latency), `jax.vmap`ped over a batch of 32 (one call for the whole batch; also one call an
example on deferax's default thread pool, without a target), a linear readout and an MSE
loss; an Adam step (optax, or a hand-written Adam where optax is absent), all under
`eqx.filter_jit`. deferax's step against the same step with `eqx.filter_value_and_grad`.
Each example's cotangent depends on its own output through one number (its prediction),
so the basis is k = 1 per example: the forward and the adjoint run at once, one stage
where the standard schedule takes two. Also run without the sleep (nothing is lost there).
The gradients are checked equal to Equinox's, and to plain JAX's (the layer in jnp).

    python benchmarks/bench_supervised.py            # full size
    python benchmarks/bench_supervised.py --small    # smoke test
"""

from __future__ import annotations

import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _common import describe, interleaved, machine, median, parser, result_line
from jaxtyping import Array, Float

import deferax as dx

# (case: sleep in seconds, one host call for the whole batch, target)
CASES = {
    "sleep 5 ms": (0.005, True, 0.7),
    "no sleep": (0.0, True, 1.02),
    "sleep 5 ms, a call an example": (0.005, False, None),
}


class Dense(dx.TypedModule):
    weight: Float[Array, "out in"]
    bias: Float[Array, " out"]

    def __call__(self, x: Float[Array, " in"]) -> Float[Array, " out"]:
        return self.weight @ x + self.bias


def dense(key, n_in: int, n_out: int) -> Dense:
    w = jax.random.normal(key, (n_out, n_in), jnp.float32) / np.float32(np.sqrt(n_in))
    return Dense(w, jnp.zeros((n_out,), jnp.float32))


class Encoder(dx.TypedModule):
    layers: tuple[Dense, ...]

    def __call__(self, x: Float[Array, " d"]) -> Float[Array, " h"]:
        for layer in self.layers[:-1]:
            x = jnp.tanh(layer(x))
        return self.layers[-1](x)


class Model(eqx.Module):
    encoder: Encoder
    physics: dx.ExpensiveFn
    readout: Dense

    def __call__(self, x):
        return self.readout(self.physics(self.encoder(x)))


def physics_layer(p: np.ndarray, sleep: float, vectorized: bool = True) -> dx.ExpensiveFn:
    """`y = tanh(P h)` on the host, its forward and its adjoint each sleeping `sleep` s a
    call. `vectorized`: one call takes the whole batch (`h` of shape `(batch, h)`), as a
    solver that batches its right-hand sides does; otherwise one call an example."""

    def fwd(h):
        time.sleep(sleep)
        return np.tanh(h @ p.T).astype(np.float32)

    def adjoint(h, ct):
        time.sleep(sleep)
        return (((1 - np.tanh(h @ p.T) ** 2) * ct) @ p).astype(np.float32)

    out = jax.ShapeDtypeStruct((p.shape[0],), jnp.float32)
    return dx.host(fwd, adjoint=adjoint, out=out, vectorized=vectorized, name="physics")


class Plain(eqx.Module):
    """The physics layer in JAX, for the reference gradient."""

    p: jax.Array

    def __call__(self, h):
        return jnp.tanh(self.p @ h)


def loss(model, xs, ts):
    return jnp.mean((jax.vmap(model)(xs) - ts) ** 2)


def adam(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, prefer_optax=True):
    """optax's Adam, or the same by hand on the pytree where optax is absent (or not
    `prefer_optax`)."""
    try:
        import optax
    except ImportError:
        optax = None
    if optax is not None and prefer_optax:
        return optax.adam(lr, b1=b1, b2=b2, eps=eps), "optax.adam"

    class Hand:
        def init(self, params):
            zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
            return (jnp.zeros((), jnp.int32), zeros, zeros)

        def update(self, grads, state, params=None):
            count, mu, nu = state
            count = count + 1
            mu = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, mu, grads)
            nu = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, nu, grads)
            c1 = 1 - b1 ** count.astype(jnp.float32)
            c2 = 1 - b2 ** count.astype(jnp.float32)
            updates = jax.tree_util.tree_map(lambda m, v: -lr * (m / c1) / (jnp.sqrt(v / c2) + eps), mu, nu)
            return updates, (count, mu, nu)

    return Hand(), "hand-written Adam"


def make_step(value_and_grad, opt):
    @eqx.filter_jit
    def step(model, state, xs, ts):
        value, grads = value_and_grad(loss)(model, xs, ts)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, value

    return step


def build(sleep: float, sizes: tuple[int, int, int, int, int], vectorized: bool = True):
    batch, d, width, h, m = sizes
    keys = jax.random.split(jax.random.key(0), 8)
    encoder = Encoder((dense(keys[0], d, width), dense(keys[1], width, width), dense(keys[2], width, h)))
    p = np.asarray(jax.random.normal(keys[3], (m, h), jnp.float32)) / np.float32(np.sqrt(h))
    model = Model(encoder, physics_layer(p, sleep, vectorized), dense(keys[4], m, 1))
    xs = jax.random.normal(keys[5], (batch, d), jnp.float32)
    ts = jax.random.normal(keys[6], (batch, 1), jnp.float32)
    return model, Plain(jnp.asarray(p)), xs, ts


def check_gradients(model, plain, xs, ts) -> float:
    """The largest difference of deferax's gradient from Equinox's and from plain JAX's;
    the plan must count one cotangent per example."""
    plan = dx.explain(dx.filter_value_and_grad(loss), model, xs, ts)
    (site,) = plan.sites
    print(f"plan: {site.schedule} k={site.k} (per example) over a batch of {site.batch[0]}")
    assert (site.schedule, site.k) == ("deferred-basis", 1), plan
    got = eqx.filter_jit(dx.filter_value_and_grad(loss))(model, xs, ts)
    ref_eqx = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, xs, ts)
    ref_jax = eqx.filter_jit(eqx.filter_value_and_grad(loss))(eqx.tree_at(lambda m: m.physics, model, plain), xs, ts)
    ref_jax = (ref_jax[0], eqx.tree_at(lambda m: m.physics, ref_jax[1], None))
    worst = 0.0
    for ref in (ref_eqx, ref_jax):
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
            worst = max(worst, float(np.max(np.abs(np.asarray(a) - np.asarray(b)))))
    return worst


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    sizes = (8, 4, 16, 8, 4) if args.small else (32, 16, 64, 32, 16)
    repeats = args.repeats or (2 if args.small else 31)
    opt, opt_name = adam()
    batch, d, width, h, m = sizes
    print(
        f"bench_supervised: typed MLP {d}-{width}-{width}-{h}, dx.host layer {h}->{m} under vmap over "
        f"{batch}, linear readout, MSE, {opt_name}, eqx.filter_jit, float32; {machine()}"
    )
    lines = []
    for case, (sleep, vectorized, target) in CASES.items():
        model, plain, xs, ts = build(sleep, sizes, vectorized)
        worst = check_gradients(model, plain, xs, ts)
        print(f"[{case}] gradients equal to Equinox's and plain JAX's: largest difference {worst:.2e}")
        state = opt.init(eqx.filter(model, eqx.is_array))
        steps = {
            "deferax": make_step(dx.filter_value_and_grad, opt),
            "equinox": make_step(eqx.filter_value_and_grad, opt),
        }
        args = (model, state, xs, ts)
        sides = {name: (lambda s=s, args=args: s(*args)) for name, s in steps.items()}
        times = interleaved(sides, repeats)
        for name in steps:
            print(f"[{case}] {name}: {describe(times[name])}")
        lines.append(
            result_line(
                "bench_supervised",
                case,
                median(times["deferax"]),
                median(times["equinox"]),
                target,
                new_name="deferax",
                old_name="equinox",
            )
        )
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
