"""`jax.custom_vjp` calls in an unchanged loss: each becomes a site (`custom_vjp `f`
(recognised)`), whose forward and the part of its backward that needs no computed residual
run at once where the loss's cotangent allows it, with plain JAX's values and gradients;
calls that cannot be split soundly, or would not gain, are left exactly as they are, and
`explain` says why."""

import collections
import functools as ft
import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import io_callback

import deferax as dx

from .helpers import FLOAT, FLOAT_NAME, assert_tree_allclose, hlo_ops, make, ref

HERE = os.path.relpath(__file__)


# ----------------------------------------------------------------------------- the seed's program, unchanged
#
# A wave stepper (leapfrog on an n x n grid, `lax.scan` over the steps) is linear in its
# source pattern `x`, so its adjoint needs the cotangent only: the seed's `f_bwd(x, v)` never
# reads `f(x)`, and the loss is affine in `f(x)`.


def laplacian(u):
    p = jnp.pad(u, 1)
    return p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4 * u


def seed(n: int, steps: int, counter=None):
    """`(f, loss, x)`: the seed's `custom_vjp` around the stepper, an affine loss in its
    output, and an input. `counter` counts the forward and adjoint runs ("fwd", "bwd")."""
    r = jnp.arange(n, dtype=float) / n - 0.5
    c2 = jnp.where(r[:, None] ** 2 + r[None, :] ** 2 < 0.15**2, 0.12, 0.25)
    t = jnp.arange(steps, dtype=float)
    a = ((t - steps / 4) / (steps / 12)) ** 2
    g = (1 - 2 * a) * jnp.exp(-a)

    def forward(x):
        if counter is not None:
            counter.tick("fwd")

        def step(carry, gk):
            u, u_prev = carry
            return (2 * u - u_prev + c2 * laplacian(u) + gk * x, u), None

        zero = jnp.zeros_like(x)
        (u, _), _ = lax.scan(step, (zero, zero), g)
        return u

    def adjoint(ct):
        if counter is not None:
            counter.tick("bwd")

        def step(carry, gk):
            a, a_next, acc = carry
            return (2 * a - a_next + laplacian(c2 * a), a, acc + gk * a), None

        zero = jnp.zeros_like(ct)
        (_, _, acc), _ = lax.scan(step, (ct, zero, zero), g[::-1])
        return acc

    @jax.custom_vjp
    def f(x):
        return forward(x)

    def f_fwd(x):
        return f(x), x

    def f_bwd(x, v):
        return (adjoint(v),)

    f.defvjp(f_fwd, f_bwd)
    w = jax.random.normal(jax.random.key(1), (n, n))
    x = jax.random.normal(jax.random.key(0), (n, n))

    def loss(x):
        return jnp.sum(w * f(x)) + 1e-3 * jnp.sum(x**2)

    return f, loss, x


# Large enough for the estimate to split it (about 3e7 element operations a half), small
# enough to run in milliseconds.
SEED = (48, 600)


def _line_of(text: str) -> int:
    """The line of this file that holds `text`."""
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def test_the_seed_unchanged_is_a_deferred_site(counter):
    """The seed's program, unchanged: one site, deferred (the forward and the adjoint in one
    stage, at once), plain JAX's value and gradient, eagerly and under `jax.jit`, with the
    forward and the adjoint run once each, as in plain JAX."""
    _, loss, x = seed(*SEED, counter)
    plan = dx.explain(loss, x)
    [site] = plan.sites
    assert (site.name, site.schedule) == ("custom_vjp `f` (recognised)", "deferred")
    line = _line_of("return jnp.sum(w * f(x))")
    assert str(plan.recognised[0]).startswith(f"#0 custom_vjp `f` (recognised) at {HERE}:{line}")
    assert plan.stages == (("custom_vjp `f` (recognised): fwd + adjoint",),)
    counter.reset()
    want = jax.value_and_grad(loss)(x)
    jax.effects_barrier()
    assert counter.as_dict() == {"fwd": 1, "bwd": 1, "fused": 0}
    for jit in (False, True):
        step = dx.filter_value_and_grad(loss)
        step = jax.jit(step) if jit else step
        # (a first call compiles: inside a recording, so that the calls compiled into the program
        # are counted, as where the halves run in it, on an accelerator: see `dx.record`)
        with dx.record():
            jax.block_until_ready(step(x))
        jax.effects_barrier()
        counter.reset()
        with dx.record() as timeline:
            got = jax.block_until_ready(step(x))
            jax.effects_barrier()
        assert counter.as_dict() == {"fwd": 1, "bwd": 1, "fused": 0}, jit
        assert timeline.counts() == {"fwd": 1, "adjoint": 1}, jit
        assert_tree_allclose(got, want, rtol=1e-12, atol=1e-12)


def _at_depth():
    """The seed's call inside each construct, with whether it is a site there."""
    return {
        "jit": (lambda f: jax.jit(f), True),
        "checkpoint": (lambda f: jax.checkpoint(f), True),
        "vmap": (lambda f: lambda x: jax.vmap(f)(jnp.stack([x, -x]))[0], True),
        "scan": (lambda f: lambda x: lax.scan(lambda c, _: (f(c), None), x, None, length=1)[0], False),
        "cond": (lambda f: lambda x: lax.cond(jnp.sum(x) > -1e9, f, lambda u: u, x), False),
    }


@pytest.mark.parametrize("construct", list(_at_depth()))
def test_the_seed_at_depth(construct):
    """Inside a nested `jit`, `checkpoint` or `vmap` the call is a site and deferred; inside
    `lax.scan` or `lax.cond` it is left as is, and `explain` says so. Plain JAX's value and
    gradient every time."""
    wrap, is_site = _at_depth()[construct]
    f, _, x = seed(*SEED)
    g = wrap(f)
    w = jax.random.normal(jax.random.key(2), x.shape)

    def loss(x):
        return jnp.sum(w * g(x))

    plan = dx.explain(loss, x)
    [call] = plan.recognised
    if is_site:
        assert [s.schedule for s in plan.sites] == ["deferred"] and call.site == 0
    else:
        assert plan.sites == () and call.reason.startswith(f"inside lax.{construct}: left as is")
        assert call.call == "custom_vjp `f`"
    want = jax.value_and_grad(loss)(x)
    for jit in (False, True):
        step = dx.filter_value_and_grad(loss)
        assert_tree_allclose((jax.jit(step) if jit else step)(x), want, rtol=1e-12, atol=1e-12)


def test_recognise_switches_it():
    """`recognise=False` leaves the call as traced; by default a small one is left in place by
    cost, which `recognise="always"` overrides."""
    _, loss, x = seed(*SEED)
    plan = dx.explain(dx.filter_value_and_grad(loss, recognise=False), x)
    assert plan.sites == () and plan.recognised == ()
    _, small, x8 = seed(8, 20)
    [call] = dx.explain(small, x8).recognised
    assert call.site is None and call.reason.startswith("left in place by cost: its function is estimated at about")
    assert '`recognise="always"` rewrites it anyway' in call.reason
    plan = dx.explain(dx.filter_value_and_grad(small, recognise="always"), x8)
    assert [s.schedule for s in plan.sites] == ["deferred"]
    assert_tree_allclose(
        dx.filter_value_and_grad(small, recognise="always")(x8), jax.value_and_grad(small)(x8), rtol=1e-12
    )


# ----------------------------------------------------------------------------- soundness: what is split, what is not
#
# Small programs, rewritten with `recognise="always"` where they can be (the estimate would
# leave them in place), each checked against plain JAX running the same `custom_vjp`.

W = jnp.array([0.5, -1.0, 2.0, 0.25])
P0 = jnp.array([0.3, -0.2, 0.7, 1.1])
ALWAYS = {"recognise": "always"}


def same_as_plain_jax(loss, x=P0, **settings):
    """`dx.filter_value_and_grad(loss, **settings)`, eagerly and under `jax.jit`, gives plain
    JAX's value and gradient; returns the plan."""
    want = jax.value_and_grad(loss)(x)
    for jit in (False, True):
        step = dx.filter_value_and_grad(loss, **settings)
        assert_tree_allclose((jax.jit(step) if jit else step)(x), want, rtol=1e-12, atol=1e-12)
    return dx.explain(dx.filter_value_and_grad(loss, **settings), x)


def _reversible(n: int, steps: int):
    """fdtdx's pattern: a nonlinear leapfrog `x -> (u[steps], u[steps-1])`, whose `custom_vjp`
    keeps only the final state and rebuilds the states backwards from it (time reversal):
    the whole backward needs the residual the forward computes."""

    def step(u, u_prev):
        return 2 * u - u_prev + 0.2 * laplacian(u) + 0.01 * jnp.sin(u)

    def back(u, u_next):  # (the step reversed: u_prev from u, u_next)
        return 2 * u - u_next + 0.2 * laplacian(u) + 0.01 * jnp.sin(u)

    def run(x):
        (u, u_prev), _ = lax.scan(lambda c, _: ((step(*c), c[0]), None), (x, jnp.zeros_like(x)), None, length=steps)
        return u, u_prev

    @jax.custom_vjp
    def simulate(x):
        return run(x)[0]

    def simulate_fwd(x):
        u, u_prev = run(x)
        return u, (u, u_prev)

    def simulate_bwd(res, ct):
        def one(carry, _):
            u, u_prev, a, a_prev = carry  # (the adjoint of u[k+1] = step(u[k], u[k-1]))
            _, pull = jax.vjp(step, u_prev, back(u_prev, u))
            da, da_prev = pull(a)
            return (u_prev, back(u_prev, u), da + a_prev, da_prev), None

        u, u_prev = res
        (_, _, a, a_prev), _ = lax.scan(one, (u, u_prev, ct, jnp.zeros_like(ct)), None, length=steps)
        return (a,)

    simulate.defvjp(simulate_fwd, simulate_bwd)
    return simulate


def test_a_backward_that_needs_the_forward_state_is_left_as_is():
    """fdtdx-style time reversal: nothing of the backward can start before the forward ends,
    so the call is left as it is (the standard schedule), and `explain` names the residual it
    needs and where the forward computes it. With `recognise="always"` it is a site whose
    second part does all the work: plain JAX's gradient either way."""
    simulate = _reversible(32, 300)
    x = jax.random.normal(jax.random.key(3), (32, 32)) * 0.1
    w = jax.random.normal(jax.random.key(4), (32, 32))

    def loss(x):
        return jnp.sum(w * simulate(x))

    plan = same_as_plain_jax(loss, x)
    [call] = plan.recognised
    assert plan.sites == () and call.site is None
    line = _line_of("(u, u_prev), _ = lax.scan(lambda c")
    needs = (
        r"its backward's work \(about .* operations, .* ms\) needs the residuals "
        rf"`res\[0\]` \({FLOAT_NAME}\[32, 32\]\) and "
        rf"`res\[1\]` \({FLOAT_NAME}\[32, 32\]\) that its forward computes \(`scan` at {HERE}:{line} "
    )
    assert re.match(needs, call.reason), call.reason
    assert "so it cannot start before the forward ends: left as is (the standard schedule)" in call.reason
    plan = same_as_plain_jax(loss, x, **ALWAYS)
    assert [s.schedule for s in plan.sites] == ["deferred"]


class _Problem:
    """jax-fem's pattern: the forward sets the parameters on a Python object, and the
    backward's callback reads them back from it."""

    def __init__(self):
        self.params = None

    def set_params(self, p):
        self.params = np.asarray(p)
        return np.zeros((), p.dtype)

    def adjoint(self, ct):
        return np.cos(self.params) * np.asarray(ct)


def _stateful(problem, kind: str):
    """`sin` whose backward reads, through a host callback (`kind`), what the forward wrote."""
    out = jax.ShapeDtypeStruct((4,), FLOAT)

    @jax.custom_vjp
    def solve(p):
        return jnp.sin(p)

    def solve_fwd(p):
        done = jax.pure_callback(problem.set_params, jax.ShapeDtypeStruct((), FLOAT), p)
        return jnp.sin(p) + 0.0 * done, None

    def solve_bwd(_, ct):
        if kind == "pure_callback":
            return (jax.pure_callback(problem.adjoint, out, ct),)
        return (io_callback(problem.adjoint, out, ct),)

    solve.defvjp(solve_fwd, solve_bwd)
    return solve


@pytest.mark.parametrize("kind", ["pure_callback", "io_callback"])
def test_a_backward_callback_is_left_as_is_unless_declared(kind):
    """A callback in the part of the backward that could run early may read what the forward
    wrote (here it does): the call is left as is, with plain JAX's gradient on every call, and
    `explain` says how to declare it. Declared (for a backward whose callback reads nothing the
    forward wrote), the call is a deferred site."""
    problem = _Problem()
    solve = _stateful(problem, kind)

    def loss(p):
        return jnp.sum(W * solve(p))

    for p in (P0, 2.0 * P0):
        plan = same_as_plain_jax(loss, p, **ALWAYS)
    [call] = plan.recognised
    assert plan.sites == () and call.reason.startswith(
        f"the part of its backward that needs no computed residual calls `{kind}` at {HERE}:"
    )
    assert call.reason.endswith("declare it: `dx.recognise_custom_vjp(solve, callbacks_independent=True)`")

    @jax.custom_vjp
    def independent(p):
        return jnp.sin(p)

    out = jax.ShapeDtypeStruct((4,), FLOAT)
    independent.defvjp(
        lambda p: (jnp.sin(p), p), lambda p, ct: (jax.pure_callback(lambda a, b: np.cos(a) * b, out, p, ct),)
    )
    assert dx.recognise_custom_vjp(independent) is independent
    plan = same_as_plain_jax(lambda p: jnp.sum(W * independent(p)), **ALWAYS)
    assert [s.schedule for s in plan.sites] == ["deferred"]
    dx.recognise_custom_vjp(independent, callbacks_independent=False)
    assert dx.explain(dx.filter_value_and_grad(lambda p: jnp.sum(W * independent(p)), **ALWAYS), P0).sites == ()


def test_a_backward_that_touches_a_ref_is_left_as_is():
    @jax.custom_vjp
    def f(p):
        return jnp.sin(p)

    def f_bwd(p, ct):
        box = jax.new_ref(jnp.zeros_like(ct))
        box[...] = ct * jnp.cos(p)
        return (box[...],)

    f.defvjp(lambda p: (jnp.sin(p), p), f_bwd)
    plan = same_as_plain_jax(lambda p: jnp.sum(W * f(p)), **ALWAYS)
    [call] = plan.recognised
    assert plan.sites == ()
    assert call.reason.startswith("the part of its backward that needs no computed residual uses a `jax.Ref`, which")


def test_recognise_custom_vjp_takes_a_custom_vjp():
    with pytest.raises(
        TypeError,
        match=r"`dx.recognise_custom_vjp`: `f` must be a `jax.custom_vjp` function with its "
        r"rules defined \(`f.defvjp\(f_fwd, f_bwd\)`\), but got <PjitFunction",
    ):
        dx.recognise_custom_vjp(jnp.sin)
    with pytest.raises(TypeError, match="must be a `jax.custom_vjp` function with its rules defined"):
        dx.recognise_custom_vjp(jax.custom_vjp(jnp.sin))


# ----------------------------------------------------------------------------- soundness: the rules as users write them
#
# Each rule is deliberately not the derivative (a factor, an offset), so that a gradient not
# taken from the rule shows: plain JAX's result is the rule's.


@jax.custom_vjp
def _two_outputs(x, y):
    return x * 2.0, jnp.sin(y)


def _two_outputs_fwd(x, y):
    assert type(x) is jax.custom_derivatives.CustomVJPPrimal  # (symbolic_zeros: told what is perturbed)
    return (x.value * 2.0, jnp.sin(y.value)), (y.value, x.perturbed, y.perturbed)


def _two_outputs_bwd(res, ct):
    y, x_perturbed, y_perturbed = res
    ct_a, ct_b = ct
    zero_b = type(ct_b) is jax.custom_derivatives.SymbolicZero
    ct_y = None if zero_b or not y_perturbed else 3.0 * ct_b * jnp.cos(y)
    return (None if type(ct_a) is jax.custom_derivatives.SymbolicZero else 5.0 * ct_a, ct_y)


_two_outputs.defvjp(_two_outputs_fwd, _two_outputs_bwd, symbolic_zeros=True)


@ft.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _power(x, n):
    return x**n


_power.defvjp(lambda x, n: (x**n, x), lambda n, x, ct: (3.0 * n * x ** (n - 1) * ct,))


@jax.custom_vjp
def _with_integers(x, k, flag):
    return x * k.astype(x.dtype), k + 1, flag


_with_integers.defvjp(
    lambda x, k, flag: ((x * k.astype(x.dtype), k + 1, flag), k),
    lambda k, ct: (2.0 * ct[0] * k.astype(ct[0].dtype), None, None),
)


@jax.custom_vjp
def _with_key(x, key):
    return x + jax.random.normal(key, x.shape)


_with_key.defvjp(lambda x, key: (x + jax.random.normal(key, x.shape), None), lambda _, ct: (2.0 * ct, None))

GRID = jnp.array([0.5, 1.0, 1.5, 2.0])


@jax.custom_vjp
def _on_grid(u):
    return u * GRID


_on_grid.defvjp(lambda u: (u * GRID, None), lambda _, ct: (2.0 * ct * GRID,))


@jax.custom_vjp
def _outer(x):
    return _on_grid(x) * 2.0


def _outer_fwd(x):
    y, pull = jax.vjp(_on_grid, x)
    return 2.0 * y, (x,)


def _outer_bwd(res, ct):
    (x,) = res
    return (jax.vjp(_on_grid, x)[1](2.0 * ct)[0] + 1.0,)


_outer.defvjp(_outer_fwd, _outer_bwd)

KEY = jax.random.key(7)
CASES = {
    # (the loss, the schedule it gets, with `recognise="always"`)
    "symbolic zeros, an unused output": (lambda p: jnp.sum(W * _two_outputs(p, p + 1.0)[0]), "deferred"),
    "symbolic zeros, both outputs": (
        lambda p: jnp.sum(W * _two_outputs(p, p)[0]) + jnp.sum(W * _two_outputs(p, 2.0 * p)[1] ** 2),
        ("deferred", "standard"),
    ),
    "symbolic zeros, an input not differentiated": (lambda p: jnp.sum(W * _two_outputs(W, p)[1]), "deferred"),
    "symbolic zeros, no input differentiated": (lambda p: jnp.sum(W * _two_outputs(W, W)[1]) + jnp.sum(p), None),
    "nondiff_argnums": (lambda p: jnp.sum(W * _power(p, 3)), "deferred"),
    "integer and boolean inputs and outputs": (
        lambda p: jnp.sum(W * _with_integers(p, jnp.arange(4.0).astype(int), jnp.bool_(True))[0]),
        "deferred",
    ),
    "a PRNG key (a float0 cotangent)": (lambda p: jnp.sum(W * _with_key(p, KEY)), "deferred"),
    "closed-over module-level constants": (lambda p: jnp.sum(W * _on_grid(p)), "deferred"),
    "a custom_vjp inside a custom_vjp": (lambda p: jnp.sum(W * _outer(p)), "deferred"),
    "under vmap, with symbolic zeros": (
        lambda p: jnp.sum(jax.vmap(lambda q: _two_outputs(q, q)[0])(jnp.stack([p, -p])) * W),
        "deferred",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rules_as_users_write_them(case):
    """Each rule's value and gradient are plain JAX's, eagerly and under `jit`, as a site."""
    loss, schedule = CASES[case]
    plan = same_as_plain_jax(loss, **ALWAYS)
    schedules = tuple(s.schedule for s in plan.sites)
    if schedule is None:  # (nothing to differentiate in the call: left as is)
        assert schedules == () and "none of its inputs depends on the differentiated" in plan.recognised[0].reason
    else:
        assert schedules == (schedule if isinstance(schedule, tuple) else (schedule,)), str(plan)


def test_a_rule_closing_over_a_value_of_the_loss_is_left_as_is():
    """A rule closing over a value computed in the loss cannot run outside the loss's trace:
    left as is (the whole call then runs as Equinox's would, as before); plain JAX's gradient."""

    def loss(p):
        scale = jax.lax.stop_gradient(jnp.cos(p))
        f = jax.custom_vjp(lambda u: u * scale)
        f.defvjp(lambda u: (u * scale, None), lambda _, ct: (2.0 * ct * scale,))
        return jnp.sum(W * f(p))

    plan = same_as_plain_jax(loss, **ALWAYS)
    [call] = plan.recognised
    assert call.reason.startswith("its forward rule closes over a value computed in the function (a tracer of the")
    assert "closes over a value computed in the function" in plan.fallback


def test_a_function_closing_over_a_differentiated_value_its_rules_do_not_read():
    """JAX differentiates a custom_vjp through its rules alone: what its function closes over
    (here a value of the differentiated input) plays no part, and the site gives plain JAX's
    value and gradient (deferax raised JAX's `CustomVJPException` there before: it
    differentiated the traced program, where the function's closure is an operand)."""

    def loss(p):
        scale = jnp.cos(p)
        f = jax.custom_vjp(lambda u: u * scale)
        f.defvjp(lambda u: (2.0 * u, None), lambda _, ct: (3.0 * ct,))
        return jnp.sum(W * f(p))

    plan = same_as_plain_jax(loss, **ALWAYS)
    assert [s.schedule for s in plan.sites] == ["deferred"]


def test_an_expensive_function_inside_a_custom_vjp_and_the_reverse(counter):
    """An `ExpensiveFn` inside a custom_vjp's rules keeps its own schedule (the call is left
    as is); a custom_vjp inside an `ExpensiveFn`'s implementations is its own business (the
    site is deferred). Plain JAX's value and gradient both ways."""
    site = make(ref, ("fwd", "bwd"), counter, name="sim")

    @jax.custom_vjp
    def around(x):
        return 2.0 * site(x)

    def around_bwd(x, ct):
        return (3.0 * jax.vjp(site, x)[1](ct)[0],)

    around.defvjp(lambda x: (2.0 * site(x), x), around_bwd)
    plan = same_as_plain_jax(lambda p: jnp.sum(W * around(p)), **ALWAYS)
    [call] = plan.recognised
    assert call.reason == "its function calls a deferax site, which keeps its own schedule"

    inner = dx.ExpensiveFn(fwd=_on_grid, bwd=lambda x, y, ct: jax.vjp(_on_grid, x)[1](ct)[0], name="grid")
    plan = same_as_plain_jax(lambda p: jnp.sum(W * inner(p)), **ALWAYS)
    assert [(s.name, s.schedule) for s in plan.sites] == [("grid", "deferred")] and plan.recognised == ()


def test_python_in_the_rules_runs_as_jax_runs_it():
    """The forward rule's and the backward rule's Python run once a call eagerly, and once a
    trace under `jit`, as in plain JAX (the function's own Python runs when deferax traces
    the loss, as for any function in it)."""
    runs = collections.Counter()

    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def f_fwd(x):
        runs["fwd"] += 1
        return jnp.sin(x), x

    def f_bwd(x, ct):
        runs["bwd"] += 1
        return (2.0 * ct * jnp.cos(x),)

    f.defvjp(f_fwd, f_bwd)

    def loss(p):
        return jnp.sum(W * f(p))

    for name, step in (("plain JAX", jax.value_and_grad(loss)), ("deferax", dx.filter_value_and_grad(loss, **ALWAYS))):
        runs.clear()
        step(P0), step(P0)
        assert (runs["fwd"], runs["bwd"]) == (2, 2), name
        jitted = jax.jit(step)
        runs.clear()
        jitted(P0), jitted(2.0 * P0)
        assert (runs["fwd"], runs["bwd"]) == (1, 1), name


# Programs whose `custom_vjp` rules count their Python runs, each called as plain JAX calls it:
# at the top level; under `vmap` in the loss (JAX batches the rules, a new backward function
# every trace); beside an input nothing differentiates (the residuals JAX passes the backward
# depend on which inputs are perturbed); with rules defined in the loss (new every trace); after
# a deferred site, whose backward pass the analysis traces through the call; read by the aux
# alone (JAX never calls the backward); and with `symbolic_zeros`, an output unread (JAX passes
# the backward a symbolic zero for it).


def _counted(runs):
    """`f(x, c) = sin(x) * c`, a `custom_vjp` whose rules count their Python runs in `runs`
    (its backward gives twice the derivative: plain JAX's gradient is the rule's)."""

    @jax.custom_vjp
    def f(x, c):
        return jnp.sin(x) * c

    def f_fwd(x, c):
        runs["fwd"] += 1
        return jnp.sin(x) * c, (x, c)

    def f_bwd(res, ct):
        runs["bwd"] += 1
        x, c = res
        return 2.0 * ct * c * jnp.cos(x), 2.0 * ct * jnp.sin(x)

    f.defvjp(f_fwd, f_bwd)
    return f


def _counted_scale(runs):
    """`g(x) = 3 x`, a `custom_vjp` counting as `_counted`, whose backward (`6 ct`) reads nothing
    of the forward: a site's output through it may be deferred."""

    @jax.custom_vjp
    def g(x):
        return 3.0 * x

    def g_fwd(x):
        runs["fwd"] += 1
        return 3.0 * x, None

    def g_bwd(_, ct):
        runs["bwd"] += 1
        return (6.0 * ct,)

    g.defvjp(g_fwd, g_bwd)
    return g


def _counted_pair(runs):
    """`h(x) = (sin x, cos x)`, a `custom_vjp` with `symbolic_zeros` counting as `_counted`."""

    @jax.custom_vjp
    def h(x):
        return jnp.sin(x), jnp.cos(x)

    def h_fwd(x):
        runs["fwd"] += 1
        return (jnp.sin(x.value), jnp.cos(x.value)), x.value

    def h_bwd(x, cts):
        runs["bwd"] += 1
        ct_sin, ct_cos = (0.0 if isinstance(ct, jax.custom_derivatives.SymbolicZero) else ct for ct in cts)
        return (2.0 * (ct_sin * jnp.cos(x) - ct_cos * jnp.sin(x)),)

    h.defvjp(h_fwd, h_bwd, symbolic_zeros=True)
    return h


C = jnp.array([1.0, 2.0, 0.5, -1.0])
CUBE = dx.ExpensiveFn(fwd=lambda x: x**3, bwd=lambda x, y, ct: 3.0 * x**2 * ct, name="cube")
COUNTED = [
    "at the top level",
    "under vmap",
    "beside a constant",
    "defined in the loss",
    "after a deferred site",
    "read by the aux alone",
    "with symbolic zeros",
]


def _counted_loss(program: str, runs):
    """`(loss, has_aux)` of `program` (one of `COUNTED`), its rules counting in `runs`."""
    f, g, h = _counted(runs), _counted_scale(runs), _counted_pair(runs)
    losses = {
        "at the top level": lambda p: jnp.sum(W * f(p, p)),
        "under vmap": lambda p: jnp.sum(W * jax.vmap(f)(p, p)),
        "beside a constant": lambda p: jnp.sum(W * f(p, C)),
        "defined in the loss": lambda p: jnp.sum(W * _counted(runs)(p, p)),
        "after a deferred site": lambda p: jnp.sum(W * g(CUBE(p))),
        "read by the aux alone": lambda p: (jnp.sum(W * p**2), f(p, p)),
        "with symbolic zeros": lambda p: jnp.sum(W * h(p)[0]),
    }
    return losses[program], program == "read by the aux alone"


def _runs_when_called(step, runs) -> dict:
    """How often the rules' Python runs (`runs`) for each of two calls of `step` on `P0`, and
    of two on a stack of two inputs under `vmap`, eagerly and under `eqx.filter_jit`."""
    found = {}
    ways = {
        "eager": (step, P0),
        "jit": (eqx.filter_jit(step), P0),
        "vmap": (jax.vmap(step), jnp.stack([P0, 0.5 * P0])),
        "vmap under jit": (jax.jit(jax.vmap(step)), jnp.stack([P0, 0.5 * P0])),
    }
    for way, (call, x) in ways.items():
        found[way] = []
        for scale in (1.0, 2.0):
            runs.clear()
            jax.block_until_ready(call(scale * x))
            found[way].append((runs["fwd"], runs["bwd"]))
    return found


# (With recognise="always", a call that only the aux reads is a site all the same, and the split
# traces its backward rule, which JAX never runs there.)
RECOGNISED = [(p, r) for p in COUNTED for r in (True, False, "always") if (p, r) != ("read by the aux alone", "always")]


@pytest.mark.parametrize(("program", "recognise"), RECOGNISED)
def test_python_in_the_rules_runs_as_often_as_in_plain_jax(program, recognise):
    """The forward rule's and the backward rule's Python run as often as under plain JAX's
    `jax.value_and_grad` (and Equinox's) on the same program called the same way: once a call
    eagerly, a first call included, and once a trace under `jit`, at the top level and under
    `vmap`, whether or not the calls are recognised. (The check that a rule can run outside
    the trace that made it runs the backward rule once; the stages evaluate that run's trace.)"""
    runs = collections.Counter()
    loss, has_aux = _counted_loss(program, runs)
    want = _runs_when_called(jax.value_and_grad(loss, has_aux=has_aux), runs)
    assert _runs_when_called(eqx.filter_value_and_grad(loss, has_aux=has_aux), runs) == want
    assert want["eager"][0][0] == 1 and want["jit"][1] == (0, 0)  # (the call is differentiated, traced once)
    step = dx.filter_value_and_grad(loss, has_aux=has_aux, recognise=recognise)
    assert _runs_when_called(step, runs) == want, (program, recognise)
    if program == "after a deferred site" and recognise != "always":  # (recognised, the call is a site too)
        assert [s.schedule for s in dx.explain(step, P0).sites] == ["deferred"]  # (its backward pass went through it)
    assert_tree_allclose(step(P0), jax.value_and_grad(loss, has_aux=has_aux)(P0))


# ----------------------------------------------------------------------------- only where it pays


@jax.custom_vjp
def straight_through(x):
    """Rounding, differentiated as the identity (a straight-through estimator)."""
    return jnp.round(x)


straight_through.defvjp(lambda x: (jnp.round(x), None), lambda _, ct: (ct,))


@jax.custom_vjp
def clip_gradient(x):
    return x


clip_gradient.defvjp(lambda x: (x, None), lambda _, ct: (jnp.clip(ct, -1.0, 1.0),))


class _MLP(eqx.Module):
    layers: list

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        sizes = [(8, 32), (32, 32), (32, 1)]
        self.layers = [eqx.nn.Linear(n_in, n_out, key=k) for (n_in, n_out), k in zip(sizes, keys, strict=True)]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = clip_gradient(straight_through(4.0 * jax.nn.relu(layer(x))) / 4.0)
        return self.layers[-1](x)[0]


def test_a_training_step_of_cheap_custom_vjps_is_equinox_s():
    """Straight-through estimators and gradient clipping cost next to nothing: each call is
    left in place by cost, and the jitted step compiles to Equinox's program, with its
    gradients."""
    model = _MLP(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, 8))
    y = jax.random.normal(jax.random.key(2), (16,))

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    plan = dx.explain(loss, model, x, y)
    assert plan.sites == () and len(plan.recognised) == 4
    assert all(r.reason.startswith("left in place by cost: its function is estimated at") for r in plan.recognised)
    step = eqx.filter_jit(dx.filter_value_and_grad(loss))
    ops = hlo_ops(lambda *a: dx.filter_value_and_grad(loss)(*a), model, x, y)
    assert ops == hlo_ops(lambda *a: eqx.filter_value_and_grad(loss)(*a), model, x, y)
    assert_tree_allclose(
        step(model, x, y), eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, x, y), rtol=0, atol=0
    )
