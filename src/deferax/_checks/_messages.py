"""What the messages of several modules share: how they show a value (`tree_text`, from
`_jaxpr.shape_text`; `out_example`), and the messages raised in two modules. A message raised in
one place is written there, or beside it as a private constant (STYLE.md, "Errors"); each
names the call, what was expected, what was found, and the fix, and has a test that
matches its text."""

from typing import Any

import jax.tree_util as jtu

from .._jaxpr import shape_text


def tree_text(value: Any) -> str:
    """How a value is shown in messages: `float64[3, 4]` for an array, a pytree of those
    (a large pytree, an MLP say, by its type and size rather than in full)."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return shape_text(value)
    if value is None:
        return "None"
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


TOO_MANY_TANGENTS = """{call}: reverse-mode differentiation (`jax.grad`, `jax.vjp`, `jax.jacrev`) needs `bwd` or \
`fused`, or the
forward-basis strategy: the primal with one tangent per input number. This input has n={n} numbers, more than
max_tangents={limit}. Give `bwd(x, y, ct_y) -> ct_x` (an adjoint), or raise `max_tangents`."""


def second_order(call: str, impl: str | None = None) -> str:
    """The refusal of a second derivative through the host site `call`: up front, by the
    site's rules (`_site`), or, with `impl`, when JAX differentiates that host function's
    callback (`_host/_host.py`)."""
    if impl is None:
        what = "a derivative of its derivative is asked for"
    else:
        what = f"its host function `{impl}` is being differentiated, for a derivative of its derivative"
    return f"""{call}: second order is not supported for this site: {what} (`jax.hessian`,
`jax.jacfwd(jax.grad(f))`, `jax.grad(jax.grad(f))`), and its derivatives are host functions, which JAX cannot
differentiate. A host site has first-order derivatives: reverse mode (`jax.grad`, `jax.vjp`, `jax.jacrev`,
`dx.filter_value_and_grad`) and, with `jvp`, forward mode (`jax.jvp`, `jax.jacfwd`). For second order, give
`dx.host(..., higher_order=f)`: `f(x) -> y` in JAX, which JAX can differentiate (for a linear solve, the host solve
inside `jax.lax.custom_linear_solve`); for a sparse linear solve, use `dx.sparse_solve`, which has every order; or
make the site traceable (`dx.ExpensiveFn` with JAX implementations), or take finite differences of the gradient."""


BAD_MAX_BASIS = "{where}: `max_basis` must be {allowed}, but got {found!r}."
