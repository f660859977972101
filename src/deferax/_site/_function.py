"""What a site calls on the function it holds (`AbstractSiteFunction`): the interface that
`ExpensiveFn`, in the layer above, implements. A site's `Spec` holds the function typed as
this, so what the rules, the analysis, the schedules and the stages read of it is declared
here and checked by pyright, and the site primitives never import `ExpensiveFn`."""

import abc
from typing import Any

import equinox as eqx
from equinox import AbstractVar
from jaxtyping import PyTree

from .._plan._cost import Estimates


class AbstractSiteFunction(eqx.Module):
    """An expensive function as its sites see it: the implementations it was given (each
    None where not given), its switches, what is derived from them, and the calls that run it."""

    # the implementations given (a callable, a host implementation, or None)
    fwd: AbstractVar[Any]
    bwd: AbstractVar[Any]
    fused: AbstractVar[Any]
    fused_batch: AbstractVar[Any]
    jvp: AbstractVar[Any]
    jvp_batch: AbstractVar[Any]
    adjoint: AbstractVar[Any]
    combine: AbstractVar[Any]
    # the switches
    name: AbstractVar[str | None]
    out: AbstractVar[Any]
    max_basis: AbstractVar[int | None]
    max_tangents: AbstractVar[int | None]
    prefer: AbstractVar[str | None]
    thread_safe: AbstractVar[bool]
    cost: AbstractVar[Any]

    # ------------------------------------------------------------------ derived from them

    @property
    @abc.abstractmethod
    def title(self) -> str:
        """How messages name it."""

    @property
    @abc.abstractmethod
    def timings_key(self) -> Any:
        """The identity under which its calls' timings are kept (None: not timed)."""

    @property
    @abc.abstractmethod
    def autodiff(self) -> bool:
        """Whether JAX differentiates `fwd` itself."""

    @property
    @abc.abstractmethod
    def on_host(self) -> bool:
        """Whether its implementations run on the host."""

    @property
    @abc.abstractmethod
    def higher_order(self) -> Any:
        """A JAX function of `x` computing `y` that JAX differentiates to every order, for a
        site on the host whose derivative is differentiated; None where it has none."""

    @property
    @abc.abstractmethod
    def has_vjp(self) -> bool:
        """Whether a hand-written reverse-mode derivative is given."""

    # ------------------------------------------------------------------ the calls

    @abc.abstractmethod
    def invoke(self, impl: str, *args: Any) -> Any:
        """Call the implementation `impl` (checked and recorded)."""

    @abc.abstractmethod
    def out_struct(self, x: PyTree) -> PyTree:
        """The output's structure for an input of structure `x`."""

    @abc.abstractmethod
    def check_out(self, x: PyTree, error: Exception) -> None:
        """Raise the error that says why the output's structure could not be found."""

    @abc.abstractmethod
    def primal(self, x: PyTree) -> PyTree:
        """`y`, by `fwd` (or what stands for it)."""

    @abc.abstractmethod
    def cotangent(self, x: PyTree, y: PyTree, ct_y: PyTree) -> PyTree:
        """`ct_x`, by `bwd` (or what stands for it)."""

    @abc.abstractmethod
    def combined(self, x: PyTree, y: PyTree, partial: PyTree) -> PyTree:
        """`ct_x` from `adjoint`'s `partial`, by `combine`."""

    @abc.abstractmethod
    def derived_fused(self) -> Any:
        """The `fused` made from `fwd` and `adjoint` (or a `y`-free `bwd`)."""

    @abc.abstractmethod
    def run_fused(self, x: PyTree, ct_y: PyTree) -> tuple[PyTree, PyTree]:
        """`(y, ct_x)` in one call."""

    @abc.abstractmethod
    def run_fused_batch(self, x: PyTree, cts: PyTree) -> tuple[PyTree, PyTree]:
        """`(y, ct_xs)` for cotangents stacked on a leading axis, in one call."""

    @abc.abstractmethod
    def tangent(self, x: PyTree, t_x: PyTree) -> PyTree:
        """`t_y`."""

    @abc.abstractmethod
    def tangents(self, x: PyTree, t_xs: PyTree) -> tuple[PyTree, PyTree]:
        """`(y, t_ys)` for tangents stacked on a leading axis."""

    @abc.abstractmethod
    def output_and_jacobian(self, x: PyTree) -> tuple[PyTree, PyTree]:
        """`y` and its Jacobian, one call (the forward-basis strategy)."""

    @abc.abstractmethod
    def forward_basis_estimates(self, shapes: tuple, n: int) -> Estimates | None:
        """The estimates of its standard and forward-basis strategies for `n` tangents."""

    @abc.abstractmethod
    def by_estimate(self, estimates: Estimates | None) -> bool:
        """Whether its strategy is chosen by `estimates` (no preference given)."""

    @abc.abstractmethod
    def strategy(self, n: int, estimates: Estimates | None) -> str:
        """`"standard"` or `"forward-basis"` for `n` tangents."""
