"""Forward mode of an `ExpensiveFn`: its `jvp` and `jvp_batch`, and the Jacobian from `n`
unit tangents (the forward-basis strategy).

`jvp(x, t_x) -> (y, t_y)` and `jvp_batch(x, t_xs) -> (y, t_ys)` (`t_xs` stacks `k`
tangents on a leading axis) compute the primal with the tangents, as a tangent solve that
shares the forward's factorisation does. `n` counts the real numbers of the
differentiable leaves of `x` (a complex number counts as two).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._checks import _checks, _messages
from .._implementation._abstract import AbstractExpensiveFn, AbstractImplementation
from .._misc import stacked, zero_like
from .._plan import _cost

# The most tangents the forward-basis strategy takes by default, when the function also has
# a reverse-mode implementation (`bwd` or `fused`) and its costs are not known (a `cost=`
# hint or timings of earlier calls decide instead); `ExpensiveFn(max_tangents=...)` sets it.
DEFAULT_MAX_TANGENTS = 8

STRATEGIES = ("standard", "forward-basis")


def n_inputs(x: Any) -> int:
    """The real numbers of the differentiable leaves of `x` (complex counts twice)."""
    total = 0
    for leaf in jtu.tree_leaves(x):
        dtype = jnp.result_type(leaf)
        if jnp.issubdtype(dtype, jnp.inexact):
            size = int(np.prod(jnp.shape(leaf), dtype=int))
            total += 2 * size if jnp.issubdtype(dtype, jnp.complexfloating) else size
    return total


def unit_tangents(x: Any) -> Any:
    """The `n` unit tangents of `x`, stacked on a leading axis: for each real number of each
    differentiable leaf, a one there (a one, then `1j`, for a complex entry) and zeros
    elsewhere; integer leaves get `float0` zeros."""
    n = n_inputs(x)
    out, offset = [], 0
    for leaf in jtu.tree_leaves(x):
        dtype, shape = jnp.result_type(leaf), jnp.shape(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            out.append(np.zeros((n, *shape), jax.dtypes.float0))
            continue
        size = int(np.prod(shape, dtype=int))
        eye = jnp.eye(n, size, k=-offset, dtype=dtype)  # rows offset..offset+size-1 hold the identity
        if jnp.issubdtype(dtype, jnp.complexfloating):
            eye = eye + 1j * jnp.eye(n, size, k=-(offset + size), dtype=dtype)
            offset += 2 * size
        else:
            offset += size
        out.append(jnp.reshape(eye, (n, *shape)))
    return jtu.tree_unflatten(jtu.tree_structure(x), out)


def flatten_tangent(t_x: Any, x: Any) -> jax.Array:
    """A tangent of `x` as the real vector of length `n` that `unit_tangents` indexes."""
    parts = []
    for t, leaf in zip(jtu.tree_leaves(t_x), jtu.tree_leaves(x), strict=True):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            continue
        flat = jnp.ravel(t)
        parts += [jnp.real(flat), jnp.imag(flat)] if jnp.iscomplexobj(flat) else [flat]
    if not parts:
        return jnp.zeros((0,))
    dtype = jnp.result_type(*[jnp.real(p) for p in parts])
    return jnp.concatenate([p.astype(dtype) for p in parts])


def tangent_struct(y_struct: Any) -> Any:
    """The structure of a tangent of `y`: `float0` for integer leaves (JAX's convention)."""
    return jtu.tree_map(
        lambda s: s if jnp.issubdtype(s.dtype, jnp.inexact) else jax.ShapeDtypeStruct(s.shape, jax.dtypes.float0),
        y_struct,
    )


def _jvp(fn: AbstractExpensiveFn, x: Any, t_x: Any, y_struct: Any) -> tuple[Any, Any]:
    """`jvp(x, t_x)`, checked against the output structure."""
    y, t_y = _checks.checked_pair(fn.title, "jvp", fn.invoke("jvp", x, t_x))
    fn.check_result("jvp", "an output `y`", y, y_struct, "the output structure")
    fn.check_result("jvp", "a tangent `t_y`", t_y, tangent_struct(y_struct), "the output structure")
    return y, t_y


def tangent(fn: AbstractExpensiveFn, x: Any, t_x: Any) -> Any:
    """`t_y = J t_x`: `jvp(x, t_x)[1]`, or `jvp_batch` on one tangent."""
    if fn.jvp is not None:
        return _jvp(fn, x, t_x, fn.out_struct(x))[1]
    _, t_ys = tangents(fn, x, jtu.tree_map(lambda t: t[None], t_x))
    return jtu.tree_map(lambda t: t[0], t_ys)


def output_once(one: Any, stacked_: Any) -> Any:
    """`jax.vmap(one)` over the leading axis of `stacked`, where `one(s) -> (y, out)`, with
    `y` computed once (not batched); None when `vmap` cannot see that `y` does not depend
    on `s` (a host callback computes it, say). Only traces to find out."""
    separable = jax.vmap(one, out_axes=(None, 0))
    try:
        jax.eval_shape(separable, stacked_)  # traces only: nothing expensive runs
    except ValueError as error:
        if "out_axes" not in str(error):
            raise
        return None
    return separable


def output_each(one: Any, stacked_: Any) -> tuple[Any, Any]:
    """`jax.vmap(one)` over the leading axis of `stacked`, `y` computed for each element (the
    first one kept): correct, but the primal runs once per element."""
    y, outs = jax.vmap(one)(stacked_)
    return jtu.tree_map(lambda a: a[0], y), outs


def tangents(fn: AbstractExpensiveFn, x: Any, t_xs: Any) -> tuple[Any, Any]:
    """`(y, t_ys)` for `k` tangents stacked on a leading axis: `jvp_batch` once, or `jvp`
    batched with `jax.vmap` over the tangent (the primal computed once where `vmap` can
    see that it does not depend on the tangent)."""
    y_struct = fn.out_struct(x)
    k = jtu.tree_leaves(t_xs)[0].shape[0]
    if fn.jvp_batch is not None:
        y, t_ys = _checks.checked_pair(fn.title, "jvp_batch", fn.invoke("jvp_batch", x, t_xs))
        fn.check_result("jvp_batch", "an output `y`", y, y_struct, "the output structure")
        against = "the output with a leading axis of one tangent each"
        fn.check_result("jvp_batch", "a batch of tangents", t_ys, stacked(tangent_struct(y_struct), k), against)
        return y, t_ys

    def one(t):
        return _jvp(fn, x, t, y_struct)

    separable = output_once(one, t_xs)
    if separable is not None:
        return separable(t_xs)
    warnings.warn(_messages.NOT_SEPARABLE_JVP.format(call=fn.title, k=k), stacklevel=2)
    return output_each(one, t_xs)


def output_and_jacobian(fn: AbstractExpensiveFn, x: Any) -> tuple[Any, Any]:
    """`(y, J)`: the output and its tangents along the `n` unit tangents of `x` (stacked on
    a leading axis), in one batched call."""
    return tangents(fn, x, unit_tangents(x))


def unchecked_output(fn: AbstractExpensiveFn, x: Any) -> tuple[str, Any]:
    """`(impl, y)`: `y` from the forward-mode implementation `impl` alone (a wasted zero
    tangent), unchecked."""
    zero = jtu.tree_map(zero_like, x)
    if fn.jvp is not None:
        return "jvp", _checks.checked_pair(fn.title, "jvp", fn.invoke("jvp", x, zero))[0]
    zeros = jtu.tree_map(lambda t: t[None], zero)
    return "jvp_batch", _checks.checked_pair(fn.title, "jvp_batch", fn.invoke("jvp_batch", x, zeros))[0]


def output(fn: AbstractExpensiveFn, x: Any) -> Any:
    """`y` from the forward-mode implementations alone (a wasted zero tangent), checked
    against the declared output structure (without one, the structure *is* theirs)."""
    impl, y = unchecked_output(fn, x)
    if fn.out is not None:
        fn.check_result(impl, "an output `y`", y, fn.out_struct(x), "the output structure")
    return y


def estimates(fn: AbstractExpensiveFn, shapes: tuple, n: int) -> _cost.Estimates | None:
    """The estimates of the standard schedule and the forward-basis strategy for `fn` on an
    input of leaves of `shapes` with `n` numbers (`_cost.forward_basis`); None without `jvp`
    or `jvp_batch`. One job computes the output and all `n` tangents, unless a host
    function's `jvp` runs once per tangent."""
    if fn.jvp is None and fn.jvp_batch is None:
        return None
    batch = fn.jvp_batch
    one_job = not isinstance(batch, AbstractImplementation) or batch.batch_in_one_job
    fused_only = fn.fwd is None and fn.bwd is None and fn.adjoint is None
    workers = batch.jobs_at_once if isinstance(batch, AbstractImplementation) and not one_job else 1
    return _cost.forward_basis(fn.timings_key, shapes, fn.cost, n, one_job, fused_only, workers)


def by_estimate(fn: AbstractExpensiveFn, estimates: _cost.Estimates | None) -> bool:
    """Whether the estimates choose between the standard schedule and the forward-basis
    strategy: both are possible (`jvp` or `jvp_batch`, and `bwd` or `fused`), the user set
    neither `prefer` nor `max_tangents`, and the costs are known (a `cost=` hint or timings
    of earlier calls, not the equal-cost defaults)."""
    return (
        estimates is not None
        and estimates.source != "defaults"
        and fn.has_vjp
        and fn.prefer is None
        and fn.max_tangents is None
    )


def strategy(fn: AbstractExpensiveFn, n: int, estimates: _cost.Estimates | None = None) -> str:
    """The reverse-mode strategy of a site whose input has `n` numbers, given its
    `estimates` (what `estimates` returned):

    - `"forward-basis"`: the primal and `n` tangents in one batched call during the forward
      pass (one stage), `ct_x = J^T ct_y` after; possible when the function has `jvp` or
      `jvp_batch`. Chosen when the function has nothing else for reverse mode (within
      `max_tangents` if given); else when `n <= max_tangents` if given; else, where costs
      are known (`by_estimate`), when its estimate is below the standard schedule's; else,
      with the equal-cost defaults, by the fixed rule `n <= DEFAULT_MAX_TANGENTS` (fewest
      sequential expensive stages, then fewest expensive calls);
    - `"standard"`: `fwd` on the forward pass, `bwd` on the backward pass (two stages).

    `ExpensiveFn(prefer=...)` forces either.
    """
    has_jvp = fn.jvp is not None or fn.jvp_batch is not None
    has_vjp = fn.has_vjp
    if fn.prefer in STRATEGIES:
        return fn.prefer
    if not has_jvp:
        return "standard"
    limit = fn.max_tangents if fn.max_tangents is not None else DEFAULT_MAX_TANGENTS
    if not has_vjp:
        if fn.max_tangents is None or n <= limit:
            return "forward-basis"
        return "standard"  # reverse mode then fails with TOO_MANY_TANGENTS, forward mode works
    if by_estimate(fn, estimates):
        assert estimates is not None and estimates.forward_basis is not None  # (`_cost.forward_basis`'s)
        return "forward-basis" if estimates.forward_basis < estimates.standard else "standard"
    return "forward-basis" if n <= limit else "standard"
