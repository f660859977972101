"""jax_fdm's form finding through an unchanged loss, jitted: `dx.filter_value_and_grad` against
Equinox's and plain JAX's `value_and_grad`.

jax_fdm (the force density method for cable nets and shells) solves its equilibrium with
SciPy's `spsolve` in a `pure_callback` inside a `jax.custom_vjp`, whose backward pass solves
once more: two factorisations a gradient. deferax recognises that custom_vjp (by its backward
rule) and rewrites it into `dx.sparse_solve`: one factorisation a gradient, the three
coordinates' right-hand sides one job. With `recognise=False` the loss has no site, and deferax
must cost nothing: its jitted step should be the program Equinox compiles (the script compares
the lowered programs' operations) and take its time. A rectangular cable net of 65 x 61 nodes
anchored on its boundary (63 x 59 = 3,717 free nodes; `--small`: 12 x 10, 80), force density 1,
a load on each free node. Two losses: jax_fdm's goals (the distance of the form found from a
target dome plus its load path), differentiated with respect to the force densities, the
supports and the loads; and a loss affine in the heights, differentiated with respect to the
force densities.

    python benchmarks/bench_fdm.py            # 3,717 free nodes
    python benchmarks/bench_fdm.py --small    # 80 free nodes, 2 repeats (a smoke test)
"""

from __future__ import annotations

import collections
import importlib.util
import re
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
from _common import describe, interleaved, load, machine, median, parser, result_line

import deferax as dx

AS_IS = 1.02  # a loss with no site (`recognise=False`) must cost nothing beyond plain JAX
RECOGNISED = 0.70  # one factorisation a gradient instead of two


def cable_net(nx: int, ny: int):
    """`(loss, params)` for an `nx x ny` grid of cables anchored on its boundary."""
    from jax_fdm.datastructures import FDNetwork
    from jax_fdm.equilibrium import EquilibriumModelSparse, EquilibriumParametersState, EquilibriumStructureSparse

    key = lambda i, j: i * ny + j  # noqa: E731
    nodes = [[float(i), float(j), 0.0] for i in range(nx) for j in range(ny)]
    edges = [(key(i, j), key(i + 1, j)) for i in range(nx - 1) for j in range(ny)]
    edges += [(key(i, j), key(i, j + 1)) for i in range(nx) for j in range(ny - 1)]
    network = FDNetwork.from_nodes_and_edges(nodes, edges)
    for i in range(nx):
        for j in range(ny):
            if i in (0, nx - 1) or j in (0, ny - 1):
                network.node_anchor(key=key(i, j))
    network.edges_forcedensities(1.0, keys=network.edges())
    network.nodes_loads([0.0, 0.0, -0.1], keys=network.nodes_free())

    model = EquilibriumModelSparse(tmax=1)
    structure = EquilibriumStructureSparse.from_network(network)
    state = EquilibriumParametersState.from_datastructure(network, dtype=jnp.float64)
    params = {"q": state.q, "xyz_fixed": state.xyz_fixed, "loads": state.loads.nodes}
    xy = state.xyz_fixed.mean(axis=0)[:2]
    scale = 1.0 / max(nx, ny) ** 2

    def loss(params):
        loads = state.loads._replace(nodes=params["loads"])
        found = model(EquilibriumParametersState(params["q"], params["xyz_fixed"], loads), structure)
        target = 1.0 - scale * jnp.sum((found.xyz[:, :2] - xy) ** 2, axis=1)
        return jnp.sum((found.xyz[:, 2] - target) ** 2) + 1e-2 * jnp.sum(jnp.abs(found.forces * found.lengths))

    weights = jnp.linspace(0.5, 1.5, nx * ny)

    def affine(q):
        return jnp.sum(weights * model(state._replace(q=q), structure).xyz[:, 2])

    return {"goals": (loss, params), "affine": (affine, state.q)}, len(list(network.nodes_free()))


def close(got, want, rtol: float) -> bool:
    """Whether each leaf of `got` is within `rtol` of `want`'s leaf, relative to its largest entry."""
    leaves = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    return all(float(jnp.max(jnp.abs(g - w))) <= rtol * float(jnp.max(jnp.abs(w))) for g, w in leaves)


def operations(jitted, x) -> collections.Counter:
    """How many of each operation the lowered program has (names of values aside)."""
    text = jitted.lower(x).as_text()
    return collections.Counter(re.findall(r'(?:= |^\s*)"?((?:stablehlo|func|chlo|mhlo|sdy)\.[a-z_]+)', text, re.M))


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    if importlib.util.find_spec("jax_fdm") is None:
        print("bench_fdm: skipped, jax_fdm is not installed (pip install jax-fdm, in the tests extra)")
        return 0
    jax.config.update("jax_enable_x64", True)
    nx, ny = (12, 10) if args.small else (65, 61)
    repeats = args.repeats or (2 if args.small else 41)
    print(f"bench_fdm: {machine()}")
    ok = True
    with jax.numpy_dtype_promotion("standard"):
        losses, free = cable_net(nx, ny)
        for case, (loss, x) in losses.items():
            equinox = eqx.filter_value_and_grad(loss)
            sides = {
                "plain JAX": jax.jit(jax.value_and_grad(loss)),
                "Equinox": jax.jit(lambda p, e=equinox: e(p)),
                "deferax as is": jax.jit(dx.filter_value_and_grad(loss, recognise=False)),
                "deferax": jax.jit(dx.filter_value_and_grad(loss)),
            }
            plan = dx.explain(sides["deferax"], x)
            schedules = [s.schedule for s in plan.sites]
            print(f"--- cable net {nx} x {ny}, {case} loss: {free} free nodes; deferax's sites {schedules}")
            as_is = dx.explain(sides["deferax as is"], x)
            print(f"  recognise=False: {len(as_is.sites)} sites, fallback {as_is.fallback}")
            want = sides["plain JAX"](x)
            for name, step in sides.items():
                rtol = 1e-9 if name == "deferax" else 1e-12  # (another factorisation: SuperLU's own ordering)
                assert close(step(x), want, rtol), name
            same = operations(sides["deferax as is"], x) == operations(sides["Equinox"], x)
            # A net of 80 nodes factors in microseconds: the rule leaves it in place by cost, so the
            # site is required at full size only.
            if not same or not (args.small or len(plan.sites) == 1):
                print(f"FAILED: as is with Equinox's operations {same}; {len(plan.sites)} sites where 1 is wanted")
                ok = False
            print(f"  values and gradients equal; deferax as is has Equinox's operations: {same}")
            times = interleaved({name: (lambda s=step, x=x: s(x)) for name, step in sides.items()}, repeats)
            for side, ts in times.items():
                print(f"  {side:13s}: {describe(ts)}")
            what = f"{free} free nodes, {case}"
            for side, target in (("deferax as is", AS_IS), ("deferax", RECOGNISED)):
                for other in ("plain JAX", "Equinox"):
                    new, old = median(times[side]), median(times[other])
                    print(result_line("bench_fdm", what, new, old, None if args.small else target, side, other))
    print(f"at the end: {load()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
