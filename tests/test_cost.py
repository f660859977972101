"""The schedule chosen by cost: `dx.Cost` hints, timings of earlier calls, equal-cost
defaults, the estimates `explain` shows, `max_basis` as a fixed rule; the newcomer's
complex overlap through `dx.sparse_solve` deferred by default; errors."""

import concurrent.futures as cf
import math
import multiprocessing
import os
import pickle
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx
from deferax._host import _timing
from deferax._plan import _cost

from .helpers import assert_tree_allclose
from .test_sparse_solve import COMPLEX, Tally, dense, run, sparse


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
    key = solve_key(pattern)
    measured = _cost.TIMINGS.decided(*key)
    assert set(measured) == {"setup", "fwd", "bwd"}
    expected = measured["setup"] + measured["fwd"] + measured["bwd"] + 2 * _cost.STAGE_SECONDS
    assert estimates.standard == pytest.approx(expected)
    # later timings change nothing (no flip-flop), until the user asks for new ones
    first = _cost.TIMINGS.decided(*key)
    run(loss, (values, b))
    _cost.observe(*key, setup=10 * measured["setup"])
    assert _cost.TIMINGS.decided(*key) == first == measured
    dx.forget_timings()
    assert _cost.TIMINGS.decided(*key) == {}
    assert dx.explain(loss, (values, b)).sites[0].estimates.source == "defaults"
    # a hint's numbers take precedence over the timings
    hinted = dx.explain(three_overlaps(sparse(pattern, cost=dx.Cost(setup=1.0, fwd=1.0, bwd=1.0))), (values, b)).sites[
        0
    ]
    assert hinted.estimates.source == "hint"


# ----------------------------------------------------------------------------- a `dx.host` site timed

SLEEP_FWD, SLEEP_ADJOINT = 0.030, 0.001  # seconds: a slow forward, a quick adjoint


def slow_sin(x):
    time.sleep(SLEEP_FWD)
    return np.sin(x)


def quick_adjoint(x, ct):
    time.sleep(SLEEP_ADJOINT)
    return ct * np.cos(x)


def sleepy(**kwargs):
    """A host site (module-level functions: picklable for a process pool)."""
    out = jax.ShapeDtypeStruct((4,), jnp.float64)
    return dx.host(slow_sin, adjoint=quick_adjoint, out=out, name="sleepy", **kwargs)


SLEEPY = (sleepy().timings_key, ((4,),))  # the key of its timings: its host functions and input shapes


def solve_key(pattern):
    """The key of a `dx.sparse_solve`'s timings on `pattern`: the solve itself and its input shapes."""
    shapes = ((pattern.nnz,), (pattern.n,))
    (key,) = [key for key in _cost.TIMINGS.sites(sampled=True) if key[1] == shapes]
    return key


def deferred_seconds(fwd, bwd, k, workers):
    """The deferred-basis estimate of a site whose forward and `k` adjoints are separate jobs,
    `workers` at a time: the longest job, or all of them shared by the workers."""
    jobs = [fwd] + [bwd] * k
    return max(max(jobs), sum(jobs) / workers) + _cost.STAGE_SECONDS


def steps(loss, n):
    """`n` eager value-and-gradient steps: for each, the schedule `explain` shows before it,
    where its estimates come from, and the counts of the host jobs that ran."""
    seen = []
    for _ in range(n):
        site = dx.explain(loss, X).sites[0]
        with dx.record() as timeline:
            got = run(loss, X)
        assert_tree_allclose(got, jax.value_and_grad(power(jnp.sin))(X), rtol=1e-12, atol=1e-14)
        seen.append((site.schedule, site.estimates.source, timeline.counts()))
    return seen


def test_a_host_sites_timings_change_its_schedule_once():
    """Equal costs keep k=4 standard; measured, the four 1 ms adjoints fit beside the 30 ms
    forward on two workers: deferred-basis from the call after the SAMPLES-th, and then kept."""
    loss = power(sleepy(cost=dx.Cost(workers=2)))
    standard, basis = {"fwd": 1, "adjoint": 1}, {"fwd": 1, "adjoint": 4}
    expected = [("standard", "defaults", standard)] * _cost.SAMPLES + [("deferred-basis", "measured", basis)] * 2
    assert steps(loss, _cost.SAMPLES + 2) == expected
    measured = _cost.TIMINGS.decided(*SLEEPY)  # (`fwd` and `bwd` decided together, after the SAMPLES-th call)
    assert set(measured) == {"fwd", "bwd"} and measured["fwd"] >= SLEEP_FWD and measured["bwd"] >= SLEEP_ADJOINT
    # one sample of each per call (a call's four adjoints are one), and none kept once decided
    assert _cost.TIMINGS.sampled(*SLEEPY) == {}
    site = dx.explain(loss, X).sites[0]
    assert site.estimates == dx.Estimates(
        standard=measured["fwd"] + measured["bwd"] + 2 * _cost.STAGE_SECONDS,
        deferred=deferred_seconds(measured["fwd"], measured["bwd"], 4, workers=2),
        source="measured",
    )
    dx.forget_timings()  # measured again from the next calls
    assert steps(loss, _cost.SAMPLES + 1) == expected[: _cost.SAMPLES + 1]


def fused_sin(x, ct):
    time.sleep(SLEEP_FWD)
    return np.sin(x), ct * np.cos(x)


def test_a_fused_job_is_split_as_equal_costs():
    """A `fused` job's time is the forward's and the adjoint's together: half each."""
    cost = dx.Cost(workers=1)  # (k = 4 calls of `fused` one after the other: slower than two)
    site = dx.host(fused=fused_sin, out=jax.ShapeDtypeStruct((4,), jnp.float64), name="sleepy", cost=cost)
    seen = steps(power(site), _cost.SAMPLES + 1)
    # the standard schedule calls it twice a step: two samples
    timed = math.ceil(_cost.SAMPLES / 2)
    assert [s[:2] for s in seen] == [("standard", "defaults")] * timed + [("standard", "measured")] * (
        _cost.SAMPLES + 1 - timed
    )
    assert [s[2] for s in seen] == [{"fused": 2}] * (_cost.SAMPLES + 1)
    measured = _cost.TIMINGS.decided(site.timings_key, ((4,),))
    assert measured["fwd"] == measured["bwd"] >= SLEEP_FWD / 2


def test_a_process_pool_sites_jobs_are_timed_in_the_workers():
    """The timing wrapper travels with the jobs (pickled); the pool's two workers run the
    forward beside the adjoints."""
    pool = cf.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
    try:
        seen = steps(power(sleepy(executor=pool)), _cost.SAMPLES + 1)
    finally:
        pool.shutdown()
    assert [s[:2] for s in seen] == [("standard", "defaults")] * _cost.SAMPLES + [("deferred-basis", "measured")]
    measured = _cost.TIMINGS.decided(*SLEEPY)
    assert measured["fwd"] >= SLEEP_FWD and measured["bwd"] >= SLEEP_ADJOINT


def test_a_timed_job_reaches_a_dask_worker_without_deferax():
    """For Dask, the timing wrapper pickles by value: a fresh Python loads and runs the job
    without importing deferax or JAX (a cluster's workers need only the solver's packages)."""
    pytest.importorskip("cloudpickle")
    data = pickle.dumps({"job": _timing.Timed(np.sin, by_value=True)})
    code = (
        "import pickle, sys; job = pickle.loads(sys.stdin.buffer.read())['job']; y, t = job(0.5); "
        "print(y, t >= 0, 'deferax' in sys.modules, 'jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, timeout=120)
    assert out.stdout.decode().split() == [str(np.sin(0.5)), "True", "False", "False"], out.stderr.decode()


def test_workers_are_taken_from_the_executor():
    """fwd 3, bwd 1, k = 4: standard 4; deferred-basis 7 on one worker, 3.5 on two, 3 on more."""
    cost = dx.Cost(fwd=3.0, bwd=1.0)
    standard = 4.0 + 2 * _cost.STAGE_SECONDS
    cores = len(os.sched_getaffinity(0))
    processes = cf.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
    threads = [cf.ThreadPoolExecutor(1), cf.ThreadPoolExecutor(2), cf.ThreadPoolExecutor(64)]
    cases = [
        ({"executor": threads[0]}, min(2, cores)),  # (a pool's size is not public: the cores)
        ({"executor": threads[0], "cost": dx.Cost(fwd=3.0, bwd=1.0, workers=1)}, 1),  # (unless the hint says)
        ({"executor": threads[1]}, min(2, cores)),
        ({"executor": threads[2]}, cores),  # (a thread pool: at most the cores)
        ({"executor": processes}, 2),
        ({"executor": processes, "thread_safe": False}, 1),  # (one job at a time)
        ({"executor": threads[0], "cost": dx.Cost(fwd=3.0, bwd=1.0, workers=3)}, 3),  # (the hint wins)
    ]
    try:  # (nothing runs: explain only traces)
        for kwargs, workers in cases:
            site = dx.explain(power(sleepy(**{"cost": cost} | kwargs)), X).sites[0]
            deferred = deferred_seconds(3.0, 1.0, 4, workers)
            assert site.estimates == dx.Estimates(standard=standard, deferred=deferred, source="hint"), kwargs
            assert site.schedule == ("deferred-basis" if deferred < standard else "standard"), kwargs
    finally:
        processes.shutdown()
        for pool in threads:
            pool.shutdown()


def test_a_sparse_solve_is_timed_once_per_part():
    """`dx.sparse_solve` times its factorisation and each solve itself; its jobs are not
    also timed whole (which would count the forward job as a right-hand side)."""
    values, pattern, b = COMPLEX
    run(three_overlaps(sparse(pattern)), (values, b))  # standard: factor, solve, solve the adjoint
    assert {what: len(samples) for what, samples in _cost.TIMINGS.sampled(*solve_key(pattern)).items()} == {
        "setup": 1,
        "fwd": 1,
        "bwd": 1,
    }


@pytest.mark.parametrize(
    "kwargs, field, expected",
    [
        ({"fwd": -1.0}, "fwd", "a non-negative, finite number or None"),
        ({"bwd": float("nan")}, "bwd", "a non-negative, finite number or None"),
        ({"setup": float("inf")}, "setup", "a non-negative, finite number or None"),
        ({"stage": -1e-3}, "stage", "a non-negative, finite number or None"),
        ({"workers": 0}, "workers", "a positive int or None (taken from the executor)"),
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
