"""Deferred vs standard VJP for an expensive JAX-native function: a 2D wave-equation stepper.

The forward (`lax.scan`, leapfrog) and its hand-written adjoint cost the same, and the
loss is linear in the stepper's output, so `dx.filter_value_and_grad` defers the site: it
computes the cotangent first and runs `fused(x, ct)` = forward and adjoint on two threads.
The baseline is `eqx.filter_value_and_grad` of the same loss with a plain `jax.custom_vjp`
(forward on the forward pass, adjoint on the backward pass).

Case (a) `eager`: called as a user would, without an outer jit.
Case (b) `jit`: both sides inside `eqx.filter_jit`.

Each case also prints the deferred step against its floor, `dx.fuse` alone (the forward and
the adjoint on two threads and nothing else), timed interleaved with it.

    python benchmarks/bench_wave.py            # full size: 256 x 256 grid, 400 steps
    python benchmarks/bench_wave.py --small    # smoke test
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

TARGETS = {"eager": 0.6, "jit": 0.8}
# Over the floor: `dx.fuse` alone (forward and adjoint on two threads, nothing else), timed
# interleaved with the step; what the step adds is its trace, cache key and dispatch (eager)
# or the cheap parts of the loss (both).
FLOOR_TARGETS = {"eager": 1.10, "jit": 1.05}


def build(forward, adjoint, objective=None):
    """The two sides: (deferred loss, standard loss), same maths. The loss is
    `sum(w * y)` (linear in the output), or `objective(y)` when given."""
    wave, wave_std = wave_sites(forward, adjoint)

    def make_loss(sim):
        def loss(params, w):
            y = sim(params["source"])
            fit = jnp.sum(w * y) if objective is None else objective(y)
            return fit + 1e-3 * jnp.sum(params["source"] ** 2)

        return loss

    return make_loss(wave), make_loss(wave_std)


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    n, steps = (32, 20) if args.small else (256, 400)
    repeats = args.repeats or (2 if args.small else 21)
    print(f"bench_wave: {n}x{n} grid, {steps} steps, float32; {machine()}")

    forward, adjoint = make_wave(n, steps)
    key_x, key_w = jax.random.split(jax.random.key(0))
    rows = jnp.arange(n)[:, None]
    source = jax.random.normal(key_x, (n, n)) * (rows < n // 8)  # a source band near one edge
    w = jax.random.normal(key_w, (n, n)) * (rows > n - n // 8)  # a weighted sum near the other
    params = {"source": source}

    err32, err64 = check_adjoint_both(forward, adjoint, source, w)
    print(
        f"adjoint vs jax.vjp(forward), max relative error: {err32:.1e} "
        f"(float32, this size), {err64:.1e} (float64, 64x64, 100 steps)"
    )
    assert err32 < 1e-4 and err64 < 1e-10, (err32, err64)

    loss_def, loss_std = build(forward, adjoint)
    plan = dx.explain(loss_def, params, w)
    print(plan)
    assert plan.sites[0].schedule == "deferred", plan

    # Check that the two sides agree before timing them.
    (v1, g1) = dx.filter_value_and_grad(loss_def)(params, w)
    (v2, g2) = eqx.filter_value_and_grad(loss_std)(params, w)
    gerr = float(jnp.max(jnp.abs(g1["source"] - g2["source"])) / jnp.max(jnp.abs(g2["source"])))
    print(
        f"deferred vs standard: value {float(v1):.6g} vs {float(v2):.6g}, gradient max relative difference {gerr:.1e}"
    )
    assert gerr < 1e-5 and abs(float(v1 - v2)) <= 1e-5 * abs(float(v2)), (v1, v2, gerr)

    # How many times forward and adjoint really run per call (untimed, instrumented copies).
    counts: collections.Counter = collections.Counter()
    c_def, c_std = build(*counted(forward, adjoint, counts))
    for case, wrap in (("eager", lambda f: f), ("jit", eqx.filter_jit)):
        for side, vg, loss in (
            ("deferred", dx.filter_value_and_grad, c_def),
            ("standard", eqx.filter_value_and_grad, c_std),
        ):
            fn = wrap(vg(loss))
            block(fn(params, w))  # trace, compile
            jax.effects_barrier()
            counts.clear()
            block(fn(params, w))
            jax.effects_barrier()
            print(f"runs per call, {case:5s} {side:8s}: forward {counts['forward']}, adjoint {counts['adjoint']}")

    # Timed interleaved with every case, to show whether a second core was free meanwhile.
    fwd_jit = jax.jit(forward)
    fused = dx.fuse(forward, adjoint)
    probes = {"forward alone": lambda: fwd_jit(source), "dx.fuse alone": lambda: fused(source, w)}

    results = []

    # (a) eager: no outer jit. The deferred side jits its cheap stages internally (cached);
    # fused runs forward and adjoint on two threads. Also timed there: the ExpensiveFn on the
    # standard schedule, which should cost what the plain custom_vjp does.
    # (b) jit: both sides inside eqx.filter_jit.
    vg_lib_std = dx.filter_value_and_grad(loss_def, schedule="standard")
    extra = {"eager": {"ExpensiveFn standard": lambda: vg_lib_std(params, w)}, "jit": {}}
    for case, wrap in (("eager", lambda f: f), ("jit", eqx.filter_jit)):
        step_def = wrap(dx.filter_value_and_grad(loss_def))
        step_std = wrap(eqx.filter_value_and_grad(loss_std))
        sides = {"deferred": lambda s=step_def: s(params, w), "standard": lambda s=step_std: s(params, w)}
        times = interleaved({**sides, **extra[case], **probes}, repeats, warmup=2)
        for side, ts in times.items():
            print(f"{case:5s} {side:21s}: {describe(ts)}")
        print(f"{case:5s} {overlap(times)}")
        results.append(
            result_line("bench_wave", case, median(times["deferred"]), median(times["standard"]), TARGETS[case])
        )
        over = [d - f for d, f in zip(times["deferred"], times["dx.fuse alone"], strict=True)]
        print(f"{case:5s} deferred - dx.fuse alone, round by round: median {median(over) * 1e3:.2f} ms")
        results.append(
            result_line(
                "bench_wave",
                f"{case} over the floor",
                median(times["deferred"]),
                median(times["dx.fuse alone"]),
                FLOOR_TARGETS[case],
                old_name="floor (dx.fuse alone)",
            )
        )

    # For reference: forward + adjoint in one jitted program (XLA:CPU runs them one after
    # the other), against one forward.
    both = jax.jit(lambda x, ct: (forward(x), adjoint(x, ct)))
    times = interleaved({"forward": lambda: fwd_jit(source), "forward+adjoint": lambda: both(source, w)}, repeats)
    for side, ts in times.items():
        print(f"ref   {side:21s}: {describe(ts)}")

    print(f"at the end: {load()}")
    for line in results:
        print(line)


if __name__ == "__main__":
    main()
