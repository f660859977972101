"""Two halves at the same time: a forward and an adjoint, each compiled (or called as the
standard schedule would call it) and run on its own thread, eagerly or from one host
callback inside a traced program."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools as ft
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .. import _jaxpr, _record, _runtime
from .._jaxpr import is_concrete, zeros
from . import _placement
from ._devices import on
from ._placement import one_at_a_time, serialised


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
        outs = self.run(*on(device, (list(consts), jtu.tree_leaves(args))))
        return jtu.tree_unflatten(jtu.tree_structure(self.out), outs)


class _NeedsY:
    def __repr__(self) -> str:
        return "NEEDS_Y"


# What an adjoint half gives in place of its result where the check it was given found that
# its `bwd` reads `y` (`concurrently`): the caller runs it after the forward, on its `y`.
NEEDS_Y: Any = _NeedsY()


def _unless_it_needs_y(check: Callable[[], str | None], run: Callable[[], Any]) -> Any:
    """`run()`, where `check()` finds nothing that needs `y`; else `NEEDS_Y`, run nothing."""
    return NEEDS_Y if check() is not None else run()


def _both(first, second, serial_: bool):
    """`(first(), second())`: `second` on a thread of the pool while `first` runs here (one
    hand-off, not two), or one after the other (under the lock that keeps implementations
    that are not thread-safe apart) for a function that is not thread-safe (`serial_`) or
    while concurrency is switched off (read now, when the halves run, also from a program
    compiled before `set_concurrency` was called)."""
    if serialised(serial_):
        with one_at_a_time(serial_):
            return first(), second()
    other = _runtime.POOLS.get("halves").submit(second)
    try:
        mine = first()
    except BaseException:
        concurrent.futures.wait([other])  # never leave the other half running behind an error
        raise
    return mine, other.result()


@dataclasses.dataclass(frozen=True)
class _Halves:
    """The two halves of one concurrent call: what each runs (`static`, with the traced
    arrays given at each call), how (`run`: `_dispatch` compiles, `_direct` does not),
    under which names for the recording, and on which devices."""

    static: Any  # (fwd_fn, adjoint_fn) without their traced arrays
    run: Callable[..., Any]
    batched: bool
    names: tuple[str, str]
    devices: tuple[jax.Device | None, jax.Device | None]  # pyright: ignore[reportInvalidTypeForm]  (jax.Device: compiled, no stub)

    def fwd(self, arrays: Any, x: PyTree, device: jax.Device | None) -> PyTree:  # pyright: ignore[reportInvalidTypeForm]  (jax.Device: compiled, no stub)
        f, _ = eqx.combine(arrays, self.static)
        with _record.timed_outside():  # (recorded around this call)
            return self.run(False, *on(device, (f, x)))

    def adjoint(self, arrays: Any, x: PyTree, ct: PyTree, device: jax.Device | None) -> PyTree:  # pyright: ignore[reportInvalidTypeForm]  (jax.Device: compiled, no stub)
        _, a = eqx.combine(arrays, self.static)
        with _record.timed_outside():
            return self.run(self.batched, *on(device, (a, x, ct)))

    def compiled_fwd(self, consts: list, arrays: Any, x: PyTree) -> PyTree:
        return self.fwd(arrays, x, self.devices[0])

    def compiled_adjoint(self, consts: list, arrays: Any, x: PyTree, ct: PyTree) -> PyTree:
        return self.adjoint(arrays, x, ct, self.devices[1])


def _is_tracer(leaf) -> bool:
    return isinstance(leaf, jax.core.Tracer)


def _ready(thunk: Callable[[], Any]) -> Any:
    return jax.block_until_ready(thunk())


def _timed_eager(name: str, device: jax.Device | None, home: jax.Device | None, thunk: Callable[[], Any]) -> Any:  # pyright: ignore[reportInvalidTypeForm]  (jax.Device: compiled, no stub)
    """`thunk()`, recorded as `name`'s run on `device` until its result is ready, the result
    moved to `home`."""
    return on(home, _record.recorded(name, ft.partial(_ready, thunk), False, device))


def _to_numpy(half: Callable[..., Any], *args: Any) -> Any:
    return jtu.tree_map(np.asarray, half(*args))


def _timed_host(name: str, device: jax.Device, half: Callable[..., Any], *args: Any) -> Any:  # pyright: ignore[reportInvalidTypeForm]  (jax.Device: compiled, no stub)
    """`half(*args)` as NumPy arrays (from the callback), recorded as `name`'s run on `device`."""
    return _record.recorded(name, ft.partial(_to_numpy, half, *args), False, device)


def _both_from_callback(run_fwd, run_adjoint, serial_: bool, consts, arrays, x, ct):
    """The callback: both halves at the same time, on the concrete operands."""
    return _both(ft.partial(run_fwd, consts[0], arrays, x), ft.partial(run_adjoint, consts[1], arrays, x, ct), serial_)


def _eager(
    halves: _Halves,
    fns: tuple,
    arrays: Any,
    x: PyTree,
    ct: PyTree,
    compiled: bool,
    where: _placement.Placement,
    check: Callable[[], str | None] | None = None,
):
    """Both halves on concrete arrays, from here (`check`: see `concurrently`)."""
    fwd_device, adjoint_device = halves.devices
    entry = None if compiled else where.prepared
    if entry is not None:  # (in a gathered callback: the halves as they were traced)
        traced_fwd, traced_adjoint = entry
        every, _ = eqx.partition(fns, eqx.is_array)  # (all were tracers then)
        call_fwd = ft.partial(traced_fwd, fwd_device, [], every, x)
        call_adjoint = ft.partial(traced_adjoint, adjoint_device, [], every, x, ct)
    else:
        call_fwd = ft.partial(halves.fwd, arrays, x, fwd_device)
        call_adjoint = ft.partial(halves.adjoint, arrays, x, ct, adjoint_device)
    # the results go back to the device `x` is on (when the halves were placed)
    home = (_record.device_of(x) or jax.local_devices()[0]) if fwd_device is not None else None
    first = ft.partial(_timed_eager, halves.names[0], fwd_device, home, call_fwd)
    second = ft.partial(_timed_eager, halves.names[1], adjoint_device, home, call_adjoint)
    if check is not None:  # (on the adjoint's thread, beside the forward)
        second = ft.partial(_unless_it_needs_y, check, second)
    return _both(first, _jaxpr.carry_context(second), where.serial)


def _traced(halves: _Halves, arrays: Any, x: PyTree, ct: PyTree, compiled: bool, where: _placement.Placement):
    """Both halves inside a trace (`jit` or `vmap`): the program leaves through one host
    callback, which runs them on two threads (with the caller's context, read while
    tracing) and hands both results back."""
    fwd_device, adjoint_device = halves.devices
    if compiled:
        y_struct = jax.eval_shape(ft.partial(halves.fwd, device=fwd_device), arrays, x)
        ct_struct = jax.eval_shape(ft.partial(halves.adjoint, device=adjoint_device), arrays, x, ct)
        half_fwd, half_adjoint = halves.compiled_fwd, halves.compiled_adjoint
        consts = ([], [])
    else:
        traced_fwd = _TracedHalf(halves.names[0], ft.partial(halves.fwd, device=None), arrays, x)
        traced_adjoint = _TracedHalf(halves.names[1], ft.partial(halves.adjoint, device=None), arrays, x, ct)
        if where.traced is not None:  # (for the gathered callback)
            where.traced.append((traced_fwd, traced_adjoint))
        y_struct, ct_struct = traced_fwd.out, traced_adjoint.out
        half_fwd = ft.partial(traced_fwd, fwd_device)
        half_adjoint = ft.partial(traced_adjoint, adjoint_device)
        consts = (traced_fwd.consts, traced_adjoint.consts)
    default = jax.local_devices()[0]
    run_fwd = _jaxpr.carry_context(ft.partial(_timed_host, halves.names[0], fwd_device or default, half_fwd))
    run_adjoint = _jaxpr.carry_context(
        ft.partial(_timed_host, halves.names[1], adjoint_device or default, half_adjoint)
    )
    callback = ft.partial(_both_from_callback, run_fwd, run_adjoint, where.serial)
    return jax.pure_callback(callback, (y_struct, ct_struct), consts, arrays, x, ct, vmap_method="sequential")


def concurrently(
    fwd_fn: Callable[..., Any],
    adjoint_fn: Callable[..., Any],
    x: PyTree,
    ct: PyTree,
    *,
    names: tuple[str, str],
    batched: bool = False,
    compiled: bool = True,
    check: Callable[[], str | None] | None = None,
) -> tuple[PyTree, PyTree]:
    """`(fwd_fn(x), adjoint_fn(x, ct))` at the same time (`adjoint_fn` vmapped over the
    leading axis of `ct` when `batched`), recorded under `names`. `compiled`: each half is
    compiled once per function and input structure (`dx.fuse`); otherwise each is called
    as the standard schedule calls an implementation: eagerly as it is, and under a trace,
    traced now. `check` (eagerly): why the adjoint cannot run without `y` (None when it
    can), called before the adjoint half, on its thread; where it gives a reason, the
    forward alone runs and `(y, NEEDS_Y)` is returned."""
    where = _placement.current()  # (stage 2's for its site: read while tracing, if traced)
    # The halves' own arrays (an `eqx.Module` implementation's fields) that are tracers (the
    # model passed through `jit`, or batched by `vmap`) enter the callback as operands;
    # concrete ones stay where they are.
    arrays, static = eqx.partition((fwd_fn, adjoint_fn), _is_tracer)
    runs = _placement.halves_run((arrays, x, ct)).where
    devices = where.devices() if runs in ("threads", "callback", "devices") else (None, None)
    halves = _Halves(static, _dispatch if compiled else _direct, batched, names, devices)
    concrete = is_concrete((arrays, x, ct))
    if check is not None and not (concrete and runs in ("threads", "callback")):
        # (where the halves do not run on threads from here: read before either starts)
        if check() is not None:
            return _record.recorded(halves.names[0], ft.partial(halves.fwd, arrays, x, None), not concrete), NEEDS_Y
        check = None
    if runs == "program":
        return _in_program(halves, arrays, x, ct)
    if runs == "devices":
        return _on_devices(halves, arrays, x, ct)
    if concrete:
        return _eager(halves, (fwd_fn, adjoint_fn), arrays, x, ct, compiled, where, check)
    return _traced(halves, arrays, x, ct, compiled, where)


def _in_program(halves: _Halves, arrays: Any, x: PyTree, ct: PyTree) -> tuple[PyTree, PyTree]:
    """Both halves where the program runs, no JAX work started from a callback: eagerly, one
    after the other on the arrays where they are (sharded ones stay sharded); under a trace,
    traced into the program, a loop of each stepped in one loop where both have one of the
    same length."""
    if is_concrete((arrays, x, ct)):
        y = _record.recorded(halves.names[0], ft.partial(halves.fwd, arrays, x, None), False)
        return y, _record.recorded(halves.names[1], ft.partial(halves.adjoint, arrays, x, ct, None), False)
    fwd_in, fwd_tree = jtu.tree_flatten((arrays, x))
    adjoint_in, adjoint_tree = jtu.tree_flatten((arrays, x, ct))
    shapes: dict = {}

    def fwd(*leaves):
        arrays_, x_ = jtu.tree_unflatten(fwd_tree, leaves)
        y = halves.fwd(arrays_, x_, None)
        out, shapes["y"] = jtu.tree_flatten(y)
        return out

    def adjoint(*leaves):
        arrays_, x_, ct_ = jtu.tree_unflatten(adjoint_tree, leaves)
        partial = halves.adjoint(arrays_, x_, ct_, None)
        out, shapes["partial"] = jtu.tree_flatten(partial)
        return out

    def both():
        return _jaxpr.together(fwd, adjoint, fwd_in, adjoint_in)[:2]

    ys, partials = _record.recorded(halves.names[0], both, True)
    _record.recorded(halves.names[1], lambda: None, True)  # (counted where it runs, with the first)
    return jtu.tree_unflatten(shapes["y"], ys), jtu.tree_unflatten(shapes["partial"], partials)


_AXIS = "deferax_halves"


def _on_devices(halves: _Halves, arrays: Any, x: PyTree, ct: PyTree) -> tuple[PyTree, PyTree]:
    """Both halves inside the traced program, each on its own device: a `shard_map` over the
    devices `dx.set_devices` named, whose body runs the forward on the site's first device
    and the adjoint on its second (`lax.switch` on the device's index; the others do
    nothing). Each device's results are stacked on a leading axis, and the forward's and the
    adjoint's taken from their devices' rows."""
    chosen = _runtime.SWITCHES.devices
    assert chosen is not None  # (`halves_run` places halves on devices only where some are named)
    first, second = (chosen.index(d) for d in halves.devices)
    mesh = jax.sharding.Mesh(np.array(chosen), (_AXIS,))
    y_struct = jax.eval_shape(ft.partial(halves.fwd, device=None), arrays, x)
    partial_struct = jax.eval_shape(ft.partial(halves.adjoint, device=None), arrays, x, ct)

    def body(arrays, x, ct):
        index = jax.lax.axis_index(_AXIS)
        branch = jnp.where(index == first, 0, jnp.where(index == second, 1, 2))
        branches = [
            lambda: (halves.fwd(arrays, x, None), zeros(partial_struct)),
            lambda: (zeros(y_struct), halves.adjoint(arrays, x, ct, None)),
            lambda: (zeros(y_struct), zeros(partial_struct)),
        ]
        return jtu.tree_map(lambda a: a[None], jax.lax.switch(branch, branches))

    specs = jax.sharding.PartitionSpec()
    rows = jax.sharding.PartitionSpec(_AXIS)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, specs, specs), out_specs=(rows, rows), check_vma=False)
    ys, partials = _record.recorded(halves.names[0], lambda: mapped(arrays, x, ct), True)
    _record.recorded(halves.names[1], lambda: None, True)  # (counted where it runs, with the first)
    return jtu.tree_map(lambda a: a[first], ys), jtu.tree_map(lambda a: a[second], partials)
