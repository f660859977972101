"""The schedule chosen by cost, against measurement: for each case, each schedule's estimate
beside its measured time, and the default's choice against the measured-fastest.

Cases (each a value and gradient under `eqx.filter_jit`, traced after the default's first
calls have timed the site, so that its plan is the one the timings choose):

- `bend`: a waveguide-bend-like problem. Two wavelengths, each a 2D Helmholtz-like complex
  sparse system on an N x N grid (`-lap E - k0^2 eps E + i sigma E = b`, 5-point stencil,
  an absorbing shift on the boundary cells), solved by `dx.sparse_solve`; the loss sees
  each field through 3 complex overlaps (k = 6 real numbers per site): a smooth window
  loss of the powers. Schedules: standard (forward: factor and solve; backward: the kept
  factorisation, one adjoint solve) and deferred-basis (`max_basis=6`: one job per
  wavelength, one factorisation, the forward and 3 adjoint solves).
- `fem`: the MBB beam's compliance (`examples/topology_mbb.py`, 180 x 60 Q4 elements, as
  `bench_fem.py`): self-adjoint, so the deferred schedule needs no second solve (nor does
  the standard one: its adjoint is `u`). Schedules: standard and deferred.
- `host`: a `dx.host` site sleeping 5 ms in `fwd` and 5 ms in its adjoint, on 4 numbers,
  with a loss `sum(y)^2` (k = 1): standard runs them one after the other, deferred-basis
  at once on two threads.
- `stage`: the same site without the sleep: the difference between the two schedules is
  one stage's fixed cost (a host round trip), beside the model's `STAGE_SECONDS`.

Each case prints the site's timings the model uses (setup, fwd, bwd per right-hand side),
each schedule's estimate for the program (the sum over its sites) and its measured median,
and `RESULT bench_cost <case> chosen-vs-fastest: ... ratio R` (target R <= 1.05): the median
of the default's schedule (its times as the default and forced, one program, pooled) over
the fastest schedule's.

    python benchmarks/bench_cost.py                 # full sizes, 31 repeats (the fem case spreads widely)
    python benchmarks/bench_cost.py --small         # smoke test
    python benchmarks/bench_cost.py --case bend     # one case
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import re  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import describe, fmt, interleaved, load, load_example, machine, median, parser  # noqa: E402

import deferax as dx  # noqa: E402
from deferax._plan import _cost  # noqa: E402

jax.config.update("jax_enable_x64", True)

TARGET = 1.05
AT_ONCE = "standard at once"  # (the standard schedule, the sites' backward jobs at once)
SLEEP = 0.005  # seconds, in the host case's `fwd` and adjoint


def helmholtz(n: int):
    """`(pattern, base, diagonal)`: the stencil's pattern, its entries without the
    permittivity term, and the index of each cell's diagonal entry in `values`."""
    rows, cols, vals, diag = [], [], [], []
    h2 = 1.0 / (n + 1) ** 2
    for i in range(n):
        for j in range(n):
            c = i * n + j
            edge = min(i, j, n - 1 - i, n - 1 - j)
            diag.append(len(vals))
            rows.append(c), cols.append(c), vals.append(4.0 / h2 + (1j * 40.0 / h2 if edge < 4 else 0.0))
            for di, dj in ((-1, 0), (1, 0), (0, -1), (0, 1)):
                if 0 <= i + di < n and 0 <= j + dj < n:
                    rows.append(c), cols.append((i + di) * n + j + dj), vals.append(-1.0 / h2)
    pattern = dx.SparsePattern(np.array(rows), np.array(cols), n * n)
    return pattern, jnp.asarray(np.array(vals, np.complex128)), jnp.asarray(np.array(diag))


def problem(n: int):
    """The bend: `(loss, eps)`, the loss taking options for `dx.sparse_solve`."""
    pattern, base, diag = helmholtz(n)
    rng = np.random.default_rng(0)
    b = np.zeros(n * n, np.complex128)
    b[(n // 2) * n + 5] = 1.0  # a point source near the left edge
    monitors = jnp.asarray(rng.normal(size=(3, n * n)) * (rng.uniform(size=(3, n * n)) < 0.02) + 0j)

    def field(eps, k0, **kwargs):
        values = base.at[diag].add(-(k0**2) * eps)
        return dx.sparse_solve(values, pattern, jnp.asarray(b), **kwargs)

    def loss(eps, **kwargs):
        total = 0.0
        for k0 in (20.0, 22.0):  # two wavelengths: two sites
            powers = jnp.abs(monitors @ field(eps, k0, **kwargs)) ** 2  # k = 6 real numbers
            total = total + jnp.sum(jax.nn.softplus(powers / jnp.mean(powers) - 1.0))
        return total

    eps = jnp.asarray(1.0 + rng.uniform(size=n * n))
    return loss, eps


def sleeping(x):
    time.sleep(SLEEP)
    return np.sin(x)


def sleeping_adjoint(x, ct):
    time.sleep(SLEEP)
    return ct * np.cos(x)


def quick(x):
    return np.sin(x)


def quick_adjoint(x, ct):
    return ct * np.cos(x)


def host_case(fwd, adjoint):
    site = dx.host(fwd, adjoint=adjoint, out=jax.ShapeDtypeStruct((4,), jnp.float64), name="host")

    def loss(x):
        return jnp.sum(site(x)) ** 2  # (k = 1: the cotangent is `2 sum(y)` times ones)

    return loss, jnp.linspace(0.1, 0.4, 4)


def cases(small: bool) -> dict:
    """Each case: `(loss, x, forced)`: `forced` the options that force its deferred schedule."""
    bend, eps = problem(24 if small else 108)
    beam = load_example("topology_mbb").MBB(*((30, 10) if small else (180, 60)))
    x = jnp.full(beam.nelx * beam.nely, 0.5)
    return {
        "bend": (bend, eps, {"max_basis": 6}),
        "fem": (beam.compliance, x, {}),
        "host": (*host_case(sleeping, sleeping_adjoint), {"max_basis": 1}),
        "stage": (*host_case(quick, quick_adjoint), {"max_basis": 1}),
    }


def run_case(name: str, loss, x, forced: dict, repeats: int) -> float | None:
    dx.forget_timings()
    default = dx.filter_value_and_grad(loss)
    for _ in range(_cost.SAMPLES):  # the first calls time the site's jobs: the plan is decided from them
        jax.block_until_ready(default(x))
    plan = dx.explain(default, x)
    deferred_name = "deferred-basis" if forced else "deferred"
    sides = {
        "default": eqx.filter_jit(default),
        "standard": eqx.filter_jit(dx.filter_value_and_grad(loss, schedule="standard")),
        deferred_name: eqx.filter_jit(dx.filter_value_and_grad(loss, **forced)),
    }
    at_once = None
    if len(plan.sites) > 1 and forced:  # (the standard sites' jobs at once: `max_basis=0` keeps them standard)
        at_once = dx.filter_value_and_grad(loss, max_basis=0)
        jax.block_until_ready(at_once(x))
        if _backward_at_once(dx.explain(at_once, x)):
            sides[AT_ONCE] = eqx.filter_jit(at_once)
    chosen = sorted({s.schedule for s in plan.sites})
    if chosen == ["standard"] and _backward_at_once(plan):
        chosen = [AT_ONCE]
    print(f"--- {name}: {len(plan.sites)} site(s), the default chose {', '.join(chosen)}")
    for timings in (_cost.TIMINGS.decided(*site) for site in _cost.TIMINGS.sites()):
        shown = ", ".join(f"{k} {fmt(v)}" for k, v in sorted(timings.items()))
        print(f"  timings (least of {_cost.SAMPLES} calls): {shown}")
    estimates = [s.estimates for s in plan.sites]
    est = {"standard": sum(e.standard for e in estimates if e is not None)}
    if all(e is not None and e.deferred is not None for e in estimates):
        est[deferred_name] = sum(e.deferred for e in estimates)  # pyright: ignore[reportOptionalMemberAccess]
    unit = " s" if all(e is not None and e.source != "defaults" for e in estimates) else " (units of one forward)"
    if AT_ONCE in sides:
        assert at_once is not None
        found = re.search(r"estimated ([0-9.e+-]+)(?: s)? at once", dx.explain(at_once, x).sites[0].reason or "")
        if found:
            est[AT_ONCE] = float(found.group(1))
    times = interleaved({k: (lambda f=f: f(x)) for k, f in sides.items()}, repeats, settle=0.05)
    for side, ts in times.items():
        shown = f"estimated {est[side]:.4g}{unit}, " if side in est else ""
        print(f"  {side:17s}: {shown}measured {describe(ts)}")
    if name == "stage":  # (no choice to judge: one stage's cost, from the standard schedule's two)
        work = sum(v for k, v in _cost.TIMINGS.decided(*_cost.TIMINGS.sites()[0]).items() if k in ("fwd", "bwd"))
        stage = (median(times["standard"]) - work) / 2
        print(
            f"  one stage measured ((standard - fwd - bwd) / 2): {fmt(stage)}; the model's: {fmt(_cost.STAGE_SECONDS)}"
        )
        return None
    # the default's schedule, timed both as the default and forced (one program: pooled)
    (schedule,) = chosen if len(chosen) == 1 else ("mixed",)
    pooled = {k: times[k] for k in ("standard", AT_ONCE, deferred_name) if k in times}
    if schedule in pooled:
        pooled[schedule] = pooled[schedule] + times["default"]
    else:
        pooled["default"] = times["default"]
    mine = "default" if schedule not in pooled else schedule
    fastest = min(pooled, key=lambda s: median(pooled[s]))
    ratio = median(pooled[mine]) / median(pooled[fastest])
    goal = f"target <= {TARGET}, {'met' if ratio <= TARGET else 'MISSED'}"
    print(
        f"RESULT bench_cost {name} chosen-vs-fastest: chosen {mine} {fmt(median(pooled[mine]))}, "
        f"fastest {fastest} {fmt(median(pooled[fastest]))}, ratio {ratio:.2f} ({goal})"
    )
    return ratio


def _backward_at_once(plan) -> bool:
    """Whether the plan runs standard sites' backward jobs at once (a stage of two `bwd`s or more)."""
    return any(sum(": bwd" in job for job in stage) > 1 for stage in plan.stages)


def main():
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=["bend", "fem", "host", "stage"], action="append", help="run only these")
    args = p.parse_args()
    repeats = args.repeats or (2 if args.small else 31)
    print(f"bench_cost: {machine()}; at the start: {load()}")
    for name, (loss, x, forced) in cases(args.small).items():
        if args.case and name not in args.case:
            continue
        run_case(name, loss, x, forced, repeats)
        print(f"  at the end of {name}: {load()}")


if __name__ == "__main__":
    main()
