"""What deferax learns of a user's implementation without running it: whether an error
raised while tracing it says that JAX cannot trace it (`untraceable`), and which function's
jaxtyping annotations a call of it checks (`checked_function`, `annotated`)."""

from __future__ import annotations

import inspect
from typing import Any

import equinox as eqx
import jax

from .. import _typed


def untraceable(error: Exception) -> bool:
    """Whether `error`, raised by an implementation traced on abstract values, says that JAX
    cannot trace it (a NumPy or host function), rather than that it failed on this input."""
    if isinstance(error, UNTRACEABLE):
        return True
    # a compiled extension rejecting the tracer itself: SciPy's "argument 1 must be
    # numpy.ndarray, not DynamicJaxprTracer"
    return type(error) is TypeError and "Tracer" in str(error)


UNTRACEABLE = (
    jax.errors.TracerArrayConversionError,  # `np.asarray(x)`, a NumPy or SciPy function
    jax.errors.ConcretizationTypeError,  # `float(x)`, `int(x)`, `if x > 0:`, `x.item()`
    jax.errors.TracerIntegerConversionError,  # `x` as an index: `items[x]`, `range(x)`
)


def checked_function(fn: Any) -> Any:
    """The function whose annotations `ExpensiveFn._typed_call` checks for an implementation
    `fn`: `fn` itself (a function or a method), a Module's `__call__`, or None (a
    `TypedModule` checks its own wherever it is called; other callables are not checked)."""
    if isinstance(fn, _typed.TypedModule):
        return None
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        return fn
    method = type(fn).__call__ if isinstance(fn, eqx.Module) else None
    return method if inspect.isfunction(method) else None


def annotated(fn: Any) -> bool:
    """Whether `fn` has annotations that `ExpensiveFn._typed_call` would check."""
    return bool(getattr(checked_function(fn), "__annotations__", None))
