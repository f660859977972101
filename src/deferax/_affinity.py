"""One worker per matrix on a Dask cluster, for [`deferax.sparse_solve`][].

A forward pass leaves its factorisation in the worker process that made it, for the
backward pass. On a cluster, that backward job must go to the same worker, or it factors
again; and different matrices (one a wavelength, say) should go to different workers, to
be factored at once. `pinned(executor)` wraps a Dask executor so that every job of one
matrix (the same `values`) goes to one worker, and new matrices go to the workers in turn.
The worker is a preference (`allow_other_workers=True`): when it is gone, the job runs
elsewhere and factors again.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import hashlib
import threading
import weakref
from typing import Any

import numpy as np

from . import _executor

# Matrices whose worker is remembered, per executor: enough for the forward passes still
# waiting for their backward pass (`_sparse_solve.FACTORISATIONS` keeps at most 8).
REMEMBERED = 64

_PINNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PINNED_LOCK = threading.Lock()


class Pinned(cf.Executor):
    """`dask_executor` (from `distributed.Client(...).get_executor()`), with the jobs of one
    matrix on one worker. Each job's first argument is the solve's input `(values, b)`."""

    def __init__(self, dask_executor: cf.Executor):
        self.dask_executor = dask_executor
        self._worker_of: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._turn = 0
        self._lock = threading.Lock()

    def submit(self, fn, /, *args, **kwargs):
        values = np.ascontiguousarray(args[0][0])
        key = hashlib.blake2b(values.dtype.str.encode(), digest_size=16)
        key.update(values)
        return self.dask_executor.submit(fn, *args, workers=[self._worker(key.digest())], allow_other_workers=True, **kwargs)

    def _worker(self, key: bytes) -> str:
        with self._lock:
            worker = self._worker_of.get(key)
            if worker is None:
                workers = sorted(self.dask_executor._client.scheduler_info()["workers"])
                worker = self._worker_of[key] = workers[self._turn % len(workers)]
                self._turn += 1
                while len(self._worker_of) > REMEMBERED:
                    self._worker_of.popitem(last=False)
            self._worker_of.move_to_end(key)
            return worker

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing: the Dask executor belongs to the caller."""


def pinned(executor: Any) -> Any:
    """`executor` as a `Pinned` if it is a Dask executor (the same `Pinned` each time, so
    that programs built for it are reused), else `executor`."""
    if not (isinstance(executor, cf.Executor) and _executor.is_dask(executor)):
        return executor
    with _PINNED_LOCK:
        if executor not in _PINNED:
            _PINNED[executor] = Pinned(executor)
        return _PINNED[executor]
