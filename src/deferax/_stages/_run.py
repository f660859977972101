"""One value and gradient on a traced program, after the public transform has traced it:
its analysis (eagerly, with the compiled cheap stages, from a cache keyed on the program's
structure), then the stages in order (`run`), each below: stage 1 (the deferred sites'
operands and cotangents), stage 2 (the expensive calls, each a job) and stage 3 (value, aux
and gradients). `_transform.py` calls `analysis_of` and `run` and nothing of the stages else."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools as ft
import threading
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .. import _jaxpr, _record, _runtime, _site
from .._analysis._analysis import Analysis, analyse
from .._concurrency._placement import Placement, one_at_a_time, placed
from .._implementation._abstract import AbstractImplementation
from .._jaxpr import structs, zeros
from .._plan import _cost
from .._schedules._abstract import AbstractAhead, AbstractJob
from .._schedules._together import JointBackward
from .._site._spec import PRIMITIVES, bwd_decisions, spec_of


class Compiled:
    """What a traced program needs, cached for calls outside any transformation: its
    analysis and the cheap stages compiled with `jax.jit` (constants as arguments)."""

    def __init__(self, analysis: Analysis, has_diff: list[bool]):
        self.analysis = analysis
        self.stage1 = jax.jit(ft.partial(stage1, analysis))
        together = analysis.together
        self.backward_cotangents = None if together is None else jax.jit(ft.partial(JointBackward.cotangents, together))
        # With standard sites left, stage 3 runs their implementations: it runs uncompiled,
        # as in Equinox, so that they run eagerly (and read what they read afresh).
        self.stage3 = None if analysis.live else jax.jit(ft.partial(stage3, analysis, has_diff))


_CACHE = _runtime.EAGER_CACHE
_LAST_BWDS = _runtime.LAST_BWDS
_CACHE_SIZE = 256
_CACHE_LOCK = threading.Lock()


def analysis_of(
    program: Any, n_consts: int, has_diff: list[bool], schedule: str, max_basis: int | None, eager: bool, where: str
) -> tuple[Analysis, Compiled | None, Any]:
    """The analysis of a traced program (`n_consts` of its inputs constants) and, eagerly,
    its compiled stages: from the cache when the same program was seen before; and, where
    the sites' `bwd`s were left unread, what forgets the read they were taken from (None
    where they were read).

    Whether each site's `bwd` lets a `fused` be made from it is read from `bwd` traced
    afresh (a global it branches on may have been rebound). Where the program's last eager
    call read that every one does, they are not traced here, before the halves start: the
    plan of that call is taken, and each half made from a `bwd` is checked on its own
    thread, beside the forward, before it runs; one that reads `y` now runs after the
    forward, on the forward's `y` (`_schedules/_deferred.py`), and the read is forgotten, so
    that the next call reads them here. Where one did not, all are read here, and the plan
    follows."""
    key, bwds, unread = None, None, None
    if eager:
        key = _jaxpr.structural_key(program)
        if key is not None:
            # which inputs are constants and which are differentiated is not in the equations
            # (nor where the halves run: sharded inputs keep them in the program)
            key = (key, n_consts, schedule, max_basis, _timings(program), _runtime.SPANS.get() > 1)
            # (kept by the key's hash, which holds nothing alive: what a site holds, a host
            # function's executor say, is held by the cache alone. Two programs of one hash
            # would share their last read: a `bwd` left unread is checked where its half runs)
            last_key = hash(key)
            with _CACHE_LOCK:
                last = _LAST_BWDS.get(last_key)
            if last is not None and all(b is None for b in last):
                unread = ft.partial(_forget, last_key)
            # nor whether each `bwd` (traced now, or checked where its half runs) lets a
            # `fused` be made from it
            bwds = last if unread is not None else bwd_decisions(program)
            key = (key, bwds)
            with _CACHE_LOCK:
                _LAST_BWDS[last_key] = bwds
                _LAST_BWDS.move_to_end(last_key)
                if len(_LAST_BWDS) > _CACHE_SIZE:
                    _LAST_BWDS.popitem(last=False)
                compiled = _CACHE.get(key)
                if compiled is not None:
                    _CACHE.move_to_end(key)
            if compiled is not None:
                return compiled.analysis, compiled, unread
    analysis = analyse(program, n_consts, schedule=schedule, max_basis=max_basis, where=where, bwds=bwds)
    _record.log_plan(analysis.plan)  # a new program (or one traced under a transformation)
    if not eager or key is None:
        # (a program that cannot be keyed would be compiled for one call: run uncompiled)
        return analysis, None, None
    compiled = Compiled(analysis, has_diff)
    with _CACHE_LOCK:
        _CACHE[key] = compiled
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return analysis, compiled, unread


def _forget(key: int) -> None:
    """Forget what the sites' `bwd`s were read to allow on the last call of the program whose
    key has the hash `key`."""
    with _CACHE_LOCK:
        _LAST_BWDS.pop(key, None)


def _timings(program) -> tuple:
    """The timings each site of `program` (nested ones included) is planned from
    (`_cost.TIMINGS.decided`), in order: part of the key of its compiled stages, so that a
    site's timings, once decided, recompile the programs that contain it and no other."""
    found = []
    for eqn in program.jaxpr.eqns:
        for e in [eqn, *(e for name in PRIMITIVES for e in _jaxpr.nested_in(eqn, name))]:
            if str(e.primitive) in PRIMITIVES:
                spec = spec_of(e)
                decided = _cost.TIMINGS.decided(spec.static.timings_key, tuple(s.shape for s in spec.x_structs))
                found.append(tuple(sorted(decided.items())))
    return tuple(found)


def run(
    analysis: Analysis, compiled: Compiled | None, has_diff: list[bool], ins: list, eager: bool, unread: Any = None
) -> tuple:
    """`(outs, grads)` of the traced program on `ins`: stages 1, 2 and 2b for the sites run
    ahead (`analysis.ahead`, `analysis.together`), then stage 3. `unread` (not None): the
    sites' `bwd`s were not read for this call (see `analysis_of`): their halves check them."""
    results = None
    if analysis.ahead:
        with _stage("deferax stage 1: operands and cotangents"):
            operands, cts = (compiled.stage1 if compiled is not None else ft.partial(stage1, analysis))(ins)
        with _stage("deferax stage 2: expensive calls"), _jaxpr.setting(_runtime.BWD_UNREAD, unread):
            ys, diff_cts = by_position(analysis.ahead, stage2(analysis.ahead, operands, cts, eager))
        together = analysis.together
        if together is not None:
            with _stage("deferax stage 2b: backward jobs at once"):
                backward = compiled.backward_cotangents if compiled is not None else None
                cts_y = (backward or together.cotangents)(ins, ys)
                diff_cts |= together.run(operands, ys, cts_y, ft.partial(stage2, eager=eager))
        results = (cts, ys, diff_cts)
    with _stage("deferax stage 3: value and gradients"):
        if compiled is not None and compiled.stage3 is not None:
            return compiled.stage3(ins, results)
        return stage3(analysis, has_diff, ins, results)


@contextlib.contextmanager
def _stage(name: str):
    """A named region: in a profiler trace (`jax.profiler.trace`) for what runs here, and in
    the names of the operations traced here (what a compiled program shows)."""
    with jax.profiler.TraceAnnotation(name), jax.named_scope(name.replace(" ", "_").replace(":", "")):
        yield


# Stage 1 of a deferred schedule: the deferred sites' operands and cotangents, from the
# backward program the analysis traced, with zeros standing in for every expensive output
# (the static check proved them unused) and nothing else of the program run (no user
# effects). For a basis site, its `k` basis cotangents.


def stage1(analysis: Analysis, ins: list) -> tuple[dict, dict]:
    """`(operands, cts)` of the sites that stage 2 runs, by position; for a basis site the
    cotangents are its `k` basis cotangents stacked on a leading axis."""
    ys = [zeros(structs(s.spec.y_avals())) for s in analysis.schedules]
    operands: dict = {}
    traced: dict = {}
    if analysis.backward is not None:
        seed = jnp.ones((), analysis.program.jaxpr.outvars[0].aval.dtype)
        outs = _jaxpr.interpret(analysis.backward, [*ins, *jtu.tree_leaves(ys), seed])
        for (kind, p, _), value in zip(analysis.backward_out, outs, strict=True):
            (traced if kind == "ct" else operands).setdefault(p, []).append(value)
    cts = {s.position: s.stage1_cotangents(ins, ys, traced.get(s.position)) for s in analysis.ahead}
    return operands, {p: c for p, c in cts.items() if c is not None}


# Stage 2 of a deferred schedule: the expensive calls. One `fused` per deferred site
# (batched over its `vmap` levels, or over its basis cotangents and its levels), and the
# `fwd` of the standard sites that need no expensive output, concurrently: each is a job
# (`AbstractJob`: a schedule's call ahead of the value, or in stage 2b a backward job of the
# together group), run here on the site's `Placement`.


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


# Stage 3 of a deferred schedule: value, aux and gradients, the program evaluated under
# `jax.vjp` with each site run in stage 2 in the hands of its schedule (`stage3`), and every
# other site on its own rules.


def _replacements(analysis: Analysis, results) -> tuple[dict, dict]:
    """`(handlers, wraps)` for `_jaxpr.interpret`: what stage 3 runs in place of the sites
    run in stage 2, and the wrappers of the basis sites' frontier variables. Made afresh
    for each trace: the basis sites' operands recorded here are that trace's tracers, and
    nothing may keep them alive after it (jax >= 0.11 checks for leaked tracers)."""
    handlers, wraps = {}, {}
    if results is None:
        return handlers, wraps
    _, ys, diff_cts = results
    for s in analysis.ahead:
        handlers[analysis.sites[s.position]], own = s.stage3(ys[s.position], diff_cts[s.position])
        for v, wrap in own.items():
            # A variable on several sites' frontiers (`sum(f(x)) + sum(f(2 * x))`
            # before a square): each site's wrapper in turn, all given its cotangent.
            before = wraps.get(v)
            wraps[v] = wrap if before is None else (lambda z, wrap=wrap, before=before: wrap(before(z)))
    return handlers, wraps


def stage3(analysis: Analysis, has_diff: list[bool], ins: list, results) -> tuple:
    """`(outputs, grads)`: the program's outputs (value first) and the gradient of the value
    with respect to the inputs flagged in `has_diff`."""
    diff = [a for a, d in zip(ins, has_diff, strict=True) if d]

    def program(diff_):
        it = iter(diff_)
        full = [next(it) if d else a for a, d in zip(ins, has_diff, strict=True)]
        outs = _jaxpr.interpret(analysis.program, full, *_replacements(analysis, results))
        return outs[0], outs[1:]

    with _site.planned(analysis.strategies):  # (the sites' JVP rules run here: as planned)
        value, vjp, aux = jax.vjp(program, diff, has_aux=True)
        (grads,) = vjp(jnp.ones((), value.dtype))
    return [value, *aux], grads
