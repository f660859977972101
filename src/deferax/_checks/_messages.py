"""User-facing messages. Each one names the call, what was expected, what was found, and
the fix; each has a test that matches its text."""

from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np


def shape_text(a: Any) -> str:
    """`float64[3, 4]` for an array or a `jax.ShapeDtypeStruct` (`key<fry>[]` for a typed PRNG key)."""
    dtype = a.dtype if jnp.issubdtype(a.dtype, jax.dtypes.extended) else np.dtype(a.dtype)
    return f"{dtype.name}{list(a.shape)}"


def tree_text(value: Any) -> str:
    """How a value is shown in messages: `float64[3, 4]` for an array, a pytree of those
    (a large pytree, an MLP say, by its type and size rather than in full)."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return shape_text(value)
    leaves, treedef = jtu.tree_flatten(value)
    if treedef.num_nodes == 1:
        return type(value).__name__ if not leaves or leaves[0] is not value else repr(value)[:80]
    text = str(jtu.tree_unflatten(treedef, [tree_text(v) for v in leaves])).replace("'", "")
    if len(text) > 160 or "\n" in text:
        return f"{type(value).__name__} (a pytree of {len(leaves)} leaves)"
    return text


def out_example(make: str, impls: dict[str, Any]) -> str:
    """How to declare `out=` beside the implementations given (by their names; `...` for a
    lambda): `dx.ExpensiveFn(fused=solve, out=jax.ShapeDtypeStruct((nx, ny), jnp.float64))`."""

    def shown(fn: Any) -> str:
        name = getattr(fn, "__name__", "")
        return name if name.isidentifier() else "..."

    given = [f"{impl}={shown(fn)}" for impl, fn in impls.items() if fn is not None]
    return f"{make}({', '.join([*given, 'out=jax.ShapeDtypeStruct((nx, ny), jnp.float64)'])})"


BAD_COST = """`dx.Cost`: `{field}` must be {expected}, but got {found!r}.
Give seconds (or any one unit for every number), for example:

    dx.Cost(fwd=0.8, bwd=0.9)                       # a forward and an adjoint solve
    dx.Cost(setup=2.0, fwd=0.05, bwd=0.05)          # a factorisation shared by every solve of a job"""

NOT_CALLABLE = "{call}: `{impl}` must be a callable or None, but got {found!r}."

SIGNATURES = {
    "fwd": "fwd(x)",
    "bwd": "bwd(x, y, ct_y)",
    "fused": "fused(x, ct_y)",
    "fused_batch": "fused_batch(x, cts)",
    "jvp": "jvp(x, t_x)",
    "jvp_batch": "jvp_batch(x, t_xs)",
    "adjoint": "adjoint(x, ct_y)",
    "combine": "combine(x, y, partial)",
}

BAD_SIGNATURE = """{call}: `{impl}` cannot be called as `{expected}`: its signature is `{found}` ({why}).
Each implementation is called with positional arguments only: `{expected}`."""

MISMATCH = """{call}: `{impl}` returned {what} that does not match {against}.
{detail}
{rule}"""

RULES = {
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

FUSED_NOT_PAIR = """{call}: `fused` returned {found}, not a pair. `fused(x, ct_y)` must return `(y, ct_x)`:

    def fused(x, ct_y):
        return simulate(x), adjoint(x, ct_y)"""

TOO_MANY_TANGENTS = """{call}: reverse-mode differentiation (`jax.grad`, `jax.vjp`, `jax.jacrev`) needs `bwd` or \
`fused`, or the
forward-basis strategy: the primal with one tangent per input number. This input has n={n} numbers, more than
max_tangents={limit}. Give `bwd(x, y, ct_y) -> ct_x` (an adjoint), or raise `max_tangents`."""

NOT_PAIR_IMPL = """{call}: `{impl}` returned {found}, not a pair.
{rule}"""

CANNOT_DEFER = """{where}: schedule='deferred' was requested, but these call sites cannot be deferred:
{lines}
Use schedule='auto' to defer what can be and keep the rest standard, or restructure the loss so that the
cotangent reaching each expensive output does not depend on an expensive output (see "How the deferred VJP works")."""

BAD_MAX_BASIS = "{where}: `max_basis` must be {allowed}, but got {found!r}."

ANNOTATION = """{where}: {what} does not match its annotation.
  expected: {expected}
  received: {found}
  dimension bindings so far: {bindings}"""

BOTH_ADJOINTS = """{call}: give `adjoint(x, ct_y)` or `bwd(x, y, ct_y)`, not both. Prefer `adjoint` (with `combine` \
if the
cotangent needs `y`): it does not need the output, so forward and adjoint can run at the same time."""

ONLY_WITH_ADJOINT = (
    "{call}: `{what}` was given without `adjoint`; `combine` and `adjoint_out` describe what `adjoint` returns."
)

X64_OFF = """JAX's 64-bit mode is off (`jax_enable_x64`), so JAX computes in 32 bits: declare 32-bit dtypes in \
`out=`, or turn it
on first with `jax.config.update("jax_enable_x64", True)`."""

WIDE_DECLARED = """{call}: {what} declares {found}, a 64-bit dtype. """ + X64_OFF

BAD_DEVICES = """`deferax.set_devices`: `devices` must be None (every local device) or a non-empty list of \
`jax.Device`s, such as
`jax.local_devices()[:2]`, but got {found}."""
