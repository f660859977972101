"""Quickstart: `sin` as an expensive function whose forward and adjoint can run together.

`sin` stands in for an expensive simulation whose derivative is written by hand. We give all
three implementations:

- `fwd(x) -> y`: the forward "simulation";
- `bwd(x, y, ct_y) -> ct_x`: the hand-written reverse-mode derivative (the "adjoint");
- `fused(x, ct_y) -> (y, ct_x)`: both at once.

The loss is linear in the output, so the cotangent reaching `sin` does not depend on its
value: `dx.filter_value_and_grad` sees this in the program and runs `fused` once instead of
`fwd` then `bwd`. `dx.record()` records each implementation call, so the script can show
how often each ran on each schedule.

Run with `python examples/quickstart.py`.
"""

import jax.numpy as jnp

import deferax as dx


def fwd(x):
    return jnp.sin(x)


def bwd(x, y, ct_y):
    return ct_y * jnp.cos(x)


def fused(x, ct_y):
    return jnp.sin(x), ct_y * jnp.cos(x)


f = dx.ExpensiveFn(fwd=fwd, bwd=bwd, fused=fused, name="sin")

weights = jnp.array([1.0, 2.0, 3.0])


def loss(x):
    # Linear in f(x): the cotangent reaching f's output is `weights`, whatever f(x) is.
    return jnp.sum(weights * f(x)) + 1.0


def main():
    x = jnp.array([0.0, 0.5, 1.0])

    print(dx.explain(loss, x))
    print()

    for schedule in ("auto", "standard"):
        with dx.record() as timeline:  # every implementation call made inside
            value, grad = dx.filter_value_and_grad(loss, schedule=schedule)(x)
        runs = timeline.counts()
        expected_value = jnp.sum(weights * jnp.sin(x)) + 1.0
        expected_grad = weights * jnp.cos(x)  # d/dx sin(x) = cos(x)
        ok = bool(jnp.allclose(value, expected_value) and jnp.allclose(grad, expected_grad))
        print(f"schedule={schedule!r}")
        print(f"  value    = {float(value):.6f}")
        print(f"  gradient = {grad}")
        print(f"  matches the analytic derivative weights * cos(x): {ok}")
        counts = ", ".join(f"{impl}: {runs.get(impl, 0)}" for impl in ("fwd", "bwd", "fused"))
        print(f"  implementation runs: {counts}")
        if not ok:
            raise SystemExit("the gradient does not match the analytic derivative")
        expected_runs = {"auto": {"fused": 1}, "standard": {"fwd": 1, "bwd": 1}}[schedule]
        if runs != expected_runs:
            raise SystemExit(f"expected runs {expected_runs}, found {runs}")


if __name__ == "__main__":
    main()
