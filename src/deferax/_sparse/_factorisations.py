"""The factorisations that `sparse_solve`'s forward passes keep for their backward passes: the
store (`Store`, one a process: `FACTORISATIONS`), its budget in bytes
(`set_factorisation_budget`), and, for the plan, whether a solve's factorisation will be kept
(`not_kept`, from the bytes its first one measured: `nbytes_of`)."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import _runtime
from .._host import _executor
from . import _affinity
from ._pattern import SparsePattern


class _Entry:
    """A factorisation (a future: the first caller computes it, the others wait), the number
    of users that still need it (calls running, and forward passes whose backward passes
    may still come), how many of those are `holds` (see `Store`), and its bytes."""

    def __init__(self):
        self.future: cf.Future = cf.Future()
        self.users = 0
        self.holds = 0
        self.nbytes = 0  # (the factorisation's, once made)


class Store:
    """The factorisations that forward passes leave for their backward passes, by matrix.

    The key is the matrix itself (the solve's configuration and the bytes of `values`), so a
    backward pass finds its forward's factorisation without any handle in the program, and
    jobs on one matrix at once wait for one factorisation (the rows of a `vmap` over `b` are
    one job: `_on_host._Solve.rows`). A call that uses a factorisation is a user while it
    runs (a job of several rows, one a row); a forward request (one host call, all the rows
    of a `vmap` batch) that a backward pass may follow leaves one more user per matrix for
    the backward passes (one that nothing differentiates leaves none: `_runtime.BACKWARD`):

    - eagerly (the forward's output a concrete array), a *lease* on that output: the user is
      removed when the output is garbage collected, as then no backward pass can run (it
      needs the output as a residual). Backward passes do not remove it: a `jax.vjp`
      function called several times uses one factorisation.
    - otherwise (inside `jax.jit`, or from a callback), a *hold*, removed by the first
      backward request on that matrix once all its rows are done: a `jax.jacrev` (the
      backward pass vmapped, one request of `n` rows) factors once.

    A factorisation with no users left is dropped. The store is bounded by `budget` bytes
    (each factorisation's as its solver reports them, `AbstractSparseSolver.nbytes`) and by
    `limit` factorisations: beyond either, the oldest are dropped whatever their users
    (forward passes whose backward pass never comes, or has not come yet), and one past the
    budget on its own is not kept at all (its callers use it, and let it go). A backward
    pass that finds nothing factors again: the result is always right. The bytes kept
    (`nbytes`) never exceed the budget: a factorisation counts once made, and is fitted in
    (or dropped) before anyone can use it.

    A lease ends in a finalizer, which runs wherever the garbage collector runs, also on a
    thread inside this store's lock: it only queues the release (`_ended`), which the next
    call takes in under the lock (taking the lock there deadlocked that thread).

    Making a key copies and hashes every byte of the entries (0.9-1.8 ms for the 180 x 60
    beam's 5.5 MB): the keys a request made (`requested`) are found again by its jobs (`made`), by
    the entries array itself.
    """

    def __init__(self, limit: int, budget: int | None = None):
        self.limit = limit
        self.budget = default_budget() if budget is None else budget
        self._entries: collections.OrderedDict[Any, _Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._ended: collections.deque[tuple[Any, _Entry]] = collections.deque()  # (leases ended, not yet taken in)
        self._requested: dict[int, tuple[Any, Any]] = {}  # (the keys of running requests, by `id` of the entries)

    def __len__(self) -> int:
        with self._lock:
            self._take_ended()
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        """The bytes of the factorisations kept (made; those being made count once made)."""
        with self._lock:
            self._take_ended()
            return self._nbytes()

    def _nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def clear(self) -> None:
        """Drop every factorisation kept (their callers that run now keep theirs; a backward
        pass that finds nothing factors again). `_runtime.reset` calls it."""
        with self._lock:
            self._entries.clear()
            self._ended.clear()
            self._requested.clear()

    @contextlib.contextmanager
    def requested(self, arrays: list, keys: list) -> Iterator[None]:
        """Inside, `made(a)` of each entries array of `arrays` is its key in `keys` (a
        request's keys, for its jobs). The caller holds each array meanwhile, so no other
        array has its `id`; an array already registered keeps the key it has."""
        mine = []
        with self._lock:
            for a, key in zip(arrays, keys, strict=True):
                if id(a) not in self._requested:
                    self._requested[id(a)] = (a, key)
                    mine.append(id(a))
        try:
            yield
        finally:
            with self._lock:
                for i in mine:
                    self._requested.pop(i, None)  # (`clear` may have emptied it)

    def made(self, values: Any) -> Any:
        """The key a running request made for the entries array `values` itself, or None."""
        with self._lock:
            found = self._requested.get(id(values))
        return found[1] if found is not None and found[0] is values else None

    def set_budget(self, budget: int) -> None:
        """Bound the store by `budget` bytes from now on, dropping the oldest factorisations
        kept until the others fit."""
        with self._lock:
            self._take_ended()
            self.budget = budget
            self._fit()

    def acquire(self, key: Any, make: Any, size: Any = None, users: int = 1) -> Any:
        """The factorisation for `key` (made with `make()` unless kept or being made), with
        `users` more users (a job's rows). `size(factorisation)`: its bytes, for the budget
        (default 0)."""
        with self._lock:
            self._take_ended()
            entry = self._entries.get(key)
            owner = entry is None
            if owner:
                entry = self._entries[key] = _Entry()
            entry.users += users
            self._entries.move_to_end(key)
            self._trim()
        if owner:
            try:
                made = make()
                nbytes = 0 if size is None else int(size(made))
            except BaseException as e:  # (the callers waiting for it raise it too)
                entry.future.set_exception(e)
                with self._lock:
                    if self._entries.get(key) is entry:
                        del self._entries[key]
                raise
            with self._lock:  # (counted, and fitted in or dropped, before anyone can use it)
                entry.nbytes = nbytes
                if self._entries.get(key) is entry:
                    if nbytes > self.budget:  # (alone past the budget: its callers use it, none keeps it)
                        del self._entries[key]
                    else:
                        self._fit(entry)
                entry.future.set_result(made)
        return entry.future.result()

    def release(self, key: Any, n: int = 1, *, hold: bool = False) -> None:
        """`n` users fewer for `key`, and with `hold`, one more (a forward request's) if it
        has one; the factorisation is dropped when none is left."""
        with self._lock:
            self._take_ended()
            entry = self._entries.get(key)
            if entry is not None:
                if hold and entry.holds > 0:
                    entry.holds -= 1
                    n += 1
                entry.users -= n
                if entry.users <= 0:
                    del self._entries[key]

    def hold(self, key: Any, n: int) -> None:
        """A forward request's `n` users of `key` (its rows) become one hold."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.users -= n - 1
                entry.holds += 1

    def pin(self, key: Any) -> Any:
        """One more user of `key`'s factorisation, kept or being made: a token for `unpin`,
        or None where there is none."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.users += 1
            return entry

    def pinned(self, key: Any, token: Any) -> bool:
        """Whether `token` (from `pin`) still holds `key`'s factorisation."""
        with self._lock:
            return token is not None and self._entries.get(key) is token

    def unpin(self, key: Any, token: Any) -> None:
        """`pin`'s user let go: one user fewer for `key`, if its factorisation is still the
        one pinned (not dropped since, and made again)."""
        with self._lock:
            self._take_ended()
            if token is not None and self._entries.get(key) is token:
                token.users -= 1
                if token.users <= 0:
                    del self._entries[key]

    def lease(self, key: Any, owner: Any) -> None:
        """A hold of `key` becomes a lease on `owner`: released when `owner` is collected, or
        when the `dx.filter_value_and_grad` call that took it returns (`_runtime.LEASES`:
        its backward pass has run, and an aux that returns `owner` keeps nothing)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.holds == 0:
                return
            entry.holds -= 1
        end = weakref.finalize(owner, self._drop_lease, key, entry)
        if (ends := _runtime.LEASES.get()) is not None:
            ends.append(end)

    def _drop_lease(self, key: Any, entry: _Entry) -> None:
        self._ended.append((key, entry))  # (no lock here: see the class's docstring)

    def _take_ended(self) -> None:
        """The releases of the leases that have ended (under the lock)."""
        while self._ended:
            key, entry = self._ended.popleft()
            if self._entries.get(key) is entry:  # (not a later factorisation of the same matrix)
                entry.users -= 1
                if entry.users <= 0:
                    del self._entries[key]

    def _trim(self) -> None:
        done = [k for k, e in self._entries.items() if e.future.done()]
        for key in done[: max(0, len(self._entries) - self.limit)]:
            del self._entries[key]

    def _fit(self, new: _Entry | None = None) -> None:
        """Drop the oldest factorisations made (not `new`, nor one being made) until those kept
        fit the budget (under the lock)."""
        total = self._nbytes()
        for key, entry in list(self._entries.items()):
            if total <= self.budget:
                return
            if entry is not new and entry.future.done():
                del self._entries[key]
                total -= entry.nbytes


# The store's default budget: this fraction of the machine's memory (`os.sysconf`), or
# `FALLBACK_BUDGET` bytes where it cannot be read.
BUDGET_FRACTION = 0.25
FALLBACK_BUDGET = 4 * 2**30


def machine_memory() -> int | None:
    """The machine's physical memory in bytes, None where `os.sysconf` cannot say (Windows)."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return memory if memory > 0 else None


def default_budget() -> int:
    """A quarter of the machine's memory (`BUDGET_FRACTION`), else `FALLBACK_BUDGET`."""
    memory = machine_memory()
    return FALLBACK_BUDGET if memory is None else int(memory * BUDGET_FRACTION)


# The factorisations kept for backward passes that have not come yet: at most this many
# (the workers of as many matrices are remembered on Dask, `_affinity.REMEMBERED`), and at
# most the budget's bytes (`set_factorisation_budget`).
FACTORISATIONS = Store(limit=_affinity.REMEMBERED)
# (a test's factorisations and budget are not the next one's: reset empties the store and puts
# the default budget back)
_runtime.on_reset(FACTORISATIONS.clear)
_runtime.on_reset(lambda: FACTORISATIONS.set_budget(default_budget()))


# `nbytes` typed `Any` so that a wrong value reaches the check below, whose message names the call.
def set_factorisation_budget(nbytes: Any) -> int:
    """Bound the memory of the factorisations that [`deferax.sparse_solve`][] keeps between
    the forward and the backward pass, in this process, to `nbytes` bytes.

    On the standard schedule, the forward pass's factorisation waits on the host for the
    backward pass. The store that keeps them holds at most `nbytes` bytes, the oldest
    dropped first; a factorisation past the budget on its own is not kept at all, and its
    backward pass factors again (two factorisations a gradient, the same result). Its site
    is then planned so: [`deferax.explain`][] says so beside its estimates, which count the
    second factorisation (the deferred schedules, one job, may then be estimated faster).
    A factorisation's bytes are its solver's report
    ([`deferax.AbstractSparseSolver`][]'s `nbytes`: for [`deferax.SuperLU`][], its factors'
    entries, an index each, and its permutations).

    **Arguments:**

    - `nbytes`: the budget in bytes, a non-negative int (0: never keep one), or None for the
      default: a quarter of the machine's memory (`os.sysconf`), 4 GiB where it cannot be read.

    **Returns:**

    The budget before, in bytes.

    The budget is this process's: the workers of a Dask cluster keep their factorisations
    under their own default budget (call this there, in a worker plugin, to change it).
    Programs already compiled under `jax.jit` keep the plan they were traced with; the
    store keeps to the new budget at once.

    !!! Example

        ```python
        import deferax as dx

        before = dx.set_factorisation_budget(2 * 2**30)  # 2 GiB
        dx.set_factorisation_budget(before)
        ```
    """
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int | np.integer) or nbytes < 0):
        raise ValueError(_BAD_BUDGET.format(found=nbytes, default=_bytes_text(default_budget())))
    before = FACTORISATIONS.budget
    FACTORISATIONS.set_budget(default_budget() if nbytes is None else int(nbytes))
    return before


def factorisation_budget() -> int:
    """The bytes that [`deferax.sparse_solve`][]'s factorisations kept for backward passes may
    take in this process (see [`deferax.set_factorisation_budget`][])."""
    return FACTORISATIONS.budget


_BAD_BUDGET = """`dx.set_factorisation_budget`: `nbytes` must be a non-negative int (bytes), or None for \
the default ({default}, a quarter of this machine's memory), but got {found!r}.
Give a number of bytes, for example `dx.set_factorisation_budget(2 * 2**30)` for 2 GiB."""


def _bytes_text(nbytes: int) -> str:
    """`nbytes` for a message: "100 bytes", "9.62 KB", "44.3 MB", "6.32 GB"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} bytes"


# ----------------------------------------------------------------------------- for the plan


# by solve (a `_on_host._Solve`, typed `Any` here: that module imports this one): the
# bytes of its first factorisation (in this process), for the plan; the latest
# `_MEASURED_KEPT` solves
_MEASURED: collections.OrderedDict[Any, int] = _runtime.store(collections.OrderedDict())
_MEASURED_LOCK = threading.Lock()
_MEASURED_KEPT = 256


def record_nbytes(solve: Any, nbytes: int) -> None:
    """`nbytes` kept as `solve`'s bytes, if it is its first factorisation (see `nbytes_of`)."""
    with _MEASURED_LOCK:
        _MEASURED.setdefault(solve, nbytes)
        while len(_MEASURED) > _MEASURED_KEPT:
            _MEASURED.popitem(last=False)


@_runtime.cached(maxsize=64)
def _positions(pattern: SparsePattern) -> int:
    """The number of distinct positions of `pattern`'s entries."""
    return int(np.unique(pattern.rows * pattern.n + pattern.cols).size)


def nbytes_of(solve: Any) -> tuple[int, bool]:
    """`(bytes, measured)`: the bytes of `solve`'s factorisation, as its first one in this
    process measured; before any, the least any factorisation takes (its factors hold an
    entry at least at each position of the matrix's), not `measured`."""
    with _MEASURED_LOCK:
        measured = _MEASURED.get(solve)
    if measured is not None:
        return measured, True
    return _positions(solve.pattern) * solve.matrix_dtype.itemsize, False


_NOT_KEPT_PROCESSES = """its jobs run on {where}, which cannot send the backward job to the process that \
factored: the factorisation is not kept for the backward pass, which factors again"""
_NOT_KEPT_BUDGET = """its factorisation ({nbytes}) is past the factorisation budget ({budget}, \
`dx.set_factorisation_budget`): it is not kept for the backward pass, which factors again"""


def not_kept(solve: Any, executor: Any) -> str | None:
    """Why the standard schedule's backward pass factors again, for the plan; None when it
    finds the forward's factorisation."""
    if solve.kept == "none":  # (not an executor: `on_executor` says so next)
        return _NOT_KEPT_PROCESSES.format(where=_executor.name(executor)) if isinstance(executor, cf.Executor) else None
    if solve.kept == "worker":  # (its workers' budgets are theirs: kept as far as this process knows)
        return None
    nbytes, measured = nbytes_of(solve)
    budget = FACTORISATIONS.budget
    if nbytes <= budget:
        return None
    shown = _bytes_text(nbytes) if measured else f"at least {_bytes_text(nbytes)}, its matrix's entries"
    return _NOT_KEPT_BUDGET.format(nbytes=shown, budget=_bytes_text(budget))
