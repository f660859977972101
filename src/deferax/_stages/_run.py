"""One value and gradient on a traced program, after the public transform has traced it:
its analysis (eagerly, with the compiled cheap stages, from a cache keyed on the program's
structure), then the stages in order (`run`). `_transform.py` calls these two and nothing of
the stages else."""

from __future__ import annotations

import contextlib
import functools as ft
import threading
from typing import Any

import jax

from .. import _jaxpr, _record, _runtime
from .._analysis._analysis import Analysis, analyse
from .._analysis._bwd import bwd_decisions
from .._plan import _cost
from .._schedules._together import JointBackward
from .._site._spec import PRIMITIVES, spec_of
from . import _stage1, _stage2, _stage3


class Compiled:
    """What a traced program needs, cached for calls outside any transformation: its
    analysis and the cheap stages compiled with `jax.jit` (constants as arguments)."""

    def __init__(self, analysis: Analysis, has_diff: list[bool]):
        self.analysis = analysis
        self.stage1 = jax.jit(ft.partial(_stage1.stage1, analysis))
        together = analysis.together
        self.backward_cotangents = None if together is None else jax.jit(ft.partial(JointBackward.cotangents, together))
        # With standard sites left, stage 3 runs their implementations: it runs uncompiled,
        # as in Equinox, so that they run eagerly (and read what they read afresh).
        self.stage3 = None if analysis.live else jax.jit(ft.partial(_stage3.stage3, analysis, has_diff))


_CACHE = _runtime.EAGER_CACHE
_CACHE_SIZE = 256
_CACHE_LOCK = threading.Lock()


def analysis_of(
    program: Any, n_consts: int, has_diff: list[bool], schedule: str, max_basis: int | None, eager: bool, where: str
) -> tuple[Analysis, Compiled | None]:
    """The analysis of a traced program (`n_consts` of its inputs constants) and, eagerly,
    its compiled stages: from the cache when the same program was seen before."""
    key, bwds = None, None
    if eager:
        key = _jaxpr.structural_key(program)
        if key is not None:
            # which inputs are constants and which are differentiated is not in the equations,
            # nor whether each `bwd` (traced now) lets a `fused` be made from it
            bwds = bwd_decisions(program)
            key = (key, n_consts, schedule, max_basis, bwds, _timings(program))
            with _CACHE_LOCK:
                compiled = _CACHE.get(key)
                if compiled is not None:
                    _CACHE.move_to_end(key)
            if compiled is not None:
                return compiled.analysis, compiled
    analysis = analyse(program, n_consts, schedule=schedule, max_basis=max_basis, where=where, bwds=bwds)
    _record.log_plan(analysis.plan)  # a new program (or one traced under a transformation)
    if not eager or key is None:
        # (a program that cannot be keyed would be compiled for one call: run uncompiled)
        return analysis, None
    compiled = Compiled(analysis, has_diff)
    with _CACHE_LOCK:
        _CACHE[key] = compiled
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return analysis, compiled


def _timings(program) -> tuple:
    """The timings each site of `program` (nested ones included) is planned from
    (`_cost.decided`), in order: part of the key of its compiled stages, so that a site's
    timings, once decided, recompile the programs that contain it and no other."""
    found = []
    for eqn in program.jaxpr.eqns:
        for e in [eqn, *(e for name in PRIMITIVES for e in _jaxpr.nested_in(eqn, name))]:
            if str(e.primitive) in PRIMITIVES:
                spec = spec_of(e)
                found.append(_cost.decided(spec.static.timings_key, tuple(s.shape for s in spec.x_structs)))
    return tuple(found)


def run(analysis: Analysis, compiled: Compiled | None, has_diff: list[bool], ins: list, eager: bool) -> tuple:
    """`(outs, grads)` of the traced program on `ins`: stages 1, 2 and 2b for the sites run
    ahead (`analysis.ahead`, `analysis.together`), then stage 3."""
    results = None
    if analysis.ahead:
        with _stage("deferax stage 1: operands and cotangents"):
            operands, cts = (compiled.stage1 if compiled is not None else ft.partial(_stage1.stage1, analysis))(ins)
        with _stage("deferax stage 2: expensive calls"):
            ys, diff_cts = _stage2.by_position(analysis.ahead, _stage2.stage2(analysis.ahead, operands, cts, eager))
        together = analysis.together
        if together is not None:
            with _stage("deferax stage 2b: backward jobs at once"):
                backward = compiled.backward_cotangents if compiled is not None else None
                cts_y = (backward or together.cotangents)(ins, ys)
                diff_cts |= together.run(operands, ys, cts_y, ft.partial(_stage2.stage2, eager=eager))
        results = (cts, ys, diff_cts)
    with _stage("deferax stage 3: value and gradients"):
        if compiled is not None and compiled.stage3 is not None:
            return compiled.stage3(ins, results)
        return _stage3.stage3(analysis, has_diff, ins, results)


@contextlib.contextmanager
def _stage(name: str):
    """A named region: in a profiler trace (`jax.profiler.trace`) for what runs here, and in
    the names of the operations traced here (what a compiled program shows)."""
    with jax.profiler.TraceAnnotation(name), jax.named_scope(name.replace(" ", "_").replace(":", "")):
        yield
