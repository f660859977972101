"""Host functions on a Dask cluster: a `LocalCluster` with two worker processes, started here.

Each host function records every run as a file in a shared directory (name: what ran and
the worker's process id), so the counts are of real executions on the workers.
"""

import os
import pathlib
import re
import sys
import threading
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx

from .helpers import RecordingLU, assert_tree_allclose, load_example, plain_fdfd_design, record, runs

distributed = pytest.importorskip("distributed")
dask = pytest.importorskip("dask")
cloudpickle = pytest.importorskip("cloudpickle")

A0 = np.array([[4.0 + 1.0j, 1.0, 0.5j], [0.3, 3.0 - 0.5j, 1.0], [0.2j, -0.7, 5.0 + 0.2j]])
SOURCE = np.array([1.0, -0.5j, 2.0])
X0 = jnp.array([0.3, -0.2, 0.8])
W = jnp.array([1.0 - 1.0j, 2.0, 0.5j])
FIELD = jax.ShapeDtypeStruct((3,), jnp.complex128)


@pytest.fixture(scope="module")
def client():
    # Functions of this module travel to the workers by value, so the workers need not
    # import the tests (nor JAX): they only run NumPy.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # A job whose worker dies runs once more elsewhere; a second death fails it (fast).
    with dask.config.set({"distributed.scheduler.allowed-failures": 1}):
        cluster = distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None)
        client = distributed.Client(cluster)
        try:
            yield client
        finally:
            # The last tests kill workers; closing while a nanny restarts one can fail in
            # Dask's teardown ("can only join a started process"): let them come back first.
            try:
                client.wait_for_workers(2, timeout=30)
            except TimeoutError:
                pass
            client.close()
            cluster.close()
            cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def executor(client):
    return client.get_executor()


def given(client, how):
    """What the caller gives as `executor=`: the client itself, or an executor made from it."""
    return client if how == "client" else client.get_executor()


def wait_for(path, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.01)


def solver(directory, executor, *, meet=False, fail=None, **kwargs):
    """E(x) = (A0 + diag(x))^-1 s, with the adjoint solve and the combine step (see test_host.py).

    `meet=True`: the forward and adjoint jobs each wait for the other to start (they can
    only finish if they run at the same time). `fail`: what the jobs do when `x[0] < 0`.
    """

    def solve(x):
        record(directory, "fwd")
        if meet:
            pathlib.Path(directory, "started-fwd").touch()
            wait_for(os.path.join(directory, "started-adjoint"))
        if x[0] < 0 and fail == "raise":
            raise np.linalg.LinAlgError("Singular matrix")
        if x[0] < 0 and fail == "sleep":
            time.sleep(2.0)
        if x[0] < 0 and fail == "raise once" and not os.path.exists(os.path.join(directory, "raised")):
            pathlib.Path(directory, "raised").touch()
            raise RuntimeError("license server busy")
        if x[0] < 0 and fail == "die once" and not os.path.exists(os.path.join(directory, "died")):
            pathlib.Path(directory, "died").touch()
            os._exit(1)
        if x[0] < 0 and fail == "die":
            os._exit(1)
        return np.linalg.solve(A0 + np.diag(x), SOURCE)

    def solve_adjoint(x, ct):
        record(directory, "adjoint")
        if meet:
            pathlib.Path(directory, "started-adjoint").touch()
            wait_for(os.path.join(directory, "started-fwd"))
        return np.linalg.solve((A0 + np.diag(x)).T, ct)

    return dx.host(
        solve,
        adjoint=solve_adjoint,
        combine=lambda x, e, lam: -jnp.real(e * lam),
        out=FIELD,
        adjoint_out=FIELD,
        executor=executor,
        name="fdfd",
        **kwargs,
    )


def reference(x):
    return jnp.linalg.solve(jnp.asarray(A0) + jnp.diag(x.astype(jnp.complex128)), jnp.asarray(SOURCE))


def linear_loss(f):
    return lambda x: jnp.sum(jnp.real(W * f(x))) + jnp.sum(x**2)


def expected(x=X0):
    return eqx.filter_value_and_grad(linear_loss(reference))(x)


@pytest.mark.parametrize("how", ["client", "get_executor"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("schedule", ["auto", "standard"])
def test_values_gradients_and_runs_on_the_workers(client, tmp_path, schedule, jit, how):
    loss = linear_loss(solver(tmp_path, given(client, how)))
    fn = dx.filter_value_and_grad(loss, schedule=schedule)
    if jit:
        fn = eqx.filter_jit(fn)
    assert_tree_allclose(fn(X0), expected(), rtol=1e-12, atol=1e-12)
    counts, pids = runs(tmp_path)
    assert counts == {"fwd": 1, "adjoint": 1}
    assert os.getpid() not in pids  # it ran on the workers


@pytest.mark.parametrize("how", ["client", "get_executor"])
def test_forward_and_adjoint_run_on_two_workers_at_once(client, tmp_path, how):
    loss = linear_loss(solver(tmp_path, given(client, how), meet=True, timeout=30))
    assert_tree_allclose(dx.filter_value_and_grad(loss)(X0), expected(), rtol=1e-12, atol=1e-12)
    counts, pids = runs(tmp_path)
    assert counts == {"fwd": 1, "adjoint": 1}
    assert len(pids - {os.getpid()}) == 2  # on the two workers


def test_exception_on_a_worker_reaches_the_caller(executor, tmp_path):
    loss = linear_loss(solver(tmp_path, executor, fail="raise"))
    message = re.escape(
        "`ExpensiveFn(name='fdfd')`: the host function `fwd` raised LinAlgError: Singular matrix (on a Dask worker).\n"
        "The original exception came back from the worker and is this error's `original`."
    )
    step = dx.filter_value_and_grad(loss)
    for _ in range(2):
        with pytest.raises(dx.HostError, match=message) as info:
            step(-X0)
        assert isinstance(info.value.__cause__, np.linalg.LinAlgError) and info.value.original is info.value.__cause__
    # under jit, JAX wraps it: a `JaxRuntimeError` when the first (compiling) call fails, on
    # every failing call after it too; a plain `ValueError` for failing calls after a first
    # call that succeeded (JAX's C++ fast path). The message contains deferax's.
    jitted = jax.jit(dx.filter_value_and_grad(loss))
    for _ in range(2):
        with pytest.raises(jax.errors.JaxRuntimeError, match=message):
            jax.block_until_ready(jitted(-X0))
    jitted = jax.jit(dx.filter_value_and_grad(loss))
    assert_tree_allclose(jitted(X0), expected(), rtol=1e-12, atol=1e-12)
    for _ in range(2):
        with pytest.raises(ValueError, match=message) as info:
            jax.block_until_ready(jitted(-X0))
        assert type(info.value) is ValueError
    assert_tree_allclose(step(X0), expected(), rtol=1e-12, atol=1e-12)  # still usable


def test_retries_of_a_dask_executor(client, tmp_path):
    loss = linear_loss(solver(tmp_path, client.get_executor(retries=1), fail="raise once"))
    assert_tree_allclose(dx.filter_value_and_grad(loss)(-X0), expected(-X0), rtol=1e-12, atol=1e-12)
    counts, _ = runs(tmp_path)
    assert counts == {"fwd": 2, "adjoint": 1}  # the forward job raised once and ran again


@pytest.mark.serial  # (bounds the wall time of a timed-out job)
def test_timeout_on_a_worker(executor, tmp_path):
    loss = linear_loss(solver(tmp_path, executor, fail="sleep", timeout=0.5))
    t0 = time.perf_counter()
    message = (
        "`ExpensiveFn(name='fdfd')`: the host function `fwd` did not finish within timeout=0.5 s (on a Dask worker)."
    )
    with pytest.raises(dx.HostError, match=re.escape(message)):
        dx.filter_value_and_grad(loss)(-X0)
    assert time.perf_counter() - t0 < 2.0
    # A running task is not interrupted (Dask cannot), so the next jobs may queue behind it
    # on its worker; they run once it returns.
    loss = linear_loss(solver(tmp_path, executor))
    assert_tree_allclose(dx.filter_value_and_grad(loss)(X0), expected(), rtol=1e-12, atol=1e-12)


def test_not_picklable_is_refused_before_anything_runs(executor, tmp_path):
    lock = threading.Lock()

    def solve(x):
        with lock:
            return np.linalg.solve(A0 + np.diag(x), SOURCE)

    message = (
        "`ExpensiveFn(name='locked')`: `fwd` cannot be sent to the worker processes of a Dask cluster: "
        "cloudpickle failed with TypeError: cannot pickle '_thread.lock' object.\n"
        "Host functions that run in other processes must be picklable"
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        dx.host(solve, out=FIELD, executor=executor, name="locked")


def test_fdfd_example_on_dask(executor):
    fdfd = load_example("fdfd_inverse_design", "fdfd_inverse_design_dask")
    problem = fdfd.Helmholtz(20)
    on_dask, _ = fdfd.design(problem, steps=2, executor=executor, verbose=False)
    on_threads, _ = fdfd.design(problem, steps=2, verbose=False)
    np.testing.assert_allclose(on_dask, on_threads, rtol=1e-12)
    # independent of deferax: the same design loop on the objective in plain JAX (a dense solve)
    np.testing.assert_allclose(on_dask, plain_fdfd_design(problem, steps=2), rtol=1e-8)
    assert on_dask[-1] > on_dask[0]


def helmholtz(n, k0):
    """A complex 2D Helmholtz operator on an n x n grid, as `(values, pattern)`."""
    import scipy.sparse as sp

    d = sp.diags([1.0, -2.0, 1.0], [-1, 0, 1], shape=(n, n)) * (n + 1) ** 2
    a = sp.kron(d, sp.identity(n)) + sp.kron(sp.identity(n), d) + k0**2 * (1 + 0.1j) * sp.identity(n * n)
    return dx.SparsePattern.from_scipy(a.tocsc())


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_sparse_solve_keeps_each_matrix_on_one_worker(client, tmp_path, jit):
    """The standard schedule: each forward factors on a worker and leaves the factorisation
    there; the backward job goes to that worker and uses it. Two matrices (two wavelengths)
    go to the two workers. (Given the client: an executor made by `client.get_executor()`
    does not make its client public, and its jobs go where Dask puts them.)"""
    pytest.importorskip("scipy")
    sites = [helmholtz(6, k0) for k0 in (9.0, 13.0)]
    b = jnp.linspace(1.0, 2.0, 36).astype(jnp.complex128)

    def loss(vs, solve):
        return sum(jnp.sum(jnp.abs(solve(v, p)) ** 2) for v, (_, p) in zip(vs, sites, strict=True))

    def dense(v, p):
        return jnp.linalg.solve(p.todense(v), b)

    for step in range(3):
        directory = str(tmp_path / f"step{step}")
        on_dask = lambda v, p, d=directory: dx.sparse_solve(v, p, b, solver=RecordingLU(d), executor=client)  # noqa: E731
        vs = tuple(jnp.asarray(v) * (1.0 + 0.1 * step) for v, _ in sites)
        fn = jax.value_and_grad(lambda vs, s=on_dask: loss(vs, s))
        got = (jax.jit(fn) if jit else fn)(vs)
        assert_tree_allclose(got, jax.value_and_grad(lambda vs: loss(vs, dense))(vs), rtol=1e-10, atol=1e-12)
        counts, pids = runs(directory)
        assert counts == {"factor": 2}  # one a matrix: the backward passes reused them
        assert len(pids) == 2  # the two matrices on the two workers


def test_sparse_solve_on_a_cluster_with_no_worker_yet_waits_for_one():
    """An adaptive cluster starts with no worker: the forward job waits in the scheduler (it
    is not given a worker it cannot have), runs on the first worker to come, and the
    backward job follows it there. (Before: `integer modulo by zero` in placing it.)"""
    pytest.importorskip("scipy")
    values, pattern = helmholtz(6, 9.0)
    b = jnp.linspace(1.0, 2.0, 36).astype(jnp.complex128)

    def loss(v, solve):
        return jnp.sum(jnp.abs(solve(v)) ** 2)

    with distributed.LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster:
        with distributed.Client(cluster) as empty:
            assert empty.nthreads() == {}
            fn = jax.value_and_grad(lambda v: loss(v, lambda v: dx.sparse_solve(v, pattern, b, executor=empty)))
            got = {}
            thread = threading.Thread(target=lambda: got.setdefault("result", fn(jnp.asarray(values))))
            thread.start()
            deadline = time.monotonic() + 20
            while not cluster.scheduler.tasks and thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert cluster.scheduler.tasks, "the forward job never reached the scheduler"
            assert empty.nthreads() == {}  # it was submitted while there was no worker
            cluster.scale(1)
            thread.join(60)
            assert not thread.is_alive()
    dense = jax.value_and_grad(lambda v: loss(v, lambda v: jnp.linalg.solve(pattern.todense(v), b)))
    assert_tree_allclose(got["result"], dense(jnp.asarray(values)), rtol=1e-10, atol=1e-12)


# The two tests that kill workers come last: the nannies restart them, which takes a moment.


def test_worker_dies_once_and_the_job_runs_again(executor, tmp_path):
    loss = linear_loss(solver(tmp_path, executor, fail="die once"))
    assert_tree_allclose(dx.filter_value_and_grad(loss)(-X0), expected(-X0), rtol=1e-12, atol=1e-12)
    counts, _ = runs(tmp_path)
    assert counts == {"fwd": 2, "adjoint": 1}  # the forward job ran again on another worker


def test_worker_that_always_dies_gives_a_clear_error(executor, tmp_path):
    loss = linear_loss(solver(tmp_path, executor, fail="die"))
    with pytest.raises(dx.HostError) as info:
        dx.filter_value_and_grad(loss)(-X0)
    text = str(info.value)
    assert text.startswith(
        "`ExpensiveFn(name='fdfd')`: the host function `fwd` did not complete: the worker running it was lost \
(KilledWorker: "
    )
    assert (
        "The Dask scheduler ran the job again on other workers (`distributed.scheduler.allowed-failures` times)" in text
    )
