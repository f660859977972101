"""Topology optimisation of the MBB beam: a finite-element compliance through `dx.sparse_solve`.

Half of a simply supported beam, `nelx x nely` square Q4 elements (plane stress, Poisson's
ratio 0.3), loaded downwards at its top-left corner; the left edge slides vertically (the
symmetry plane) and the bottom-right corner rests on a roller. Each element has a density
`x_e` in (0, 1], and SIMP gives it the stiffness `E_e = E_min + x_e**3 (1 - E_min)`. The
compliance `c = f . u`, with `K(x) u = f` on the free degrees of freedom, is the quantity to
minimise.

The stiffness is assembled as the entries of `dx.sparse_solve`: each element adds its 8 x 8
block, scaled by `E_e`, and the fixed degrees of freedom are removed from the pattern (their
rows and columns dropped, the rest renumbered). The compliance is linear in `u`, so the
gradient defers: one job factors `K`, solves `f` and the adjoint right-hand side (also `f`).
The script checks the gradient against the analytic SIMP sensitivity,
`dc/dx_e = -3 x_e**2 (1 - E_min) u_e^T KE u_e`, then takes a few optimality-criteria steps.

    python examples/topology_mbb.py          # 60 x 20 elements
    python examples/topology_mbb.py --small  # 12 x 4, for a quick run
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import deferax as dx

E_MIN, PENAL, NU = 1e-9, 3.0, 0.3


def element_stiffness(nu=NU):
    """The 8 x 8 stiffness of a unit square Q4 element, plane stress, Young's modulus 1."""
    k = np.array(
        [1 / 2 - nu / 6, 1 / 8 + nu / 8, -1 / 4 - nu / 12, -1 / 8 + 3 * nu / 8]
        + [-1 / 4 + nu / 12, -1 / 8 - nu / 8, nu / 6, 1 / 8 - 3 * nu / 8]
    )
    order = [
        [0, 1, 2, 3, 4, 5, 6, 7],
        [1, 0, 7, 6, 5, 4, 3, 2],
        [2, 7, 0, 5, 6, 3, 4, 1],
        [3, 6, 5, 0, 7, 2, 1, 4],
        [4, 5, 6, 7, 0, 1, 2, 3],
        [5, 4, 3, 2, 1, 0, 7, 6],
        [6, 3, 4, 1, 2, 7, 0, 5],
        [7, 2, 1, 4, 3, 6, 5, 0],
    ]
    return k[order] / (1 - nu**2)


class MBB:
    """The MBB beam's mesh, supports and load: everything but the densities (NumPy, static).

    - `pattern`: the reduced stiffness's [`deferax.SparsePattern`] on the free degrees of freedom;
    - `entry_element`, `entry_ke`: for each of the pattern's entries, its element and its
      value in `KE` (so `values = E[entry_element] * entry_ke`);
    - `f`: the load on the free degrees of freedom; `free`: their indices among all;
    - `edofs`: each element's 8 degrees of freedom (among all).
    """

    def __init__(self, nelx: int, nely: int):
        self.nelx, self.nely = nelx, nely
        self.ke = element_stiffness()
        elx, ely = np.meshgrid(np.arange(nelx), np.arange(nely), indexing="ij")
        n1 = ((nely + 1) * elx + ely).ravel()  # each element's upper-left node, column by column
        n2 = ((nely + 1) * (elx + 1) + ely).ravel()
        self.edofs = np.stack(
            [2 * n1 + 2, 2 * n1 + 3, 2 * n2 + 2, 2 * n2 + 3, 2 * n2, 2 * n2 + 1, 2 * n1, 2 * n1 + 1], axis=1
        )
        ndof = 2 * (nelx + 1) * (nely + 1)
        fixed = np.union1d(np.arange(0, 2 * (nely + 1), 2), [ndof - 1])  # the left edge in x, a roller in y
        self.free = np.setdiff1d(np.arange(ndof), fixed)
        number = np.full(ndof, -1)
        number[self.free] = np.arange(self.free.size)  # the free degrees of freedom renumbered
        rows = np.repeat(self.edofs, 8, axis=1).ravel()  # element e's entry (i, j) at 64 e + 8 i + j
        cols = np.tile(self.edofs, (1, 8)).ravel()
        keep = (number[rows] >= 0) & (number[cols] >= 0)
        self.pattern = dx.SparsePattern(number[rows[keep]], number[cols[keep]], self.free.size)
        self.entry_element = np.repeat(np.arange(nelx * nely), 64)[keep]
        self.entry_ke = np.tile(self.ke.ravel(), nelx * nely)[keep]
        f = np.zeros(ndof)
        f[1] = -1.0  # a unit load down at the top-left corner
        self.f = f[self.free]

    def stiffness(self, x):
        """SIMP's `E_e` for the densities `x` (one per element, column by column)."""
        return E_MIN + x**PENAL * (1.0 - E_MIN)

    def values(self, x):
        """The reduced stiffness's entries for the densities `x`, in `x`'s dtype."""
        return self.stiffness(x)[self.entry_element] * jnp.asarray(self.entry_ke, x.dtype)

    def compliance(self, x, **solve_options):
        """`f . u` with `K(x) u = f`, through `dx.sparse_solve`."""
        f = jnp.asarray(self.f, x.dtype)
        u = dx.sparse_solve(self.values(x), self.pattern, f, **solve_options)
        return jnp.dot(f, u)

    def sensitivity(self, x):
        """The compliance and its analytic gradient, in NumPy and SciPy (float64): the reference."""
        import scipy.sparse
        import scipy.sparse.linalg

        x = np.asarray(x, np.float64)
        values = (E_MIN + x**PENAL * (1.0 - E_MIN))[self.entry_element] * self.entry_ke
        p = self.pattern
        k = scipy.sparse.csc_matrix((values, (p.rows, p.cols)), shape=(p.n, p.n))
        u = np.zeros(2 * (self.nelx + 1) * (self.nely + 1))
        u[self.free] = scipy.sparse.linalg.spsolve(k, self.f)
        ue = u[self.edofs]
        energy = np.einsum("ei,ij,ej->e", ue, self.ke, ue)
        return float(self.f @ u[self.free]), -PENAL * x ** (PENAL - 1) * (1.0 - E_MIN) * energy


def optimality_criteria(x, dc, volfrac, move=0.2):
    """The classic density update: scale each density by `sqrt(-dc / lambda)`, with the
    multiplier `lambda` found by bisection so that the mean density is `volfrac`."""
    lo, hi = 1e-9, 1e9
    while (hi - lo) / (hi + lo) > 1e-4:
        mid = 0.5 * (lo + hi)
        new = np.clip(x * np.sqrt(np.maximum(-dc, 0.0) / mid), np.maximum(0.001, x - move), np.minimum(1.0, x + move))
        lo, hi = (mid, hi) if new.mean() > volfrac else (lo, mid)
    return new


def main(nelx=60, nely=20, steps=5, volfrac=0.5):
    beam = MBB(nelx, nely)
    x = jnp.full(nelx * nely, volfrac)
    value_and_grad = jax.jit(dx.filter_value_and_grad(beam.compliance))

    c, dc = value_and_grad(x)
    ref_c, ref_dc = beam.sensitivity(x)
    value_error = abs(float(c) - ref_c) / abs(ref_c)
    grad_error = float(np.max(np.abs(np.asarray(dc) - ref_dc)) / np.max(np.abs(ref_dc)))
    print(f"{nelx} x {nely} elements, {beam.pattern.n} unknowns, {beam.pattern.nnz} entries")
    print(f"compliance {float(c):.6g}; against the analytic sensitivity:", end=" ")
    print(f"value {value_error:.1e}, gradient {grad_error:.1e}")
    assert value_error < 1e-10 and grad_error < 1e-10, (value_error, grad_error)
    plan = dx.explain(beam.compliance, x)  # (a small beam's solve runs inside the program: no site)
    print(plan.sites[0].schedule if plan.sites else "solved inside the program")

    for step in range(steps):
        x = jnp.asarray(optimality_criteria(np.asarray(x), np.asarray(dc), volfrac))
        c, dc = value_and_grad(x)
        print(f"step {step + 1}: compliance {float(c):.4f}")


if __name__ == "__main__":
    jax.config.update("jax_enable_x64", True)
    if "--small" in sys.argv:
        main(12, 4, steps=2)
    else:
        main()
