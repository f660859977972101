"""Inverse design with a SciPy FDFD solver: a 2D frequency-domain Helmholtz problem.

The electric field `E` (out of plane) of a source at one frequency satisfies, on an n x n
grid with spacing 1,

    (laplacian + k0**2 * diag(eps)) E = source,        M(eps) E = b,

with `laplacian` the 5-point stencil and an absorbing layer (a lossy permittivity,
`Im eps > 0`) around the edges. `M` is complex and symmetric (`M.T == M`), not Hermitian.
The permittivity `x` of a square design region is the input; the figure of merit is the
power coupled into a Gaussian beam profile `m` on the far side, `|<m, E>|**2`. Gradient
ascent on `x` (kept in [1, 4]) raises it.

The expensive function `x -> E` is a host function: one sparse LU solve with SciPy. Its
reverse-mode derivative is an adjoint solve plus a cheap step:

    lam  = M^-T ct_E = M^-1 ct_E          (the adjoint solve: needs the cotangent, not E)
    ct_x = -k0**2 * Re(E * lam)[design]   (the combine step: needs E)

JAX's cotangent convention for complex arrays is the transpose, not the conjugate
transpose: `ct_x = Re(J^T ct_E)` for the Jacobian `J = dE/dx = -k0**2 M^-1 diag(E)` (a
real input, a complex output), hence `M^-T`, which is `M^-1` here. The test suite checks
this gradient against finite differences.

The objective depends on `E` through one complex number, `<m, E>`, so
`dx.filter_value_and_grad` runs the "deferred-basis" schedule: it computes the cotangent
for the two basis directions (`1` and `1j`) of that number before any solve, runs the
forward solve and the adjoint solves at the same time on the executor, and combines
them once `E` is known. `linear_adjoint=True` tells deferax that the adjoint solve is
linear in its right-hand side, so the second basis cotangent (`1j` times the first) needs
no second solve: one forward and one adjoint solve per step, run concurrently.

    python examples/fdfd_inverse_design.py            # 40 x 40 grid, 5 steps
    python examples/fdfd_inverse_design.py --small    # 24 x 24 grid, 3 steps
    python examples/fdfd_inverse_design.py --n 120 --steps 20
    python examples/fdfd_inverse_design.py --dask 2   # solves on a local Dask cluster
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spl

import deferax as dx

jax.config.update("jax_enable_x64", True)


class Helmholtz:
    """The FDFD problem: grid, absorbing layer, source, design region and target beam.

    A plain Python object: deferax hashes host functions by identity, and Dask sends it to
    its workers with cloudpickle.
    """

    def __init__(self, n: int = 40, wavelength: float = 10.0, absorber: int = 6):
        self.n = n
        self.k0 = 2 * np.pi / wavelength
        one = np.ones(n)
        d2 = sp.diags([one[:-1], -2 * one, one[:-1]], [-1, 0, 1])
        eye = sp.identity(n)
        self.laplacian = (sp.kron(d2, eye) + sp.kron(eye, d2)).tocsr()
        # a lossy layer of `absorber` cells around the edges, graded quadratically
        edge = np.minimum(np.arange(n), np.arange(n)[::-1]).astype(float)
        ramp = np.where(edge < absorber, ((absorber - edge) / absorber) ** 2, 0.0)
        self.eps_background = 1.0 + 2.0j * (ramp[:, None] + ramp[None, :])
        # the design region: a square in the middle
        d = max(2, n // 4)
        lo = (n - d) // 2
        self.design = (slice(lo, lo + d), slice(lo, lo + d))
        self.design_shape = (d, d)
        # a point source on the left, a Gaussian beam profile across a column on the right
        self.source = np.zeros((n, n), np.complex128)
        self.source[n // 2, absorber + 2] = 1.0
        rows = np.arange(n)
        self.mode = np.zeros((n, n), np.complex128)
        self.mode[:, n - absorber - 3] = np.exp(-(((rows - n / 2 - n / 8) / (n / 10)) ** 2))

    def operator(self, x: np.ndarray) -> sp.csc_matrix:
        """`M(x) = laplacian + k0**2 diag(eps(x))`, complex symmetric."""
        eps = self.eps_background.copy()
        eps[self.design] = x
        return (self.laplacian + sp.diags(self.k0**2 * eps.ravel())).tocsc()

    # ------------------------------------------------------------------ host functions (NumPy in, NumPy out)

    def solve(self, x: np.ndarray) -> np.ndarray:
        """The forward solve: `E = M(x)^-1 b`."""
        return spl.spsolve(self.operator(x), self.source.ravel()).reshape(self.n, self.n)

    def solve_adjoint(self, x: np.ndarray, ct_e: np.ndarray) -> np.ndarray:
        """The adjoint solve: `lam = M(x)^-T ct_E` (`M` is symmetric, so `M^-T = M^-1`)."""
        return spl.spsolve(self.operator(x).T.tocsc(), ct_e.ravel()).reshape(self.n, self.n)

    # ------------------------------------------------------------------ JAX side

    def combine(self, x, e, lam):
        """`ct_x = -k0**2 Re(E * lam)` on the design region (a JAX function)."""
        return -(self.k0**2) * jnp.real(e[self.design] * lam[self.design])

    def field(self, executor=None) -> dx.ExpensiveFn:
        """`x -> E` as an `ExpensiveFn`."""
        field = jax.ShapeDtypeStruct((self.n, self.n), jnp.complex128)
        return dx.host(
            self.solve,
            adjoint=self.solve_adjoint,
            combine=self.combine,
            out=field,
            adjoint_out=field,
            linear_adjoint=True,
            executor=executor,
            name="fdfd",
        )

    def objective(self, field: dx.ExpensiveFn):
        """`x -> |<m, E(x)>|**2`, the power coupled into the target beam."""
        mode = jnp.asarray(self.mode)

        def objective(x):
            return jnp.abs(jnp.vdot(mode, field(x))) ** 2

        return objective


def design(problem: Helmholtz, steps: int, executor=None, rate: float = 0.4, verbose: bool = True):
    """Gradient ascent on the design permittivity; returns the objective at each step."""
    objective = problem.objective(problem.field(executor))
    value_and_grad = dx.filter_value_and_grad(lambda x: -objective(x))
    x = jnp.full(problem.design_shape, 2.0, dtype=jnp.float64)
    history = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        loss, grad = value_and_grad(x)
        history.append(-float(loss))
        if verbose:
            print(f"step {step:3d}: objective {history[-1]:.6e}  ({time.perf_counter() - t0:.3f} s)", flush=True)
        if step < steps:
            x = jnp.clip(x - rate * grad / jnp.max(jnp.abs(grad)), 1.0, 4.0)
    return history, x


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="24 x 24 grid, 3 steps (a smoke test)")
    parser.add_argument("--n", type=int, default=None, help="grid size (default 40)")
    parser.add_argument("--steps", type=int, default=None, help="design steps (default 5)")
    parser.add_argument("--dask", type=int, default=0, metavar="WORKERS", help="run the solves on a local Dask cluster")
    args = parser.parse_args()
    n = args.n or (24 if args.small else 40)
    steps = args.steps if args.steps is not None else (3 if args.small else 5)
    problem = Helmholtz(n)
    print(f"FDFD inverse design: {n} x {n} grid, design region {problem.design_shape}, {steps} steps")
    print(dx.explain(lambda x: -problem.objective(problem.field())(x), jnp.full(problem.design_shape, 2.0)))

    if args.dask:
        try:
            from distributed import Client, LocalCluster
        except ModuleNotFoundError:
            raise SystemExit(
                "--dask needs Dask's `distributed`: install it with "
                "`pip install -e .[dask]` (or `pip install distributed`)."
            ) from None

        with LocalCluster(n_workers=args.dask, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
            with Client(cluster) as client:
                history, _ = design(problem, steps, executor=client)
    else:
        history, _ = design(problem, steps)
    print(f"objective: {history[0]:.6e} -> {history[-1]:.6e} ({history[-1] / history[0]:.2f}x)")
    if not history[-1] > history[0]:
        raise SystemExit("the design did not improve the objective")


if __name__ == "__main__":
    main()
