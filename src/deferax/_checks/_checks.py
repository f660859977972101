"""The checks behind the messages: of settings at construction, of what implementations
return at run time. Each raises with its message, written beside it, naming the call."""

from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._jaxpr import is_inexact, shape_text, stacked, struct_of, structs, zero_like
from . import _messages

_WIDE = ("float64", "complex128", "int64", "uint64")  # (by name: an extended dtype has no NumPy one)


def is_count(value: Any) -> bool:
    """Whether `value` is a non-negative int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def default_name(impls: dict[str, Any]) -> str:
    """The name of a function given without one: the `__name__` of the first of `fwd`,
    `fused`, `jvp`, `jvp_batch` given (its type's name for a callable object), or
    "ExpensiveFn"."""
    first = next((impls[k] for k in ("fwd", "fused", "jvp", "jvp_batch") if impls.get(k) is not None), None)
    if first is None:
        return "ExpensiveFn"
    return getattr(first, "__name__", None) or type(first).__name__


def title(name: str | None) -> str:
    """How messages name an expensive function: "`ExpensiveFn(name='fdtd')`"."""
    return f"`ExpensiveFn(name={name!r})`"


def check_implementations(call: str, impls: dict[str, Any]) -> None:
    """Refuse an implementation that is not callable, or cannot take its positional arguments."""
    for impl, fn in impls.items():
        if fn is not None and not callable(fn):
            raise TypeError(f"{call}: `{impl}` must be a callable or None, but got {fn!r}.")
        if fn is not None:
            check_signature(call, impl, fn)


_BOTH_ADJOINTS = """{call}: give `adjoint(x, ct_y)` or `bwd(x, y, ct_y)`, not both. Prefer `adjoint` (with `combine` \
if the
cotangent needs `y`): it does not need the output, so forward and adjoint can run at the same time."""


def check_adjoint_split(call: str, adjoint: Any, bwd: Any, **needs_adjoint: Any) -> None:
    """Refuse `adjoint` with `bwd`, and the settings (`combine`, `adjoint_out`) that describe
    what `adjoint` returns without it."""
    if adjoint is not None and bwd is not None:
        raise TypeError(_BOTH_ADJOINTS.format(call=call))
    for what, value in needs_adjoint.items():
        if value is not None and adjoint is None:
            raise TypeError(
                f"{call}: `{what}` was given without `adjoint`; `combine` and `adjoint_out` describe what `adjoint` "
                "returns."
            )


_SIGNATURES = {
    "fwd": "fwd(x)",
    "bwd": "bwd(x, y, ct_y)",
    "fused": "fused(x, ct_y)",
    "fused_batch": "fused_batch(x, cts)",
    "jvp": "jvp(x, t_x)",
    "jvp_batch": "jvp_batch(x, t_xs)",
    "adjoint": "adjoint(x, ct_y)",
    "combine": "combine(x, y, partial)",
}


_BAD_SIGNATURE = """{call}: `{impl}` cannot be called as `{expected}`: its signature is `{found}` ({why}).
Each implementation is called with positional arguments only: `{expected}`."""


def check_signature(call: str, impl: str, fn: Any) -> None:
    """Refuse, at construction, an implementation that cannot take its positional arguments
    (`bwd=lambda x, ct: ...` without `y`), naming what it must take."""
    expected = _SIGNATURES[impl]
    n = expected.count(",") + 1
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or a C function: nothing to check
        return
    try:
        signature.bind(*range(n))
    except TypeError as e:
        found = f"{impl}{signature}"
        raise TypeError(_BAD_SIGNATURE.format(call=call, impl=impl, expected=expected, found=found, why=e)) from None


_X64_OFF = """JAX's 64-bit mode is off (`jax_enable_x64`), so JAX computes in 32 bits: declare 32-bit dtypes in \
`out=`, or turn it
on first with `jax.config.update("jax_enable_x64", True)`."""

_RULES = {
    "fwd": "`fwd(x)` must return a pytree shaped like the declared (or inferred) output `y`.",
    "bwd": "`bwd(x, y, ct_y)` must return a cotangent with the structure, shapes and dtypes of `x`.",
    "fused": "`fused(x, ct_y)` must return a pair `(y, ct_x)`: `y` shaped like the output, `ct_x` shaped like `x`.",
    "combine": "`combine(x, y, partial)` must return a cotangent with the structure, shapes and dtypes of `x`.",
    "adjoint": "`adjoint(x, ct_y)` (without `combine`) must return a cotangent with the structure, shapes and \
dtypes of `x`.",
    "jvp": "`jvp(x, t_x)` must return a pair `(y, t_y)`: `y` and `t_y` shaped like the output.",
    "jvp_batch": "`jvp_batch(x, t_xs)` must return a pair `(y, t_ys)`: `y` shaped like the output, `t_ys` shaped \
like the output with a leading axis of length `k` (one tangent per row of `t_xs`).",
    "fused_batch": "`fused_batch(x, cts)` must return a pair `(y, ct_xs)`: `y` shaped like the output, `ct_xs` \
shaped like `x` with a leading axis of length `k` (one cotangent per row of `cts`).",
}


_MISMATCH = """{call}: `{impl}` returned {what} that does not match {against}.
{detail}
{rule}"""


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
            fs = struct_of(f)
            if fs.shape != e.shape or fs.dtype != e.dtype:
                where = f" at {jtu.keystr(path)}" if path else ""
                lines.append(f"Expected {shape_text(e)}{where}, found {shape_text(fs)}.")
        if not lines:
            return
        x64 = jax.config.jax_enable_x64  # pyright: ignore[reportAttributeAccessIssue]  (a flag: set at run time)
        if not x64 and any(str(e.dtype) in _WIDE for e in jtu.tree_leaves(expected)):
            lines.append(_X64_OFF)
        detail = "\n".join(lines)
    rule = _RULES[impl]
    raise ValueError(_MISMATCH.format(call=call, impl=impl, what=what, against=against, detail=detail, rule=rule))


_WIDE_DECLARED = """{call}: {what} declares {found}, a 64-bit dtype. """ + _X64_OFF


def check_declared_width(call: str, what: str, declared: PyTree) -> None:
    """Refuse a declared 64-bit structure while JAX's 64-bit mode is off (JAX would compute in
    32 bits, and a callback declared wider fails with an error that names nothing of ours)."""
    x64 = jax.config.jax_enable_x64  # pyright: ignore[reportAttributeAccessIssue]  (a flag: set at run time)
    if not x64 and any(str(s.dtype) in _WIDE for s in jtu.tree_leaves(declared)):
        raise ValueError(_WIDE_DECLARED.format(call=call, what=what, found=_messages.tree_text(declared)))


def checked_ct_x(call: str, impl: str, ct_x: PyTree, x: PyTree) -> PyTree:
    """A returned input cotangent, checked, with float0 zeros for integer inputs."""
    expected = structs(x)
    if jtu.tree_structure(ct_x) == jtu.tree_structure(x):
        ct_x = jtu.tree_map(lambda c, a: c if is_inexact(a) else jnp.zeros(jnp.shape(a)), ct_x, x)
        expected = jtu.tree_map(
            lambda s: s if is_inexact(s) else jax.ShapeDtypeStruct(s.shape, jnp.result_type(float)), expected
        )
    check_tree(call, impl, "a cotangent", ct_x, expected, "the input `x`")
    return jtu.tree_map(lambda c, a: c if is_inexact(a) else zero_like(a), ct_x, x)


def checked_ct_xs(call: str, impl: str, ct_xs: PyTree, x: PyTree, k: int) -> PyTree:
    """A returned batch of `k` input cotangents (stacked on a leading axis), checked as
    `checked_ct_x` checks one: float0 zeros for the inputs that are not differentiable,
    whatever was returned there (integers; typed PRNG keys, whose cotangents a host
    function returns shaped like the keys' `uint32` data)."""
    expected = stacked(structs(x), k)
    if jtu.tree_structure(ct_xs) == jtu.tree_structure(x):
        ct_xs = jtu.tree_map(lambda c, a: c if is_inexact(a) else jnp.zeros((k, *jnp.shape(a))), ct_xs, x)
        expected = jtu.tree_map(
            lambda s: s if is_inexact(s) else jax.ShapeDtypeStruct(s.shape, jnp.result_type(float)), expected
        )
    against = "the input `x` with a leading axis of one cotangent each"
    check_tree(call, impl, "a batch of cotangents", ct_xs, expected, against)
    return jtu.tree_map(lambda c, a: c if is_inexact(a) else np.zeros((k, *jnp.shape(a)), jax.dtypes.float0), ct_xs, x)


_FUSED_NOT_PAIR = """{call}: `fused` returned {found}, not a pair. `fused(x, ct_y)` must return `(y, ct_x)`:

    def fused(x, ct_y):
        return simulate(x), adjoint(x, ct_y)"""

_NOT_PAIR_IMPL = """{call}: `{impl}` returned {found}, not a pair.
{rule}"""


def checked_pair(call: str, impl: str, result: Any) -> tuple[Any, Any]:
    """`result` of an implementation that returns a pair (`fused`, `jvp`, ...), as one."""
    if isinstance(result, tuple | list) and len(result) == 2:
        return result[0], result[1]
    if isinstance(result, tuple | list):
        found = f"a {type(result).__name__} of length {len(result)}"
    else:
        found = f"a {type(result).__name__}" if impl in ("fused", "fused_batch") else _messages.tree_text(result)
    if impl == "fused":
        raise ValueError(_FUSED_NOT_PAIR.format(call=call, found=found))
    raise ValueError(_NOT_PAIR_IMPL.format(call=call, impl=impl, found=found, rule=_RULES[impl]))
