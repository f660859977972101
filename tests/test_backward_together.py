"""The backward jobs of independent standard sites at once (`runs="together"`): two or more host sites
whose operands need no expensive output, on the standard schedule (their `bwd` reads `y`,
the loss is nonlinear in each output), run their `fwd` jobs at once in stage 2 and their
`bwd` jobs at once in stage 2b, eagerly and under `jax.jit`, when the cost model says so.

The jobs that must run at once wait on a shared `threading.Barrier`: a test passes only if
they overlap (run one after another, the first waits until the barrier times out, and the
step fails). Gradients against plain JAX (each host site replaced by the function it
stands for); runs counted by the host functions themselves."""

import collections
import concurrent.futures as cf
import gc
import multiprocessing
import re
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse

import deferax as dx
from deferax._sparse import _factorisations

from .helpers import CountingLU, RecordingLU, Tally, assert_tree_allclose, runs

X = jnp.array([0.1, -0.4, 0.7])
WAIT = 10.0  # seconds a job waits at the barrier for the others


def sine(name, calls, barrier=None, on="bwd", **kwargs):
    """`sin` as host code; `bwd` reads `y` (so the site stays standard). The job `on` (`"fwd"`
    or `"bwd"`) waits at `barrier` for the other sites' jobs."""

    def fwd(x):
        calls.append(f"{name}.fwd")
        if barrier is not None and on == "fwd":
            barrier.wait()
        return np.sin(x)

    def bwd(x, y, ct):
        calls.append(f"{name}.bwd")
        if barrier is not None and on == "bwd":
            barrier.wait()
        return ct * np.sqrt(1 - y**2)  # cos(x), for x in (-pi/2, pi/2)

    return dx.host(fwd, bwd=bwd, out=lambda s: s, name=name, **kwargs)


def two_sites(a, b):
    """Nonlinear in each output."""
    return lambda x: jnp.sum(a(x) ** 2) + jnp.sum(b(2 * x) ** 3)


PLAIN = two_sites(jnp.sin, jnp.sin)


def step(loss, jit, **kwargs):
    fn = dx.filter_value_and_grad(loss, **kwargs)
    return jax.jit(fn) if jit else fn


def each_once(calls, names=("a", "b")):
    return collections.Counter(calls) == collections.Counter(f"{n}.{i}" for n in names for i in ("fwd", "bwd"))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("on", ["bwd", "fwd"])
def test_two_sites_jobs_overlap(jit, on):
    """Two independent standard sites: their backward jobs (and their forward jobs) run at
    once, so the barrier is passed; one `fwd` and one `bwd` a site a step, and plain JAX's
    value and gradient."""
    calls, barrier = [], threading.Barrier(2, timeout=WAIT)
    loss = two_sites(sine("a", calls, barrier, on), sine("b", calls, barrier, on))
    fn = step(loss, jit)
    for _ in range(2):  # (under `jit`, the first call compiles)
        calls.clear()
        got = jax.block_until_ready(fn(X))
        assert each_once(calls), calls
        assert_tree_allclose(got, jax.value_and_grad(PLAIN)(X))
    if on == "bwd":  # (the backward jobs after both forward jobs)
        assert set(calls[:2]) == {"a.fwd", "b.fwd"}


def test_explain_shows_the_backward_jobs_at_once():
    calls = []
    plan = dx.explain(two_sites(sine("a", calls), sine("b", calls)), X)
    assert not calls  # (nothing runs)
    assert [s.schedule for s in plan.sites] == ["standard", "standard"]
    assert plan.stages == (("a: fwd", "b: fwd"), ("a: bwd", "b: bwd"))
    for site in plan.sites:
        assert site.reason.endswith(
            "; backward jobs at once with #0, #1: estimated 2.03 at once against 4.04 in turn"
        ), site.reason
    text = str(plan)
    assert "  1. a: fwd, b: fwd (concurrently)" in text
    assert "  2. a: bwd, b: bwd (concurrently)" in text


def test_three_sites():
    calls, barrier = [], threading.Barrier(3, timeout=WAIT)
    a, b, c = (sine(n, calls, barrier) for n in "abc")

    def loss(x):
        return jnp.sum(a(x) ** 2) + jnp.sum(b(2 * x) ** 3) + jnp.prod(c(x / 2))

    def plain(x):
        return jnp.sum(jnp.sin(x) ** 2) + jnp.sum(jnp.sin(2 * x) ** 3) + jnp.prod(jnp.sin(x / 2))

    assert dx.explain(loss, X).stages == (("a: fwd", "b: fwd", "c: fwd"), ("a: bwd", "b: bwd", "c: bwd"))
    for jit in (False, True):
        calls.clear()
        got = step(loss, jit)(X)
        assert each_once(calls, "abc"), calls
        assert_tree_allclose(got, jax.value_and_grad(plain)(X))


# ----------------------------------------------------------------------------- the cost gate


@pytest.mark.parametrize("how", ["workers=1", "thread_safe=False"])
def test_one_worker_keeps_the_jobs_in_turn(how):
    """With one worker (`dx.Cost(workers=1)`, or functions that must not run twice at once)
    nothing runs at once: the sites stay in turn, and the plan says why."""
    calls = []
    kwargs = {"cost": dx.Cost(workers=1)} if how == "workers=1" else {"thread_safe": False}
    loss = two_sites(sine("a", calls, **kwargs), sine("b", calls, **kwargs))
    plan = dx.explain(loss, X)
    assert plan.stages == (("a: fwd",), ("b: fwd",), ("b: bwd",), ("a: bwd",))
    assert plan.sites[0].reason.endswith(
        "; backward jobs in turn: one worker runs one job at a time (estimated 4.03 at once against 4.04 in turn)"
    )
    for jit in (False, True):
        calls.clear()
        got = step(loss, jit)(X)
        assert calls[:2] == ["a.fwd", "b.fwd"] and each_once(calls), calls
        assert_tree_allclose(got, jax.value_and_grad(PLAIN)(X))


def test_the_estimate_in_seconds():
    """From a hint: the forward jobs share the two workers, then the backward jobs."""
    calls = []
    cost = dx.Cost(fwd=0.02, bwd=0.03, stage=0.001)
    plan = dx.explain(two_sites(sine("a", calls, cost=cost), sine("b", calls, cost=cost)), X)
    # in turn: 2 * (0.02 + 0.03 + 2 * 0.001); at once: 0.02 + 0.03 + 3 * 0.001
    assert re.search(r"at once with #0, #1: estimated 0\.053 s at once against 0\.104 s in turn$", plan.sites[1].reason)


# ----------------------------------------------------------------------------- what stays in turn


def in_turn(loss, plain, calls, expected_calls, x=X):
    """The sites' jobs one after another (no barrier: they would wait for ever), counted,
    with plain JAX's value and gradient."""
    for jit in (False, True):
        calls.clear()
        got = step(loss, jit)(x)
        assert collections.Counter(calls) == collections.Counter(expected_calls), calls
        assert_tree_allclose(got, jax.value_and_grad(plain)(x))


def test_an_input_that_depends_on_the_other_output():
    calls = []
    a, b = sine("a", calls), sine("b", calls)
    loss = lambda x: jnp.sum(b(a(x)) ** 2)  # noqa: E731
    plan = dx.explain(loss, X)
    assert plan.stages == (("a: fwd",), ("b: fwd",), ("b: bwd",), ("a: bwd",))
    for site in plan.sites:
        assert site.reason.endswith("; backward jobs in turn: the input of site #1 `b` depends on an expensive output")
    in_turn(loss, lambda x: jnp.sum(jnp.sin(jnp.sin(x)) ** 2), calls, ["a.fwd", "a.bwd", "b.fwd", "b.bwd"])


def test_a_site_inside_scan():
    calls = []

    a, b = sine("a", calls), sine("b", calls)

    def loss(x, fa=a, fb=b):
        scanned, _ = jax.lax.scan(lambda c, xi: (c + jnp.sum(fb(xi) ** 2), None), 0.0, jnp.stack([x, x / 2]))
        return jnp.sum(fa(x) ** 3) + scanned

    plan = dx.explain(loss, X)
    assert ("a: bwd",) in plan.stages and all(len(s) == 1 for s in plan.stages)
    assert plan.sites[0].reason == "called inside lax.scan; sites there stay standard"
    assert plan.sites[1].reason.endswith(
        "; backward jobs in turn: the expensive call inside lax.scan runs on the program's own passes"
    )
    expected = ["a.fwd", "a.bwd", "b.fwd", "b.fwd", "b.bwd", "b.bwd"]
    in_turn(loss, lambda x: loss(x, jnp.sin, jnp.sin), calls, expected)


def test_a_once_only_effect_in_the_cotangent():
    """An `io_callback` that the cotangent of site #0 needs: computed ahead, it would run
    twice. The sites stay in turn; it runs once a step."""
    calls, draws = [], []

    def weight():
        draws.append(1)
        return np.float64(2.0)

    a, b = sine("a", calls), sine("b", calls)

    def loss(x, fa=a, fb=b):
        w = jax.experimental.io_callback(weight, jax.ShapeDtypeStruct((), jnp.float64))
        return w * jnp.sum(fa(x) ** 2) + jnp.sum(fb(2 * x) ** 3)

    reason = dx.explain(loss, X).sites[1].reason
    assert re.search(
        r"; backward jobs in turn: for site #0 `a`, computing its input and cotangent ahead of the expensive "
        r"calls runs `io_callback` at .*test_backward_together\.py:\d+",
        reason,
    ), reason
    for jit in (False, True):
        calls.clear()
        draws.clear()
        got = step(loss, jit)(X)
        assert collections.Counter(calls) == collections.Counter(["a.fwd", "a.bwd", "b.fwd", "b.bwd"])
        assert len(draws) == 1
        assert_tree_allclose(got, jax.value_and_grad(lambda x: loss(x, jnp.sin, jnp.sin))(X))


def test_a_site_with_a_traceable_implementation():
    """XLA runs a traced `bwd` in turn with the rest of the program: nothing to gain."""
    calls = []
    b = dx.ExpensiveFn(fwd=jnp.sin, bwd=lambda x, y, ct: ct * jnp.sqrt(1 - y**2), name="b")
    loss = two_sites(sine("a", calls), b)
    plan = dx.explain(loss, X)
    assert plan.stages == (("a: fwd",), ("b: fwd",), ("b: bwd",), ("a: bwd",))
    assert plan.sites[0].reason.endswith(
        "; backward jobs in turn: site #1 `b` runs inside the program, where XLA runs its jobs in turn"
    )
    in_turn(loss, PLAIN, calls, ["a.fwd", "a.bwd"])


# ----------------------------------------------------------------------------- what the program may hold


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_aux(jit):
    calls, barrier = [], threading.Barrier(2, timeout=WAIT)

    sa, sb = sine("a", calls, barrier), sine("b", calls, barrier)

    def loss(x, a=sa, b=sb):
        ya, yb = a(x), b(2 * x)
        return jnp.sum(ya**2) + jnp.sum(yb**3), {"ya": ya, "yb0": yb[0], "n": 3}

    got = step(loss, jit, has_aux=True)(X)
    assert each_once(calls), calls
    assert_tree_allclose(got, eqx.filter_value_and_grad(lambda x: loss(x, jnp.sin, jnp.sin), has_aux=True)(X))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_sites_under_vmap(jit):
    calls = []
    a, b = sine("a", calls), sine("b", calls)
    xs = jnp.stack([X, X / 2, -X / 3])

    def loss(xs, a=a, b=b):
        return jnp.sum(jax.vmap(a)(xs) ** 2) + jnp.sum(jax.vmap(b)(2 * xs) ** 3)

    assert dx.explain(loss, xs).stages == (("a: fwd x3", "b: fwd x3"), ("a: bwd x3", "b: bwd x3"))
    got = step(loss, jit)(xs)
    assert collections.Counter(calls) == collections.Counter({"a.fwd": 3, "a.bwd": 3, "b.fwd": 3, "b.bwd": 3})
    assert_tree_allclose(got, jax.value_and_grad(lambda xs: loss(xs, jnp.sin, jnp.sin))(xs))


@pytest.mark.parametrize("dtypes", [("float32", "float32"), ("float32", "float64")])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_float32_and_float64_leaves(jit, dtypes):
    calls, barrier = [], threading.Barrier(2, timeout=WAIT)
    value_dtype = jnp.float64 if "float64" in dtypes else jnp.float32

    sa, sb = sine("a", calls, barrier), sine("b", calls, barrier)

    def loss(xs, a=sa, b=sb):
        x32, x2 = xs
        return jnp.sum(a(x32) ** 2).astype(value_dtype) + jnp.sum(b(2 * x2) ** 3).astype(value_dtype)

    xs = (X.astype(jnp.float32), X.astype(dtypes[1]))
    got = step(loss, jit)(xs)
    assert each_once(calls), calls
    assert got[0].dtype == value_dtype and [g.dtype for g in got[1]] == [x.dtype for x in xs]
    assert_tree_allclose(got, jax.value_and_grad(lambda xs: loss(xs, jnp.sin, jnp.sin))(xs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_complex_outputs(jit):
    calls, barrier = [], threading.Barrier(2, timeout=WAIT)

    def phase(name):
        def fwd(x):
            calls.append(f"{name}.fwd")
            return np.exp(1j * x)

        def bwd(x, y, ct):
            calls.append(f"{name}.bwd")
            barrier.wait()
            return np.real(ct * 1j * y)

        return dx.host(fwd, bwd=bwd, out=lambda s: jax.ShapeDtypeStruct(s.shape, jnp.complex128), name=name)

    pa, pb = phase("a"), phase("b")

    def loss(x, a=pa, b=pb):
        return jnp.sum(jnp.abs(a(x) + 0.5) ** 2) + jnp.sum(jnp.real(b(2 * x) ** 3))

    got = step(loss, jit)(X)
    assert each_once(calls), calls
    plain = lambda x: jnp.exp(1j * x.astype(jnp.complex128))  # noqa: E731
    assert_tree_allclose(got, jax.value_and_grad(lambda x: loss(x, plain, plain))(X))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nan_in_an_output(jit):
    calls, barrier = [], threading.Barrier(2, timeout=WAIT)
    loss = two_sites(sine("a", calls, barrier), sine("b", calls, barrier))
    x = X.at[1].set(jnp.nan)
    value, grad = step(loss, jit)(x)
    assert each_once(calls), calls
    want_value, want_grad = jax.value_and_grad(PLAIN)(x)
    assert np.isnan(value) and np.isnan(want_value)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-10)  # (NaN where plain JAX has NaN)
    assert np.isnan(grad[1]) and np.isfinite(grad[0])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_with_a_deferred_site(jit):
    """A deferred site's `fwd` and `adjoint` run with the standard sites' `fwd` in stage 2;
    then the standard sites' `bwd` at once."""
    calls, barrier = [], threading.Barrier(2, timeout=WAIT)
    m = np.array([[2.0, 1.0, 0.0], [0.5, 3.0, 1.0], [0.0, 1.0, 4.0]])

    def fwd(x):
        calls.append("d.fwd")
        return m @ x

    def adjoint(x, ct):
        calls.append("d.adjoint")
        return m.T @ ct

    d = dx.host(fwd, adjoint=adjoint, out=lambda s: s, name="d")
    w = jnp.array([1.0, -2.0, 0.5])

    sa, sb = sine("a", calls, barrier), sine("b", calls, barrier)

    def loss(x, d=d, a=sa, b=sb):
        return jnp.sum(w * d(x)) + two_sites(a, b)(x)

    plan = dx.explain(loss, X)
    assert [s.schedule for s in plan.sites] == ["deferred", "standard", "standard"]
    assert plan.stages == (("d: fused", "a: fwd", "b: fwd"), ("a: bwd", "b: bwd"))
    got = step(loss, jit)(X)
    assert collections.Counter(calls) == collections.Counter(["d.fwd", "d.adjoint", "a.fwd", "a.bwd", "b.fwd", "b.bwd"])
    assert_tree_allclose(got, jax.value_and_grad(lambda x: loss(x, lambda x: jnp.asarray(m) @ x, jnp.sin, jnp.sin))(X))


# ----------------------------------------------------------------------------- `dx.sparse_solve` twice

M = 6  # a 6 x 6 grid: 36 unknowns


def operator(shift):
    """A convection-diffusion operator (not symmetric), `(values, pattern)`."""
    d = scipy.sparse.diags([-1.3, 4.5 + shift, -0.7], [-1, 0, 1], shape=(M, M))
    e = scipy.sparse.diags([-1.1, -0.9], [-1, 1], shape=(M, M))
    a = scipy.sparse.kron(scipy.sparse.identity(M), d) + scipy.sparse.kron(e, scipy.sparse.identity(M))
    values, pattern = dx.SparsePattern.from_scipy(a.tocsc())
    return jnp.asarray(values), pattern


(V0, P), (V1, _) = operator(0.0), operator(0.5)  # (one pattern)
B = jnp.linspace(1.0, 2.0, M * M)


def solves(two, solve):
    """Two solves, on two matrices or on one matrix with two right-hand sides; a loss
    nonlinear in each solution."""

    def loss(vs):
        v0, v1 = vs
        if two == "matrices":
            return jnp.sum(solve(v0, B) ** 2) + jnp.sum(solve(v1, B) ** 3)
        return jnp.sum(solve(v0, B) ** 2) + jnp.sum(solve(v0, 2 * B + 1) ** 3) + jnp.sum(v1**2)

    return loss


def dense(v, b):
    return jnp.linalg.solve(P.todense(v), b)


@pytest.mark.parametrize("two", ["matrices", "right-hand sides"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_two_sparse_solves(jit, two):
    """The forward's factorisation, made inside stage 2 (under `jit`, from its callback), is
    kept for the backward job in stage 2b: one factorisation a matrix a step, as in turn,
    and none kept after."""
    tally = Tally()
    loss = solves(two, lambda v, b: dx.sparse_solve(v, P, b, solver=CountingLU(tally)))
    plan = dx.explain(loss, (V0, V1))
    assert plan.stages == (("sparse_solve: fwd", "sparse_solve: fwd"), ("sparse_solve: bwd", "sparse_solve: bwd"))
    fn = step(loss, jit)
    want = jax.value_and_grad(solves(two, dense))((V0, V1))
    for _ in range(2):
        tally.factor = 0
        got = jax.block_until_ready(fn((V0, V1)))
        assert tally.factor == (2 if two == "matrices" else 1)
        assert_tree_allclose(got, want, rtol=1e-10, atol=1e-12)
        del got
        gc.collect()  # (eagerly, a factorisation is kept while the forward's output lives)
        assert len(_factorisations.FACTORISATIONS) == 0


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_two_sparse_solves_on_a_process_pool(tmp_path, jit):
    """A process pool keeps no factorisation (its backward job may land in another process):
    each job factors, four a step, as in turn; the right gradient."""
    context = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(2, mp_context=context) as pool:
        directory = str(tmp_path)
        loss = solves("matrices", lambda v, b: dx.sparse_solve(v, P, b, solver=RecordingLU(directory), executor=pool))
        assert len(dx.explain(loss, (V0, V1)).stages) == 2  # (the jobs at once)
        got = step(loss, jit)((V0, V1))
        assert_tree_allclose(got, jax.value_and_grad(solves("matrices", dense))((V0, V1)), rtol=1e-10, atol=1e-12)
    counts, _ = runs(directory)
    assert counts == {"factor": 4}


@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed")
    cloudpickle = pytest.importorskip("cloudpickle")
    import sys

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # (the workers need not import the tests)
    cluster = distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None)
    client = distributed.Client(cluster)
    try:
        yield client
    finally:
        client.close()
        cluster.close()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_two_sparse_solves_on_dask(client, tmp_path, jit):
    """On Dask each matrix's jobs go to one worker, which keeps its factorisation for the
    backward job: one factorisation a matrix a step, on the two workers, at once."""
    directory = str(tmp_path)
    loss = solves("matrices", lambda v, b: dx.sparse_solve(v, P, b, solver=RecordingLU(directory), executor=client))
    assert len(dx.explain(loss, (V0, V1)).stages) == 2
    got = step(loss, jit)((V0, V1))
    assert_tree_allclose(got, jax.value_and_grad(solves("matrices", dense))((V0, V1)), rtol=1e-10, atol=1e-12)
    counts, pids = runs(directory)
    assert counts == {"factor": 2}
    assert len(pids) == 2


def linear_sine(name, calls, barrier=None, **kwargs):
    """`sin` as host code with a linear `adjoint`, and `fused` and `fused_batch` (the forward
    and its adjoints in one job): the site may be deferred on a basis. The adjoint waits at
    `barrier` for the other site's."""

    def fwd(x):
        calls.append(f"{name}.fwd")
        return np.sin(x)

    def adjoint(x, ct):
        calls.append(f"{name}.adjoint")
        if barrier is not None:
            barrier.wait()
        return ct * np.cos(x)

    def fused(x, ct):
        calls.append(f"{name}.fused")
        return np.sin(x), ct * np.cos(x)

    def fused_batch(x, cts):
        calls.append(f"{name}.fused_batch")
        return np.sin(x), cts * np.cos(x)

    return dx.host(fwd, adjoint=adjoint, fused=fused, fused_batch=fused_batch, out=lambda s: s, name=name, **kwargs)


def squared_sums(a, b):
    """Each site's cotangent a multiple of one fixed cotangent (k = 1): a basis candidate."""
    return lambda x: jnp.sum(a(x)) ** 2 + jnp.sum(b(2 * x)) ** 2


# a factorisation-like setup, kept for the backward pass, and 3 solves to a basis cotangent
# (the estimate of each site deferred on its basis: 10 + 1 + 3 * 3 = 20, each site alone on
# the workers; standard, with both sites' forward jobs at once, then their backward jobs at
# once: 11 + 1)
KEPT_SETUP = dx.Cost(setup=10.0, fwd=1.0, bwd=3.0, keeps_setup=True)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_basis_sites_go_back_to_standard_when_their_jobs_at_once_cost_less(jit):
    """Two sites that could each be deferred on a basis of k = 1: deferred, each pays its
    setup in two jobs (the forward's and the adjoint's); standard with their jobs at once,
    the setup is paid once and kept. The estimates choose the latter, the plan says why, the
    adjoint jobs overlap (the barrier), and no `fused` runs: one `fwd` and one `adjoint` a
    site a step, with plain JAX's value and gradient."""
    calls, barrier = [], threading.Barrier(2, timeout=WAIT)
    loss = squared_sums(
        linear_sine("a", calls, barrier, cost=KEPT_SETUP), linear_sine("b", calls, barrier, cost=KEPT_SETUP)
    )
    plan = dx.explain(dx.filter_value_and_grad(loss), X)
    assert [s.schedule for s in plan.sites] == ["standard", "standard"]
    for s in plan.sites:
        assert "deferring its k=1 fixed cotangents is estimated slower than the standard sites' jobs at once" in (
            s.reason or ""
        )
        assert "backward jobs at once with #0, #1" in (s.reason or "")
    assert plan.stages[-1] == ("a: bwd", "b: bwd")
    fn = step(loss, jit)
    want = jax.value_and_grad(squared_sums(jnp.sin, jnp.sin))(X)
    for _ in range(2):
        calls.clear()
        assert_tree_allclose(fn(X), want, rtol=1e-12, atol=1e-12)
        assert collections.Counter(calls) == collections.Counter(
            f"{n}.{i}" for n in ("a", "b") for i in ("fwd", "adjoint")
        )


@pytest.mark.parametrize(
    "options",
    [{"max_basis": 1}, {"cost": dx.Cost(setup=10.0, fwd=1.0, bwd=3.0, keeps_setup=True, workers=1)}],
    ids=["max_basis", "one-worker"],
)
def test_basis_sites_stay_deferred_when_asked_or_alone_on_a_worker(options):
    """`max_basis` decides the basis schedule by itself, not the estimates; on one worker the
    jobs at once save nothing: the sites stay deferred on their basis (one `fused_batch` job
    a site, no `fwd`, no `adjoint`), with plain JAX's value and gradient."""
    calls = []
    cost = options.get("cost", KEPT_SETUP)
    loss = squared_sums(linear_sine("a", calls, cost=cost), linear_sine("b", calls, cost=cost))
    fn = dx.filter_value_and_grad(loss, **{k: v for k, v in options.items() if k != "cost"})
    assert [s.schedule for s in dx.explain(fn, X).sites] == ["deferred-basis", "deferred-basis"]
    assert_tree_allclose(fn(X), jax.value_and_grad(squared_sums(jnp.sin, jnp.sin))(X), rtol=1e-12, atol=1e-12)
    assert collections.Counter(calls) == collections.Counter(["a.fused_batch", "b.fused_batch"])


def test_basis_sites_stay_deferred_where_standard_would_take_the_forward_basis_strategy():
    """A site that, put back on the standard schedule, would be differentiated on the
    forward-basis strategy (one input number, a `jvp_batch`: the output and its one tangent in
    one call) runs in turn there, not at once: the basis sites are not moved, and stay
    deferred on their basis, with plain JAX's value and gradient."""

    def with_jvp(name):
        return dx.host(
            np.sin,
            adjoint=lambda x, ct: ct * np.cos(x),
            fused=lambda x, ct: (np.sin(x), ct * np.cos(x)),
            fused_batch=lambda x, cts: (np.sin(x), cts * np.cos(x)),
            jvp_batch=lambda x, ts: (np.sin(x), ts * np.cos(x)),
            out=lambda s: s,
            name=name,
            cost=KEPT_SETUP,
        )

    x = jnp.array([0.3])
    loss = squared_sums(with_jvp("a"), with_jvp("b"))
    fn = dx.filter_value_and_grad(loss)
    sites = dx.explain(fn, x).sites
    assert [s.schedule for s in sites] == ["deferred-basis", "deferred-basis"]
    assert_tree_allclose(fn(x), jax.value_and_grad(squared_sums(jnp.sin, jnp.sin))(x), rtol=1e-12, atol=1e-12)
