"""Executors of other libraries, through their public API only: a caller's thread pool and a
Dask client are freed once the caller drops them; a Dask `distributed.Client` given as
`executor=`; how many jobs at once the estimates count for each kind of executor; a lost
Dask worker recognised as `distributed.KilledWorker`."""

import concurrent.futures as cf
import gc
import re
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx
from deferax._host import _executor
from deferax._sparse import _solve
from deferax._stages import _run

from .helpers import assert_tree_allclose

PATTERN = dx.SparsePattern(rows=np.array([0, 0, 1, 1]), cols=np.array([0, 1, 0, 1]), n=2)
VALUES = jnp.array([4.0, 1.0, 2.0, 3.0])
B = jnp.array([1.0, 2.0])
A = np.array([[2.0, 1.0], [1.0, 3.0]])


def dense_loss(values):
    return jnp.sum(jnp.linalg.solve(PATTERN.todense(values), B) ** 2)


def solve_a(b):
    return np.linalg.solve(A, b)


def solve_a_adjoint(b, ct):
    return np.linalg.solve(A.T, ct)


def host_site(executor, **kwargs):
    out = jax.ShapeDtypeStruct((2,), jnp.float64)
    return dx.host(solve_a, adjoint=solve_a_adjoint, out=out, executor=executor, name="solve_a", **kwargs)


def host_loss(f):
    return lambda b: jnp.sum(f(b) ** 2)


def plain_host_loss(b):
    return jnp.sum(jnp.linalg.solve(jnp.asarray(A), b) ** 2)


def freed(ref, within=10.0):
    """Whether the object behind `ref` is freed once the bounded caches of recent programs
    are emptied: JAX's (the parameters of recently traced operations, up to 2048) and
    deferax's compiled eager stages (up to 256 programs). Each holds a program's sites, with
    their executors, until newer programs push it out, as `jax.jit` holds its static
    arguments; nothing else may hold them.

    Asked again for up to `within` seconds: a closed Dask client is still held for a moment
    by its own event loop's pending callbacks (on a loaded machine, long enough for one look
    to find it alive: CI, Python 3.13). Anything deferax held would be held for good."""
    deadline = time.monotonic() + within
    while True:
        jax.clear_caches()
        _run._CACHE.clear()
        gc.collect()
        if ref() is None:
            return True
        if time.monotonic() > deadline:
            held = ref()
            holders = [type(r).__qualname__ for r in gc.get_referrers(held)] if held is not None else []
            print(f"still held after {within} s, by: {holders}")
            return False
        time.sleep(0.05)


def sparse_calls(executor):
    """Every way a sparse solve is called: eager value-and-gradient, `jax.grad`, under `jit`."""
    loss = lambda v: jnp.sum(dx.sparse_solve(v, PATTERN, B, executor=executor) ** 2)  # noqa: E731
    expected = jax.value_and_grad(dense_loss)(VALUES)
    assert_tree_allclose(dx.filter_value_and_grad(loss)(VALUES), expected, rtol=1e-12)
    assert_tree_allclose(jax.grad(loss)(VALUES), expected[1], rtol=1e-12)
    assert_tree_allclose(jax.jit(jax.value_and_grad(loss))(VALUES), expected, rtol=1e-12)


@pytest.mark.parametrize("how", ["eager", "jit", "jax.grad"])
def test_a_thread_pool_given_to_host_is_freed_once_dropped(how):
    pool = cf.ThreadPoolExecutor(2)
    f = host_site(pool)
    step = {
        "eager": dx.filter_value_and_grad(host_loss(f)),
        "jit": jax.jit(dx.filter_value_and_grad(host_loss(f))),
        "jax.grad": jax.value_and_grad(host_loss(f)),
    }[how]
    b = jnp.array([1.0, 2.0])
    assert_tree_allclose(step(b), jax.value_and_grad(plain_host_loss)(b), rtol=1e-12)
    ref = weakref.ref(pool)
    pool.shutdown()
    del pool, f, step
    assert freed(ref)


def test_a_thread_pool_given_to_sparse_solve_is_freed_once_dropped():
    """`dx.sparse_solve` keeps the sites it made for reuse; none of them holds the pool."""
    pool = cf.ThreadPoolExecutor(2)
    sparse_calls(pool)
    ref = weakref.ref(pool)
    pool.shutdown()
    del pool
    assert freed(ref)


def test_the_same_sparse_solve_site_serves_every_call_on_one_executor():
    """Made once, and only its executor changes from call to call."""
    pools = [cf.ThreadPoolExecutor(1), cf.ThreadPoolExecutor(1)]
    _solve._solve_site.cache_clear()
    try:
        for pool in pools:
            sparse_calls(pool)
            sparse_calls(pool)
        assert _solve._solve_site.cache_info().currsize == 1
    finally:
        for pool in pools:
            pool.shutdown()


# --- Dask: an in-process cluster (threads, no worker processes), cheap to start ----------


@pytest.fixture
def cluster():
    distributed = pytest.importorskip("distributed")
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None)
    try:
        yield cluster
    finally:
        cluster.close()


def _client(cluster):
    import distributed

    return distributed.Client(cluster)


@pytest.mark.parametrize("given", ["client", "get_executor"])
def test_a_dask_client_is_freed_once_closed_and_dropped(cluster, given):
    """A Dask client (and the executor made from it) given to `dx.sparse_solve` and
    `dx.host` is freed once the caller closes and drops it: deferax remembers which worker
    each matrix went to without holding the client."""
    client = _client(cluster)
    executor = client if given == "client" else client.get_executor()
    sparse_calls(executor)
    f = host_site(executor)
    b = jnp.array([1.0, 2.0])
    assert_tree_allclose(dx.filter_value_and_grad(host_loss(f))(b), jax.value_and_grad(plain_host_loss)(b), rtol=1e-12)
    refs = [weakref.ref(client), weakref.ref(executor)]
    client.close()
    del client, executor, f
    assert freed(refs[0]) and freed(refs[1])


def deferred_estimate(executor, workers=None):
    """The deferred-basis estimate of a host site on `executor` (k = 4, separate jobs), from
    a hint with `workers` (None: as many as the executor runs at once)."""
    cost = dx.Cost(fwd=3.0, bwd=1.0, workers=workers)
    f = dx.host(solve4, adjoint=adjoint4, out=OUT4, executor=executor, cost=cost, name="four")
    return dx.explain(lambda x: jnp.sum(f(x) ** 2), X4).sites[0].estimates.deferred


def test_a_dask_client_as_executor_counts_the_clusters_threads(cluster):
    """The client answers how many threads the cluster has (2); an executor made by
    `client.get_executor()` does not make its client public: 1, unless `dx.Cost(workers=)` says."""
    with cf.ThreadPoolExecutor(1) as threads, _client(cluster) as client:
        one, two = deferred_estimate(threads, workers=1), deferred_estimate(threads, workers=2)
        assert two < one
        assert deferred_estimate(client) == two
        assert deferred_estimate(client.get_executor()) == one
        assert deferred_estimate(client.get_executor(), workers=2) == two


def test_a_dask_client_as_executor_runs_on_the_workers(cluster):
    with _client(cluster) as client:
        f = host_site(client, timeout=30)
        b = jnp.array([1.0, 2.0])
        for fn in (dx.filter_value_and_grad(host_loss(f)), jax.jit(jax.value_and_grad(host_loss(f)))):
            assert_tree_allclose(fn(b), jax.value_and_grad(plain_host_loss)(b), rtol=1e-12)
        with dx.record() as rec:
            dx.filter_value_and_grad(host_loss(f))(b)
        assert {c.thread for c in rec.calls if c.impl in ("fwd", "adjoint")} == {"a Dask cluster"}
        assert _executor.is_dask(_executor.as_executor(client))
        assert _executor.as_executor(client) == _executor.as_executor(client)  # (sites made for it compare equal)
        assert client.status == "running"  # deferax never closes the caller's client


def test_a_killed_worker_is_recognised_by_its_public_type():
    distributed = pytest.importorskip("distributed")
    assert _executor._lost(distributed.KilledWorker("task", "worker", 1))

    class KilledWorker(Exception):  # (a lookalike from elsewhere is a failure of the job, not a lost worker)
        pass

    assert not _executor._lost(KilledWorker())
    assert _executor._lost(cf.BrokenExecutor()) and _executor._lost(cf.CancelledError())


def test_a_thread_or_process_pool_of_the_callers_counts_the_cores():
    """Their size is not public: the cores (Python's default size, at most the cores; 2 in
    the tests), unless `dx.Cost(workers=)` says; deferax's own pool: its size (it made it),
    at most the cores."""
    with cf.ThreadPoolExecutor(1) as threads, cf.ProcessPoolExecutor(1) as processes:
        assert _executor.jobs_at_once(threads) == _executor.jobs_at_once(processes) == 2
        assert _executor.jobs_at_once(None) == min(_executor.DEFAULT_WORKERS, 2)
        one, two = deferred_estimate(threads, workers=1), deferred_estimate(threads, workers=2)
        assert two < one
        assert deferred_estimate(threads) == deferred_estimate(processes) == deferred_estimate(None) == two
        # the native thread pools are shared among the jobs that run at once on threads of this process
        assert _executor._at_once(threads, 3) == 3 and _executor._at_once(threads, 3, workers=1) == 1
        assert _executor._at_once(_executor.default_executor(), 64) == min(64, _executor.DEFAULT_WORKERS)
        assert _executor._at_once(processes, 3) == 0


def test_error_bad_executor():
    message = (
        "`ExpensiveFn(name='solve_a')`: `executor` must be a `concurrent.futures.Executor` (a `ThreadPoolExecutor`, a "
        "`ProcessPoolExecutor`,\n`distributed.Client(...).get_executor()`), a Dask `distributed.Client`, or None for "
        "deferax's thread pool, but got 'threads'."
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        host_site("threads")
    with pytest.raises(TypeError, match=re.escape(message.replace("solve_a", "sparse_solve"))):
        dx.sparse_solve(VALUES, PATTERN, B, executor="threads")


X4 = jnp.linspace(0.1, 1.0, 4)
OUT4 = jax.ShapeDtypeStruct((4,), jnp.float64)


def solve4(x):
    return np.sin(x)


def adjoint4(x, ct):
    return ct * np.cos(x)
