"""The forward-basis choice made once, in the plan: under `dx.filter_value_and_grad` a site
is differentiated on the strategy its plan names (standard, or forward-basis), even when its
timings are decided between the analysis and stage 3 (here by a callback that runs in the
loss ahead of the site); a plain `jax.grad` still chooses in the site's JVP rule, from the
timings known then."""

import jax
import jax.numpy as jnp
import pytest

import deferax as dx
from deferax._plan import _cost

from .helpers import assert_tree_allclose, host_sine

# (setup, fwd, bwd) decided by the callback: the opposite of what equal costs choose
TO_STANDARD = (0.0, 1.0, 1.0)  # n = 2: forward-basis by the fixed rule; standard by these
TO_FORWARD_BASIS = (10.0, 1.0, 0.1)  # n = 12: standard by the fixed rule; forward-basis by these


@pytest.fixture(autouse=True)
def no_timings():
    dx.forget_timings()
    yield
    dx.forget_timings()


def loss_deciding(f, x, timings, nested=False):
    """A loss whose cotangent reaches `f` through its output (so the site is not deferred),
    and which decides `f`'s timings when it runs, before it calls `f` (`nested`: inside a
    `lax.scan`, where sites stay standard or forward-basis)."""
    setup, fwd, bwd = timings

    def decide():
        for _ in range(_cost.SAMPLES):
            _cost.observe(f.timings_key, ((x.shape[0],),), setup=setup, fwd=fwd, bwd=bwd)

    def call(x):
        return jax.lax.scan(lambda c, _: (c, f(x)), 0.0, None, length=1)[1][0] if nested else f(x)

    def loss(x):
        jax.debug.callback(decide)
        return jnp.sum(call(x) ** 2 * jnp.linspace(1.0, 2.0, x.shape[0]))

    return loss


def plain(x):
    return jnp.sum(jnp.sin(x) ** 2 * jnp.linspace(1.0, 2.0, x.shape[0]))


@pytest.mark.parametrize(
    "n, timings, planned, runs, then",
    [
        (2, TO_STANDARD, "forward-basis", ["jvp_batch"], ["bwd", "fwd"]),
        (12, TO_FORWARD_BASIS, "standard", ["bwd", "fwd"], ["jvp_batch"]),
    ],
    ids=["planned-forward-basis", "planned-standard"],
)
@pytest.mark.parametrize("nested", [False, True], ids=["top-level", "in-scan"])
def test_timings_decided_after_the_analysis_do_not_change_the_planned_strategy(n, timings, planned, runs, then, nested):
    calls = []
    f = host_sine(calls)
    x = jnp.linspace(0.1, 1.2, n)
    loss = loss_deciding(f, x, timings, nested)
    assert dx.explain(loss, x).sites[0].schedule == planned  # (equal costs: nothing decided yet)
    assert _cost.TIMINGS.decided(f.timings_key, ((n,),)) == {}

    value, grad = dx.filter_value_and_grad(loss)(x)
    jax.effects_barrier()
    assert sorted(calls) == runs  # the plan's strategy ran, not the one the new timings choose
    assert _cost.TIMINGS.decided(f.timings_key, ((n,),)) != {}  # (the callback did decide them, in the run)
    assert_tree_allclose((value, grad), jax.value_and_grad(plain)(x), rtol=1e-12, atol=1e-14)

    # Now decided, the next plan follows the timings; so does the JVP rule of a plain `jax.grad`.
    assert dx.explain(loss, x).sites[0].schedule != planned
    for transform in (dx.filter_value_and_grad, jax.value_and_grad):
        calls.clear()
        got = transform(loss)(x)
        jax.effects_barrier()
        assert sorted(calls) == then
        assert_tree_allclose(got, jax.value_and_grad(plain)(x), rtol=1e-12, atol=1e-14)
