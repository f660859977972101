"""A host function timed where it runs (a thread, a process, a Dask worker): the time spent
inside it, not its wait in the executor's queue."""

import pickle
import time
import typing


@typing.no_type_check  # (a run-time type checker's wrapper, as the tests' jaxtyping hook adds, does not pickle)
def closure(fn):
    """`fn` returning `(result, seconds)`."""

    def timed(*args):
        start = time.perf_counter()
        result = fn(*args)
        return result, time.perf_counter() - start

    return timed


class Timed:
    """`closure(fn)` as an object that pickles: by reference to this class (a process pool,
    whose workers run this Python and its packages), or, `by_value`, as cloudpickle's bytes
    of the closure, which `pickle.loads` rebuilds (a Dask worker, which then needs neither
    deferax nor JAX)."""

    def __init__(self, fn, by_value=False):
        self.fn = fn
        self.by_value = by_value

    def __call__(self, *args):
        return closure(self.fn)(*args)

    def __reduce__(self):
        if not self.by_value:
            return Timed, (self.fn,)
        import cloudpickle  # shipped with distributed

        return pickle.loads, (cloudpickle.dumps(closure(self.fn)),)


class Gathered:
    """`fn` returning `(result, gathered)`: the timings it observed itself while it ran
    (`_cost.gathering`, on the thread where it runs), for a host function that times its
    own parts (`dx.sparse_solve`). Pickles by reference to this class (its worker imports
    deferax, as `fn` itself does)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        from .._plan import _cost

        with _cost.gathering() as gathered:
            result = self.fn(*args)
        return result, gathered
