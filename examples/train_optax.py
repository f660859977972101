"""Training a typed model that holds an expensive solver, with optax.

A small inverse-design loop: an MLP (`eqx.nn.MLP`) maps a latent code to the conductivity
of a 1D rod; a typed wrapper (`dx.TypedModule`) hands it to a diffusion solver, an
`ExpensiveFn` with a hand-written adjoint whose configuration (the grid's Laplacian and the
heat source) is held by its implementations; the loss is the temperature at a probe point
(to be made small, with a penalty on the conductivity), over a batch of latent codes
`vmap`ped inside the loss. `optax.adamw` trains it.

What to look at:

- the batch under `jax.vmap` is deferred as one batched call: the forward and the adjoint
  solves of the whole batch run together (`dx.explain` below says so, and a recording of
  one step counts the runs);
- `dx.trainable(model)` keeps the solver's configuration arrays out of the optimizer:
  their gradient is zero, but `adamw`'s weight decay would still shrink them (checked at
  the end);
- one progress line per step, with the loss, the step's time (the first includes
  compiling) and the implementation runs recorded with `dx.record()`; the loss falls by
  more than 90 % in 20 steps (the script checks that it at least halves).

Run: python examples/train_optax.py
"""

import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float

import deferax as dx

N = 64  # grid points of the rod
LATENT, BATCH, STEPS = 4, 8, 20


class Solve(eqx.Module):
    """`u = (L + diag(kappa))^-1 f`: the steady temperature for a conductivity-like field
    `kappa`. Its arrays (the Laplacian `L`, the source `f`) are configuration."""

    laplacian: Float[Array, "n n"]
    source: Float[Array, " n"]

    def __call__(self, kappa):
        return jnp.linalg.solve(self.laplacian + jnp.diag(kappa), self.source)


class AdjointSolve(eqx.Module):
    """`lam = (L + diag(kappa))^-T ct_u`: needs the cotangent, not `u`."""

    laplacian: Float[Array, "n n"]

    def __call__(self, kappa, ct_u):
        return jnp.linalg.solve((self.laplacian + jnp.diag(kappa)).T, ct_u)


def combine(kappa, u, lam):  # the cheap step that needs u: ct_kappa = -u * lam
    return -u * lam


class Rod(dx.TypedModule):
    """Typed wrapper: a positive field on the grid in, the temperature out."""

    solver: dx.ExpensiveFn

    def __call__(self, kappa: Float[Array, " n"]) -> Float[Array, " n"]:
        return self.solver(kappa)


class Model(eqx.Module):
    decoder: eqx.nn.MLP
    rod: Rod

    def conductivity(self, z: Float[Array, " latent"]) -> Float[Array, " n"]:
        return jax.nn.softplus(self.decoder(z)) + 0.1

    def __call__(self, z: Float[Array, " latent"]) -> Float[Array, " n"]:
        return self.rod(self.conductivity(z))


def make_model(key):
    h = 1.0 / N
    laplacian = (2 * jnp.eye(N) - jnp.eye(N, k=1) - jnp.eye(N, k=-1)) / h**2
    source = jnp.exp(-(((jnp.arange(N) + 0.5) * h - 0.3) ** 2) / 0.005)
    solver = dx.ExpensiveFn(
        fwd=Solve(laplacian, source),
        adjoint=AdjointSolve(laplacian),
        combine=combine,
        name="rod",
    )
    decoder = eqx.nn.MLP(LATENT, N, width_size=32, depth=2, key=key)
    return Model(decoder, Rod(solver))


PROBE = jnp.zeros(N).at[3 * N // 4].set(1.0)  # the temperature at one point


def loss(model, zs):
    temperatures = jax.vmap(model)(zs)  # one batched solve per step, deferred
    probe = temperatures @ PROBE  # linear in the solver's output: nothing waits for it
    penalty = 1e-7 * jnp.mean(jax.vmap(model.conductivity)(zs) ** 2)
    return jnp.mean(probe) + penalty, probe


def main():
    key, data_key = jax.random.split(jax.random.key(0))
    model = eqx.filter_jit(make_model)(key)  # (built under jit: one compilation)
    zs = jax.random.normal(data_key, (BATCH, LATENT))

    # The solver's arrays stay out of the optimizer; the MLP's weights are trained.
    params, static = eqx.partition(model, dx.trainable(model))
    optimizer = optax.adamw(2e-2, weight_decay=1e-2)
    opt_state = eqx.filter_jit(optimizer.init)(params)
    print(dx.explain(lambda p, zs: loss(eqx.combine(p, static), zs)[0], params, zs))

    @eqx.filter_jit
    def step(params, opt_state, zs):
        def objective(params):
            return loss(eqx.combine(params, static), zs)

        (value, probe), grads = dx.filter_value_and_grad(objective, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, value, probe

    first = None
    for i in range(STEPS):
        start = time.perf_counter()
        with dx.record() as timeline:  # (the first step is traced inside it: all its calls are counted)
            params, opt_state, value, probe = jax.block_until_ready(step(params, opt_state, zs))
        ms = 1e3 * (time.perf_counter() - start)
        runs = dict(sorted(timeline.counts().items()))
        print(
            f"step {i:3d}  loss {float(value):.6f}  probe temperature "
            f"{float(jnp.mean(probe)):.6f}  {ms:7.1f} ms  runs {runs}"
        )
        if i == 0:
            assert runs == {"adjoint": 1, "combine": 1, "fwd": 1}, runs  # the whole batch: one forward, one adjoint
            first = float(value)
    print(f"loss {first:.6f} -> {float(value):.6f} in {STEPS} steps ({100 * (float(value) / first - 1):+.0f} %)")
    assert float(value) < 0.5 * first, "the loss did not fall"

    trained = eqx.combine(params, static)
    solver = trained.rod.solver
    assert jnp.array_equal(solver.fwd.laplacian, model.rod.solver.fwd.laplacian), "the configuration moved"
    assert jnp.array_equal(solver.fwd.source, model.rod.solver.fwd.source), "the configuration moved"
    moved = jnp.max(jnp.abs(trained.decoder.layers[0].weight - model.decoder.layers[0].weight))
    print(f"decoder weights moved by up to {float(moved):.3f}; the solver's configuration did not move")

    # What happens without dx.trainable: adamw's weight decay shrinks the configuration.
    @eqx.filter_jit
    def naive_steps(model):  # three adamw steps on every array of the model
        naive = eqx.filter(model, eqx.is_inexact_array)
        naive_state = optimizer.init(naive)
        grads = eqx.filter_grad(lambda m: loss(m, zs)[0])(model)
        for _ in range(3):
            updates, naive_state = optimizer.update(grads, naive_state, naive)
            naive = eqx.apply_updates(naive, updates)
        return naive

    naive = naive_steps(model)
    drift = jnp.max(jnp.abs(naive.rod.solver.fwd.source - model.rod.solver.fwd.source))
    print(f"without dx.trainable, 3 adamw steps move the heat source by up to {float(drift):.2e}")
    assert drift > 0


if __name__ == "__main__":
    main()
