"""A ring of 16 unknowns (a cyclic tridiagonal matrix) whose entries, right-hand side and a
tangent of the entries are sharded over the process's 2 CPU devices: what the scripts run with
2 devices share (`from sharded_ring import ...`; x64 on)."""

import jax
import jax.numpy as jnp
import numpy as np

import deferax as dx

jax.config.update("jax_enable_x64", True)
assert len(jax.devices()) == 2, jax.devices()

n = 16
i = np.arange(n)
pattern = dx.SparsePattern(np.r_[i, i, i], np.r_[i, (i + 1) % n, (i - 1) % n], n)
rng = np.random.default_rng(0)
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
values = jax.device_put(jnp.asarray(np.r_[np.full(n, 5.0), rng.normal(size=2 * n)]), sharded)
b = jax.device_put(jnp.asarray(rng.normal(size=n)), sharded)
t = jax.device_put(jnp.asarray(rng.normal(size=3 * n)), sharded)
