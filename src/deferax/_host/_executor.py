"""Running host jobs on a `concurrent.futures.Executor`: submission, waiting, faults, timeouts.

Every job of a host `ExpensiveFn` (a forward solve, an adjoint solve, a `bwd` or `fused`
call) is the user's own function with NumPy arguments, wrapped to time it where it runs
(`_timing.Timed`). A Dask worker gets the wrapper as cloudpickle's bytes and needs neither
JAX nor deferax; a process pool's worker (the same machine and environment) imports deferax
once to unpickle it. What comes back (a result, an exception, a lost worker, nothing
before the timeout) is turned into a result or a `HostError` here.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import pickle
import sys
import time
from collections.abc import Callable
from typing import Any

from .. import _record, _runtime
from .._concurrency import _native_threads
from .._concurrency._placement import one_at_a_time, serialised

DEFAULT_WORKERS = _runtime.HOST_WORKERS  # (the size of deferax's thread pool)


def default_executor() -> cf.Executor:
    """The thread pool that host jobs run on when no `executor=` is given (created on first use)."""
    return _runtime.POOLS.get("host")


class HostError(RuntimeError):
    """A host implementation of an [`deferax.ExpensiveFn`][] failed.

    Raised when a host function raised an exception (on a thread, a process or a Dask
    worker; the message carries the original exception's type and message, and the original
    exception is the error's `original`, and its `__cause__` unless JAX's backward pass has
    put its own there), when the worker running it was lost,
    or when it did not finish within the `timeout=` given to [`deferax.host`][]. The
    message names the `ExpensiveFn` and the implementation (`fwd`, `adjoint`, `bwd`,
    `fused`).

    Inside `jax.jit` (or any other traced context) the host function runs from a
    `jax.pure_callback`, and JAX re-raises the failure with this message inside its own:
    as a `jax.errors.JaxRuntimeError` when the jitted function's first call failed, as a
    `ValueError` once a call of it has succeeded (measured with jax 0.10.2 on a CPU).
    Catch `(jax.errors.JaxRuntimeError, ValueError)` there.
    """

    def __init__(self, message: str, original: BaseException | None = None):
        super().__init__(message)
        self.original = original


@dataclasses.dataclass(frozen=True)
class Job:
    """One call of a host function: `fn(*args)`, named `impl` in messages."""

    impl: str
    fn: Callable[..., Any]
    args: tuple


class WrappingExecutor(cf.Executor):
    """An executor deferax puts around the caller's (`wrapped`), to which it submits."""

    wrapped: cf.Executor


def _dask() -> Any:
    """Dask's `distributed`, when it is imported (no Dask client, executor or error exists
    before), else None. Never imports it."""
    return sys.modules.get("distributed")


class DaskClient(WrappingExecutor):
    """A Dask `distributed.Client` given as `executor=`: jobs go to its public
    `client.get_executor()`, and the client answers how many threads the cluster has
    (`client.nthreads()`). Equal for the same client, so that sites made for it compare
    equal (and share compiled programs). Shutting it down leaves the client alone: it
    belongs to the caller."""

    def __init__(self, client: Any):
        self.client = client
        self.wrapped = client.get_executor()

    def submit(self, fn, /, *args, **kwargs):
        return self.wrapped.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing: the client belongs to the caller."""

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.client is self.client  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), id(self.client)))


def is_dask_client(executor: Any) -> bool:
    """Whether `executor` is a Dask `distributed.Client` (not an executor made from one)."""
    distributed = _dask()
    return distributed is not None and isinstance(executor, distributed.Client)


def as_executor(executor: Any) -> Any:
    """`executor=` as deferax submits to it: a Dask `distributed.Client` as a `DaskClient`,
    anything else as given (checked by the caller)."""
    return DaskClient(executor) if is_dask_client(executor) else executor


def name(executor: cf.Executor) -> str:
    """The executor, for messages: "a ThreadPoolExecutor", "a Dask cluster", ..."""
    return "a Dask cluster" if is_dask(executor) else f"a {type(executor).__name__}"


def describe(executor: cf.Executor) -> str:
    """Where a job runs, for messages: "a thread of a ThreadPoolExecutor", "a Dask worker", ..."""
    if isinstance(executor, cf.ThreadPoolExecutor):
        return "a thread of a ThreadPoolExecutor"
    if isinstance(executor, cf.ProcessPoolExecutor):
        return "a process of a ProcessPoolExecutor"
    if is_dask(executor):
        return "a Dask worker"
    return name(executor)


def is_dask(executor: cf.Executor) -> bool:
    """Whether jobs submitted to `executor` run on a Dask cluster: a `distributed.Client`
    given as `executor=`, or what its `get_executor()` returns (a `ClientExecutor`)."""
    if isinstance(executor, DaskClient):
        return True
    if _dask() is None:
        return False
    from distributed.cfexecutor import ClientExecutor  # (imported with `distributed`)

    return isinstance(executor, ClientExecutor)


def transport(executor: cf.Executor) -> tuple[str, str] | None:
    """How host functions reach `executor`'s workers: `(pickler, executor's name)`; None
    for threads, or an executor whose transport deferax does not know."""
    if isinstance(executor, cf.ProcessPoolExecutor):
        return "pickle", name(executor)
    if is_dask(executor):
        return "cloudpickle", name(executor)
    return None


def check_picklable(call: str, executor: cf.Executor, impls: dict[str, Callable[..., Any]]) -> None:
    """Raise before anything is submitted if a host function cannot reach the executor's workers."""
    how = transport(executor)
    if how is not None:
        check_transport(call, *how, impls)


_NOT_PICKLABLE = """{call}: `{impl}` cannot be sent to the worker processes of {where}: {pickler} failed with \
{error}.
Host functions that run in other processes must be picklable: use functions defined at module level (for Dask, also
closures over picklable data), and open files, locks and connections inside the function rather than capturing them."""


def check_transport(call: str, pickler: str, where: str, impls: dict[str, Callable[..., Any]]) -> None:
    """Raise if a host function cannot be pickled by `pickler` (to reach `where`)."""
    if pickler == "cloudpickle":
        import cloudpickle  # shipped with distributed

        dumps = cloudpickle.dumps
    else:
        dumps = pickle.dumps
    for impl, fn in impls.items():
        try:
            dumps(fn)
        except Exception as e:
            raise TypeError(
                _NOT_PICKLABLE.format(call=call, impl=impl, where=where, pickler=pickler, error=_error(e))
            ) from e


def _error(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _lost(e: BaseException) -> bool:
    distributed = _dask()  # (a `KilledWorker` can only come from an imported `distributed`)
    return isinstance(e, cf.BrokenExecutor | cf.CancelledError) or (
        distributed is not None and isinstance(e, distributed.KilledWorker)
    )


_RAISED = """{call}: the host function `{impl}` raised {error} (on {where}).
The original exception {chained} this error's `original`."""

_LOST = """{call}: the host function `{impl}` did not complete: the worker running it was lost ({error}, on \
{where}).
{advice}"""

_ADVICE_PROCESS_POOL = """A `concurrent.futures.ProcessPoolExecutor` cannot be used once one of its workers has \
died: make a new one.
A Dask executor (`distributed.Client(...).get_executor()`) runs a job again on another worker when its worker dies."""

_ADVICE_DASK = """The Dask scheduler ran the job again on other workers \
(`distributed.scheduler.allowed-failures` times) and all of
them died: the job itself probably kills its worker (a crash, an out-of-memory kill, `os._exit`). Jobs that *raise* are
retried with `client.get_executor(retries=n)`."""


def _failure(call: str, executor: cf.Executor, job: Job, e: BaseException) -> HostError:
    where = describe(executor)
    if _lost(e):
        if isinstance(executor, cf.ProcessPoolExecutor):
            advice = _ADVICE_PROCESS_POOL
        elif is_dask(executor):
            advice = _ADVICE_DASK
        else:
            advice = "Submit the job again on a working executor."
        return HostError(_LOST.format(call=call, impl=job.impl, error=_error(e), where=where, advice=advice), e)
    chained = "is" if isinstance(executor, cf.ThreadPoolExecutor) else "came back from the worker and is"
    return HostError(_RAISED.format(call=call, impl=job.impl, error=_error(e), where=where, chained=chained), e)


def run(
    call: str,
    executor: cf.Executor | None,
    timeout: float | None,
    jobs: list[Job],
    serial: bool = False,
    check: Any = None,
    workers: int | None = None,
) -> list[Any]:
    """Submit all `jobs` at once, wait for all of them, and return their results in order.

    The first failure (in completion order) cancels the jobs that have not started and is
    raised as a `HostError`; the others are not waited for, so nothing hangs on them. With
    `serial` (or concurrency switched off), one job at a time, under the serial lock (`one_at_a_time`).

    `check(i, result)` checks job `i`'s result against what was declared. When a job
    fails, the results of the others that finish within a second are checked first: a
    result of the wrong shape (a wrong `out=`) is often why another job failed, and is the
    error to report.

    `workers`: how many jobs the executor runs at once, when the caller knows (`dx.Cost(workers=)`):
    a thread pool of this process shares the native threads among them.
    """
    if serialised(serial) and len(jobs) > 1:
        results = []
        for i, job in enumerate(jobs):
            (result,) = run(call, executor, timeout, [job], serial=True)
            if check is not None:
                check(i, result)
            results.append(result)
        return results
    with one_at_a_time(serial):
        return _run(call, executor, timeout, jobs, check, workers)


_GRACE = 1.0  # seconds to let the other jobs finish when one fails, to check their results


def _run(
    call: str,
    executor: cf.Executor | None,
    timeout: float | None,
    jobs: list[Job],
    check: Any = None,
    workers: int | None = None,
) -> list[Any]:
    executor = executor if executor is not None else default_executor()
    with _native_threads.shared(_at_once(executor, len(jobs), workers)):
        return _submit(call, executor, timeout, jobs, check)


def _at_once(executor: cf.Executor, jobs: int, workers: int | None = None) -> int:
    """How many of `jobs` run at once on threads of this process (none on other processes):
    at most `workers` (`dx.Cost(workers=)`), or deferax's pool's size; a thread pool of the
    caller's hides its size, so all of them, unless told."""
    if not isinstance(executor, cf.ThreadPoolExecutor):
        return 0
    if workers is None and executor is _runtime.POOLS.made("host"):
        workers = DEFAULT_WORKERS
    return jobs if workers is None else min(jobs, workers)


_TIMEOUT = """{call}: the host function `{impl}` did not finish within timeout={timeout:g} s (on {where}).
Jobs not yet started were cancelled; a job already running on a thread keeps its thread until it returns.
Raise `timeout=` in `dx.host(...)`, or give `timeout=None` to wait without limit."""

_SUBMIT_FAILED = """{call}: the host function `{impl}` could not be submitted to {where}: {error}.
Give `dx.host(..., executor=...)` an executor that accepts jobs (not one that was shut down)."""


def _submit(call: str, executor: cf.Executor, timeout: float | None, jobs: list[Job], check: Any = None) -> list[Any]:
    futures: list[cf.Future] = []
    where = name(executor)
    records: list[tuple[int, Any]] = []  # (the jobs to record, each `_record.job`'s `record(end)`)
    ends: dict[int, float] = {}  # (when each ended: its future's callback, on the thread that ran it)
    for i, job in enumerate(jobs):
        record = _record.job(job.impl, where)
        # a job on a thread of this process records its steps as the site's (a sparse solve's factorisations)
        fn = _record.carrying(job.fn, where) if record is not None and in_this_process(executor) else job.fn
        try:
            futures.append(executor.submit(fn, *job.args))
            if record is not None:
                records.append((i, record))
                futures[-1].add_done_callback(lambda _, i=i: ends.setdefault(i, time.perf_counter()))
        except Exception as e:
            for f in futures:
                f.cancel()
            raise HostError(
                _SUBMIT_FAILED.format(call=call, impl=job.impl, where=name(executor), error=_error(e))
            ) from e
    job_of = dict(zip(futures, jobs, strict=True))
    done, pending = cf.wait(futures, timeout=timeout, return_when=cf.FIRST_EXCEPTION)
    # Recorded here, before the request returns (a future's callbacks may run after its waiter
    # wakes: a recording could end without the job), each at its own end where its callback ran.
    now = time.perf_counter()
    for i, record in records:
        if futures[i] in done:
            record(ends.get(i, now))
    for f in futures:
        if f in done:
            e = cf.CancelledError("the job was cancelled") if f.cancelled() else f.exception()
            if e is not None:
                if check is not None:
                    _check_others(futures, f, check)
                for g in pending:
                    g.cancel()
                raise _failure(call, executor, job_of[f], e) from e
    if pending:  # no failure, so `wait` returned because the timeout passed
        for f in pending:
            f.cancel()
        job = job_of[next(f for f in futures if f in pending)]
        raise HostError(_TIMEOUT.format(call=call, impl=job.impl, timeout=timeout, where=describe(executor)))
    return [f.result() for f in futures]


def in_this_process(executor: cf.Executor) -> bool:
    """Whether jobs submitted to `executor` run on threads of this process (a
    `ThreadPoolExecutor`, or one deferax wraps around it)."""
    while isinstance(executor, WrappingExecutor):
        executor = executor.wrapped
    return isinstance(executor, cf.ThreadPoolExecutor)


def _check_others(futures: list[cf.Future], failed: cf.Future, check: Any) -> None:
    """Check the results of the jobs other than `failed` that finish within `_GRACE`."""
    others = [g for g in futures if g is not failed]
    cf.wait(others, timeout=_GRACE)
    for i, g in enumerate(futures):
        if g is not failed and g.done() and not g.cancelled() and g.exception() is None:
            check(i, g.result())


def jobs_at_once(executor: cf.Executor | None) -> int:
    """How many jobs `executor` runs at the same time (`None`: deferax's thread pool), when
    no `dx.Cost(workers=)` says: deferax's thread pool's size (it made the pool), at most
    the cores this process may use; for a `ThreadPoolExecutor` or `ProcessPoolExecutor` of
    the caller's, whose size is not public, the cores (Python's default size, at most the
    cores); a Dask `distributed.Client`'s worker threads, all workers together
    (`client.nthreads()`, one question to the scheduler; 1 if it cannot answer); 1 for any
    other executor (`client.get_executor()`'s among them: it does not make its client
    public)."""
    cores = _native_threads.cores()
    if executor is None or executor is _runtime.POOLS.made("host"):
        return max(1, min(DEFAULT_WORKERS, cores))
    if isinstance(executor, DaskClient):
        try:
            return max(1, sum(executor.client.nthreads().values()))
        except Exception:  # (an asynchronous client, a scheduler gone)
            return 1
    if isinstance(executor, cf.ThreadPoolExecutor | cf.ProcessPoolExecutor):
        return max(1, cores)
    return 1
