"""The schedule chosen by cost: `dx.Cost` hints, timings of earlier calls, equal-cost
defaults, the estimates `explain` shows, `max_basis` as a fixed rule; the newcomer's
complex overlap through `dx.sparse_solve` deferred by default; errors."""

import concurrent.futures as cf
import multiprocessing
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx
from deferax._plan import _cost

from .helpers import assert_tree_allclose
from .test_sparse_solve import COMPLEX, Tally, dense, run, sparse


@pytest.fixture(autouse=True)
def no_timings():
    """Each test starts with no timings of earlier calls (a sparse solve times its own)."""
    dx.forget_timings()
    yield
    dx.forget_timings()


def sim_site(**kwargs):
    return dx.ExpensiveFn(
        fwd=jnp.sin,
        bwd=lambda x, y, ct: ct * jnp.cos(x),
        fused=lambda x, ct: (jnp.sin(x), ct * jnp.cos(x)),
        name="sim",
        **kwargs,
    )


X = jnp.linspace(0.1, 1.0, 4)
power = lambda f: lambda x: jnp.sum(f(x) ** 2)  # noqa: E731  (k = 4: every entry)


def test_a_hint_with_a_shared_setup_defers_four_cotangents():
    sim = sim_site(cost=dx.Cost(setup=10.0, fwd=1.0, bwd=0.1))
    site = dx.explain(power(sim), X).sites[0]
    assert (site.schedule, site.k) == ("deferred-basis", 4)
    # standard: setup + fwd, then setup + bwd, two stages; deferred-basis: setup + fwd + 4 bwd, one stage
    assert site.estimates == dx.Estimates(
        standard=21.1 + 2 * _cost.STAGE_SECONDS, deferred=11.4 + _cost.STAGE_SECONDS, source="hint"
    )
    assert "#0 standard 21.1 s, deferred 11.4 s (from cost=)" in str(dx.explain(power(sim), X))
    with dx.record() as timeline:
        got = run(power(sim), X)
    assert_tree_allclose(got, jax.value_and_grad(power(jnp.sin))(X), rtol=1e-12, atol=1e-14)
    assert timeline.counts() == {"fused": 1}


def test_without_a_hint_four_cotangents_stay_standard():
    site = dx.explain(power(sim_site()), X).sites[0]
    assert (site.schedule, site.k) == ("standard", 4)
    assert site.reason.endswith(
        "deferring its k=4 fixed cotangents is estimated slower: standard 2.02, deferred 5.01 (equal costs assumed)"
    )


def test_an_explicit_max_basis_is_a_fixed_rule():
    sim = sim_site(cost=dx.Cost(setup=10.0, fwd=1.0, bwd=0.1))
    site = dx.explain(dx.filter_value_and_grad(power(sim), max_basis=2), X).sites[0]
    assert site.schedule == "standard" and site.reason.endswith("k=4 fixed cotangents, more than max_basis=2")
    site = dx.explain(dx.filter_value_and_grad(power(sim_site()), max_basis=4), X).sites[0]
    assert site.schedule == "deferred-basis"  # what the user allowed, whatever the estimates


def three_overlaps(solve):
    """k = 6: three complex overlaps, each seen through its squared magnitude."""
    modes = jnp.asarray(np.random.default_rng(2).normal(size=(3, 16)) + 0j)
    return lambda vb: jnp.sum(jnp.abs(modes @ solve(*vb)) ** 2)


def test_a_sparse_solve_reuses_its_factorisation_on_threads_not_on_processes():
    values, pattern, b = COMPLEX
    cost = dx.Cost(setup=10.0, fwd=1.0, bwd=1.0)
    # threads: the forward's factorisation serves the backward pass; k = 6 is 3 complex solves
    site = dx.explain(three_overlaps(sparse(pattern, cost=cost)), (values, b)).sites[0]
    assert (site.schedule, site.k) == ("standard", 6)
    assert site.estimates == dx.Estimates(
        standard=12.0 + 2 * _cost.STAGE_SECONDS, deferred=14.0 + _cost.STAGE_SECONDS, source="hint"
    )
    pool = cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:  # (nothing runs: explain only traces)
        site = dx.explain(three_overlaps(sparse(pattern, cost=cost, executor=pool)), (values, b)).sites[0]
    finally:
        pool.shutdown()
    assert (site.schedule, site.k) == ("deferred-basis", 6)
    assert site.estimates.standard == pytest.approx(22.0 + 2 * _cost.STAGE_SECONDS)


def test_the_newcomers_complex_overlap_is_deferred_by_default():
    """Issue 23: `|<m, x>|^2` of a SciPy sparse solve, k = 2, with no option: one job holds
    the factorisation, the forward and one adjoint (`1j * m`'s is 1j times `m`'s)."""
    values, pattern, b = COMPLEX
    m = jnp.asarray(np.random.default_rng(3).normal(size=16) + 1j)
    loss = lambda solve: lambda vb: jnp.abs(jnp.vdot(m, solve(*vb))) ** 2  # noqa: E731
    tally = Tally()
    site = dx.explain(loss(sparse(pattern, tally)), (values, b)).sites[0]
    assert (site.schedule, site.k) == ("deferred-basis", 2)
    with dx.record() as timeline:
        got = run(loss(sparse(pattern, tally)), (values, b))
    assert_tree_allclose(got, jax.value_and_grad(loss(dense(pattern)))((values, b)), rtol=1e-11, atol=1e-12)
    assert timeline.counts() == {"fused_batch": 1}
    assert tally.counts == {"factor": 1, "solve": 2, "rhs": 2}


def test_timings_of_earlier_calls_are_used_and_kept_stable():
    values, pattern, b = COMPLEX
    loss = three_overlaps(sparse(pattern))
    for _ in range(_cost.SAMPLES):  # the least of the first calls' timings, kept after the last
        assert dx.explain(loss, (values, b)).sites[0].estimates.source == "defaults"
        run(loss, (values, b))
    estimates = dx.explain(loss, (values, b)).sites[0].estimates
    assert estimates.source == "measured"
    measured = _cost._DECIDED[("sparse_solve", ((pattern.nnz,), (pattern.n,)))]
    assert set(measured) == {"setup", "fwd", "bwd"}
    expected = measured["setup"] + measured["fwd"] + measured["bwd"] + 2 * _cost.STAGE_SECONDS
    assert estimates.standard == pytest.approx(expected)
    # later timings change nothing (no flip-flop), until the user asks for new ones
    before, first = _cost.version(), dict(measured)
    run(loss, (values, b))
    _cost.observe("sparse_solve", ((pattern.nnz,), (pattern.n,)), setup=10 * measured["setup"])
    assert (_cost.version(), measured) == (before, first)
    dx.forget_timings()
    assert _cost.version() == before + 1 and dx.explain(loss, (values, b)).sites[0].estimates.source == "defaults"
    # a hint's numbers take precedence over the timings
    hinted = dx.explain(three_overlaps(sparse(pattern, cost=dx.Cost(setup=1.0, fwd=1.0, bwd=1.0))), (values, b)).sites[
        0
    ]
    assert hinted.estimates.source == "hint"


@pytest.mark.parametrize(
    "kwargs, field, expected",
    [
        ({"fwd": -1.0}, "fwd", "a non-negative, finite number or None"),
        ({"bwd": float("nan")}, "bwd", "a non-negative, finite number or None"),
        ({"setup": float("inf")}, "setup", "a non-negative, finite number or None"),
        ({"stage": -1e-3}, "stage", "a non-negative, finite number or None"),
        ({"workers": 0}, "workers", "a positive int"),
    ],
)
def test_error_bad_cost(kwargs, field, expected):
    found = next(iter(kwargs.values()))
    message = (
        f"`dx.Cost`: `{field}` must be {expected}, but got {found!r}.\nGive seconds (or any one unit for every number)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        dx.Cost(**kwargs)


def test_error_cost_that_is_not_a_cost():
    message = "`ExpensiveFn(name='sim')`: `cost` must be a `dx.Cost` or None, but got 2.0. Give what the \
implementations cost:"
    with pytest.raises(TypeError, match=re.escape(message)):
        sim_site(cost=2.0)
    message = "`ExpensiveFn(name='f')`: `cost` must be a `dx.Cost` or None, but got {'fwd': 1}."
    with pytest.raises(TypeError, match=re.escape(message)):
        dx.host(lambda x: x, out=jax.ShapeDtypeStruct((2,), jnp.float64), name="f", cost={"fwd": 1})
    values, pattern, b = COMPLEX
    with pytest.raises(
        TypeError,
        match=re.escape("`dx.sparse_solve(name='sparse_solve')`: `cost` must be a `dx.Cost` or None, but got 'fast'."),
    ):
        dx.sparse_solve(values, pattern, b, cost="fast")
