"""Each call of an `ExpensiveFn` is one equation of the program: the `deferax_site` primitive.

`site_p` computes `y = f(x)` (its implementation calls `fwd`, or `fused` with a zero
cotangent); its JVP rule binds `site_p` for `y` and the linear primitive `lin_p` for the
tangent, whose transpose calls `bwd(x, y, ct_y)`. So `jax.grad` runs one `fwd` and one
`bwd` with `x` and `y` as residuals: the standard schedule. Under `jax.vmap` the batching
rule rebinds the same primitive with one more batch level, so a site under `vmap` is still
one equation, which [`deferax.filter_value_and_grad`][] can find and defer.

The operands of `site_p` are the arrays of the `ExpensiveFn` (configuration held by an
`eqx.Module` implementation; constants to the derivative) followed by the leaves of `x`.
Everything else (the implementations, the structures) is the static `Spec`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .. import _jaxpr, _runtime
from .._checks import _messages
from .._jaxpr import (
    aval_of,
    is_concrete,
    struct_of,
    to_varying,
    unreduced_axes,
    vary,
    varying_axes,
    with_varying,
    zero_like,
)
from ._forward_basis import forward_basis_jvp
from ._spec import LINEAR, SITE, Spec, rebind_batched, split_fn_x


def outputs(spec: Spec, *operands):
    """`fwd(x)` (or what stands for it) over every batch level: the output leaves. The
    forward keeps what a backward pass would use only where one may follow (`spec.backward`)."""
    fn_leaves, x_leaves = operands[: spec.n_fn], operands[spec.n_fn :]

    def one(fn_leaves, x_leaves):
        y = spec.fn(fn_leaves).primal(spec.x(x_leaves))
        return jtu.tree_leaves(y)

    with _jaxpr.setting(_runtime.BACKWARD, spec.backward):
        return spec.over_levels(one, split_fn_x(spec.n_fn))(list(fn_leaves), list(x_leaves))


def _site_impl(*operands, spec: Spec):
    return outputs(spec, *operands)


def _site_abstract(*avals, spec: Spec):
    # (inside `jax.shard_map`, the output varies along the manual axes its operands vary along)
    return with_varying(spec.y_avals(), avals)


def _site_batch(args, dims, spec: Spec):
    return rebind_batched(site_p, args, dims, spec)


# The host sites whose JVP rule is running, by their function (`_site_jvp`).
_DIFFERENTIATED = _runtime.DIFFERENTIATED
_TO_BE_DIFFERENTIATED = _runtime.TO_BE_DIFFERENTIATED


def _site_jvp(primals, tangents, spec: Spec):
    """The JVP rule. A host site's derivative cannot be differentiated (JAX cannot see into
    its host functions): a second derivative (`jax.hessian`, `jax.grad` of `jax.grad`) binds
    the site inside its own rule, under the outer derivative's trace, which calls this rule
    again for the same function; that call is refused, before anything runs."""
    static = spec.static
    if not static.on_host:
        return _site_jvp_rule(primals, tangents, spec)
    if static.higher_order is not None and (_TO_BE_DIFFERENTIATED.get() or _jaxpr.under_differentiation()):
        # (an outer differentiation will differentiate this derivative: the formulation JAX
        # differentiates to every order, `dx.sparse_solve`'s)
        return _higher_order_jvp(primals, tangents, spec)
    within = _DIFFERENTIATED.get()
    if any(s is static for s in within):
        raise TypeError(_messages.second_order(static.title))
    with _jaxpr.setting(_DIFFERENTIATED, (*within, static)):
        return _site_jvp_rule(primals, tangents, spec)


def _with_diff(x_leaves, diff, d_leaves) -> list:
    """`x_leaves` with its differentiable leaves (`diff`) replaced by `d_leaves`, in order."""
    it = iter(d_leaves)
    return [next(it) if dj else xj for xj, dj in zip(x_leaves, diff, strict=True)]


def _jvp_of_diff(f, x_leaves, x_tangents, diff):
    """JAX's `jax.jvp` of `f(x_leaves)` along the tangents of the differentiable leaves of `x`
    (the others constant: an integer leaf has no tangent)."""
    d_primals = [x for x, d in zip(x_leaves, diff, strict=True) if d]
    d_tangents = [_jaxpr.instantiate(t, jax.typeof(x)) for x, t, d in zip(x_leaves, x_tangents, diff, strict=True) if d]
    return jax.jvp(lambda d_leaves: f(_with_diff(x_leaves, diff, d_leaves)), (d_primals,), (d_tangents,))


def _higher_order_jvp(primals, tangents, spec: Spec):
    """The JVP of the site's `higher_order(x)` over every batch level, the implementations'
    arrays constants to it (as to every derivative of a site)."""
    fn_leaves, x_leaves = primals[: spec.n_fn], primals[spec.n_fn :]

    def one(fn_leaves, x_leaves):
        return jtu.tree_leaves(spec.fn(fn_leaves).higher_order(spec.x(x_leaves)))

    def f(xs):
        return spec.over_levels(one, split_fn_x(spec.n_fn))(list(fn_leaves), xs)

    return _jvp_of_diff(f, x_leaves, tangents[spec.n_fn :], spec.diff)


def _site_jvp_rule(primals, tangents, spec: Spec):
    fn_leaves, x_leaves = primals[: spec.n_fn], primals[spec.n_fn :]
    x_tangents = tangents[spec.n_fn :]
    diff = spec.diff
    if spec.static.autodiff:
        # `fwd` only: JAX differentiates it, in both modes. The arrays of the implementations
        # are constants to the derivative.
        return _jvp_of_diff(lambda xs: outputs(spec, *fn_leaves, *xs), x_leaves, x_tangents, diff)
    if _jvp_strategy(spec) == "forward-basis":
        return forward_basis_jvp(spec, fn_leaves, x_leaves, x_tangents)
    d_tangents = [(x, t) for x, t, d in zip(x_leaves, x_tangents, diff, strict=True) if d]
    if all(_jaxpr.is_zero(t) for _, t in d_tangents):
        y = site_p.bind(*primals, spec=spec)
        return y, [_jaxpr.zero_tangent(jax.typeof(v)) for v in y]
    # (a backward pass may follow: the transpose of `lin_p` below)
    y = site_p.bind(*primals, spec=dataclasses.replace(spec, backward=True))
    ts = [_jaxpr.instantiate(t, jax.typeof(x)) for x, t in d_tangents]
    lin_spec = dataclasses.replace(spec, axes=tuple((_linear_axes(spec, in_axes), size) for in_axes, size in spec.axes))
    t_y = lin_p.bind(*fn_leaves, *x_leaves, *y, *ts, spec=lin_spec)
    return y, t_y


# The strategy of each site whose differentiation deferax planned (`planned`): by `Spec`.
_PLANNED = _runtime.PLANNED


@contextlib.contextmanager
def planned(strategies: Mapping[Spec, str]):
    """Inside: the sites of `strategies` are differentiated on the strategy given there
    (`"standard"` or `"forward-basis"`), as the analysis planned it, whatever timings came
    in since. Any other site (and every site outside) chooses in its JVP rule (`_jvp_strategy`)."""
    with _jaxpr.setting(_PLANNED, strategies):
        yield


def _jvp_strategy(spec: Spec) -> str:
    """How reverse mode differentiates this site: `"standard"` or `"forward-basis"`, as
    planned (`planned`), else as its function chooses from its estimates now."""
    fixed = _PLANNED.get()
    chosen = None if fixed is None else fixed.get(spec)
    if chosen is not None:
        return chosen
    fn = spec.static
    return fn.strategy(spec.n_tangents, fn.forward_basis_estimates(spec.x_shapes, spec.n_tangents))


def _linear_axes(spec: Spec, in_axes: tuple) -> tuple:
    """A site level's `in_axes` extended to `lin_p`'s operands `(fn, x, y, t_x)`."""
    x_axes = in_axes[spec.n_fn :]
    t_axes = tuple(a for a, d in zip(x_axes, spec.diff, strict=True) if d)
    return (*in_axes, *([0] * len(spec.y_structs)), *t_axes)


site_p = _jaxpr.define_primitive(SITE, impl=_site_impl, abstract_eval=_site_abstract, jvp=_site_jvp, batch=_site_batch)


# ----------------------------------------------------------------------------- lin_p: t_y = J t_x, transposed to bwd


def _split_linear(spec: Spec, operands):
    n_fn, n_x, n_y = spec.n_fn, spec.n_x, len(spec.y_structs)
    fn_leaves = operands[:n_fn]
    x_leaves = operands[n_fn : n_fn + n_x]
    y_leaves = operands[n_fn + n_x : n_fn + n_x + n_y]
    t_leaves = operands[n_fn + n_x + n_y :]
    return fn_leaves, x_leaves, y_leaves, t_leaves


_FORWARD_MODE = """{call}: forward-mode differentiation (`jax.jvp`, `jax.jacfwd`, `jax.linearize`, \
`jax.hessian`) needs a
forward-mode implementation, but this function's derivative is {how}, which serves reverse mode only. Give
`jvp(x, t_x) -> (y, t_y)` (or `jvp_batch(x, t_xs) -> (y, t_ys)` for several tangents at once):

    dx.ExpensiveFn(fwd=simulate, bwd=adjoint, jvp=simulate_with_tangent)

or use reverse mode (`jax.grad`, `jax.vjp`, `jax.jacrev`)."""


def _linear_impl(*operands, spec: Spec):
    """Forward mode: `t_y = J t_x` with `jvp` (or `jvp_batch`), over every batch level; a
    level that batches only the tangents (`jax.jacfwd`) is one `jvp_batch` call."""
    static = spec.static
    if static.jvp is None and static.jvp_batch is None and static.higher_order is not None:
        # (no forward-mode host function: the tangent of `higher_order`, which JAX differentiates)
        fn_leaves, x_leaves, _, t_leaves = _split_linear(spec, operands)
        return _higher_order_tangent(spec, fn_leaves, x_leaves, t_leaves)
    if static.jvp is None and static.jvp_batch is None:
        how = (
            "given by `bwd`"
            if static.bwd is not None
            else "given by `adjoint`"
            if static.adjoint is not None
            else "derived from `fused`"
        )
        raise TypeError(_FORWARD_MODE.format(call=static.title, how=how))
    fn_leaves, x_leaves, _, t_leaves = _split_linear(spec, operands)
    n_fn, n_x, n_y = spec.n_fn, spec.n_x, len(spec.y_structs)
    diff = spec.diff

    def full_tangent(x_leaves, t_leaves):
        it = iter(t_leaves)
        return [next(it) if d else zero_like(x) for x, d in zip(x_leaves, diff, strict=True)]

    inner = spec.axes[1:] if spec.axes else ()
    head = spec.axes[0][0] if spec.axes else None
    if head is not None and all(a is None for a in head[: n_fn + n_x]) and not inner and static.jvp_batch is not None:
        fn = spec.fn(fn_leaves)
        x = spec.x(x_leaves)
        k = spec.axes[0][1]
        # a tangent the level does not batch (a zero, for `jax.jacfwd(..., argnums=...)`) is the same for all `k`
        t_axes = head[n_fn + n_x + n_y :]
        t_leaves = [
            t if a is not None else jnp.broadcast_to(t, (k, *jnp.shape(t)))
            for t, a in zip(t_leaves, t_axes, strict=True)
        ]
        t_xs = [
            t if d else np.zeros((k, *jnp.shape(x_)), jax.dtypes.float0)
            for x_, t, d in zip(x_leaves, full_tangent(x_leaves, t_leaves), diff, strict=True)
        ]
        return jtu.tree_leaves(fn.tangents(x, spec.x(t_xs))[1])

    def one(fn_leaves, x_leaves, t_leaves):
        fn = spec.fn(fn_leaves)
        return jtu.tree_leaves(fn.tangent(spec.x(x_leaves), spec.x(full_tangent(x_leaves, t_leaves))))

    def axes_of(level):
        return (list(level[:n_fn]), list(level[n_fn : n_fn + n_x]), list(level[n_fn + n_x + n_y :]))

    return spec.over_levels(one, axes_of)(list(fn_leaves), list(x_leaves), list(t_leaves))


def _higher_order_tangent(spec: Spec, fn_leaves, x_leaves, t_leaves) -> list:
    """`t_y = J(x) t` (the tangents `t` of the differentiable leaves of `x`) over every batch
    level of `lin_p`, by JAX's `jax.jvp` of the site's `higher_order`."""
    n_fn, n_x, n_y = spec.n_fn, spec.n_x, len(spec.y_structs)
    diff = spec.diff

    def one(fn_leaves, x_leaves, t_leaves):
        fn = spec.fn(fn_leaves)
        d_x = [x for x, d in zip(x_leaves, diff, strict=True) if d]

        def of_diff(d_leaves):
            return jtu.tree_leaves(fn.higher_order(spec.x(_with_diff(x_leaves, diff, d_leaves))))

        return jax.jvp(of_diff, (d_x,), (list(t_leaves),))[1]

    def axes_of(level):
        return (list(level[:n_fn]), list(level[n_fn : n_fn + n_x]), list(level[n_fn + n_x + n_y :]))

    return spec.over_levels(one, axes_of)(list(fn_leaves), list(x_leaves), list(t_leaves))


def _linear_jvp(primals, tangents, spec: Spec):
    """`t_y = J(x) t` differentiated: along `t` alone it is itself (linear in `t`); along `x`
    it is a second derivative, which a site with `higher_order` takes from JAX's `jax.jvp`
    of that (a `jax.linearize` function or a forward-mode derivative in a jaxpr, differentiated
    later), and any other refuses."""
    static = spec.static
    fn_leaves, x_leaves, y_leaves, t_leaves = _split_linear(spec, primals)
    _, dx_leaves, _, dt_leaves = _split_linear(spec, tangents)
    out = lin_p.bind(*primals, spec=spec)
    avals = with_varying(spec.t_avals(), [aval_of(o) for o in primals])
    if all(_jaxpr.is_zero(d) for d, dj in zip(dx_leaves, spec.diff, strict=True) if dj):
        if all(_jaxpr.is_zero(d) for d in dt_leaves):
            return out, [_jaxpr.zero_tangent(a) for a in avals]
        dt = [_jaxpr.instantiate(d, jax.typeof(t)) for d, t in zip(dt_leaves, t_leaves, strict=True)]
        return out, lin_p.bind(*fn_leaves, *x_leaves, *y_leaves, *dt, spec=spec)
    if static.higher_order is None:
        raise TypeError(_messages.second_order(static.title))

    def tangent(d_leaves, t_leaves):
        return _higher_order_tangent(spec, fn_leaves, _with_diff(x_leaves, spec.diff, d_leaves), t_leaves)

    d_x = [x for x, dj in zip(x_leaves, spec.diff, strict=True) if dj]
    t_d_x = [
        _jaxpr.instantiate(d, jax.typeof(x)) for d, x, dj in zip(dx_leaves, x_leaves, spec.diff, strict=True) if dj
    ]
    d_t = [_jaxpr.instantiate(d, jax.typeof(t)) for d, t in zip(dt_leaves, t_leaves, strict=True)]
    return out, jax.jvp(tangent, (d_x, list(t_leaves)), (t_d_x, d_t))[1]


def _linear_abstract(*avals, spec: Spec):
    return with_varying(spec.t_avals(), avals)


def _linear_batch(args, dims, spec: Spec):
    return rebind_batched(lin_p, args, dims, spec)


def cotangents(spec: Spec, fn_leaves, x_leaves, y_leaves, cts) -> list:
    """`bwd` (or `fused`) over every batch level: the cotangents of the differentiable
    leaves of `x`, each shaped like its operand (summed over the levels where it is not
    batched)."""
    diff = spec.diff
    n_fn, n_x, n_y = spec.n_fn, spec.n_x, len(spec.y_structs)

    def one(fn_leaves, x_leaves, y_leaves, ct_leaves):
        fn = spec.fn(fn_leaves)
        y = jtu.tree_unflatten(spec.y_tree, list(y_leaves))
        ct = jtu.tree_unflatten(spec.y_tree, list(ct_leaves))
        ct_x = jtu.tree_leaves(fn.cotangent(spec.x(x_leaves), y, ct))
        return [c for c, d in zip(ct_x, diff, strict=True) if d]

    def axes_of(level):
        return (list(level[:n_fn]), list(level[n_fn : n_fn + n_x]), [0] * n_y, [0] * n_y)

    out = spec.over_levels(one, axes_of)(list(fn_leaves), list(x_leaves), list(y_leaves), list(cts))
    return unbatch(spec, out)


def unbatch(spec: Spec, diff_cts: list) -> list:
    """Cotangents of the differentiable leaves of `x`, computed batched at every level,
    summed over the levels where their operand is not batched."""
    x_axes = [
        [a for a, d in zip(level[spec.n_fn : spec.n_fn + spec.n_x], spec.diff, strict=True) if d]
        for level, _ in spec.axes
    ]
    out = []
    for j, c in enumerate(diff_cts):
        dropped = tuple(level for level, axes in enumerate(x_axes) if axes[j] is None)
        out.append(jnp.sum(c, axis=dropped) if dropped else c)
    return out


def operand_cotangents(spec: Spec, operands, diff_cts) -> list:
    """Cotangents for every operand `(fn_leaves, x_leaves)`: zero for the implementations'
    arrays and the integer leaves of `x`, `diff_cts` for the others."""
    it = iter(diff_cts)
    x_leaves = operands[spec.n_fn :]
    cts = [zero_like(a) for a in operands[: spec.n_fn]]
    cts += [next(it) if d else zero_like(a) for a, d in zip(x_leaves, spec.diff, strict=True)]
    return cts


def _differentiable_cotangents(spec: Spec, fn_leaves: list, x_leaves: list, y_leaves: list, cts: list) -> list:
    """`cotangents(...)` (the site's `bwd` on the host, as always where nothing differentiates
    it), differentiable: its derivative is that of the cotangents of `higher_order` (JAX's
    `jax.vjp` of it, which JAX differentiates to every order). For a derivative traced where
    no enclosing differentiation could be seen (a jaxpr, `jax.closure_convert`, a `jax.vjp`
    function), differentiated later. `y` is `higher_order`'s own there: its tangent is the
    one `x`'s gives it."""
    diff = spec.diff

    @jax.custom_jvp
    def run(fn_leaves, x_leaves, y_leaves, cts):
        return cotangents(spec, fn_leaves, x_leaves, y_leaves, cts)

    @run.defjvp
    def _(primals, tangents):
        fn_leaves, x_leaves, _, cts = primals
        _, t_x, _, t_cts = tangents

        def one(fn_leaves, x_leaves, ct_leaves):
            fn = spec.fn(fn_leaves)
            _, pullback = jax.vjp(lambda xs: jtu.tree_leaves(fn.higher_order(spec.x(xs))), list(x_leaves))
            (ct_x,) = pullback(list(ct_leaves))
            return [c for c, d in zip(ct_x, diff, strict=True) if d]

        def axes_of(level):
            return (list(level[: spec.n_fn]), list(level[spec.n_fn : spec.n_fn + spec.n_x]), [0] * len(cts))

        def again(x_leaves, cts):
            return unbatch(spec, spec.over_levels(one, axes_of)(list(fn_leaves), list(x_leaves), list(cts)))

        t_x = [_jaxpr.instantiate(t, jax.typeof(x)) if d else t for t, x, d in zip(t_x, x_leaves, diff, strict=True)]
        return jax.jvp(again, (list(x_leaves), list(cts)), (t_x, list(t_cts)))

    return run(fn_leaves, x_leaves, y_leaves, cts)


def _linear_transpose(cts, *operands, spec: Spec):
    static = spec.static
    if not static.has_vjp:  # forward-basis was not possible
        raise TypeError(
            _messages.TOO_MANY_TANGENTS.format(call=static.title, n=spec.n_tangents, limit=static.max_tangents)
        )
    fn_leaves, x_leaves, y_leaves, t_leaves = _split_linear(spec, operands)
    nones = [None] * (len(operands) - len(t_leaves))
    if all(_jaxpr.is_zero(c) for c in cts):
        return [*nones, *[None] * len(t_leaves)]
    avals = [aval_of(o) for o in operands]
    cts = [_jaxpr.instantiate(c, a) for c, a in zip(cts, with_varying(spec.t_avals(), avals), strict=True)]
    # an integer output's cotangent is `float0`; implementations get zeros of its dtype
    cts = [
        vary(jnp.zeros(y.shape, y.dtype), varying_axes(jax.typeof(y)))
        if getattr(c, "dtype", None) == jax.dtypes.float0
        else c
        for c, y in zip(cts, y_leaves, strict=True)
    ]
    if static.higher_order is not None and not (_jaxpr.is_eager() and is_concrete((operands, cts))):
        # (traced, JAX may differentiate it later: in a jaxpr, a `jax.vjp` function; run now on
        # concrete values, nothing can)
        ct_x = _differentiable_cotangents(spec, list(fn_leaves), list(x_leaves), list(y_leaves), list(cts))
    else:
        ct_x = cotangents(spec, fn_leaves, x_leaves, y_leaves, cts)
    # Inside `jax.shard_map`, each cotangent is typed as its operand (`to_varying`): `bind_site`
    # cast a replicated input to vary with the others, and JAX sums its cotangent over the shards.
    t_axes = [varying_axes(a) for a in avals[len(nones) :]]
    return [*nones, *[to_varying(c, axes) for c, axes in zip(ct_x, t_axes, strict=True)]]


lin_p = _jaxpr.define_primitive(
    LINEAR,
    impl=_linear_impl,
    abstract_eval=_linear_abstract,
    jvp=_linear_jvp,
    batch=_linear_batch,
    transpose=_linear_transpose,
)


# ----------------------------------------------------------------------------- binding


_DECLARED = _runtime.DECLARED


@contextlib.contextmanager
def declared_outputs_checked():
    """Inside: a trace of the user's function. If it fails, and a site whose output
    structure was declared (`out=`) was called in it, the declaration is checked against
    what `fwd` really returns (where it can be traced): a wrong `out=` is the error raised
    then, naming the call, rather than what it made fail in the user's code (a shape
    mismatch there)."""
    seen: list = []
    with _jaxpr.setting(_DECLARED, seen):
        try:
            yield
        except Exception as e:
            for fn, x in seen:
                fn.check_out(x, e)
            raise


def bind_site(fn: Any, x: Any) -> Any:
    """`fn(x)` as one `site_p` equation (on concrete arrays outside any transformation,
    simply `fwd(x)`: no output structure is needed to run it, and no backward pass can follow,
    so it keeps nothing for one)."""
    if _jaxpr.is_eager() and is_concrete((fn, x)):
        with _jaxpr.setting(_runtime.BACKWARD, False):
            return fn.primal(x)
    fn_dynamic, static = eqx.partition(fn, eqx.is_array)
    fn_leaves, fn_tree = jtu.tree_flatten(fn_dynamic)
    x_leaves, x_tree = jtu.tree_flatten(x)
    x_structs = tuple(struct_of(a) for a in x_leaves)
    x_struct = jtu.tree_unflatten(x_tree, list(x_structs))
    y_struct = fn.out_struct(x_struct)
    if fn.out is not None and (declared := _DECLARED.get()) is not None:
        # (abstract: the function's arrays may be tracers of this trace, gone if it fails)
        abstract = eqx.combine(jtu.tree_unflatten(fn_tree, [struct_of(a) for a in fn_leaves]), static)
        declared.append((abstract, x_struct))
    y_leaves, y_tree = jtu.tree_flatten(y_struct)
    spec = Spec(
        static, fn_tree, x_tree, x_structs, y_tree, tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in y_leaves)
    )
    fn_leaves, x_leaves = _varying_together(fn, x, fn_leaves, x_leaves)
    y = site_p.bind(*fn_leaves, *x_leaves, spec=spec)
    return jtu.tree_unflatten(y_tree, y)


_UNREDUCED = """{call}: called on {what}, which is unreduced along the mesh axes {axes}
(`jax.shard_map`): each shard holds one term of a sum that was never taken. The function must be given the value
itself, the same on every shard that holds it, not a term of it. Reduce it first:

    jax.lax.psum(x, {axes_arg})

(or leave these axes out of the `unreduced=` of the `PartitionSpec` it came in with)."""


def _varying_together(fn: Any, x: Any, fn_leaves: list, x_leaves: list) -> tuple[list, list]:
    """The operands of a site, cast to vary along the same manual mesh axes inside
    `jax.shard_map` (as JAX does for the operands of its own primitives): where one varies
    from shard to shard, the output does (`_site_abstract`), and the cotangent of a replicated
    input is the sum of every shard's (the transpose of the cast). Unchanged elsewhere. An
    unreduced operand (a term of a sum on each shard) is refused."""
    leaves = [*fn_leaves, *x_leaves]
    avals = [jax.typeof(a) for a in leaves]
    for i, a in enumerate(avals):
        if unreduced := sorted(unreduced_axes(a), key=str):
            if i < len(fn_leaves):
                what = "an array its implementations hold"
            else:
                path = jtu.tree_flatten_with_path(x)[0][i - len(fn_leaves)][0]
                what = f"its input `x{jtu.keystr(path)}`"
            axes_arg = repr(unreduced[0]) if len(unreduced) == 1 else repr(tuple(unreduced))
            raise TypeError(
                _UNREDUCED.format(call=fn.title, what=what, axes=", ".join(map(repr, unreduced)), axes_arg=axes_arg)
            )
    axes = frozenset().union(*(varying_axes(a) for a in avals))
    if not axes:
        return fn_leaves, x_leaves
    cast = [vary(a, axes) for a in leaves]
    return cast[: len(fn_leaves)], cast[len(fn_leaves) :]
