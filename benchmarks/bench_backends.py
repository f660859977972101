"""The sparse direct solvers inside deferax, side by side: one jitted value and gradient of
`sum |x|^2` for `x = A^-1 b` through `dx.sparse_solve(..., solver=S)` (the standard schedule:
one factorisation, a forward solve and a transposed solve), for each solver `S`:

- `dx.SuperLU()` (the ordering chosen by fill, as before `dx.AutoSparseSolver`), and SuperLU
  with `permc_spec="COLAMD"` and `"MMD_AT_PLUS_A"`;
- `dx.KLU()` (klujax's handle API), `dx.Cholmod()` (sparsax's CHOLMOD where installed, else
  cholespy's) on the SPD matrix, and `dx.Pardiso()` (MKL's PARDISO, through pypardiso's MKL);
- `dx.AutoSparseSolver()` (the fastest of those, measured on the pattern's first calls:
  its trial runs in the warm-up rounds, and the choice it made is printed).

Matrices (`--small`: tiny sizes, a smoke test): (a) the 180 x 60 MBB beam's stiffness
(`examples/topology_mbb.py`, densities uniform in [0.01, 1]: real, symmetric positive definite,
n = 22,020); (b) a real convection-diffusion operator on a 150 x 150 grid (`docs/linear-solve.md`'s
upwinded 5-point operator, n = 22,500); (c) the complex Helmholtz-like operator of
`bench_recognised.py` on a 150 x 150 grid (n = 22,500). Medians of interleaved repeats, with
the load average before and after each matrix: on a shared machine the figures are preliminary.

    python benchmarks/bench_backends.py            # the sizes above
    python benchmarks/bench_backends.py --small    # tiny sizes (a smoke test)
"""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import bench_recognised  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import scipy.sparse  # noqa: E402
from _common import describe, interleaved, load, load_example, machine, median, parser  # noqa: E402

import deferax as dx  # noqa: E402

jax.config.update("jax_enable_x64", True)


def mbb(nelx: int, nely: int):
    """(a): the beam's reduced stiffness, entries as `MBB.values` makes them."""
    beam = load_example("topology_mbb").MBB(nelx, nely)
    x = jnp.asarray(np.random.default_rng(0).uniform(0.01, 1.0, nelx * nely))
    return np.asarray(beam.values(x)), beam.pattern


def convection_diffusion(m: int):
    """(b): `docs/linear-solve.md`'s operator, upwinded (not symmetric)."""
    ones = np.ones(m)
    d1 = scipy.sparse.diags([-1.2 * ones[1:], 2.0 * ones, -0.8 * ones[1:]], [-1, 0, 1])
    values, pattern = dx.SparsePattern.from_scipy(scipy.sparse.kronsum(d1, d1) + 0.1 * scipy.sparse.eye(m * m))
    return values, pattern


def helmholtz(m: int):
    """(c): `bench_recognised.py`'s complex operator (5-point, a lossy random diagonal)."""
    rows, cols, _, values, _, _ = bench_recognised.helmholtz(m)
    return np.asarray(values), dx.SparsePattern(rows, cols, m * m)


def solvers(spd: bool) -> dict[str, dx.AbstractSparseSolver]:
    out: dict[str, dx.AbstractSparseSolver] = {
        "SuperLU() (by fill)": dx.SuperLU(),
        "SuperLU COLAMD": dx.SuperLU(permc_spec="COLAMD"),
        "SuperLU MMD_AT_PLUS_A": dx.SuperLU(permc_spec="MMD_AT_PLUS_A"),
    }
    if importlib.util.find_spec("klujax") is not None:
        out["KLU (klujax)"] = dx.KLU()
    if spd and importlib.util.find_spec("cholespy") is not None:
        out["CHOLMOD"] = dx.Cholmod()
    if importlib.util.find_spec("pypardiso") is not None:
        out["PARDISO"] = dx.Pardiso()
    out["AutoSparseSolver"] = dx.AutoSparseSolver()
    return out


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    repeats = args.repeats or (2 if args.small else 7)
    print(f"bench_backends: {machine()}")
    m = 12 if args.small else 150
    cases = {
        "MBB {} x {} stiffness (SPD)".format(*((12, 4) if args.small else (180, 60))): (
            lambda: mbb(*((12, 4) if args.small else (180, 60))),
            True,
        ),
        f"convection-diffusion n={m * m} (real)": (lambda: convection_diffusion(m), False),
        f"Helmholtz n={m * m} (complex)": (lambda: helmholtz(m), False),
    }
    summary = []
    for case, (make, spd) in cases.items():
        values, pattern = make()
        values = jnp.asarray(values)
        b = jnp.asarray(np.random.default_rng(1).normal(size=pattern.n)).astype(values.dtype)
        dense = pattern.n <= 600
        print(f"--- {case}: {pattern!r}; {load()}")
        sides, reference = {}, None
        for name, solver in solvers(spd).items():

            def loss(v, b, solver=solver, pattern=pattern):
                return jnp.sum(jnp.abs(dx.sparse_solve(v, pattern, b, solver=solver)) ** 2)

            f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            value, grads = f(values, b)
            if reference is None:  # (the first side, or a dense solve in plain JAX on a small system)
                if dense:
                    ref = jax.value_and_grad(
                        lambda v, b, p=pattern: jnp.sum(jnp.abs(jnp.linalg.solve(p.todense(v), b)) ** 2),
                        argnums=(0, 1),
                    )
                    reference = ref(values, b)
                else:
                    reference = (value, grads)
            err = max(
                float(jnp.max(jnp.abs(a - r)) / jnp.max(jnp.abs(r))) for a, r in zip(grads, reference[1], strict=True)
            )
            print(f"  {name:24s}: value {float(value):.10g}, gradient {err:.1e} off the reference")
            sides[name] = lambda f=f, v=values, b=b: jax.block_until_ready(f(v, b))
        times = interleaved(sides, repeats, warmup=4 if not args.small else 3)
        for name, ts in times.items():
            print(f"  {name:24s}: {describe(ts)}")
        chosen = dx.AutoSparseSolver().chosen(pattern, np.promote_types(values.dtype, np.float64))
        if chosen is not None:
            label, seconds = chosen
            trial = ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in sorted(seconds.items(), key=lambda kv: kv[1]))
            print(f"  AutoSparseSolver chose {label} (each one's median factorisation and two solves: {trial})")
        print(f"  after: {load()}")
        meds = {name: median(ts) for name, ts in times.items()}
        base = meds["SuperLU() (by fill)"]
        summary.append((case, {name: t / base for name, t in meds.items()}))
    print("medians over SuperLU() (by fill), which was the default:")
    for case, ratios in summary:
        print(f"  {case}: " + ", ".join(f"{name} {r:.2f}" for name, r in ratios.items()))


if __name__ == "__main__":
    main()
