"""The price of `dx.filter_value_and_grad` called eagerly on a program with no expensive function.

Both sides without any outer jit, as a user would call them in a notebook:
`dx.filter_value_and_grad(loss)(params, ...)` against `eqx.filter_value_and_grad(loss)(params, ...)`.
Equinox runs the loss and its VJP op by op (each primitive dispatched on its own);
deferax traces the loss once per call and runs cheap stages compiled with `jax.jit`, cached
on the traced program. Steady state: after warm-up, `inner` calls per timing.

Case `mlp`: the mean squared error of a small `eqx.nn.MLP` (`jax.vmap` over a batch).
Case `ops`: a few operations on 192 x 192 arrays (a matrix product, `tanh`, sums).

    python benchmarks/bench_eager.py            # full size
    python benchmarks/bench_eager.py --small    # smoke test
"""

from __future__ import annotations

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
from _common import describe, interleaved, load, machine, median, parser, result_line, time_once

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
    return result_line(
        "bench_eager",
        f"{case} steady call",
        median(times["dx"]) / inner,
        median(times["eqx"]) / inner,
        TARGETS[case],
        new_name="dx",
        old_name="eqx",
    )


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    repeats = args.repeats or (2 if args.small else 21)
    inner = 2 if args.small else 20
    print(f"bench_eager: no outer jit, no ExpensiveFn, float32, {inner} calls per timing; {machine()}")
    results = [
        run_case(case, *make(args.small), repeats, inner) for case, make in (("mlp", mlp_case), ("ops", ops_case))
    ]
    print(f"at the end: {load()}")
    for line in results:
        print(line)


if __name__ == "__main__":
    main()
