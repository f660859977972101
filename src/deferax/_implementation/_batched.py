"""An implementation run over `k` tangents or cotangents stacked on a leading axis with
`jax.vmap`: the primal computed once where `vmap` can see that it does not depend on them
(`output_once`), else once each (`output_each`, with a warning: `NOT_SEPARABLE`,
`NOT_SEPARABLE_JVP`). `ExpensiveFn.tangents` and `ExpensiveFn.run_fused_batch` use them."""

from __future__ import annotations

from typing import Any

import jax
import jax.tree_util as jtu

NOT_SEPARABLE_JVP = """{call}: `jvp` could not be batched over the tangent with the primal computed once (its output \
`y`
depends on the batch under `jax.vmap`, as a host callback's does), so the primal runs {k} times, once per tangent.
Give `jvp_batch(x, t_xs) -> (y, t_ys)` to compute it once."""

NOT_SEPARABLE = """{call}: `fused` could not be batched over the cotangent with the primal computed once (its output \
`y`
depends on the batch under `jax.vmap`, as a host callback's does), so the primal runs {k} times, once per basis
cotangent. Give `fused_batch(x, cts) -> (y, ct_xs)` to compute it once."""


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
