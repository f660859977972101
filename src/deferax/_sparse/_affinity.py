"""One worker per matrix on a Dask cluster, for [`deferax.sparse_solve`][].

A forward pass leaves its factorisation in the worker process that made it, for the
backward pass. On a cluster, that backward job must go to the same worker, or it factors
again; and different matrices (one a wavelength, say) should go to different workers, to
be factored at once. `pinned(executor)` turns a Dask `distributed.Client` into an executor
that sends every job of one matrix (the same `values`) to one worker, and new matrices to
the workers in turn. The worker is a preference (`allow_other_workers=True`): when it is
gone, the job runs elsewhere and factors again. A cluster with no worker yet (an adaptive
one, scaling up) takes the job where Dask puts it, and its matrix is placed by a later job.
Only the client's public API is used: its workers from `client.nthreads()`, and
`client.get_executor(workers=...)` for each job.

An executor made by `client.get_executor()` does not make its client public: its jobs go
where Dask puts them.

Which worker each matrix went to is remembered per client, holding the client weakly (and
nothing that holds it), so that a client the caller drops is freed.
"""

from __future__ import annotations

import collections
import hashlib
import threading
import weakref
from typing import Any

import numpy as np

from .. import _runtime
from .._host import _executor

# Matrices whose worker is remembered, per client: enough for the forward passes still
# waiting for their backward pass (`_factorisations.FACTORISATIONS` keeps at most as many).
REMEMBERED = 64


class _Workers:
    """The workers a client's matrices went to (by a digest of their values), and whose turn
    is next. Holds no reference to the client."""

    def __init__(self):
        self.of: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self.turn = 0
        self.lock = threading.Lock()


_WORKERS: weakref.WeakKeyDictionary[Any, _Workers] = _runtime.store(weakref.WeakKeyDictionary())
_WORKERS_LOCK = threading.Lock()


class Pinned(_executor.DaskClient):
    """A Dask `distributed.Client`, with the jobs of one matrix on one worker. Each job's
    first argument is the solve's input `(values, b)`."""

    def submit(self, fn, /, *args, **kwargs):
        values = np.ascontiguousarray(args[0][0])
        key = hashlib.blake2b(values.dtype.str.encode(), digest_size=16)
        key.update(values.data)
        worker = self._worker(key.digest())
        if worker is None:  # no worker yet (an adaptive cluster scaling up): where Dask puts it
            return self.client.get_executor().submit(fn, *args, **kwargs)
        where = self.client.get_executor(workers=[worker], allow_other_workers=True)
        return where.submit(fn, *args, **kwargs)

    def _worker(self, key: bytes) -> str | None:
        with _WORKERS_LOCK:
            workers = _WORKERS.get(self.client)
            if workers is None:
                workers = _WORKERS[self.client] = _Workers()
        with workers.lock:
            worker = workers.of.get(key)
            if worker is None:
                # Asked of the scheduler each time (`nthreads`), not read from the client's
                # `scheduler_info()`: a periodic refresh can leave that without its workers.
                addresses = sorted(self.client.nthreads())
                if not addresses:
                    return None
                worker = workers.of[key] = addresses[workers.turn % len(addresses)]
                workers.turn += 1
                while len(workers.of) > REMEMBERED:
                    workers.of.popitem(last=False)
            workers.of.move_to_end(key)
            return worker


def pinned(executor: Any) -> Any:
    """`executor` as a `Pinned` if it is a Dask `distributed.Client` (equal for the same
    client, so that programs built for it are reused), else `executor`."""
    return Pinned(executor) if _executor.is_dask_client(executor) else executor
