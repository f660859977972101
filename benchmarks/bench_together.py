"""Backward jobs of independent standard sites at once, under `jax.jit`: two `dx.host` sites
whose `fwd` and `bwd` each sleep 20 ms (`bwd` reads `y`, and the loss is nonlinear in each
output, so both stay on the standard schedule).

Sides, interleaved, each a value and gradient under `jax.jit`:

- `in turn`: the sites with `cost=dx.Cost(workers=1)`: each `fwd`, then each `bwd`, one
  after another (4 x 20 ms of sleep);
- `at once`: the sites with `cost=dx.Cost(workers=2)`: both `fwd` jobs at once, then both
  `bwd` jobs at once (2 x 20 ms);
- `default`: the sites with no hint, planned from the timings of their first calls;
- `equinox`: `eqx.filter_value_and_grad` of the same program (JAX's own standard schedule).

It prints each side's estimate (from `dx.explain`: "estimated X s at once against Y s in
turn") beside its measured median, and

    RESULT bench_together at-once-vs-in-turn: ... ratio R   (the gain: about 0.5 at best)
    RESULT bench_together default-vs-fastest: ... ratio R   (target <= 1.05)

    python benchmarks/bench_together.py            # 15 repeats
    python benchmarks/bench_together.py --small    # smoke test
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
from _common import describe, fmt, interleaved, load, machine, median, parser  # noqa: E402

import deferax as dx  # noqa: E402
from deferax._plan import _cost  # noqa: E402

jax.config.update("jax_enable_x64", True)

SLEEP = 0.020  # seconds, in each `fwd` and `bwd`
TARGET = 1.05


def sleeping_fwd(x):
    time.sleep(SLEEP)
    return np.sin(x)


def sleeping_bwd(x, y, ct):
    time.sleep(SLEEP)
    return ct * np.sqrt(1 - y**2)  # (reads `y`: no `fused` can be made, the site stays standard)


def program(cost: dx.Cost | None):
    """The loss on two sites, with host functions of their own (their timings are kept apart
    from the other programs')."""

    def site(name):
        fwd = lambda x: sleeping_fwd(x)  # noqa: E731
        bwd = lambda x, y, ct: sleeping_bwd(x, y, ct)  # noqa: E731
        return dx.host(fwd, bwd=bwd, out=lambda s: s, name=name, cost=cost)

    a, b = site("a"), site("b")

    def loss(x):
        return jnp.sum(a(x) ** 2) + jnp.sum(b(2 * x) ** 3)

    return loss


_ESTIMATE = re.compile(r"estimated ([0-9.e+-]+)( s)? at once against ([0-9.e+-]+)( s)? in turn")


def estimates(plan) -> tuple[float, float, str]:
    """`(at once, in turn, unit)` from the plan's reason."""
    found = _ESTIMATE.search(plan.sites[0].reason or "")
    assert found is not None, plan
    unit = " s" if found.group(2) else " (units of one forward)"
    return float(found.group(1)), float(found.group(3)), unit


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    repeats = args.repeats or (3 if args.small else 15)
    print(f"bench_together: {machine()}; at the start: {load()}")
    x = jnp.linspace(0.1, 0.7, 64)
    dx.forget_timings()
    losses = {"in turn": program(dx.Cost(workers=1)), "at once": program(dx.Cost(workers=2)), "default": program(None)}
    steps = {name: jax.jit(dx.filter_value_and_grad(loss)) for name, loss in losses.items()}
    steps["equinox"] = eqx.filter_jit(eqx.filter_value_and_grad(losses["default"]))
    eager = dx.filter_value_and_grad(losses["default"])
    for _ in range(_cost.SAMPLES):  # (the default's first calls time its sites: then its plan is decided)
        jax.block_until_ready(eager(x))
    plans = {name: dx.explain(losses[name], x) for name in ("in turn", "at once", "default")}
    for name, plan in plans.items():
        print(f"  plan of {name!r}: {len(plan.stages)} expensive stages: {plan.stages}")
    for timings in (_cost.TIMINGS.decided(*site) for site in _cost.TIMINGS.sites()):
        print("  timings (least of 3 calls): " + ", ".join(f"{k} {fmt(v)}" for k, v in sorted(timings.items())))
    at_once, in_turn, unit = estimates(plans["default"])
    print(f"  the default's estimates: at once {at_once:.4g}{unit}, in turn {in_turn:.4g}{unit}")
    want = jax.value_and_grad(losses["default"])(x)
    for name, fn in steps.items():
        got = fn(x)
        assert all(
            np.allclose(g, w, rtol=1e-12) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
        ), name
    times = interleaved({k: (lambda f=f: f(x)) for k, f in steps.items()}, repeats)
    estimated = {"in turn": in_turn, "at once": at_once}
    estimated["default"] = at_once if len(plans["default"].stages) == 2 else in_turn
    for name, ts in times.items():
        shown = f"estimated {estimated[name]:.4g}{unit}, " if name in estimated else ""
        print(f"  {name:8s}: {shown}measured {describe(ts)}")
    ratio = median(times["at once"]) / median(times["in turn"])
    print(
        f"RESULT bench_together at-once-vs-in-turn: at once {fmt(median(times['at once']))}, "
        f"in turn {fmt(median(times['in turn']))}, ratio {ratio:.2f} (about 0.5 at best: two jobs on two workers)"
    )
    fastest = min(("in turn", "at once"), key=lambda s: median(times[s]))
    ratio = median(times["default"]) / median(times[fastest])
    goal = f"target <= {TARGET}, {'met' if ratio <= TARGET else 'MISSED'}"
    print(
        f"RESULT bench_together default-vs-fastest: default {fmt(median(times['default']))}, "
        f"fastest {fastest} {fmt(median(times[fastest]))}, ratio {ratio:.2f} ({goal})"
    )
    print(f"bench_together: at the end: {load()}")


if __name__ == "__main__":
    main()
