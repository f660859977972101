"""`ExpensiveFn`: an expensive function with hand-written derivatives, as an Equinox module."""

from __future__ import annotations

import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from .. import _record, _site, _typed
from .._checks import _checks, _messages
from .._jaxpr import is_concrete, stacked, structs, zero_like, zeros
from .._plan import _cost
from .._plan._cost import Cost
from .._typed import annotated, checked_function, untraceable
from . import _strategy
from ._abstract import AbstractFused, AbstractImplementation, Implementation
from ._batched import NOT_SEPARABLE, NOT_SEPARABLE_JVP, output_each, output_once
from ._derived import AdjointHalf, CombineStep, DerivedFused, PrimalHalf

_NO_PRIMAL = """{call}: nothing can compute the output. Give `fwd(x) -> y`, `fused(x, ct_y) -> (y, ct_x)` or `jvp(x, \
t_x) -> (y, t_y)`:

    dx.ExpensiveFn(fwd=simulate, bwd=adjoint)   # or
    dx.ExpensiveFn(fused=simulate_and_adjoint, out=jax.ShapeDtypeStruct((n,), jnp.float64))"""

_NO_OUT = """{call}: the output shape is unknown. With nothing to infer it from ({why}), declare it with `out=`, a \
pytree of
`jax.ShapeDtypeStruct` (or a function from the input's structure to one):

    {example}"""

_TRACE_FAILED = """{call}: raised by `{impl}`, traced (with `jax.eval_shape`) on the input {x} to infer the \
output's shape. Check that its configuration (the sizes of the arrays it holds) fits this input."""

_BAD_COST_HINT = """{call}: `cost` must be a `dx.Cost` or None, but got {found!r}. Give what the implementations cost:

    dx.ExpensiveFn(fwd=..., bwd=..., fused=..., cost=dx.Cost(fwd=0.8, bwd=0.9))"""

_BAD_OUT = "{call}: `out` must be a pytree of `jax.ShapeDtypeStruct` or a callable returning one, but got {found!r}."


class ExpensiveFn(_site.AbstractSiteFunction):
    """An expensive function with hand-written derivatives that behaves as a JAX function.

    Give any of three implementations; each is a callable (a function, or an `eqx.Module`
    whose array fields carry non-differentiable configuration such as a source or a grid):

    - `fwd(x) -> y`: the primal computation (a simulation, a solve, a remote job);
    - `bwd(x, y, ct_y) -> ct_x`: the reverse-mode derivative (typically an adjoint solve),
      given the input, the output and the cotangent of the output;
    - `fused(x, ct_y) -> (y, ct_x)`: both at once. The deferred schedule of
      [`deferax.filter_value_and_grad`][] calls it instead of `fwd` then `bwd`, so that the
      forward and adjoint solves can run together;
    - `jvp(x, t_x) -> (y, t_y)`: the forward-mode derivative (a tangent solve), with the
      primal; and `jvp_batch(x, t_xs) -> (y, t_ys)` for `k` tangents stacked on a leading
      axis (a solve that factorises once). They serve `jax.jvp`, `jax.jacfwd`,
      `jax.linearize`, and reverse mode on the *forward-basis* strategy: the primal and the
      `n` unit tangents of the input in one call, `ct_x = J^T ct_y` (see
      [Forward and reverse mode](../forward-reverse.md)).

    `x` and `y` are pytrees of arrays, real or complex.

    Calling `f(x)` gives an ordinary differentiable JAX function on the *standard*
    schedule: the forward pass runs `fwd`; the backward pass runs `bwd` with `x` and `y`
    kept as residuals, so `bwd` never causes the primal to be recomputed. Missing
    implementations are derived:

    | given | primal | reverse mode |
    | --- | --- | --- |
    | `fwd` only | `fwd` | JAX autodiff of `fwd` (forward mode works too) |
    | `fwd`, `bwd` | `fwd` | `bwd` (deferred: `fwd` and `bwd` together when the jaxpr of `bwd` shows that it does \
not read `y` and calls nothing deferax cannot read, such as a host callback) |
    | `fwd`, `adjoint` (`combine`) | `fwd` | `combine(x, y, adjoint(x, ct))` (deferred: `fwd` and `adjoint` together) |
    | `fused` only | `fused(x, 0)[0]`: runs a wasted adjoint with a zero cotangent | `fused(x, ct)[1]`: recomputes \
the primal |
    | `fwd`, `fused` | `fwd` | `fused(x, ct)[1]`: recomputes the primal |
    | `fused`, `bwd` | `fused(x, 0)[0]` | `bwd` |
    | `jvp` or `jvp_batch` (with any of the above) | `fwd`, else `jvp(x, 0)[0]` | forward-basis when `n <= \
max_tangents` if set, else when estimated faster (costs known) or `n <= 8`; else as above |

    **Arguments:**

    - `fwd`, `bwd`, `fused`: the implementations, each optional; `fwd` or `fused` is required.
    - `name`: shown in every error and in [`deferax.explain`][]; defaults to the
      implementation's `__name__`.
    - `out`: the output's structure, a pytree of `jax.ShapeDtypeStruct`, or a function from
      the input's structure (a pytree of `jax.ShapeDtypeStruct`) to it. Optional when `fwd`
      (or, without one, `jvp` or `jvp_batch`) is JAX-traceable: it is then inferred with
      `jax.eval_shape`.
    - `fused_batch`: optional `fused_batch(x, cts) -> (y, ct_xs)`, where `cts` stacks `k`
      cotangents on a leading axis and `ct_xs` stacks their input cotangents: the primal
      once, `k` adjoints. Used by the `"deferred-basis"` schedule; without it, `fused` is
      batched with `jax.vmap` over the cotangent (a [`deferax.fuse`][] implementation
      runs the forward once and the batched adjoint concurrently). Give it for
      implementations that cannot be `vmap`ped that way (host callbacks, remote jobs).
    - `max_basis`: this function's limit on `k` for the `"deferred-basis"` schedule; it
      takes precedence over the `max_basis` of [`deferax.filter_value_and_grad`][].
    - `jvp`, `jvp_batch`: the forward-mode implementations, each optional.
    - `adjoint`, `combine`: the reverse-mode derivative split as in [`deferax.host`][]:
      `adjoint(x, ct_y) -> partial` does not get `y`, `combine(x, y, partial) -> ct_x` is
      the cheap step that does (default: `partial` is `ct_x`). Instead of `bwd`. With
      `fwd`, the deferred schedules run `fwd` and `adjoint` at the same time, as
      [`deferax.fuse`][] does: giving `adjoint` declares that it needs nothing `fwd`
      computes, `y` nor state kept between the calls (a factorisation in a Python object).
      They do so with a `bwd` only when its jaxpr shows all it does: it does not read `y`
      (nor pass it to `jax.debug.callback`), and it calls no host callback or other
      function whose body deferax cannot read, which might reuse what `fwd` stored.
    - `max_tangents`: the most input numbers `n` for which reverse mode uses the
      forward-basis strategy. Default: when `bwd` or `fused` is given too, chosen by the
      estimates where the costs are known (a `cost=` hint or timings of earlier calls),
      else 8; no limit for a function with forward-mode implementations only.
    - `thread_safe`: `False` for implementations that must not run twice at once (one
      shared workspace): deferax then runs no two calls of it, nor of any other such
      function, at the same time, not even the forward and the adjoint of one deferred
      call. See also [`deferax.set_concurrency`][].
    - `cost`: a [`deferax.Cost`][], what the implementations cost, from which the schedule
      is chosen when no `max_basis` is set; default: timings of earlier calls, else equal
      costs (see "How the schedule is chosen" in the docs).
    - `prefer`: `None` (the default rule: fewest sequential expensive stages, then fewest
      expensive calls), or force a strategy: `"standard"` (`fwd` then `bwd`; never
      deferred), `"forward-basis"` (the primal with `n` tangents; never deferred).

    Arrays held by the implementations (fields of an `eqx.Module` implementation) are
    constants to the derivative: their cotangent is zero.

    !!! Example

        ```python
        import deferax as dx
        import jax, jax.numpy as jnp

        f = dx.ExpensiveFn(
            fwd=jnp.sin,
            bwd=lambda x, y, ct: ct * jnp.cos(x),
            name="sin",
        )
        jax.value_and_grad(lambda x: f(x).sum())(jnp.arange(3.0))
        ```
    """

    fwd: Implementation | None = None
    bwd: Implementation | None = None
    fused: Implementation | None = None
    name: str | None = eqx.field(default=None, static=True)
    # A pytree of `jax.ShapeDtypeStruct`, or a function returning one: configuration, static
    # (as a leaf, `eqx.tree_deserialise_leaves` would read an array for it that was never saved).
    out: Any = eqx.field(default=None, static=True)
    fused_batch: Implementation | None = None
    max_basis: int | None = eqx.field(default=None, static=True)
    jvp: Implementation | None = None
    jvp_batch: Implementation | None = None
    adjoint: Implementation | None = None
    combine: Implementation | None = None
    max_tangents: int | None = eqx.field(default=None, static=True)
    prefer: str | None = eqx.field(default=None, static=True)
    thread_safe: bool = eqx.field(default=True, static=True)
    cost: Any = eqx.field(default=None, static=True)  # (a `Cost`; `Any` so that a wrong value reaches the check)

    def __post_init__(self):
        if self.name is None:
            object.__setattr__(self, "name", _checks.default_name(self._impls()))

    def __check_init__(self):
        call = self.title
        _checks.check_implementations(call, self._impls())
        if self.max_basis is not None and not _checks.is_count(self.max_basis):
            allowed = "a non-negative int (or None: the limit of `filter_value_and_grad`)"
            raise ValueError(_messages.BAD_MAX_BASIS.format(where=call, allowed=allowed, found=self.max_basis))
        _checks.check_adjoint_split(call, self.adjoint, self.bwd, combine=self.combine)
        if self.cost is not None and not isinstance(self.cost, Cost):
            raise TypeError(_BAD_COST_HINT.format(call=call, found=self.cost))
        if self.max_tangents is not None and not _checks.is_count(self.max_tangents):
            raise ValueError(
                f"{call}: `max_tangents` must be a non-negative int or None, but got {self.max_tangents!r}."
            )
        if self.prefer is not None and self.prefer not in _strategy.STRATEGIES:
            raise ValueError(f"{call}: `prefer` must be None, 'standard' or 'forward-basis', but got {self.prefer!r}.")
        if self.prefer == "forward-basis" and self.jvp is None and self.jvp_batch is None:
            raise TypeError(f"{call}: prefer={self.prefer!r} needs `jvp` or `jvp_batch`, which was not given.")
        if self.prefer == "standard" and not self.has_vjp:
            raise TypeError(f"{call}: prefer={self.prefer!r} needs `bwd` or `fused`, which was not given.")
        if self.fwd is None and self.fused is None and self.jvp is None and self.jvp_batch is None:
            raise TypeError(_NO_PRIMAL.format(call=call))
        if self.out is not None and not callable(self.out):
            leaves = jtu.tree_leaves(self.out)
            if not leaves or not all(isinstance(s, jax.ShapeDtypeStruct) for s in leaves):
                raise TypeError(_BAD_OUT.format(call=call, found=self.out))

    def _impls(self) -> dict[str, Any]:
        return {
            "fwd": self.fwd,
            "bwd": self.bwd,
            "fused": self.fused,
            "fused_batch": self.fused_batch,
            "jvp": self.jvp,
            "jvp_batch": self.jvp_batch,
            "adjoint": self.adjoint,
            "combine": self.combine,
        }

    @property
    def title(self) -> str:
        """How messages name the function: "`ExpensiveFn(name='fdtd')`"."""
        return _checks.title(self.name)

    @property
    def timings_key(self) -> Any:
        """The identity under which the timings of its calls are kept, with its input shapes
        (`_cost`): that of the host functions its jobs run, never its name (which another
        function may share); None when nothing of it is timed."""
        for impl in (self.fwd, self.fused, self.fused_batch, self.bwd, self.jvp, self.jvp_batch):
            key = impl.timings_key if isinstance(impl, AbstractImplementation) else None
            if key is not None:
                return key
        return None

    @property
    def autodiff(self) -> bool:
        """Whether JAX differentiates `fwd` itself: no other implementation is given."""
        impls = self._impls()
        return all(impls[impl] is None for impl in ("bwd", "fused", "jvp", "jvp_batch", "adjoint"))

    @property
    def on_host(self) -> bool:
        """Whether its implementations run on the host (made by `dx.host`): JAX cannot
        differentiate them, so it has no second derivative."""
        return any(isinstance(i, AbstractImplementation) and i.runs_on_host for i in self._impls().values())

    @property
    def higher_order(self) -> Any:
        """The formulation that its host implementations' derivatives are differentiated
        through (set by `dx.sparse_solve`: `_host.with_higher_order`); None for any other."""
        for impl in self._impls().values():
            host = getattr(impl, "host", None)
            if host is not None:
                return getattr(host, "higher_order", None)
        return None

    @property
    def has_vjp(self) -> bool:
        """Whether a hand-written reverse-mode derivative is given (`bwd`, `adjoint` or `fused`)."""
        return self.bwd is not None or self.adjoint is not None or self.fused is not None

    # ------------------------------------------------------------------ shapes and checks

    def out_struct(self, x: PyTree) -> PyTree[jax.ShapeDtypeStruct]:
        """The structure of `self(x)`: declared by `out`, or inferred from `fwd` (or, without
        one, from what `jvp` or `jvp_batch` returns)."""
        if self.out is not None:
            out = self.out(structs(x)) if callable(self.out) else self.out
            if callable(self.out) and not all(isinstance(s, jax.ShapeDtypeStruct) for s in jtu.tree_leaves(out)):
                raise TypeError(_BAD_OUT.format(call=self.title, found=out))
            _checks.check_declared_width(self.title, "`out=`", out)
            return out
        impl = next((impl for impl in ("fwd", "jvp", "jvp_batch") if self._impls()[impl] is not None), None)
        if impl is None:
            raise TypeError(
                self._no_out("no `fwd` or `jvp` was given, and `fused` takes a cotangent shaped like the output")
            )
        if impl != "fwd":
            fwd = lambda x_: self._forward_mode_output(x_)[1]  # noqa: E731
        elif _typed.typechecking_enabled() and annotated(self.fwd):
            # `fwd`'s annotations checked, as when it runs: a wrong shape is its error. (A new
            # function, traced each time; `fwd` itself is traced once and cached by JAX.)
            fwd = lambda x_: self._typed_call("fwd", self.fwd, (x_,))  # noqa: E731
        else:
            assert self.fwd is not None  # (`impl` is "fwd": the first given, above)
            fwd = self.fwd
        try:
            return jax.eval_shape(fwd, x)
        except _typed.AnnotationError:
            raise
        except Exception as e:
            if untraceable(e):  # a host (NumPy) function: nothing to infer the shape from
                raise TypeError(self._no_out(f"`{impl}` is not JAX-traceable: {type(e).__name__}")) from e
            # The implementation's own failure (a configuration that does not fit this input):
            # it stands, first, with the site named.
            note = _TRACE_FAILED.format(call=self.title, impl=impl, x=_messages.tree_text(x))
            if not str(e).startswith(self.title) and note not in getattr(e, "__notes__", ()):
                e.add_note(note)
            raise

    def _no_out(self, why: str) -> str:
        example = _messages.out_example("dx.ExpensiveFn", self._impls())
        return _NO_OUT.format(call=self.title, why=why, example=example)

    def check_out(self, x: PyTree, error: Exception) -> None:
        """After `error` in a trace that used the declared `out=` for `x` (structures): raise
        the mismatch between `out=` and what `fwd` returns, if there is one and `fwd` can be
        traced; otherwise nothing (`error` stands). (A `fused` alone cannot tell: it takes
        a cotangent shaped by `out=`.)"""
        try:
            real = eqx.filter_eval_shape(lambda fwd, x_: fwd(x_), self.fwd, x)  # (its arrays may be structures)
        except Exception:  # no `fwd`, or not traceable: `out=` is all there is to go by
            return
        try:
            self.check_result("fwd", "an output", real, self.out_struct(x), "the output structure")
        except ValueError as mismatch:
            raise mismatch from error

    def check_result(self, impl: str, what: str, found: PyTree, expected: PyTree, against: str) -> None:
        """Raise, naming the function and `impl`, where `found` does not match `expected`."""
        _checks.check_tree(self.title, impl, what, found, expected, against)

    def checked_ct_x(self, impl: str, ct_x: PyTree, x: PyTree) -> PyTree:
        """The input cotangent `impl` returned, checked (float0 zeros for integer inputs)."""
        return _checks.checked_ct_x(self.title, impl, ct_x, x)

    # ------------------------------------------------------------------ implementations, derived where needed

    def invoke(self, impl: str, *args: Any) -> Any:
        """Call an implementation, checking its jaxtyping annotations (if it has any), and
        recording it when a recording (or DEBUG logging) is on. `dx.fuse` halves and host
        functions are recorded where they run; here they only learn the site's name."""
        fn = self._impls()[impl]
        with _record.site(self.name):
            if isinstance(fn, AbstractImplementation):
                return self._typed_call(impl, fn, args)
            return _record.recorded(impl, lambda: self._typed_call(impl, fn, args), not is_concrete(args))

    def _typed_call(self, impl: str, fn: Any, args: tuple) -> Any:
        checked = checked_function(fn) if _typed.typechecking_enabled() else None
        if checked is None:
            return fn(*args)
        where = f"{self.title} `{impl}`"
        if checked is fn:
            return _typed.check_call(fn, where, args, {})
        return _typed.check_call(checked, where, (fn, *args), {}, call=lambda *_: fn(*args))  # a Module's `__call__`

    def primal(self, x: PyTree) -> PyTree:
        """Compute `y = f(x)` with `fwd`, or with `fused` and a zero cotangent."""
        if self.fwd is not None:
            try:
                y = self.invoke("fwd", x)
            except TypeError as e:
                if self.out is not None or not untraceable(e):
                    raise
                raise TypeError(self._no_out(f"`fwd` is not JAX-traceable: {type(e).__name__}")) from e
            if self.out is not None:  # otherwise the output structure *is* fwd's: nothing to check
                self.check_result("fwd", "an output", y, self.out_struct(x), "the output structure")
            return y
        if self.fused is None:
            impl, y = self._forward_mode_output(x)
            if self.out is not None:  # (without one, the structure *is* theirs)
                self.check_result(impl, "an output `y`", y, self.out_struct(x), "the output structure")
            return y
        return self.run_fused(x, zeros(self.out_struct(x)))[0]

    def cotangent(self, x: PyTree, y: PyTree, ct_y: PyTree) -> PyTree:
        """Compute `ct_x` with `bwd`, or with `fused` (which recomputes the primal)."""
        if self.bwd is not None:
            return self.checked_ct_x("bwd", self.invoke("bwd", x, y, ct_y), x)
        if self.adjoint is not None:
            return self.combined(x, y, self.invoke("adjoint", x, ct_y))
        if self.fused is None:
            n = _site.n_inputs(x)
            raise TypeError(_messages.TOO_MANY_TANGENTS.format(call=self.title, n=n, limit=self.max_tangents))
        return self.run_fused(x, ct_y)[1]

    def combined(self, x: PyTree, y: PyTree, partial: PyTree) -> PyTree:
        """`combine(x, y, partial)` (the adjoint's result itself without `combine`), checked."""
        ct_x = partial if self.combine is None else self.invoke("combine", x, y, partial)
        return self.checked_ct_x("combine" if self.combine is not None else "adjoint", ct_x, x)

    def derived_fused(self) -> DerivedFused:
        """A `fused` made from the other implementations, running the forward and the
        adjoint concurrently ([`deferax.Fused`][]): `fwd` with `adjoint` (and `combine`), or
        `fwd` with a `bwd` that does not read `y` (the static check has proved it)."""
        # `combine` (or, without one, the check of what `adjoint` returned) needs `y`: after both
        return DerivedFused(
            PrimalHalf(self), AdjointHalf(self), CombineStep(self) if self.adjoint is not None else None
        )

    def run_fused(self, x: PyTree, ct_y: PyTree) -> tuple[PyTree, PyTree]:
        """Compute `(y, ct_x)` with `fused`, or with `fwd` then `bwd` when there is none."""
        if self.fused is None:
            y = self.primal(x)
            return y, self.cotangent(x, y, ct_y)
        y, ct_x = _checks.checked_pair(self.title, "fused", self.invoke("fused", x, ct_y))
        self.check_result("fused", "an output `y`", y, self.out_struct(x), "the output structure")
        return y, self.checked_ct_x("fused", ct_x, x)

    def run_fused_batch(self, x: PyTree, cts: PyTree) -> tuple[PyTree, PyTree]:
        """Compute `y` once and `ct_x` for each of `k` cotangents (stacked on a leading axis).

        Uses `fused_batch` when given; otherwise `fused` batched with `jax.vmap` over the
        cotangent only, so that JAX computes the parts of `fused` that do not depend on
        the cotangent (the forward solve) once. An implementation that cannot be
        `vmap`ped this way should give `fused_batch(x, cts) -> (y, ct_xs)`.
        """
        k = jtu.tree_leaves(cts)[0].shape[0]
        if self.fused_batch is not None:
            y, ct_xs = _checks.checked_pair(self.title, "fused_batch", self.invoke("fused_batch", x, cts))
            self.check_result("fused_batch", "an output `y`", y, self.out_struct(x), "the output structure")
            return y, _checks.checked_ct_xs(self.title, "fused_batch", ct_xs, x, k)
        if isinstance(self.fused, AbstractFused):
            return self.fused.batched(x, cts)

        def one(ct):
            return self.run_fused(x, ct)

        separable = output_once(one, cts)
        if separable is not None:
            # one (vmapped) run of `fused`: recorded here, around the batch
            with _record.site(self.name):
                return _record.recorded("fused", lambda: separable(cts), not is_concrete((x, cts)))
        warnings.warn(NOT_SEPARABLE.format(call=self.title, k=k), stacklevel=2)
        return output_each(one, cts)

    # ------------------------------------------------------------------ forward mode

    def _jvp(self, x: PyTree, t_x: PyTree, y_struct: PyTree) -> tuple[PyTree, PyTree]:
        """`jvp(x, t_x)`, checked against the output structure."""
        y, t_y = _checks.checked_pair(self.title, "jvp", self.invoke("jvp", x, t_x))
        self.check_result("jvp", "an output `y`", y, y_struct, "the output structure")
        self.check_result("jvp", "a tangent `t_y`", t_y, _site.tangent_struct(y_struct), "the output structure")
        return y, t_y

    def tangent(self, x: PyTree, t_x: PyTree) -> PyTree:
        """`t_y = J t_x`: `jvp(x, t_x)[1]`, or `jvp_batch` on one tangent."""
        if self.jvp is not None:
            return self._jvp(x, t_x, self.out_struct(x))[1]
        _, t_ys = self.tangents(x, jtu.tree_map(lambda t: t[None], t_x))
        return jtu.tree_map(lambda t: t[0], t_ys)

    def tangents(self, x: PyTree, t_xs: PyTree) -> tuple[PyTree, PyTree]:
        """`(y, t_ys)` for `k` tangents stacked on a leading axis: `jvp_batch` once, or `jvp`
        batched with `jax.vmap` over the tangent (the primal computed once where `vmap` can
        see that it does not depend on the tangent)."""
        y_struct = self.out_struct(x)
        k = jtu.tree_leaves(t_xs)[0].shape[0]
        if self.jvp_batch is not None:
            y, t_ys = _checks.checked_pair(self.title, "jvp_batch", self.invoke("jvp_batch", x, t_xs))
            self.check_result("jvp_batch", "an output `y`", y, y_struct, "the output structure")
            against = "the output with a leading axis of one tangent each"
            t_struct = stacked(_site.tangent_struct(y_struct), k)
            self.check_result("jvp_batch", "a batch of tangents", t_ys, t_struct, against)
            return y, t_ys

        def one(t):
            return self._jvp(x, t, y_struct)

        separable = output_once(one, t_xs)
        if separable is not None:
            return separable(t_xs)
        warnings.warn(NOT_SEPARABLE_JVP.format(call=self.title, k=k), stacklevel=2)
        return output_each(one, t_xs)

    def output_and_jacobian(self, x: PyTree) -> tuple[PyTree, PyTree]:
        """`(y, J)`: the output and its tangents along the `n` unit tangents of `x` (stacked
        on a leading axis), in one batched call: the forward-basis strategy's call."""
        return self.tangents(x, _site.unit_tangents(x))

    def _forward_mode_output(self, x: PyTree) -> tuple[str, PyTree]:
        """`(impl, y)`: `y` from the forward-mode implementation `impl` alone (a wasted zero
        tangent), unchecked."""
        zero = jtu.tree_map(zero_like, x)
        if self.jvp is not None:
            return "jvp", _checks.checked_pair(self.title, "jvp", self.invoke("jvp", x, zero))[0]
        zeros_ = jtu.tree_map(lambda t: t[None], zero)
        return "jvp_batch", _checks.checked_pair(self.title, "jvp_batch", self.invoke("jvp_batch", x, zeros_))[0]

    # ------------------------------------------------------------------ the forward-basis choice

    def forward_basis_estimates(self, shapes: tuple, n: int) -> _cost.Estimates | None:
        """The estimates of the standard schedule and the forward-basis strategy on an input
        of leaves of `shapes` with `n` numbers; None without `jvp` or `jvp_batch`
        (`_strategy.forward_basis_estimates`)."""
        return _strategy.forward_basis_estimates(self, shapes, n)

    def by_estimate(self, estimates: _cost.Estimates | None) -> bool:
        """Whether `estimates` (what `forward_basis_estimates` returned) choose between the
        standard schedule and the forward-basis strategy (`_strategy.by_estimate`)."""
        return _strategy.by_estimate(self, estimates)

    def strategy(self, n: int, estimates: _cost.Estimates | None) -> str:
        """The reverse-mode strategy of a call whose input has `n` numbers, given its
        `estimates`: `"forward-basis"` or `"standard"` (`_strategy.strategy`)."""
        return _strategy.strategy(self, n, estimates)

    # ------------------------------------------------------------------ calling

    def __call__(self, x: PyTree) -> PyTree:
        x = jtu.tree_map(jnp.asarray, x)
        return _site.bind_site(self, x)
