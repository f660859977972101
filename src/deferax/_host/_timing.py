"""A host function timed where it runs (a thread, a process, a Dask worker): the time spent
inside it, not its wait in the executor's queue."""

import time


def closure(fn):
    """`fn` returning `(result, seconds)`, as a closure: what cloudpickle (Dask) sends by
    value, so that Dask workers need not import deferax (nor JAX)."""

    def timed(*args):
        start = time.perf_counter()
        result = fn(*args)
        return result, time.perf_counter() - start

    return timed


class Timed:
    """`closure(fn)` as an object that `pickle` sends by reference (a process pool, whose
    workers run this Python and its packages), with `fn`."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return closure(self.fn)(*args)
