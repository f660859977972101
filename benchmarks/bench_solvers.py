"""Sparse direct solvers side by side: one factorisation, a forward solve and a transposed
(adjoint) solve, as one value and gradient through `dx.sparse_solve` needs.

Sides, all on the host with NumPy values from a `scipy.sparse.csc_matrix` (as
`dx.AbstractSparseSolver.factor` receives it):

- SciPy's SuperLU through `dx.SuperLU()` (COLAMD ordering, the default) and
  `dx.SuperLU(permc_spec="MMD_AT_PLUS_A")`;
- KLU through klujax's handle API: `analyze` + `factor` once, then `solve_with_numeric` and
  `tsolve_with_numeric` with the numeric handle (the handles closed after);
- the same with the symbolic analysis (KLU's ordering) made once for the pattern, outside
  the timing, as a solver that kept it per pattern would run;
- for reference, plain `klujax.solve` under `jax.jit` for the forward and the adjoint (two
  factorisations, as klujax's own VJP makes).

Systems: (a) a complex Helmholtz-like operator on a 150 x 150 grid (n = 22,500; `helmholtz`
from `bench_cost.py`, k0 = 20, permittivity uniform in [1, 2]) and (a') the gentler complex
operator of `bench_recognised.py` at the same size, (b) the 180 x 60 MBB beam's stiffness
(`examples/topology_mbb.py`, densities uniform in [0.01, 1], real symmetric), (c) a
circuit-sized complex system of 100 unknowns. Interleaved repeats.

    python benchmarks/bench_solvers.py            # the sizes above
    python benchmarks/bench_solvers.py --small    # tiny sizes (a smoke test); skips KLU without klujax
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pathlib  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import scipy.sparse  # noqa: E402
from _common import describe, interleaved, load, machine, median, memory, parser, result_line  # noqa: E402

import deferax as dx  # noqa: E402

jax.config.update("jax_enable_x64", True)

try:  # (importing klujax turns jax_enable_x64 on and sets jax_platform_name to "cpu" for the process)
    import klujax
except ImportError:
    klujax = None


def helmholtz_cost(m: int):
    """(a): `bench_cost.py`'s operator, k0 = 20, permittivity uniform in [1, 2]."""
    from bench_cost import helmholtz

    pattern, base, diag = helmholtz(m)
    values = np.asarray(base).copy()
    values[np.asarray(diag)] -= 20.0**2 * (1.0 + np.random.default_rng(0).uniform(size=m * m))
    return pattern.rows, pattern.cols, values, m * m


def helmholtz_recognised(m: int):
    """(a'): `bench_recognised.py`'s operator (that script imports klujax: None without it)."""
    try:
        from bench_recognised import helmholtz
    except ImportError:
        return None

    rows, cols, _, values, _, _ = helmholtz(m)
    return rows, cols, np.asarray(values), m * m


def mbb(nelx: int, nely: int):
    """(b): the MBB beam's reduced stiffness (duplicate entries: the elements' blocks add up)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
    from topology_mbb import MBB

    beam = MBB(nelx, nely)
    x = np.random.default_rng(0).uniform(0.01, 1.0, nelx * nely)
    values = beam.stiffness(x)[beam.entry_element] * beam.entry_ke
    return beam.pattern.rows, beam.pattern.cols, values, beam.pattern.n


def circuit(n: int = 100):
    """(c): `I - S C`-like: a unit diagonal and 4 complex couplings a row of modulus < 0.25."""
    rng = np.random.default_rng(0)
    rows = [np.arange(n)] + [np.arange(n)] * 4
    cols = [np.arange(n)] + [rng.integers(0, n, n) for _ in range(4)]
    coupling = 0.24 * rng.uniform(size=4 * n) * np.exp(2j * np.pi * rng.uniform(size=4 * n))
    values = np.concatenate([np.ones(n, complex), coupling])
    return np.concatenate(rows), np.concatenate(cols), values, n


def sides(rows, cols, values, n):
    matrix = scipy.sparse.csc_matrix((values, (rows, cols)), shape=(n, n))  # duplicates summed
    b = np.random.default_rng(1).normal(size=n).astype(values.dtype)

    def superlu(solver):
        def run():
            lu = solver.factor(matrix)
            return solver.solve(lu, b, False), solver.solve(lu, b, True)

        return run

    out = {
        "SuperLU COLAMD": superlu(dx.SuperLU()),
        "SuperLU MMD_AT_PLUS_A": superlu(dx.SuperLU(permc_spec="MMD_AT_PLUS_A")),
    }
    if klujax is None:
        return out, matrix, b

    def klu_host():
        coo = matrix.tocoo()  # (what a solver given the csc matrix would do: KLU's analyze rejects duplicates)
        r, c = coo.row.astype(np.int32), coo.col.astype(np.int32)
        with klujax.analyze(r, c, n) as symbolic, klujax.factor(r, c, coo.data, symbolic) as numeric:
            x = np.asarray(klujax.solve_with_numeric(numeric, b, symbolic))
            xt = np.asarray(klujax.tsolve_with_numeric(numeric, b, symbolic))
        return x, xt

    coo = matrix.tocoo()
    r, c = coo.row.astype(np.int32), coo.col.astype(np.int32)
    kept = klujax.analyze(r, c, n)  # a solver could keep the analysis of each pattern: KLU's ordering, done once

    def klu_kept():
        coo = matrix.tocoo()
        with klujax.factor(coo.row.astype(np.int32), coo.col.astype(np.int32), coo.data, kept) as numeric:
            x = np.asarray(klujax.solve_with_numeric(numeric, b, kept))
            xt = np.asarray(klujax.tsolve_with_numeric(numeric, b, kept))
        return x, xt

    r, c, v = (jax.numpy.asarray(a) for a in (coo.row.astype(np.int32), coo.col.astype(np.int32), coo.data))
    both = jax.jit(lambda v, b: (klujax.solve(r, c, v, b), klujax.solve(c, r, v, b)))  # A x = b, A^T x = b
    out["KLU handles (host)"] = klu_host
    out["KLU, analysis kept"] = klu_kept
    out["klujax.solve jit x2"] = lambda: both(v, jax.numpy.asarray(b))
    return out, matrix, b


def check(run, matrix, b) -> float:
    x, xt = (np.asarray(a).ravel() for a in run())
    scale = np.abs(b).max()
    return max(np.abs(matrix @ x - b).max(), np.abs(matrix.T @ xt - b).max()) / scale


def from_callback(run, matrix, b) -> str:
    """Run `run` (the KLU handle API, itself JAX calls) as deferax runs a host job: on a pool
    thread, while a `jax.pure_callback` inside a jitted function waits for it. A deadlock would
    show as the timeout."""
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(1)

    def host(bb):
        return np.asarray(pool.submit(run).result(timeout=60)[0]).astype(bb.dtype).reshape(bb.shape)

    f = jax.jit(lambda bb: jax.pure_callback(host, jax.ShapeDtypeStruct(bb.shape, bb.dtype), bb))
    try:
        x = np.asarray(f(jax.numpy.asarray(b)))
    except Exception as e:  # (a timeout reaches here as the callback's error)
        return f"FAILED ({type(e).__name__}: {e})"
    finally:
        pool.shutdown()
    return f"ran, residual {np.abs(matrix @ x - b).max() / np.abs(b).max():.1e}"


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    repeats = args.repeats or (2 if args.small else 7)
    print(f"bench_solvers: {machine()}")
    if klujax is None:
        print("bench_solvers: klujax is not installed: the KLU sides are skipped (pip install klujax)")
    m = 12 if args.small else 150
    cases = {
        f"helmholtz (bench_cost) n={m * m} complex": lambda: helmholtz_cost(m),
        f"helmholtz (bench_recognised) n={m * m} complex": lambda: helmholtz_recognised(m),
        "mbb {} x {} real symmetric": (12, 4) if args.small else (180, 60),
        "circuit n=100 complex": circuit,
    }
    results = []
    for case, make in cases.items():
        if isinstance(make, tuple):
            case, make = case.format(*make), (lambda shape=make: mbb(*shape))
        system = make()
        if system is None:
            print(f"--- {case}: skipped (its builder needs klujax)")
            continue
        rows, cols, values, n = system
        runs, matrix, b = sides(rows, cols, values, n)
        print(f"--- {case}: n = {n}, {matrix.nnz} entries; {load()}")
        for name, run in runs.items():
            print(f"  residual {name}: {check(run, matrix, b):.1e}")
        if klujax is not None:
            ran = from_callback(runs["KLU handles (host)"], matrix, b)
            print(f"  KLU handles on a pool thread inside jax.pure_callback under jit: {ran}")
        times = interleaved(runs, repeats, warmup=1 if args.small else 2)
        for name, ts in times.items():
            print(f"  {name:24s}: {describe(ts)}")
        print(f"  {memory()}")
        med = {name: median(ts) for name, ts in times.items()}
        base = med["SuperLU COLAMD"]
        results.append(result_line("bench_solvers", case, med["SuperLU MMD_AT_PLUS_A"], base, None, "MMD", "COLAMD"))
        if klujax is not None:
            results.append(result_line("bench_solvers", case, med["KLU handles (host)"], base, None, "KLU", "COLAMD"))
            results.append(
                result_line(
                    "bench_solvers", case, med["KLU handles (host)"], med["SuperLU MMD_AT_PLUS_A"], None, "KLU", "MMD"
                )
            )
            results.append(
                result_line(
                    "bench_solvers",
                    case + " analysis kept",
                    med["KLU, analysis kept"],
                    med["SuperLU MMD_AT_PLUS_A"],
                    None,
                    "KLU",
                    "MMD",
                )
            )
            results.append(
                result_line(
                    "bench_solvers",
                    case + " klujax.solve x2",
                    med["klujax.solve jit x2"],
                    med["KLU handles (host)"],
                    None,
                    "klujax.solve",
                    "KLU",
                )
            )
    print(f"at the end: {load()}")
    for line in results:
        print(line)


if __name__ == "__main__":
    main()
