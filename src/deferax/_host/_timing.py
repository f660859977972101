"""A host function timed where it runs (a thread, a process, a Dask worker): the time spent
inside it, not its wait in the executor's queue. It imports nothing of JAX or deferax, and
travels to Dask workers by value (`_runner` registers this module with cloudpickle), so
that they still need neither."""

import time


class Timed:
    """`fn(*args)`, returned with the seconds it took: `(result, seconds)`. Picklable when
    `fn` is."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        start = time.perf_counter()
        result = self.fn(*args)
        return result, time.perf_counter() - start
