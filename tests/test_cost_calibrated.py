"""The cost model counting what each schedule runs (not timed): with the timings the model
decides from injected (`_cost.TIMINGS`, where a site's first calls put them), the schedule
chosen follows the arithmetic worked out here by hand:

- two wavelengths of a frequency-domain solve, k = 6 real numbers each (3 complex overlaps:
  3 adjoint solves), on 2 workers: the deferred-basis jobs of the two sites run at once,
  where the standard schedule runs the sites' host calls one after the other;
- a compliance (self-adjoint): no adjoint solve on either schedule, timed as free;
- a host site sleeping in `fwd` and in its adjoint, k = 1.

Values and gradients against plain JAX (a dense `jnp.linalg.solve`, `jnp.sin`)."""

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx
from deferax._plan import _cost

from .helpers import assert_tree_allclose, load_example

SETUP, FWD, BWD = 0.030, 0.002, 0.002  # seconds: a factorisation, a forward and an adjoint solve
STAGE = _cost.STAGE_SECONDS


def grid(n: int):
    """A small complex Helmholtz-like operator (5-point stencil with an absorbing shift):
    `(pattern, base, diagonal index)`."""
    rows, cols, vals, diag = [], [], [], []
    for i in range(n):
        for j in range(n):
            c = i * n + j
            diag.append(len(vals))
            rows.append(c), cols.append(c), vals.append(4.5 + (0.5j if min(i, j, n - 1 - i, n - 1 - j) == 0 else 0))
            for di, dj in ((-1, 0), (1, 0), (0, -1), (0, 1)):
                if 0 <= i + di < n and 0 <= j + dj < n:
                    rows.append(c), cols.append((i + di) * n + j + dj), vals.append(-1.0)
    pattern = dx.SparsePattern(np.array(rows), np.array(cols), n * n)
    return pattern, jnp.asarray(np.array(vals, np.complex128)), np.array(diag)


N = 5
PATTERN, BASE, DIAG = grid(N)
MONITORS = jnp.asarray(np.random.default_rng(0).normal(size=(3, N * N)) + 0j)
B = jnp.zeros(N * N, jnp.complex128).at[N * N // 2].set(1.0)


def bend(wavelengths, **options):
    """A loss over the given wavelengths, each a site whose cotangent is a combination of its
    3 complex overlaps (k = 6); `solve` the site (`dx.sparse_solve`, or a dense stand-in)."""

    def loss(eps, solve=None):
        total = 0.0
        for k0 in wavelengths:
            values = BASE.at[DIAG].add((-k0 * eps).astype(jnp.complex128))
            if solve is None:
                x = dx.sparse_solve(values, PATTERN, B, **options)
            else:
                x = solve(values)
            powers = jnp.abs(MONITORS @ x) ** 2
            total = total + jnp.sum(jnp.log1p(powers))
        return total

    return loss


def dense_solve(values):
    a = jnp.zeros((N * N, N * N), values.dtype).at[PATTERN.rows, PATTERN.cols].add(values)
    return jnp.linalg.solve(a, B)


EPS = jnp.asarray(np.random.default_rng(1).uniform(0.1, 0.3, N * N))


def inject(**seconds):
    """Replace every site's decided timings (after its first calls) with `seconds`."""
    decided = _cost.TIMINGS.sites()
    assert decided  # (the first calls decided them)
    for key, shapes in decided:
        _cost.TIMINGS.decide(key, shapes, seconds)


def decide(loss, x):
    grad = dx.filter_value_and_grad(loss)
    for _ in range(_cost.SAMPLES):
        grad(x)
    return grad


@pytest.mark.parametrize(
    ("wavelengths", "workers", "expected"),
    [
        # per site: standard = SETUP + FWD + BWD + 2 STAGE (the factorisation kept: one adjoint solve);
        # one job of SETUP + FWD + 3 BWD (6 real cotangents, `m` and `1j m` one solve) per site
        # two jobs at once on two workers, half of both each (0.020 + 0.020 - one stage they
        # share = 0.039); but standard, both forward jobs at once, then both backward jobs
        # (the factorisations kept): 0.032 + 0.002 + 3 stages = 0.037
        ((1.0, 1.2), 2, "standard"),
        ((1.0,), 2, "standard"),  # one job alone: the 2 adjoint solves more are not paid back
        ((1.0, 1.2), 1, "standard"),  # one worker: the jobs in turn
    ],
    ids=["two-wavelengths-two-workers", "one-wavelength", "two-wavelengths-one-worker"],
)
def test_two_wavelengths_on_two_workers(wavelengths, workers, expected):
    loss = bend(wavelengths, cost=dx.Cost(workers=workers))
    grad = decide(loss, EPS)
    inject(setup=SETUP, fwd=FWD, bwd=BWD)
    peers = len(wavelengths)
    standard = SETUP + FWD + BWD + 2 * STAGE
    job = SETUP + FWD + 3 * BWD
    deferred = max(job, peers * job / workers) / peers + STAGE
    assert standard == pytest.approx(0.036) and job == pytest.approx(0.038)
    plan = dx.explain(grad, EPS)
    for site in plan.sites:
        assert site.k == 6 and site.schedule == expected
        assert site.estimates.standard == pytest.approx(standard)
        assert site.estimates.deferred == pytest.approx(deferred)
    if peers == 2 and workers == 2:  # (why not deferred: the jobs at once, estimated by the same numbers)
        at_once = (SETUP + FWD) + BWD + 3 * STAGE
        assert at_once == pytest.approx(0.037) and 2 * deferred - STAGE == pytest.approx(0.039)
        for site in plan.sites:
            assert f"estimated slower than the standard sites' jobs at once ({2 * deferred - STAGE:.4g} s against " in (
                site.reason or ""
            )
            assert f"{at_once:.4g} s)" in (site.reason or "")
        assert plan.stages == (("sparse_solve: fwd",) * 2, ("sparse_solve: bwd",) * 2)
    assert_tree_allclose(grad(EPS), jax.value_and_grad(lambda e: bend(wavelengths)(e, dense_solve))(EPS), rtol=1e-9)


def test_a_compliance_needs_no_adjoint_solve_and_is_timed_as_free():
    """Self-adjoint: the adjoint is the forward's solution, on either schedule; the solve not
    run is timed as 0 s, so the site's timings are decided (and in seconds) after its first
    calls, and the deferred schedule, one stage fewer, is estimated the faster."""
    beam = load_example("topology_mbb").MBB(12, 4)
    x = jnp.full(48, 0.5)
    grad = decide(ft.partial(beam.compliance, where="host"), x)  # (a site: on the host)
    ((key, shapes),) = _cost.TIMINGS.sites()
    timings = _cost.TIMINGS.decided(key, shapes)
    assert timings["bwd"] == 0.0 and timings["setup"] > 0 and timings["fwd"] > 0
    site = dx.explain(grad, x).sites[0]
    assert site.schedule == "deferred" and site.estimates.source == "measured"
    inject(setup=0.120, fwd=0.004, bwd=0.0)
    site = dx.explain(grad, x).sites[0]
    assert site.estimates.standard == pytest.approx(0.120 + 0.004 + 0.0 + 2 * STAGE)
    assert site.estimates.deferred == pytest.approx(0.120 + 0.004 + 0.0 + STAGE)
    for schedule in ("auto", "standard"):
        with dx.record() as timeline:
            dx.filter_value_and_grad(ft.partial(beam.compliance, where="host"), schedule=schedule)(x)
        assert timeline.counts(steps=True).get("solve") == 1, schedule  # (the forward's alone)


SLEEP = 0.005


def sleeping(x):
    return np.sin(x)


def sleeping_adjoint(x, ct):
    return ct * np.cos(x)


@pytest.mark.parametrize(("workers", "twins"), [(2, 1), (1, 1), (2, 2)])
def test_a_sleeping_host_site(workers, twins):
    """A host site of 5 ms in `fwd` and 5 ms in its adjoint, k = 1: standard runs them in
    turn (plus two stages); deferred-basis runs its two jobs on the workers (and a twin
    site's beside them), one stage."""
    site = dx.host(
        sleeping,
        adjoint=sleeping_adjoint,
        out=jax.ShapeDtypeStruct((4,), jnp.float64),
        name="sleeping",
        cost=dx.Cost(workers=workers),
    )

    def loss(x):
        return sum(jnp.sum(site(x * (1 + i))) ** 2 for i in range(twins))

    x = jnp.linspace(0.1, 0.4, 4)
    grad = decide(loss, x)
    inject(fwd=SLEEP, bwd=SLEEP)
    standard = SLEEP + SLEEP + 2 * STAGE
    jobs = [SLEEP, SLEEP]
    deferred = max(max(jobs), twins * sum(jobs) / workers) / twins + STAGE
    # by hand: two 5 ms jobs on two workers, at once; on one, in turn; four on two, 10 ms for two sites
    want = {(2, 1): 0.005, (1, 1): 0.010, (2, 2): 0.005}[(workers, twins)]
    assert deferred == pytest.approx(want + STAGE)
    for s in dx.explain(grad, x).sites:
        assert s.k == 1 and s.schedule == ("deferred-basis" if deferred < standard else "standard")
        assert s.estimates.standard == pytest.approx(standard) and s.estimates.deferred == pytest.approx(deferred)
    reference = jax.value_and_grad(lambda x: sum(jnp.sum(jnp.sin(x * (1 + i))) ** 2 for i in range(twins)))(x)
    assert_tree_allclose(grad(x), reference, rtol=1e-12)
