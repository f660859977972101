"""The process's state, in one place: thread pools, switches, caches and registries.

Every other module is code over values; what deferax keeps between calls lives here (or,
for a store that belongs to one feature, stays beside it and registers with `reset`).
The modules that use a piece of state name it once (`_CACHE = _runtime.EAGER_CACHE`), so
that a mutable container keeps one identity: `reset` clears it in place, and never rebinds
a name that another module holds.

Two kinds of switch, on purpose (`set_concurrency`'s and `set_typechecking`'s docstrings say so too):

- process-wide (`SWITCHES`: `dx.set_concurrency`, `dx.set_devices`): read when the
  expensive calls run, from whichever thread runs them: deferax's pools, and the callbacks
  that XLA runs on its own threads for a step compiled earlier, in another context. A
  context variable set by the caller would not reach them, and a compiled step would keep
  the value it was traced with.
- per context (the `contextvars.ContextVar`s below: `dx.set_typechecking`, and the
  settings deferax itself makes around a block): read while a step is traced, in the
  caller's thread, and carried into deferax's own threads with the caller's context
  (`_jaxpr.carry_context`). A thread the user starts begins with the defaults.

`reset()` puts everything back as it was at import (for tests: `tests/conftest.py` calls it
around each test).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import contextvars
import dataclasses
import functools as ft
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])

# ----------------------------------------------------------------------------- process-wide switches


@dataclasses.dataclass
class Switches:
    """The process-wide switches (module docstring: why these are not context variables)."""

    concurrent: bool = True  # `set_concurrency`: may two implementation calls run at once
    devices: list | None = None  # `set_devices`; None: every local device of the default backend
    # the platform the placement of a site's halves is decided for; None: the devices' own
    # (tests set it, to check each platform's decision on a CPU)
    platform: str | None = None


SWITCHES = Switches()

# ----------------------------------------------------------------------------- per-context switches

TYPECHECK_ENV = "DEFERAX_TYPECHECK"
TYPECHECK_DEFAULT = os.environ.get(TYPECHECK_ENV, "1").strip().lower() not in ("0", "false", "off", "no")
# `set_typechecking`, `typechecking` (`_typed.py`)
TYPECHECKING: contextvars.ContextVar[bool] = contextvars.ContextVar("deferax_typecheck", default=TYPECHECK_DEFAULT)
# the module whose fields share the current jaxtyping bindings, while a typed call is checked (`_typed.py`)
FIELDS: contextvars.ContextVar[Any] = contextvars.ContextVar("deferax_fields", default=None)
# how the site whose stage-2 call runs here is placed: its devices, whether serial, its
# halves traced for the gathered callback (`_concurrency/_placement.py`)
PLACEMENT: contextvars.ContextVar[Any] = contextvars.ContextVar("deferax_placement", default=None)
# the output structures declared by the sites traced here (`_site/_primitive.py`)
DECLARED: contextvars.ContextVar[list | None] = contextvars.ContextVar("deferax_declared", default=None)
# inside: a structural key is being made for a rule's program (`_jaxpr/_keys.py`)
IN_RULE: contextvars.ContextVar[bool] = contextvars.ContextVar("deferax_keying_a_rule", default=False)
# inside: a key is being made for a program that is only evaluated, never differentiated (`_jaxpr/_keys.py`)
EVALUATED: contextvars.ContextVar[bool] = contextvars.ContextVar("deferax_keying_evaluated", default=False)
# what a recorded call is part of: its site, where it runs, whether timed outside (`_record.py`)
SITE: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("deferax_site", default=None)
WHERE: contextvars.ContextVar[str | None] = contextvars.ContextVar("deferax_where", default=None)
TIMED_OUTSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("deferax_timed_outside", default=False)
# the strategy the plan chose for each site that stage 3 differentiates, by `Spec` (`_site/_primitive.py`)
PLANNED: contextvars.ContextVar[Any] = contextvars.ContextVar("deferax_planned", default=None)
# inside: the host functions run from stage 2's gathered callback, whose outputs leave as
# NumPy arrays (no lease is taken on them: `_host/_host.py`, `_sparse/_factorisations.py`)
IN_CALLBACK: contextvars.ContextVar[bool] = contextvars.ContextVar("deferax_in_callback", default=False)
# inside: the stage 2 of an eager call whose plan came from the cache without tracing the sites'
# `bwd`s again (each read as not reading `y` on the program's last call, `_stages/_run.py`):
# a half made from `bwd` is checked on its own thread, before it runs (`_schedules/_deferred.py`);
# the value: what forgets that last read, where the check finds that a `bwd` now reads `y`
BWD_UNREAD: contextvars.ContextVar[Any] = contextvars.ContextVar("deferax_bwd_unread", default=None)
# the most devices one input of the call being analysed spans (eagerly: 2 or more for sharded
# inputs; 0 under a trace, where it cannot be told): read by `_placement.halves_run`
SPANS: contextvars.ContextVar[int] = contextvars.ContextVar("deferax_spans", default=0)
# inside: `explain` plans a function compiled with `jax.jit` (its halves placed as under a trace)
EXPLAINING_JITTED: contextvars.ContextVar[bool] = contextvars.ContextVar("deferax_explaining_jitted", default=False)
# the host sites' functions whose derivative is being traced here (their JVP rule runs): one
# met again inside is being differentiated twice (`_site/_primitive.py`)
DIFFERENTIATED: contextvars.ContextVar[tuple] = contextvars.ContextVar("deferax_differentiated", default=())
# inside: the trace of a loss that deferax differentiates next (`_transform._trace`): a site
# differentiated in it (a `jax.grad` inside the loss) has its derivative differentiated too,
# and one that has a formulation for that uses it (`_site/_primitive.py`)
TO_BE_DIFFERENTIATED: contextvars.ContextVar[bool] = contextvars.ContextVar("deferax_diff_next", default=False)
# whether a backward pass may follow the forward calls made here: set from a site's equation
# (`Spec.backward`, `_site/_primitive.py: outputs`); `dx.sparse_solve` keeps a forward's
# factorisation for it only then (`_sparse/_on_host.py`). Outside a site's rules, True.
BACKWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("deferax_backward", default=True)
# inside a `dx.filter_value_and_grad` call: the ends of the leases its eager forward passes
# took on their outputs (`_sparse/_factorisations.py: Store.lease`), run when the call returns,
# since no backward pass of its own can follow then; None outside one (a lease then lasts as
# long as its output, for a `jax.vjp` function called later)
LEASES: contextvars.ContextVar[list | None] = contextvars.ContextVar("deferax_leases", default=None)

CONTEXT_VARS: tuple[contextvars.ContextVar, ...] = (
    TYPECHECKING,
    FIELDS,
    PLACEMENT,
    DECLARED,
    IN_RULE,
    EVALUATED,
    SITE,
    WHERE,
    TIMED_OUTSIDE,
    PLANNED,
    IN_CALLBACK,
    SPANS,
    EXPLAINING_JITTED,
    DIFFERENTIATED,
    TO_BE_DIFFERENTIATED,
    BACKWARD,
    LEASES,
)

# ----------------------------------------------------------------------------- thread pools

# The size of deferax's host pool: Python's default for a `ThreadPoolExecutor`, given
# explicitly, so that deferax knows it (a pool's size is not public).
HOST_WORKERS = min(32, (os.cpu_count() or 1) + 4)
# name: (threads, thread name prefix)
_POOL_SIZES = {
    # two halves at once (`_concurrency/_threads.py`): the threads mostly wait for compiled
    # programs, and several sites each need two at once
    "halves": (max(16, 2 * (os.cpu_count() or 2)), "deferax"),
    # the sites of one step together (stage 2, `_stages/_run.py`); each waits for its site's calls,
    # which run on the other pools, so that no thread waits for its own pool
    "sites": (32, "deferax-site"),
    # host jobs given no `executor=` (`_host/_executor.py`)
    "host": (HOST_WORKERS, "deferax-host"),
}


class Pools:
    """deferax's own thread pools, each made on its first use."""

    def __init__(self):
        self._lock = threading.Lock()
        self._made: dict[str, cf.ThreadPoolExecutor] = {}

    def get(self, name: str) -> cf.ThreadPoolExecutor:
        """The pool `name` (`"halves"`, `"sites"`, `"host"`), made now if it was not yet."""
        with self._lock:
            pool = self._made.get(name)
            if pool is None:
                workers, prefix = _POOL_SIZES[name]
                pool = self._made[name] = cf.ThreadPoolExecutor(workers, thread_name_prefix=prefix)
            return pool

    def made(self, name: str) -> cf.ThreadPoolExecutor | None:
        """The pool `name` if it has been made (None before its first use)."""
        with self._lock:
            return self._made.get(name)

    def close(self) -> None:
        """Shut every pool down (jobs already submitted still finish) and forget it."""
        with self._lock:
            pools, self._made = list(self._made.values()), {}
        for pool in pools:
            pool.shutdown(wait=False)


POOLS = Pools()

# ----------------------------------------------------------------------------- timings of earlier calls

# On each thread, the timings gathered for one job that times its own parts: the thread-local
# of `_plan/_cost.TIMINGS` (which keeps the timings themselves, and is cleared by `reset`).
TIMINGS_GATHERING = threading.local()

# ----------------------------------------------------------------------------- native thread pools

NATIVE_LOCK = threading.Lock()


@dataclasses.dataclass
class Native:
    """The native thread pools' limits while host jobs run at once (`_concurrency/_native_threads.py`)."""

    running: int = 0  # host jobs running at once on threads of this process, over all batches
    caps: list[int] = dataclasses.field(default_factory=list)  # the caps of the code inside `capped` now
    # (a library's path, its setter, its setting before deferax limited it, its setting now)
    saved: list[list[Any]] = dataclasses.field(default_factory=list)
    found: tuple[int, list] | None = None  # (how many modules were imported, the libraries loaded then)


NATIVE = Native()

# ----------------------------------------------------------------------------- caches

# the eager path's compiled stages, by program key, least recently used first (`_transform.py`)
EAGER_CACHE: collections.OrderedDict = collections.OrderedDict()
# what each site's `bwd` was read to allow on a program's last eager call, by its key's hash (`_stages/_run.py`)
LAST_BWDS: collections.OrderedDict = collections.OrderedDict()
# the backward rules found to run alone (`_jaxpr/_replay.py`)
REPLAY_ALONE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# `dx.SuperLU()`'s column ordering chosen for each sparsity pattern, by (shape, digest of the
# pattern): the ordering and the fill of each one tried (`_sparse/_solver.py`)
ORDERINGS: dict[tuple, tuple[str, dict[str, int]]] = {}

# ----------------------------------------------------------------------------- registries

# `register_recognition`: rule by primitive, and the built-in rules' libraries loaded (`_recognise/_registry.py`)
RECOGNITION_RULES: dict[Any, tuple[str, Callable]] = {}
RECOGNITION_BUILTINS: set[str] = set()
# `recognise_tesseract`: the tesseracts declared (`_recognise/_tesseract.py`)
TESSERACTS: weakref.WeakSet = weakref.WeakSet()
# `recognise_custom_vjp`: the backward rules declared, each with its callbacks independent (`_recognise/_custom_vjp.py`)
CUSTOM_VJPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# the timelines of the `record()` blocks open now (`_record.py`)
RECORDERS: list = []

# ----------------------------------------------------------------------------- reset

_CLEARS: list[Callable[[], Any]] = []  # what `reset` calls besides the state above


def on_reset(clear: Callable[[], Any]) -> Callable[[], Any]:
    """Have `reset` call `clear` (a store kept beside its feature: its `clear` method)."""
    _CLEARS.append(clear)
    return clear


_C = TypeVar("_C")


def store(container: _C) -> _C:
    """`container` (a dict, a set, ...: a store kept beside its feature), emptied by `reset`."""
    on_reset(container.clear)  # pyright: ignore[reportAttributeAccessIssue]
    return container


def cached(maxsize: int | None) -> Callable[[_F], _F]:
    """`functools.lru_cache(maxsize)`, emptied by `reset`."""

    def decorate(fn: _F) -> _F:
        wrapped = ft.lru_cache(maxsize=maxsize)(fn)
        on_reset(wrapped.cache_clear)
        return wrapped  # pyright: ignore[reportReturnType]  (an lru_cache wrapper calls as `fn`)

    return decorate


@contextlib.contextmanager
def leases_end_on_return() -> Iterator[None]:
    """Around one `dx.filter_value_and_grad` call: the leases its forward passes take end
    when it returns (`LEASES`)."""
    ends: list = []
    token = LEASES.set(ends)
    try:
        yield
    finally:
        LEASES.reset(token)
        for end in ends:
            end()


def reset() -> None:
    """Put the process's state back as it was at import: the switches to their defaults (the
    per-context ones in the current context), no timings, empty caches and registries, and
    the pools shut down (made again on their next use). The counts of native jobs running
    now are live and stay; the libraries found are found again. For tests: not meant to be
    called while deferax runs something."""
    defaults = Switches()
    SWITCHES.concurrent, SWITCHES.devices, SWITCHES.platform = defaults.concurrent, defaults.devices, defaults.platform
    for var in CONTEXT_VARS:
        var.set(_default(var))
    with NATIVE_LOCK:
        NATIVE.found = None
    EAGER_CACHE.clear()
    LAST_BWDS.clear()
    ORDERINGS.clear()
    REPLAY_ALONE.clear()
    RECOGNITION_RULES.clear()
    RECOGNITION_BUILTINS.clear()
    TESSERACTS.clear()
    CUSTOM_VJPS.clear()
    RECORDERS.clear()
    for clear in _CLEARS:
        clear()
    POOLS.close()


def _default(var: contextvars.ContextVar) -> Any:
    """The default `var` was declared with (every variable here has one)."""
    return contextvars.Context().run(var.get)
