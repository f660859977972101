"""`deferax.lineax` and a recognised sparsax call with their inputs sharded over 2 CPU devices,
under `jit` and eagerly: a value and gradient (and a Hessian-vector product through Lineax),
each against the same program on a dense solve. Run by tests/test_devices.py (2 devices,
fixed when JAX starts)."""

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import sparsax
from sharded_ring import b, pattern, t, values  # (x64 on, 2 devices checked)

import deferax as dx
from deferax._sparse import _program
from deferax.lineax import SparseOperator, SparseSolver


def loss_of(solve):
    return lambda v, b: jnp.sum(jnp.sin(solve(v, b))) + jnp.sum(solve(v, b) ** 2)


def close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-11)


dense = loss_of(lambda v, b: jnp.linalg.solve(pattern.todense(v), b))
want = jax.value_and_grad(dense, argnums=(0, 1))(values, b)
want_hvp = jax.jvp(lambda v: jax.grad(dense)(v, b), (values,), (t,))


def through_lineax(solver):
    return loss_of(lambda v, b: lx.linear_solve(SparseOperator(v, pattern), b, solver=solver).value)


for host in (None, dx.SuperLU()):  # (inside the program where it would be; on the host)
    ours = through_lineax(SparseSolver(solver=host, nonfinite="nan"))
    for run in (jax.value_and_grad(ours, argnums=(0, 1)), jax.jit(jax.value_and_grad(ours, argnums=(0, 1)))):
        close(run(values, b), want)
    hvp = jax.jit(lambda v, ours=ours: jax.jvp(lambda v: jax.grad(ours)(v, b), (v,), (t,)))
    close(hvp(values), want_hvp)

# sparsax's `lu_solve`, unchanged, recognised (its factorisation taken as long: a host site)
_program.trial_seconds = lambda pattern, complex_=False: 0.05
rows, cols = pattern.rows.astype(np.int32), pattern.cols.astype(np.int32)
theirs = loss_of(lambda v, b: sparsax.lu_solve(rows, cols, v, b))
fn = dx.filter_value_and_grad(lambda p: theirs(*p))
assert dx.explain(fn, (values, b)).sites[0].name == "sparsax.lu_solve (recognised)"
for run in (fn, jax.jit(fn)):
    value, grads = run((values, b))
    close((value, grads), want)
print("ok")
