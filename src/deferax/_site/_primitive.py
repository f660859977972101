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
import contextvars
import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .. import _jaxpr, _record
from .._checks import _messages as _errors
from .._concurrency._threads import is_concrete
from .._forward_basis import _tangents

SITE = "deferax_site"
LINEAR = "deferax_site_linear"
BASIS = "deferax_site_forward_basis"


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a site equation knows statically: the function and the structures.

    `axes` lists the `vmap` levels applied to the equation, outermost first; each level is
    `(in_axes, size)` with `in_axes` holding `0` or `None` for each operand of the
    primitive it belongs to. Every output is batched at axis 0 of every level.
    """

    static: Any  # the ExpensiveFn with its arrays partitioned out
    fn_tree: Any
    x_tree: Any
    x_structs: tuple
    y_tree: Any
    y_structs: tuple
    axes: tuple = ()

    def __hash__(self) -> int:  # the implementations' structure may hold unhashable containers
        return hash((self.name, self.fn_tree, self.x_tree, self.x_structs, self.y_tree, self.y_structs, self.axes))

    def __repr__(self) -> str:  # how the equation's parameter prints in a jaxpr
        batch = f", vmap={list(self.sizes)}" if self.axes else ""
        return f"{self.name}{batch}"

    @property
    def name(self) -> str:
        return self.static.name

    @property
    def n_fn(self) -> int:
        return self.fn_tree.num_leaves

    @property
    def n_x(self) -> int:
        return len(self.x_structs)

    @property
    def diff(self) -> tuple[bool, ...]:
        """Which leaves of `x` are differentiable (inexact)."""
        return tuple(bool(jnp.issubdtype(s.dtype, jnp.inexact)) for s in self.x_structs)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    def fn(self, fn_leaves) -> Any:
        return eqx.combine(jtu.tree_unflatten(self.fn_tree, list(fn_leaves)), self.static)

    def x(self, x_leaves) -> Any:
        return jtu.tree_unflatten(self.x_tree, list(x_leaves))

    def y_avals(self) -> list:
        return [_jaxpr.shaped(jax.ShapeDtypeStruct((*self.sizes, *s.shape), s.dtype)) for s in self.y_structs]

    def t_avals(self) -> list:
        """The tangent avals of the output: as `y_avals`, with `float0` for integer leaves."""
        return [a if jnp.issubdtype(a.dtype, jnp.inexact) else _jaxpr.shaped(jax.ShapeDtypeStruct(a.shape, jax.dtypes.float0)) for a in self.y_avals()]

    def with_level(self, in_axes: tuple, size: int) -> Spec:
        return dataclasses.replace(self, axes=((in_axes, size), *self.axes))

    def vmapped(self, f, axes_of):
        """`f(*operands)` vmapped over every batch level (`axes_of(level_in_axes)` gives
        the `in_axes` of `f`'s operands at that level), outputs batched at 0."""
        for in_axes, _ in reversed(self.axes):
            f = jax.vmap(f, in_axes=axes_of(in_axes), out_axes=0)
        return f


def spec_of(eqn) -> Spec:
    return eqn.params["spec"]


# ----------------------------------------------------------------------------- site_p


def primal(spec: Spec, *operands):
    fn_leaves, x_leaves = operands[: spec.n_fn], operands[spec.n_fn :]

    def one(fn_leaves, x_leaves):
        y = spec.fn(fn_leaves).primal(spec.x(x_leaves))
        return jtu.tree_leaves(y)

    return spec.vmapped(one, lambda a: (list(a[: spec.n_fn]), list(a[spec.n_fn :])))(list(fn_leaves), list(x_leaves))


def _site_impl(*operands, spec: Spec):
    return primal(spec, *operands)


def _site_abstract(*avals, spec: Spec):
    return spec.y_avals()


def _batch(p, args, dims, spec: Spec):
    moved, in_axes = [], []
    size = None
    for a, d in zip(args, dims, strict=True):
        if _jaxpr.is_not_mapped(d):
            moved.append(a)
            in_axes.append(None)
        else:
            moved.append(_jaxpr.move_to_front(a, d))
            in_axes.append(0)
            size = a.shape[d]
    outs = p.bind(*moved, spec=spec.with_level(tuple(in_axes), size))
    return outs, [0] * len(outs)


def _site_batch(args, dims, spec: Spec):
    return _batch(site_p, args, dims, spec)


def _site_jvp(primals, tangents, spec: Spec):
    fn_leaves, x_leaves = primals[: spec.n_fn], primals[spec.n_fn :]
    x_tangents = tangents[spec.n_fn :]
    diff = spec.diff
    if spec.static.autodiff:
        # `fwd` only: JAX differentiates it, in both modes. The arrays of the implementations
        # are constants to the derivative.
        def of_diff(d_leaves):
            it = iter(d_leaves)
            xs = [next(it) if dj else xj for xj, dj in zip(x_leaves, diff, strict=True)]
            return primal(spec, *fn_leaves, *xs)

        d_primals = [x for x, d in zip(x_leaves, diff, strict=True) if d]
        d_tangents = [_jaxpr.instantiate(t, jax.typeof(x)) for x, t, d in zip(x_leaves, x_tangents, diff, strict=True) if d]
        return jax.jvp(of_diff, (d_primals,), (d_tangents,))
    if strategy(spec) == "forward-basis":
        return _forward_basis_jvp(spec, fn_leaves, x_leaves, x_tangents)
    y = site_p.bind(*primals, spec=spec)
    d_tangents = [(x, t) for x, t, d in zip(x_leaves, x_tangents, diff, strict=True) if d]
    if all(_jaxpr.is_zero(t) for _, t in d_tangents):
        return y, [_jaxpr.zero_tangent(a) for a in spec.y_avals()]
    ts = [_jaxpr.instantiate(t, jax.typeof(x)) for x, t in d_tangents]
    lin_spec = dataclasses.replace(spec, axes=tuple((_linear_axes(spec, in_axes), size) for in_axes, size in spec.axes))
    t_y = lin_p.bind(*fn_leaves, *x_leaves, *y, *ts, spec=lin_spec)
    return y, t_y


def _linear_axes(spec: Spec, in_axes: tuple) -> tuple:
    """A site level's `in_axes` extended to `lin_p`'s operands `(fn, x, y, t_x)`."""
    x_axes = in_axes[spec.n_fn :]
    t_axes = tuple(a for a, d in zip(x_axes, spec.diff, strict=True) if d)
    return (*in_axes, *([0] * len(spec.y_structs)), *t_axes)


site_p = _jaxpr.define_primitive(
    SITE, impl=_site_impl, abstract_eval=_site_abstract, jvp=_site_jvp, batch=_site_batch
)


# ----------------------------------------------------------------------------- lin_p: t_y = J t_x, transposed to bwd


def _split_linear(spec: Spec, operands):
    n_fn, n_x, n_y = spec.n_fn, spec.n_x, len(spec.y_structs)
    fn_leaves = operands[:n_fn]
    x_leaves = operands[n_fn : n_fn + n_x]
    y_leaves = operands[n_fn + n_x : n_fn + n_x + n_y]
    t_leaves = operands[n_fn + n_x + n_y :]
    return fn_leaves, x_leaves, y_leaves, t_leaves


def _linear_impl(*operands, spec: Spec):
    """Forward mode: `t_y = J t_x` with `jvp` (or `jvp_batch`), over every batch level; a
    level that batches only the tangents (`jax.jacfwd`) is one `jvp_batch` call."""
    static = spec.static
    if static.jvp is None and static.jvp_batch is None:
        how = "given by `bwd`" if static.bwd is not None else "given by `adjoint`" if static.adjoint is not None else "derived from `fused`"
        raise TypeError(_errors.FORWARD_MODE.format(call=static._call, how=how))
    fn_leaves, x_leaves, _, t_leaves = _split_linear(spec, operands)
    n_fn, n_x, n_y = spec.n_fn, spec.n_x, len(spec.y_structs)
    diff = spec.diff

    def full_tangent(x_leaves, t_leaves):
        it = iter(t_leaves)
        return [next(it) if d else _tangents.zero_like(x) for x, d in zip(x_leaves, diff, strict=True)]

    inner = spec.axes[1:] if spec.axes else ()
    head = spec.axes[0][0] if spec.axes else None
    if head is not None and all(a is None for a in head[: n_fn + n_x]) and not inner and static.jvp_batch is not None:
        fn = spec.fn(fn_leaves)
        x = spec.x(x_leaves)
        k = spec.axes[0][1]
        # a tangent the level does not batch (a zero, for `jax.jacfwd(..., argnums=...)`) is the same for all `k`
        t_axes = head[n_fn + n_x + n_y :]
        t_leaves = [t if a is not None else jnp.broadcast_to(t, (k, *jnp.shape(t))) for t, a in zip(t_leaves, t_axes, strict=True)]
        t_xs = [t if d else np.zeros((k, *jnp.shape(x_)), jax.dtypes.float0) for x_, t, d in zip(x_leaves, full_tangent(x_leaves, t_leaves), diff, strict=True)]
        return jtu.tree_leaves(_tangents.tangents(fn, x, spec.x(t_xs))[1])

    def one(fn_leaves, x_leaves, t_leaves):
        fn = spec.fn(fn_leaves)
        return jtu.tree_leaves(_tangents.tangent(fn, spec.x(x_leaves), spec.x(full_tangent(x_leaves, t_leaves))))

    def axes_of(level):
        return (list(level[:n_fn]), list(level[n_fn : n_fn + n_x]), list(level[n_fn + n_x + n_y :]))

    return spec.vmapped(one, axes_of)(list(fn_leaves), list(x_leaves), list(t_leaves))


def _linear_abstract(*avals, spec: Spec):
    return spec.t_avals()


def _linear_batch(args, dims, spec: Spec):
    return _batch(lin_p, args, dims, spec)


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

    out = spec.vmapped(one, axes_of)(list(fn_leaves), list(x_leaves), list(y_leaves), list(cts))
    return unbatch(spec, out)


def unbatch(spec: Spec, diff_cts: list) -> list:
    """Cotangents of the differentiable leaves of `x`, computed batched at every level,
    summed over the levels where their operand is not batched."""
    x_axes = [[a for a, d in zip(level[spec.n_fn : spec.n_fn + spec.n_x], spec.diff, strict=True) if d] for level, _ in spec.axes]
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
    cts = [_tangents.zero_like(a) for a in operands[: spec.n_fn]]
    cts += [next(it) if d else _tangents.zero_like(a) for a, d in zip(x_leaves, spec.diff, strict=True)]
    return cts


def _linear_transpose(cts, *operands, spec: Spec):
    static = spec.static
    if not static.has_vjp:  # forward-basis was not possible
        raise TypeError(_errors.TOO_MANY_TANGENTS.format(call=static._call, n=n_inputs(spec), limit=static.max_tangents))
    fn_leaves, x_leaves, y_leaves, t_leaves = _split_linear(spec, operands)
    nones = [None] * (len(operands) - len(t_leaves))
    if all(_jaxpr.is_zero(c) for c in cts):
        return [*nones, *[None] * len(t_leaves)]
    cts = [_jaxpr.instantiate(c, a) for c, a in zip(cts, spec.t_avals(), strict=True)]
    # an integer output's cotangent is `float0`; implementations get zeros of its dtype
    cts = [jnp.zeros(y.shape, y.dtype) if getattr(c, "dtype", None) == jax.dtypes.float0 else c for c, y in zip(cts, y_leaves, strict=True)]
    return [*nones, *cotangents(spec, fn_leaves, x_leaves, y_leaves, cts)]


lin_p = _jaxpr.define_primitive(
    LINEAR,
    impl=_linear_impl,
    abstract_eval=_linear_abstract,
    batch=_linear_batch,
    transpose=_linear_transpose,
)


# ----------------------------------------------------------------------------- forward-basis: y and J in one call


def n_inputs(spec: Spec) -> int:
    """The real numbers of the differentiable leaves of one example's `x`."""
    return _tangents.n_inputs(spec.x(spec.x_structs))


def strategy(spec: Spec) -> str:
    """How reverse mode differentiates this site: `"standard"` or `"forward-basis"`."""
    return _tangents.strategy(spec.static, n_inputs(spec))


def _basis_avals(spec: Spec) -> list:
    n = n_inputs(spec)
    stacked = [_jaxpr.shaped(jax.ShapeDtypeStruct((*spec.sizes, n, *a.shape[len(spec.sizes) :]), a.dtype)) for a in spec.t_avals()]
    return [*spec.y_avals(), *stacked]


def _basis_impl(*operands, spec: Spec):
    """`(y, J)` over every batch level: the output and its `n` unit-tangent directions."""

    def one(fn_leaves, x_leaves):
        with _record.site(spec.name, "forward-basis"):  # (the recording names the strategy as `explain` does)
            y, jac = _tangents.jacobian(spec.fn(fn_leaves), spec.x(x_leaves))
        return [*jtu.tree_leaves(y), *jtu.tree_leaves(jac)]

    axes_of = lambda level: (list(level[: spec.n_fn]), list(level[spec.n_fn :]))  # noqa: E731
    return spec.vmapped(one, axes_of)(list(operands[: spec.n_fn]), list(operands[spec.n_fn :]))


def _basis_abstract(*avals, spec: Spec):
    return _basis_avals(spec)


def _basis_batch(args, dims, spec: Spec):
    return _batch(basis_p, args, dims, spec)


def _basis_jvp(primals, tangents, spec: Spec):
    # Forward over forward-basis (`jax.hessian`): JAX differentiates the forward-mode
    # implementations themselves, which must then be JAX-traceable.
    tangents = [_jaxpr.instantiate(t, jax.typeof(p)) if jnp.issubdtype(jax.typeof(p).dtype, jnp.inexact) else t for p, t in zip(primals, tangents, strict=True)]
    return jax.jvp(lambda *ops: _basis_impl(*ops, spec=spec), tuple(primals), tuple(tangents))


basis_p = _jaxpr.define_primitive(
    BASIS, impl=_basis_impl, abstract_eval=_basis_abstract, jvp=_basis_jvp, batch=_basis_batch
)


def _contract(jac_leaves, d_tangents) -> list:
    """`t_y = J t_x` for one example, with `J` stacked along the unit tangents and `t_x`
    the tangents of the differentiable leaves of `x` (their order is that of the units)."""
    flat = _tangents.flatten_tangent(d_tangents, d_tangents)
    return [
        np.zeros(j.shape[1:], jax.dtypes.float0) if j.dtype == jax.dtypes.float0 else jnp.tensordot(flat.astype(j.dtype), j, axes=1)
        for j in jac_leaves
    ]


def _forward_basis_jvp(spec: Spec, fn_leaves, x_leaves, x_tangents):
    outs = basis_p.bind(*fn_leaves, *x_leaves, spec=spec)
    n_y = len(spec.y_structs)
    y, jac = outs[:n_y], outs[n_y:]
    ts = [_jaxpr.instantiate(t, jax.typeof(x)) for x, t, d in zip(x_leaves, x_tangents, spec.diff, strict=True) if d]

    def axes_of(level):
        d_axes = [a for a, d in zip(level[spec.n_fn : spec.n_fn + spec.n_x], spec.diff, strict=True) if d]
        return ([0] * n_y, d_axes)

    return y, spec.vmapped(_contract, axes_of)(list(jac), ts)


def structs_of(avals: list) -> list:
    """`jax.ShapeDtypeStruct`s of abstract values."""
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]


_READS_Y = "its `bwd` reads `y`{through} (give `adjoint` and `combine`, or `fused`)"

_OPAQUE_BWD = """its `bwd` calls {location}, whose body deferax cannot read: it may use what `fwd` left behind \
(a factorisation kept in a Python object), so it runs after `fwd`. If it does not, give `adjoint(x, ct_y)` instead \
of `bwd`, or `fused=dx.fuse(fwd, adjoint)`: they run at the same time"""


def bwd_blocks_fused(spec: Spec, fn_avals: list) -> str | None:
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
        return fn._invoke("bwd", spec.x(x_leaves), y, ct)

    try:
        closed = jax.make_jaxpr(bwd)(structs_of(fn_avals), list(spec.x_structs), list(spec.y_structs), list(spec.y_structs))
    except Exception:  # noqa: BLE001 - not JAX-traceable: assume the worst
        return _READS_Y.format(through="")
    n_y = len(spec.y_structs)
    labels = [None] * (len(fn_avals) + spec.n_x) + ["y"] * n_y + [None] * n_y
    if _returns_y(closed, labels):
        return _READS_Y.format(through="")
    for marks, location in _jaxpr.effect_dependencies(closed, labels):
        if "y" in marks:
            return _READS_Y.format(through=f" through {location}")
    opaque = _jaxpr.opaque_call(closed, (SITE, LINEAR, BASIS))
    return None if opaque is None else _OPAQUE_BWD.format(location=opaque)


def _returns_y(closed, labels: list) -> bool:
    """Whether an output of `bwd`'s program (`closed`, its inputs labelled) depends on `y`,
    or `y` is written to a `jax.Ref` from outside (and read there after the call)."""
    return any("y" in d for d in _jaxpr.dependencies(closed, labels)) or "y" in _jaxpr.escaping(closed, labels)


# ----------------------------------------------------------------------------- binding


def _struct(a) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))


_DECLARED: contextvars.ContextVar[list | None] = contextvars.ContextVar("deferax_declared", default=None)


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


def call(fn: Any, x: Any) -> Any:
    """`fn(x)` as one `site_p` equation (on concrete arrays outside any transformation,
    simply `fwd(x)`: no output structure is needed to run it)."""
    if _jaxpr.is_eager() and is_concrete((fn, x)):
        return fn.primal(x)
    fn_dynamic, static = eqx.partition(fn, eqx.is_array)
    fn_leaves, fn_tree = jtu.tree_flatten(fn_dynamic)
    x_leaves, x_tree = jtu.tree_flatten(x)
    x_structs = tuple(_struct(a) for a in x_leaves)
    x_struct = jtu.tree_unflatten(x_tree, list(x_structs))
    y_struct = fn.out_struct(x_struct)
    if fn.out is not None and _DECLARED.get() is not None:
        # (abstract: the function's arrays may be tracers of this trace, gone if it fails)
        abstract = eqx.combine(jtu.tree_unflatten(fn_tree, [_struct(a) for a in fn_leaves]), static)
        _DECLARED.get().append((abstract, x_struct))
    y_leaves, y_tree = jtu.tree_flatten(y_struct)
    spec = Spec(static, fn_tree, x_tree, x_structs, y_tree, tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in y_leaves))
    y = site_p.bind(*fn_leaves, *x_leaves, spec=spec)
    return jtu.tree_unflatten(y_tree, y)
