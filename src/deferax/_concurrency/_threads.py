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

from .. import _jaxpr, _record
from .._checks import _messages as _errors
from .._host import _executor

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
    # `dx.fuse` compiles its halves once (as `jax.jit` would); the one made from `fwd` and
    # `adjoint`/`bwd` calls them as the standard schedule would (see `_concurrently`)
    compiled = True

    def __call__(self, x: PyTree, ct_y: PyTree) -> tuple[PyTree, PyTree]:
        y, partial = _concurrently(self.fwd, self.adjoint, x, ct_y, compiled=self.compiled)
        return y, (partial if self.combine is None else self.combine(x, y, partial))

    def vmapped(self, x: PyTree, ct_y: PyTree, x_axes: list) -> tuple[PyTree, PyTree]:
        """The call under `jax.vmap` levels (outermost first; `x_axes` gives each level's
        `in_axes` for `x`, `ct_y` is batched at 0 at every level): the whole batch's
        forward and the whole batch's adjoint, on two threads."""
        fwd = _Vmapped(self.fwd, tuple(_frozen((axes,)) for axes in x_axes))
        adjoint = _Vmapped(self.adjoint, tuple(_frozen((axes, 0)) for axes in x_axes))
        y, partial = _concurrently(fwd, adjoint, x, ct_y, compiled=self.compiled)
        if self.combine is None:
            return y, partial
        return y, _Vmapped(self.combine, tuple(_frozen((axes, 0, 0)) for axes in x_axes))(x, y, partial)

    def batched(self, x: PyTree, cts: PyTree) -> tuple[PyTree, PyTree]:
        """`y` once and one `ct_x` per cotangent (leading axis of `cts`): the forward runs
        once, concurrently with the adjoint batched by `jax.vmap` over the cotangents."""
        y, partials = _concurrently(self.fwd, self.adjoint, x, cts, batched=True, compiled=self.compiled)
        if self.combine is None:
            return y, partials
        return y, jax.vmap(lambda p: self.combine(x, y, p))(partials)


class Derived(Fused):
    """The `fused` that the deferred schedule makes from `fwd` and `adjoint` (or a `bwd` that
    does not read `y`): the same two threads, each half called as the standard schedule
    would call it, so that it reads what it reads afresh (eagerly, on every call)."""

    compiled = False


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


def _direct(batched: bool, f, *args):
    """`f` called as it is, not compiled here (eagerly: operation by operation, unless `f`
    is itself jitted), reading whatever it reads now."""
    return _run(f, batched, *args)


class _TracedHalf:
    """A half traced now, inside the caller's trace, and compiled at its first run from the
    callback: what it reads (a global, a NumPy array) is read at trace time, as when the
    standard schedule traces the implementation into the surrounding program. Constants it
    closes over stay in the compiled program, except tracers of the surrounding program,
    which enter the callback as operands (`consts`)."""

    def __init__(self, name: str, f, *args):
        self.name = name
        with _record.timed_outside():  # (recorded around the run, not here)
            closed, self.out = _jaxpr.trace(lambda *a: f(*a), *args)
        program, consts = _jaxpr.open_consts(closed)
        traced = [isinstance(c, jax.core.Tracer) for c in consts]
        self.consts = [c for c, t in zip(consts, traced, strict=True) if t]
        kept = [c for c, t in zip(consts, traced, strict=True) if not t]

        def run(given, leaves):
            it_given, it_kept = iter(given), iter(kept)
            return _jaxpr.interpret(program, [next(it_given) if t else next(it_kept) for t in traced] + list(leaves))

        self.run = jax.jit(run)

    def __call__(self, device, consts, *args):
        outs = self.run(*_on(device, (list(consts), jtu.tree_leaves(args))))
        return jtu.tree_unflatten(jtu.tree_structure(self.out), outs)


# Several sites gathered into one callback under `jit` (`_stages.stage2`): while their
# shapes are traced, each site's halves made from `fwd` and `bwd` are traced and kept by
# slot in the dict of `_PREPARING`; the callback then runs them as traced (`_PREPARED`).
_PREPARING: contextvars.ContextVar[dict | None] = contextvars.ContextVar("deferax_preparing", default=None)
_PREPARED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("deferax_prepared", default=None)


def preparing(prepared: dict):
    """Inside: the halves traced here for made-from-`fwd`-and-`bwd` sites are kept in `prepared`."""
    return _jaxpr.setting(_PREPARING, prepared)


def all_runnable(prepared: dict) -> bool:
    """Whether every half kept in `prepared` can run from the gathered callback: traced once
    for its site, and closing over no value of the surrounding trace."""
    return all(h is not None and not h[0].consts and not h[1].consts for h in prepared.values())


def running_prepared(prepared: dict):
    """Inside (the gathered callback): the halves kept in `prepared` run as they were traced."""
    return _jaxpr.setting(_PREPARED, prepared)


_SERIAL: contextvars.ContextVar[bool] = contextvars.ContextVar("deferax_serial", default=False)


def serial():
    """Inside: `Fused` runs its two halves one after the other (the function is not thread-safe)."""
    return _jaxpr.setting(_SERIAL, True)


def _both(first, second, serial_: bool):
    """`(first(), second())`: `second` on a thread of the pool while `first` runs here (one
    hand-off, not two), or one after the other (under the lock that keeps implementations
    that are not thread-safe apart) for a function that is not thread-safe (`serial_`) or
    while concurrency is switched off (read now, when the halves run, also from a program
    compiled before `set_concurrency` was called)."""
    if serial_ or not _executor.concurrency_enabled():
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


def _is_tracer(leaf) -> bool:
    return isinstance(leaf, jax.core.Tracer)


def _concurrently(fwd_fn, adjoint_fn, x, ct, *, batched: bool = False, compiled: bool = True):
    """`(fwd_fn(x), adjoint_fn(x, ct))` at the same time (`adjoint_fn` vmapped over the
    leading axis of `ct` when `batched`). `compiled`: each half is compiled once per
    function and input structure (`dx.fuse`); otherwise each is called as the standard
    schedule calls an implementation: eagerly as it is, and under a trace, traced now."""
    serial_ = _SERIAL.get()  # (the function's own: read while tracing, if traced)
    fwd_device, adjoint_device = placement()
    run = _dispatch if compiled else _direct

    fwd_name, adjoint_name = getattr(fwd_fn, "impl", "fwd"), getattr(adjoint_fn, "impl", "adjoint")
    # The halves' own arrays (an `eqx.Module` implementation's fields) that are tracers (the
    # model passed through `jit`, or batched by `vmap`) enter the callback as operands;
    # concrete ones stay where they are.
    arrays, static = eqx.partition((fwd_fn, adjoint_fn), _is_tracer)

    def fwd(arrays_, x_, device=fwd_device):
        f, _ = eqx.combine(arrays_, static)
        with _record.timed_outside():  # (recorded around this call)
            return run(False, *_on(device, (f, x_)))

    def adjoint(arrays_, x_, ct_, device=adjoint_device):
        _, a = eqx.combine(arrays_, static)
        with _record.timed_outside():
            return run(batched, *_on(device, (a, x_, ct_)))

    if is_concrete((arrays, x, ct)):
        prepared = _PREPARED.get()
        entry = None if compiled or prepared is None else prepared.get(_SLOT.get())
        if entry is not None:  # (in a gathered callback: the halves as they were traced)
            traced_fwd, traced_adjoint = entry
            every, _ = eqx.partition((fwd_fn, adjoint_fn), eqx.is_array)  # (all were tracers then)
            call_fwd = lambda: traced_fwd(fwd_device, [], every, x)  # noqa: E731
            call_adjoint = lambda: traced_adjoint(adjoint_device, [], every, x, ct)  # noqa: E731
        else:
            call_fwd = lambda: fwd(arrays, x)  # noqa: E731
            call_adjoint = lambda: adjoint(arrays, x, ct)  # noqa: E731
        # the results go back to the device `x` is on (when the halves were placed)
        home = (_record.device_of(x) or jax.local_devices()[0]) if fwd_device is not None else None
        first = lambda: _on(home, _record.call(fwd_name, lambda: jax.block_until_ready(call_fwd()), False, fwd_device))  # noqa: E731
        second = _jaxpr.carry_context(lambda: _on(home, _record.call(adjoint_name, lambda: jax.block_until_ready(call_adjoint()), False, adjoint_device)))
        return _both(first, second, serial_)

    # Traced (inside jit or vmap): leave the program through one host callback, which runs
    # the two compiled halves on two threads (with the caller's context, read while
    # tracing) and hands both results back.
    if compiled:
        y_struct = jax.eval_shape(fwd, arrays, x)
        ct_struct = jax.eval_shape(adjoint, arrays, x, ct)
        half_fwd = lambda consts, arrays_, x_: fwd(arrays_, x_)  # noqa: E731
        half_adjoint = lambda consts, arrays_, x_, ct_: adjoint(arrays_, x_, ct_)  # noqa: E731
        consts = ([], [])
    else:
        traced_fwd = _TracedHalf(fwd_name, lambda a, x_: fwd(a, x_, None), arrays, x)
        traced_adjoint = _TracedHalf(adjoint_name, lambda a, x_, ct_: adjoint(a, x_, ct_, None), arrays, x, ct)
        preparing_ = _PREPARING.get()
        if preparing_ is not None:  # (kept for the gathered callback; a second call of one slot: not used)
            index = _SLOT.get()
            preparing_[index] = None if index in preparing_ else (traced_fwd, traced_adjoint)
        y_struct, ct_struct = traced_fwd.out, traced_adjoint.out
        half_fwd = ft.partial(traced_fwd, fwd_device)
        half_adjoint = ft.partial(traced_adjoint, adjoint_device)
        consts = (traced_fwd.consts, traced_adjoint.consts)
    default = jax.local_devices()[0]
    run_fwd = _jaxpr.carry_context(
        lambda c, arrays_, x_: _record.call(fwd_name, lambda: jtu.tree_map(np.asarray, half_fwd(c, arrays_, x_)), False, fwd_device or default)
    )
    run_adjoint = _jaxpr.carry_context(
        lambda c, arrays_, x_, ct_: _record.call(
            adjoint_name, lambda: jtu.tree_map(np.asarray, half_adjoint(c, arrays_, x_, ct_)), False, adjoint_device or default
        )
    )

    def host(consts_, arrays_, x_, ct_):
        return _both(lambda: run_fwd(consts_[0], arrays_, x_), lambda: run_adjoint(consts_[1], arrays_, x_, ct_), serial_)

    return jax.pure_callback(host, (y_struct, ct_struct), consts, arrays, x, ct, vmap_method="sequential")


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
