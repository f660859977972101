"""Host solvers (`dx.host`) on executors: deferred vs standard schedule, measured side by side.

(a) FDFD (2D Helmholtz) with an iterative solver: the forward solve `M E = b` and the
    adjoint solve `M lam = ct` (M is complex symmetric) are BiCGSTAB runs to a relative
    residual of 1e-9 on the same operator, preconditioned with the complex-shifted
    Laplacian (inverted by fast sine transforms); they take about the same number of
    iterations. The operator is applied matrix-free with NumPy slicing and the
    preconditioner with `scipy.fft`, both of which release the GIL, so two solves use the two
    cores from two threads (SciPy's sparse matrix-vector product keeps the GIL: with it two
    threads run one after the other). BLAS is kept to one thread per solve.
    The loss is `-|<m, E>|^2`: the deferred-basis schedule with `linear_adjoint=True` runs
    one forward and one adjoint solve at the same time on the default thread pool; the
    standard schedule runs them one after the other. (For comparison, without
    `linear_adjoint` it runs one forward and two adjoint solves on the two cores.)

(b) A latency-bound remote job: a "simulation service" with a fixed service time per job
    (`time.sleep` in a worker of a pool of W workers) and a cheap linear map as the result.
    One site on W=2 workers: standard waits 2 service times, deferred 1. Four independent
    sites on W=4 workers: standard waits 8, deferred 2 (8 jobs, 4 at a time).

    python benchmarks/bench_host.py            # full size
    python benchmarks/bench_host.py --small    # smoke test
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one BLAS thread per solve: the solves are the parallelism

import concurrent.futures as cf  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import scipy.fft as sfft  # noqa: E402
import scipy.sparse.linalg as spl  # noqa: E402
from _common import block, describe, interleaved, load, machine, median, parser, result_line  # noqa: E402

import deferax as dx  # noqa: E402

jax.config.update("jax_enable_x64", True)

TARGETS = {"fdfd": 0.6, "service": 0.55, "service-4": 0.3}


# ---------------------------------------------------------------------------- (a) FDFD


class StencilHelmholtz:
    """`M(x) = laplacian + k0^2 diag(eps(x))` applied matrix-free, solved with BiCGSTAB and a
    complex-shifted-Laplacian preconditioner.

    The solves must converge: the deferred-basis schedule combines adjoint solves of basis
    cotangents linearly, which is exact only for a solve that is linear in its right-hand
    side (an unconverged Krylov solve is not).
    """

    def __init__(self, n: int, wavelength: float = 16.0, rtol: float = 1e-9, absorber: int = 10):
        self.n, self.rtol = n, rtol
        self.k0 = 2 * np.pi / wavelength
        edge = np.minimum(np.arange(n), np.arange(n)[::-1]).astype(float)
        ramp = np.where(edge < absorber, ((absorber - edge) / absorber) ** 2, 0.0)
        self.eps_background = 1.0 + 0.1j + 2.0j * (ramp[:, None] + ramp[None, :])
        d = n // 4
        lo = (n - d) // 2
        self.design = (slice(lo, lo + d), slice(lo, lo + d))
        self.design_shape = (d, d)
        self.source = np.zeros((n, n), np.complex128)
        self.source[n // 2, absorber + 2] = 1.0
        rows = np.arange(n)
        self.mode = np.zeros((n, n), np.complex128)
        self.mode[:, n - absorber - 3] = np.exp(-(((rows - n / 2) / (n / 10)) ** 2))
        # the preconditioner: (laplacian + k0^2 (1 + 0.5j))^-1, diagonal in the DST-I basis
        j = np.arange(1, n + 1)
        eig = -4 * np.sin(np.pi * j / (2 * (n + 1))) ** 2
        self.shifted = eig[:, None] + eig[None, :] + self.k0**2 * (1.0 + 0.5j)

    def operator(self, x: np.ndarray) -> spl.LinearOperator:
        n = self.n
        ke = self.k0**2 * self.eps_background
        ke[self.design] = self.k0**2 * x

        def matvec(v):
            u = v.reshape(n, n)
            out = (ke - 4.0) * u
            out[1:] += u[:-1]
            out[:-1] += u[1:]
            out[:, 1:] += u[:, :-1]
            out[:, :-1] += u[:, 1:]
            return out.ravel()

        # symmetric: the transpose is the same map
        return spl.LinearOperator((n * n, n * n), matvec=matvec, rmatvec=matvec, dtype=np.complex128)

    def preconditioner(self) -> spl.LinearOperator:
        n = self.n

        def apply(v):
            return sfft.idstn(sfft.dstn(v.reshape(n, n), type=1) / self.shifted, type=1).ravel()

        return spl.LinearOperator((n * n, n * n), matvec=apply, dtype=np.complex128)

    def _solve(self, x, rhs, iterations=None):
        count = [0]
        e, info = spl.bicgstab(
            self.operator(x),
            rhs.ravel(),
            rtol=self.rtol,
            M=self.preconditioner(),
            maxiter=10 * self.n,
            callback=lambda _: count.__setitem__(0, count[0] + 1),
        )
        if info != 0:
            raise RuntimeError(f"BiCGSTAB did not converge (info={info})")
        if iterations is not None:
            iterations.append(count[0])
        return e.reshape(self.n, self.n)

    def solve(self, x):
        return self._solve(x, self.source)

    def solve_adjoint(self, x, ct):
        return self._solve(x, ct)

    def iterations(self, x) -> tuple[int, int]:
        """BiCGSTAB iterations of the forward solve and of the adjoint solve for the overlap."""
        counts: list[int] = []
        self._solve(x, self.source, counts)
        self._solve(x, np.conj(self.mode), counts)
        return counts[0], counts[1]

    def loss(self, **kwargs):
        field = jax.ShapeDtypeStruct((self.n, self.n), jnp.complex128)
        f = dx.host(
            self.solve,
            adjoint=self.solve_adjoint,
            combine=lambda x, e, lam: -(self.k0**2) * jnp.real(e[self.design] * lam[self.design]),
            out=field,
            adjoint_out=field,
            name="fdfd",
            **kwargs,
        )
        mode = jnp.asarray(self.mode)
        return lambda x: -(jnp.abs(jnp.vdot(mode, f(x))) ** 2)


def bench_fdfd(small: bool, repeats: int) -> list[str]:
    n = 63 if small else 255  # 2 (n + 1) a power of two: fast sine transforms
    problem = StencilHelmholtz(n)
    x = jnp.full(problem.design_shape, 2.0, dtype=jnp.float64)
    t0 = time.perf_counter()
    problem.solve(np.asarray(x))
    one = time.perf_counter() - t0
    forward, adjoint = problem.iterations(np.asarray(x))
    print(
        f"(a) FDFD {n}x{n}, BiCGSTAB to rtol {problem.rtol:g}: {forward} "
        f"iterations forward, {adjoint} adjoint; one solve {one:.3f} s"
    )
    lines = []
    for label, linear in (("linear_adjoint=True", True), ("linear_adjoint=False", False)):
        loss = problem.loss(linear_adjoint=linear)
        # max_basis=2 for both: without linear_adjoint the default limit (1) would keep the
        # complex overlap (k = 2) standard; the row shows what deferring it would cost.
        deferred = dx.filter_value_and_grad(loss, max_basis=2)
        site = dx.explain(deferred, x).sites[0]
        standard = dx.filter_value_and_grad(loss, schedule="standard")
        v1, g1 = deferred(x)
        v2, g2 = standard(x)
        diff = float(jnp.max(jnp.abs(g1 - g2)) / jnp.max(jnp.abs(g2)))
        print(
            f"    {label}: site schedule {site.schedule} (k={site.k}); "
            f"deferred vs standard gradient relative difference {diff:.1e}"
        )
        assert diff < 1e-6, diff
        times = interleaved({"deferred": lambda d=deferred: d(x), "standard": lambda s=standard: s(x)}, repeats)
        for side, ts in times.items():
            print(f"    {side:9s}: {describe(ts)}")
        line = result_line(
            "bench_host", f"fdfd-{n} {label}", median(times["deferred"]), median(times["standard"]), TARGETS["fdfd"]
        )
        if not linear:
            line = line.rsplit(" (target", 1)[0] + " (for comparison: 3 solves on 2 cores)"
        elif small:
            line = line.rsplit(" (target", 1)[0] + " (smoke size: too small for two threads to pay off; no target)"
        lines.append(line)
    return lines


# ---------------------------------------------------------------------------- (b) a simulation service


def service_fn(service: cf.Executor, seconds: float, size: int, name: str, seed: int) -> dx.ExpensiveFn:
    """A job that waits `seconds` on a service worker, then applies a small linear map."""
    g = np.random.default_rng(seed).normal(size=(size, size))

    def simulate(x):
        time.sleep(seconds)
        return g @ x

    def simulate_adjoint(x, ct):
        time.sleep(seconds)
        return g.T @ ct

    return dx.host(
        simulate, adjoint=simulate_adjoint, out=jax.ShapeDtypeStruct((size,), jnp.float64), executor=service, name=name
    )


def bench_service(small: bool, repeats: int) -> list[str]:
    seconds = 0.02 if small else 0.1
    size = 16
    x = jnp.linspace(0.0, 1.0, size)
    w = jnp.cos(jnp.arange(size, dtype=jnp.float64))
    lines = []
    for sites, workers, target in ((1, 2, "service"), (4, 4, "service-4")):
        service = cf.ThreadPoolExecutor(workers, thread_name_prefix="service")
        fs = [service_fn(service, seconds, size, f"service{i}", i) for i in range(sites)]

        def loss(x, fs=fs):
            return sum(jnp.sum(w * f(x * (i + 1))) for i, f in enumerate(fs)) + jnp.sum(x**2)

        print(f"(b) {sites} site(s), a service with {workers} workers and {seconds} s per job")
        for mode, wrap in (("eager", lambda f: f), ("jit", eqx.filter_jit)):
            deferred = wrap(dx.filter_value_and_grad(loss))
            standard = wrap(dx.filter_value_and_grad(loss, schedule="standard"))
            times = interleaved({"deferred": lambda d=deferred: d(x), "standard": lambda s=standard: s(x)}, repeats)
            for side, ts in times.items():
                print(f"    {mode:5s} {side:9s}: {describe(ts)}")
            line = result_line(
                "bench_host",
                f"service {sites} site(s) {workers} workers {mode}",
                median(times["deferred"]),
                median(times["standard"]),
                TARGETS[target],
            )
            lines.append(line)
        service.shutdown()
    return lines


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    repeats = args.repeats or (2 if args.small else 7)
    print(f"bench_host: {machine()}")
    lines = bench_fdfd(args.small, repeats)
    lines += bench_service(args.small, repeats)
    print(f"at the end: {load()}")
    for line in lines:
        block(line)
        print(line)


if __name__ == "__main__":
    main()
