"""Native thread pools (BLAS, OpenMP) while host jobs run at once: limited to a share of the
cores inside concurrent jobs, left alone for a job that runs alone, restored afterwards."""

import concurrent.futures as cf
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

import deferax as dx
from deferax._concurrency import _native_threads as _threads
from deferax._host import _executor

from .helpers import assert_tree_allclose

A = np.array([[4.0, 1.0, 0.5], [0.3, 3.0, 1.0], [0.2, -0.7, 5.0]])
X0 = jnp.array([0.3, -0.2, 0.8])
OUT = jax.ShapeDtypeStruct((3,), jnp.float64)
OUTER = 2  # the program's own setting in these tests


def blas_threads() -> set[int]:
    """The thread counts of the BLAS libraries whose setting is the process's (OpenBLAS on its
    own pthreads). One on OpenMP (MKL's Intel or GNU threading layer, which pypardiso's MKL
    brings; an OpenBLAS built on OpenMP) has one setting a thread, which a limit set by the
    thread that submits the jobs does not reach (`_native_threads`)."""
    return {
        lib["num_threads"]
        for lib in threadpool_info()
        if lib["user_api"] == "blas" and lib.get("threading_layer") not in ("openmp", "intel", "gnu")
    }


@pytest.fixture
def cores(monkeypatch):
    """Two cores, and the program's BLAS at `OUTER` threads, whatever the machine."""
    monkeypatch.setattr(_threads, "cores", lambda: 2)
    with threadpool_limits(limits=OUTER):
        assert blas_threads() == {OUTER}
        yield


def solver(seen, barrier=None, fail=False):
    """`y = (A + diag(x))^-1 1`, each job noting the BLAS thread count it runs with."""

    def note(impl):
        seen.setdefault(impl, []).append(blas_threads())
        if barrier is not None:
            barrier.wait()  # (the other job runs at the same time)

    def fwd(x):
        note("fwd")
        return np.linalg.solve(A + np.diag(x), np.ones(3))

    def adjoint(x, ct):
        note("adjoint")
        if fail:
            raise RuntimeError("adjoint failed")
        return np.linalg.solve((A + np.diag(x)).T, ct)

    return dx.host(fwd, adjoint=adjoint, combine=lambda x, y, lam: -y * lam, out=OUT, adjoint_out=OUT, name="solver")


def reference(x):
    return jnp.linalg.solve(jnp.asarray(A) + jnp.diag(x), jnp.ones(3))


def loss_of(f):
    return lambda x: jnp.sum(jnp.array([1.0, -2.0, 0.5]) * f(x))  # linear in y: deferred


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_two_concurrent_jobs_each_get_half_the_cores(cores, jit):
    seen = {}
    fn = dx.filter_value_and_grad(loss_of(solver(seen, barrier=threading.Barrier(2, timeout=20))))
    got = jax.block_until_ready((eqx.filter_jit(fn) if jit else fn)(X0))
    assert_tree_allclose(got, jax.value_and_grad(loss_of(reference))(X0), rtol=1e-12, atol=1e-12)
    assert seen == {"fwd": [{1}], "adjoint": [{1}]}  # 2 cores // 2 jobs
    assert blas_threads() == {OUTER}


def test_a_job_alone_keeps_the_programs_setting(cores):
    seen = {}
    got = jax.value_and_grad(loss_of(solver(seen)))(X0)  # standard: the forward, then the adjoint
    assert_tree_allclose(got, jax.value_and_grad(loss_of(reference))(X0), rtol=1e-12, atol=1e-12)
    assert seen == {"fwd": [{OUTER}], "adjoint": [{OUTER}]}
    assert blas_threads() == {OUTER}


def test_the_setting_is_restored_when_a_job_raises(cores):
    seen = {}
    with pytest.raises(dx.HostError, match="the host function `adjoint` raised RuntimeError: adjoint failed"):
        dx.filter_value_and_grad(loss_of(solver(seen, barrier=threading.Barrier(2, timeout=20), fail=True)))(X0)
    assert seen == {"fwd": [{1}], "adjoint": [{1}]}
    assert blas_threads() == {OUTER}


def test_processes_are_not_limited_from_here(cores):
    with cf.ProcessPoolExecutor(1) as pool:
        with _threads.shared(_executor._at_once(pool, 2)):
            assert blas_threads() == {OUTER}


def test_batches_from_two_threads_add_up_and_the_last_restores(monkeypatch):
    monkeypatch.setattr(_threads, "cores", lambda: 8)
    with threadpool_limits(limits=6):
        first, second = _threads.shared(2), _threads.shared(2)
        first.__enter__()
        assert blas_threads() == {4}  # 8 cores // 2 jobs
        second.__enter__()
        assert blas_threads() == {2}  # 8 cores // 4 jobs
        first.__exit__(None, None, None)
        assert blas_threads() == {2}  # never raised while jobs run
        second.__exit__(None, None, None)
        assert blas_threads() == {6}


def test_jobs_submitted_from_another_thread_are_limited_while_the_program_holds_a_limit(cores):
    """The program's `threadpool_limits` (here the fixture's, on the main thread) makes the
    main thread threadpoolctl's "controlling thread" for OpenBLAS; deferax's limit, set from
    the thread that submits the jobs, must hold all the same."""
    seen, got = {}, []
    fn = dx.filter_value_and_grad(loss_of(solver(seen, barrier=threading.Barrier(2, timeout=20))))
    thread = threading.Thread(target=lambda: got.append(jax.block_until_ready(fn(X0))))
    thread.start()
    thread.join()
    assert_tree_allclose(got[0], jax.value_and_grad(loss_of(reference))(X0), rtol=1e-12, atol=1e-12)
    assert seen == {"fwd": [{1}], "adjoint": [{1}]}
    assert blas_threads() == {OUTER}


def test_the_programs_own_limits_work_after_jobs_from_a_pool_thread(monkeypatch):
    """A limit deferax set and restored from a pool thread (alive for good) must not keep
    the program's later `threadpool_limits` from working."""
    monkeypatch.setattr(_threads, "cores", lambda: 2)
    outer = blas_threads()
    seen = {}
    fn = dx.filter_value_and_grad(loss_of(solver(seen, barrier=threading.Barrier(2, timeout=20))))
    with cf.ThreadPoolExecutor(1) as pool:
        got = pool.submit(lambda: jax.block_until_ready(fn(X0))).result()
        assert_tree_allclose(got, jax.value_and_grad(loss_of(reference))(X0), rtol=1e-12, atol=1e-12)
        assert seen == {"fwd": [{1}], "adjoint": [{1}]}
        assert blas_threads() == outer
        with threadpool_limits(limits=1):
            assert blas_threads() == {1}
        assert blas_threads() == outer


def test_superlu_factors_and_solves_on_one_thread_and_gives_the_setting_back(cores, monkeypatch):
    """SciPy's SuperLU gains nothing from BLAS threads: `dx.SuperLU` in `dx.sparse_solve`
    runs with one, even in a job that runs alone (the standard schedule's forward)."""
    import scipy.sparse.linalg as spl

    seen, original = [], spl.splu

    class Noting:
        def __init__(self, lu):
            self.lu = lu

        def __getattr__(self, name):  # (its fill, `nnz`, which the ordering is chosen by)
            return getattr(self.lu, name)

        def solve(self, rhs, trans):
            seen.append(("solve", blas_threads()))
            return self.lu.solve(rhs, trans=trans)

    def splu(matrix, permc_spec):
        seen.append(("factor", blas_threads()))
        return Noting(original(matrix, permc_spec=permc_spec))

    monkeypatch.setattr(spl, "splu", splu)
    m = 4
    rows, cols = np.nonzero(np.eye(m * m) + np.eye(m * m, k=1) + np.eye(m * m, k=-1))
    pattern = dx.SparsePattern(rows, cols, m * m)
    values = jnp.asarray(np.where(rows == cols, 4.0, -1.0) * (1.0 + 0.01 * np.arange(len(rows))))
    b = jnp.linspace(1.0, 2.0, m * m)

    def loss(v, solve):
        return jnp.sum(jnp.sin(solve(v, b)))  # nonlinear in x: standard, each job alone

    def dense(v, b):
        return jnp.linalg.solve(pattern.todense(v), b)

    got = dx.filter_value_and_grad(lambda v: loss(v, lambda v, b: dx.sparse_solve(v, pattern, b, solver=dx.SuperLU())))(
        values
    )
    assert_tree_allclose(got, jax.value_and_grad(lambda v: loss(v, dense))(values), rtol=1e-10, atol=1e-12)
    # forward (a pattern's first factorisation tries both orderings), then the adjoint on its factors
    assert seen == [("factor", {1}), ("factor", {1}), ("solve", {1}), ("solve", {1})]
    assert blas_threads() == {OUTER}


def test_a_cap_and_jobs_at_once_compose(monkeypatch):
    monkeypatch.setattr(_threads, "cores", lambda: 8)
    with threadpool_limits(limits=6):
        with _threads.capped(3):
            assert blas_threads() == {3}
            with _threads.shared(2):
                assert blas_threads() == {3}  # 8 // 2 = 4, and the cap is lower
                with _threads.capped(1):
                    assert blas_threads() == {1}
                assert blas_threads() == {1}  # never raised while a limit holds
        assert blas_threads() == {6}
        with _threads.shared(1):
            assert blas_threads() == {6}  # a job alone, no cap
        with pytest.raises(RuntimeError, match="inside"):
            with _threads.capped(2):
                assert blas_threads() == {2}
                raise RuntimeError("inside")
        assert blas_threads() == {6}
