"""The forward-basis strategy of a site: the `deferax_site_forward_basis` primitive computes
the output and its `n` unit-tangent directions (the Jacobian) in one call, during the
forward pass; `t_y = J t_x` (and so `ct_x = J^T ct_y`) follows without another expensive call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .. import _jaxpr, _record
from .._checks import _messages
from ._spec import FORWARD_BASIS, Spec, rebind_batched, split_fn_x
from ._tangents import flatten_tangent


def _basis_avals(spec: Spec) -> list:
    n = spec.n_tangents
    stacked = [
        _jaxpr.shaped(jax.ShapeDtypeStruct((*spec.sizes, n, *a.shape[len(spec.sizes) :]), a.dtype))
        for a in spec.t_avals()
    ]
    return [*spec.y_avals(), *stacked]


def _basis_impl(*operands, spec: Spec):
    """`(y, J)` over every batch level: the output and its `n` unit-tangent directions."""

    def one(fn_leaves, x_leaves):
        with _record.site(spec.name, "forward-basis"):  # (the recording names the strategy as `explain` does)
            y, jac = spec.fn(fn_leaves).output_and_jacobian(spec.x(x_leaves))
        return [*jtu.tree_leaves(y), *jtu.tree_leaves(jac)]

    return spec.over_levels(one, split_fn_x(spec.n_fn))(list(operands[: spec.n_fn]), list(operands[spec.n_fn :]))


def _basis_abstract(*avals, spec: Spec):
    return _jaxpr.with_varying(_basis_avals(spec), avals)


def _basis_batch(args, dims, spec: Spec):
    return rebind_batched(forward_basis_p, args, dims, spec)


def _basis_jvp(primals, tangents, spec: Spec):
    # Forward over forward-basis (`jax.hessian`): JAX differentiates the forward-mode
    # implementations themselves, which must then be JAX-traceable; a host site's are not.
    if spec.static.on_host:
        raise TypeError(_messages.second_order(spec.static.title))
    tangents = [
        _jaxpr.instantiate(t, jax.typeof(p)) if jnp.issubdtype(jax.typeof(p).dtype, jnp.inexact) else t
        for p, t in zip(primals, tangents, strict=True)
    ]
    return jax.jvp(lambda *ops: _basis_impl(*ops, spec=spec), tuple(primals), tuple(tangents))


forward_basis_p = _jaxpr.define_primitive(
    FORWARD_BASIS, impl=_basis_impl, abstract_eval=_basis_abstract, jvp=_basis_jvp, batch=_basis_batch
)


def _contract(jac_leaves, d_tangents) -> list:
    """`t_y = J t_x` for one example, with `J` stacked along the unit tangents and `t_x`
    the tangents of the differentiable leaves of `x` (their order is that of the units)."""
    flat = flatten_tangent(d_tangents, d_tangents)
    return [
        np.zeros(j.shape[1:], jax.dtypes.float0)
        if j.dtype == jax.dtypes.float0
        else jnp.tensordot(flat.astype(j.dtype), j, axes=1)
        for j in jac_leaves
    ]


def forward_basis_jvp(spec: Spec, fn_leaves, x_leaves, x_tangents):
    """The JVP rule of a site on the forward-basis strategy: `y` and `J` in one call, `t_y = J t_x`."""
    outs = forward_basis_p.bind(*fn_leaves, *x_leaves, spec=spec)
    n_y = len(spec.y_structs)
    y, jac = outs[:n_y], outs[n_y:]
    ts = [_jaxpr.instantiate(t, jax.typeof(x)) for x, t, d in zip(x_leaves, x_tangents, spec.diff, strict=True) if d]

    def axes_of(level):
        d_axes = [a for a, d in zip(level[spec.n_fn : spec.n_fn + spec.n_x], spec.diff, strict=True) if d]
        return ([0] * n_y, d_axes)

    return y, spec.over_levels(_contract, axes_of)(list(jac), ts)
