"""The deferred-basis schedule on the wave stepper: an |overlap|^2 objective.

The loss sees the stepper's output `y` only through an overlap `z = <m, y>` with a mode
profile `m`, then squares it: the cotangent `2 z m` depends on `y`, but only through the
number `z`, so `dx.filter_value_and_grad` runs the forward once together with one adjoint
for the fixed cotangent `m` (k = 1) and scales it by `2 z` afterwards. With a complex mode
`z` is two real numbers (k = 2): the forward and two adjoints. The baseline is
`eqx.filter_value_and_grad` of the same loss with a plain `jax.custom_vjp`.

    python benchmarks/bench_basis.py            # full size: 256 x 256 grid, 400 steps
    python benchmarks/bench_basis.py --small    # smoke test
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from _common import describe, interleaved, load, machine, make_wave, median, parser, result_line
from bench_wave import build

import deferax as dx


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    n, steps = (32, 20) if args.small else (256, 400)
    repeats = args.repeats or (2 if args.small else 15)
    print(f"bench_basis: {n}x{n} grid, {steps} steps, float32; {machine()}")
    forward, adjoint = make_wave(n, steps)
    rows = jnp.arange(n, dtype=jnp.float32)[:, None]
    cols = jnp.arange(n, dtype=jnp.float32)[None, :]
    source = jax.random.normal(jax.random.key(0), (n, n)) * (rows < n // 8)
    profile = jnp.exp(-(((cols - n / 2) / (n / 8)) ** 2)) * (rows > n - n // 8)  # a mode near the far edge
    modes = {
        "real mode (k=1)": profile,
        "complex mode (k=2)": profile * jnp.exp(1j * 0.3 * cols).astype(jnp.complex64),
    }
    results = []
    for label, mode in modes.items():
        loss_def, loss_std = build(
            forward, adjoint, objective=lambda y, m=mode: jnp.abs(jnp.vdot(m, y.astype(m.dtype))) ** 2
        )
        params = {"source": source}
        # max_basis=2 so that the complex mode (k = 2) is deferred too: the default limit
        # is 1, set from this very measurement.
        vg_def = dx.filter_value_and_grad(loss_def, max_basis=2)
        plan = dx.explain(vg_def, params, profile)
        print(plan)
        assert plan.sites[0].schedule == "deferred-basis", plan
        v1, g1 = vg_def(params, profile)
        v2, g2 = eqx.filter_value_and_grad(loss_std)(params, profile)
        gerr = float(jnp.max(jnp.abs(g1["source"] - g2["source"])) / jnp.max(jnp.abs(g2["source"])))
        print(f"{label}: value {float(v1):.6g} vs {float(v2):.6g}, gradient max relative difference {gerr:.1e}")
        assert gerr < 1e-4, gerr
        vg_std = eqx.filter_value_and_grad(loss_std)
        times = interleaved(
            {
                "deferred-basis": lambda f=vg_def, p=params: f(p, profile),
                "standard": lambda f=vg_std, p=params: f(p, profile),
            },
            repeats,
            warmup=2,
        )
        for side, ts in times.items():
            print(f"{label} {side:15s}: {describe(ts)}")
        results.append(
            result_line(
                "bench_basis",
                f"eager {label}",
                median(times["deferred-basis"]),
                median(times["standard"]),
                None,
                new_name="deferred-basis",
            )
        )
    print(f"at the end: {load()}")
    for line in results:
        print(line)


if __name__ == "__main__":
    main()
