"""The seed's program as users write it, unchanged: a `jax.custom_vjp` whose `bwd` never reads
`f(x)`, in a loss affine in `f(x)`; and programs whose custom_vjps must be left alone.

    seed    the wave stepper of `bench_wave.py` (128 x 128 grid, 1500 steps) as a `custom_vjp`:
            `f_fwd(x) = (f(x), x)`, `f_bwd(x, v) = (adjoint(x, v),)`. Jitted, side by side in
            one run: plain JAX (`jax.value_and_grad`), deferax on the unchanged loss
            (`dx.filter_value_and_grad`: the call is recognised, its forward and adjoint run
            on two threads), and the two-thread floor (the forward and the adjoint jitted
            separately, run from two Python threads: what no schedule on this machine beats).
    mlp     an Equinox MLP training step (64 x 256 hidden, batch 256) with a straight-through
            estimator and gradient clipping in every layer, under `eqx.filter_jit`: deferax
            against Equinox (the cheap custom_vjps are left in place: the same program).
    fdtdx   fdtdx's time-reversal gradient (a 20 x 20 cell domain, 210 steps), whose backward
            needs the forward's final fields: deferax against Equinox, jitted (left as is).

    python benchmarks/bench_seed_custom_vjp.py            # full size
    python benchmarks/bench_seed_custom_vjp.py --small    # smoke test
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
from _common import block, describe, interleaved, load, machine, make_wave, median, parser, result_line

import deferax as dx

TARGETS = {"plain": 0.75, "floor": 1.10, "mlp": 1.03, "fdtdx": 1.03}


def seed(n: int, steps: int):
    """`(loss, forward, adjoint, w)`: the unchanged program and its two halves."""
    forward, adjoint = make_wave(n, steps)

    @jax.custom_vjp
    def f(x):
        return forward(x)

    def f_fwd(x):
        return f(x), x

    def f_bwd(x, v):
        return (adjoint(x, v),)  # (reads neither f(x) nor x: the stepper is linear)

    f.defvjp(f_fwd, f_bwd)
    w = jax.random.normal(jax.random.key(1), (n, n))

    def loss(x):
        return jnp.sum(w * f(x)) + 1e-3 * jnp.sum(x**2)

    return loss, forward, adjoint, w


def two_threads(forward, adjoint, x, ct):
    """The floor: the two halves jitted separately, run from two threads."""
    fwd, adj = jax.jit(forward), jax.jit(adjoint)
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def run():
        other = pool.submit(lambda: block(adj(x, ct)))
        y = block(fwd(x))
        return y, other.result()

    return run


def check(got, want, what: str, rtol: float):
    (v1, g1), (v2, g2) = got, want
    leaves = zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True)
    err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30)) for a, b in leaves)
    print(f"{what}: value {float(v1):.6g} vs {float(v2):.6g}, gradient max relative difference {err:.1e}")
    assert abs(float(v1 - v2)) <= rtol * abs(float(v2)) + 1e-30 and err <= rtol, (what, err)


def case_seed(args, results):
    n, steps = (32, 50) if args.small else (128, 1500)
    repeats = args.repeats or (2 if args.small else 21)
    loss, forward, adjoint, w = seed(n, steps)
    x = jax.random.normal(jax.random.key(0), (n, n))
    recognise = "always" if args.small else True  # (the small size is left in place by cost)
    step = dx.filter_value_and_grad(loss, recognise=recognise)
    plan = dx.explain(step, x)
    print(f"seed: {n}x{n} grid, {steps} steps, float32")
    print(plan)
    assert [s.schedule for s in plan.sites] == ["deferred"], plan
    plain, mine = jax.jit(jax.value_and_grad(loss)), jax.jit(step)
    check(mine(x), plain(x), "seed, deferax vs plain JAX", 1e-5)
    floor = two_threads(forward, adjoint, x, w)
    sides = {"deferax": lambda: mine(x), "plain JAX": lambda: plain(x), "floor": floor}
    times = interleaved(sides, repeats, warmup=2)
    for side, ts in times.items():
        print(f"seed {side:9s}: {describe(ts)}")
    new = median(times["deferax"])
    for case, old, name in (("seed jit", "plain JAX", "plain JAX"), ("seed floor", "floor", "two-thread floor")):
        target = TARGETS["plain" if old == "plain JAX" else "floor"]
        results.append(result_line("bench_seed_custom_vjp", case, new, median(times[old]), target, "deferax", name))


@jax.custom_vjp
def straight_through(x):
    return jnp.round(x)


straight_through.defvjp(lambda x: (jnp.round(x), None), lambda _, ct: (ct,))


@jax.custom_vjp
def clip_gradient(x):
    return x


clip_gradient.defvjp(lambda x: (x, None), lambda _, ct: (jnp.clip(ct, -1.0, 1.0),))


class MLP(eqx.Module):
    layers: list

    def __init__(self, width: int, depth: int, key):
        keys = jax.random.split(key, depth + 1)
        sizes = [16] + [width] * depth
        self.layers = [eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys, strict=False)]
        self.layers.append(eqx.nn.Linear(width, 1, key=keys[-1]))

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = clip_gradient(straight_through(8.0 * jax.nn.relu(layer(x))) / 8.0)
        return self.layers[-1](x)[0]


def case_mlp(args, results):
    width, depth, batch = (16, 2, 8) if args.small else (256, 3, 256)
    repeats = args.repeats or (2 if args.small else 51)
    model = MLP(width, depth, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (batch, 16))
    y = jax.random.normal(jax.random.key(2), (batch,))

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    plan = dx.explain(loss, model, x, y)
    print(f"mlp: {depth} hidden layers of {width}, batch {batch}; {len(plan.recognised)} custom_vjp calls")
    assert plan.sites == () and all(r.reason.startswith("left in place by cost") for r in plan.recognised), plan
    mine = eqx.filter_jit(dx.filter_value_and_grad(loss))
    equinox = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    check(mine(model, x, y), equinox(model, x, y), "mlp, deferax vs Equinox", 0.0)
    times = interleaved({"deferax": lambda: mine(model, x, y), "Equinox": lambda: equinox(model, x, y)}, repeats)
    for side, ts in times.items():
        print(f"mlp {side:9s}: {describe(ts)}")
    new, old = median(times["deferax"]), median(times["Equinox"])
    results.append(result_line("bench_seed_custom_vjp", "mlp", new, old, TARGETS["mlp"], "deferax", "Equinox"))


def fdtdx_simulation(steps_time: float):
    """tests/test_fdtdx.py's domain with fdtdx's time-reversal gradient: `(simulate, params)`."""
    import fdtdx

    config = fdtdx.SimulationConfig(
        time=steps_time, grid=fdtdx.UniformGrid(spacing=50e-9), backend="cpu", dtype=jnp.float64
    )
    gradient = fdtdx.GradientConfig(method="reversible", recorder=fdtdx.Recorder(modules=[]))
    config = config.aset("gradient_config", gradient)
    volume = fdtdx.SimulationVolume(partial_grid_shape=(20, 20, 1))
    bounds, constraints = fdtdx.boundary_objects_from_config(
        fdtdx.BoundaryConfig.from_uniform_bound(boundary_type="periodic"), volume
    )
    source = fdtdx.PointDipoleSource(
        partial_grid_shape=(1, 1, 1), polarization=2, wave_character=fdtdx.WaveCharacter(wavelength=500e-9)
    )
    materials = {"air": fdtdx.Material(permittivity=1.0), "dielectric": fdtdx.Material(permittivity=4.0)}
    device = fdtdx.Device(
        name="design",
        partial_grid_shape=(6, 4, 1),
        partial_voxel_grid_shape=(1, 1, 1),
        materials=materials,
        param_transforms=[],
    )
    flux = fdtdx.PoyntingFluxDetector(
        name="flux", partial_grid_shape=(None, 1, None), direction="+", fixed_propagation_axis=1, plot=False
    )
    constraints = [
        *constraints,
        source.place_relative_to(
            volume, axes=(0, 1, 2), own_positions=(0, -1, 0), other_positions=(0, -1, 0), grid_margins=(0, 5, 0)
        ),
        device.place_at_center(volume, axes=(0, 1, 2)),
        flux.place_relative_to(volume, axes=1, own_positions=1, other_positions=1, grid_margins=-5),
    ]
    placed_objects = [volume, *bounds.values(), source, device, flux]
    objects, arrays, params, config, _ = fdtdx.place_objects(
        placed_objects, config=config, constraints=constraints, key=jax.random.PRNGKey(0)
    )
    key = jax.random.PRNGKey(1)

    def simulate(params):
        a, placed, _ = fdtdx.apply_params(arrays, objects, params, key)
        _, a = fdtdx.run_fdtd(arrays=a, objects=placed, config=config, key=key, show_progress=False)
        return 1e14 * a.detector_states["flux"]["poynting_flux"].astype(jnp.float64)

    return simulate, params


def case_fdtdx(args, results):
    if importlib.util.find_spec("fdtdx") is None:
        print("fdtdx: not installed, skipped")
        return
    repeats = args.repeats or (2 if args.small else 21)
    with jax.numpy_dtype_promotion("standard"):
        simulate, params = fdtdx_simulation(5e-15 if args.small else 20e-15)

        def loss(params):
            flux = simulate(params)
            return jnp.sum(jnp.linspace(0.0, 1.0, flux.shape[0])[:, None] * flux)

        plan = dx.explain(loss, params)
        print("fdtdx:", plan.recognised[0])
        assert plan.sites == () and plan.fallback is not None, plan
        mine = eqx.filter_jit(dx.filter_value_and_grad(loss))
        equinox = eqx.filter_jit(eqx.filter_value_and_grad(loss))
        check(mine(params), jax.jit(jax.value_and_grad(loss))(params), "fdtdx, deferax vs plain JAX", 1e-9)
        times = interleaved({"deferax": lambda: mine(params), "Equinox": lambda: equinox(params)}, repeats)
    for side, ts in times.items():
        print(f"fdtdx {side:9s}: {describe(ts)}")
    new, old = median(times["deferax"]), median(times["Equinox"])
    results.append(result_line("bench_seed_custom_vjp", "fdtdx", new, old, TARGETS["fdtdx"], "deferax", "Equinox"))


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    print(f"bench_seed_custom_vjp; {machine()}")
    results: list[str] = []
    for case in (case_seed, case_mlp, case_fdtdx):
        case(args, results)
        print()
    print(f"at the end: {load()}")
    for line in results:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
