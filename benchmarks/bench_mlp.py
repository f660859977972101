"""The price of `dx.filter_value_and_grad` on a program with no expensive function.

A training step of a plain `eqx.nn.MLP` (no `ExpensiveFn`), both sides inside
`eqx.filter_jit`: `dx.filter_value_and_grad` against `eqx.filter_value_and_grad`.

- steady state: the time of a compiled step (the static check runs only while tracing, so
  the compiled programs should be the same; the script compares their HLO);
- first call: trace + compile + run of a freshly built step function, each repeat with
  new Python functions so that no cache of JAX or Equinox is hit.

    python benchmarks/bench_mlp.py            # full size
    python benchmarks/bench_mlp.py --small    # smoke test
"""

from __future__ import annotations

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
from _common import describe, interleaved, load, machine, median, parser, result_line, time_once

import deferax as dx

TARGETS = {"steady": 1.05, "first call": 1.5}


def make_step(value_and_grad, lr=1e-2):
    """A fresh SGD step (new Python functions each time, so nothing is cached)."""

    def loss(model, x, y):
        pred = jax.vmap(model)(x)
        return jnp.mean((pred - y) ** 2)

    @eqx.filter_jit
    def step(model, x, y):
        value, grads = value_and_grad(loss)(model, x, y)
        model = eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -lr * g, grads))
        return model, value

    return step


def run_steps(step, model, x, y, k):
    for _ in range(k):
        model, value = step(model, x, y)
    return model, value


def main():
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    if args.small:
        in_size, width, depth, out_size, batch, inner = 8, 16, 2, 4, 16, 2
    else:
        in_size, width, depth, out_size, batch, inner = 64, 256, 3, 16, 512, 50
    repeats = args.repeats or (2 if args.small else 21)
    first_repeats = args.repeats or (1 if args.small else 11)
    print(
        f"bench_mlp: MLP {in_size}-{width}x{depth}-{out_size}, batch "
        f"{batch}, float32, {inner} steps per timing; {machine()}"
    )

    kx, ky, km = jax.random.split(jax.random.key(0), 3)
    model = eqx.nn.MLP(in_size, out_size, width, depth, activation=jax.nn.tanh, key=km)
    x = jax.random.normal(kx, (batch, in_size))
    y = jax.random.normal(ky, (batch, out_size))

    step_dx = make_step(dx.filter_value_and_grad)
    step_eqx = make_step(eqx.filter_value_and_grad)

    m1, v1 = step_dx(model, x, y)
    m2, v2 = step_eqx(model, x, y)
    same = bool(eqx.tree_equal(m1, m2)) and bool(v1 == v2)
    print(f"one step, dx vs eqx: identical results: {same}")
    assert same
    hlo_dx = step_dx.lower(model, x, y).as_text()
    hlo_eqx = step_eqx.lower(model, x, y).as_text()
    print(f"lowered programs (StableHLO) identical: {hlo_dx == hlo_eqx}")

    # Steady state: `inner` compiled steps per timing.
    times = interleaved(
        {
            "dx": lambda: run_steps(step_dx, model, x, y, inner),
            "eqx": lambda: run_steps(step_eqx, model, x, y, inner),
        },
        repeats,
        warmup=2,
    )
    for side, ts in times.items():
        print(f"steady {side:3s} ({inner} steps): {describe(ts)}")
    steady = (median(times["dx"]) / inner, median(times["eqx"]) / inner)

    # First call: trace + compile + one step, fresh functions every time.
    first: dict[str, list[float]] = {"dx": [], "eqx": []}
    vgs = {"dx": dx.filter_value_and_grad, "eqx": eqx.filter_value_and_grad}
    for r in range(first_repeats + 1):  # the first round warms up JAX itself, and is dropped
        order = ["dx", "eqx"] if r % 2 == 0 else ["eqx", "dx"]
        for side in order:
            step = make_step(vgs[side])
            t = time_once(ft.partial(step, model, x, y))
            if r > 0:
                first[side].append(t)
    for side, ts in first.items():
        print(f"first call {side:3s}: {describe(ts)}")

    print(f"at the end: {load()}")
    print(result_line("bench_mlp", "steady step", *steady, TARGETS["steady"], new_name="dx", old_name="eqx"))
    print(
        result_line(
            "bench_mlp",
            "first call",
            median(first["dx"]),
            median(first["eqx"]),
            TARGETS["first call"],
            new_name="dx",
            old_name="eqx",
        )
    )


if __name__ == "__main__":
    main()
