"""Two independent programs evaluated together in the current trace, a loop of each stepped
in one loop.

On one accelerator the two halves of a deferred site (a forward and an adjoint that does not
need its output) cannot run at the same time: the device runs one program, one operation
after another. What it can do is take one loop where it took two: when both halves are
time-steppers (`lax.scan`s of the same length), one `lax.scan` whose body steps the forward
and the adjoint gives the compiler one loop of twice the work per step, and saves a loop's
per-step cost (measured on a TPU v5e, the seed's wave stepper by hand: 0.94-0.96 of the two
loops one after the other). No JAX library fuses the loops of two independent programs, and
XLA does not merge while loops.

`together(f, g, f_args, g_args)` traces both, inlines nested `jit`/`checkpoint` bodies that
hold a loop, picks the longest top-level `scan` of each of equal length, and evaluates:
what comes before each loop (in its program's order), the two loops as one, then what comes
after each. Both programs are independent (neither reads the other's values), so this order
is one of theirs. Loops with effects, of different lengths, or nested deeper (in a `cond`, a
`while`, another loop) are left as they are: then the two programs run one after the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax

from . import _internals as _core
from ._program import contains, inline, interpret, trace


def together(
    f: Callable[..., Any], g: Callable[..., Any], f_args: Sequence, g_args: Sequence
) -> tuple[list, list, bool]:
    """`(f(*f_args), g(*g_args), stepped)`: the flat outputs of `f` and `g` (functions of flat
    arrays to flat arrays), evaluated under the current trace, with a loop of each stepped
    in one loop where both have one of the same length (`stepped`: whether they were)."""
    closed_f, _ = trace(f, *[_core.struct_of(a, keep_weak_type=True) for a in f_args])
    closed_g, _ = trace(g, *[_core.struct_of(a, keep_weak_type=True) for a in g_args])
    closed_f, closed_g = _flattened(closed_f), _flattened(closed_g)
    pair = _loops_of_equal_length(closed_f, closed_g)
    if pair is None:
        return interpret(closed_f, list(f_args)), interpret(closed_g, list(g_args)), False
    i, j = pair
    env: dict = {}
    env.update(zip(closed_f.jaxpr.constvars, closed_f.consts, strict=True))
    env.update(zip(closed_f.jaxpr.invars, f_args, strict=True))
    env.update(zip(closed_g.jaxpr.constvars, closed_g.consts, strict=True))
    env.update(zip(closed_g.jaxpr.invars, g_args, strict=True))
    eqns_f, eqns_g = closed_f.jaxpr.eqns, closed_g.jaxpr.eqns
    _evaluate(env, eqns_f[:i])
    _evaluate(env, eqns_g[:j])
    loop_f, loop_g = eqns_f[i], eqns_g[j]
    ins_f, ins_g = [_read(env, v) for v in loop_f.invars], [_read(env, v) for v in loop_g.invars]
    outs_f, outs_g = _one_loop(loop_f, ins_f, loop_g, ins_g)
    env.update(zip(loop_f.outvars, outs_f, strict=True))
    env.update(zip(loop_g.outvars, outs_g, strict=True))
    _evaluate(env, eqns_f[i + 1 :])
    _evaluate(env, eqns_g[j + 1 :])
    return _outputs(env, closed_f), _outputs(env, closed_g), True


# Calls whose primal is a nested program: a user's custom rule (the forward of a recognised
# `jax.custom_vjp` is its call). Stage 2 evaluates the halves, it does not differentiate them:
# their primal is what runs.
_PRIMAL = ("custom_vjp_call", "custom_jvp_call")  # (each holds its primal as `call_jaxpr`)


def _flattened(closed):
    """`closed` with the nested `jit`/`checkpoint` bodies and, where nothing differentiates the
    code running now, the custom rules' primal programs that hold a loop inlined, so that
    the loop sits at the top level."""
    closed = inline(closed, {"scan"})
    if _core.under_differentiation():
        return closed
    handlers = {
        i: (lambda eqn, ins: interpret(eqn.params["call_jaxpr"], ins))
        for i, eqn in enumerate(closed.jaxpr.eqns)
        if str(eqn.primitive) in _PRIMAL and contains(eqn, {"scan"})
    }
    if not handlers:
        return closed
    structs = [_core.struct_of(v.aval, keep_weak_type=True) for v in closed.jaxpr.invars]
    flat, _ = trace(lambda *args: interpret(closed, list(args), handlers), *structs)
    return inline(flat, {"scan"})


def _loops_of_equal_length(closed_f, closed_g) -> tuple[int, int] | None:
    """The indices of the longest top-level `scan` of each program of the same length, with no
    effects; None when there is no such pair."""
    loops_f, loops_g = _loops(closed_f), _loops(closed_g)
    common = set(loops_f) & set(loops_g)
    if not common:
        return None
    length = max(common)
    return loops_f[length], loops_g[length]


def _loops(closed) -> dict[int, int]:
    """The first top-level effect-free `scan` of each length (of more than one step), by length."""
    found: dict[int, int] = {}
    for i, eqn in enumerate(closed.jaxpr.eqns):
        if str(eqn.primitive) == "scan" and not eqn.effects and int(eqn.params["length"]) > 1:
            found.setdefault(int(eqn.params["length"]), i)
    return found


def _read(env: dict, v) -> Any:
    return v.val if isinstance(v, _core.Literal) else env[v]


def _evaluate(env: dict, eqns) -> None:
    for eqn in eqns:
        outs = _core.bind_equation(eqn, [_read(env, v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs, strict=True))


def _outputs(env: dict, closed) -> list:
    return [jnp.asarray(v.val) if isinstance(v, _core.Literal) else env[v] for v in closed.jaxpr.outvars]


def _split(eqn, ins: list) -> tuple[list, list, list]:
    """A `scan` equation's operands: `(consts, initial carry, stacked inputs)`."""
    n_consts, n_carry = _core.scan_sizes(eqn)
    return ins[:n_consts], ins[n_consts : n_consts + n_carry], ins[n_consts + n_carry :]


def _one_loop(loop_f, ins_f: list, loop_g, ins_g: list) -> tuple[list, list]:
    """The outputs of the `scan` equations `loop_f` and `loop_g` (of equal length) on their
    operands, computed by one `scan` that steps both bodies. A loop run in the other
    direction has its stacked inputs and outputs reversed."""
    consts_f, carry_f, xs_f = _split(loop_f, ins_f)
    consts_g, carry_g, xs_g = _split(loop_g, ins_g)
    reverse = bool(loop_f.params["reverse"])
    flip = bool(loop_g.params["reverse"]) != reverse
    if flip:
        xs_g = [lax.rev(x, (0,)) for x in xs_g]
    body_f, body_g = loop_f.params["jaxpr"], loop_g.params["jaxpr"]
    n_f, n_g = len(carry_f), len(carry_g)

    def body(carry, xs):
        (c_f, c_g), (x_f, x_g) = carry, xs
        out_f = interpret(body_f, [*consts_f, *c_f, *x_f])
        out_g = interpret(body_g, [*consts_g, *c_g, *x_g])
        return (out_f[:n_f], out_g[:n_g]), (out_f[n_f:], out_g[n_g:])

    unroll_f, unroll_g = loop_f.params.get("unroll", 1), loop_g.params.get("unroll", 1)
    (c_f, c_g), (ys_f, ys_g) = lax.scan(
        body,
        (list(carry_f), list(carry_g)),
        (list(xs_f), list(xs_g)),
        length=int(loop_f.params["length"]),
        reverse=reverse,
        unroll=unroll_f if unroll_f == unroll_g else 1,
    )
    if flip:
        ys_g = [lax.rev(y, (0,)) for y in ys_g]
    return [*c_f, *ys_f], [*c_g, *ys_g]
