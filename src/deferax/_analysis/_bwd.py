"""Whether a `fused` can be made from a site's `fwd` and `bwd`: read from the jaxpr of `bwd`."""

from __future__ import annotations

import jax
import jax.tree_util as jtu

from .. import _jaxpr, _site
from .._misc import structs

_READS_Y = "its `bwd` reads `y`{through} (give `adjoint` and `combine`, or `fused`)"

_OPAQUE_BWD = (
    "its `bwd` calls {location}, whose body deferax cannot read: it may use what `fwd` left behind "
    "(a factorisation kept in a Python object), so it runs after `fwd`. If it does not, give `adjoint(x, ct_y)` "
    "instead of `bwd`, or `fused=dx.fuse(fwd, adjoint)`: they run at the same time"
)


def bwd_blocks_fused(spec: _site.Spec, fn_avals: list) -> str | None:
    """Why no `fused` can be made from the site's `fwd` and `bwd(x, y, ct_y)`, read from the
    jaxpr of `bwd` traced now; None when one can. It can when `bwd` does not read `y` (in
    what it returns, nor in an effect such as `jax.debug.callback`, which would see the
    zeros it is given instead) and everything it calls can be read: a host callback may use
    what `fwd` kept (its state), and must run after it. A `bwd` that cannot be traced (a
    host function) counts as reading `y`."""

    def bwd(fn_leaves, x_leaves, y_leaves, ct_leaves):
        fn = spec.fn(fn_leaves)
        y = jtu.tree_unflatten(spec.y_tree, list(y_leaves))
        ct = jtu.tree_unflatten(spec.y_tree, list(ct_leaves))
        return fn.invoke("bwd", spec.x(x_leaves), y, ct)

    try:
        y_structs = list(spec.y_structs)
        closed = jax.make_jaxpr(bwd)(structs(fn_avals), list(spec.x_structs), y_structs, y_structs)
    except Exception:  # noqa: BLE001 - not JAX-traceable: assume the worst
        return _READS_Y.format(through="")
    n_y = len(spec.y_structs)
    labels = [None] * (len(fn_avals) + spec.n_x) + ["y"] * n_y + [None] * n_y
    if _returns_y(closed, labels):
        return _READS_Y.format(through="")
    for marks, location in _jaxpr.effect_dependencies(closed, labels):
        if "y" in marks:
            return _READS_Y.format(through=f" through {location}")
    opaque = _jaxpr.opaque_call(closed, _site.PRIMITIVES)
    return None if opaque is None else _OPAQUE_BWD.format(location=opaque)


def _returns_y(closed, labels: list) -> bool:
    """Whether an output of `bwd`'s program (`closed`, its inputs labelled) depends on `y`,
    or `y` is written to a `jax.Ref` from outside (and read there after the call)."""
    return any("y" in d for d in _jaxpr.dependencies(closed, labels)) or "y" in _jaxpr.escaping(closed, labels)


def bwd_decisions(program) -> tuple:
    """What the check reads beyond the program's equations: for each top-level site with
    `fwd` and `bwd` only, why no `fused` can be made from them (None when one can), from
    the program of `bwd` traced now (a global that it branches on may have been rebound
    since the last call); None for the other sites. A key for the compiled stages covers it."""
    decisions = []
    for i in _jaxpr.top_level(program, _site.SITE):
        eqn = program.jaxpr.eqns[i]
        spec = _site.spec_of(eqn)
        static = spec.static
        derivable = (
            static.fwd is not None and static.bwd is not None and static.fused is None and static.fused_batch is None
        )
        blocked = (
            bwd_blocks_fused(spec, [v.aval for v in eqn.invars[: spec.n_fn]])
            if derivable and static.prefer is None
            else None
        )
        decisions.append(blocked)
    return tuple(decisions)
