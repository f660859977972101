"""ceviche-challenges' waveguide bend (invrs-gym's lightweight size: a 108 x 108 FDFD grid, two
wavelengths): one value and gradient of the challenge's loss, timed side by side.

- reference: the challenge's own path, ceviche's `simulate` (the two wavelengths on two
  threads) and the loss, differentiated by autograd (a forward `spsolve` per wavelength,
  then an adjoint `spsolve` of `A^T`, which factors again);
- deferax default: `examples/inverse_design_ceviche.py`'s loss (the system assembled in
  JAX, `dx.sparse_solve`), `jax.jit(dx.filter_value_and_grad(loss))`, no options;
- deferax max_basis=6: the same with `max_basis=6` (each wavelength's loss sees the field
  through 3 complex amplitudes, k = 6): the deferred-basis schedule;
- deferax default, COLAMD: the default with `solver=dx.SuperLU(permc_spec="COLAMD")`, the
  ordering the hand-written sides and the floors use (the default chooses `MMD_AT_PLUS_A`
  for this structurally symmetric pattern: more fill here);
- hand-written fused: the best a user can write by hand, a `dx.host` site per wavelength
  whose `fused_batch` factors `A` once and solves the forward and the 6 adjoint right-hand
  sides with it (`max_basis=6`);
- serial floor: the least work any schedule does, one job after the other: per wavelength,
  one `splu`, the forward solve and one adjoint solve, with one BLAS thread (threadpoolctl's
  `threadpool_limits(1)`: on OpenBLAS's default threads, on a loaded machine, these took
  up to 30 times longer);
- parallel floor (the true floor): the same two jobs at once, on two bare Python threads
  (SuperLU releases the GIL), inside threadpoolctl's `threadpool_limits(1)`: one BLAS thread
  each. No schedule on two cores can do less: the targets are against this one.

Each side's median is printed with its spread over the repeats (min-max and the
interquartile range).

With `--processes`, the deferax sides also run with their solves on a 2-process pool (spawn).
Run it with and without `OPENBLAS_NUM_THREADS=1`: the script prints which.

    python benchmarks/bench_ceviche.py                 # the 108 x 108 bend, 5 repeats
    python benchmarks/bench_ceviche.py --small         # 1 repeat (a smoke test)
    python benchmarks/bench_ceviche.py --processes     # also on a process pool
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import multiprocessing
import os
import statistics
import threading

import autograd
import autograd.numpy as npa
import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spl
from _common import describe, fmt, interleaved, load, load_example, machine, median, parser, result_line

import deferax as dx

TARGETS = {"default": 0.45, "fused": 1.05, "floor": 1.15}


EXAMPLE = load_example("inverse_design_ceviche")


class Factored:
    """The solve `values -> Ez` of one wavelength, by hand: `fused_batch` factors `A` once
    and solves `b` and every adjoint right-hand side with that factorisation. NumPy only, so
    that a process pool can take it."""

    def __init__(self, pattern, source):
        self.rows, self.cols, self.n, self.b = pattern.rows, pattern.cols, pattern.n, np.asarray(source)

    def factor(self, values):
        return spl.splu(sp.csc_matrix((values, (self.rows, self.cols)), shape=(self.n, self.n)))

    def fwd(self, values):
        return self.factor(values).solve(self.b)

    def fused(self, values, ct):
        ez, ct_values = self.fused_batch(values, ct[None])
        return ez, ct_values[0]

    def fused_batch(self, values, cts):
        lu = self.factor(values)
        ez = lu.solve(self.b)
        lam = lu.solve(np.ascontiguousarray(cts.T), trans="T").T
        return ez, -lam[:, self.rows] * ez[self.cols]


class HandWritten(EXAMPLE.Wavelength):
    """A wavelength of the example whose solve is a `Factored` host site (`max_basis=6`: the
    deferred-basis schedule)."""

    def __init__(self, model, wavelength_nm, executor=None):
        super().__init__(model, wavelength_nm)
        self.factored = f = Factored(self.pattern, self.source)
        out = jax.ShapeDtypeStruct((self.pattern.n,), jnp.complex128)
        impls = dict(fused=f.fused, fused_batch=f.fused_batch, out=out, max_basis=6, executor=executor)
        self.site = dx.host(f.fwd, **impls, name="hand-written")

    def solve(self, values):
        return self.site(values)


class Colamd(EXAMPLE.Wavelength):
    """A wavelength of the example whose solve orders the columns with COLAMD."""

    def solve(self, values):
        solver = dx.SuperLU(permc_spec="COLAMD")
        return dx.sparse_solve(values, self.pattern, self.source, solver=solver, executor=self.executor)


def at_once(jobs):
    """Run the thunks `jobs` at once, one bare Python thread each, with one BLAS thread per
    native library (threadpoolctl's limit, set here for the whole process), and return their
    results."""
    from threadpoolctl import threadpool_limits

    out = [None] * len(jobs)

    def run(i):
        out[i] = jobs[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    with threadpool_limits(1):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return out


def one_thread(fn):
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        return fn()


def spread(times: list[float]) -> str:
    """Max - min and the interquartile range."""
    q1, _, q3 = statistics.quantiles(times, n=4) if len(times) >= 2 else (times[0],) * 3
    return f"spread {fmt(max(times) - min(times))}, IQR {fmt(q3 - q1)}"


def main():
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--processes", action="store_true", help="also run the deferax sides on a 2-process pool (spawn)")
    args = p.parse_args()
    repeats = args.repeats or (1 if args.small else 5)
    jax.config.update("jax_enable_x64", True)
    print(f"bench_ceviche: {machine()}")
    print(f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(not set)')}")
    model = EXAMPLE.challenge("waveguide_bend")
    print(f"waveguide bend: {model.shape[0]} x {model.shape[1]} grid, {len(model.output_wavelengths)} wavelengths")
    design = np.random.default_rng(0).uniform(0.0, 1.0, model.design_variable_shape)
    x = jnp.asarray(design)

    reference = autograd.value_and_grad(lambda d: EXAMPLE.window_loss(model.simulate(d)[0], npa))
    loss = EXAMPLE.make_loss(model)
    # Every call gets a design of its own, as in an optimisation: a factorisation kept from
    # an earlier call (in a worker process, for a backward pass that ran elsewhere) must not
    # be found again.
    calls = itertools.count(1)

    def fresh():
        return design * (1.0 + 1e-12 * next(calls))

    sides = {"reference": lambda: reference(fresh())}
    steps = {
        "default": (loss, {}),
        "max_basis=6": (loss, {"max_basis": 6}),
        "default, COLAMD": (EXAMPLE.make_loss(model, [Colamd(model, w) for w in model.output_wavelengths]), {}),
        "hand-written fused": (EXAMPLE.make_loss(model, [HandWritten(model, w) for w in model.output_wavelengths]), {}),
    }
    pool = None
    if args.processes:
        pool = cf.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
        on_pool = EXAMPLE.make_loss(model, [EXAMPLE.Wavelength(model, w, pool) for w in model.output_wavelengths])
        hand_pool = EXAMPLE.make_loss(model, [HandWritten(model, w, pool) for w in model.output_wavelengths])
        steps |= {
            "default, processes": (on_pool, {}),
            "max_basis=6, processes": (on_pool, {"max_basis": 6}),
            "hand-written fused, processes": (hand_pool, {}),
        }
    expected = reference(design)
    for name, (fn, options) in steps.items():
        value_and_grad = dx.filter_value_and_grad(fn, **options)
        step = jax.jit(value_and_grad)
        got = step(x)
        error = float(jnp.max(jnp.abs(got[1] - expected[1])) / np.max(np.abs(expected[1])))
        plan = dx.explain(value_and_grad, x)
        with dx.record() as timeline:
            jax.block_until_ready(step(jnp.asarray(fresh())))
        runs = dict(sorted(timeline.counts().items()))
        print(f"--- {name}: runs {runs} per step, gradient error {error:.1e} (relative to its largest entry)\n{plan}")
        sides[name] = lambda s=step: s(jnp.asarray(fresh()))
        steps[name] = step

    floor = [HandWritten(model, w) for w in model.output_wavelengths]
    eps = model.epsilon_r(design).ravel()
    values = [np.r_[-EXAMPLE.EPSILON_0 * w.omega**2 * eps, np.asarray(w.curl)] for w in floor]
    ct = np.ones((1, floor[0].pattern.n), complex)
    sides["serial floor"] = lambda: one_thread(
        lambda: [w.factored.fused_batch(v, ct) for w, v in zip(floor, values, strict=True)]
    )
    sides["parallel floor"] = lambda: at_once(
        [lambda w=w, v=v: w.factored.fused_batch(v, ct) for w, v in zip(floor, values, strict=True)]
    )

    # OpenBLAS's threads spin for about 0.1 s after a call that used them (its
    # OPENBLAS_THREAD_TIMEOUT) before they sleep: the reference's solves, on default threads,
    # would slow down whichever side runs next. Sides start 0.3 s apart.
    times = interleaved(sides, repeats, settle=0.3)
    print(f"timings ({repeats} interleaved repeats):")
    for name, ts in times.items():
        print(f"  {name:30s}: {describe(ts)}, {spread(ts)}")
    # The schedule may change once timings are known (from a site's fourth call): what ran last.
    for name, step in steps.items():
        with dx.record() as timeline:
            jax.block_until_ready(step(jnp.asarray(fresh())))
        print(f"  {name}: after the timings, a step runs {dict(sorted(timeline.counts().items()))}")
    chosen = dx.SuperLU().chosen(floor[0].pattern)
    print(
        "  the floors factor with splu's default ordering (COLAMD); deferax's SuperLU() measured "
        + ("nothing for this pattern" if chosen is None else f"{chosen[0]} for it (factors' entries: {chosen[1]})")
    )
    ref = median(times["reference"])
    for name in times:
        if name != "reference":
            print(f"  {name} / reference: {median(times[name]) / ref:.2f}")
    default, fused = median(times["default"]), median(times["hand-written fused"])
    print(result_line("bench_ceviche", "default", default, ref, TARGETS["default"], "deferax", "reference"))
    print(result_line("bench_ceviche", "default-vs-fused", default, fused, TARGETS["fused"], "deferax", "fused"))
    d_spread, f_spread = (max(times[n]) - min(times[n]) for n in ("default", "hand-written fused"))
    print(
        f"  spread (max - min) of the default's repeats {fmt(d_spread)}, of the hand-written site's {fmt(f_spread)}: "
        + ("no wider" if d_spread <= f_spread else "WIDER")
    )
    par = median(times["parallel floor"])
    print(f"  parallel floor / serial floor: {par / median(times['serial floor']):.2f} (0.5: the two jobs overlapped)")
    for name, case, label in (
        ("default", "default-vs-floor", "deferax"),
        ("max_basis=6", "max-basis-6-vs-floor", "max_basis=6"),
        ("default, COLAMD", "default-colamd-vs-floor", "deferax COLAMD"),
        ("hand-written fused", "fused-vs-floor", "fused"),
    ):
        target = TARGETS["floor"] if name == "default" else None
        print(result_line("bench_ceviche", case, median(times[name]), par, target, label, "floor"))
    print(f"at the end: {load()}")
    if pool is not None:
        pool.shutdown()


if __name__ == "__main__":
    main()
