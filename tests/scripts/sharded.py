"""Run by `tests/test_devices.py` in a subprocess with `XLA_FLAGS` forcing 8 CPU devices: every
kind of site with its input sharded over the 8 devices (a `NamedSharding` over a 1-D mesh),
eagerly, under `jax.jit` and under `jax.jit` with `in_shardings`/`out_shardings`: plain JAX's
values and gradients, no error, no abort (a process that aborts fails the test that runs
it), and the gradient sharded as plain JAX's is. Prints `ok` at the end."""

import functools as ft
import os

assert "xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", ""), "run with 8 forced devices"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import scipy.sparse  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import deferax as dx  # noqa: E402

devices = jax.devices()
assert len(devices) == 8, devices
mesh = Mesh(np.array(devices), ("i",))
row = NamedSharding(mesh, P("i"))
whole = NamedSharding(mesh, P())
n = 64
rng = np.random.default_rng(0)
M = jnp.asarray(rng.normal(size=(n, n)) / np.sqrt(n), jnp.float32)
w = jnp.asarray(rng.normal(size=n), jnp.float32)


# 1. a JAX-native site: a short time-stepper, its adjoint the transposed stepper from the
#    cotangent alone (a forward and an adjoint loop of equal length)
def forward(x):
    return lax.scan(lambda u, _: (jnp.tanh(0.1 * (M @ u)) + u, None), x, None, length=5)[0]


def reference_native(x):
    return jnp.dot(w, forward(x)) + jnp.sum(x**2)


def bwd(x, y, ct):  # reads x and the cotangent only
    return jax.vjp(forward, x)[1](ct)[0]


native = dx.ExpensiveFn(fwd=forward, bwd=bwd, name="stepper")
fused = dx.ExpensiveFn(fwd=forward, bwd=bwd, fused=dx.fuse(forward, lambda x, ct: bwd(x, None, ct)), name="fused")


# 2. a custom_vjp as users write it, recognised as a site
@jax.custom_vjp
def stepper(x):
    return forward(x)


stepper.defvjp(lambda x: (forward(x), x), lambda x, ct: (bwd(x, None, ct),))


# 3. a host site: a dense solve on the host, its adjoint the transposed solve
A0 = np.eye(n) * 4 + rng.normal(size=(n, n)) * 0.1


def solve(x):
    return np.linalg.solve(A0 + np.diag(np.asarray(x, np.float64)), np.ones(n)).astype(np.float32)


def solve_adjoint(x, ct):
    return np.linalg.solve((A0 + np.diag(np.asarray(x, np.float64))).T, np.asarray(ct, np.float64)).astype(np.float32)


host = dx.host(
    solve, adjoint=solve_adjoint, combine=lambda x, y, lam: -y * lam, out=jax.ShapeDtypeStruct((n,), jnp.float32)
)


def reference_host(x):
    return jnp.dot(w, jnp.linalg.solve(jnp.asarray(A0, jnp.float32) + jnp.diag(x), jnp.ones(n))) + jnp.sum(x**2)


# 4. a sparse solve: the entries of a 1-D Laplacian-like matrix, shifted by x on the diagonal
base = scipy.sparse.diags([-np.ones(n - 1), 4 * np.ones(n), -np.ones(n - 1)], [-1, 0, 1]).tocsr()
values, pattern = dx.SparsePattern.from_scipy(base)
numbered = base.copy()
numbered.data = np.arange(1.0, base.nnz + 1)
order = np.asarray(dx.SparsePattern.from_scipy(numbered)[0]).astype(int) - 1  # each entry's place in `base`
coo = base.tocoo()
entry_row = coo.row[order]
on_diagonal = jnp.asarray(coo.row[order] == coo.col[order], jnp.float32)
dense_base = jnp.asarray(base.toarray(), jnp.float32)


def sparse_loss(x):
    entries = jnp.asarray(values, jnp.float32) + on_diagonal * x[entry_row]
    return jnp.dot(w, dx.sparse_solve(entries, pattern, jnp.ones(n, jnp.float32))) + jnp.sum(x**2)


def reference_sparse(x):
    return jnp.dot(w, jnp.linalg.solve(dense_base + jnp.diag(x), jnp.ones(n, jnp.float32))) + jnp.sum(x**2)


# (the custom_vjp is small: `recognise="always"` makes it a site all the same)
value_and_grad = ft.partial(dx.filter_value_and_grad, recognise="always")
cases = {
    "JAX-native ExpensiveFn": (lambda x: jnp.dot(w, native(x)) + jnp.sum(x**2), reference_native),
    "dx.fuse": (lambda x: jnp.dot(w, fused(x)) + jnp.sum(x**2), reference_native),
    "custom_vjp site": (lambda x: jnp.dot(w, stepper(x)) + jnp.sum(x**2), reference_native),
    "host site": (lambda x: jnp.dot(w, host(x)) + jnp.sum(x**2), reference_host),
    "sparse solve": (sparse_loss, reference_sparse),
}
x = jax.device_put(jnp.asarray(rng.uniform(0.1, 0.5, size=n), jnp.float32), row)
for name, (loss, reference) in cases.items():
    ref_value, ref_grad = jax.jit(jax.value_and_grad(reference))(x)
    ways = {
        "eager": value_and_grad(loss),
        "jit": jax.jit(value_and_grad(loss)),
        "jit with shardings": jax.jit(value_and_grad(loss), in_shardings=row, out_shardings=(whole, row)),
    }
    for way, step in ways.items():
        value, grad = step(x)
        np.testing.assert_allclose(value, ref_value, rtol=2e-5, err_msg=f"{name}, {way}")
        np.testing.assert_allclose(grad, ref_grad, rtol=2e-4, atol=2e-5, err_msg=f"{name}, {way}")
        if way == "jit with shardings":
            assert grad.sharding.is_equivalent_to(row, 1), (name, way, grad.sharding)
        print(f"{name}, {way}: ok", flush=True)
    plan = dx.explain(value_and_grad(loss), x)
    if name in ("JAX-native ExpensiveFn", "dx.fuse", "custom_vjp site"):
        (site,) = plan.sites
        assert site.schedule == "deferred" and site.halves.startswith("program: its inputs are sharded"), plan


# dx.filter_value_and_grad inside `shard_map` (check_vma=False: see docs/accelerators.md), a site's
# halves per shard in the shard's program: each shard's value and gradient are plain JAX's
def per_shard(step):
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("i"), out_specs=(P("i"), P("i")), check_vma=False))


per_shard_site = dx.ExpensiveFn(
    fwd=lambda x: lax.scan(lambda u, _: (jnp.tanh(0.5 * u) + u, None), x, None, length=4)[0],
    bwd=lambda x, y, ct: jax.vjp(per_shard_site.fwd, x)[1](ct)[0],
    name="per shard",
)


def shard_loss(xs):
    return jnp.sum(jnp.sin(xs) * per_shard_site(xs))


def shard_reference(xs):  # the same in plain JAX: the site's forward, differentiated by JAX
    return jnp.sum(jnp.sin(xs) * per_shard_site.fwd(xs))


ours = per_shard(lambda xs: (lambda v, g: (v[None], g))(*dx.filter_value_and_grad(shard_loss)(xs)))
theirs = per_shard(lambda xs: (lambda v, g: (v[None], g))(*jax.value_and_grad(shard_reference)(xs)))
(value, grad), (ref_value, ref_grad) = ours(x), theirs(x)
np.testing.assert_allclose(value, ref_value, rtol=2e-5)
np.testing.assert_allclose(grad, ref_grad, rtol=2e-5, atol=1e-6)
assert "callback" not in str(jax.make_jaxpr(ours)(x))
print("inside shard_map: ok")
print("ok")
