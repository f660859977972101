"""`fuse`: a `fused` implementation that runs a forward and an adjoint at the same time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from ._abstract import AbstractFused


class Fused(AbstractFused):
    """`fused(x, ct_y) -> (y, ct_x)` built from `fwd(x) -> y` and `adjoint(x, ct_y)`, with
    `ct_x = combine(x, y, adjoint(x, ct_y))` (the adjoint's result itself without `combine`).

    Made by [`deferax.fuse`][]. The two halves are compiled separately with `jax.jit` and
    run on two threads, so that on a CPU they use two cores (XLA:CPU runs independent
    work inside one program one piece after the other); `combine`, the cheap step that
    needs `y`, runs after both.
    """

    fwd: Callable[..., Any]
    adjoint: Callable[..., Any]
    combine: Callable[..., Any] | None = None
    compiled: ClassVar[bool] = True  # pyright: ignore[reportIncompatibleVariableOverride]  (an eqx.AbstractClassVar: pyright#4965)

    def half_names(self) -> tuple[str, str]:
        return "fwd", "adjoint"


def fuse(fwd: Callable[..., Any], adjoint: Callable[..., Any], combine: Callable[..., Any] | None = None) -> Fused:
    """Make a `fused` implementation that runs `fwd` and `adjoint` concurrently.

    Use it when the adjoint does not need the primal output (a linear solve with the
    cotangent as right-hand side, a time-stepper run backwards from the cotangent): then the
    deferred schedule can run both at once.

    **Arguments:**

    - `fwd`: `fwd(x) -> y`, JAX-traceable.
    - `adjoint`: `adjoint(x, ct_y) -> ct_x` (or the part of it that `combine` finishes),
      JAX-traceable; it must not need `y`.
    - `combine`: optional `combine(x, y, partial) -> ct_x`, the cheap step that needs `y`
      (for a PDE, `ct_eps = Re(E_fwd * E_adj)`), run after both halves; the same meaning
      as in [`deferax.host`][] and [`deferax.ExpensiveFn`][].

    **Returns:**

    A [`deferax.Fused`][] to pass as `ExpensiveFn(fused=...)`. Called on concrete arrays
    (the deferred schedule outside `jit`) it submits the two compiled halves to a thread
    pool; under `jit` or `vmap` it does the same from inside one `jax.pure_callback` (a
    batch under `vmap` is run one element after another). Not differentiable itself.

    !!! Example

        ```python
        sim = dx.ExpensiveFn(
            fwd=simulate,
            bwd=lambda x, y, ct: adjoint(x, ct),
            fused=dx.fuse(simulate, adjoint),
        )
        ```
    """
    return Fused(fwd, adjoint, combine)
