"""Typed modules: a jitted training step of a typed model vs the same model untyped.

Both sides compile to the same XLA program (the checks run while tracing), so the
steady-state ratio should be ~1.00; the first call pays the checks once.

Run: python benchmarks/bench_typed.py [--small]
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

import deferax as dx


class TypedLinear(dx.TypedModule):
    weight: Float[Array, "out in"]
    bias: Float[Array, " out"]

    def __call__(self, x: Float[Array, "batch in"]) -> Float[Array, "batch out"]:
        return jnp.tanh(x @ self.weight.T + self.bias)


class PlainLinear(eqx.Module):
    weight: Array
    bias: Array

    def __call__(self, x):
        return jnp.tanh(x @ self.weight.T + self.bias)


def make_model(layer, width, depth, key):
    keys = jax.random.split(key, depth)
    return [layer(jax.random.normal(k, (width, width)) / width**0.5, jnp.zeros(width)) for k in keys]


def loss(model, x, y):
    for layer in model:
        x = layer(x)
    return jnp.mean((x - y) ** 2)


def make_step():
    @eqx.filter_jit
    def step(model, x, y):
        value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
        return value, jax.tree.map(lambda p, g: p - 1e-3 * g, model, grads)

    return step


def timed(fn, *args):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    width, depth, batch, repeats, firsts = (16, 2, 8, 5, 2) if args.small else (512, 6, 256, 200, 5)
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (batch, width))
    y = jnp.zeros((batch, width))
    typed = make_model(TypedLinear, width, depth, key)
    plain = make_model(PlainLinear, width, depth, key)

    first = {"typed": [], "plain": []}
    for _ in range(firsts):  # fresh functions: trace + compile each time
        first["plain"].append(timed(make_step(), plain, x, y))
        first["typed"].append(timed(make_step(), typed, x, y))
    trace = {"typed": [], "plain": []}
    for _ in range(repeats if args.small else 20):  # trace only (no compile): where the checks run
        for name, model in (("plain", plain), ("typed", typed)):
            start = time.perf_counter()
            eqx.filter_make_jaxpr(lambda m: eqx.filter_value_and_grad(loss)(m, x, y))(model)
            trace[name].append(time.perf_counter() - start)
    steps = {"typed": make_step(), "plain": make_step()}
    models = {"typed": typed, "plain": plain}
    for name in steps:
        timed(steps[name], models[name], x, y)
    times = {"typed": [], "plain": []}
    for _ in range(repeats):  # interleaved, side by side
        for name in ("plain", "typed"):
            times[name].append(timed(steps[name], models[name], x, y))
    med = {k: statistics.median(v) for k, v in times.items()}
    med_first = {k: statistics.median(v) for k, v in first.items()}
    print(f"steady step: typed {med['typed'] * 1e3:.3f} ms, untyped {med['plain'] * 1e3:.3f} ms")
    print(
        f"first call:  typed {med_first['typed'] * 1e3:.1f} ms, untyped {med_first['plain'] * 1e3:.1f} ms "
        f"(extra {1e3 * (med_first['typed'] - med_first['plain']):.1f} ms)"
    )
    print(
        f"RESULT bench_typed steady: typed {med['typed']:.6f} s, untyped {med['plain']:.6f} s, "
        f"ratio {med['typed'] / med['plain']:.3f} (target <= 1.02)"
    )
    med_trace = {k: statistics.median(v) for k, v in trace.items()}
    print(
        f"RESULT bench_typed trace: typed {med_trace['typed'] * 1e3:.2f} "
        f"ms, untyped {med_trace['plain'] * 1e3:.2f} ms, "
        f"extra {1e3 * (med_trace['typed'] - med_trace['plain']):.2f} ms for {depth} checked layer calls"
    )
    print(
        f"RESULT bench_typed first-call: typed {med_first['typed']:.4f} s, untyped {med_first['plain']:.4f} s, "
        f"extra {med_first['typed'] - med_first['plain']:.4f} s"
    )


if __name__ == "__main__":
    main()
