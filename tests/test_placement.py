"""Where the two halves of a JAX-native deferred site run (`_placement.halves_run`), decided
for each platform and tested on the CPU by pretending the platform
(`_runtime.SWITCHES.platform`): on an accelerator no deferax callback starts JAX work, the
halves run in the compiled program, and two loops of equal length are stepped in one. The
values and gradients are plain JAX's on every placement. Several devices: `test_devices.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import deferax as dx
from deferax import _runtime
from deferax._concurrency import _placement
from deferax._concurrency import _threads as _concurrent

N, STEPS = 16, 40
rng = np.random.default_rng(0)
C = jnp.asarray(rng.uniform(0.1, 0.2, size=(N, N)))
g = jnp.asarray(np.sin(np.arange(STEPS) / 3.0))
W = jnp.asarray(rng.normal(size=(N, N)))


def laplacian(u):
    p = jnp.pad(u, 1)
    return p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4 * u


def forward(x):  # the seed's leapfrog stepper, small
    def step(carry, gk):
        u, u_prev = carry
        return (2 * u - u_prev + C * laplacian(u) + gk * x, u), None

    zero = jnp.zeros_like(x)
    return lax.scan(step, (zero, zero), g)[0][0]


def adjoint(v):  # its transpose, run backwards from the cotangent alone: a loop of the same length
    def step(carry, gk):
        b, b_next, acc = carry
        return (2 * b - b_next + laplacian(C * b), b, acc + gk * b), None

    zero = jnp.zeros_like(v)
    return lax.scan(step, (v, zero, zero), g[::-1])[0][2]


@jax.custom_vjp
def seed(x):
    return forward(x)


seed.defvjp(lambda x: (forward(x), None), lambda _, v: (adjoint(v),))


def reference(x):  # plain JAX through the stepper itself: an independent gradient
    return jnp.sum(W * forward(x)) + jnp.sum(x**2)


sites = {
    "custom_vjp": seed,
    "fwd + adjoint": dx.ExpensiveFn(fwd=forward, adjoint=lambda x, ct: adjoint(ct), name="wave"),
    "dx.fuse": dx.ExpensiveFn(
        fwd=forward, bwd=lambda x, y, ct: adjoint(ct), fused=dx.fuse(forward, lambda x, ct: adjoint(ct)), name="wave"
    ),
}
x0 = jnp.asarray(rng.normal(size=(N, N)))


def loss_of(site):
    return lambda x: jnp.sum(W * site(x)) + jnp.sum(x**2)


def no_callback(*args):
    raise AssertionError("a deferax callback started the halves where they must run in the program")


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("kind", list(sites))
def test_on_an_accelerator_the_halves_run_in_the_program_with_one_loop(platform, kind, monkeypatch):
    monkeypatch.setattr(_runtime.SWITCHES, "platform", platform)
    monkeypatch.setattr(_concurrent, "_both_from_callback", no_callback)
    monkeypatch.setattr(_concurrent, "_both", no_callback)  # (no thread either)
    step = dx.filter_value_and_grad(loss_of(sites[kind]), recognise="always")
    # (traced apart: JAX keeps a function's trace, and the recording below is compiled in when traced)
    program = str(jax.make_jaxpr(dx.filter_value_and_grad(loss_of(sites[kind]), recognise="always"))(x0))
    assert "callback" not in program
    assert program.count("scan[") == 1, program  # the forward's and the adjoint's loops, stepped in one
    ref_value, ref_grad = jax.value_and_grad(reference)(x0)
    for run in (jax.jit(step), step):
        with dx.record() as timeline:
            value, grad = run(x0)
        np.testing.assert_allclose(value, ref_value, rtol=1e-10)
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-9, atol=1e-12)
        assert timeline.counts() == {"fwd": 1, "adjoint": 1}  # each half once, in the program
    plan = dx.explain(jax.jit(step), x0)
    (site,) = plan.sites
    assert site.schedule == "deferred"
    assert site.halves.startswith(f"program: one {platform} device runs one program at a time"), site.halves
    assert "where the halves run:" in str(plan)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the callback placement is a CPU's (runs it)")
def test_on_one_cpu_device_a_traced_step_starts_both_halves_from_one_callback(monkeypatch):
    started = []
    both = _concurrent._both_from_callback

    def spied(*args):
        started.append(1)
        return both(*args)

    monkeypatch.setattr(_concurrent, "_both_from_callback", spied)
    step = jax.jit(dx.filter_value_and_grad(loss_of(sites["fwd + adjoint"])))
    value, grad = step(x0)
    ref_value, ref_grad = jax.value_and_grad(reference)(x0)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert started == [1]
    assert _placement.halves_run(eager=False).where == "callback"
    assert _placement.halves_run(eager=True).where == "threads"


def test_loops_of_different_lengths_run_one_after_the_other(monkeypatch):
    monkeypatch.setattr(_runtime.SWITCHES, "platform", "tpu")
    longer = jnp.concatenate([g, g])

    def adjoint_longer(v):
        return lax.scan(lambda b, gk: (b * 0.5 + 0.01 * gk * laplacian(b), None), v, longer)[0]  # (stable)

    site = dx.ExpensiveFn(
        fwd=forward, adjoint=lambda x, ct: jax.vjp(forward, x)[1](ct)[0] + 0 * adjoint_longer(ct), name="w"
    )
    step = dx.filter_value_and_grad(loss_of(site))
    program = str(jax.make_jaxpr(step)(x0))
    assert program.count("scan[") >= 3 and "callback" not in program  # (vjp's loops, and the longer one)
    for run in (jax.jit(step), step):  # (in the program, and eagerly: one half after the other)
        np.testing.assert_allclose(run(x0)[1], jax.grad(reference)(x0), rtol=1e-9, atol=1e-12)


def test_a_loop_run_backwards_is_stepped_with_one_run_forwards(monkeypatch):
    """`lax.scan(..., reverse=True)` in one half: its inputs and outputs are reversed in the one loop."""
    monkeypatch.setattr(_runtime.SWITCHES, "platform", "tpu")

    def adjoint_reversed(v):  # the same adjoint, reading `g` backwards with reverse=True, with its trajectory
        def step(carry, gk):
            b, b_next, acc = carry
            return (2 * b - b_next + laplacian(C * b), b, acc + gk * b), jnp.sum(b)

        zero = jnp.zeros_like(v)
        (_, _, acc), trail = lax.scan(step, (v, zero, zero), g, reverse=True)
        return acc + 0 * trail[0]

    site = dx.ExpensiveFn(fwd=forward, adjoint=lambda x, ct: adjoint_reversed(ct), name="w")
    step = dx.filter_value_and_grad(loss_of(site))
    program = str(jax.make_jaxpr(step)(x0))
    assert program.count("scan[") == 1, program
    for run in (jax.jit(step), step):  # (the one loop in the program; eagerly, one half after the other)
        np.testing.assert_allclose(run(x0)[1], jax.grad(reference)(x0), rtol=1e-9, atol=1e-12)


def test_the_reasons_given_for_each_placement(monkeypatch):
    monkeypatch.setattr(_runtime.SWITCHES, "platform", "cpu")
    traced = _placement.halves_run(eager=False)
    assert traced.why == "one host callback starts both halves on two threads (two CPU cores)"
    monkeypatch.setattr(_runtime.SWITCHES, "platform", "gpu")
    eager, traced = _placement.halves_run(eager=True), _placement.halves_run(eager=False)
    assert eager.where == traced.where == "program"
    assert "no JAX work from a host callback there" in traced.why
    assert not traced.leave_program


def test_an_accelerators_round_trip_is_measured_once_and_priced_by_size(monkeypatch):
    from deferax._plan import _cost

    monkeypatch.setattr(_runtime.SWITCHES, "platform", "cpu")
    assert _cost.round_trip_seconds(10**9) == _cost.STAGE_SECONDS  # a CPU's: measured by bench_cost
    monkeypatch.setattr(_runtime.SWITCHES, "platform", "tpu")
    measured = []
    seconds = _cost._measured.__wrapped__

    def counted(platform):
        measured.append(platform)
        return seconds(platform)

    monkeypatch.setattr(_cost, "_measured", _runtime.cached(maxsize=8)(counted))

    @jax.jit
    def traced(x):  # (asked while a step is traced: measured on concrete arrays all the same)
        small, large = _cost.round_trip_seconds(4), _cost.round_trip_seconds(1 << 24)
        assert 0 < small <= large < 10, (small, large)
        return x

    traced(x0)
    assert _cost.round_trip_seconds(4) == _cost.round_trip_seconds(4) and measured == ["tpu"]
    # a site's stage is priced with its input's bytes
    site = dx.ExpensiveFn(fwd=jnp.sin, bwd=lambda x, y, ct: ct * jnp.cos(x), cost=dx.Cost(fwd=1.0, bwd=1.0))
    *_, stage, source = _cost.numbers(site.timings_key, ((1024,),), site.cost)
    assert source == "hint" and stage == _cost.round_trip_seconds(4 * 1024)
