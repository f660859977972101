"""The price of `dx.filter_value_and_grad` called eagerly: per call, against Equinox on the same program.

Both sides without any outer jit, as a user would call them in a notebook:
`dx.filter_value_and_grad(loss)(params, ...)` against `eqx.filter_value_and_grad(loss)(params, ...)`.
Equinox runs the loss and its VJP op by op (each primitive dispatched on its own);
deferax traces the loss once per call and runs cheap stages compiled with `jax.jit`, cached
on the traced program. Steady state: after warm-up, `inner` calls per timing.

Case `mlp`: the mean squared error of a small `eqx.nn.MLP` (`jax.vmap` over a batch).
Case `ops`: a few operations on 192 x 192 arrays (a matrix product, `tanh`, sums).
Case `wave`: `bench_wave`'s stepper as an `ExpensiveFn` with `fused` (deferred), on a grid
small enough (32 x 32, 4 steps) that what is timed is the overhead: Equinox runs the same
loss with the site standard.
Case `site`: the same with `fwd` and `bwd` only (deferred with a `fused` made from them,
which deferax checks `bwd` for on every call).

Each case prints the overhead per call, deferax's time minus Equinox's, in ms.

    python benchmarks/bench_eager.py            # full size
    python benchmarks/bench_eager.py --small    # smoke test
"""

from __future__ import annotations

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
from _common import (
    describe,
    interleaved,
    load,
    machine,
    make_wave,
    median,
    parser,
    result_line,
    time_once,
    wave_sites,
)

import deferax as dx

TARGETS = {"mlp": 1.3, "ops": 1.3}


def mlp_case(small: bool):
    in_size, width, depth, out_size, batch = (8, 16, 2, 4, 16) if small else (32, 64, 2, 8, 128)
    kx, ky, km = jax.random.split(jax.random.key(0), 3)
    model = eqx.nn.MLP(in_size, out_size, width, depth, activation=jax.nn.tanh, key=km)
    x = jax.random.normal(kx, (batch, in_size))
    y = jax.random.normal(ky, (batch, out_size))

    def loss(model, x, y):
        pred = jax.vmap(model)(x)
        return jnp.mean((pred - y) ** 2)

    return f"MLP {in_size}-{width}x{depth}-{out_size}, batch {batch}", loss, (model, x, y)


def ops_case(small: bool):
    n = 32 if small else 192
    ka, kb, kx = jax.random.split(jax.random.key(1), 3)
    params = {"a": jax.random.normal(ka, (n, n)) / n**0.5, "b": jax.random.normal(kb, (n, n))}
    x = jax.random.normal(kx, (n, n))

    def loss(params, x):
        h = jnp.tanh(params["a"] @ x + params["b"])
        return jnp.sum(h**2) / n + 1e-3 * jnp.sum(params["a"] ** 2)

    return f"{n}x{n} arrays: tanh(a @ x + b), sums", loss, (params, x)


def wave_case(small: bool, with_fused: bool = True):
    n, steps = (16, 2) if small else (32, 4)
    forward, adjoint = make_wave(n, steps)
    kx, kw = jax.random.split(jax.random.key(2))
    params = {"source": jax.random.normal(kx, (n, n))}
    w = jax.random.normal(kw, (n, n))
    if with_fused:
        wave, _ = wave_sites(forward, adjoint)
    else:
        fwd_jit, adj_jit = jax.jit(forward), jax.jit(adjoint)
        wave = dx.ExpensiveFn(fwd=fwd_jit, bwd=lambda x, y, ct: adj_jit(x, ct), name="wave")

    def loss(params, w):
        return jnp.sum(w * wave(params["source"])) + 1e-3 * jnp.sum(params["source"] ** 2)

    what = "`fwd`, `bwd` and `fused`" if with_fused else "`fwd` and `bwd` only"
    return f"wave stepper {n}x{n}, {steps} steps, an ExpensiveFn with {what}", loss, (params, w)


def site_case(small: bool):
    return wave_case(small, with_fused=False)


def repeat(fn, args, k):
    for _ in range(k):
        out = fn(*args)
    return out


def run_case(case, what, loss, call_args, repeats, inner) -> str:
    vg_dx = dx.filter_value_and_grad(loss)
    vg_eqx = eqx.filter_value_and_grad(loss)
    print(f"{case}: {what}")

    # The first call of each (one measurement, for information): trace + compile of the
    # stages for deferax, op-by-op dispatch (compiling each primitive the first time) for Equinox.
    t_dx = time_once(ft.partial(vg_dx, *call_args))
    t_eqx = time_once(ft.partial(vg_eqx, *call_args))
    print(f"{case} first call (one measurement): dx {t_dx * 1e3:.1f} ms, eqx {t_eqx * 1e3:.1f} ms")

    (v1, g1), (v2, g2) = vg_dx(*call_args), vg_eqx(*call_args)
    close = bool(jnp.allclose(v1, v2, rtol=1e-5)) and all(
        bool(jnp.allclose(a, b, rtol=1e-4, atol=1e-6))
        for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2), strict=True)
    )
    same_tree = jax.tree_util.tree_structure(g1) == jax.tree_util.tree_structure(g2)
    print(
        f"{case} dx vs eqx: value {float(v1):.6g} vs {float(v2):.6g}, "
        f"gradients allclose: {close}, same structure: {same_tree}"
    )
    assert close and same_tree, (v1, v2)

    times = interleaved(
        {"dx": ft.partial(repeat, vg_dx, call_args, inner), "eqx": ft.partial(repeat, vg_eqx, call_args, inner)},
        repeats,
        warmup=2,
    )
    for side, ts in times.items():
        print(f"{case} steady {side:3s} ({inner} calls): {describe(ts)}")
    over = [(a - b) / inner * 1e3 for a, b in zip(times["dx"], times["eqx"], strict=True)]
    print(
        f"{case} overhead per call, dx - eqx: median {median(over):.3f} ms (min {min(over):.3f}, max {max(over):.3f})"
    )
    return result_line(
        "bench_eager",
        f"{case} steady call",
        median(times["dx"]) / inner,
        median(times["eqx"]) / inner,
        TARGETS.get(case),
        new_name="dx",
        old_name="eqx",
    )


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    repeats = args.repeats or (2 if args.small else 21)
    inner = 2 if args.small else 20
    print(f"bench_eager: no outer jit, float32, {inner} calls per timing; {machine()}")
    cases = (("mlp", mlp_case), ("ops", ops_case), ("wave", wave_case), ("site", site_case))
    results = [run_case(case, *make(args.small), repeats, inner) for case, make in cases]
    print(f"at the end: {load()}")
    for line in results:
        print(line)


if __name__ == "__main__":
    main()
