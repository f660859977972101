"""`ExpensiveFn`: an expensive function with hand-written derivatives, as an Equinox module."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from . import _errors, _record, _site, _tangents, _typed
from ._concurrent import Derived, Fused, is_concrete
from ._cost import Cost

BAD_COST_HINT = """{call}: `cost` must be a `dx.Cost` or None, but got {found!r}. Give what the implementations cost:

    dx.ExpensiveFn(fwd=..., bwd=..., fused=..., cost=dx.Cost(fwd=0.8, bwd=0.9))"""


def _struct(tree: PyTree) -> PyTree[jax.ShapeDtypeStruct]:
    return jtu.tree_map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), tree)


def _differentiable(a: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


class ExpensiveFn(eqx.Module):
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
    | `fwd`, `bwd` | `fwd` | `bwd` (deferred: `fwd` and `bwd` together when the jaxpr of `bwd` shows that it does not read `y` and calls nothing deferax cannot read, such as a host callback) |
    | `fwd`, `adjoint` (`combine`) | `fwd` | `combine(x, y, adjoint(x, ct))` (deferred: `fwd` and `adjoint` together) |
    | `fused` only | `fused(x, 0)[0]`: runs a wasted adjoint with a zero cotangent | `fused(x, ct)[1]`: recomputes the primal |
    | `fwd`, `fused` | `fwd` | `fused(x, ct)[1]`: recomputes the primal |
    | `fused`, `bwd` | `fused(x, 0)[0]` | `bwd` |
    | `jvp` or `jvp_batch` (with any of the above) | `fwd`, else `jvp(x, 0)[0]` | forward-basis when `n <= max_tangents`, else as above |

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
      forward-basis strategy (default 8 when `bwd` or `fused` is given too; no limit for a
      function with forward-mode implementations only).
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

    # Typed `Any` so that a wrong value reaches `__check_init__`, whose message names the
    # function; each must be a callable or None.
    fwd: Any = None
    bwd: Any = None
    fused: Any = None
    name: str | None = eqx.field(default=None, static=True)
    out: Any = None
    fused_batch: Any = None
    max_basis: int | None = eqx.field(default=None, static=True)
    jvp: Any = None
    jvp_batch: Any = None
    adjoint: Any = None
    combine: Any = None
    max_tangents: int | None = eqx.field(default=None, static=True)
    prefer: str | None = eqx.field(default=None, static=True)
    thread_safe: bool = eqx.field(default=True, static=True)
    cost: Any = eqx.field(default=None, static=True)  # (a `Cost`; `Any` so that a wrong value reaches the check)

    def __post_init__(self):
        if self.name is None:
            impl = next((f for f in (self.fwd, self.fused, self.jvp, self.jvp_batch) if f is not None), None)
            name = "ExpensiveFn" if impl is None else getattr(impl, "__name__", None) or type(impl).__name__
            object.__setattr__(self, "name", name)

    def __check_init__(self):
        for impl in ("fwd", "bwd", "fused", "fused_batch", "jvp", "jvp_batch", "adjoint", "combine"):
            value = getattr(self, impl)
            if value is not None and not callable(value):
                raise TypeError(_errors.NOT_CALLABLE.format(call=self._call, impl=impl, found=value))
            if value is not None:
                check_signature(self._call, impl, value)
        if self.max_basis is not None and (not isinstance(self.max_basis, int) or isinstance(self.max_basis, bool) or self.max_basis < 0):
            allowed = "a non-negative int (or None: the limit of `filter_value_and_grad`)"
            raise ValueError(_errors.BAD_MAX_BASIS.format(where=self._call, allowed=allowed, found=self.max_basis))
        if self.adjoint is not None and self.bwd is not None:
            raise TypeError(_errors.BOTH_ADJOINTS.format(call=self._call))
        if self.cost is not None and not isinstance(self.cost, Cost):
            raise TypeError(BAD_COST_HINT.format(call=self._call, found=self.cost))
        if self.combine is not None and self.adjoint is None:
            raise TypeError(_errors.ONLY_WITH_ADJOINT.format(call=self._call, what="combine"))
        if self.max_tangents is not None and (not isinstance(self.max_tangents, int) or isinstance(self.max_tangents, bool) or self.max_tangents < 0):
            raise ValueError(_errors.BAD_MAX_TANGENTS.format(call=self._call, found=self.max_tangents))
        if self.prefer is not None and self.prefer not in _tangents.STRATEGIES:
            raise ValueError(_errors.BAD_PREFER.format(call=self._call, found=self.prefer))
        if self.prefer == "forward-basis" and self.jvp is None and self.jvp_batch is None:
            raise TypeError(_errors.PREFER_WITHOUT.format(call=self._call, prefer=self.prefer, give="`jvp` or `jvp_batch`"))
        if self.prefer == "standard" and not self.has_vjp:
            raise TypeError(_errors.PREFER_WITHOUT.format(call=self._call, prefer=self.prefer, give="`bwd` or `fused`"))
        if self.fwd is None and self.fused is None and self.jvp is None and self.jvp_batch is None:
            raise TypeError(_errors.NO_PRIMAL.format(call=self._call))
        if self.out is not None and not callable(self.out):
            leaves = jtu.tree_leaves(self.out)
            if not leaves or not all(isinstance(s, jax.ShapeDtypeStruct) for s in leaves):
                raise TypeError(_errors.BAD_OUT.format(call=self._call, found=self.out))

    @property
    def _call(self) -> str:
        return f"`ExpensiveFn(name={self.name!r})`"

    @property
    def autodiff(self) -> bool:
        """Whether JAX differentiates `fwd` itself: no other implementation is given."""
        return all(getattr(self, impl) is None for impl in ("bwd", "fused", "jvp", "jvp_batch", "adjoint"))

    @property
    def has_vjp(self) -> bool:
        """Whether a hand-written reverse-mode derivative is given (`bwd`, `adjoint` or `fused`)."""
        return self.bwd is not None or self.adjoint is not None or self.fused is not None

    # ------------------------------------------------------------------ shapes and checks

    def out_struct(self, x: PyTree) -> PyTree[jax.ShapeDtypeStruct]:
        """The structure of `self(x)`: declared by `out`, or inferred from `fwd` (or, without
        one, from what `jvp` or `jvp_batch` returns)."""
        if self.out is not None:
            out = self.out(_struct(x)) if callable(self.out) else self.out
            if callable(self.out) and not all(isinstance(s, jax.ShapeDtypeStruct) for s in jtu.tree_leaves(out)):
                raise TypeError(_errors.BAD_OUT.format(call=self._call, found=out))
            check_declared_width(self._call, "`out=`", out)
            return out
        impl = next((impl for impl in ("fwd", "jvp", "jvp_batch") if getattr(self, impl) is not None), None)
        if impl is None:
            raise TypeError(self._no_out("no `fwd` or `jvp` was given, and `fused` takes a cotangent shaped like the output"))
        if impl != "fwd":
            fwd = lambda x_: _tangents.primal_of(self, x_)[1]  # noqa: E731
        elif _typed.typechecking_enabled() and _annotated(self.fwd):
            # `fwd`'s annotations checked, as when it runs: a wrong shape is its error. (A new
            # function, traced each time; `fwd` itself is traced once and cached by JAX.)
            fwd = lambda x_: self._typed_call("fwd", self.fwd, (x_,))  # noqa: E731
        else:
            fwd = self.fwd
        try:
            return jax.eval_shape(fwd, x)
        except _typed.AnnotationError:
            raise
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError, TypeError) as e:
            raise TypeError(self._no_out(f"`{impl}` is not JAX-traceable: {type(e).__name__}")) from e

    def _no_out(self, why: str) -> str:
        impls = ("fwd", "bwd", "fused", "fused_batch", "jvp", "jvp_batch", "adjoint", "combine")
        example = _errors.out_example("dx.ExpensiveFn", {impl: getattr(self, impl) for impl in impls})
        return _errors.NO_OUT.format(call=self._call, why=why, example=example)

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
            self._check("fwd", "an output", real, self.out_struct(x), "the output structure")
        except ValueError as mismatch:
            raise mismatch from error

    def _check(self, impl: str, what: str, found: PyTree, expected: PyTree, against: str) -> None:
        check_tree(self._call, impl, what, found, expected, against)

    def _check_ct_x(self, impl: str, ct_x: PyTree, x: PyTree) -> PyTree:
        return check_ct_x(self._call, impl, ct_x, x)

    # ------------------------------------------------------------------ implementations, derived where needed

    def _invoke(self, impl: str, *args: Any) -> Any:
        """Call an implementation, checking its jaxtyping annotations (if it has any), and
        recording it when a recording (or DEBUG logging) is on. `dx.fuse` halves and host
        functions are recorded where they run; here they only learn the site's name."""
        fn = getattr(self, impl)
        with _record.site(self.name):
            if isinstance(fn, Fused) or getattr(getattr(fn, "__self__", None), "runs_on_host", False):
                return self._typed_call(impl, fn, args)
            return _record.call(impl, lambda: self._typed_call(impl, fn, args), not is_concrete(args))

    def _typed_call(self, impl: str, fn: Any, args: tuple) -> Any:
        checked = _checked_function(fn) if _typed.typechecking_enabled() else None
        if checked is None:
            return fn(*args)
        where = f"{self._call} `{impl}`"
        if checked is fn:
            return _typed.check_call(fn, where, args, {})
        return _typed.check_call(checked, where, (fn, *args), {}, call=lambda *_: fn(*args))  # a Module's `__call__`

    def primal(self, x: PyTree) -> PyTree:
        """Compute `y = f(x)` with `fwd`, or with `fused` and a zero cotangent."""
        if self.fwd is not None:
            try:
                y = self._invoke("fwd", x)
            except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError) as e:
                if self.out is not None:
                    raise
                raise TypeError(self._no_out(f"`fwd` is not JAX-traceable: {type(e).__name__}")) from e
            if self.out is not None:  # otherwise the output structure *is* fwd's: nothing to check
                self._check("fwd", "an output", y, self.out_struct(x), "the output structure")
            return y
        if self.fused is None:
            return _tangents.primal(self, x)
        ct0 = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), self.out_struct(x))
        return self.run_fused(x, ct0)[0]

    def cotangent(self, x: PyTree, y: PyTree, ct_y: PyTree) -> PyTree:
        """Compute `ct_x` with `bwd`, or with `fused` (which recomputes the primal)."""
        if self.bwd is not None:
            return self._check_ct_x("bwd", self._invoke("bwd", x, y, ct_y), x)
        if self.adjoint is not None:
            return self._combine(x, y, self._invoke("adjoint", x, ct_y))
        if self.fused is None:
            n = _tangents.n_inputs(x)
            raise TypeError(_errors.TOO_MANY_TANGENTS.format(call=self._call, n=n, limit=self.max_tangents))
        return self.run_fused(x, ct_y)[1]

    def _combine(self, x: PyTree, y: PyTree, partial: PyTree) -> PyTree:
        """`combine(x, y, partial)` (the adjoint's result itself without `combine`), checked."""
        ct_x = partial if self.combine is None else self._invoke("combine", x, y, partial)
        return self._check_ct_x("combine" if self.combine is not None else "adjoint", ct_x, x)

    def derived_fused(self) -> Any:
        """A `fused` made from the other implementations, running the forward and the
        adjoint concurrently ([`deferax.Fused`][]): `fwd` with `adjoint` (and `combine`), or
        `fwd` with a `bwd` that does not read `y` (the static check has proved it)."""
        # `combine` (or, without one, the check of what `adjoint` returned) needs `y`: after both
        return Derived(_Primal(self), _Adjoint(self), _Combine(self) if self.adjoint is not None else None)

    def run_fused(self, x: PyTree, ct_y: PyTree) -> tuple[PyTree, PyTree]:
        """Compute `(y, ct_x)` with `fused`, or with `fwd` then `bwd` when there is none."""
        if self.fused is None:
            y = self.primal(x)
            return y, self.cotangent(x, y, ct_y)
        result = self._invoke("fused", x, ct_y)
        if not (isinstance(result, tuple | list) and len(result) == 2):
            found = f"a {type(result).__name__}" + (f" of length {len(result)}" if isinstance(result, tuple | list) else "")
            raise ValueError(_errors.FUSED_NOT_PAIR.format(call=self._call, found=found))
        y, ct_x = result
        self._check("fused", "an output `y`", y, self.out_struct(x), "the output structure")
        return y, self._check_ct_x("fused", ct_x, x)

    def run_fused_batch(self, x: PyTree, cts: PyTree) -> tuple[PyTree, PyTree]:
        """Compute `y` once and `ct_x` for each of `k` cotangents (stacked on a leading axis).

        Uses `fused_batch` when given; otherwise `fused` batched with `jax.vmap` over the
        cotangent only, so that JAX computes the parts of `fused` that do not depend on
        the cotangent (the forward solve) once. An implementation that cannot be
        `vmap`ped this way should give `fused_batch(x, cts) -> (y, ct_xs)`.
        """
        k = jtu.tree_leaves(cts)[0].shape[0]
        if self.fused_batch is not None:
            result = self._invoke("fused_batch", x, cts)
            if not (isinstance(result, tuple | list) and len(result) == 2):
                raise ValueError(_errors.FUSED_NOT_PAIR.format(call=self._call, found=f"a {type(result).__name__}").replace("`fused`", "`fused_batch`", 1))
            y, ct_xs = result
            self._check("fused_batch", "an output `y`", y, self.out_struct(x), "the output structure")
            expected = jtu.tree_map(lambda s: jax.ShapeDtypeStruct((k, *s.shape), s.dtype), _struct(x))
            self._check("fused_batch", "a batch of cotangents", ct_xs, expected, "the input `x` with a leading axis of one cotangent each")
            return y, ct_xs
        batched = getattr(self.fused, "batched", None)
        if batched is not None:
            return batched(x, cts)
        def one(ct):
            return self.run_fused(x, ct)

        separable = _tangents.primal_once(one, cts)
        if separable is not None:
            # one (vmapped) run of `fused`: recorded here, around the batch
            with _record.site(self.name):
                return _record.call("fused", lambda: separable(cts), not is_concrete((x, cts)))
        warnings.warn(_errors.NOT_SEPARABLE.format(call=self._call, k=k), stacklevel=2)
        return _tangents.primal_each(one, cts)

    # ------------------------------------------------------------------ calling

    def __call__(self, x: PyTree) -> PyTree:
        x = jtu.tree_map(jnp.asarray, x)
        return _site.call(self, x)



def _checked_function(fn: Any) -> Any:
    """The function whose annotations `ExpensiveFn._typed_call` checks for an implementation
    `fn`: `fn` itself (a function or a method), a Module's `__call__`, or None (a
    `TypedModule` checks its own wherever it is called; other callables are not checked)."""
    if isinstance(fn, _typed.TypedModule):
        return None
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        return fn
    method = type(fn).__call__ if isinstance(fn, eqx.Module) else None
    return method if inspect.isfunction(method) else None


def _annotated(fn: Any) -> bool:
    """Whether `fn` has annotations that `ExpensiveFn._typed_call` would check."""
    return bool(getattr(_checked_function(fn), "__annotations__", None))


_WIDE = ("float64", "complex128", "int64", "uint64")  # (by name: an extended dtype has no NumPy one)


def check_tree(call: str, impl: str, what: str, found: PyTree, expected: PyTree, against: str) -> None:
    """Raise, naming `call` and `impl`, where `found` differs from `expected` (structures) in
    structure, shape or dtype."""
    found_def = jtu.tree_structure(found)
    expected_def = jtu.tree_structure(expected)
    if found_def != expected_def:
        detail = f"Expected structure {expected_def}, found {found_def}."
    else:
        lines = []
        paths = jtu.tree_flatten_with_path(expected)[0]
        for (path, e), f in zip(paths, jtu.tree_leaves(found), strict=True):
            fs = jax.ShapeDtypeStruct(jnp.shape(f), jnp.result_type(f))
            if fs.shape != e.shape or fs.dtype != e.dtype:
                where = f" at {jtu.keystr(path)}" if path else ""
                lines.append(f"Expected {_errors.shape_text(e)}{where}, found {_errors.shape_text(fs)}.")
        if not lines:
            return
        if not jax.config.jax_enable_x64 and any(str(e.dtype) in _WIDE for e in jtu.tree_leaves(expected)):
            lines.append(_errors.X64_OFF)
        detail = "\n".join(lines)
    raise ValueError(
        _errors.MISMATCH.format(
            call=call, impl=impl, what=what, against=against, detail=detail, rule=_errors.RULES[impl]
        )
    )


def check_declared_width(call: str, what: str, declared: PyTree) -> None:
    """Refuse a declared 64-bit structure while JAX's 64-bit mode is off (JAX would compute in
    32 bits, and a callback declared wider fails with an error that names nothing of ours)."""
    if not jax.config.jax_enable_x64 and any(str(s.dtype) in _WIDE for s in jtu.tree_leaves(declared)):
        raise ValueError(_errors.WIDE_DECLARED.format(call=call, what=what, found=_errors.tree_text(declared)))


def check_ct_x(call: str, impl: str, ct_x: PyTree, x: PyTree) -> PyTree:
    """Check a returned input cotangent and fill in float0 zeros for integer inputs."""
    expected = _struct(x)
    if jtu.tree_structure(ct_x) == jtu.tree_structure(x):
        ct_x = jtu.tree_map(lambda c, a: c if _differentiable(a) else jnp.zeros(jnp.shape(a)), ct_x, x)
        expected = jtu.tree_map(
            lambda s: s if jnp.issubdtype(s.dtype, jnp.inexact) else jax.ShapeDtypeStruct(s.shape, jnp.result_type(float)),
            expected,
        )
    check_tree(call, impl, "a cotangent", ct_x, expected, "the input `x`")
    return jtu.tree_map(lambda c, a: c if _differentiable(a) else _tangents.zero_like(a), ct_x, x)


def check_signature(call: str, impl: str, fn: Any) -> None:
    """Refuse, at construction, an implementation that cannot take its positional arguments
    (`bwd=lambda x, ct: ...` without `y`), naming what it must take."""
    expected = _errors.SIGNATURES[impl]
    n = expected.count(",") + 1
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or a C function: nothing to check
        return
    try:
        signature.bind(*range(n))
    except TypeError as e:
        raise TypeError(_errors.BAD_SIGNATURE.format(call=call, impl=impl, expected=expected, found=f"{impl}{signature}", why=e)) from None


class _Primal(eqx.Module):
    """`fn.primal`, as a Module that compares by value (its compiled form is reused)."""

    fn: ExpensiveFn
    impl = "fwd"  # (for the recording)

    def __call__(self, x):
        return self.fn.primal(x)


class _Adjoint(eqx.Module):
    """The part of the reverse-mode derivative that does not need `y`: `adjoint(x, ct)`, or
    `bwd(x, zeros, ct)` for a `bwd` that does not read `y`."""

    fn: ExpensiveFn

    @property
    def impl(self) -> str:  # (for the recording)
        return "adjoint" if self.fn.adjoint is not None else "bwd"

    def __call__(self, x, ct):
        fn = self.fn
        if fn.adjoint is not None:
            return fn._invoke("adjoint", x, ct)
        zeros = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), fn.out_struct(x))
        return fn._check_ct_x("bwd", fn._invoke("bwd", x, zeros, ct), x)


class _Combine(eqx.Module):
    fn: ExpensiveFn

    def __call__(self, x, y, partial):
        return self.fn._combine(x, y, partial)


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
        lambda node: jtu.tree_map(lambda _: False, node) if isinstance(node, ExpensiveFn) else eqx.is_inexact_array(node),
        tree,
        is_leaf=lambda node: isinstance(node, ExpensiveFn),
    )
