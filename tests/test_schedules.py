"""Each site's schedule is one object of the `_schedules` family; stage 2 reaches a user's
implementation through few frames of deferax."""

import os
import traceback

import jax
import jax.numpy as jnp
import pytest

import deferax as dx
from deferax._plan import _cost
from deferax._schedules import _deferred

PACKAGE = os.path.dirname(dx.__file__)
W = jnp.array([1.0, -2.0, 0.5])
X = jnp.array([0.3, -0.2, 0.8])


def _frames_from_stage2() -> list:
    """The deferax frames from `stage2` (or, on a thread of deferax's, from the first of
    deferax's frames) to the implementation's entry (`run_fused`), both included."""
    stack = [f for f in traceback.extract_stack() if f.filename.startswith(PACKAGE)]
    starts = [i for i, f in enumerate(stack) if f.name == "stage2"]
    stack = stack[starts[-1] if starts else 0 :]
    end = next(i for i, f in enumerate(stack) if f.name == "run_fused")
    return [f.name for f in stack[: end + 1]]


def _site(depths: list, name: str):
    def fused(x, ct):
        depths.append(_frames_from_stage2())
        return jnp.sin(x), ct * jnp.cos(x)

    return dx.ExpensiveFn(fwd=jnp.sin, bwd=lambda x, y, ct: ct * jnp.cos(x), fused=fused, name=name)


@pytest.mark.parametrize("n_sites", [1, 2])
def test_stage2_reaches_fused_in_few_frames(n_sites):
    depths: list = []
    sites = [_site(depths, f"s{i}") for i in range(n_sites)]

    def loss(x):
        return sum(jnp.sum(W * f(x * (i + 1))) for i, f in enumerate(sites))

    value, grad = dx.filter_value_and_grad(loss, schedule="deferred")(X)
    expected = sum(W * (i + 1) * jnp.cos(X * (i + 1)) for i in range(n_sites))
    assert jnp.allclose(grad, expected)
    assert len(depths) == n_sites
    # (before the schedules were objects: 9 from `stage2`, 8 from a thread; now 6 and 5)
    assert max(map(len, depths)) <= 6, depths


def test_the_deferred_estimate_of_one_job_on_the_defaults():
    """A deferred site's one job on the equal-cost defaults: its forward and its adjoint, one
    each, and a stage; the job's switches are keyword-only."""
    setup, fwd, bwd, stage, source = _cost.numbers(None, ((3,),), dx.Cost())
    with pytest.raises(TypeError, match="positional"):
        _deferred.jobs(setup, fwd, bwd, 1, dx.Cost(), False, True, False)  # pyright: ignore[reportCallIssue]
    found = _deferred.jobs(setup, fwd, bwd, 1, dx.Cost(), complex_out=False, one_job=True, fused_jobs=False)
    assert source == "defaults" and _cost.at_once(found, 1, stage) == 1.0 + 1.0 + _cost.DEFAULT_STAGE


def _analysed(monkeypatch, loss, x):
    import deferax._analysis._analysis as analysis_module

    found = []

    def keeping(*args, **kwargs):
        found.append(analysis_module.analyse(*args, **kwargs))
        return found[-1]

    monkeypatch.setattr("deferax._stages._run.analyse", keeping)
    value, grad = dx.filter_value_and_grad(loss)(x)
    return found[-1], value, grad


def test_one_schedule_object_per_site(monkeypatch):
    """Each kind of site gets its schedule's object; the stages run them to the gradient
    plain JAX gives."""
    from deferax._schedules._deferred import Deferred
    from deferax._schedules._deferred_basis import DeferredBasis
    from deferax._schedules._jobs import ForwardJob
    from deferax._schedules._standard import ForwardBasis, Standard

    def fused(x, ct):
        return jnp.sin(x), ct * jnp.cos(x)

    linear = dx.ExpensiveFn(fwd=jnp.sin, bwd=lambda x, y, ct: ct * jnp.cos(x), fused=fused, name="linear")
    squared = dx.ExpensiveFn(fwd=jnp.sin, bwd=lambda x, y, ct: ct * jnp.cos(x), fused=fused, name="squared")
    early = dx.ExpensiveFn(fwd=jnp.tanh, bwd=lambda x, y, ct: ct * (1 - y**2), name="early")
    tangents = dx.ExpensiveFn(
        fwd=jnp.exp, jvp=lambda x, t: (jnp.exp(x), jnp.exp(x) * t), prefer="forward-basis", name="tangents"
    )

    def loss(x):
        return jnp.sum(W * linear(x)) + jnp.sum(squared(2 * x)) ** 2 + jnp.sum(early(x)) + jnp.sum(tangents(x))

    def plain(x):
        return jnp.sum(W * jnp.sin(x)) + jnp.sum(jnp.sin(2 * x)) ** 2 + jnp.sum(jnp.tanh(x)) + jnp.sum(jnp.exp(x))

    analysis, value, grad = _analysed(monkeypatch, loss, X)
    kinds = [type(s) for s in analysis.schedules]
    assert kinds == [Deferred, DeferredBasis, Standard, ForwardBasis]  # (a schedule: how its derivative is had)
    assert analysis.schedules[2].runs == "ahead"  # (where its jobs run: its `fwd` in stage 2)
    assert [s.position for s in analysis.schedules] == [0, 1, 2, 3]
    assert [type(s) for s in analysis.ahead] == [Deferred, DeferredBasis, ForwardJob]  # (the deferred first)
    assert [s.label for s in analysis.schedules] == [s.schedule for s in analysis.plan.sites]
    assert analysis.plan.sites[1].k == 1
    assert jnp.allclose(value, plain(X))
    assert jnp.allclose(grad, jax.grad(plain)(X))
