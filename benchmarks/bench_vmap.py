"""Deferred vs standard VJP for one expensive call site under `jax.vmap` inside the loss.

The loss `jax.vmap`s the wave stepper of `_common.py` over 4 source patterns and takes a
fixed weighted sum of the 4 final fields: linear in the outputs, so
`dx.filter_value_and_grad` defers the site (one batched `fused` call for the 4 examples,
`dx.fuse(forward, adjoint)`: forward and adjoint on two threads). The baseline is the same
loss and the same `ExpensiveFn` on the standard schedule,
`dx.filter_value_and_grad(loss, schedule="standard")`: the batched forward on the forward
pass, the batched adjoint on the backward pass. Also timed (no RESULT line): the plain
`jax.custom_vjp` under `eqx.filter_value_and_grad`.

Case (a) `eager`: called as a user would, without an outer jit.
Case (b) `jit`: both sides inside `eqx.filter_jit`.

    python benchmarks/bench_vmap.py            # full size: 4 x 256 x 256 grids, 400 steps (as bench_wave)
    python benchmarks/bench_vmap.py --small    # smoke test
"""

from __future__ import annotations

import collections

import equinox as eqx
import jax
import jax.numpy as jnp
from _common import (
    block,
    check_adjoint_both,
    counted,
    describe,
    interleaved,
    load,
    machine,
    make_wave,
    median,
    overlap,
    parser,
    result_line,
    wave_sites,
)

import deferax as dx

TARGETS = {"eager": 0.6, "jit": 0.6}
BATCH = 4
COEFS = (1.0, -0.5, 0.25, 2.0)  # the fixed weights of the 4 outputs in the loss


def build(forward, adjoint):
    """`(loss, loss_custom_vjp)`: the loss over the `ExpensiveFn` (both deferax sides use
    it) and the same maths over a plain `jax.custom_vjp` (the Equinox reference)."""
    wave, wave_std = wave_sites(forward, adjoint)
    coefs = jnp.asarray(COEFS, jnp.float32)

    def make_loss(sim):
        def loss(params, w):
            ys = jax.vmap(sim)(params["sources"])  # (4, n, n): one site, batched
            fit = jnp.sum(coefs[:, None, None] * w * ys)  # linear in the outputs
            return fit + 1e-3 * jnp.sum(params["sources"] ** 2)

        return loss

    return make_loss(wave), make_loss(wave_std)


def rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    n, steps = (32, 20) if args.small else (256, 400)
    repeats = args.repeats or (2 if args.small else 15)
    print(f"bench_vmap: jax.vmap over {BATCH} inputs, {n}x{n} grid, {steps} steps, float32; {machine()}")

    forward, adjoint = make_wave(n, steps)
    key_x, key_w = jax.random.split(jax.random.key(0))
    rows = jnp.arange(n)[:, None]
    sources = jax.random.normal(key_x, (BATCH, n, n)) * (rows < n // 8)  # source bands near one edge
    w = jax.random.normal(key_w, (n, n)) * (rows > n - n // 8)  # a weighted sum near the other
    params = {"sources": sources}

    err32, err64 = check_adjoint_both(forward, adjoint, sources[0], w)
    print(
        f"adjoint vs jax.vjp(forward), max relative error: {err32:.1e} "
        f"(float32, this size), {err64:.1e} (float64, 64x64, 100 steps)"
    )
    assert err32 < 1e-4 and err64 < 1e-10, (err32, err64)

    loss, loss_cvjp = build(forward, adjoint)
    vg_def = dx.filter_value_and_grad(loss)
    vg_std = dx.filter_value_and_grad(loss, schedule="standard")
    vg_eqx = eqx.filter_value_and_grad(loss_cvjp)

    plan = dx.explain(vg_def, params, w)
    print(plan)
    (site,) = plan.sites
    assert site.schedule == "deferred" and site.batch == (BATCH,), plan
    plan_std = dx.explain(vg_std, params, w)
    assert plan_std.sites[0].schedule == "standard", plan_std

    # Check that the sides agree before timing them.
    v1, g1 = vg_def(params, w)
    v2, g2 = vg_std(params, w)
    v3, g3 = vg_eqx(params, w)
    e12, e13 = rel(g1["sources"], g2["sources"]), rel(g1["sources"], g3["sources"])
    print(
        f"deferred vs standard: value {float(v1):.6g} vs {float(v2):.6g}, gradient max relative difference {e12:.1e}"
        f" (vs eqx custom_vjp: {e13:.1e})"
    )
    scale = jnp.max(jnp.abs(g2["sources"]))
    assert jnp.allclose(v1, v2, rtol=1e-5), (v1, v2)
    assert jnp.allclose(g1["sources"], g2["sources"], rtol=1e-5, atol=1e-5 * scale), e12
    assert e12 < 1e-5 and e13 < 1e-5, (e12, e13)

    # How many times forward and adjoint really run per call (untimed, instrumented copies).
    counts: collections.Counter = collections.Counter()
    c_loss, c_cvjp = build(*counted(forward, adjoint, counts))
    for case, wrap in (("eager", lambda f: f), ("jit", eqx.filter_jit)):
        for side, fn in (
            ("deferred", dx.filter_value_and_grad(c_loss)),
            ("standard", dx.filter_value_and_grad(c_loss, schedule="standard")),
            ("eqx", eqx.filter_value_and_grad(c_cvjp)),
        ):
            fn = wrap(fn)
            block(fn(params, w))  # trace, compile
            jax.effects_barrier()
            counts.clear()
            block(fn(params, w))
            jax.effects_barrier()
            print(f"runs per call, {case:5s} {side:8s}: forward {counts['forward']}, adjoint {counts['adjoint']}")

    # Timed interleaved with every case, to show whether a second core was free meanwhile.
    fwd_jit = jax.jit(forward)
    fused = dx.fuse(forward, adjoint)
    probes = {"forward alone": lambda: fwd_jit(sources[0]), "dx.fuse alone": lambda: fused(sources[0], w)}

    results = []
    for case, wrap in (("eager", lambda f: f), ("jit", eqx.filter_jit)):
        step_def, step_std, step_eqx = wrap(vg_def), wrap(vg_std), wrap(vg_eqx)
        sides = {
            "deferred": lambda s=step_def: s(params, w),
            "standard": lambda s=step_std: s(params, w),
            "eqx custom_vjp": lambda s=step_eqx: s(params, w),
        }
        times = interleaved({**sides, **probes}, repeats, warmup=2)
        for side, ts in times.items():
            print(f"{case:5s} {side:15s}: {describe(ts)}")
        print(f"{case:5s} {overlap(times)}")
        results.append(
            result_line("bench_vmap", case, median(times["deferred"]), median(times["standard"]), TARGETS[case])
        )

    # For reference: the batched forward, and batched forward + adjoint in one jitted program.
    fwd_b = jax.jit(jax.vmap(forward))
    both_b = jax.jit(jax.vmap(lambda x, ct: (forward(x), adjoint(x, ct))))
    cts = jnp.asarray(COEFS, jnp.float32)[:, None, None] * w  # the 4 cotangents of the loss
    times = interleaved(
        {
            f"{BATCH} x forward (vmap)": lambda: fwd_b(sources),
            f"{BATCH} x forward+adjoint (vmap)": lambda: both_b(sources, cts),
        },
        repeats,
    )
    for side, ts in times.items():
        print(f"ref   {side:29s}: {describe(ts)}")

    print(f"at the end: {load()}")
    for line in results:
        print(line)


if __name__ == "__main__":
    main()
