"""Plans that must not wander: a site's timings are its own (not its name's), settling them
recompiles only the programs that contain the site, a plan changes at most once (also
under `vmap`), a `linear_adjoint` site is planned by the cost model, and `dx.Cost` checks
its `workers`."""

import logging
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx
from deferax._plan import _cost

from .helpers import COMPLEX as DEFAULT_COMPLEX
from .helpers import FLOAT, assert_tree_allclose
from .test_host import M1, X0, Runs, W, reference, solver
from .test_sparse_solve import COMPLEX, MODE, dense

SLEEP = 0.030  # seconds: a slow forward beside quick adjoints
OUT = jax.ShapeDtypeStruct((4,), FLOAT)
X = jnp.linspace(0.1, 1.0, 4)


def slow_sin(x):
    time.sleep(SLEEP)
    return np.sin(x)


def quick_adjoint(x, ct):
    return ct * np.cos(x)


def power(f):
    """k = 4: every entry of the output."""
    return lambda x: jnp.sum(f(x) ** 2)


def step(loss):
    """One eager value-and-gradient step, checked against plain JAX (the site is `sin`)."""
    got = jax.block_until_ready(dx.filter_value_and_grad(loss)(X))
    assert_tree_allclose(got, jax.value_and_grad(power(jnp.sin))(X), rtol=1e-12, atol=1e-14)


def settle(loss):
    """Run `loss` until its site's timings are decided (the SAMPLES-th call), then check so."""
    for _ in range(_cost.SAMPLES):
        step(loss)
    site = dx.explain(loss, X).sites[0]
    assert (site.schedule, site.estimates.source) == ("deferred-basis", "measured")


# ----------------------------------------------------------------------------- timings by the site's identity


@pytest.mark.parametrize("named", [True, False], ids=["name=solve", "default name"])
def test_another_sites_timings_under_the_same_name_do_not_change_a_plan(named):
    """A slow forward's timings make its k=4 site deferred-basis (four quick adjoints beside
    it on two workers); a new site with other host functions but the same name (given, or
    `<lambda>` by default) and input shapes is still planned from equal costs: standard."""
    cost = dx.Cost(workers=2)
    if named:
        slow = dx.host(slow_sin, adjoint=quick_adjoint, out=OUT, cost=cost, name="solve")
        fresh = dx.host(np.sin, adjoint=quick_adjoint, out=OUT, cost=cost, name="solve")
    else:
        slow = dx.host(lambda x: slow_sin(x), adjoint=lambda x, ct: quick_adjoint(x, ct), out=OUT, cost=cost)
        fresh = dx.host(lambda x: np.sin(x), adjoint=lambda x, ct: quick_adjoint(x, ct), out=OUT, cost=cost)
    assert slow.name == fresh.name
    settle(power(slow))
    site = dx.explain(power(fresh), X).sites[0]
    assert (site.schedule, site.k) == ("standard", 4)
    estimates = site.estimates
    assert estimates.source == "defaults"
    assert (estimates.standard, estimates.deferred) == pytest.approx((2.02, max(1.0, 5 / 2) + 0.01))
    with dx.record() as timeline:
        step(power(fresh))
    assert timeline.counts() == {"fwd": 1, "adjoint": 1}


def test_the_same_host_functions_share_their_timings_whatever_the_name():
    """The identity is the host functions and the input shapes: a site made again from the
    same functions (another name) uses the timings; other input shapes do not."""
    cost = dx.Cost(workers=2)
    settle(power(dx.host(slow_sin, adjoint=quick_adjoint, out=OUT, cost=cost, name="first")))
    again = dx.host(slow_sin, adjoint=quick_adjoint, out=OUT, cost=cost, name="second")
    assert dx.explain(power(again), X).sites[0].estimates.source == "measured"
    wider = dx.host(slow_sin, adjoint=quick_adjoint, out=jax.ShapeDtypeStruct((5,), FLOAT), name="first")
    assert dx.explain(power(wider), jnp.linspace(0.1, 1.0, 5)).sites[0].estimates.source == "defaults"


# ----------------------------------------------------------------------------- what a site's timings recompile


def test_a_sites_timings_settling_recompiles_only_the_programs_that_contain_it(caplog):
    """Each newly analysed program's plan is logged (INFO): count them per site."""
    cost = dx.Cost(workers=2)
    a = dx.host(slow_sin, adjoint=quick_adjoint, out=OUT, cost=cost, name="a")
    b = dx.host(np.sin, adjoint=quick_adjoint, out=OUT, name="b")

    def plans(name):
        return sum(r.getMessage().startswith(f"site #0 {name}:") for r in caplog.records)

    with caplog.at_level(logging.INFO, logger="deferax"):
        for _ in range(_cost.SAMPLES + 2):
            step(power(b))
        # the first call, and the call after its own timings are decided
        assert plans("b") == 2
        settle(power(a))
        step(power(a))
        assert plans("a") == 2
        for _ in range(2):
            step(power(b))
        assert plans("b") == 2  # `a`'s timings do not recompile `b`'s program
        dx.forget_timings()
        step(power(b))  # (back to the plan from equal costs, already compiled)
    assert plans("b") == 2


# ----------------------------------------------------------------------------- at most once, under vmap


def test_under_vmap_a_sparse_solves_plan_changes_at_most_once():
    """A `vmap` over 4 right-hand sides: each call is one sample of each timing (not one
    per solve), so the plan is made from equal costs for the first SAMPLES calls and from
    the timings after, with one change."""
    values, pattern, b = COMPLEX
    rhs = jnp.stack([b * (1.0 + 0.5 * j) for j in range(4)])
    mode = MODE.astype(DEFAULT_COMPLEX)

    def loss(solve):
        return lambda v: jnp.sum(jnp.abs(jax.vmap(lambda r: solve(v, r))(rhs) @ mode) ** 2)

    sparse = loss(lambda v, r: dx.sparse_solve(v, pattern, r))
    expected = jax.value_and_grad(loss(lambda v, r: dense(pattern)(v, r)))(values)
    seen = []
    for _ in range(6):
        site = dx.explain(sparse, values).sites[0]
        seen.append((site.schedule, site.estimates))
        got = jax.block_until_ready(dx.filter_value_and_grad(sparse)(values))
        assert_tree_allclose(got, expected, rtol=1e-10, atol=1e-10)
    sources = [estimates.source for _, estimates in seen]
    assert sources == ["defaults"] * _cost.SAMPLES + ["measured"] * (6 - _cost.SAMPLES)
    changes = sum(a != b for a, b in zip(seen[:-1], seen[1:], strict=True))
    assert changes <= 1, seen


def test_a_host_site_under_vmap_is_one_sample_a_call():
    """A `dx.host` site's jobs for a batch of 4 examples are one sample of each kind."""
    rows = jnp.stack([X * (1.0 + 0.1 * j) for j in range(4)])
    site = dx.host(np.sin, adjoint=quick_adjoint, out=OUT, name="batched")

    def loss(f):
        return lambda xs: jnp.sum(jax.vmap(f)(xs) ** 2)

    for calls in range(1, _cost.SAMPLES + 1):
        got = dx.filter_value_and_grad(loss(site))(rows)
        assert_tree_allclose(got, jax.value_and_grad(loss(jnp.sin))(rows), rtol=1e-12, atol=1e-14)
        source = dx.explain(loss(site), rows).sites[0].estimates.source
        assert source == ("measured" if calls == _cost.SAMPLES else "defaults"), calls


# ----------------------------------------------------------------------------- `linear_adjoint` by the cost model


def overlaps(f, *modes):
    """k = 2 per mode: complex overlaps of one call's output, each seen through its squared magnitude."""

    def loss(x):
        y = f(x)
        return sum(jnp.abs(jnp.vdot(m, y)) ** 2 for m in modes)

    return loss


@pytest.fixture
def cpu_round_trip(monkeypatch):
    """A CPU's round trip between stages, wherever the test runs (an accelerator's is measured
    where it runs, and moves the estimates these tests state)."""
    monkeypatch.setattr(_cost, "round_trip_seconds", lambda nbytes=0: _cost.STAGE_SECONDS)


def test_a_linear_adjoint_site_follows_its_cost_hint_to_the_basis_schedule(cpu_round_trip):
    """k = 4 of a complex output with a complex-linear adjoint is m = 2 solves: the forward
    and two adjoints on four workers take one solve's time, the standard schedule two. The
    hint decides (no hidden `max_basis=2` keeps it standard)."""
    runs = Runs()
    f = solver(runs, linear_adjoint=True, max_basis=None, cost=dx.Cost(fwd=1.0, bwd=1.0, workers=4))
    site = dx.explain(overlaps(f, M1, W), X0).sites[0]
    assert (site.schedule, site.k) == ("deferred-basis", 4)
    stage = _cost.STAGE_SECONDS
    assert site.estimates.source == "hint"
    assert (site.estimates.standard, site.estimates.deferred) == pytest.approx((2.0 + 2 * stage, 1.0 + stage))
    got = jax.block_until_ready(dx.filter_value_and_grad(overlaps(f, M1, W))(X0))
    assert_tree_allclose(got, jax.value_and_grad(overlaps(reference, M1, W))(X0), rtol=1e-12, atol=1e-12)
    assert runs.as_dict("fwd", "adjoint") == {"fwd": 1, "adjoint": 2}  # (the multiples not solved again)


def test_a_linear_adjoint_site_estimated_slower_says_so_not_max_basis(cpu_round_trip):
    """One worker and an expensive setup in every job: the deferred-basis schedule's four
    jobs cost twice the standard schedule's two. The reason names the estimates; the user
    set no `max_basis`, so none is named."""
    runs = Runs()
    cost = dx.Cost(setup=10.0, fwd=1.0, bwd=1.0, workers=1)
    f = solver(runs, linear_adjoint=True, max_basis=None, cost=cost)
    loss = overlaps(f, M1, W, W + 2 * M1)  # k = 6, m = 3
    site = dx.explain(loss, X0).sites[0]
    assert (site.schedule, site.k) == ("standard", 6)
    assert "max_basis" not in site.reason and "max_basis" not in str(dx.explain(loss, X0))
    assert site.reason.endswith(
        "deferring its k=6 fixed cotangents is estimated slower: standard 22 s, deferred 44 s (from cost=)"
    )
    plain = overlaps(reference, M1, W, W + 2 * M1)
    got = jax.block_until_ready(dx.filter_value_and_grad(loss)(X0))
    assert_tree_allclose(got, jax.value_and_grad(plain)(X0), rtol=1e-12, atol=1e-12)
    assert runs.as_dict("fwd", "adjoint") == {"fwd": 1, "adjoint": 1}


def test_a_linear_adjoint_complex_overlap_is_deferred_by_equal_costs():
    """Without a hint: k = 2 is one solve (m = 1), so equal costs defer it, as before."""
    runs = Runs()
    f = solver(runs, linear_adjoint=True, max_basis=None)
    loss = overlaps(f, M1)
    site = dx.explain(loss, X0).sites[0]
    assert (site.schedule, site.k, site.estimates.source) == ("deferred-basis", 2, "defaults")
    assert f.cost == dx.Cost(linear=True)
    got = jax.block_until_ready(dx.filter_value_and_grad(loss)(X0))
    assert_tree_allclose(got, jax.value_and_grad(overlaps(reference, M1))(X0), rtol=1e-12, atol=1e-12)
    assert runs.as_dict("fwd", "adjoint") == {"fwd": 1, "adjoint": 1}


# ----------------------------------------------------------------------------- `dx.Cost(workers=...)`


@pytest.mark.parametrize("workers", [2.5, True, 2.0, "2"])
def test_error_cost_workers_not_a_positive_int(workers):
    message = (
        f"`dx.Cost`: `workers` must be a positive int or None (taken from the executor), but got {workers!r}.\n"
        "Give seconds"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        dx.Cost(workers=workers)


def test_cost_workers_takes_a_numpy_int():
    cost = dx.Cost(workers=np.int64(3))
    assert cost.workers == 3 and type(cost.workers) is int
