"""Second order through `dx.sparse_solve` against the field: one jitted Hessian-vector product
(`jax.jvp` of `jax.grad`) of `power` (`sum |x|^2`, `x = A^-1 b`) with respect to the matrix's
entries (on the SPD beam, the element densities they are made from), beside every peer of
`bench_peers.py` that has second derivatives (sparsax's `custom_linear_solve`, klujax, JAX's
`spsolve`, the hand-written `custom_vjp`s do not: those that raise are listed, and left out).

Matrices as in `bench_peers.py`: (a) the 180 x 60 MBB beam's stiffness (SPD, n = 22,020),
(b) a real convection-diffusion operator (n = 22,500), (c) a complex Helmholtz operator
(n = 22,500); `--small`: tiny sizes (a smoke test), where deferax is also checked against a
dense solve. deferax's factorisations and solves are counted (one factorisation a product:
`x`, its tangent, the adjoint and its tangent are four solves of it). Each timed call gets a
new matrix, as an optimisation loop does. Medians of interleaved repeats, the load printed
before and after.

    python benchmarks/bench_hvp.py            # the sizes above
    python benchmarks/bench_hvp.py --small    # tiny sizes (a smoke test)
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import bench_peers  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import load, machine, parser  # noqa: E402

jax.config.update("jax_enable_x64", True)


def hvp(loss):
    """`(theta, b, t) -> H t`, jitted: the Hessian of `loss(theta, b)` in `theta` times `t`."""
    return jax.jit(lambda theta, b, t: jax.jvp(lambda th: jax.grad(loss)(th, b), (theta,), (t,))[1])


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    repeats = args.repeats or (2 if args.small else 7)
    warmup = 2 if args.small else 12  # (past deferax's measurement of the solvers: up to 12 calls)
    print(f"bench_hvp: {machine()}")
    summary: list[str] = []
    rng = np.random.default_rng(1)
    for case, make, theta, pattern, spd, complex_ in bench_peers.matrices(args.small):
        dtype = np.complex128 if complex_ else np.float64
        b = jnp.asarray(rng.normal(size=pattern.n)).astype(dtype)
        w = jnp.asarray(rng.normal(size=pattern.n)).astype(dtype)
        t = jnp.asarray(rng.normal(size=theta.shape)).astype(theta.dtype)
        print(f"--- {case}, power: {pattern!r}; {load()}")
        sides = {}
        for name, solve in bench_peers.peers(pattern, spd, complex_).items():
            loss = bench_peers.loss_fns(lambda th, b, solve=solve, make=make: solve(make(th), b), w)["power"]
            fn = hvp(loss)
            try:
                jax.block_until_ready(fn(theta, b, t))
            except Exception as e:  # noqa: BLE001 - a peer without second derivatives: said, and left out
                print(f"  {name:24s}: no second derivative ({type(e).__name__}: {str(e).splitlines()[0][:90]})")
                continue
            sides[name] = fn
        if args.small:
            solve = lambda th, b, p=pattern, make=make: jnp.linalg.solve(p.todense(make(th)), b)  # noqa: E731
            dense = bench_peers.loss_fns(solve, w)["power"]
            off = bench_peers.off(sides["deferax"](theta, b, t), hvp(dense)(theta, b, t))
            print(f"  deferax against a dense solve: {off:.1e} off")
        bench_peers.race(f"{case}, Hessian-vector product", sides, (theta, b, t), repeats, warmup, summary)
    bench_peers.report(summary)


if __name__ == "__main__":
    main()
