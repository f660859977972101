"""What `dx.sparse_solve`'s double-precision factorisation costs a single-precision program.

`dx.sparse_solve` factors and solves in float64 (complex128) whatever the inputs' dtype and
rounds its results to the inputs' dtype; `precision="input"` factors in the inputs' own
dtype instead. Two problems, one jitted value and gradient each, timed side by side
(interleaved):

- the waveguide-bend-like problem of `bench_cost.py` (two wavelengths, a 108 x 108 complex
  Helmholtz-like grid, three monitor overlaps each): complex64 inputs against complex128;
- the MBB beam of `examples/topology_mbb.py` (180 x 60 Q4 elements, 21,960 unknowns, a SIMP
  compliance with densities in [0.01, 1]): float32 against float64.

Each prints the time of the single-precision program (promoted: the default) over the
double-precision one, and the single-precision program's error in value and gradient
against the double-precision answer, beside `precision="input"`'s.

    python benchmarks/bench_precision.py            # full size
    python benchmarks/bench_precision.py --small    # smoke test
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    describe,
    interleaved,
    load,
    load_example,
    machine,
    median,
    memory,
    parser,
    result_line,
)
from bench_cost import helmholtz  # noqa: E402

import deferax as dx  # noqa: E402

jax.config.update("jax_enable_x64", True)


def bend(n: int):
    """The loss of `bench_cost.py`, for inputs of any dtype: `loss(eps, precision)` (float32
    permittivities give complex64 entries)."""
    pattern, base, diag = helmholtz(n)
    rng = np.random.default_rng(0)
    b = np.zeros(n * n, np.complex128)
    b[(n // 2) * n + 5] = 1.0
    monitors = rng.normal(size=(3, n * n)) * (rng.uniform(size=(3, n * n)) < 0.02) + 0j

    def loss(eps, precision="double"):
        cdtype = jnp.result_type(eps.dtype, jnp.complex64)
        total = jnp.zeros((), eps.dtype)
        for k0 in (20.0, 22.0):
            values = base.astype(cdtype).at[diag].add(-(k0**2) * eps.astype(cdtype))
            x = dx.sparse_solve(values, pattern, jnp.asarray(b, cdtype), precision=precision)
            powers = jnp.abs(jnp.asarray(monitors, cdtype) @ x) ** 2
            total = total + jnp.sum(jax.nn.softplus(powers / jnp.mean(powers) - 1.0))
        return total

    return loss, rng.uniform(1.0, 2.0, n * n)


def mbb(nelx: int, nely: int):
    beam = load_example("topology_mbb").MBB(nelx, nely)
    x = np.random.default_rng(0).uniform(0.01, 1.0, nelx * nely)
    return (lambda x, precision="double": beam.compliance(x, precision=precision)), x


def relative(a, b) -> float:
    a, b = np.asarray(a, np.complex128), np.asarray(b, np.complex128)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def compare(name: str, loss, x: np.ndarray, single, double, repeats: int) -> None:
    x32, x64 = jnp.asarray(x, single), jnp.asarray(x, double)
    promoted = jax.jit(dx.filter_value_and_grad(loss))
    as_input = jax.jit(dx.filter_value_and_grad(lambda x: loss(x, precision="input")))
    want, got, single_solve = promoted(x64), promoted(x32), as_input(x32)
    s, d = np.dtype(single).name, np.dtype(double).name
    # the solve's own error: the same single-precision entries factored in single precision
    # against double; and the program's: entries computed in single precision, against double
    print(
        f'  the solve\'s error, {s} entries: precision="input" against promoted: value '
        f"{relative(single_solve[0], got[0]):.1e}, gradient {relative(single_solve[1], got[1]):.1e}"
    )
    for label, (c, g) in (("promoted (default)", got), ('precision="input"', single_solve)):
        print(
            f"  the {s} program, {label}, against the {d} program: value {relative(c, want[0]):.1e}, "
            f"gradient {relative(g, want[1]):.1e}"
        )
    sides = {
        f"{np.dtype(single).name}, promoted": lambda: promoted(x32),
        f"{np.dtype(double).name}": lambda: promoted(x64),
        f'{np.dtype(single).name}, precision="input"': lambda: as_input(x32),
    }
    times = interleaved(sides, repeats)
    for side, ts in times.items():
        print(f"  {side}: {describe(ts)}")
    print(f"  {memory()}")
    a, b, c = (median(ts) for ts in times.values())
    print(result_line("bench_precision", f"{name} single vs double", a, b, None, "promoted", "double"))
    print(result_line("bench_precision", f"{name} promoted vs single", a, c, None, "promoted", '"input"'))


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    repeats = args.repeats or (2 if args.small else 7)
    n = 24 if args.small else 108
    nelx, nely = (30, 10) if args.small else (180, 60)
    print(f"bench_precision: {machine()}")
    print(f"the bend-like problem: {n} x {n} grid, two wavelengths")
    loss, x = bend(n)
    compare("bend", loss, x, np.float32, np.float64, repeats)
    print(f"the MBB beam: {nelx} x {nely} elements")
    loss, x = mbb(nelx, nely)
    compare("mbb", loss, x, np.float32, np.float64, repeats)
    print(f"at the end: {load()}")


if __name__ == "__main__":
    main()
