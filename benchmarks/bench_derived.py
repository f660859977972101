"""Forward and adjoint together from `fwd` + a `bwd` that does not read `y` (no `fused`
given), with `fused=dx.fuse(...)`, and two JAX-native deferred sites under jit.

The wave stepper of `_common.py`, whose adjoint needs neither `x` nor `y`. The baseline is
the hand-written `jax.custom_vjp` (jitted forward on the forward pass, jitted adjoint on the
backward pass) under `eqx.filter_value_and_grad`. The deferax sides:

- `fwd+bwd`: `ExpensiveFn(fwd=forward, bwd=lambda x, y, ct: adjoint(x, ct))`, what seed
  000's author writes; the static check reads from `bwd`'s jaxpr that it does not use `y`
  and runs the two together;
- `dx.fuse`: the same with `fused=dx.fuse(forward, adjoint)`;
- two sites: a loss over two independent stepper calls (fwd + bwd each), inside
  `eqx.filter_jit`: all four halves run at once on the 2 cores.

Sizes: about 10 ms per run (192 x 192 grid, 300 steps) and about 35 ms (256 x 256, 400
steps); eager and inside `eqx.filter_jit`.

With `--devices 2`, JAX sees two CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=2`)
and deferax puts each forward and its adjoint on different devices, as on a 2-GPU machine.

    python benchmarks/bench_derived.py               # both sizes
    python benchmarks/bench_derived.py --devices 2   # the same, on two forced CPU devices
    python benchmarks/bench_derived.py --small       # smoke test
"""

from __future__ import annotations

import concurrent.futures
import os
import sys

if "--devices" in sys.argv:  # before JAX starts: the device count is fixed then
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={int(sys.argv[sys.argv.index('--devices') + 1])}"

import equinox as eqx
import jax
import jax.numpy as jnp
from _common import describe, fmt, interleaved, load, machine, make_wave, median, parser, result_line

import deferax as dx

TARGETS = {"10 ms": 0.58, "35 ms": 0.55, "two sites": 0.6}


def sides(forward, adjoint):
    fwd_jit, adj_jit = jax.jit(forward), jax.jit(adjoint)
    derived = dx.ExpensiveFn(fwd=fwd_jit, bwd=lambda x, y, ct: adj_jit(x, ct), name="wave")
    fused = dx.ExpensiveFn(
        fwd=fwd_jit, bwd=lambda x, y, ct: adj_jit(x, ct), fused=dx.fuse(forward, adjoint), name="wave"
    )

    @jax.custom_vjp
    def baseline(x):
        return fwd_jit(x)

    baseline.defvjp(lambda x: (fwd_jit(x), None), lambda _, ct: (adj_jit(None, ct),))
    return {"fwd+bwd": derived, "dx.fuse": fused}, baseline


def loss_of(sim):
    def loss(source, w):
        return jnp.sum(w * sim(source)) + 1e-3 * jnp.sum(source**2)

    return loss


def two_sites_loss(sim_a, sim_b):
    def loss(sources, w):
        return jnp.sum(w * sim_a(sources[0])) + jnp.sum(w * sim_b(sources[1])) + 1e-3 * jnp.sum(sources**2)

    return loss


def main():
    cli = parser(__doc__.split("\n\n")[0])
    cli.add_argument("--devices", type=int, default=1, help="JAX sees this many CPU devices (forced)")
    args = cli.parse_args()
    sizes = {"10 ms": (32, 20), "35 ms": (48, 30)} if args.small else {"10 ms": (192, 300), "35 ms": (256, 400)}
    repeats = args.repeats or (2 if args.small else 15)
    print(f"bench_derived: wave stepper; {machine()}; {len(jax.devices())} device(s); {load()}")
    results, floors = [], []
    tag = "" if args.devices == 1 else f" {args.devices} devices"
    for label, (n, steps) in sizes.items():
        forward, adjoint = make_wave(n, steps)
        key = jax.random.key(n)
        source = jax.random.normal(key, (n, n)) * (jnp.arange(n)[:, None] < n // 8)
        w = jax.random.normal(jax.random.fold_in(key, 1), (n, n)) * (jnp.arange(n)[:, None] > n - n // 8)
        mine, baseline = sides(forward, adjoint)
        plan = dx.explain(loss_of(mine["fwd+bwd"]), source, w)
        assert plan.sites[0].schedule == "deferred" and plan.stages == (("wave: fwd + bwd",),), str(plan)
        reference = eqx.filter_value_and_grad(loss_of(baseline))(source, w)
        for sim in mine.values():
            got = dx.filter_value_and_grad(loss_of(sim))(source, w)
            assert jnp.allclose(got[0], reference[0], rtol=1e-4) and jnp.allclose(
                got[1], reference[1], rtol=1e-3, atol=1e-5
            )
        fwd_jit, adj_jit = jax.jit(forward), jax.jit(adjoint)
        ct = jax.random.normal(jax.random.fold_in(key, 2), (n, n))
        for case, wrap in (("eager", lambda f: f), ("jit", eqx.filter_jit)):
            steps_ = {name: wrap(dx.filter_value_and_grad(loss_of(sim))) for name, sim in mine.items()}
            steps_["custom_vjp"] = wrap(eqx.filter_value_and_grad(loss_of(baseline)))
            times = interleaved(
                {
                    **{k: (lambda s=s, source=source, w=w: s(source, w)) for k, s in steps_.items()},
                    "forward alone": lambda f=fwd_jit, source=source: f(source),
                    "bare threads": lambda f=fwd_jit, a=adj_jit, source=source, ct=ct: bare_threads(
                        [lambda: f(source), lambda: a(source, ct)]
                    ),
                },
                repeats,
                warmup=2,
            )
            for side, ts in times.items():
                print(f"{label} {case:5s} {side:13s}: {describe(ts)}")
            floors.append(
                f"FLOOR bench_derived {label} {case}: forward and adjoint on two bare threads (no deferax) "
                f"{fmt(median(times['bare threads']))}, ratio "
                f"{median(times['bare threads']) / median(times['custom_vjp']):.2f} to custom_vjp"
            )
            for name in mine:
                results.append(
                    result_line(
                        "bench_derived",
                        f"{label} {case} {name}{tag}",
                        median(times[name]),
                        median(times["custom_vjp"]),
                        TARGETS[label],
                        old_name="custom_vjp",
                    )
                )

    # two JAX-native deferred sites (fwd + bwd each) inside one jitted step: 10 ms size
    n, steps = sizes["10 ms"]
    forward, adjoint = make_wave(n, steps)
    (mine_a, baseline) = sides(forward, adjoint)
    mine_b, _ = sides(forward, adjoint)
    key = jax.random.key(7)
    sources = jax.random.normal(key, (2, n, n)) * (jnp.arange(n)[:, None] < n // 8)
    w = jax.random.normal(jax.random.fold_in(key, 1), (n, n)) * (jnp.arange(n)[:, None] > n - n // 8)
    loss = two_sites_loss(mine_a["fwd+bwd"], mine_b["fwd+bwd"])
    plan = dx.explain(loss, sources, w)
    assert [s.schedule for s in plan.sites] == ["deferred", "deferred"], str(plan)
    step_dx = eqx.filter_jit(dx.filter_value_and_grad(loss))
    step_std = eqx.filter_jit(eqx.filter_value_and_grad(two_sites_loss(baseline, baseline)))
    fwd_jit, adj_jit = jax.jit(forward), jax.jit(adjoint)
    four = [
        lambda: fwd_jit(sources[0]),
        lambda: adj_jit(sources[0], w),
        lambda: fwd_jit(sources[1]),
        lambda: adj_jit(sources[1], w),
    ]
    times = interleaved(
        {
            "two sites deferred": lambda: step_dx(sources, w),
            "two sites custom_vjp": lambda: step_std(sources, w),
            "bare threads": lambda: bare_threads(four),
        },
        repeats,
        warmup=2,
    )
    floors.append(
        f"FLOOR bench_derived two sites jit: the four halves on four bare threads (no deferax) "
        f"{fmt(median(times['bare threads']))}, ratio "
        f"{median(times['bare threads']) / median(times['two sites custom_vjp']):.2f} to custom_vjp"
    )
    for side, ts in times.items():
        print(f"jit   {side:21s}: {describe(ts)}")
    results.append(
        result_line(
            "bench_derived",
            f"two sites jit{tag}",
            median(times["two sites deferred"]),
            median(times["two sites custom_vjp"]),
            TARGETS["two sites"],
            old_name="custom_vjp",
        )
    )
    print(f"at the end: {load()}")
    for line in [*floors, *results]:
        print(line)


def bare_threads(calls):
    """The machine's floor: the calls on threads of their own, each waited for, no deferax."""
    pool = _POOL
    futures = [pool.submit(lambda c=c: jax.block_until_ready(c())) for c in calls]
    return [f.result() for f in futures]


_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4)


if __name__ == "__main__":
    main()
