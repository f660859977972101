"""The hook through which the schedule transforms see `ExpensiveFn` call sites.

Outside `deferax.filter_value_and_grad` no recorder is active and an `ExpensiveFn` call is
an ordinary function call on the standard schedule. While one of the transforms traces the
user's program it installs a recorder; every call site is then routed to the recorder,
which may record it, replace its output by a placeholder, or replay precomputed results.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Recorder(Protocol):
    def call(self, fn: Any, x: Any) -> Any: ...


_RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "deferax_recorder", default=None
)


def active() -> Recorder | None:
    return _RECORDER.get()


@contextlib.contextmanager
def recording(recorder: Recorder | None) -> Iterator[None]:
    token = _RECORDER.set(recorder)
    try:
        yield
    finally:
        _RECORDER.reset(token)
