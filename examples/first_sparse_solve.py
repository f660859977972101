"""A first inverse-design script: a sparse solve `A(p) x = b` inside a loss `|<m, x>|^2`.

A 2D frequency-domain field `x` solves `A(p) x = b`, with

    A(p) = laplacian + k0**2 * diag(eps(p)),

`eps(p)` the permittivity: a lossy layer at the edges (so `A` is complex) and the design
parameters `p` in a square in the middle. `b` is a point source; `m` is a beam profile on
the far side, and the figure of merit is the power coupled into it, `|<m, x>|^2`.

`dx.sparse_solve(values, pattern, x)` is the solve, differentiable with respect to the
matrix entries `values` (a JAX array) on a fixed SciPy sparsity `pattern`. The loss sees
`x` only through one complex number, `<m, x>`, so `dx.filter_value_and_grad` computes
the adjoint's right-hand sides before `x` is known and runs the forward and the adjoint
solves in one job, with one factorisation of `A(p)`: `dx.explain` says so below, and a
recording of one step counts what ran. At the end the script checks its gradient against
plain JAX (a dense `jnp.linalg.solve`).

    python examples/first_sparse_solve.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

import deferax as dx

jax.config.update("jax_enable_x64", True)

# --- the problem: an n x n grid, a design square of d x d cells in the middle
n, d, k0 = 30, 8, 2 * np.pi / 10.0
d2 = sp.diags([np.ones(n - 1), -2 * np.ones(n), np.ones(n - 1)], [-1, 0, 1])
laplacian = sp.kronsum(d2, d2)  # the 5-point stencil
edge = np.minimum(np.arange(n), np.arange(n)[::-1])
ramp = np.clip((6.0 - edge) / 6.0, 0.0, None) ** 2  # an absorbing layer 6 cells deep
background = 1.0 + 2.0j * (ramp[:, None] + ramp[None, :])
design = (slice((n - d) // 2, (n + d) // 2),) * 2  # the rows and columns of the design square

# The matrix entries: the Laplacian's, then k0**2 * eps on the diagonal (entries at one
# position add up). The pattern is fixed; the values depend on p.
lap_values, lap_pattern = dx.SparsePattern.from_scipy(laplacian)
diagonal = np.arange(n * n)
pattern = dx.SparsePattern(
    rows=np.concatenate([lap_pattern.rows, diagonal]),
    cols=np.concatenate([lap_pattern.cols, diagonal]),
    n=n * n,
)

b = jnp.zeros(n * n, complex).at[n // 2 * n + 8].set(1.0)  # a point source on the left
rows = np.arange(n)
m = np.zeros((n, n), complex)
m[:, n - 9] = np.exp(-(((rows - n / 2 - 3) / 3.0) ** 2))  # a beam profile on the right
m = jnp.asarray(m.ravel())


def matrix_values(p):
    eps = jnp.asarray(background).at[design].set(p)  # p: the permittivity of the design square
    return jnp.concatenate([jnp.asarray(lap_values, complex), k0**2 * eps.ravel()])


def loss(p, solver=None):  # (solver: SciPy's SuperLU unless told otherwise)
    x = dx.sparse_solve(matrix_values(p), pattern, b, solver=solver)
    return -(jnp.abs(jnp.vdot(m, x)) ** 2)  # minimise: maximise the power in the beam


# --- what will run
p = jnp.full((d, d), 2.0)
plan = dx.explain(loss, p)
print(plan)

# --- a few steps of gradient descent, each recorded
value_and_grad = dx.filter_value_and_grad(loss)
for step in range(5):
    with dx.record() as timeline:
        value, grad = value_and_grad(p)
    print(f"step {step}: power in the beam {-float(value):.4e}, ran {timeline.counts()}")
    p = jnp.clip(p - 0.3 * grad / jnp.max(jnp.abs(grad)), 1.0, 4.0)


# --- checks (CI runs this script): the schedule, the work per step, the gradient
def dense_loss(p):  # the same loss in plain JAX, with a dense solve
    x = jnp.linalg.solve(pattern.todense(matrix_values(p)), b)
    return -(jnp.abs(jnp.vdot(m, x)) ** 2)


class CountingSuperLU(dx.AbstractSparseSolver):  # SciPy's SuperLU, counting factorisations
    def factor(self, matrix):
        factorisations.append(matrix.shape)
        return dx.SuperLU().factor(matrix)

    def solve(self, factorisation, rhs, transpose):
        return dx.SuperLU().solve(factorisation, rhs, transpose)


factorisations = []
with dx.record() as timeline:
    value, grad = value_and_grad(p, CountingSuperLU())
ref_value, ref_grad = jax.value_and_grad(dense_loss)(p)
error = float(jnp.max(jnp.abs(grad - ref_grad)) / jnp.max(jnp.abs(ref_grad)))
print(f"gradient against a dense jnp.linalg.solve: relative error {error:.1e}")
print(f"one step: {len(factorisations)} factorisation, jobs {timeline.counts()}")

site = plan.sites[0]
assert site.schedule in ("deferred", "deferred-basis"), f"the solve is {site.schedule}: {site.reason}"
assert sum(timeline.counts().values()) == 1, timeline.counts()  # forward and adjoint: one job
assert len(factorisations) == 1, factorisations
assert abs(float(value - ref_value)) <= 1e-10 * abs(float(ref_value)) and error <= 1e-10
