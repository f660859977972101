"""Stage 2 of a deferred schedule: the expensive calls. One `fused` per deferred site
(batched over its `vmap` levels, or over its basis cotangents and its levels), and the
`fwd` of the standard sites that need no expensive output, concurrently: each is a job
(`AbstractJob`: a schedule's call ahead of the value, or in stage 2b a backward job of the
together group), run here on the site's `Placement`."""

from __future__ import annotations

import concurrent.futures
import functools as ft
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from .. import _jaxpr, _record, _runtime
from .._concurrency._placement import Placement, placed
from .._concurrency._serial import one_at_a_time
from .._implementation._abstract import AbstractImplementation
from .._schedules._abstract import AbstractAhead, AbstractJob


def _on_host(schedule: AbstractJob) -> bool:
    """Whether a site's stage-2 work is host functions (`dx.host`), whose callback takes a
    batch from `vmap` whole."""
    impl = schedule.impl
    return isinstance(impl, AbstractImplementation) and impl.runs_on_host


class _Stage2:
    """The stage-2 work of one trace of the step: each site's call on its placement (`run`),
    and all of them together (`run_all`), eagerly or from one callback (`from_callback`)."""

    def __init__(self, sites: tuple[AbstractJob, ...]):
        self.sites = sites
        # the i-th site's halves on the i-th pair of devices
        self.placements = tuple(Placement(i, not s.spec.static.thread_safe) for i, s in enumerate(self.sites))
        # the host sites' work, taking a batch whole (compiled once for this trace of the
        # step, each batch size once)
        self.on_host = {
            i: jax.jit(jax.vmap(ft.partial(self._one_example, i))) for i, s in enumerate(self.sites) if _on_host(s)
        }

    def _one_example(self, i: int, operands: Any, cts: Any) -> tuple:
        site = self.sites[i]
        with _record.site(site.spec.name, site.label):
            return site.call(operands, cts)

    def run(self, placement: Placement, operands: dict, cts: dict, size: int | None = None) -> tuple:
        """One site's call, on its `placement`: one call at a time for a function that is not
        thread-safe, or while concurrency is switched off (which its halves read again when
        they run). With `size`, for a batch of that many examples (from a `vmap` around the
        whole step) stacked on a leading axis."""
        i = placement.slot
        site = self.sites[i]
        args = (operands[site.position], cts.get(site.position))
        with placed(placement), one_at_a_time(placement.serial):
            if size is None:
                with _record.site(site.spec.name, site.label):
                    return site.call(*args)
            if i in self.on_host:  # the host functions get the whole batch in one submission
                return self.on_host[i](*args)
            each = [self._one_example(i, *jtu.tree_map(ft.partial(_index, j), args)) for j in range(size)]
            return jtu.tree_map(_stack, *each)

    def run_all(self, placements: tuple, operands: dict, cts: dict, size: int | None = None) -> list:
        """Every site's call: this thread runs the first, the site pool the others."""
        first, *others = placements
        futures = []
        if others:
            run = _jaxpr.carry_context(self.run)
            futures = [_runtime.POOLS.get("sites").submit(run, p, operands, cts, size) for p in others]
        try:
            mine = self.run(first, operands, cts, size)
        except BaseException:
            concurrent.futures.wait(futures)
            raise
        return [mine, *(f.result() for f in futures)]

    def traced_all(self, placements: tuple, mine: tuple) -> list:
        """Every site's call traced in this thread (JAX's tracing state does not reach the
        pool's threads), for the shapes of the gathered callback."""
        return [self.run(p, *mine) for p in placements]

    def from_callback(self, rank: int, placements: tuple, concrete: tuple) -> list:
        """The gathered callback. Under a `vmap` of the whole step, every operand comes with
        the batch's leading axes: the sites run on the batch flattened to one axis."""
        leaves = jtu.tree_leaves(concrete)
        batch = np.shape(leaves[0])[: np.ndim(leaves[0]) - rank] if leaves else ()
        # (what the host functions return here leaves as NumPy: see `_runtime.IN_CALLBACK`)
        with _jaxpr.setting(_runtime.IN_CALLBACK, True):
            if not batch:
                return jtu.tree_map(np.asarray, self.run_all(placements, *concrete))
            size = int(np.prod(batch))
            flat = jtu.tree_map(ft.partial(_merge_batch, len(batch), size), concrete)
            return jtu.tree_map(ft.partial(_split_batch, batch), self.run_all(placements, *flat, size=size))


def _index(i: int, a: Any) -> Any:
    return a[i]


def _stack(*a: Any) -> Any:
    return np.stack(a)


def _merge_batch(n_axes: int, size: int, a: Any) -> Any:
    return np.reshape(a, (size, *np.shape(a)[n_axes:]))


def _split_batch(batch: tuple, a: Any) -> Any:
    return np.reshape(a, (*batch, *np.shape(a)[1:]))


def by_position(sites: tuple[AbstractAhead, ...], results: list) -> tuple[dict, dict]:
    """`(ys, diff_cts)` by position, from stage 2's `results` for `sites`: each site's output
    leaves and, for a deferred site, the cotangents of the differentiable leaves of its
    input (stacked for a basis site)."""
    ys = {s.position: r[0] for s, r in zip(sites, results, strict=True)}
    diff_cts = {s.position: r[1] for s, r in zip(sites, results, strict=True)}
    return ys, diff_cts


def stage2(sites: tuple[AbstractJob, ...], operands: dict, cts: dict, eager: bool) -> list:
    """The calls of the jobs `sites` (`analysis.ahead`, or stage 2b's `bwd` jobs), concurrently: a
    result each, `(y, ct_x)` (see `by_position`).

    Eagerly, the calls run concurrently on threads. Traced (under `jit` or `vmap`), each is
    part of the surrounding program, where XLA:CPU runs them one after another; when there
    are several and all of them leave the program anyway (host functions, `dx.fuse`, a
    `fused` made from `fwd` and `adjoint`), they leave it through one callback that runs
    them all concurrently; under a `vmap` of the whole step, on the whole batch (each host
    site's functions get it in one submission, other halves run one example after another).
    """
    work = _Stage2(sites)
    placements = work.placements
    results = None
    if eager:
        results = work.run_all(placements, operands, cts)
    elif len(sites) > 1 and all(s.leaves_program for s in sites):
        mine = ({s.position: operands[s.position] for s in sites}, {s.position: cts.get(s.position) for s in sites})
        # the halves made from `fwd` and `bwd` are traced here, with the program, and kept
        preparing = tuple(p.preparing() for p in placements)
        shapes = jax.eval_shape(ft.partial(work.traced_all, preparing), mine)
        rank = next((np.ndim(a) for a in jtu.tree_leaves(mine)), 0)
        prepared = [p.prepared_halves() for p in preparing]
        # A half that closes over a value of the surrounding trace cannot run from one
        # callback for all: then each site leaves through its own, which takes that value.
        if all(h is not None for p, h in zip(preparing, prepared, strict=True) if p.traced):
            running = tuple(p.running(h) for p, h in zip(placements, prepared, strict=True))
            callback = ft.partial(work.from_callback, rank, running)
            results = jax.pure_callback(callback, shapes, mine, vmap_method="broadcast_all")
    if results is None:
        results = [work.run(p, operands, cts) for p in placements]
    return results
