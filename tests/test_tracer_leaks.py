"""No tracer outlives a gradient: `jax.checking_leaks()` around each schedule, eager and
under `jit`, against plain JAX on the same program. From jax 0.11, `jax.vjp` itself looks for
leaked tracers, so a leak there is an error for every user, not only under this check."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import deferax as dx

from .helpers import Counter, assert_tree_allclose, make

X = jnp.array([0.3, -0.2, 0.8, 0.5])
W = jnp.array([1.0, -2.0, 0.5, 3.0])


def ref(x):
    return jnp.sin(x) * jnp.exp(0.3 * x)


# (implementations, loss of the expensive function, the schedule `explain` must report, the
# implementation runs of one gradient)
CASES = {
    "deferred": (("fwd", "bwd", "fused"), lambda g: lambda p: jnp.sum(W * g(p)), {"fused": 1}),
    "deferred-basis": (("fwd", "bwd", "fused"), lambda g: lambda p: jnp.log(1 + jnp.sum(g(p)) ** 2), {"fused": 1}),
    "forward-basis": (("fwd", "bwd", "jvp_batch"), lambda g: lambda p: jnp.sum(g(p) ** 2), {"jvp_batch": 1}),
}


@pytest.mark.parametrize("schedule", list(CASES))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_no_leaked_tracers(schedule, jit):
    impls, loss, runs = CASES[schedule]
    counter = Counter()
    f = make(ref, impls, counter)
    grad = dx.filter_value_and_grad(loss(f))
    with jax.checking_leaks():
        assert dx.explain(loss(f), X).sites[0].schedule == schedule
        got = (eqx.filter_jit(grad) if jit else grad)(X)
    jax.effects_barrier()
    assert_tree_allclose(got, jax.value_and_grad(loss(ref))(X))
    assert {k: v for k, v in counter.counts.items() if v} == runs
