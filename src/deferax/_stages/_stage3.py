"""Stage 3 of a deferred schedule: value, aux and gradients, the program evaluated under
`jax.vjp` with each site run in stage 2 in the hands of its schedule (`stage3`), and every
other site on its own rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _jaxpr, _site
from .._analysis._analysis import Analysis


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
