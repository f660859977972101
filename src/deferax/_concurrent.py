"""`fuse`: a `fused` implementation that runs a forward and an adjoint at the same time."""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from . import _executor, _jaxpr

# The threads mostly wait for compiled programs; several sites each need two at once.
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=max(16, 2 * (os.cpu_count() or 2)), thread_name_prefix="deferax")


def is_concrete(tree: PyTree) -> bool:
    """True when no leaf is a tracer: the arrays are values, not part of a trace."""
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in jtu.tree_leaves(tree))


class Fused(eqx.Module):
    """`fused(x, ct_y) -> (y, ct_x)` built from `fwd(x) -> y` and `adjoint(x, ct_y)`, with
    `ct_x = combine(x, y, adjoint(x, ct_y))` (the adjoint's result itself without `combine`).

    Made by [`deferax.fuse`][]. The two halves are compiled separately with `jax.jit` and
    run on two threads, so that on a CPU they use two cores (XLA:CPU runs independent
    work inside one program one piece after the other); `combine`, the cheap step that
    needs `y`, runs after both.
    """

    fwd: Callable[..., Any]
    adjoint: Callable[..., Any]
    combine: Callable[..., Any] | None = None

    def __call__(self, x: PyTree, ct_y: PyTree) -> tuple[PyTree, PyTree]:
        y, partial = _concurrently(self.fwd, self.adjoint, _apply, x, ct_y)
        return y, (partial if self.combine is None else self.combine(x, y, partial))

    def vmapped(self, x: PyTree, ct_y: PyTree, x_axes: list) -> tuple[PyTree, PyTree]:
        """The call under `jax.vmap` levels (outermost first; `x_axes` gives each level's
        `in_axes` for `x`, `ct_y` is batched at 0 at every level): the whole batch's
        forward and the whole batch's adjoint, each compiled once, on two threads."""
        fwd = _Vmapped(self.fwd, tuple(_frozen((axes,)) for axes in x_axes))
        adjoint = _Vmapped(self.adjoint, tuple(_frozen((axes, 0)) for axes in x_axes))
        y, partial = _concurrently(fwd, adjoint, _apply, x, ct_y)
        if self.combine is None:
            return y, partial
        return y, _Vmapped(self.combine, tuple(_frozen((axes, 0, 0)) for axes in x_axes))(x, y, partial)

    def batched(self, x: PyTree, cts: PyTree) -> tuple[PyTree, PyTree]:
        """`y` once and one `ct_x` per cotangent (leading axis of `cts`): the forward runs
        once, concurrently with the adjoint batched by `jax.vmap` over the cotangents."""
        y, partials = _concurrently(self.fwd, self.adjoint, _apply_batched, x, cts)
        if self.combine is None:
            return y, partials
        return y, jax.vmap(lambda p: self.combine(x, y, p))(partials)


def _frozen(axes: PyTree) -> tuple:
    leaves, treedef = jtu.tree_flatten(axes, is_leaf=lambda a: a is None)
    return treedef, tuple(leaves)


class _Vmapped(eqx.Module):
    """`f` under `jax.vmap` levels, as a Module that compares by value (so that the
    compiled halves of `Fused.vmapped` are reused from call to call)."""

    f: Callable[..., Any]
    levels: tuple = eqx.field(static=True)  # per level, `in_axes` as (treedef, leaves)

    def __call__(self, *args):
        g = self.f
        for treedef, leaves in reversed(self.levels):
            g = jax.vmap(g, in_axes=jtu.tree_unflatten(treedef, list(leaves)))
        return g(*args)


# Compiled once per implementation and input structure; an `eqx.Module` implementation's
# arrays are arguments, not baked-in constants.
@eqx.filter_jit
def _apply(f, *args):
    return f(*args)


@eqx.filter_jit
def _apply_batched(f, x, cts):
    return jax.vmap(f, in_axes=(None, 0))(x, cts)


_SERIAL: contextvars.ContextVar[bool] = contextvars.ContextVar("deferax_serial", default=False)


@contextlib.contextmanager
def serial() -> Iterator[None]:
    """Inside: `Fused` runs its two halves one after the other (the function is not thread-safe)."""
    token = _SERIAL.set(True)
    try:
        yield
    finally:
        _SERIAL.reset(token)


def _both(first, second, one_at_a_time: bool):
    """`(first(), second())`: on two threads of the pool, or one after the other (under the
    lock that keeps implementations that are not thread-safe apart)."""
    if one_at_a_time:
        with _executor.SERIAL_LOCK:
            return first(), second()
    a, b = _POOL.submit(first), _POOL.submit(second)
    return a.result(), b.result()


def _concurrently(fwd_fn, adjoint_fn, apply_adjoint, x, ct):
    fwd = lambda x_: _apply(fwd_fn, x_)  # noqa: E731
    adjoint = lambda x_, ct_: apply_adjoint(adjoint_fn, x_, ct_)  # noqa: E731
    one_at_a_time = _SERIAL.get() or not _executor.concurrency_enabled()  # read now (while tracing, if traced)
    if is_concrete((x, ct)):
        first = _jaxpr.carry_context(lambda: jax.block_until_ready(fwd(x)))
        second = _jaxpr.carry_context(lambda: jax.block_until_ready(adjoint(x, ct)))
        return _both(first, second, one_at_a_time)

    # Traced (inside jit or vmap): leave the program through one host callback, which runs
    # the two compiled halves on two threads (with the caller's context, read while
    # tracing) and hands both results back.
    y_struct = jax.eval_shape(fwd, x)
    ct_struct = jax.eval_shape(adjoint, x, ct)
    run_fwd = _jaxpr.carry_context(lambda x_: jtu.tree_map(np.asarray, fwd(x_)))
    run_adjoint = _jaxpr.carry_context(lambda x_, ct_: jtu.tree_map(np.asarray, adjoint(x_, ct_)))

    def host(x_, ct_):
        return _both(lambda: run_fwd(x_), lambda: run_adjoint(x_, ct_), one_at_a_time)

    return jax.pure_callback(host, (y_struct, ct_struct), x, ct, vmap_method="sequential")


def fuse(fwd: Callable[..., Any], adjoint: Callable[..., Any], combine: Callable[..., Any] | None = None) -> Fused:
    """Make a `fused` implementation that runs `fwd` and `adjoint` concurrently.

    Use it when the adjoint does not need the primal output (a linear solve with the
    cotangent as right-hand side, a time-stepper run backwards from the cotangent): then the
    deferred schedule can run both at once.

    **Arguments:**

    - `fwd`: `fwd(x) -> y`, JAX-traceable.
    - `adjoint`: `adjoint(x, ct_y) -> ct_x` (or the part of it that `combine` finishes),
      JAX-traceable; it must not need `y`.
    - `combine`: optional `combine(x, y, partial) -> ct_x`, the cheap step that needs `y`
      (for a PDE, `ct_eps = Re(E_fwd * E_adj)`), run after both halves; the same meaning
      as in [`deferax.host`][] and [`deferax.ExpensiveFn`][].

    **Returns:**

    A [`deferax.Fused`][] to pass as `ExpensiveFn(fused=...)`. Called on concrete arrays
    (the deferred schedule outside `jit`) it submits the two compiled halves to a thread
    pool; under `jit` or `vmap` it does the same from inside one `jax.pure_callback` (a
    batch under `vmap` is run one element after another). Not differentiable itself.

    !!! Example

        ```python
        sim = dx.ExpensiveFn(
            fwd=simulate,
            bwd=lambda x, y, ct: adjoint(x, ct),
            fused=dx.fuse(simulate, adjoint),
        )
        ```
    """
    return Fused(fwd, adjoint, combine)
