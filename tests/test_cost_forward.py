"""The forward-basis strategy chosen by cost (issue 22, item 2): with a `dx.Cost` hint or
timings of earlier calls, a site with `jvp_batch` (or a host `jvp`) is differentiated from
`n` tangents on the forward pass iff that is estimated faster than `fwd` then `bwd`; with
equal-cost defaults the fixed rule `n <= 8` stays; `max_tangents` caps, `prefer` forces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx
from deferax._plan import _cost

from .helpers import assert_tree_allclose, host_sine

STAGE = _cost.STAGE_SECONDS
HEAVY = dx.Cost(setup=10.0, fwd=1.0, bwd=0.1)  # a factorisation dominates
LIGHT = dx.Cost(fwd=1.0, bwd=1.0)


@pytest.fixture(autouse=True)
def no_timings():
    dx.forget_timings()
    yield
    dx.forget_timings()


def standard_by_hand(setup, fwd, bwd):
    """`fwd` (with its setup) on the forward pass, `bwd` (with its setup again) on the
    backward pass: two stages."""
    return (setup + fwd) + (setup + bwd) + 2 * STAGE


def forward_basis_by_hand(setup, fwd, tangent, n, jobs=1, workers=1):
    """The output and `n` tangents: one job, or `n` jobs (each with the output) on `workers`."""
    if jobs == 1:
        return setup + fwd + n * tangent + STAGE
    one = setup + fwd + tangent
    return max(one, n * one / workers) + STAGE


def loss(f):
    return lambda x: jnp.sum(f(x) ** 2 * jnp.linspace(1.0, 2.0, x.shape[0]))


def xs(n):
    return jnp.linspace(0.1, 1.2, n)


def check_run(f, x, expected_calls, calls, jit=False):
    """One value and gradient, through deferax and through `jax.value_and_grad` (the site's
    own rule, which chooses the same way): the host functions that ran, and the result
    against plain JAX."""
    for transform in (dx.filter_value_and_grad, jax.value_and_grad):
        fn = transform(loss(f))
        fn = jax.jit(fn) if jit else fn
        calls.clear()
        got = fn(x)
        jax.effects_barrier()
        assert sorted(calls) == sorted(expected_calls)
        assert_tree_allclose(got, jax.value_and_grad(loss(jnp.sin))(x), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "n, cost, schedule",
    [
        (4, HEAVY, "forward-basis"),  # also the fixed rule's choice
        (12, HEAVY, "forward-basis"),  # n > 8: the fixed rule chose standard
        (120, HEAVY, "standard"),  # n tangents now cost more than a second factorisation
        (4, LIGHT, "standard"),  # no setup to share: one tangent costs one adjoint
    ],
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jvp_batch_chosen_by_a_hint(n, cost, schedule, jit):
    calls = []
    f = host_sine(calls, cost=cost)
    x = xs(n)
    site = dx.explain(loss(f), x).sites[0]
    setup = cost.setup or 0.0
    standard = standard_by_hand(setup, cost.fwd, cost.bwd)
    fb = forward_basis_by_hand(setup, cost.fwd, cost.bwd, n)
    assert site.estimates == dx.Estimates(standard=standard, deferred=None, source="hint", forward_basis=fb)
    assert (fb < standard) == (schedule == "forward-basis")
    assert site.schedule == schedule and site.n == (n if schedule == "forward-basis" else None)
    shown = f"standard {standard:.4g} s, forward-basis {fb:.4g} s (from cost=)"
    first = "no `fused` implementation, and "
    if schedule == "forward-basis":
        assert site.reason.startswith(first) and site.reason.endswith(
            f"; forward-basis: the output and n={n} tangents in one call, estimated faster than `fwd` then `bwd`"
        )
        assert f"estimated wall time:\n  #0 {shown}\n" in str(dx.explain(loss(f), x))
        check_run(f, x, ["jvp_batch"], calls, jit)
    else:
        assert site.reason.startswith(first) and site.reason.endswith(
            f"; the forward-basis strategy with its n={n} tangents is estimated slower: {shown}"
        )
        assert "estimated wall time:" not in str(dx.explain(loss(f), x))  # (the note gives them)
        check_run(f, x, ["fwd", "bwd"], calls, jit)


def test_the_worked_figures():
    """The formulas above, worked out once by hand (`setup=10, fwd=1, bwd=0.1`)."""
    f = host_sine([], cost=HEAVY)
    estimates = [dx.explain(loss(f), xs(n)).sites[0].estimates for n in (4, 12, 120)]
    assert [e.standard for e in estimates] == pytest.approx([21.102] * 3)
    assert [e.forward_basis for e in estimates] == pytest.approx([11.401, 12.201, 23.001])
    assert str(estimates[2]) == "standard 21.1 s, forward-basis 23 s (from cost=)"


@pytest.mark.parametrize("workers, schedule", [(4, "forward-basis"), (1, "standard")])
def test_a_host_jvp_alone_runs_one_job_per_tangent_on_workers(workers, schedule):
    calls = []
    cost = dx.Cost(setup=10.0, fwd=1.0, bwd=0.1, workers=workers)
    f = host_sine(calls, cost=cost, jvp_only=True)
    x = xs(4)
    site = dx.explain(loss(f), x).sites[0]
    fb = forward_basis_by_hand(10.0, 1.0, 0.1, 4, jobs=4, workers=workers)
    assert site.estimates.forward_basis == pytest.approx(fb)  # 11.101 on 4 workers, 44.401 on 1
    assert site.estimates.standard == pytest.approx(standard_by_hand(10.0, 1.0, 0.1))
    assert site.schedule == schedule
    check_run(f, x, ["jvp"] * 4 if schedule == "forward-basis" else ["fwd", "bwd"], calls)


def test_timings_of_earlier_calls_choose_once_known():
    """Timings as the runner reports them (fed here by hand: no timed assertion): until
    `SAMPLES` are seen the fixed rule holds (n = 12: standard); then the estimates choose."""
    calls = []
    f = host_sine(calls)
    x = xs(12)
    shapes = ((12,),)
    for _ in range(_cost.SAMPLES):
        site = dx.explain(loss(f), x).sites[0]
        assert site.schedule == "standard" and site.estimates is None
        _cost.observe(f.timings_key, shapes, setup=0.010, fwd=0.001, bwd=0.0001)
    site = dx.explain(loss(f), x).sites[0]
    assert site.schedule == "forward-basis" and site.estimates.source == "measured"
    assert site.estimates.forward_basis == pytest.approx(forward_basis_by_hand(0.010, 0.001, 0.0001, 12))
    assert site.estimates.standard == pytest.approx(standard_by_hand(0.010, 0.001, 0.0001))
    assert "(measured)" in str(dx.explain(loss(f), x))
    check_run(f, x, ["jvp_batch"], calls)
    dx.forget_timings()
    assert dx.explain(loss(f), x).sites[0].schedule == "standard"
    check_run(f, x, ["fwd", "bwd"], calls)


def test_equal_cost_defaults_keep_the_fixed_rule():
    calls = []
    f = host_sine(calls)
    site = dx.explain(loss(f), xs(8)).sites[0]
    assert (site.schedule, site.n, site.estimates) == ("forward-basis", 8, None)
    assert site.reason == (
        "no `fused` implementation, and its `bwd` reads `y` (give `adjoint` and `combine`, or `fused`); "
        "forward-basis: the output and n=8 tangents in one call, one stage where `fwd` then `bwd` take two"
    )
    check_run(f, xs(8), ["jvp_batch"], calls)
    site = dx.explain(loss(f), xs(9)).sites[0]
    assert (site.schedule, site.estimates) == ("standard", None)
    assert "forward-basis" not in site.reason


C = jnp.array([1.0, 2.0, 3.0])
spread = lambda x: jnp.sin(x[:, None] * C)  # noqa: E731  (n = 2 inputs, 6 outputs)


def test_a_traced_site_shows_all_three_estimates():
    """A site that could be deferred (its `bwd` does not read `y`), its loss nonlinear in
    6 outputs (k = 6) of 2 inputs (n = 2): deferring 6 cotangents is estimated slower
    than standard, 2 tangents faster."""
    f = dx.ExpensiveFn(
        fwd=spread,
        bwd=lambda x, y, ct: jnp.sum(ct * C * jnp.cos(x[:, None] * C), axis=1),
        jvp_batch=lambda x, ts: (spread(x), ts[:, :, None] * C * jnp.cos(x[:, None] * C)),
        name="spread",
        cost=dx.Cost(setup=2.0, fwd=1.0, bwd=1.0),
    )
    sq = lambda g: lambda x: jnp.sum(g(x) ** 2 * jnp.arange(1.0, 7.0).reshape(2, 3))  # noqa: E731
    x = jnp.array([0.3, -0.7])
    site = dx.explain(sq(f), x).sites[0]
    standard = standard_by_hand(2.0, 1.0, 1.0)  # 6.002
    deferred = 2.0 + 1.0 + 6 * 1.0 + STAGE  # one job: the forward and 6 adjoints
    fb = forward_basis_by_hand(2.0, 1.0, 1.0, 2)  # 5.001
    assert site.schedule == "forward-basis" and site.n == 2
    assert site.estimates == dx.Estimates(standard=standard, deferred=deferred, source="hint", forward_basis=fb)
    assert site.reason.startswith("its cotangent depends on its own output")
    assert "deferring its k=6 fixed cotangents is estimated slower: standard 6.002 s, deferred 9.001 s" in site.reason
    assert str(site.estimates) == "standard 6.002 s, deferred 9.001 s, forward-basis 5.001 s (from cost=)"
    with dx.record() as timeline:
        got = dx.filter_value_and_grad(sq(f))(x)
    assert timeline.counts() == {"jvp_batch": 1}
    assert_tree_allclose(got, jax.value_and_grad(sq(spread))(x), rtol=1e-12, atol=1e-14)


def test_max_tangents_caps_and_prefer_forces():
    calls = []
    capped = host_sine(calls, cost=HEAVY, max_tangents=8)
    site = dx.explain(loss(capped), xs(12)).sites[0]  # estimated faster, but over the cap
    assert (site.schedule, site.estimates) == ("standard", None)
    check_run(capped, xs(12), ["fwd", "bwd"], calls)
    forced = host_sine(calls, cost=LIGHT, prefer="forward-basis")
    site = dx.explain(loss(forced), xs(4)).sites[0]  # estimated slower, but asked for
    assert (site.schedule, site.reason) == ("forward-basis", "prefer='forward-basis' was given")
    check_run(forced, xs(4), ["jvp_batch"], calls)


def test_a_site_with_no_reverse_mode_stays_forward_basis():
    calls = []

    def jvp_batch(x, ts):
        calls.append("jvp_batch")
        return np.sin(x), ts * np.cos(x)

    f = dx.host(jvp_batch=jvp_batch, out=jax.ShapeDtypeStruct((12,), jnp.float64), name="sine", cost=LIGHT)
    site = dx.explain(loss(f), xs(12)).sites[0]
    assert site.schedule == "forward-basis" and site.estimates is None
    check_run(f, xs(12), ["jvp_batch"], calls)
