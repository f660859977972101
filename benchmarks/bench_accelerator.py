"""deferax on whatever device JAX finds (a CPU, a TPU, a GPU), in float32: three programs,
each timed side by side in one run (interleaved, medians, jitted functions warmed up first).

    compliance  the SIMP compliance step of the MBB beam (`examples/topology_mbb.py`'s mesh
                and load, densities between 0.3 and 1, a density filter of radius
                `1.5 nelx / 60`), assembled on the device, jitted, at 60 x 20, 120 x 40 and
                180 x 60 elements: deferax (`dx.sparse_solve`, `dx.filter_value_and_grad`)
                against what a user of an accelerator writes by hand, a `jax.custom_vjp`
                whose forward and backward each factor the stiffness with SciPy's `splu` in
                a `jax.pure_callback` (float64 on the host, the results cast to float32),
                and against a dense float32 `jnp.linalg.solve` on the device where the dense
                matrix fits (n <= 6000). Each side's compliance and gradient are compared
                with a float64 NumPy/SciPy reference (the analytic SIMP sensitivity, taken
                back through the filter), and with the same reference whose element
                stiffness `KE` is rounded to float32 ("float64, KE float32"), as the float32
                programs' is: that rounding alone moves the compliance by 0.4 % at 60 x 20
                and 3 % at 180 x 60 (the rounded `KE` loses its exact rigid-body modes, the
                same way in every element, and a slender beam's bending energy is a small
                difference of large entries), so no program assembling a float32 `KE` gets
                closer. deferax and the hand-written side (the same float32 entries, solved
                in float64) are checked to agree with each other.
    seed        the seed's program (`examples/seed_custom_vjp.py`: the wave stepper as a
                `jax.custom_vjp`, 1500 steps, a loss affine in its output), jitted, at
                128 x 128 and 1024 x 1024: plain JAX, deferax on the unchanged loss,
                `dx.ExpensiveFn(fwd=forward, adjoint=adjoint)`, the same with
                `fused=dx.fuse(forward, adjoint)`, and a hand-written floor (forward and
                adjoint stepped together in one `lax.scan`); gradients checked against
                plain JAX.
    supervised  `bench_supervised.py`'s training step (typed MLP, a `dx.host` layer under
                `vmap`, Adam, `eqx.filter_jit`): deferax against Equinox.
    devices     with two devices or more (on a CPU: `XLA_FLAGS=
                --xla_force_host_platform_device_count=2`), the seed's program at 128 x 128
                with its halves on two devices in one jitted step (`dx.set_devices`), against
                the two-thread floor (the two jitted halves started from two threads) and
                plain JAX. On one device it prints a note and skips.

float32 throughout: x64 stays off (the references are NumPy's). Timings are medians of
interleaved repeats, the first calls (compilation) untimed.

    python benchmarks/bench_accelerator.py                      # full size
    python benchmarks/bench_accelerator.py --small              # smoke test (CPU: under a minute)
    python benchmarks/bench_accelerator.py --part seed          # one part: compliance, seed or supervised
"""

from __future__ import annotations

import concurrent.futures
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.signal
import numpy as np
import scipy.signal
import scipy.sparse as sp
import scipy.sparse.linalg as spl
from _common import (
    block,
    describe,
    interleaved,
    laplacian,
    load,
    load_example,
    machine,
    make_wave,
    material,
    median,
    parser,
    result_line,
    wavelet,
)
from jax import lax

import deferax as dx

BENCH = "bench_accelerator"
EXAMPLE = load_example("topology_mbb")
DENSE_LIMIT = 6000  # the dense solve's largest n (a float32 n x n matrix: 144 MB)
TARGETS = {"compliance 180x60": 0.10}
SEED_TARGET = 0.97  # the seed's deferred sites / plain JAX (its halves are loops of equal length)
DEVICES_TARGET = 1.15  # the halves on two devices / the two-thread floor  # deferax / hand-written at 180 x 60
GRAD_RTOL = 1e-4  # the seed's gradients against plain JAX's (float32)


def device() -> str:
    d = jax.devices()[0]
    return f"platform {d.platform}, device {d.device_kind} ({jax.device_count()} device(s))"


def errors(c, dc, ref_c: float, ref_dc: np.ndarray) -> tuple[float, float]:
    """The compliance's relative error and the gradient's largest difference relative to
    its largest entry."""
    value = abs(float(c) - ref_c) / abs(ref_c)
    grad = float(np.max(np.abs(np.asarray(dc, np.float64) - ref_dc)) / np.max(np.abs(ref_dc)))
    return value, grad


# ---------------------------------------------------------------------------- compliance


class Beam:
    """The MBB beam with a density filter: `examples/topology_mbb.py`'s `MBB` (mesh, load,
    pattern), a cone filter of radius `rmin` (top88's `H x / Hs`, as a 2D convolution on
    the `nelx x nely` grid of elements), and the three compliance losses, each
    `x -> f . u` with `K(filter(x)) u = f`, all in JAX (float32)."""

    def __init__(self, nelx: int, nely: int):
        self.nelx, self.nely = nelx, nely
        self.mbb = EXAMPLE.MBB(nelx, nely)
        self.n = self.mbb.pattern.n
        self.rmin = 1.5 * nelx / 60
        r = int(np.ceil(self.rmin)) - 1
        i = np.arange(-r, r + 1)
        self.kernel = np.maximum(0.0, self.rmin - np.hypot(i[:, None], i[None, :]))  # (symmetric)
        self.hs = scipy.signal.convolve2d(np.ones((nelx, nely)), self.kernel, mode="same")
        rng = np.random.default_rng(0)
        self.x = rng.uniform(0.3, 1.0, nelx * nely)  # (the element index is elx * nely + ely)

    # the filter, in JAX and in NumPy

    def filter(self, x):
        kernel, hs = jnp.asarray(self.kernel, x.dtype), jnp.asarray(self.hs, x.dtype)
        grid = x.reshape(self.nelx, self.nely)
        smooth = jax.scipy.signal.convolve2d(grid, kernel, mode="same", precision=lax.Precision.HIGHEST)
        return (smooth / hs).ravel()

    def filter_np(self, x):
        grid = np.asarray(x, np.float64).reshape(self.nelx, self.nely)
        return (scipy.signal.convolve2d(grid, self.kernel, mode="same") / self.hs).ravel()

    def reference(self, ke_float32: bool = False) -> tuple[float, np.ndarray]:
        """The compliance and its gradient in float64 (NumPy and SciPy): the analytic SIMP
        sensitivity with respect to the filtered densities, taken back through the filter
        (`dc/dx = H^T (dc/dx_phys / Hs)`, a convolution with the symmetric kernel).
        `ke_float32`: with the element stiffness `KE` rounded to float32, the rest in float64:
        what is left of the programs' error once `KE` is float32 (as `MBB.values` makes it)."""
        mbb = self.mbb
        x_phys = self.filter_np(self.x)

        def rounded(a):
            return a.astype(np.float32).astype(np.float64) if ke_float32 else a

        values = mbb.stiffness(x_phys)[mbb.entry_element] * rounded(mbb.entry_ke)
        p = mbb.pattern
        u = np.zeros(2 * (self.nelx + 1) * (self.nely + 1))
        u[mbb.free] = spl.spsolve(sp.csc_matrix((values, (p.rows, p.cols)), shape=(p.n, p.n)), mbb.f)
        ue = u[mbb.edofs]
        energy = np.einsum("ei,ij,ej->e", ue, rounded(mbb.ke), ue)
        dc_phys = -EXAMPLE.PENAL * x_phys ** (EXAMPLE.PENAL - 1) * (1.0 - EXAMPLE.E_MIN) * energy
        back = dc_phys.reshape(self.nelx, self.nely) / self.hs
        return float(mbb.f @ u[mbb.free]), scipy.signal.convolve2d(back, self.kernel, mode="same").ravel()

    # the losses

    def loss_deferax(self, x):
        return self.mbb.compliance(self.filter(x))

    def loss_handwritten(self, x):
        f = jnp.asarray(self.mbb.f, x.dtype)
        return jnp.dot(f, handwritten_solve(self.mbb.pattern)(self.mbb.values(self.filter(x)), f))

    def loss_dense(self, x):
        f = jnp.asarray(self.mbb.f, x.dtype)
        p = self.mbb.pattern
        k = jnp.zeros((p.n, p.n), x.dtype).at[p.rows, p.cols].add(self.mbb.values(self.filter(x)))
        return jnp.dot(f, jnp.linalg.solve(k, f))


def handwritten_solve(pattern):
    """`solve(values, b)`: `A^-1 b` for `A[rows[k], cols[k]] += values[k]`, as a user of an
    accelerator writes it: a `jax.custom_vjp` whose forward factors `A` with SciPy's `splu`
    in a `jax.pure_callback` and whose backward factors it again in another to solve
    `A^T lam = ct` (float64 on the host, the results cast to float32); the entries'
    cotangents `-lam[rows] * u[cols]` are made on the device."""
    rows, cols, n = pattern.rows, pattern.cols, pattern.n

    def factor(values):
        return spl.splu(sp.csc_matrix((np.asarray(values, np.float64), (rows, cols)), shape=(n, n)))

    def solve_host(values, b):
        return factor(values).solve(np.asarray(b, np.float64)).astype(np.float32)

    def solve_transposed_host(values, ct):
        return factor(values).solve(np.asarray(ct, np.float64), trans="T").astype(np.float32)

    out = jax.ShapeDtypeStruct((n,), jnp.float32)

    @jax.custom_vjp
    def solve(values, b):
        return jax.pure_callback(solve_host, out, values, b)

    def solve_fwd(values, b):
        u = solve(values, b)
        return u, (values, u)

    def solve_bwd(res, ct):
        values, u = res
        lam = jax.pure_callback(solve_transposed_host, out, values, ct)
        return -lam[rows] * u[cols], lam

    solve.defvjp(solve_fwd, solve_bwd)
    return solve


def compliance_sides(beam: Beam) -> dict:
    """The jitted value-and-gradient functions of one beam, by side name."""
    sides = {
        "deferax": jax.jit(dx.filter_value_and_grad(beam.loss_deferax)),
        "hand-written splu": jax.jit(jax.value_and_grad(beam.loss_handwritten)),
    }
    if beam.n <= DENSE_LIMIT:
        sides["dense jnp.linalg.solve"] = jax.jit(jax.value_and_grad(beam.loss_dense))
    return sides


def part_compliance(args, results: list[str], problems: list[str]):
    sizes = [(30, 10), (60, 20)] if args.small else [(60, 20), (120, 40), (180, 60)]
    repeats = args.repeats or (2 if args.small else 9)
    print("== compliance: SIMP MBB beam, density filter, float32, jitted value and gradient")
    for nelx, nely in sizes:
        beam = Beam(nelx, nely)
        case = f"compliance {nelx}x{nely}"
        print(f"-- {case}: {beam.n} unknowns, {beam.mbb.pattern.nnz} entries, filter radius {beam.rmin:.2f}")
        x = jnp.asarray(beam.x, jnp.float32)
        fns = compliance_sides(beam)
        if "dense jnp.linalg.solve" not in fns:
            print(f"   dense jnp.linalg.solve: skipped (n = {beam.n} > {DENSE_LIMIT})")
        plan = dx.explain(dx.filter_value_and_grad(beam.loss_deferax), x)
        print(f"   deferax's schedule: {', '.join(s.schedule for s in plan.sites) or 'solved inside the program'}")
        ref_c, ref_dc = beam.reference()
        round_c, round_dc = beam.reference(ke_float32=True)
        value_error, grad_error = errors(round_c, round_dc, ref_c, ref_dc)
        print(
            f"   {'float64, KE float32':22s}: compliance {round_c:.7g} (float64 {ref_c:.7g}), relative error "
            f"{value_error:.1e}; gradient {grad_error:.1e} (the rounding of KE to float32 alone)"
        )
        got = {}
        for name, fn in fns.items():
            got[name] = c, dc = block(fn(x))
            value_error, grad_error = errors(c, dc, ref_c, ref_dc)
            print(
                f"   {name:22s}: compliance {float(c):.7g} (float64 {ref_c:.7g}), relative error "
                f"{value_error:.1e}; gradient {grad_error:.1e}"
            )
        # deferax and the hand-written side solve the same float32 entries in float64: they agree
        (c, dc), (c_hand, dc_hand) = got["deferax"], got["hand-written splu"]
        value_error, grad_error = errors(c, dc, float(c_hand), np.asarray(dc_hand, np.float64))
        print(f"   deferax against hand-written: value {value_error:.1e}, gradient {grad_error:.1e}")
        if value_error > 1e-4 or grad_error > 1e-3:  # (180 x 60 on a CPU: 0 and 8e-5)
            problems.append(f"{case}: deferax against hand-written: value {value_error:.1e}, gradient {grad_error:.1e}")
        times = timed({name: (lambda fn=fn, x=x: fn(x)) for name, fn in fns.items()}, repeats, 22)
        new = median(times["deferax"])
        results.append(
            result_line(
                BENCH, case, new, median(times["hand-written splu"]), TARGETS.get(case), "deferax", "hand-written"
            )
        )
        if "dense jnp.linalg.solve" in times:
            results.append(
                result_line(
                    BENCH, f"{case} dense", new, median(times["dense jnp.linalg.solve"]), None, "deferax", "dense"
                )
            )


# ---------------------------------------------------------------------------- seed


def seed_program(n: int, steps: int):
    """The seed's program and its variants: `(loss, losses, floor, halves)`, where `loss` is the
    unchanged program (the stepper as a `jax.custom_vjp`), `losses` the same loss through
    two `dx.ExpensiveFn` sites, `floor(x) -> (value, grad)` the hand-written floor, and
    `halves` the forward and the adjoint, each jitted alone."""
    forward, adjoint = make_wave(n, steps)  # (the seed's stepper, as the other benchmarks have it)
    c2, g = material(n), wavelet(steps)  # (for the floor below)
    w = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)

    @jax.custom_vjp
    def f(x):
        return forward(x)

    f.defvjp(lambda x: (f(x), x), lambda x, v: (adjoint(x, v),))

    def loss_of(fn):
        def loss(x):
            return jnp.sum(w * fn(x)) + 1e-3 * jnp.sum(x**2)  # affine in fn(x)

        return loss

    sites = {
        "ExpensiveFn(adjoint=)": dx.ExpensiveFn(fwd=forward, adjoint=adjoint, name="wave"),
        "ExpensiveFn(fused=dx.fuse)": dx.ExpensiveFn(
            fwd=forward, adjoint=adjoint, fused=dx.fuse(forward, adjoint), name="wave"
        ),
    }

    def floor(x):
        """Forward and adjoint stepped together: one scan whose carry holds both states
        (the loss's cotangent of the output is `w`)."""

        def step(carry, gs):
            (u, u_prev), (b, b_next, acc) = carry
            gk, gr = gs
            u_next = 2 * u - u_prev + c2 * laplacian(u) + gk * x
            b_prev = 2 * b - b_next + laplacian(c2 * b)
            return ((u_next, u), (b_prev, b, acc + gr * b)), None

        zero = jnp.zeros_like(x)
        ((u, _), (_, _, acc)), _ = lax.scan(step, ((zero, zero), (w, zero, zero)), (g, g[::-1]))
        return jnp.sum(w * u) + 1e-3 * jnp.sum(x**2), acc + 2e-3 * x

    # (the two halves alone, each jitted: the forward, and the adjoint of the loss's cotangent `w`)
    halves = (jax.jit(forward), jax.jit(lambda x: adjoint(x, w)))
    return loss_of(f), {name: loss_of(site) for name, site in sites.items()}, floor, halves


def timed(sides: dict, repeats: int, width: int) -> dict[str, list[float]]:
    """Each side timed `repeats` times, interleaved (`_common.interleaved`), each printed."""
    times = interleaved(sides, repeats)
    for name, ts in times.items():
        print(f"   {name:{width}s}: {describe(ts)}")
    return times


def agree(got, want) -> tuple[float, float]:
    """The value's and the gradient's relative differences."""
    (v1, g1), (v2, g2) = got, want
    value = abs(float(v1) - float(v2)) / (abs(float(v2)) + 1e-30)
    grad = float(jnp.max(jnp.abs(g1 - g2)) / (jnp.max(jnp.abs(g2)) + 1e-30))
    return value, grad


def part_seed(args, results: list[str], problems: list[str]):
    sizes = [(64, 200)] if args.small else [(128, 1500), (1024, 1500)]
    print("== seed: the wave stepper as a jax.custom_vjp, a loss affine in its output, float32, jitted")
    for n, steps in sizes:
        repeats = args.repeats or (2 if args.small else 11 if n <= 256 else 5)
        loss, site_losses, floor, _ = seed_program(n, steps)
        case = f"seed {n}x{n}"
        print(f"-- {case}, {steps} steps")
        x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        fns = {
            "plain JAX": jax.jit(jax.value_and_grad(loss)),
            "deferax unchanged": jax.jit(dx.filter_value_and_grad(loss)),
        }
        plans = {"deferax unchanged": dx.explain(dx.filter_value_and_grad(loss), x)}
        for name, site_loss in site_losses.items():
            fns[name] = jax.jit(dx.filter_value_and_grad(site_loss))
            plans[name] = dx.explain(dx.filter_value_and_grad(site_loss), x)
        fns["floor (one scan)"] = jax.jit(floor)
        for name, plan in plans.items():
            schedules = ", ".join(s.schedule for s in plan.sites) or "no site"
            recognised = f"; {len(plan.recognised)} custom_vjp call(s) recognised" if plan.recognised else ""
            print(f"   {name:26s}: {schedules}{recognised}")
        want = block(fns["plain JAX"](x))
        for name, fn in fns.items():
            if name == "plain JAX":
                continue
            value, grad = agree(block(fn(x)), want)
            ok = value <= GRAD_RTOL and grad <= GRAD_RTOL
            print(
                f"   {name:26s}: against plain JAX: value {value:.1e}, gradient {grad:.1e} {'ok' if ok else 'MISMATCH'}"
            )
            if not ok:
                problems.append(f"{case} {name}: value {value:.1e}, gradient {grad:.1e} against plain JAX")
        times = timed({name: (lambda fn=fn, x=x: fn(x)) for name, fn in fns.items()}, repeats, 26)
        old = median(times["plain JAX"])
        for name in fns:
            if name != "plain JAX":
                # (the halves are loops of equal length: 0.97 of plain JAX where they run in one
                # program, on an accelerator; a CPU's deferred schedules are measured by bench_seed*)
                on_cpu = jax.default_backend() == "cpu"
                target = None if name.startswith("floor") or on_cpu else SEED_TARGET
                results.append(
                    result_line(BENCH, f"{case} {name}", median(times[name]), old, target, name, "plain JAX")
                )


def part_devices(args, results: list[str], problems: list[str]):
    """The seed's program with its halves on two devices in one jitted step (`dx.set_devices`),
    against the two-thread floor (the jitted halves started from two threads, eagerly) and
    plain JAX. Needs two devices: on a CPU, `XLA_FLAGS=--xla_force_host_platform_device_count=2`."""
    devices = jax.devices()
    print("== devices: the seed's halves on two devices in one jitted step")
    if len(devices) < 2:
        print("   (one device: run with XLA_FLAGS=--xla_force_host_platform_device_count=2 on a CPU)")
        return
    n, steps = (64, 200) if args.small else (128, 1500)
    repeats = args.repeats or (3 if args.small else 15)
    loss, _, _, halves = seed_program(n, steps)
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    plain = jax.jit(jax.value_and_grad(loss))
    dx.set_devices(devices[:2])  # (read when the step is traced: at its first call, below)
    on_devices = jax.jit(dx.filter_value_and_grad(loss, recognise="always"))
    plan = dx.explain(on_devices, x)
    jax.block_until_ready(on_devices(x))
    dx.set_devices(None)
    print(f"   deferax: {plan.sites[0].schedule}; {plan.sites[0].halves}")
    pool = concurrent.futures.ThreadPoolExecutor(2)

    def two_threads():
        other = pool.submit(lambda: jax.block_until_ready(halves[1](x)))
        jax.block_until_ready(halves[0](x))
        return other.result()

    want = block(plain(x))
    value, grad = agree(block(on_devices(x)), want)
    print(f"   against plain JAX: value {value:.1e}, gradient {grad:.1e}")
    if value > GRAD_RTOL or grad > GRAD_RTOL:
        problems.append(f"devices: value {value:.1e}, gradient {grad:.1e} against plain JAX")
    sides = {
        "plain JAX": lambda: plain(x),
        "two-thread floor": two_threads,
        "one after the other": lambda: (halves[0](x), halves[1](x)),
        "deferax, two devices": lambda: on_devices(x),
    }
    times = timed(sides, repeats, 22)
    floor = median(times["two-thread floor"])
    results.append(
        result_line(
            BENCH,
            f"devices seed {n}x{n}",
            median(times["deferax, two devices"]),
            floor,
            DEVICES_TARGET,
            "deferax, two devices",
            "two-thread floor",
        )
    )
    results.append(
        result_line(
            BENCH,
            f"devices seed {n}x{n} vs plain",
            median(times["deferax, two devices"]),
            median(times["plain JAX"]),
            None,
            "deferax, two devices",
            "plain JAX",
        )
    )


# ---------------------------------------------------------------------------- supervised


def part_supervised(args, results: list[str], problems: list[str]):
    import bench_supervised as sup

    sizes = (8, 4, 16, 8, 4) if args.small else (32, 16, 64, 32, 16)
    repeats = args.repeats or (2 if args.small else 31)
    opt, opt_name = sup.adam()
    batch, d, width, h, m = sizes
    print(
        f"== supervised: typed MLP {d}-{width}-{width}-{h}, dx.host layer {h}->{m} under vmap over {batch}, "
        f"MSE, {opt_name}, eqx.filter_jit, float32"
    )
    cases = ("sleep 5 ms", "no sleep") if args.small else tuple(sup.CASES)
    for case in cases:
        sleep, vectorized, target = sup.CASES[case]
        model, _, xs, ts = sup.build(sleep, sizes, vectorized)
        plan = dx.explain(dx.filter_value_and_grad(sup.loss), model, xs, ts)
        print(f"-- {case}: deferax's schedule {', '.join(f'{s.schedule} k={s.k}' for s in plan.sites)}")
        got = eqx.filter_jit(dx.filter_value_and_grad(sup.loss))(model, xs, ts)
        ref = eqx.filter_jit(eqx.filter_value_and_grad(sup.loss))(model, xs, ts)
        leaves = zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref), strict=True)
        worst = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30)) for a, b in leaves)
        print(f"   gradient against Equinox's: largest relative difference {worst:.1e}")
        if worst > 1e-4:
            problems.append(f"supervised {case}: gradient {worst:.1e} from Equinox's")
        state = opt.init(eqx.filter(model, eqx.is_array))
        steps = {
            "deferax": sup.make_step(dx.filter_value_and_grad, opt),
            "equinox": sup.make_step(eqx.filter_value_and_grad, opt),
        }
        operands = (model, state, xs, ts)
        times = timed({name: (lambda s=s, operands=operands: s(*operands)) for name, s in steps.items()}, repeats, 8)
        new, old = median(times["deferax"]), median(times["equinox"])
        results.append(result_line(BENCH, f"supervised {case}", new, old, target, "deferax", "equinox"))


PARTS = {"compliance": part_compliance, "seed": part_seed, "supervised": part_supervised, "devices": part_devices}


def main():
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=tuple(PARTS), action="append", help="run this part only (repeatable)")
    args = p.parse_args()
    assert not jax.config.jax_enable_x64, "this benchmark runs in float32: leave jax_enable_x64 off"
    print(f"{BENCH}: {device()}")
    print(f"{machine()}")
    results: list[str] = []
    problems: list[str] = []
    for name in args.part or tuple(PARTS):
        PARTS[name](args, results, problems)
        print()
    print(f"at the end: {load()}; {device()}")
    for line in results:
        print(line)
    for problem in problems:
        print(f"CHECK FAILED {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
