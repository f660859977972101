"""Two SciPy sparse solves at once on threads, with the default native thread pools.

Two `dx.sparse_solve` sites (two "wavelengths" of a complex 2D Helmholtz operator, n x n
grid, SuperLU), each seen by the loss through one number: the deferred schedule runs one
job per site (factor, forward solve, adjoint solve), and the two jobs run at the same time
on deferax's thread pool. Nothing sets `OPENBLAS_NUM_THREADS` or the like: OpenBLAS starts
one thread per core for each call, and deferax limits each of the two jobs to half the
cores while they run together. Sides, timed interleaved in one run:

- concurrent: the two jobs at once (deferax's default);
- sequential: the same jobs one after the other (`dx.set_concurrency(False)`), each with
  every core;
- concurrent, not limited: the two jobs at once with deferax's limit switched off (what the
  limit buys).

Also plain SciPy without deferax: one factorisation and solve, two in turn and two on two
threads, on one BLAS thread each (SuperLU releases Python's GIL: the pair overlaps), and
two on two threads with the default BLAS threads. And the cost of de-duplicating 6 basis
cotangents (`linear_adjoint`) beside one solve.

    python benchmarks/bench_threads.py            # 150 x 150 grid (22,500 unknowns)
    python benchmarks/bench_threads.py --small    # smoke test
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spl
from _common import describe, fmt, interleaved, load, machine, median, parser, result_line
from threadpoolctl import threadpool_info, threadpool_limits

import deferax as dx
from deferax._concurrency import _native_threads as _threads
from deferax._host._runner import _multiples

jax.config.update("jax_enable_x64", True)

TARGET = 1.0  # no slower than sequential


def helmholtz(n: int, k0: float) -> sp.csc_matrix:
    """`laplacian + k0^2 (1 + 0.1i)` on an n x n grid (h = 1/(n+1)), complex, sparse."""
    h = 1.0 / (n + 1)
    d = sp.diags([1.0, -2.0, 1.0], [-1, 0, 1], shape=(n, n)) / h**2
    eye = sp.identity(n)
    return (sp.kron(d, eye) + sp.kron(eye, d) + k0**2 * (1 + 0.1j) * sp.identity(n * n)).tocsc()


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    n = 40 if args.small else 150
    repeats = args.repeats or (2 if args.small else 7)
    print(f"bench_threads: {machine()}")
    print(f"native thread pools: {[(lib['internal_api'], lib['num_threads']) for lib in threadpool_info()]}")

    wavelengths = (20.0, 23.0)
    matrices = [helmholtz(n, k0) for k0 in wavelengths]
    values, pattern = zip(*[dx.SparsePattern.from_scipy(a) for a in matrices], strict=True)
    b = jnp.zeros(n * n, jnp.complex128).at[(n // 2) * n + n // 4].set(1.0)
    m = jnp.zeros(n * n, jnp.complex128).at[(n // 2) * n + 3 * n // 4].set(1.0)

    def loss(vs):
        return sum(jnp.real(jnp.vdot(m, dx.sparse_solve(v, p, b))) for v, p in zip(vs, pattern, strict=True))

    vs = tuple(jnp.asarray(v) for v in values)
    step = eqx.filter_jit(dx.filter_value_and_grad(loss))
    sites = dx.explain(dx.filter_value_and_grad(loss), vs).sites
    print(f"{n} x {n} grid, {n * n} unknowns, {len(sites)} sites: {[s.schedule for s in sites]}")

    # One solve, two in turn and two on plain threads, on one BLAS thread each: does SuperLU
    # overlap on threads at all (does it release Python's GIL)? And two on threads with the
    # default BLAS threads, the oversubscription deferax avoids.
    def solve(a):
        return spl.splu(a).solve(np.asarray(b))

    def pair_on_threads():
        with cf.ThreadPoolExecutor(2) as pool:
            return list(pool.map(solve, matrices))

    def one_blas_thread(fn):
        def run():
            with threadpool_limits(limits=1):
                return fn()

        return run

    plain = interleaved(
        {
            "one solve": one_blas_thread(lambda: solve(matrices[0])),
            "two in turn": one_blas_thread(lambda: [solve(a) for a in matrices]),
            "two threads": one_blas_thread(pair_on_threads),
            "two threads, default BLAS threads": pair_on_threads,
        },
        repeats,
    )
    for side, ts in plain.items():
        print(f"    plain SciPy {side:34s}: {describe(ts)}")
    gil = median(plain["two threads"]) / median(plain["two in turn"])
    print(
        "plain SciPy, one BLAS thread: two threads / two in turn = "
        f"{gil:.2f} (0.5: SuperLU overlaps fully; 1.0: not at all)"
    )

    # De-duplicating the cotangent rows of a basis schedule (host jobs with `linear_adjoint`),
    # beside the solve it may save.
    rows = [np.exp(1j * np.arange(n * n) * (r + 1) / n) for r in range(6)]
    dedup = interleaved({"dedup": lambda: _multiples(rows, jax.ShapeDtypeStruct((n * n,), jnp.complex128))}, repeats)[
        "dedup"
    ]
    print(
        f"de-duplication of 6 cotangent rows of {n * n} entries: "
        f"{describe(dedup)}; one solve {fmt(median(plain['one solve']))}"
    )

    def sequential():
        dx.set_concurrency(False)
        try:
            return step(vs)
        finally:
            dx.set_concurrency(True)

    def not_limited():
        shared = _threads.shared
        _threads.shared = lambda jobs: contextlib.nullcontext()
        try:
            return step(vs)
        finally:
            _threads.shared = shared

    v1, g1 = step(vs)
    v2, g2 = jax.value_and_grad(loss)(vs)  # the standard schedule: a check of the gradient
    diff = max(float(jnp.max(jnp.abs(a - c)) / jnp.max(jnp.abs(c))) for a, c in zip(g1, g2, strict=True))
    print(f"deferred vs standard gradient: relative difference {diff:.1e}")
    assert diff < 1e-9, diff

    times = interleaved(
        {"concurrent": lambda: step(vs), "sequential": sequential, "concurrent, not limited": not_limited}, repeats
    )
    for side, ts in times.items():
        print(f"    through deferax {side:24s}: {describe(ts)}")
    ratio_free = median(times["concurrent, not limited"]) / median(times["sequential"])
    print(f"concurrent, not limited / sequential = {ratio_free:.2f}")
    print(f"at the end: {load()}")
    concurrent, in_turn = median(times["concurrent"]), median(times["sequential"])
    line = result_line(
        "bench_threads", f"two sparse solves {n * n}", concurrent, in_turn, TARGET, "concurrent", "sequential"
    )
    if args.small:
        line = line.rsplit(" (target", 1)[0] + " (smoke size; no target)"
    print(line)


if __name__ == "__main__":
    main()
