"""`jacobian`: Equinox's `filter_jacfwd` or `filter_jacrev`, whichever needs fewer passes."""

from __future__ import annotations

import functools as ft
from collections.abc import Callable
from typing import Any

import equinox as eqx

from . import _site

_MODES = ("auto", "forward", "reverse")


def _count(tree: Any) -> int:
    """The real numbers of the inexact arrays of `tree` (complex counts twice)."""
    return _site.n_inputs(eqx.filter(tree, eqx.is_inexact_array))


def jacobian(fun: Callable | None = None, *, has_aux: bool = False, mode: str = "auto") -> Callable:
    """The Jacobian of `fun` with respect to the floating-point arrays of its first argument,
    in forward or reverse mode, whichever needs fewer passes.

    Filtering and the returned structure are Equinox's (`eqx.filter_jacfwd` and
    `eqx.filter_jacrev`, which it calls): the first argument's floating-point arrays are
    differentiated, everything else is held constant. With `mode="auto"` the choice is
    made from the sizes, traced once: forward mode (one pass per input number, batched)
    when the input has no more numbers than the output, reverse mode (one pass per output
    number) otherwise. Inside either, each [`deferax.ExpensiveFn`][] call differentiates
    itself on its own strategy (see [Forward and reverse mode](../forward-reverse.md)).

    **Arguments:**

    - `fun`: the function; it returns a pytree of arrays (or `(out, aux)` with `has_aux`).
    - `has_aux`: as in Equinox.
    - `mode`: `"auto"` (default), `"forward"` or `"reverse"`.

    **Returns:**

    A function with the signature of `fun` that returns the Jacobian (and `aux`, as
    `(jacobian, aux)`, with `has_aux=True`).
    """
    if mode not in _MODES:
        raise ValueError(f"`deferax.jacobian`: `mode` must be 'auto', 'forward' or 'reverse', but got {mode!r}.")
    if fun is None:
        return ft.partial(jacobian, has_aux=has_aux, mode=mode)

    @ft.wraps(fun)
    def wrapper(x, *args, **kwargs):
        chosen = mode
        if chosen == "auto":
            out = eqx.filter_eval_shape(fun, x, *args, **kwargs)
            out = out[0] if has_aux else out
            chosen = "forward" if _count(x) <= _site.n_inputs(out) else "reverse"
        transform = eqx.filter_jacfwd if chosen == "forward" else eqx.filter_jacrev
        return transform(fun, has_aux=has_aux)(x, *args, **kwargs)

    return wrapper
