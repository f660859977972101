"""What a site equation knows statically (`Spec`), and what its primitives share: their
names and their batching rule. Also whether a site's `bwd` lets a `fused` be made from it,
read from the program of `bwd` (`Spec.why_bwd_blocks_fused`; for a program's sites,
`bwd_decisions`, which the analysis and the key of the compiled stages read).

A site's function (an `ExpensiveFn`, from the layer above) is held in the `Spec`, typed as
its interface (`AbstractSiteFunction`, `_function.py`: what the rules, the analysis, the
schedules and the stages call on it, declared, so that pyright checks every use).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu

from .. import _jaxpr, _runtime
from .._jaxpr import is_inexact, structs
from ._function import AbstractSiteFunction
from ._tangents import n_inputs

SITE = "deferax_site"
LINEAR = "deferax_site_linear"
FORWARD_BASIS = "deferax_site_forward_basis"
# Every primitive whose equations are expensive calls (or their derivatives).
PRIMITIVES = (SITE, LINEAR, FORWARD_BASIS)

_READS_Y = "its `bwd` reads `y`{through} (give `adjoint` and `combine`, or `fused`)"

_OPAQUE_BWD = (
    "its `bwd` calls {location}, whose body deferax cannot read: it may use what `fwd` left behind "
    "(a factorisation kept in a Python object), so it runs after `fwd`. If it does not, give `adjoint(x, ct_y)` "
    "instead of `bwd`, or `fused=dx.fuse(fwd, adjoint)`: they run at the same time"
)


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a site equation knows statically: the function and the structures.

    `axes` lists the `vmap` levels applied to the equation, outermost first; each level is
    `(in_axes, size)` with `in_axes` holding `0` or `None` for each operand of the
    primitive it belongs to. Every output is batched at axis 0 of every level.

    `backward`: whether a backward pass may use what the call leaves behind (`dx.sparse_solve`'s
    factorisation): True where the site's JVP rule bound it (or a schedule that runs its `bwd`
    later); False for a call that nothing differentiates, whose forward keeps nothing.
    """

    static: AbstractSiteFunction  # the `ExpensiveFn` with its arrays partitioned out (see above)
    fn_tree: Any
    x_tree: Any
    x_structs: tuple
    y_tree: Any
    y_structs: tuple
    axes: tuple = ()
    backward: bool = False

    def __hash__(self) -> int:  # the implementations' structure may hold unhashable containers
        structure = (self.fn_tree, self.x_tree, self.x_structs, self.y_tree, self.y_structs)
        return hash((self.name, *structure, self.axes, self.backward))

    def __repr__(self) -> str:  # how the equation's parameter prints in a jaxpr
        batch = f", vmap={list(self.sizes)}" if self.axes else ""
        return f"{self.name}{batch}"

    @property
    def name(self) -> str:
        name = self.static.name
        assert name is not None  # (an `ExpensiveFn` names itself when made)
        return name

    @property
    def n_fn(self) -> int:
        return self.fn_tree.num_leaves

    @property
    def n_x(self) -> int:
        return len(self.x_structs)

    @property
    def diff(self) -> tuple[bool, ...]:
        """Which leaves of `x` are differentiable (inexact)."""
        return tuple(is_inexact(s) for s in self.x_structs)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    @property
    def x_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of one example's leaves of `x` (what its timings are kept by)."""
        return tuple(s.shape for s in self.x_structs)

    @property
    def n_tangents(self) -> int:
        """How many unit tangents one example's `x` has: the real numbers of its
        differentiable leaves (`n_inputs`), the `n` of the forward-basis strategy."""
        return n_inputs(self.x(self.x_structs))

    def fn(self, fn_leaves) -> AbstractSiteFunction:
        return eqx.combine(jtu.tree_unflatten(self.fn_tree, list(fn_leaves)), self.static)

    def x(self, x_leaves) -> Any:
        return jtu.tree_unflatten(self.x_tree, list(x_leaves))

    def y_avals(self) -> list:
        return [_jaxpr.shaped(jax.ShapeDtypeStruct((*self.sizes, *s.shape), s.dtype)) for s in self.y_structs]

    def t_avals(self) -> list:
        """The tangent avals of the output: as `y_avals`, with `float0` for integer leaves."""
        float0 = jax.dtypes.float0
        return [a if is_inexact(a) else _jaxpr.shaped(jax.ShapeDtypeStruct(a.shape, float0)) for a in self.y_avals()]

    def with_level(self, in_axes: tuple, size: int) -> Spec:
        return dataclasses.replace(self, axes=((in_axes, size), *self.axes))

    def over_levels(self, f, axes_of):
        """`f(*operands)` vmapped over every batch level (`axes_of(level_in_axes)` gives
        the `in_axes` of `f`'s operands at that level), outputs batched at 0."""
        for in_axes, _ in reversed(self.axes):
            f = jax.vmap(f, in_axes=axes_of(in_axes), out_axes=0)
        return f

    def why_bwd_blocks_fused(self, fn_avals: list) -> str | None:
        """Why no `fused` can be made from the site's `fwd` and `bwd(x, y, ct_y)`, read from
        the jaxpr of `bwd` traced now; None when one can. It can when `bwd` does not read `y`
        (in what it returns, nor in an effect such as `jax.debug.callback`, which would see
        the zeros it is given instead) and everything it calls can be read: a host callback
        may use what `fwd` kept (its state), and must run after it. A `bwd` that cannot be
        traced (a host function) counts as reading `y`."""

        def bwd(fn_leaves, x_leaves, y_leaves, ct_leaves):
            fn = self.fn(fn_leaves)
            y = jtu.tree_unflatten(self.y_tree, list(y_leaves))
            ct = jtu.tree_unflatten(self.y_tree, list(ct_leaves))
            return fn.invoke("bwd", self.x(x_leaves), y, ct)

        try:
            y_structs = list(self.y_structs)
            closed = jax.make_jaxpr(bwd)(structs(fn_avals), list(self.x_structs), y_structs, y_structs)
        except Exception:  # noqa: BLE001 - not JAX-traceable: assume the worst
            return _READS_Y.format(through="")
        n_y = len(self.y_structs)
        labels = [None] * (len(fn_avals) + self.n_x) + ["y"] * n_y + [None] * n_y
        if _returns_y(closed, labels):
            return _READS_Y.format(through="")
        for marks, location in _jaxpr.effect_dependencies(closed, labels):
            if "y" in marks:
                return _READS_Y.format(through=f" through {location}")
        opaque = _jaxpr.opaque_call(closed, PRIMITIVES)
        return None if opaque is None else _OPAQUE_BWD.format(location=opaque)


def spec_of(eqn) -> Spec:
    return eqn.params["spec"]


def _returns_y(closed, labels: list) -> bool:
    """Whether an output of `bwd`'s program (`closed`, its inputs labelled) depends on `y`,
    or `y` is written to a `jax.Ref` from outside (and read there after the call)."""
    return any("y" in d for d in _jaxpr.dependencies(closed, labels)) or "y" in _jaxpr.escaping(closed, labels)


def bwd_decisions(program) -> tuple:
    """What the analysis reads beyond the program's equations: for each top-level site with
    `fwd` and `bwd` only, why no `fused` can be made from them (None when one can), from
    the program of `bwd` traced now (a global that it branches on may have been rebound
    since the last call); None for the other sites. A key for the compiled stages covers it."""
    decisions = []
    for i in _jaxpr.top_level(program, SITE):
        eqn = program.jaxpr.eqns[i]
        spec = spec_of(eqn)
        static = spec.static
        derivable = (
            static.fwd is not None and static.bwd is not None and static.fused is None and static.fused_batch is None
        )
        blocked = (
            spec.why_bwd_blocks_fused([v.aval for v in eqn.invars[: spec.n_fn]])
            if derivable and static.prefer is None
            else None
        )
        decisions.append(blocked)
    return tuple(decisions)


def unread_bwd_check(spec: Spec, fn_operands: list) -> Any:
    """Eagerly, on a call whose plan was taken without reading the sites' `bwd`s
    (`_runtime.BWD_UNREAD`, see `_stages/_run.py: analysis_of`), for a site whose `fused` is
    made from `fwd` and `bwd` (not `adjoint`): the check that its `bwd` still lets it be,
    `why_bwd_blocks_fused` on the site's own arrays (`fn_operands`), to call where the
    adjoint half runs, before it (None when it can; where it cannot, the read the plan was
    taken from is forgotten). None where there is nothing to check."""
    forget = _runtime.BWD_UNREAD.get()
    if forget is None or spec.static.adjoint is not None:
        return None

    def check() -> str | None:
        reason = spec.why_bwd_blocks_fused(list(fn_operands))
        if reason is not None:  # (the next call reads it before the halves)
            forget()
        return reason

    return check


def split_fn_x(n_fn: int):
    """`axes_of` for a function of `(fn_leaves, x_leaves)`: a level's `in_axes` split in two."""

    def axes_of(level):
        return list(level[:n_fn]), list(level[n_fn:])

    return axes_of


def rebind_batched(p, args, dims, spec: Spec):
    """The batching rule of a site primitive `p`: `p` bound again with one more `vmap` level
    on its `Spec`, every operand moved to axis 0 (or not batched), outputs batched at 0."""
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
    assert size is not None  # (a batching rule runs with at least one operand batched)
    outs = p.bind(*moved, spec=spec.with_level(tuple(in_axes), size))
    return outs, [0] * len(outs)
