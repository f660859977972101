"""Recognised calls: one loss written with `klujax.solve`, JAX's `spsolve` or sparsax's `lu_solve`, unchanged,
differentiated by plain `jax.jit(jax.value_and_grad(loss))` and by
`jax.jit(dx.filter_value_and_grad(loss))` (which rewrites the solve into a `dx.sparse_solve`
site: one factorisation per value and gradient where plain JAX factors 2-3 times; sparsax
factors once already, and the site brings the factorisation measured fastest for the pattern).

A complex Helmholtz-like operator on an `m x m` grid (n = m^2 unknowns), three losses of the
solution `x`: linear (`Re <w, x>`), an overlap `|<w, x>|^2` and `sum |x|^2`. Sizes n = 22,500
and 90,000 (`--small`: n = 400), interleaved repeats, and a 100-unknown klujax system (a
photonic circuit's size), where the rewrite would not pay and the call is left in place.
sparsax (real matrices only) solves the real convection-diffusion operator of the same grid.

    python benchmarks/bench_recognised.py            # n = 22,500 and 90,000
    python benchmarks/bench_recognised.py --small    # n = 400 (a smoke test)
    python benchmarks/bench_recognised.py --sizes 150  # m = 150 only (n = 22,500)
    python benchmarks/bench_recognised.py --sizes      # the 100-unknown circuit only
    python benchmarks/bench_recognised.py --sizes 300 --libraries klujax  # n = 90,000, klujax only
    python benchmarks/bench_recognised.py --sizes 150 --libraries sparsax  # sparsax.lu_solve, n = 22,500
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import klujax
import numpy as np
from _common import describe, interleaved, load, machine, median, memory, parser, result_line
from jax.experimental.sparse.linalg import spsolve

import deferax as dx

TARGETS = {"overlap": 0.6, "small": 1.05}
_CALLS = itertools.count(1)


def helmholtz(m: int):
    """`(rows, cols, indptr, values, b, w)`: a 5-point complex operator, CSR-ordered COO."""
    rng = np.random.default_rng(0)
    n = m * m
    i = np.arange(n)
    rows, cols, vals = [i], [i], [np.full(n, -4.0 + 0.5 + 0.05j) + rng.uniform(-0.1, 0.1, n)]
    for d, ok in ((-1, i % m != 0), (1, i % m != m - 1), (-m, i >= m), (m, i < n - m)):
        rows.append(i[ok]), cols.append(i[ok] + d), vals.append(np.full(ok.sum(), 1.0 + 0j))
    rows, cols, vals = np.concatenate(rows), np.concatenate(cols), np.concatenate(vals)
    order = np.lexsort((cols, rows))
    rows, cols, vals = rows[order], cols[order], vals[order]
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=n))])
    b = np.zeros(n, complex)
    b[n // 2 + m // 2] = 1.0
    w = np.exp(-(((i % m) - m / 3) ** 2 + ((i // m) - m / 3) ** 2) / (0.05 * m) ** 2) + 0j
    return rows, cols, indptr, jnp.asarray(vals), jnp.asarray(b), jnp.asarray(w)


def convection(m: int):
    """`(rows, cols, values, b, w)`: the real unsymmetric 5-point convection-diffusion
    operator of the same grid (sparsax solves real matrices only)."""
    rows, cols, _, _, b, w = helmholtz(m)
    n = m * m
    rng = np.random.default_rng(2)
    step = cols - rows
    weight = {0: 4.5, -1: -1.3, 1: -0.7, -m: -1.1, m: -0.9}
    values = np.array([weight[int(d)] for d in step]) * (1.0 + 0.05 * rng.uniform(-1, 1, rows.size))
    return rows, cols, jnp.asarray(values), jnp.real(b) + 1e-3 * jnp.arange(n) / n, jnp.real(w)


def losses(solve, w):
    return {
        "linear": lambda v, b: jnp.real(jnp.vdot(w, solve(v, b))),
        "overlap": lambda v, b: jnp.abs(jnp.vdot(w, solve(v, b))) ** 2,
        "power": lambda v, b: jnp.sum(jnp.abs(solve(v, b)) ** 2),
    }


def compare(name: str, loss, values, b, repeats: int) -> float:
    plain = jax.jit(jax.value_and_grad(loss))
    deferax = jax.jit(dx.filter_value_and_grad(loss))
    want, got = plain(values, b), deferax(values, b)
    error = float(jnp.max(jnp.abs(got[1] - want[1])) / jnp.max(jnp.abs(want[1])))
    plan = dx.explain(dx.filter_value_and_grad(loss), values, b)
    with dx.record() as timeline:
        jax.block_until_ready(deferax(values, b))
    steps = dict(sorted(timeline.counts(steps=True).items()))
    schedule = plan.sites[0].schedule if plan.sites else "left in place"
    print(f"--- {name}: {schedule}, {steps or 'no deferax steps'} per step, gradient error {error:.1e}")

    def fresh():  # (a new matrix each call, on both sides: sparsax keeps the factors of the entries it saw)
        return values * (1.0 + 1e-7 * next(_CALLS))

    times = interleaved({"plain": lambda: plain(fresh(), b), "deferax": lambda: deferax(fresh(), b)}, repeats)
    for side, ts in times.items():
        print(f"  {side:8s}: {describe(ts)}")
    print(f"  {memory()}")
    return median(times["deferax"]) / median(times["plain"]), times


def main():
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="*", default=None, help="grid sides m (n = m^2); none: the circuit only")
    p.add_argument("--libraries", nargs="*", default=["klujax", "spsolve", "sparsax"], help="klujax, spsolve, sparsax")
    args = p.parse_args()
    jax.config.update("jax_enable_x64", True)
    sizes = args.sizes if args.sizes is not None else ([20] if args.small else [150, 300])
    repeats = args.repeats or (2 if args.small else 7)
    print(f"bench_recognised: {machine()}")
    for m in sizes:
        rows, cols, indptr, values, b, w = helmholtz(m)
        solves = {
            "klujax": lambda v, b, rows=rows, cols=cols: klujax.solve(rows, cols, v, b),
            "spsolve": lambda v, b, cols=cols, indptr=indptr: spsolve(v, cols, indptr, b),
        }
        problems = {"klujax": (values, b, w), "spsolve": (values, b, w)}
        if "sparsax" in args.libraries:
            import sparsax

            real_rows, real_cols, real_values, real_b, real_w = convection(m)
            solves["sparsax"] = lambda v, b, rows=real_rows, cols=real_cols: sparsax.lu_solve(rows, cols, v, b)
            problems["sparsax"] = (real_values, real_b, real_w)
        for library, solve in solves.items():
            if library not in args.libraries:
                continue
            values_, b_, w_ = problems[library]
            for loss_name, loss in losses(solve, w_).items():
                case = f"{library} {loss_name} n={m * m}"
                ratio, times = compare(case, loss, values_, b_, repeats)
                # (the target is for a call that factors 2-3 times; sparsax factors once already)
                targeted = loss_name == "overlap" and library != "sparsax" and not args.small
                target = TARGETS["overlap"] if targeted else None
                new, old = median(times["deferax"]), median(times["plain"])
                print(result_line("bench_recognised", case, new, old, target, "deferax", "plain JAX"))

    # a circuit-sized system: 100 unknowns, a dense-ish random coupling, klujax
    n = 100
    rng = np.random.default_rng(1)
    dense = (rng.uniform(size=(n, n)) < 0.05) | np.eye(n, dtype=bool)
    rows, cols = np.nonzero(dense)
    values = jnp.asarray(np.where(rows == cols, 4.0, 0.3) * np.exp(1j * rng.uniform(0, 6.28, rows.size)))
    b = jnp.asarray(rng.normal(size=n) + 0j)
    w = jnp.asarray(rng.normal(size=n) + 0j)
    loss = losses(lambda v, b: klujax.solve(rows, cols, v, b), w)["overlap"]
    case = "klujax overlap n=100"
    print(dx.explain(dx.filter_value_and_grad(loss), values, b).recognised[0])
    ratio, times = compare(case, loss, values, b, max(repeats, 20) if not args.small else repeats)
    new, old = median(times["deferax"]), median(times["plain"])
    target = None if args.small else TARGETS["small"]
    print(result_line("bench_recognised", case, new, old, target, "deferax", "plain JAX"))
    print(f"at the end: {load()}")


if __name__ == "__main__":
    main()
