"""What cannot be evaluated again outside the trace of the loss falls back, and says why:
custom rules that close over values of the loss run as Equinox would, effects that must
happen once (an `io_callback`, writes to a `jax.Ref` from outside) are not run ahead, and
state passed through `jax.Ref`s is read as the program says."""

import collections
import functools as ft
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx

from .helpers import P0, W, assert_tree_allclose, make, plain, ref

# ---------------------------------------------------------------------- custom rules that close over values of the loss


def _scaled_by_cos(x, kind):
    """`u -> u * scale` with `scale = stop_gradient(cos(x))` computed in the loss, and a
    custom rule that closes over `scale` (as fdtdx writes its time-reversal gradient)."""
    scale = jax.lax.stop_gradient(jnp.cos(x))
    if kind == "custom_vjp":
        f = jax.custom_vjp(lambda u: u * scale)
        f.defvjp(lambda u: (u * scale, None), lambda _, ct: (ct * scale,))
    else:
        f = jax.custom_jvp(lambda u: u * scale)
        f.defjvp(
            lambda primals, tangents: (primals[0] * scale, 2.0 * tangents[0] * scale)
        )  # (a rule that is not the derivative)
    return f


@pytest.mark.parametrize("kind", ["custom_vjp", "custom_jvp"])
def test_custom_rule_closing_over_a_loss_value_runs_as_equinox(kind, counter):
    """A rule that closes over a value computed in the loss cannot run outside the trace it
    came from: the whole call runs as Equinox's does (with or without a site; the site on
    its standard schedule), and `explain` says why. Equinox is the reference (the rule is
    deliberately not the derivative for `custom_jvp`: its result is what Equinox returns)."""
    f = make(ref, ("fwd", "bwd", "fused"), counter, name="sim")
    cases = [
        (lambda p: jnp.sum(_scaled_by_cos(p, kind)(p) ** 2), {"fwd": 0, "bwd": 0, "fused": 0}),
        (lambda p: jnp.sum(W * f(_scaled_by_cos(p, kind)(p))), {"fwd": 1, "bwd": 1, "fused": 0}),
    ]
    for loss, counts in cases:
        plan = dx.explain(loss, P0)
        assert plan.fallback.startswith(f"a {kind} rule at {os.path.relpath(__file__)}:"), plan.fallback
        assert "closes over a value computed in the function" in plan.fallback
        assert "runs as `equinox.filter_value_and_grad` would" in str(plan)
        assert all(s.schedule == "standard" and s.reason == plan.fallback for s in plan.sites)
        for jit in (False, True):
            step = dx.filter_value_and_grad(loss)
            reference = eqx.filter_value_and_grad(loss)
            step, reference = (eqx.filter_jit(step), eqx.filter_jit(reference)) if jit else (step, reference)
            jax.effects_barrier()
            counter.reset()
            got = jax.block_until_ready(step(P0))
            jax.effects_barrier()
            assert counter.as_dict() == counts, (jit, counter.as_dict())
            assert_tree_allclose(got, reference(P0))
    # the plain-JAX reference agrees with Equinox here
    assert_tree_allclose(dx.filter_value_and_grad(cases[0][0])(P0), jax.value_and_grad(cases[0][0])(P0))


# A module-level custom_vjp closing over a module-level array (a grid, a material field), as
# most scientific code writes one. Its rule is deliberately not the derivative (twice it), so
# that a result not taken from the rule shows: plain JAX's result is the rule's.
GRID = jnp.array([0.5, 1.0, 1.5, 2.0])


@jax.custom_vjp
def _on_grid(u):
    return u * GRID


_on_grid.defvjp(lambda u: (u * GRID, None), lambda _, ct: (2.0 * ct * GRID,))


def test_custom_vjp_closing_over_a_module_level_array_leaves_a_site_deferred(counter):
    """The rule's closed-over constant (the grid, the first of the call's operands) is no input
    of the user's: the check holds it fixed, the call is not refused, and a deferrable site
    beside it (its input through the rule, or its output) is deferred, one `fused` a call."""
    f = make(ref, ("fwd", "bwd", "fused"), counter, name="sim")
    # (the loss, and the same program in plain JAX: the site replaced by the function it stands for)
    losses = [
        (
            lambda p: jnp.sum(W * f(_on_grid(p))) + jnp.sum(_on_grid(p) ** 2),
            lambda p: jnp.sum(W * plain(_on_grid(p))) + jnp.sum(_on_grid(p) ** 2),
        ),
        (lambda p: jnp.sum(W * _on_grid(f(p))), lambda p: jnp.sum(W * _on_grid(plain(p)))),
    ]
    for loss, reference in losses:
        plan = dx.explain(loss, P0)
        assert plan.fallback is None, plan.fallback
        assert [s.schedule for s in plan.sites] == ["deferred"]
        assert "runs as `equinox.filter_value_and_grad` would" not in str(plan)
        for jit in (False, True):
            step = dx.filter_value_and_grad(loss)
            step = eqx.filter_jit(step) if jit else step
            jax.effects_barrier()
            counter.reset()
            got = jax.block_until_ready(step(P0))
            jax.effects_barrier()
            assert counter.as_dict() == {"fwd": 0, "bwd": 0, "fused": 1}, jit
            assert_tree_allclose(got, jax.value_and_grad(reference)(P0))
    # the rule was used (twice the derivative), by deferax as by plain JAX
    grad = dx.filter_grad(losses[1][0])(P0)
    assert_tree_allclose(grad, 2.0 * jax.grad(lambda p: jnp.sum(W * plain(p) * GRID))(P0))


# ----------------------------------------------------------------------------- effects that must run once


class _Draws:
    """A host source of weights: each run returns the next draw, and counts."""

    def __init__(self):
        self.runs = 0

    def __call__(self):
        self.runs += 1
        return np.asarray(W) * (1.0 + self.runs)


@pytest.mark.parametrize("ordered", [True, False])
def test_io_callback_in_the_loss_runs_once_value_and_gradient_from_one_run(ordered, counter):
    """An `io_callback` that reads weights, for the cotangent or for the site's input: it
    runs once a call, as under Equinox, and value and gradient come from that one run (the
    site stays standard, and `explain` says why)."""
    f = make(ref, ("fwd", "bwd", "fused"), counter, name="sim")
    w = jax.ShapeDtypeStruct((4,), jnp.float64)

    def weights(draws):
        return jax.experimental.io_callback(draws, w, ordered=ordered)

    losses = {
        "cotangent": lambda p, draws: jnp.sum(weights(draws) * f(p)),  # io weights
        "input": lambda p, draws: jnp.sum(W * f(p * weights(draws))),
    }
    # one that no site needs ahead runs once, in the last stage: the site is deferred (on
    # the basis schedule, whose basis cotangents are computed from what they need alone)
    losses["not needed ahead"] = lambda p, draws: jnp.log(jnp.sum(W * f(p))) + jnp.sum(weights(draws) * p)
    for name, loss in losses.items():
        site = dx.explain(ft.partial(loss, draws=_Draws()), P0).sites[0]
        counts = {"fwd": 1, "bwd": 1, "fused": 0}
        if name == "not needed ahead":
            assert site.schedule == "deferred-basis" and site.k == 1
            counts = {"fwd": 0, "bwd": 0, "fused": 1}
        else:
            assert site.schedule == "standard", name
            assert site.reason.startswith(
                f"computing its input and cotangent ahead of the expensive calls runs `io_callback` at \
{os.path.relpath(__file__)}:"
            ), site.reason
            assert site.reason.endswith("which must happen once a call, with the value")
        for jit in (False, True):
            draws, reference_draws = _Draws(), _Draws()
            step = dx.filter_value_and_grad(ft.partial(loss, draws=draws))
            reference = eqx.filter_value_and_grad(ft.partial(loss, draws=reference_draws))
            step, reference = (eqx.filter_jit(step), eqx.filter_jit(reference)) if jit else (step, reference)
            for call in range(1, 3):
                jax.effects_barrier()
                counter.reset()
                got = jax.block_until_ready(step(P0))
                jax.effects_barrier()
                assert draws.runs == call and counter.as_dict() == counts, (name, jit, draws.runs, counter.as_dict())
                assert_tree_allclose(got, reference(P0))
                assert reference_draws.runs == call


# ----------------------------------------------------------------------------- state in `jax.Ref`s


def _bwd_through_a_ref(x, y, ct):
    """`sin`'s backward rule that reads `y` only back from a `jax.Ref` it wrote it to."""
    box = jax.new_ref(jnp.zeros_like(y))
    box[...] = y
    return ct * jnp.sqrt(1.0 - box[...] ** 2)  # cos(x) for |x| < pi/2


def _write(box, value):
    box[...] = value


def _bwd_through_a_ref_in_a_jit(x, y, ct):
    box = jax.new_ref(jnp.zeros_like(y))
    jax.jit(_write)(box, y)  # written in a nested jaxpr
    return ct * jnp.sqrt(1.0 - box[...] ** 2)


def _bwd_through_a_ref_in_a_loop(x, y, ct):
    box = jax.new_ref(jnp.zeros_like(y))
    jax.lax.fori_loop(0, 2, lambda i, c: (_write(box, y), c)[1], 0.0)  # written in a loop body
    return ct * jnp.sqrt(1.0 - box[...] ** 2)


OUTSIDE = jax.new_ref(jnp.zeros(4))


def _bwd_keeping_y_outside(x, y, ct):
    OUTSIDE[...] = y  # read there after the call
    return ct * jnp.cos(x)


@pytest.mark.parametrize(
    "bwd", [_bwd_through_a_ref, _bwd_through_a_ref_in_a_jit, _bwd_through_a_ref_in_a_loop, _bwd_keeping_y_outside]
)
def test_bwd_that_passes_y_through_a_ref_reads_y(bwd):
    """A `bwd` that reads `y` back from a `jax.Ref`, or leaves it in one from outside,
    reads `y`: no `fused` is made from it, and the gradient is `sin`'s."""
    runs = collections.Counter()
    counted = lambda name, fn: lambda *a: (jax.debug.callback(lambda: runs.update([name])), fn(*a))[1]  # noqa: E731
    f = dx.ExpensiveFn(fwd=counted("fwd", jnp.sin), bwd=counted("bwd", bwd), name="sin")
    loss = lambda p: jnp.sum(W * f(p))  # noqa: E731
    site = dx.explain(loss, P0).sites[0]
    assert site.schedule == "standard" and site.reason.startswith("no `fused` implementation, and its `bwd` reads `y`")
    OUTSIDE[...] = jnp.zeros(4)
    for jit in (False, True):
        step = eqx.filter_jit(dx.filter_value_and_grad(loss)) if jit else dx.filter_value_and_grad(loss)
        runs.clear()
        got = jax.block_until_ready(step(P0))
        jax.effects_barrier()
        assert runs == {"fwd": 1, "bwd": 1}, (jit, runs)
        assert_tree_allclose(got, jax.value_and_grad(lambda p: jnp.sum(W * jnp.sin(p)))(P0))
    if bwd is _bwd_keeping_y_outside:
        assert_tree_allclose(OUTSIDE[...], jnp.sin(P0))


def _through_a_ref(y):
    box = jax.new_ref(jnp.zeros_like(y))
    box[...] = y
    return box[...]


def test_loss_that_passes_values_through_refs(counter):
    """A loss that passes the output through a `jax.Ref` depends on it there (it was taken
    as not, and got a zero gradient); one that passes a coefficient through one is deferred
    with the coefficient it wrote (a read there was evaluated without the write)."""
    f = make(ref, ("fwd", "bwd", "fused"), counter, name="sim")
    square = lambda p: jnp.sum(W * _through_a_ref(f(p)) ** 2)  # noqa: E731
    site = dx.explain(square, P0).sites[0]
    assert site.schedule == "standard" and site.reason.startswith("its cotangent depends on its own output"), (
        site.reason
    )
    linear = lambda p: jnp.sum(_through_a_ref(2.0 * p) * f(p))  # noqa: E731
    assert dx.explain(linear, P0).sites[0].schedule == "deferred"
    for loss, reference, counts in (
        (square, lambda p: jnp.sum(W * plain(p) ** 2), {"fwd": 1, "bwd": 1, "fused": 0}),
        (linear, lambda p: jnp.sum(2.0 * p * plain(p)), {"fwd": 0, "bwd": 0, "fused": 1}),
    ):
        for jit in (False, True):
            step = eqx.filter_jit(dx.filter_value_and_grad(loss)) if jit else dx.filter_value_and_grad(loss)
            jax.effects_barrier()
            counter.reset()
            got = jax.block_until_ready(step(P0))
            jax.effects_barrier()
            assert counter.as_dict() == counts, (jit, counter.as_dict())
            assert_tree_allclose(got, jax.value_and_grad(reference)(P0))


def test_loss_that_writes_a_ref_from_outside():
    """A loss that writes a `jax.Ref` from outside: a write that its cotangent needs keeps
    the site standard (it would happen twice); one it does not need happens once a call, in
    the last stage, and the site is deferred. As under Equinox."""
    counter = jax.new_ref(jnp.zeros(()))
    coefficient = jax.new_ref(jnp.zeros(4))
    runs = collections.Counter()
    f = make(ref, ("fwd", "bwd", "fused"), name="sim")

    def loss(p, needed):
        counter[...] += 1.0
        coefficient[...] = 2.0 * jax.lax.stop_gradient(p)
        c = coefficient[...] if needed else W
        return jnp.sum(c * f(p))

    for needed, schedule in ((True, "standard"), (False, "deferred")):
        site = dx.explain(ft.partial(loss, needed=needed), P0).sites[0]
        assert site.schedule == schedule, needed
        if needed:
            assert site.reason.startswith(
                "computing its input and cotangent ahead of the expensive calls writes to a `jax.Ref` from outside \
the function at "
            )
        for jit in (False, True):
            counter[...] = 0.0
            step = dx.filter_value_and_grad(ft.partial(loss, needed=needed))
            step = eqx.filter_jit(step) if jit else step
            got = [jax.block_until_ready(step(P0)) for _ in range(2)]
            assert float(counter[...]) == 2.0, (needed, jit)
            runs.clear()
            want = eqx.filter_value_and_grad(ft.partial(loss, needed=needed))
            for g in got:
                assert_tree_allclose(
                    g, jax.value_and_grad(lambda p, c=(2.0 * P0 if needed else W): jnp.sum(c * plain(p)))(P0)
                )
            assert_tree_allclose(got[0], want(P0))
