"""SAX circuits through an unchanged loss: plain `jax.jit(jax.value_and_grad(loss))` against
`jax.jit(dx.filter_value_and_grad(loss))`.

SAX's klu backend solves a circuit's S-matrix with klujax's handle-based primitives
(`solve_with_symbol`, after `klujax.analyze`), which deferax never recognises (their
factorisation is hidden state behind the handle): the loss is left exactly as traced, and
this measures that leaving it costs nothing. Two circuits, the bar power over 5 wavelengths:
a Mach-Zehnder (4 instances, 12 unknowns) and a chain of all-pass ring resonators (a coupler
and a lossy ring waveguide each: 6 unknowns a ring; 50 rings, 300 unknowns; `--small`: 5).

SAX 0.18 requires jax < 0.10: where it is not installed this prints a line and exits 0.

    python benchmarks/bench_sax.py            # Mach-Zehnder and 50 rings
    python benchmarks/bench_sax.py --small    # 5 rings, 2 repeats (a smoke test)
    python benchmarks/bench_sax.py --rings 100
"""

from __future__ import annotations

import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _common import describe, interleaved, load, machine, median, parser, result_line

import deferax as dx

TARGET = 1.05  # leaving the program alone must not slow it down
WL = np.linspace(1.51, 1.59, 5)


def mach_zehnder(sax):
    netlist = {
        "instances": {"lft": "coupler", "top": "straight", "btm": "straight", "rgt": "coupler"},
        "connections": {"lft,out0": "btm,in0", "btm,out0": "rgt,in0", "lft,out1": "top,in0", "top,out0": "rgt,in1"},
        "ports": {"in0": "lft,in0", "in1": "lft,in1", "out0": "rgt,out0", "out1": "rgt,out1"},
    }
    circuit, _ = sax.circuit(netlist, models(sax), backend="klu")

    def loss(length):
        return jnp.sum(jnp.abs(circuit(wl=WL, top={"length": length}, btm={"length": 10.0})["in0", "out0"]) ** 2)

    return loss, jnp.asarray(25.0)


def ring_chain(sax, n_rings: int):
    instances, connections = {}, {}
    for i in range(n_rings):
        instances[f"c{i}"], instances[f"r{i}"] = "coupler", "straight"
        connections[f"c{i},out1"] = f"r{i},in0"
        connections[f"r{i},out0"] = f"c{i},in1"
        if i + 1 < n_rings:
            connections[f"c{i},out0"] = f"c{i + 1},in0"
    ports = {"in0": "c0,in0", "out0": f"c{n_rings - 1},out0"}
    netlist = {"instances": instances, "connections": connections, "ports": ports}
    circuit, _ = sax.circuit(netlist, models(sax), backend="klu")

    def loss(lengths):
        settings = {f"r{i}": {"length": lengths[i], "loss_dB_cm": 3.0} for i in range(n_rings)}
        return jnp.sum(jnp.abs(circuit(wl=WL, **settings)["in0", "out0"]) ** 2)

    return loss, jnp.asarray(40.0 + np.random.default_rng(0).uniform(-0.5, 0.5, n_rings))


def models(sax):
    return {"coupler": sax.models.coupler_ideal, "straight": sax.models.straight}


def compare(name: str, loss, x, repeats: int, target: float | None) -> None:
    plain = jax.jit(jax.value_and_grad(loss))
    deferax = jax.jit(dx.filter_value_and_grad(loss))
    want, got = plain(x), deferax(x)
    error = float(jnp.max(jnp.abs(got[1] - want[1])) / jnp.max(jnp.abs(want[1])))
    plan = dx.explain(dx.filter_value_and_grad(loss), x)
    calls = ", ".join(sorted({call.call for call in plan.recognised})) or "none"
    print(f"--- {name}: {len(plan.sites)} sites; solves looked at: {calls} (left alone); gradient error {error:.1e}")
    times = interleaved({"plain": lambda: plain(x), "deferax": lambda: deferax(x)}, repeats)
    for side, ts in times.items():
        print(f"  {side:8s}: {describe(ts)}")
    new, old = median(times["deferax"]), median(times["plain"])
    print(result_line("bench_sax", name, new, old, target, "deferax", "plain JAX"))


def main():
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--rings", type=int, default=None, help="rings in the chain (6 unknowns each)")
    args = p.parse_args()
    if importlib.util.find_spec("sax") is None:
        print("bench_sax: skipped, sax is not installed (SAX 0.18 requires jax < 0.10: try sax==0.18.2, jax==0.9.2)")
        return 0
    import sax

    jax.config.update("jax_enable_x64", True)
    rings = args.rings or (5 if args.small else 50)
    repeats = args.repeats or (2 if args.small else 200)
    target = None if args.small else TARGET
    print(f"bench_sax: {machine()}, sax {sax.__version__}")
    compare("Mach-Zehnder (12 unknowns)", *mach_zehnder(sax), repeats, target)
    compare(f"ring chain of {rings} ({6 * rings} unknowns)", *ring_chain(sax, rings), repeats, target)
    print(f"at the end: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
