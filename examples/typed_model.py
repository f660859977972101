"""A typed model carrying an expensive simulation, composed with `eqx.nn` layers.

The canonical pattern: a `dx.TypedModule` wrapper holds a `dx.ExpensiveFn` and declares
the shapes of its input and output; a larger Equinox model feeds it from an MLP. The
script trains it for a few steps (the solver call is deferred), then shows what the
annotations catch: a background field of the wrong shape, which NumPy-style broadcasting
would otherwise let through silently, stops at once with a message naming the module,
the argument and the dimensions.

Run: python examples/typed_model.py
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

import deferax as dx

NX, NY = 8, 6


def simulate(eps: Float[Array, "nx ny"]) -> Float[Array, "nx ny"]:
    """A stand-in for an expensive field solver: a few smoothing sweeps, nonlinear in eps."""
    field = jnp.sin(eps)
    for _ in range(3):
        field = 0.5 * field + 0.125 * (
            jnp.roll(field, 1, 0) + jnp.roll(field, -1, 0) + jnp.roll(field, 1, 1) + jnp.roll(field, -1, 1)
        )
    return field


def adjoint(eps: Float[Array, "nx ny"], ct: Float[Array, "nx ny"]) -> Float[Array, "nx ny"]:
    """The hand-written adjoint: the transposed sweeps, then the derivative of sin."""
    for _ in range(3):
        ct = 0.5 * ct + 0.125 * (jnp.roll(ct, -1, 0) + jnp.roll(ct, 1, 0) + jnp.roll(ct, -1, 1) + jnp.roll(ct, 1, 1))
    return jnp.cos(eps) * ct


class Simulator(dx.TypedModule):
    """Typed wrapper: the permittivity grid in, the field out, on the same `nx ny` grid."""

    sim: dx.ExpensiveFn
    background: Float[Array, "nx ny"]

    def __call__(self, design: Float[Array, "nx ny"]) -> Float[Array, "nx ny"]:
        return self.sim(self.background + design)


class Model(eqx.Module):
    decoder: eqx.nn.MLP
    simulator: Simulator

    def __call__(self, z: Float[Array, " latent"]) -> Float[Array, "nx ny"]:
        design = jnp.reshape(self.decoder(z), (NX, NY))
        return self.simulator(design)


def main():
    sim = dx.ExpensiveFn(
        fwd=simulate,
        bwd=lambda eps, y, ct: adjoint(eps, ct),
        fused=dx.fuse(simulate, adjoint),
        name="field-solver",
    )
    # (built under `jit`: one compilation instead of one per initialiser)
    decoder = eqx.filter_jit(lambda key: eqx.nn.MLP(4, NX * NY, 32, 2, key=key))(jax.random.key(0))
    model = Model(decoder, Simulator(sim, jnp.ones((NX, NY))))
    target = jnp.cos(jnp.linspace(0.0, 3.0, NX * NY)).reshape(NX, NY)
    z = jnp.array([0.1, -0.2, 0.3, 0.4])

    def loss(m, z):
        return -jnp.sum(target * m(z))  # linear in the field: the solver call is deferred

    print(dx.explain(loss, model, z))

    @eqx.filter_jit
    def step(model, z):  # the shapes are checked once, while this is traced
        value, grads = dx.filter_value_and_grad(loss)(model, z)
        return value, eqx.apply_updates(model, jax.tree.map(lambda g: -0.05 * g, grads))

    for i in range(5):
        value, model = step(model, z)
        print(f"step {i}: loss {float(value):.5f}")

    @eqx.filter_jit
    def difference(model, z):  # deferax's value and gradients against Equinox's
        ours = dx.filter_value_and_grad(loss)(model, z)
        reference = eqx.filter_value_and_grad(loss)(model, z)
        pairs = zip(jax.tree.leaves(ours), jax.tree.leaves(reference), strict=True)
        return jnp.max(jnp.stack([jnp.max(jnp.abs(a - b)) for a, b in pairs]))

    error = float(difference(model, z))
    print(f"max difference from eqx.filter_value_and_grad: {error:.2e}")
    assert error < 1e-4

    # A shape mistake: the background given as one column, (nx, 1) instead of (nx, ny).
    run = eqx.filter_jit(Model.__call__)  # (the checks run while it is traced)
    wrong = Model(decoder, Simulator(sim, jnp.ones((NX, 1))))
    try:
        run(wrong, z)
    except dx.AnnotationError as error:
        print("\nA background of the wrong shape is caught at the wrapper, before the solver runs:\n" + str(error))
    else:
        raise AssertionError("the wrong background was not caught")
    # `background + design` broadcasts it: without the checks, nothing complains.
    with dx.typechecking(False):
        field = run(wrong, z)
    print(f"Without the checks it passes silently: a field of shape {field.shape}, computed on the wrong background")


if __name__ == "__main__":
    main()
