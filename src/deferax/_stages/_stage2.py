"""Stage 2 of a deferred schedule: the expensive calls. One `fused` per deferred site
(batched over its `vmap` levels, or over its basis cotangents and its levels), and the
`fwd` of the standard sites that need no expensive output, concurrently."""

from __future__ import annotations

import concurrent.futures
import functools as ft
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .. import _jaxpr, _record, _runtime, _site
from .._analysis._analysis import Analysis
from .._concurrency._devices import slot
from .._concurrency._gathered import all_runnable, preparing, running_prepared
from .._concurrency._serial import SERIAL_LOCK, concurrency_enabled, serial
from .._implementation._abstract import AbstractFused, AbstractImplementation
from .._site._spec import Spec


def _stage2_impl(analysis: Analysis, k: int) -> Callable[..., Any] | None:
    """The implementation that site `k`'s stage-2 work calls (None for a `fused` made here)."""
    static = analysis.spec(k).static
    if k in analysis.early:
        return static.fwd
    if analysis.derived(k):
        return None
    return static.fused_batch if k in analysis.basis and static.fused_batch is not None else static.fused


def _on_host(analysis: Analysis, k: int) -> bool:
    """Whether site `k`'s stage-2 work is host functions (`dx.host`), whose callback takes a
    batch from `vmap` whole."""
    impl = _stage2_impl(analysis, k)
    return isinstance(impl, AbstractImplementation) and impl.runs_on_host


def leaves_program(analysis: Analysis, k: int) -> bool:
    """Whether site `k`'s stage-2 work runs outside the XLA program anyway: on the host
    (`dx.host`), or as two compiled halves on threads (`dx.fuse`, or a `fused` made from
    `fwd` and `adjoint`/`bwd`). Such work leaves through a callback, which JAX cannot
    differentiate."""
    if analysis.derived(k) and k not in analysis.early:
        return True
    return isinstance(_stage2_impl(analysis, k), AbstractImplementation)


class _Stage2:
    """The stage-2 work of one trace of the step: each site's expensive call (`site`), run
    under the locks its function asks for (`guarded`), on its slot of devices (`placed`),
    and all of them together (`run_all`), eagerly or from one callback (`from_callback`)."""

    def __init__(self, analysis: Analysis):
        self.analysis = analysis
        self.positions = analysis.deferred + analysis.early
        # the host sites' work, taking a batch whole (compiled once for this trace of the
        # step, each batch size once)
        self.on_host = {
            k: jax.jit(jax.vmap(ft.partial(self._one_example, k))) for k in self.positions if _on_host(analysis, k)
        }

    def _one_example(self, k: int, operands: Any, cts: Any) -> tuple:
        return self.site(k, {k: operands}, {k: cts})

    def site(self, k: int, operands: dict, cts: dict, size: int | None = None) -> tuple:
        """Site `k`'s work; with `size`, for a batch of that many examples (from a `vmap`
        around the whole step) stacked on a leading axis."""
        if size is not None:
            site_args = (operands[k], cts[k])
            if k in self.on_host:  # the host functions get the whole batch in one submission
                return self.on_host[k](*site_args)
            examples = (jtu.tree_map(ft.partial(_index, i), site_args) for i in range(size))
            each = [self.site(k, {k: o}, {k: c}) for o, c in examples]
            return jtu.tree_map(_stack, *each)
        analysis = self.analysis
        schedule = "standard" if k in analysis.early else "deferred-basis" if k in analysis.basis else "deferred"
        with _record.site(analysis.spec(k).name, schedule):
            return self._call(k, operands, cts)

    def _call(self, k: int, operands: dict, cts: dict) -> tuple:
        analysis = self.analysis
        spec = analysis.spec(k)
        if k in analysis.early:
            return _site.outputs(spec, *operands[k]), None
        if k in analysis.basis:
            return basis_over_levels(spec, operands[k], cts[k], analysis.derived(k))
        return fused_over_levels(spec, operands[k], cts[k], analysis.derived(k))

    def guarded(self, k: int, operands: dict, cts: dict, size: int | None = None) -> tuple:
        """`site(k)`, one call at a time for a function that is not thread-safe, or while
        concurrency is switched off (which its halves read again when they run)."""
        if not self.analysis.spec(k).static.thread_safe:
            with SERIAL_LOCK, serial():
                return self.site(k, operands, cts, size)
        if concurrency_enabled():
            return self.site(k, operands, cts, size)
        with SERIAL_LOCK:
            return self.site(k, operands, cts, size)

    def placed(self, i: int, k: int, operands: dict, cts: dict, size: int | None = None) -> tuple:
        with slot(i):  # the i-th site's halves on the i-th pair of devices
            return self.guarded(k, operands, cts, size)

    def run_all(self, operands: dict, cts: dict, size: int | None = None) -> list:
        """Every site's work: this thread runs the first, the site pool the others."""
        positions = self.positions
        if len(positions) <= 1:
            return [self.guarded(k, operands, cts, size) for k in positions]
        placed = _jaxpr.carry_context(self.placed)
        sites = _runtime.POOLS.get("sites")
        futures = [sites.submit(placed, i, k, operands, cts, size) for i, k in enumerate(positions[1:], 1)]
        try:
            first = self.placed(0, positions[0], operands, cts, size)
        except BaseException:
            concurrent.futures.wait(futures)
            raise
        return [first, *(f.result() for f in futures)]

    def traced_all(self, mine: tuple) -> list:
        """Every site's work traced in this thread (JAX's tracing state does not reach the
        pool's threads), for the shapes of the gathered callback."""
        out = []
        for i, k in enumerate(self.positions):
            with slot(i):
                out.append(self.site(k, *mine))
        return out

    def from_callback(self, rank: int, prepared: dict, concrete: tuple) -> list:
        """The gathered callback. Under a `vmap` of the whole step, every operand comes with
        the batch's leading axes: the sites run on the batch flattened to one axis."""
        leaves = jtu.tree_leaves(concrete)
        batch = np.shape(leaves[0])[: np.ndim(leaves[0]) - rank] if leaves else ()
        with running_prepared(prepared):
            if not batch:
                return jtu.tree_map(np.asarray, self.run_all(*concrete))
            size = int(np.prod(batch))
            flat = jtu.tree_map(ft.partial(_merge_batch, len(batch), size), concrete)
            return jtu.tree_map(ft.partial(_split_batch, batch), self.run_all(*flat, size=size))


def _index(i: int, a: Any) -> Any:
    return a[i]


def _stack(*a: Any) -> Any:
    return np.stack(a)


def _merge_batch(n_axes: int, size: int, a: Any) -> Any:
    return np.reshape(a, (size, *np.shape(a)[n_axes:]))


def _split_batch(batch: tuple, a: Any) -> Any:
    return np.reshape(a, (*batch, *np.shape(a)[1:]))


def stage2(analysis: Analysis, operands: dict, cts: dict, eager: bool) -> tuple[dict, dict]:
    """`(ys, diff_cts)` by position: each site's output leaves and, for a deferred site, the
    cotangents of the differentiable leaves of its input (stacked for a basis site).

    Eagerly, the calls run concurrently on threads. Traced (under `jit` or `vmap`), each is
    part of the surrounding program, where XLA:CPU runs them one after another; when there
    are several and all of them leave the program anyway (host functions, `dx.fuse`, a
    `fused` made from `fwd` and `adjoint`), they leave it through one callback that runs
    them all concurrently; under a `vmap` of the whole step, on the whole batch (each host
    site's functions get it in one submission, other halves run one example after another).
    """
    work = _Stage2(analysis)
    positions = work.positions
    gather = len(positions) > 1 and all(leaves_program(analysis, k) for k in positions)
    results = None
    if eager:
        results = work.run_all(operands, cts)
    elif gather:
        mine = ({k: operands[k] for k in positions}, {k: cts.get(k) for k in positions})
        # the halves made from `fwd` and `bwd` are traced here, with the program, and kept
        prepared: dict = {}
        with preparing(prepared):
            shapes = jax.eval_shape(work.traced_all, mine)
        rank = next((np.ndim(a) for a in jtu.tree_leaves(mine)), 0)
        # A half that closes over a value of the surrounding trace cannot run from one
        # callback for all: then each site leaves through its own, which takes that value.
        if all_runnable(prepared):
            callback = ft.partial(work.from_callback, rank, prepared)
            results = jax.pure_callback(callback, shapes, mine, vmap_method="broadcast_all")
    if results is None:
        results = [work.guarded(k, operands, cts) for k in positions]
    ys = {k: r[0] for k, r in zip(positions, results, strict=True)}
    diff_cts = {k: r[1] for k, r in zip(positions, results, strict=True)}
    return ys, diff_cts


def fused_over_levels(spec: Spec, operands: list, ct: list, derived: bool = False) -> tuple[list, list]:
    """`fused(x, ct_y)` over every batch level: output leaves, and the cotangents of the
    differentiable leaves of `x` shaped like their operands. `derived`: the site has no
    `fused`; one is made from its `fwd` and `adjoint` (or `y`-free `bwd`)."""
    n_fn = spec.n_fn
    diff = spec.diff

    def one(fn_leaves, x_leaves, ct_leaves):
        fn = spec.fn(fn_leaves)
        y, ct_x = fn.run_fused(spec.x(x_leaves), jtu.tree_unflatten(spec.y_tree, list(ct_leaves)))
        return jtu.tree_leaves(y), [c for c, d in zip(jtu.tree_leaves(ct_x), diff, strict=True) if d]

    def axes_of(level):
        return (list(level[:n_fn]), list(level[n_fn:]), [0] * len(spec.y_structs))

    batched_impl = any(a is not None for level, _ in spec.axes for a in level[:n_fn])
    concurrent = derived or isinstance(spec.static.fused, AbstractFused)
    if concurrent and not batched_impl:
        # `dx.fuse` (or one made here): the whole batch's forward and adjoint on two threads
        fn = spec.fn(operands[:n_fn])
        impl = fn.derived_fused() if derived else fn.fused
        assert isinstance(impl, AbstractFused)  # (as `concurrent` says)
        x, ct_tree = spec.x(operands[n_fn:]), jtu.tree_unflatten(spec.y_tree, list(ct))
        if spec.axes:
            x_axes = [jtu.tree_unflatten(spec.x_tree, list(level[n_fn:])) for level, _ in spec.axes]
            y, ct_x = impl.under_vmap(x, ct_tree, x_axes)
        else:
            y, ct_x = fn.run_fused(x, ct_tree) if not derived else impl(x, ct_tree)
        y, ct_x = jtu.tree_leaves(y), [c for c, d in zip(jtu.tree_leaves(ct_x), diff, strict=True) if d]
    else:
        y, ct_x = spec.over_levels(one, axes_of)(list(operands[:n_fn]), list(operands[n_fn:]), list(ct))
    return y, _site.unbatch(spec, ct_x)


def basis_over_levels(spec: Spec, operands: list, cts: list, derived: bool = False) -> tuple[list, list]:
    """The forward and `k` adjoints of a basis site in one job (`fused_batch`, or a `fused`
    batched over the cotangents): output leaves, and the cotangents of the differentiable
    leaves of `x` stacked on a leading axis of `k`. Under `vmap` (a site with a
    `fused_batch`: the analysis keeps the others standard), `fused_batch` batched over the
    examples (a host one: a job per example), each on all `k` basis cotangents at that
    example (zero there for those that only other examples' outputs reach)."""
    n_fn = spec.n_fn

    def one(fn_leaves, x_leaves, ct_leaves):
        fn = spec.fn(fn_leaves)
        cts_tree = jtu.tree_unflatten(spec.y_tree, list(ct_leaves))
        x = spec.x(x_leaves)
        y, ct_xs = fn.derived_fused().batched(x, cts_tree) if derived else fn.run_fused_batch(x, cts_tree)
        return jtu.tree_leaves(y), [c for c, d in zip(jtu.tree_leaves(ct_xs), spec.diff, strict=True) if d]

    if not spec.axes:
        return one(operands[:n_fn], operands[n_fn:], cts)

    def axes_of(level):  # (the basis cotangents: `k` first, then the batch levels)
        return (list(level[:n_fn]), list(level[n_fn:]), [1] * len(spec.y_structs))

    y, ct_xs = spec.over_levels(one, axes_of)(list(operands[:n_fn]), list(operands[n_fn:]), list(cts))
    # (summed over the levels where their operand is not batched; then `k` moved first)
    x_structs = [s for s, d in zip(spec.x_structs, spec.diff, strict=True) if d]
    ct_xs = [
        jnp.moveaxis(c, c.ndim - 1 - len(s.shape), 0)
        for c, s in zip(_site.unbatch(spec, ct_xs), x_structs, strict=True)
    ]
    return y, ct_xs
