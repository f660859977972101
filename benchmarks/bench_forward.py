"""Forward-basis vs standard reverse mode for an FDFD solve driven by 4 design parameters.

The frequency-domain Helmholtz problem of `examples/fdfd_inverse_design.py`,
`M(eps) E = b` with `M = laplacian + k0**2 diag(eps)` and an absorbing layer, solved with
SciPy's sparse LU (`splu`) on the host. The permittivity of a square design region is
`2 + sum_i p_i bump_i`: 4 parameters `p`, a field `E` of n x n complex numbers. The loss,
`sum |E|**4` over a monitor column, is nonlinear in every entry of `E`, so no deferral is
possible.

- standard (`prefer="standard"`): `fwd` factorises `M(p)` and solves for `E`; `bwd`
  factorises again and solves the adjoint: two factorisations, two stages.
- forward-basis (the default rule with `jvp_batch`, `n = 4 <= max_tangents`): `jvp_batch`
  factorises once and solves for `E` and the 4 tangents `dE_i = -M^-1 (k0**2 bump_i E)`
  together (5 right-hand sides); `ct_p = Re(J^T ct_E)` is then cheap: one stage.

    python benchmarks/bench_forward.py            # 160 x 160 grid
    python benchmarks/bench_forward.py --small    # 24 x 24 grid, smoke test
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spl
from _common import describe, interleaved, load, machine, median, parser, result_line

import deferax as dx

jax.config.update("jax_enable_x64", True)

TARGET = 0.6
N_PARAMS = 4


class Problem:
    """The FDFD problem, with host functions that count their factorisations."""

    def __init__(self, n: int, wavelength: float = 10.0, absorber: int = 6):
        self.n, self.k0 = n, 2 * np.pi / wavelength
        one = np.ones(n)
        d2 = sp.diags([one[:-1], -2 * one, one[:-1]], [-1, 0, 1])
        eye = sp.identity(n)
        self.laplacian = (sp.kron(d2, eye) + sp.kron(eye, d2)).tocsc()
        edge = np.minimum(np.arange(n), np.arange(n)[::-1]).astype(float)
        ramp = np.where(edge < absorber, ((absorber - edge) / absorber) ** 2, 0.0)
        self.eps_background = 1.0 + 2.0j * (ramp[:, None] + ramp[None, :])
        d = max(4, n // 4)
        lo = (n - d) // 2
        self.design = (slice(lo, lo + d), slice(lo, lo + d))
        rows, cols = np.meshgrid(np.arange(d), np.arange(d), indexing="ij")
        centres = [(d / 4, d / 4), (d / 4, 3 * d / 4), (3 * d / 4, d / 4), (3 * d / 4, 3 * d / 4)]
        self.bumps = []  # each as a full-grid field, zero outside the design region
        for r, c in centres:
            bump = np.zeros((n, n))
            bump[self.design] = np.exp(-((rows - r) ** 2 + (cols - c) ** 2) / (d / 5) ** 2)
            self.bumps.append(bump)
        self.source = np.zeros(n * n, np.complex128)
        self.source[(n // 2) * n + absorber + 2] = 1.0
        self.monitor = n - absorber - 3
        self.counts: collections.Counter = collections.Counter()

    def factorise(self, p):
        self.counts["factorisations"] += 1
        eps = self.eps_background + 2.0 + sum(pi * b for pi, b in zip(p, self.bumps, strict=True))
        return spl.splu((self.laplacian + sp.diags(self.k0**2 * eps.ravel())).tocsc())

    def fwd(self, p):
        return self.factorise(p).solve(self.source).reshape(self.n, self.n)

    def bwd(self, p, e, ct):
        # ct_p_i = Re(sum(ct * dE/dp_i)), dE/dp_i = -M^-1 (k0**2 bump_i E); M symmetric
        lam = self.factorise(p).solve(ct.ravel(), trans="T").reshape(self.n, self.n)
        return np.array([np.real(np.sum(lam * (-(self.k0**2) * b * e))) for b in self.bumps])

    def jvp_batch(self, p, tangents):
        lu = self.factorise(p)
        e = lu.solve(self.source).reshape(self.n, self.n)
        rhs = np.stack(
            [(-(self.k0**2) * sum(ti * b for ti, b in zip(t, self.bumps, strict=True)) * e).ravel() for t in tangents],
            axis=1,
        )
        de = lu.solve(rhs)  # all tangents with the one factorisation
        return e, np.moveaxis(de, 1, 0).reshape(len(tangents), self.n, self.n)

    def site(self, prefer):
        field = jax.ShapeDtypeStruct((self.n, self.n), jnp.complex128)
        return dx.host(
            self.fwd,
            bwd=self.bwd,
            jvp_batch=self.jvp_batch,
            out=field,
            prefer=prefer,
            name="fdfd" if prefer is None else f"fdfd-{prefer}",
        )

    def loss(self, site):
        monitor = self.monitor

        def loss(p):
            e = site(p)
            return jnp.sum(jnp.abs(e[:, monitor]) ** 4) * 1e6

        return loss


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    n = 24 if args.small else 160
    repeats = args.repeats or (2 if args.small else 11)
    problem = Problem(n)
    print(f"bench_forward: FDFD {n} x {n}, {N_PARAMS} design parameters, SciPy splu; {machine()}; {load()}")
    p = jnp.array([0.5, -0.3, 0.8, 0.2])
    standard = problem.loss(problem.site("standard"))
    forward = problem.loss(problem.site(None))  # the default rule picks forward-basis
    plan_std, plan_fwd = dx.explain(standard, p), dx.explain(forward, p)
    print(plan_fwd)
    assert plan_std.sites[0].schedule == "standard" and plan_fwd.sites[0].schedule == "forward-basis"
    vg_std, vg_fwd = dx.filter_value_and_grad(standard), dx.filter_value_and_grad(forward)
    (v1, g1), (v2, g2) = vg_std(p), vg_fwd(p)
    eps = 1e-6
    fd = np.array(
        [(float(standard(p.at[i].add(eps))) - float(standard(p.at[i].add(-eps)))) / (2 * eps) for i in range(N_PARAMS)]
    )
    print(
        f"values {float(v1):.10g} vs {float(v2):.10g}; gradient rel. difference "
        f"{float(jnp.max(jnp.abs(g1 - g2)) / jnp.max(jnp.abs(g1))):.1e}; "
        f"vs finite differences {float(np.max(np.abs(np.asarray(g2) - fd)) / np.max(np.abs(fd))):.1e}"
    )
    assert np.allclose(v1, v2, rtol=1e-10) and np.allclose(g1, g2, rtol=1e-8, atol=1e-12)
    assert np.allclose(g2, fd, rtol=1e-4, atol=1e-8 * np.max(np.abs(fd)))
    for name, vg in (("standard", vg_std), ("forward-basis", vg_fwd)):
        problem.counts.clear()
        jax.block_until_ready(vg(p))
        print(f"{name}: {problem.counts['factorisations']} factorisation(s) per gradient")

    times = interleaved({"forward-basis": lambda: vg_fwd(p), "standard": lambda: vg_std(p)}, repeats)
    for side, ts in times.items():
        print(f"{side:14s}: {describe(ts)}")
    print(f"at the end: {load()}")
    print(
        result_line(
            "bench_forward",
            "fdfd 4 parameters eager",
            median(times["forward-basis"]),
            median(times["standard"]),
            TARGET,
            new_name="forward-basis",
        )
    )


if __name__ == "__main__":
    main()
