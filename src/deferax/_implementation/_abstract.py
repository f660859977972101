"""The interface of the implementations deferax makes, which `ExpensiveFn` and the stages
call by name.

- `AbstractImplementation`: a callable that deferax made to stand for an implementation
  (a [`deferax.Fused`][], a `fused` derived from `fwd` and `adjoint`, a host function's JAX
  side). It records its own runs where they happen (on its threads, or as host jobs), so
  the `ExpensiveFn` that calls it does not record around it.
- `AbstractFused`: one of them that runs a forward and an adjoint at the same time.
"""

from __future__ import annotations

import abc
import functools as ft
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

import equinox as eqx
import jax
import jax.tree_util as jtu
from jaxtyping import PyTree

from .. import _jaxpr
from .._concurrency._placement import halves_run
from .._concurrency._threads import NEEDS_Y, concurrently

if TYPE_CHECKING:
    Implementation: TypeAlias = Callable[..., Any]
    """A user's implementation: a callable (a function, or an `eqx.Module` with `__call__`)."""
else:  # (`Any` to the run-time checks: a wrong value must reach the checks whose messages name the function)
    Implementation = Any


class AbstractImplementation(eqx.Module):
    """A callable deferax made to stand for an implementation; it records its own runs."""

    # Whether it runs on the host through a callback that takes a batch from `vmap` whole
    # (a `dx.host` function), so that the stages hand it whole batches.
    runs_on_host: eqx.AbstractClassVar[bool]

    @abc.abstractmethod
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the implementation (each kind with its own arguments)."""

    @property
    @abc.abstractmethod
    def batch_in_one_job(self) -> bool:
        """Whether a batch of cotangents (the deferred-basis schedule), or of tangents (the
        forward-basis strategy, for a `jvp_batch`), runs as one job with the forward (a
        `fused_batch` or `jvp_batch` of its own), rather than one job each."""

    @property
    @abc.abstractmethod
    def jobs_at_once(self) -> int:
        """How many of its separate jobs run at the same time where it runs (read for the
        estimates when `batch_in_one_job` is false)."""

    @property
    def timings_key(self) -> Any:
        """The identity under which the timings of its jobs are kept (`_cost.observe`): None
        when they are not timed (only host functions are)."""
        return None

    @property
    def batch_jobs_are_fused(self) -> bool:
        """When a batch of cotangents is not one job: whether its jobs are `fused` once per
        cotangent (each computing the forward too), rather than one forward job and one
        adjoint job per cotangent (read for the estimates)."""
        return False


class AbstractFused(AbstractImplementation):
    """`fused(x, ct_y) -> (y, ct_x)` built from `fwd(x) -> y` and `adjoint(x, ct_y)`, with
    `ct_x = combine(x, y, adjoint(x, ct_y))` (the adjoint's result itself without
    `combine`): the two halves run on two threads, `combine` after both."""

    fwd: eqx.AbstractVar[Callable[..., Any]]
    adjoint: eqx.AbstractVar[Callable[..., Any]]
    combine: eqx.AbstractVar[Callable[..., Any] | None]
    # Whether each half is compiled once per function and input structure (`dx.fuse`, as
    # `jax.jit` would), or called as the standard schedule calls it (see `concurrently`).
    compiled: eqx.AbstractClassVar[bool]
    runs_on_host: ClassVar[bool] = False  # pyright: ignore[reportIncompatibleVariableOverride]  (an eqx.AbstractClassVar: pyright#4965)

    @property
    def batch_in_one_job(self) -> bool:
        return True  # (the forward once, the adjoint batched: both halves at once)

    @property
    def jobs_at_once(self) -> int:
        # its two halves, on two threads or two devices; one after the other in the program
        return 1 if halves_run(eager=_jaxpr.is_eager()).where == "program" else 2

    @abc.abstractmethod
    def half_names(self) -> tuple[str, str]:
        """The names the two halves are recorded under."""

    def __call__(self, x: PyTree, ct_y: PyTree, check: Callable[[], str | None] | None = None) -> tuple[PyTree, PyTree]:
        """`(y, ct_x)`. `check`: called where the adjoint half runs, before it; where it gives a
        reason (its `bwd` reads `y`), the adjoint half does not run and `ct_x` is `NEEDS_Y`
        (the caller runs it after the forward, on its `y`)."""
        y, partial = concurrently(
            self.fwd, self.adjoint, x, ct_y, names=self.half_names(), compiled=self.compiled, check=check
        )
        if partial is NEEDS_Y:
            return y, partial
        return y, (partial if self.combine is None else self.combine(x, y, partial))

    def under_vmap(self, x: PyTree, ct_y: PyTree, x_axes: list) -> tuple[PyTree, PyTree]:
        """The call under `jax.vmap` levels (outermost first; `x_axes` gives each level's
        `in_axes` for `x`, `ct_y` is batched at 0 at every level): the whole batch's
        forward and the whole batch's adjoint, on two threads."""
        fwd = _Vmapped(self.fwd, tuple(_frozen((axes,)) for axes in x_axes))
        adjoint = _Vmapped(self.adjoint, tuple(_frozen((axes, 0)) for axes in x_axes))
        y, partial = concurrently(fwd, adjoint, x, ct_y, names=self.half_names(), compiled=self.compiled)
        if self.combine is None:
            return y, partial
        return y, _Vmapped(self.combine, tuple(_frozen((axes, 0, 0)) for axes in x_axes))(x, y, partial)

    def batched(self, x: PyTree, cts: PyTree) -> tuple[PyTree, PyTree]:
        """`y` once and one `ct_x` per cotangent (leading axis of `cts`): the forward runs
        once, concurrently with the adjoint batched by `jax.vmap` over the cotangents."""
        names = self.half_names()
        y, partials = concurrently(self.fwd, self.adjoint, x, cts, names=names, batched=True, compiled=self.compiled)
        if self.combine is None:
            return y, partials
        return y, jax.vmap(ft.partial(self.combine, x, y))(partials)


def _frozen(axes: PyTree) -> tuple:
    leaves, treedef = jtu.tree_flatten(axes, is_leaf=lambda a: a is None)
    return treedef, tuple(leaves)


class _Vmapped(eqx.Module):
    """`f` under `jax.vmap` levels, as a Module that compares by value (so that the
    compiled halves of `AbstractFused.under_vmap` are reused from call to call)."""

    f: Callable[..., Any]
    levels: tuple = eqx.field(static=True)  # per level, `in_axes` as (treedef, leaves)

    def __call__(self, *args):
        g = self.f
        for treedef, leaves in reversed(self.levels):
            g = jax.vmap(g, in_axes=jtu.tree_unflatten(treedef, list(leaves)))
        return g(*args)
