"""`trainable`: the filter that keeps an `ExpensiveFn`'s configuration arrays out of training."""

from __future__ import annotations

import equinox as eqx
import jax.tree_util as jtu
from jaxtyping import PyTree

from ._expensive import ExpensiveFn


def trainable(tree: PyTree) -> PyTree[bool]:
    """A filter spec for `eqx.partition`: `True` for the floating-point arrays of `tree` that
    a model learns, `False` for everything else, including every array held by an
    [`deferax.ExpensiveFn`][] (its implementations' configuration: a source, a grid,
    material constants).

    Those arrays get a zero gradient, but an optimizer still moves them: weight decay
    (`optax.adamw`) shrinks any parameter it is given. Keep them out of the optimizer:

    !!! Example

        ```python
        params, static = eqx.partition(model, dx.trainable(model))
        opt_state = optimizer.init(params)
        # in the step: model = eqx.combine(params, static); differentiate w.r.t. params
        ```
    """
    return jtu.tree_map(
        lambda node: (
            jtu.tree_map(lambda _: False, node) if isinstance(node, ExpensiveFn) else eqx.is_inexact_array(node)
        ),
        tree,
        is_leaf=lambda node: isinstance(node, ExpensiveFn),
    )
