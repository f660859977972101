"""Shared pieces of the benchmarks: a 2D wave-equation time-stepper with a hand-written
adjoint, and a small timing harness. Not part of the library."""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

# ---------------------------------------------------------------------------- the stepper
#
# Leapfrog for u_tt = c(r)^2 lap(u) + g(t) x(r) on an n x n grid, zero (Dirichlet) boundary,
# u = 0 before the first step:
#
#     u[k+1] = 2 u[k] - u[k-1] + c2 * lap(u[k]) + g[k] * x,      k = 0 .. steps-1
#
# `c2 = (c dt / h)^2` is a fixed material field (a slow disc in a uniform medium); `x`, the
# source's spatial pattern, is the input; the output is the final field u[steps].
# The map x -> y is linear, so its adjoint does not need y: with the transposed step
#
#     a[k] = 2 a[k+1] - a[k+2] + lap(c2 * a[k+1]),   a[steps] = ct_y, a[steps+1] = 0
#
# (lap is symmetric), the input cotangent is ct_x = sum_k g[k] a[k+1]. One forward step and
# one adjoint step cost the same: one 5-point Laplacian and a few element-wise operations.


def laplacian(u):
    p = jnp.pad(u, 1)
    return p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4 * u


def material(n: int, dtype=jnp.float32):
    i = jnp.arange(n, dtype=dtype) / n - 0.5
    r2 = i[:, None] ** 2 + i[None, :] ** 2
    return jnp.where(r2 < 0.15**2, 0.12, 0.25).astype(dtype)  # c2 <= 0.5 keeps leapfrog stable


def wavelet(steps: int, dtype=jnp.float32):
    t = jnp.arange(steps, dtype=dtype)
    t0, width = 30.0, 10.0
    a = ((t - t0) / width) ** 2
    return ((1 - 2 * a) * jnp.exp(-a)).astype(dtype)  # a Ricker pulse


def make_wave(n: int, steps: int, dtype=jnp.float32):
    """`(forward, adjoint)`: `forward(x) -> y`, `adjoint(x, ct_y) -> ct_x`, both plain JAX."""
    c2 = material(n, dtype)
    g = wavelet(steps, dtype)

    def forward(x):
        def step(carry, gk):
            u, u_prev = carry
            u_next = 2 * u - u_prev + c2 * laplacian(u) + gk * x
            return (u_next, u), None

        zero = jnp.zeros_like(x)
        (u, _), _ = lax.scan(step, (zero, zero), g)
        return u

    def adjoint(x, ct_y):
        del x  # linear in x: the adjoint needs neither x nor y

        def step(carry, gk):
            a, a_next, acc = carry  # a = a[k+1], a_next = a[k+2]
            acc = acc + gk * a
            a_prev = 2 * a - a_next + laplacian(c2 * a)
            return (a_prev, a, acc), None

        zero = jnp.zeros_like(ct_y)
        (_, _, acc), _ = lax.scan(step, (ct_y, zero, zero), g[::-1])
        return acc

    forward.__name__ = "wave_forward"
    adjoint.__name__ = "wave_adjoint"
    return forward, adjoint


def wave_sites(forward, adjoint):
    """`(wave, wave_std)`: the stepper as a deferax `ExpensiveFn` (`fwd`, `bwd`, and
    `fused=dx.fuse(forward, adjoint)`) and as a plain `jax.custom_vjp` (the jitted forward,
    the jitted adjoint on the backward pass)."""
    import deferax as dx

    fwd_jit, adj_jit = jax.jit(forward), jax.jit(adjoint)
    wave = dx.ExpensiveFn(
        fwd=fwd_jit,
        bwd=lambda x, y, ct: adj_jit(x, ct),
        fused=dx.fuse(forward, adjoint),  # jits both halves itself
        name="wave",
    )

    @jax.custom_vjp
    def wave_std(x):
        return fwd_jit(x)

    wave_std.defvjp(lambda x: (fwd_jit(x), x), lambda x, ct: (adj_jit(x, ct),))
    return wave, wave_std


def counted(forward, adjoint, counts):
    """`forward` and `adjoint` that count, on the host, how many times they really run
    (a `jax.debug.callback`: once per execution, once per batch under `vmap`)."""

    def bump(key):
        def cb():
            counts[key] += 1

        return cb

    def fwd_c(x):
        jax.debug.callback(bump("forward"))
        return forward(x)

    def adj_c(x, ct):
        jax.debug.callback(bump("adjoint"))
        return adjoint(x, ct)

    return fwd_c, adj_c


def check_adjoint(forward, adjoint, x, ct) -> float:
    """Max |adjoint - jax.vjp(forward)| relative to max |jax.vjp(forward)|."""
    _, vjp = jax.vjp(forward, x)
    (ref,) = vjp(ct)
    mine = jax.jit(adjoint)(x, ct)
    return float(jnp.max(jnp.abs(mine - ref)) / jnp.max(jnp.abs(ref)))


def check_adjoint_both(forward, adjoint, x, ct, n64: int = 64, steps64: int = 100) -> tuple[float, float]:
    """The adjoint's error against `jax.vjp`: at the benchmark's size in float32, and on a
    small grid in float64 (where it is exact up to rounding)."""
    err32 = check_adjoint(forward, adjoint, x, ct)
    with jax.enable_x64(True):
        f64, a64 = make_wave(n64, steps64, jnp.float64)
        k1, k2 = jax.random.split(jax.random.key(1))
        x64 = jax.random.normal(k1, (n64, n64), jnp.float64)
        ct64 = jax.random.normal(k2, (n64, n64), jnp.float64)
        err64 = check_adjoint(f64, a64, x64, ct64)
    return err32, err64


# ---------------------------------------------------------------------------- timing


def block(tree):
    return jax.block_until_ready(tree)


def time_once(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    block(fn())
    return time.perf_counter() - t0


def interleaved(
    sides: dict[str, Callable[[], object]], repeats: int, warmup: int = 4, settle: float = 0.0
) -> dict[str, list[float]]:
    """Time each side `repeats` times, alternating sides (and their order) every round,
    `settle` seconds apart (untimed), after `warmup` untimed rounds. The default, 4, runs
    past the one change of plan a host site may make from its 4th call on (once the timings
    of its first 3 are known), which would otherwise land in the timed rounds."""
    names = list(sides)
    for _ in range(warmup):
        for name in names:
            block(sides[name]())
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            time.sleep(settle)
            times[name].append(time_once(sides[name]))
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def fmt(t: float) -> str:
    return f"{t:.3f} s" if t >= 1 else f"{t * 1e3:.1f} ms" if t >= 0.01 else f"{t * 1e3:.3f} ms"


def describe(times: list[float]) -> str:
    return f"median {fmt(median(times))} (min {fmt(min(times))}, max {fmt(max(times))}, n={len(times)})"


def result_line(
    bench: str, case: str, new: float, old: float, target: float | None, new_name="deferred", old_name="standard"
) -> str:
    ratio = new / old
    if target is None:
        goal = "no target"
    else:
        goal = f"target <= {target}, {'met' if ratio <= target else 'MISSED'}"
    return f"RESULT {bench} {case}: {new_name} {fmt(new)}, {old_name} {fmt(old)}, ratio {ratio:.2f} ({goal})"


def overlap(times: dict[str, list[float]]) -> str:
    """How far forward and adjoint overlapped while these timings were taken.

    `times` holds the sides "forward alone" (one jitted forward) and "dx.fuse alone"
    (forward and adjoint on two threads, timed interleaved with the compared sides). Their
    ratio is near 1 when the process had two cores to itself, near 2 when another process
    took one: then no deferred schedule on this machine can beat the standard one.
    """
    ratio = median(times["dx.fuse alone"]) / median(times["forward alone"])
    return f"dx.fuse alone / forward alone = {ratio:.2f} (1.0: forward and adjoint fully overlapped; 2.0: not at all)"


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--small", action="store_true", help="tiny sizes and 1-2 repeats: a smoke test")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per side")
    return p


def load() -> str:
    """The 1-minute load average: other processes on a shared machine take cores away."""
    try:
        return f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    except OSError:
        return "load average unknown"


def peak_rss_mb() -> float | None:
    """This process's peak resident memory so far, in MB (`resource.getrusage`: the most it
    has held at once, its factorisations kept between passes among it); None where it
    cannot be read (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # (KiB on Linux, bytes on macOS)
    return peak / 1e6 if sys.platform == "darwin" else peak * 1024 / 1e6


def memory() -> str:
    """The peak memory, for a line beside the times."""
    peak = peak_rss_mb()
    return "peak memory unknown" if peak is None else f"peak memory {peak:.0f} MB (this process, so far)"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, jax {jax.__version__}, backend {jax.default_backend()}; {load()}"


def load_example(name: str):
    """`examples/<name>.py`, imported as a module named `name`."""
    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
