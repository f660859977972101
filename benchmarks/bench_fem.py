"""A finite-element topology step: the SIMP MBB beam (180 x 60 Q4 elements, plane stress,
penalty 3, densities 0.5), its compliance `c = f . u` with `K(x) u = f` on the free degrees
of freedom, and the gradient `dc/dx`, timed side by side.

- deferax default: `examples/topology_mbb.py`'s `MBB.compliance` (the stiffness assembled in
  JAX, `u = dx.sparse_solve(...)`), `dx.filter_value_and_grad`, no options: eagerly and
  under `eqx.filter_jit` (the headline: what an optimisation loop runs);
- SciPy splu: what a SciPy user writes by hand, the stiffness assembled in NumPy, `splu`
  with its default column ordering (COLAMD), one solve, and the analytic sensitivity
  `dc/dx_e = -p x_e^(p-1) (E0 - Emin) u_e^T KE u_e` (no adjoint solve: the compliance is
  self-adjoint);
- SciPy splu MMD: the same with `permc_spec="MMD_AT_PLUS_A"`, the symmetric ordering;
- SciPy splu MMD, 1 BLAS thread: the same inside threadpoolctl's `threadpool_limits(1)`, as
  deferax's `SuperLU` runs (the SciPy sides above keep OpenBLAS's default threads, as a
  user would). No target: it shows what the thread setting alone is worth.

Each side's median time and peak resident memory (`resource.getrusage`, the process's
high-water mark, so it only grows: measured after the warm-up of each side, in order) are
printed, and the gradients compared.

    python benchmarks/bench_fem.py              # 180 x 60, 9 repeats
    python benchmarks/bench_fem.py --small      # 30 x 10, 2 repeats (a smoke test)
    python benchmarks/bench_fem.py --repeats 21
"""

from __future__ import annotations

import resource
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spl
from _common import block, describe, interleaved, load, load_example, machine, median, parser, result_line
from threadpoolctl import threadpool_limits

import deferax as dx

TARGETS = {"default-vs-splu": 0.65, "default-vs-splu-mmd": 1.10}

EXAMPLE = load_example("topology_mbb")


class HandWritten:
    """A SciPy user's value and gradient of the compliance: the stiffness assembled in NumPy
    (COO to CSC, as top88's ports do), `splu`, one solve and the analytic SIMP sensitivity
    (the beam's mesh and load from `MBB`)."""

    def __init__(self, beam, permc_spec: str = "COLAMD"):
        self.beam, self.permc_spec = beam, permc_spec
        self.ndof = 2 * (beam.nelx + 1) * (beam.nely + 1)

    def __call__(self, x: np.ndarray) -> tuple[float, np.ndarray]:
        beam = self.beam
        stiffness = EXAMPLE.E_MIN + x**EXAMPLE.PENAL * (1.0 - EXAMPLE.E_MIN)
        values = stiffness[beam.entry_element] * beam.entry_ke
        p = beam.pattern
        k = sp.csc_matrix((values, (p.rows, p.cols)), shape=(p.n, p.n))  # (duplicates summed)
        u = np.zeros(self.ndof)
        u[beam.free] = spl.splu(k, permc_spec=self.permc_spec).solve(beam.f)
        ue = u[beam.edofs]
        energy = np.einsum("ei,ij,ej->e", ue, beam.ke, ue)
        dc = -EXAMPLE.PENAL * x ** (EXAMPLE.PENAL - 1) * (1.0 - EXAMPLE.E_MIN) * energy
        return float(beam.f @ u[beam.free]), dc


def one_thread(fn, *args):
    with threadpool_limits(1):
        return fn(*args)


def peak_mb() -> float:
    """The process's peak resident memory so far, in MB (Linux reports kB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e6 if sys.platform == "darwin" else peak / 1e3


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    nelx, nely = (30, 10) if args.small else (180, 60)
    repeats = args.repeats or (2 if args.small else 9)
    jax.config.update("jax_enable_x64", True)
    print(f"bench_fem: {machine()}")
    beam = EXAMPLE.MBB(nelx, nely)
    print(f"MBB beam: {nelx} x {nely} Q4 elements, {beam.pattern.n} unknowns, {beam.pattern.nnz} entries")
    print(f"structurally symmetric: {beam.pattern.structurally_symmetric}")
    x_np = np.full(nelx * nely, 0.5)
    x = jnp.asarray(x_np)

    value_and_grad = dx.filter_value_and_grad(beam.compliance)
    jitted = eqx.filter_jit(value_and_grad)
    sides = {
        "deferax default, jit": lambda: jitted(x),
        "deferax default, eager": lambda: value_and_grad(x),
        "SciPy splu (COLAMD)": lambda: HandWritten(beam)(x_np),
        "SciPy splu MMD_AT_PLUS_A": lambda: HandWritten(beam, "MMD_AT_PLUS_A")(x_np),
        "SciPy splu MMD, 1 thread": lambda: one_thread(HandWritten(beam, "MMD_AT_PLUS_A"), x_np),
    }
    sites = dx.explain(value_and_grad, x).sites  # (a small beam's solve runs inside the program: no site)
    print(f"deferax's schedule: {sites[0].schedule if sites else 'solved inside the program'}")

    # the gradients, against the hand-written one with SciPy's default ordering
    want_c, want_dc = HandWritten(beam)(x_np)
    peaks = {}
    for name, side in sides.items():
        c, dc = block(side())  # (the first call: compiles)
        for _ in range(3):
            block(side())
        peaks[name] = peak_mb()
        value_error = abs(float(c) - want_c) / abs(want_c)
        difference = np.abs(np.asarray(dc) - want_dc)
        grad_error = float(np.max(difference) / np.max(np.abs(want_dc)))
        entry_error = float(np.max(difference / np.abs(want_dc)))
        print(
            f"--- {name}: compliance {float(c):.10g}, value error {value_error:.1e}; gradient: max difference ", end=""
        )
        print(f"{grad_error:.1e} of the largest entry, {entry_error:.1e} entry by entry; peak RSS {peaks[name]:.0f} MB")
    with dx.record() as timeline:
        block(jitted(x))
    print(f"a deferax step (jit) runs {dict(sorted(timeline.counts(steps=True).items()))}")

    times = interleaved(sides, repeats)
    print(f"timings ({repeats} interleaved repeats; peak RSS is the process's, after each side's warm-up):")
    for name, ts in times.items():
        print(f"  {name:26s}: {describe(ts)}, peak RSS {peaks[name]:.0f} MB")
    print(f"  peak RSS at the end: {peak_mb():.0f} MB")
    default = median(times["deferax default, jit"])
    eager = median(times["deferax default, eager"])
    splu, mmd = median(times["SciPy splu (COLAMD)"]), median(times["SciPy splu MMD_AT_PLUS_A"])
    print(result_line("bench_fem", "default-vs-splu", default, splu, TARGETS["default-vs-splu"], "deferax", "splu"))
    print(
        result_line(
            "bench_fem", "default-vs-splu-mmd", default, mmd, TARGETS["default-vs-splu-mmd"], "deferax", "splu-mmd"
        )
    )
    print(result_line("bench_fem", "eager-vs-splu-mmd", eager, mmd, None, "deferax eager", "splu-mmd"))
    one = median(times["SciPy splu MMD, 1 thread"])
    print(result_line("bench_fem", "default-vs-splu-mmd-1-thread", default, one, None, "deferax", "splu-mmd-1-thread"))
    print(f"at the end: {load()}")


if __name__ == "__main__":
    main()
