"""What ran, when: `dx.record()` against counts measured independently (a
`jax.debug.callback` inside each implementation), for every schedule, eager and under
`jit`; overlap in time; the plot; the "deferax" logger; named profiler regions."""

import concurrent.futures
import gc
import glob
import logging
import os
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import pytest

import deferax as dx
from deferax._sparse import _factorisations

from .helpers import Counter, assert_tree_allclose, make

matplotlib.use("Agg")

A = jnp.asarray(np.random.default_rng(3).normal(size=(3, 3)))
W = jnp.array([1.0, -2.0, 0.5])
X = jnp.array([0.3, -0.2, 0.8])


def plain(x):
    return jnp.tanh(A @ x)


def linear(f):
    return lambda x: jnp.sum(W * f(x)) + 0.1 * jnp.sum(x**2)


def scalar(f):  # a function of one real number of the output: the deferred-basis schedule
    return lambda x: jnp.log(1.0 + jnp.dot(W, f(x)) ** 2)


def square(f):  # the cotangent needs the whole output: the standard schedule
    return lambda x: jnp.sum(f(x) ** 2)


# (implementations given, loss, the schedule explain reports)
CASES = {
    "standard": (("fwd", "bwd"), square, "standard"),
    "deferred fused": (("fwd", "bwd", "fused"), linear, "deferred"),
    "deferred-basis": (("fwd", "bwd", "fused"), scalar, "deferred-basis"),
    "forward-basis": (("jvp_batch",), square, "forward-basis"),
    "fwd only (JAX differentiates it)": (("fwd",), square, "standard"),
}


@pytest.mark.parametrize("where", ["eager", "jit"])
@pytest.mark.parametrize("case", list(CASES))
def test_recorded_counts_equal_the_counts_measured_inside_the_implementations(case, where):
    given, loss_of, schedule = CASES[case]
    counter = Counter()
    f = make(plain, given, counter, name="sim")
    loss = loss_of(f)
    assert dx.explain(loss, X).sites[0].schedule == schedule
    step = dx.filter_value_and_grad(loss)
    step = eqx.filter_jit(step) if where == "jit" else step
    with dx.record() as timeline:  # (traced inside the recording, under jit)
        for _ in range(2):
            got = jax.block_until_ready(step(X))
        jax.effects_barrier()
    assert_tree_allclose(got, jax.value_and_grad(loss_of(plain))(X))
    assert timeline.counts() == dict(counter.counts) and sum(counter.counts.values()) >= 2, (
        timeline.counts(),
        counter.counts,
    )
    assert timeline.counts("sim") == timeline.counts() and timeline.counts("other") == {}
    assert {c.site for c in timeline.calls} == {"sim"}
    expected = {"standard": {"standard"}}.get(schedule, {schedule})  # (forward-basis named as `explain` names it)
    assert {c.schedule for c in timeline.calls} == expected
    # concrete calls are timed; calls compiled into a program (or traced by JAX's own
    # differentiation of `fwd`) are counted, not timed
    timed = where == "eager" and given != ("fwd",)
    assert all((c.start is not None) == timed for c in timeline.calls), str(timeline)
    assert all(c.start <= c.end for c in timeline.timed())
    text = str(timeline)
    assert f"{len(timeline)} call(s)" in text and ("not timed" in text) == (not timed)


def test_nothing_is_recorded_outside_and_each_recording_gets_its_own_calls():
    f = make(plain, ("fwd", "bwd"), name="sim")
    step = dx.filter_value_and_grad(square(f))
    step(X)
    with dx.record() as outer:
        step(X)
        with dx.record() as inner:
            step(X)
    step(X)
    assert outer.counts() == {"fwd": 2, "bwd": 2} and inner.counts() == {"fwd": 1, "bwd": 1}
    # the inner recording's calls are the outer one's last two, on the inner one's clock
    shift = inner.origin - outer.origin
    assert shift > 0 and min(c.start for c in inner.calls) >= 0
    last = sorted(outer.calls, key=lambda c: c.start)[2:]
    for mine, theirs in zip(sorted(inner.calls, key=lambda c: c.start), last, strict=True):
        assert (mine.impl, mine.thread) == (theirs.impl, theirs.thread)
        assert abs(mine.start - (theirs.start - shift)) < 1e-9 and abs(mine.end - (theirs.end - shift)) < 1e-9


def meeting(barrier, counter, key):
    def hit():
        barrier.wait()

    counter.tick(key)
    jax.debug.callback(hit, ordered=False)


@pytest.mark.parametrize("where", ["eager", "jit"])
@pytest.mark.parametrize("kind", ["derived", "fuse"])
def test_deferred_halves_overlap_and_standard_calls_do_not(kind, where):
    counter = Counter()
    barrier = threading.Barrier(2, timeout=20)

    def fwd(x):
        meeting(barrier, counter, "fwd")
        return plain(x)

    def adjoint(x, ct):  # both must reach the barrier before either goes on
        meeting(barrier, counter, "bwd")
        return jax.vjp(plain, x)[1](ct)[0]

    if kind == "derived":
        f = dx.ExpensiveFn(fwd=fwd, bwd=lambda x, y, ct: adjoint(x, ct), name="sim")
    else:
        f = dx.ExpensiveFn(
            fwd=plain, bwd=lambda x, y, ct: jax.vjp(plain, x)[1](ct)[0], fused=dx.fuse(fwd, adjoint), name="sim"
        )
    step = dx.filter_value_and_grad(linear(f))
    step = eqx.filter_jit(step) if where == "jit" else step
    with dx.record() as timeline:
        got = jax.block_until_ready(step(X))
    assert_tree_allclose(got, jax.value_and_grad(linear(plain))(X))
    calls = {c.impl: c for c in timeline.calls}
    second = "bwd" if kind == "derived" else "adjoint"
    assert sorted(calls) == sorted(["fwd", second]) and len(timeline) == 2, str(timeline)
    a, b = calls["fwd"], calls[second]
    assert max(a.start, b.start) < min(a.end, b.end), str(timeline)  # they overlap in time
    assert a.thread != b.thread and {a.schedule, b.schedule} == {"deferred"}
    assert a.device == b.device == str(jax.local_devices()[0])

    # the standard schedule of the same function: fwd ends before bwd starts
    slow = dx.ExpensiveFn(fwd=jax.jit(plain), bwd=lambda x, y, ct: A.T @ (ct * (1 - y**2)), name="std")
    with dx.record() as standard:
        dx.filter_value_and_grad(linear(slow))(X)
    fwd_call, bwd_call = sorted(standard.calls, key=lambda c: c.start)
    assert (fwd_call.impl, bwd_call.impl) == ("fwd", "bwd") and fwd_call.end <= bwd_call.start
    assert {fwd_call.schedule, bwd_call.schedule} == {"standard"}


def test_host_jobs_are_recorded_where_they_run():
    calls = []

    def solve(x):
        calls.append("fwd")
        return np.tanh(np.asarray(A) @ x)

    def adjoint(x, ct):
        calls.append("adjoint")
        return ct

    f = dx.host(solve, adjoint=adjoint, combine=lambda x, y, p: A.T @ (p * (1 - y**2)), out=lambda s: s, name="solver")
    for step in (dx.filter_value_and_grad(linear(f)), eqx.filter_jit(dx.filter_value_and_grad(linear(f)))):
        calls.clear()
        with dx.record() as timeline:
            got = step(X)
        assert_tree_allclose(got, jax.value_and_grad(linear(plain))(X))
        host = [c for c in timeline.calls if c.impl != "combine"]
        assert sorted(c.impl for c in host) == sorted(calls) == ["adjoint", "fwd"], str(timeline)
        assert {c.site for c in host} == {"solver"} and {c.schedule for c in host} == {"deferred"}
        assert {c.thread for c in host} == {"a ThreadPoolExecutor"} and all(c.start is not None for c in host)


class _LateCallbacks(concurrent.futures.ThreadPoolExecutor):
    """A thread pool whose futures run their done callbacks 0.2 s late, on another thread: a
    future's callbacks may run after its waiter has woken (CPython wakes the waiters first),
    which this makes certain."""

    def submit(self, fn, /, *args, **kwargs):
        future = super().submit(fn, *args, **kwargs)
        add = future.add_done_callback

        def late(callback):
            add(lambda f: threading.Timer(0.2, callback, (f,)).start())

        future.add_done_callback = late
        return future


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_host_job_is_recorded_when_its_future_calls_back_late(jit):
    """The recording holds every host job of the calls made inside it, also where the job's
    future runs its callbacks after the request has returned (on jax 0.12 a recording once
    ended without the job, 1 time in 20)."""
    with _LateCallbacks(2) as pool:
        f = dx.host(np.tanh, bwd=lambda x, y, ct: ct * (1 - y**2), out=lambda s: s, executor=pool, name="late")
        step = dx.filter_value_and_grad(lambda x: jnp.sum(f(x) ** 2), max_basis=0)
        step = jax.jit(step) if jit else step
        jax.block_until_ready(step(X))  # (compiled)
        for _ in range(3):
            with dx.record() as timeline:
                got = jax.block_until_ready(step(X))
            assert_tree_allclose(got, jax.value_and_grad(lambda x: jnp.sum(jnp.tanh(x) ** 2))(X))
            assert timeline.counts() == {"fwd": 1, "bwd": 1}, str(timeline)
            assert all(c.end is not None and c.end >= c.start for c in timeline.calls)


def test_plot_draws_one_bar_per_timed_call_and_compares_two_recordings():
    f = dx.ExpensiveFn(fwd=jax.jit(plain), bwd=lambda x, y, ct: jax.vjp(plain, x)[1](ct)[0], name="sim")
    with dx.record() as deferred:
        dx.filter_value_and_grad(linear(f))(X)
        dx.filter_value_and_grad(linear(f))(X)
    with dx.record() as standard:
        dx.filter_value_and_grad(linear(f), schedule="standard")(X)
    fig = deferred.plot(title="deferred")
    (ax,) = fig.axes
    assert len(ax.patches) == len(deferred.timed()) == 4
    assert ax.get_title(loc="left").startswith("deferred: ")
    both = dx.plot_timelines({"standard": standard, "deferred": deferred})
    assert [len(a.patches) for a in both.axes] == [2, 4]
    assert [a.get_title(loc="left").split(":")[0] for a in both.axes] == ["standard", "deferred"]
    import matplotlib.pyplot as plt

    plt.close("all")


def test_the_logger_reports_plans_at_info_and_calls_at_debug(caplog):
    f = make(plain, ("fwd", "bwd", "fused"), name="sim")
    g = make(plain, ("fwd", "bwd"), name="std")

    def loss(x):
        return linear(f)(x) + square(g)(x * 1.5)

    step = dx.filter_value_and_grad(loss)
    with caplog.at_level(logging.INFO, logger="deferax"):
        step(X)
    info = [r.getMessage() for r in caplog.records if r.name == "deferax"]
    assert info[0] == "site #0 sim: deferred" and info[1].startswith(
        "site #1 std: standard (its cotangent depends on its own output"
    )
    assert len(info) == 2 and all(r.levelno == logging.INFO for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="deferax"):
        step(X)  # the same program again: its plan is cached, nothing new to report
    assert [r for r in caplog.records if r.name == "deferax"] == []
    with caplog.at_level(logging.DEBUG, logger="deferax"):
        step(X)
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and r.name == "deferax"]
    assert sorted(m.split(" (")[0] for m in debug) == ["sim: fused", "std: bwd", "std: fwd"]
    assert all(" ms on " in m for m in debug)


def test_the_logger_is_silent_by_default(capfd):
    import subprocess
    import sys

    code = (
        "import jax.numpy as jnp, deferax as dx\n"
        "f = dx.ExpensiveFn(fwd=jnp.sin, bwd=lambda x, y, ct: ct * jnp.cos(x), name='s')\n"
        "print(dx.filter_value_and_grad(lambda x: jnp.sum(f(x) ** 2))(jnp.ones(2))[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "deferax" not in out.stderr and "site #" not in out.stdout + out.stderr, out.stderr
    assert logging.getLogger("deferax").level == logging.NOTSET  # nothing set on import


def test_stages_and_calls_are_named_regions_in_a_profiler_trace(tmp_path):
    f = dx.ExpensiveFn(
        fwd=plain,
        bwd=lambda x, y, ct: jax.vjp(plain, x)[1](ct)[0],
        fused=lambda x, ct: (plain(x), jax.vjp(plain, x)[1](ct)[0]),
        name="sim",
    )
    step = dx.filter_value_and_grad(linear(f))
    step(X)
    with jax.profiler.trace(str(tmp_path)):
        step(X)
    (trace,) = glob.glob(os.path.join(tmp_path, "**", "*.xplane.pb"), recursive=True)
    data = open(trace, "rb").read()
    for name in (
        b"deferax stage 1: operands and cotangents",
        b"deferax stage 2: expensive calls",
        b"deferax stage 3: value and gradients",
        b"deferax sim: fused",
    ):
        assert name in data, name
    # under jit the names are in the compiled program's operations
    text = jax.jit(step).lower(X).as_text(debug_info=True)
    assert "deferax_stage_1" in text and "deferax_stage_3" in text


def test_calls_from_other_threads_are_recorded():
    f = make(plain, ("fwd", "bwd"), name="sim")
    step = dx.filter_value_and_grad(square(f))
    with dx.record() as timeline, concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda _: step(X), range(3)))
    assert timeline.counts() == {"fwd": 3, "bwd": 3}


# ----------------------------------------------------------------------------- a sparse solve's steps


def counting_solver():
    from .test_sparse_solve import CountingSolver, Tally

    tally = Tally()
    return tally, CountingSolver(tally)


PATTERN = dx.SparsePattern(np.array([0, 0, 1, 1, 2, 2]), np.array([0, 1, 1, 2, 2, 0]), 3)
VALUES = jnp.array([4.0, 1.0, 3.0, -1.0, 5.0, 0.5])
LOADS = [jnp.array([1.0, 2.0, 0.0]), jnp.array([0.0, 1.0, -1.0])]


def two_load_cases(solver):
    return lambda v: sum(jnp.sum(dx.sparse_solve(v, PATTERN, b, solver=solver)) for b in LOADS)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("how", ["deferred", "jax.grad"])
def test_sparse_solve_factorisations_and_solves_are_recorded_as_steps(how, jit):
    """Two load cases on one matrix: the jobs as before, and beside them the factorisations
    and solve calls that really ran, as the solver itself counted them."""
    tally, solver = counting_solver()
    loss = two_load_cases(solver)
    fn = dx.filter_value_and_grad(loss) if how == "deferred" else jax.value_and_grad(loss)
    fn = jax.jit(fn) if jit else fn
    fn(VALUES)  # (compiled, and SciPy imported)
    gc.collect()  # (an eager forward's factorisation is kept until its output is collected)
    _factorisations.FACTORISATIONS.clear()
    tally.clear()
    with dx.record() as timeline:
        got = fn(VALUES)
    assert_tree_allclose(got, jax.value_and_grad(two_load_cases(None))(VALUES))
    jobs = {"fused": 2} if how == "deferred" else {"fwd": 2, "bwd": 2}
    assert timeline.counts() == jobs
    assert timeline.counts(steps=True) == {"factor": tally.counts["factor"], "solve": tally.counts["solve"]}
    # a solve call a forward and one an adjoint each; the backward passes reuse the forwards'
    # factorisation (one matrix: the second forward may find the first's)
    assert timeline.counts(steps=True)["solve"] == 4 and timeline.counts(steps=True)["factor"] <= 2
    assert timeline.counts("sparse_solve", steps=True) == timeline.counts(steps=True)
    assert timeline.counts("other", steps=True) == {}
    steps = [c for c in timeline.calls if c.step]
    assert all(c.start is not None and c.end >= c.start and c.site == "sparse_solve" for c in steps)
    for c in steps:  # each step inside one of the jobs, in time
        assert any(j.start <= c.start and c.end <= j.end for j in timeline.calls if not j.step), c
    assert "- factor" in str(timeline) and "- solve" in str(timeline)
    fig = timeline.plot()
    assert len(fig.axes[0].patches) == len(timeline.calls)  # a bar a job and a thin one a step
    import matplotlib.pyplot as plt

    plt.close(fig)
