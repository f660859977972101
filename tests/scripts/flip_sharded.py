"""A `fwd` + `bwd` site whose `bwd` starts reading `y` on a later eager call (a global it
branches on rebound), with its input sharded over 2 CPU devices, where the halves run in the
program, not on threads (`_placement.halves_run`): the call whose plan was taken without
reading `bwd` reads it before the forward, runs `bwd` after it on its `y`, and gives plain
JAX's value and gradient at every call. Run by tests/test_devices.py (2 devices, fixed
when JAX starts)."""

import jax
import jax.numpy as jnp
import numpy as np

import deferax as dx

jax.config.update("jax_enable_x64", True)
assert len(jax.devices()) == 2, jax.devices()
READS_Y = False


def bwd(x, y, ct):
    return ct * (y if READS_Y else jnp.exp(x))


f = dx.ExpensiveFn(fwd=jnp.exp, bwd=bwd, name="exp")
w = jnp.linspace(0.5, 1.5, 8)
loss = lambda p: jnp.sum(w * f(p)) + jnp.sum(p**2)  # noqa: E731
plain = lambda p: jnp.sum(w * jnp.exp(p)) + jnp.sum(p**2)  # noqa: E731
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
p = jax.device_put(jnp.linspace(-1.0, 1.0, 8), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
step = dx.filter_value_and_grad(loss)
expected = jax.value_and_grad(plain)(p)
for reads in (False, False, True, True, False, False):
    READS_Y = reads
    with dx.record() as timeline:
        value, grad = step(p)
    np.testing.assert_allclose(value, expected[0], rtol=1e-12)
    np.testing.assert_allclose(grad, expected[1], rtol=1e-12)
    assert timeline.counts() == {"fwd": 1, "bwd": 1}, timeline.counts()
    assert dx.explain(loss, p).sites[0].schedule == ("standard" if reads else "deferred")
print("ok")
