"""Second order through `dx.sparse_solve` with the entries and `b` sharded over 2 CPU devices,
under `jit`: a Hessian-vector product and `jax.jvp` of a `dx.filter_value_and_grad` step, each
against the same program on a dense solve, one factorisation each. Run by
tests/test_devices.py (2 devices, fixed when JAX starts)."""

import jax
import jax.numpy as jnp
import numpy as np
from sharded_ring import b, pattern, t, values  # (x64 on, 2 devices checked)

import deferax as dx


class Tally:
    factor = 0


class Counting(dx.AbstractSparseSolver):
    def factor(self, matrix):
        Tally.factor += 1
        return dx.SuperLU().factor(matrix)

    def solve(self, factorisation, rhs, transpose):
        return dx.SuperLU().solve(factorisation, rhs, transpose)


def loss_of(solve):
    return lambda v: jnp.sum(jnp.sin(solve(v))) + jnp.sum(solve(v) ** 2)


ours = loss_of(lambda v: dx.sparse_solve(v, pattern, b, solver=Counting()))
dense = loss_of(lambda v: jnp.linalg.solve(pattern.todense(v), b))
want = jax.jvp(jax.grad(dense), (values,), (t,))
for k, run in enumerate(
    (
        jax.jit(lambda v: jax.jvp(jax.grad(ours), (v,), (t,))),
        jax.jit(lambda v: jax.jvp(dx.filter_grad(ours), (v,), (t,))),
    )
):
    Tally.factor = 0
    scale = 1.0 + 0.01 * (k + 1)  # (new entries each time: no factorisation found again)
    got = run(values * scale)
    ref = jax.jvp(jax.grad(dense), (values * scale,), (t,))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-11)
    assert Tally.factor == 1, (k, Tally.factor)
print("ok")
