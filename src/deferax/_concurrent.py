"""`fuse`: a `fused` implementation that runs a forward and an adjoint at the same time."""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools as ft
import os
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from . import _errors, _executor, _jaxpr, _record

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
# arrays are arguments, not baked-in constants. (What `eqx.filter_jit` does, with less
# Python on each call: its dispatch was a large part of a small function's fixed cost.)
def _run(f, batched: bool, *args):
    return jax.vmap(f, in_axes=(None, 0))(*args) if batched else f(*args)


@ft.partial(jax.jit, static_argnums=(0, 1))
def _compiled(static, batched: bool, dynamic, *args):
    return _run(eqx.combine(dynamic, static), batched, *args)


def _dispatch(batched: bool, f, *args):
    dynamic, static = eqx.partition(f, eqx.is_array)
    try:
        hash(static)
    except TypeError:  # an unhashable part (a list, say): Equinox's general path
        return _filter_compiled(f, batched, *args)
    return _compiled(static, batched, dynamic, *args)


_filter_compiled = eqx.filter_jit(_run)


def _apply(f, *args):
    return _dispatch(False, f, *args)


def _apply_batched(f, x, cts):
    """`f(x, ct)` for each cotangent along the leading axis of `cts`."""
    return _dispatch(True, f, x, cts)


_SERIAL: contextvars.ContextVar[bool] = contextvars.ContextVar("deferax_serial", default=False)


def serial():
    """Inside: `Fused` runs its two halves one after the other (the function is not thread-safe)."""
    return _jaxpr.setting(_SERIAL, True)


def _both(first, second, one_at_a_time: bool):
    """`(first(), second())`: `second` on a thread of the pool while `first` runs here (one
    hand-off, not two), or one after the other (under the lock that keeps implementations
    that are not thread-safe apart)."""
    if one_at_a_time:
        with _executor.SERIAL_LOCK:
            return first(), second()
    other = _POOL.submit(second)
    try:
        mine = first()
    except BaseException:
        concurrent.futures.wait([other])  # never leave the other half running behind an error
        raise
    return mine, other.result()


# ---------------------------------------------------------------------------- devices

_DEVICES: list | None = None  # `set_devices`; None: every local device of the default backend
_SLOT: contextvars.ContextVar[int] = contextvars.ContextVar("deferax_slot", default=0)


def set_devices(devices: Any = None) -> None:
    """Choose the devices that the deferred stage spreads its JAX-native work over.

    When JAX sees several devices (several GPUs; on a CPU, with
    `XLA_FLAGS=--xla_force_host_platform_device_count=N`), the forward and the adjoint of
    a `fused` made by [`deferax.fuse`][] (or derived from `fwd` and a `bwd` that does not
    read `y`) run on two different devices, and the sites of one step on different pairs
    of devices, round robin; their results come back to the device the inputs were on.

    **Arguments:**

    - `devices`: a list of `jax.Device`s to use, in order; `None` (the default) for all
      of `jax.local_devices()`. A list of one device keeps all the work on that device.
    """
    global _DEVICES
    if devices is None:
        _DEVICES = None
        return
    if isinstance(devices, str | jax.Device) or not isinstance(devices, Sequence) or not devices:
        raise TypeError(_errors.BAD_DEVICES.format(found=repr(devices)[:80]))
    bad = [d for d in devices if not isinstance(d, jax.Device)]
    if bad:
        raise TypeError(_errors.BAD_DEVICES.format(found=f"{bad[0]!r:.80} among them"))
    _DEVICES = list(devices)


def slot(index: int):
    """Inside: the `Fused` calls use the `index`-th pair of devices (one site of several)."""
    return _jaxpr.setting(_SLOT, index)


def placement() -> tuple[jax.Device | None, jax.Device | None]:
    """`(forward's device, adjoint's device)` for this slot; `(None, None)` on one device."""
    devices = jax.local_devices() if _DEVICES is None else _DEVICES
    if len(devices) < 2:
        return None, None
    first = (2 * _SLOT.get()) % len(devices)
    return devices[first], devices[(first + 1) % len(devices)]


def _on(device, tree):
    """`tree` with its arrays on `device` (unchanged for `None`)."""
    if device is None:
        return tree
    return jtu.tree_map(lambda a: jax.device_put(a, device) if isinstance(a, jax.Array | np.ndarray) else a, tree)


def _concurrently(fwd_fn, adjoint_fn, apply_adjoint, x, ct):
    one_at_a_time = _SERIAL.get() or not _executor.concurrency_enabled()  # read now (while tracing, if traced)
    fwd_device, adjoint_device = placement()

    fwd_name, adjoint_name = getattr(fwd_fn, "impl", "fwd"), getattr(adjoint_fn, "impl", "adjoint")

    def fwd(x_):
        with _record.timed_outside():  # (recorded around this call)
            return _apply(*_on(fwd_device, (fwd_fn, x_)))

    def adjoint(x_, ct_):
        with _record.timed_outside():
            return apply_adjoint(*_on(adjoint_device, (adjoint_fn, x_, ct_)))

    if is_concrete((x, ct)):
        # the results go back to the device `x` is on (when the halves were placed)
        home = (_record.device_of(x) or jax.local_devices()[0]) if fwd_device is not None else None
        first = lambda: _on(home, _record.call(fwd_name, lambda: jax.block_until_ready(fwd(x)), False, fwd_device))  # noqa: E731
        second = _jaxpr.carry_context(lambda: _on(home, _record.call(adjoint_name, lambda: jax.block_until_ready(adjoint(x, ct)), False, adjoint_device)))
        return _both(first, second, one_at_a_time)

    # Traced (inside jit or vmap): leave the program through one host callback, which runs
    # the two compiled halves on two threads (with the caller's context, read while
    # tracing) and hands both results back.
    y_struct = jax.eval_shape(fwd, x)
    ct_struct = jax.eval_shape(adjoint, x, ct)
    default = jax.local_devices()[0]
    run_fwd = _jaxpr.carry_context(lambda x_: _record.call(fwd_name, lambda: jtu.tree_map(np.asarray, fwd(x_)), False, fwd_device or default))
    run_adjoint = _jaxpr.carry_context(
        lambda x_, ct_: _record.call(adjoint_name, lambda: jtu.tree_map(np.asarray, adjoint(x_, ct_)), False, adjoint_device or default)
    )

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
