"""The deferred-basis schedule: a site whose cotangent is a combination of `k` fixed
cotangents (its linear frontier). Stage 1 computes the `k` basis cotangents, stage 2 runs
the forward once and the `k` adjoints in one job, and stage 3 combines the adjoints with
the frontier variables' own cotangents where those variables are made."""

from __future__ import annotations

import functools as ft
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _jaxpr, _site
from .._jaxpr import zero_like
from .._plan._cost import Estimates
from .._plan._plan import Schedule
from .._site import Spec
from . import _per_example
from ._abstract import AbstractDeferring, halves_text, leaves_program, returning
from ._deferred import estimate, fused_is_derived, fused_label


class Basis(eqx.Module):
    """The linear frontier of a deferred-basis site.

    **Fields:**

    - `k`: the number of basis cotangents (the real numbers of the frontier; per example
      where `example_axes` is given).
    - `variables`: the frontier variables, variables of the program that stage 3 evaluates.
    - `program`: what stage 1 evaluates for them: the program with every expensive output
      an input, computing the frontier variables.
    - `example_axes`: for a site under `vmap` whose basis is counted per example
      (`_per_example`), each frontier variable's axis of examples; None otherwise.
    """

    k: int
    variables: tuple
    program: Any
    example_axes: tuple[int, ...] | None = None


def _basis_cotangents(program, variables, ins, ys, position, axes=None):
    """The basis cotangents of a basis site: for each real number of each frontier variable
    (a complex number counts twice: its real, then its imaginary direction), the cotangent
    of the site's output that the variable's *direct* dependence on it gives, stacked.

    The frontier is linear in the output, so these are exact rows of a fixed Jacobian.
    "Direct": a frontier variable computed from another one sees it as a constant (its
    contribution travels through the other's cotangent in stage 3), so that
    `ct_y = sum_j ct_z[j] * row_j` holds with `ct_z` the variables' cotangents. `axes`:
    a per-example basis's axes of examples (`_per_example`): one seed a row for every example.
    """
    n_in = len(ins) + len(jtu.tree_leaves(ys))
    ns = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in program.jaxpr.invars[n_in:]]
    wanted = set(variables)

    def frontier_of(y_p):
        ys_ = list(ys)
        ys_[position] = y_p
        seen = {}

        def record(v):
            def f(value):
                seen[v] = value
                return jax.lax.stop_gradient(value)

            return f

        _jaxpr.interpret(program, [*ins, *jtu.tree_leaves(ys_), *ns], wrap={v: record(v) for v in wanted})
        return [seen[v] for v in variables]

    values, vjp = jax.vjp(frontier_of, ys[position])
    if axes is not None:  # each example's own rows (`_per_example`)
        return jax.vmap(vjp)(_per_example.seeds(values, axes))[0]
    (basis,) = jax.vmap(vjp)(_site.unit_tangents(values))  # (the real basis of the frontier values)
    return basis


def _frontier_cotangents(spec: Spec, rows: slice, axis: int | None, args, ct_z):
    _, operands, ct_xs = args
    # the order of the basis rows (per example: `(rows, examples)`)
    a = _site.flatten_tangent(ct_z, ct_z) if axis is None else _per_example.coefficients(ct_z, axis)

    def combine(c):
        c = c[rows]
        coefficients = jnp.reshape(a, a.shape + (1,) * (c.ndim - a.ndim)).astype(c.dtype)
        return jnp.sum(jnp.where(c == 0, jnp.zeros((), c.dtype), coefficients * c), axis=0)

    diff_cts = [combine(c) for c in ct_xs]
    return (ct_z, _site.operand_cotangents(spec, operands, diff_cts), jtu.tree_map(zero_like, ct_xs))


def frontier_cotangent(spec: Spec, rows: slice, axis: int | None = None):
    """Where a frontier variable `z` of a basis site is made: `frontier_cotangent(spec,
    rows)(z, operands, ct_xs)` is `z` itself, whose backward pass also gives the site's
    operands their cotangent. The coefficients are `z`'s own cotangent, exactly (no
    projection): `ct_x = sum_j ct_z[j] * ct_x_j` over the precomputed input cotangents of
    this variable's basis cotangents, with a zero entry of `ct_x_j` contributing zero
    whatever `ct_z[j]` is: an infinite slope then gives `inf` where the standard
    schedule's adjoint would, not NaN everywhere. `axis`: a per-example basis's axis of
    examples in `z`."""
    return returning(0, ft.partial(_frontier_cotangents, spec, rows, axis))


class DeferredBasis(AbstractDeferring):
    """A site on the deferred-basis schedule: its frontier (`basis`), and the operation and
    user line that make its cotangent depend on an output (`location`)."""

    spec: Spec
    position: int
    reason: None = None
    location: str | None = eqx.field(kw_only=True)
    k: int = eqx.field(kw_only=True)
    n: None = None
    estimates: Estimates = eqx.field(kw_only=True)
    basis: Basis = eqx.field(kw_only=True)
    label: ClassVar[Schedule] = "deferred-basis"  # pyright: ignore[reportIncompatibleVariableOverride]  (an eqx.AbstractClassVar: pyright#4965)
    from_backward: ClassVar[tuple[str, ...]] = ("op",)  # pyright: ignore[reportIncompatibleVariableOverride]

    @staticmethod
    def estimate(spec: Spec, k: int, peers: int = 1, per_example: bool = False) -> Estimates:
        """The estimates of the standard and the deferred-basis schedule on `k` cotangents,
        with `peers` sites like it deferred at once (`per_example`: `k` counted per example
        already)."""
        return estimate(spec, k, peers, per_example=per_example)

    def stage_rows(self) -> tuple[str | None, str | None, str | None]:
        return fused_label(self.spec) + f" ({_per_example.text(self.k, self.basis.example_axes)})", None, None

    def stage1_cotangents(self, ins: list, ys: list, traced: list | None) -> Any:
        basis = self.basis
        return _basis_cotangents(basis.program, basis.variables, ins, ys, self.position, basis.example_axes)

    @property
    def impl(self) -> Any:
        static = self.spec.static
        if fused_is_derived(self.spec):
            return None
        return static.fused_batch if static.fused_batch is not None else static.fused

    @property
    def leaves_program(self) -> bool:
        return leaves_program(self.impl, fused_is_derived(self.spec))

    @property
    def halves(self) -> str | None:
        return halves_text(self.impl, fused_is_derived(self.spec))

    def call(self, operands: list, cts: Any) -> tuple:
        """The forward and `k` adjoints of a basis site in one job (`fused_batch`, or a `fused`
        batched over the cotangents): output leaves, and the cotangents of the differentiable
        leaves of `x` stacked on a leading axis of `k`. Under `vmap`, batched over the examples
        (a host one: a job per example), each on its `k` basis cotangents at that example: its
        own rows for a basis counted per example (`_per_example`), else all `k` (a site with a
        `fused_batch`; zero there for those that only other examples' outputs reach)."""
        spec, is_derived = self.spec, fused_is_derived(self.spec)
        n_fn = spec.n_fn
        # (a `bwd` not read for this call is read here, before both halves: one that reads `y`
        # now runs after the forward, on its `y`)
        check = _site.unread_bwd_check(spec, operands[:n_fn]) if is_derived else None
        if check is not None and check() is not None:
            is_derived = False

        def one(fn_leaves, x_leaves, ct_leaves):
            fn = spec.fn(fn_leaves)
            cts_tree = jtu.tree_unflatten(spec.y_tree, list(ct_leaves))
            x = spec.x(x_leaves)
            y, ct_xs = fn.derived_fused().batched(x, cts_tree) if is_derived else fn.run_fused_batch(x, cts_tree)
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

    def stage3(self, y: list, ct_x: Any) -> tuple:
        """The output is a constant here; the operands get their cotangent where the frontier
        variables are made (the operands are recorded when the site is evaluated, before any
        of its frontier variables is made)."""
        spec, operands = self.spec, []

        def handler(eqn, ops):
            operands[:] = [ops]
            return y

        wraps, start = {}, 0
        axes = self.basis.example_axes
        for i, v in enumerate(self.basis.variables):
            axis = None if axes is None else axes[i]
            size = _per_example.rows(v, axis)
            rows = slice(start, start + size)
            wraps[v] = lambda z, rows=rows, axis=axis: frontier_cotangent(spec, rows, axis)(z, operands[0], ct_x)
            start += size
        return handler, wraps
