"""The schedule chosen by cost on a waveguide-bend-like problem: estimates beside measured times.

Two wavelengths, each a 2D Helmholtz-like complex sparse system on an N x N grid
(`-lap E - k0^2 eps E + i sigma E = b`, 5-point stencil, an absorbing shift on the
boundary cells), solved by `dx.sparse_solve` on the default thread pool. The loss sees
each wavelength's field through 3 complex overlaps with fixed monitors (k = 6 real
numbers per site): a smooth window loss of the 3 powers. Timed side by side (interleaved,
eager calls): the default (the schedule the estimates choose, from the timings of the
first three calls), `max_basis=6` (deferred-basis forced: one job per wavelength, one
factorisation, the forward and 3 adjoint solves: `1j * m`'s is `1j` times `m`'s) and
`schedule="standard"` (forward: factor and solve; backward: the kept factorisation, one
adjoint solve). Prints the estimates and the measured factorisation and solve times.

    python benchmarks/bench_cost.py            # N = 108 (the waveguide bend's grid)
    python benchmarks/bench_cost.py --small    # smoke test
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import describe, interleaved, load, machine, median, parser, result_line  # noqa: E402

import deferax as dx  # noqa: E402
from deferax._plan import _cost  # noqa: E402

jax.config.update("jax_enable_x64", True)


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


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    n = 24 if args.small else 108
    repeats = args.repeats or (2 if args.small else 9)
    print(f"bench_cost: {machine()}, {n} x {n} grid, two wavelengths, k = 6 each")
    loss, eps = problem(n)
    dx.forget_timings()
    default = dx.filter_value_and_grad(loss)
    plan_before = dx.explain(default, eps)
    for _ in range(_cost.SAMPLES):  # the first calls time the factorisations and solves
        default(eps)
    plan = dx.explain(default, eps)
    print("before any call (equal-cost defaults):", ", ".join(f"#{s.index} {s.schedule}" for s in plan_before.sites))
    print(f"after {_cost.SAMPLES} calls:")
    print(plan)
    timings = next(iter(_cost._DECIDED.values()))
    print("measured: " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in sorted(timings.items())))
    basis = dx.filter_value_and_grad(loss, max_basis=6)
    standard = dx.filter_value_and_grad(loss, schedule="standard")
    sides = {"default": lambda: default(eps), "deferred-basis": lambda: basis(eps), "standard": lambda: standard(eps)}
    times = interleaved(sides, repeats)
    for name, ts in times.items():
        print(f"{name}: {describe(ts)}")
    s = plan.sites[0].estimates
    print(
        f"estimated per site: standard {1e3 * s.standard:.2f} ms, deferred-basis {1e3 * s.deferred:.2f} ms "
        f"-> {plan.sites[0].schedule}; measured deferred-basis / standard = "
        f"{median(times['deferred-basis']) / median(times['standard']):.2f}"
    )
    print(f"at the end: {load()}")
    print(
        result_line(
            "bench_cost",
            f"default ({plan.sites[0].schedule})",
            median(times["default"]),
            median(times["standard"]),
            None,
            "default",
        )
    )
    print(
        result_line(
            "bench_cost",
            "deferred-basis forced",
            median(times["deferred-basis"]),
            median(times["standard"]),
            None,
            "deferred-basis",
        )
    )


if __name__ == "__main__":
    main()
