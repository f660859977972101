"""`dx.sparse_solve` against the field: one jitted value and gradient of a loss of
`x = A^-1 b`, differentiated with respect to the matrix's entries and `b`, side by side with

- sparsax (SuiteSparse through XLA FFI: CHOLMOD's `solve` on the SPD matrix, KLU's `lu_solve`
  on the others; real float64 only, so a complex matrix goes through its 2n real embedding),
- klujax (`klujax.solve`, KLU through XLA FFI, real and complex),
- JAX's `jax.experimental.sparse.linalg.spsolve` (SciPy's `spsolve` in a callback, with JAX's
  own VJP: two factorisations),
- SciPy by hand (a `jax.custom_vjp` over `pure_callback`s: `splu` once, its factorisation
  kept for the transposed solve: the best hand-written SciPy code), cholespy and
  sparsax's CHOLMOD (its NumPy entry points) by hand on the SPD matrix (the same, with CHOLMOD),
  and MKL's PARDISO by hand through pypardiso on the real matrices (its analysis made once).

Cases: (a) the 180 x 60 MBB beam's stiffness (SPD, n = 22,020), (b) a real
convection-diffusion operator (n = 22,500), (c) a complex Helmholtz operator (n = 22,500),
each with three losses (`linear`: `Re w.x`; `overlap`: `|w.x|^2`; `power`: `sum |x|^2`); then
at n = 3,600 `jax.jacrev` of 200 entries of `x` and `jax.vmap` of the solve over 200
right-hand sides (JAX's `spsolve` has no batching rule there), and one value and gradient at
n = 900 (a small system). deferax, with its defaults, solves a small
real system inside the compiled program (sparsax's KLU: the jacrev, vmap and small cases
here) and any other on the host; "deferax on the host"
(`where="host"`) times the host's solve beside it. Each side's value
and gradient are checked against deferax's (and deferax's against a dense solve on the small
system); deferax's factorisations, solve calls and host jobs are counted, and those of the
hand-written sides (the peers factor inside XLA, where nothing can count them). Each timed
call gets a new matrix (its entries scaled by 1 + 1e-6 k, k never the same twice in a run), as
an optimisation loop does:
sparsax keeps the factorisation of the values it saw last, which a repeated matrix would find. On the SPD
beam the loss is differentiated with respect to the element densities the stiffness is made
from (sparsax's CHOLMOD reads only the upper triangle, so its gradient with respect to each
entry differs; with respect to the densities all agree). Medians of interleaved repeats, the
load printed before and after. splineax's sides (its KLU, and its PARDISO where pardiso-mkl-jax is installed)
run where splineax is installed (Python 3.11 with jax up to 0.10: splineax 0.4 does not import on jax 0.12,
and its fork of klujax then stands for klujax). umfpack-jax is not a side: its wheel holds only the FFI
targets (its Python functions are in vajax) and requires jax < 0.10.

    python benchmarks/bench_peers.py            # the sizes above
    python benchmarks/bench_peers.py --small    # tiny sizes (a smoke test)
    python benchmarks/bench_peers.py --only many    # jacrev, vmap and the small system alone
"""

from __future__ import annotations

import collections
import importlib.util
import itertools
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import bench_backends  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import scipy.sparse  # noqa: E402
import scipy.sparse.linalg  # noqa: E402
from _common import describe, interleaved, load, machine, median, parser  # noqa: E402
from jax.experimental.sparse.linalg import spsolve  # noqa: E402

import deferax as dx  # noqa: E402
from deferax._sparse import _program  # noqa: E402

jax.config.update("jax_enable_x64", True)

CALLS = itertools.count(1)  # (each timed call's matrix scaled by its own number: never one seen before)
COUNTS: collections.Counter = collections.Counter()  # (the hand-written sides' factorisations and solves)


def installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# ----------------------------------------------------------------------------- hand-written SciPy and CHOLMOD


def by_hand(pattern: dx.SparsePattern, dtype, factor, solve, label: str):
    """`solve(values, b)`: a `jax.custom_vjp` whose forward factors once on the host (kept,
    by a key passed as a residual, for the backward's transposed solve) and whose backward
    solves `A^T lam = ct` with it, every right-hand side of a `vmap` batch in one call: what
    a careful user writes by hand."""
    kept: dict[int, object] = {}
    counter = iter(range(1 << 62))
    n = pattern.n

    def factored(values):
        COUNTS[f"{label} factor"] += 1
        return factor(pattern._csc(np.asarray(values)))

    def solved(made, rhs, transpose):  # (rhs: (..., n), any batch, in one solve call)
        COUNTS[f"{label} solve"] += 1
        flat = np.asarray(rhs).reshape(-1, n)
        return solve(made, np.ascontiguousarray(flat.T), transpose).T.reshape(rhs.shape).astype(dtype)

    def host_primal(values, b):
        values = np.asarray(values)
        if values.ndim > 1 and values.shape[:-1] != (1,) * (values.ndim - 1):
            raise NotImplementedError("a batch of matrices")
        return solved(factored(values.reshape(-1)), b, False)

    def host_fwd(values, b):
        made = factored(values)
        k = next(counter)
        kept[k] = made
        return solved(made, b, False), np.int64(k)

    def host_bwd(k, ct):
        made = kept.pop(int(np.asarray(k).reshape(-1)[0]))
        return solved(made, ct, True)

    out = jax.ShapeDtypeStruct((n,), dtype)
    key = jax.ShapeDtypeStruct((), np.int64)

    @jax.custom_vjp
    def f(values, b):
        return jax.pure_callback(host_primal, out, values, b, vmap_method="expand_dims")

    def fwd(values, b):
        x, k = jax.pure_callback(host_fwd, (out, key), values, b)
        return x, (k, x)

    def bwd(res, ct):
        k, x = res
        lam = jax.pure_callback(host_bwd, out, k, ct, vmap_method="expand_dims")
        return -lam[..., pattern.rows] * x[pattern.cols], lam

    f.defvjp(fwd, bwd)
    return f


def scipy_by_hand(pattern, dtype):
    return by_hand(
        pattern,
        dtype,
        lambda m: scipy.sparse.linalg.splu(m, permc_spec="MMD_AT_PLUS_A"),
        lambda lu, r, t: lu.solve(r, trans="T" if t else "N"),
        "SciPy",
    )


def cholespy_by_hand(pattern, dtype):
    from cholespy import CholeskySolverD, MatrixType

    def factor(m):
        coo = m.tocoo()
        return CholeskySolverD(m.shape[0], coo.row, coo.col, coo.data, MatrixType.COO)

    def solve(chol, r, t):
        r = np.require(r, np.float64, ("C", "W"))  # (cholespy takes writable C arrays only)
        x = np.empty_like(r)
        chol.solve(r, x)
        return x

    return by_hand(pattern, dtype, factor, solve, "cholespy")


def sparsax_cholmod_by_hand(pattern, dtype):
    """sparsax's CHOLMOD from NumPy (`solve_np`; `logdet_np` factors and keeps the factors,
    found again by the values): the factorisation deferax's `dx.Cholmod` makes, by hand."""
    import sparsax

    def factor(m):
        upper = scipy.sparse.triu(m).tocoo()
        rows, cols, values = (
            np.ascontiguousarray(a) for a in (upper.row.astype(np.int32), upper.col.astype(np.int32), upper.data)
        )
        sparsax._cpp.logdet_np(rows, cols, values, m.shape[0])
        return rows, cols, values

    def solve(made, r, t):
        return sparsax._cpp.solve_np(*made, np.ascontiguousarray(r, np.float64), 0)

    return by_hand(pattern, dtype, factor, solve, "sparsax CHOLMOD")


def pardiso_by_hand(pattern, dtype, spd):
    """MKL's PARDISO through pypardiso (real matrices only), as a careful user writes it: one
    solver object, the pattern analysed with the first matrix (phase 12) and each later one
    factored alone (phase 22, pypardiso's `_call_pardiso`, which its docstring points to), its
    Cholesky on the SPD matrix (the upper triangle, by rows), its LU on the others (the CSC
    matrix, which pypardiso reads as the transpose's CSR: the transposes swapped)."""
    from pypardiso import PyPardisoSolver

    solver = PyPardisoSolver(mtype=2 if spd else 11)
    analysed = []

    def factor(m):
        a = scipy.sparse.triu(m, format="csr") if spd else m
        a.sort_indices()
        solver._check_A(a)
        solver.set_phase(22 if analysed else 12)
        solver._call_pardiso(a, np.zeros((a.shape[0], 1)))
        analysed.append(True)
        return a

    def solve(a, r, t):
        solver.set_iparm(12, 0 if spd or t else 1)
        solver.set_phase(33)
        return solver._call_pardiso(a, np.asfortranarray(r, np.float64))

    return by_hand(pattern, dtype, factor, solve, "PARDISO")


# ----------------------------------------------------------------------------- the library peers


def real_embedding(pattern: dx.SparsePattern, lu_solve):
    """A complex solve through a real one: `[[Re A, -Im A], [Im A, Re A]] [Re x; Im x] = [Re b; Im b]`."""
    n = pattern.n
    rows = np.concatenate([pattern.rows, pattern.rows, pattern.rows + n, pattern.rows + n])
    cols = np.concatenate([pattern.cols, pattern.cols + n, pattern.cols, pattern.cols + n])

    def solve(values, b):
        re, im = jnp.real(values), jnp.imag(values)
        big = jnp.concatenate([re, -im, im, re])
        y = lu_solve(jnp.asarray(rows, jnp.int32), jnp.asarray(cols, jnp.int32), big, jnp.concatenate([b.real, b.imag]))
        return y[:n] + 1j * y[n:]

    return solve


def peers(pattern: dx.SparsePattern, spd: bool, complex_: bool) -> dict:
    """`name -> solve(values, b)` for every side installed."""
    rows, cols = jnp.asarray(pattern.rows), jnp.asarray(pattern.cols)
    dtype = np.complex128 if complex_ else np.float64
    # (the defaults: a small real system runs inside the program)
    out = {"deferax": lambda v, b: dx.sparse_solve(v, pattern, b)}
    if _program.refusal(pattern, np.dtype(dtype), by_cost=True) is None:
        # (where the default chooses the program, the host's time beside it)
        out["deferax on the host"] = lambda v, b: dx.sparse_solve(v, pattern, b, where="host")
    if installed("sparsax"):
        import sparsax

        if spd:
            out["sparsax (CHOLMOD)"] = lambda v, b: sparsax.solve(rows, cols, v, b)
        elif complex_:
            out["sparsax (KLU, 2n real)"] = real_embedding(pattern, sparsax.lu_solve)
        else:
            out["sparsax (KLU)"] = lambda v, b: sparsax.lu_solve(rows, cols, v, b)
    # the entries at one position summed (klujax takes the last of them), in row-major order (CSR, for spsolve)
    keys, where = np.unique(pattern.rows.astype(np.int64) * pattern.n + pattern.cols, return_inverse=True)
    if installed("splineax"):
        out.update(splineax_sides(pattern, keys, where, complex_))
    if installed("klujax"):
        import klujax

        if keys.size == pattern.nnz:
            out["klujax"] = lambda v, b: klujax.solve(rows, cols, v, b)
        else:
            summed = jnp.asarray(keys // pattern.n), jnp.asarray(keys % pattern.n), jnp.asarray(where.reshape(-1))
            out["klujax"] = lambda v, b: klujax.solve(
                summed[0], summed[1], jax.ops.segment_sum(v, summed[2], keys.size), b
            )
    indices, indptr = (
        jnp.asarray(keys % pattern.n),
        jnp.asarray(np.r_[0, np.cumsum(np.bincount(keys // pattern.n, minlength=pattern.n))]),
    )
    where = jnp.asarray(where.reshape(-1))
    out["JAX spsolve"] = lambda v, b: spsolve(jax.ops.segment_sum(v, where, keys.size), indices, indptr, b)
    out["SciPy by hand"] = scipy_by_hand(pattern, dtype)
    if spd and installed("cholespy"):
        out["cholespy by hand"] = cholespy_by_hand(pattern, dtype)
    if spd and installed("sparsax"):
        out["sparsax CHOLMOD by hand"] = sparsax_cholmod_by_hand(pattern, dtype)
    if not complex_ and installed("pypardiso"):
        out["PARDISO by hand"] = pardiso_by_hand(pattern, dtype, spd)
    return out


def splineax_sides(pattern: dx.SparsePattern, keys: np.ndarray, where: np.ndarray, complex_: bool) -> dict:
    """splineax (Lineax sparse operators): `splineax.linear_solve` of a `BCOOLinearOperator`
    made in the loss from the entries (summed at each position, in row-major order, as its
    solvers sort them otherwise), with its KLU (splineax-klujax) and, where pardiso-mkl-jax is
    installed and the matrix is real, its PARDISO. Differentiated as Lineax differentiates a
    linear solve (every order)."""
    import splineax
    from jax.experimental import sparse as jsparse

    indices = jnp.stack([jnp.asarray(keys // pattern.n), jnp.asarray(keys % pattern.n)], axis=1)
    segments = jnp.asarray(where.reshape(-1))

    def side(solver):
        def solve(v, b):
            matrix = jsparse.BCOO((jax.ops.segment_sum(v, segments, keys.size), indices), shape=(pattern.n, pattern.n))
            return splineax.linear_solve(splineax.BCOOLinearOperator(matrix), b, solver)[0].value

        return solve

    out = {"splineax (KLU)": side(splineax.KLU())}
    if installed("pardiso_mkl_jax") and not complex_:
        out["splineax (PARDISO)"] = side(splineax.Pardiso())
    return out


# ----------------------------------------------------------------------------- cases


def loss_fns(solve, w):
    return {
        "linear": lambda v, b: jnp.real(jnp.sum(w * solve(v, b))),
        "overlap": lambda v, b: jnp.abs(jnp.sum(w * solve(v, b))) ** 2,
        "power": lambda v, b: jnp.sum(jnp.abs(solve(v, b)) ** 2),
    }


def off(got, want) -> float:
    return max(
        float(jnp.max(jnp.abs(g - r)) / max(float(jnp.max(jnp.abs(r))), 1e-300))
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )


def steps_of(fn, *args) -> str:
    COUNTS.clear()
    with dx.record() as timeline:
        jax.block_until_ready(fn(*args))
    jobs = sum(timeline.counts().values())
    steps = dict(sorted(timeline.counts(steps=True).items()))
    hand = dict(sorted(COUNTS.items()))
    return f"deferax {steps} in {jobs} job(s)" if steps else (f"{hand}" if hand else "inside XLA")


def race(title: str, sides: dict, args: tuple, repeats: int, warmup: int, summary: list) -> None:
    """Time `sides` (each a jitted function of `args`), check each against deferax's, print."""
    want = jax.block_until_ready(sides["deferax"](*args))
    for name, fn in sides.items():
        got = jax.block_until_ready(fn(*args))
        print(f"  {name:24s}: {off(got, want):.1e} off deferax; {steps_of(fn, *args)}")
    # every call a new matrix, as in an optimisation loop (sparsax keeps the factorisation of
    # the last values it saw, and deferax's store would find a kept one): the first argument
    # scaled, a new array made for each call before the timing
    first, rest = args[0], args[1:]
    variants = iter([first * (1.0 + 1e-6 * next(CALLS)) for _ in range((warmup + repeats) * len(sides))])
    times = interleaved({n: (lambda f=f: f(next(variants), *rest)) for n, f in sides.items()}, repeats, warmup=warmup)
    for name, ts in times.items():
        print(f"  {name:24s}: {describe(ts)}")
    meds = {name: median(ts) for name, ts in times.items()}
    peers_ = {n: t for n, t in meds.items() if not n.startswith("deferax") and "by hand" not in n}
    hand = {n: t for n, t in meds.items() if "by hand" in n}
    best = min(peers_, key=peers_.__getitem__) if peers_ else None
    line = f"{title}: deferax {1e3 * meds['deferax']:.1f} ms"
    # (the ratio of the fastest calls beside that of the medians: on this shared machine one call's
    # time can double, and the minimum is the work itself, the least disturbed)
    mins = {name: min(ts) for name, ts in times.items()}
    if best is not None:
        line += f", fastest peer {best} {1e3 * peers_[best]:.1f} ms, ratio {meds['deferax'] / peers_[best]:.2f}"
        line += f" (of the fastest calls {mins['deferax'] / mins[best]:.2f})"
    if "deferax on the host" in meds:
        line += f" (on the host {1e3 * meds['deferax on the host']:.1f} ms)"
    if hand:
        h = min(hand, key=hand.__getitem__)
        line += f"; {h} {1e3 * hand[h]:.1f} ms, ratio {meds['deferax'] / hand[h]:.2f}"
        line += f" (of the fastest calls {mins['deferax'] / mins[h]:.2f})"
    print("RESULT bench_peers " + line)
    summary.append(line)


def matrices(small: bool):
    """`(case, make, theta, pattern, spd, complex)`: the matrix's entries are `make(theta)`."""
    m = 12 if small else 150
    nelx, nely = (12, 4) if small else (180, 60)
    beam = bench_backends.load_example("topology_mbb").MBB(nelx, nely)
    densities = jnp.asarray(np.random.default_rng(0).uniform(0.01, 1.0, nelx * nely))
    yield f"MBB {nelx} x {nely} stiffness (SPD)", beam.values, densities, beam.pattern, True, False
    for case, (values, pattern), complex_ in (
        (f"convection-diffusion n={m * m} (real)", bench_backends.convection_diffusion(m), False),
        (f"Helmholtz n={m * m} (complex)", bench_backends.helmholtz(m), True),
    ):
        yield case, (lambda v: v), jnp.asarray(values), pattern, False, complex_


def value_and_grad(name: str, loss):
    """The jitted value and gradient of `loss(theta, b)` with respect to both: deferax's
    `filter_value_and_grad` for deferax (of the pair, as Equinox differentiates its first
    argument), JAX's for the peers."""
    if name.startswith("deferax"):
        step = jax.jit(dx.filter_value_and_grad(lambda pair: loss(*pair)))
        return lambda theta, b: step((theta, b))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def main():
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument(
        "--only", choices=("matrices", "many"), help="the three matrices alone, or jacrev, vmap and the small system"
    )
    args = p.parse_args()
    repeats = args.repeats or (2 if args.small else 7)
    warmup = 2 if args.small else 12  # (past deferax's measurement of the solvers: up to 12 calls)
    print(f"bench_peers: {machine()}")
    print(
        f"  installed: sparsax {installed('sparsax')}, klujax {installed('klujax')}, cholespy {installed('cholespy')}, "
        f"pypardiso {installed('pypardiso')}"
    )
    summary: list[str] = []
    rng = np.random.default_rng(1)
    for case, make, theta, pattern, spd, complex_ in matrices(args.small) if args.only != "many" else ():
        dtype = np.complex128 if complex_ else np.float64
        b = jnp.asarray(rng.normal(size=pattern.n)).astype(dtype)
        w = jnp.asarray(rng.normal(size=pattern.n)).astype(dtype)
        solves = peers(pattern, spd, complex_)
        for loss_name in ("linear", "overlap", "power"):
            print(f"--- {case}, {loss_name}: {pattern!r}; {load()}")
            sides = {}
            for name, solve in solves.items():
                loss = loss_fns(lambda t, b, solve=solve, make=make: solve(make(t), b), w)[loss_name]
                sides[name] = value_and_grad(name, loss)
            race(f"{case}, {loss_name}", sides, (theta, b), repeats, warmup, summary)
    # many right-hand sides and a small system, on the real convection-diffusion operator
    many = (("jacrev", 6 if args.small else 60), ("vmap", 6 if args.small else 60), ("small", 5 if args.small else 30))
    for what, m in many if args.only != "matrices" else ():
        values, pattern = bench_backends.convection_diffusion(m)
        values = jnp.asarray(values)
        b = jnp.asarray(rng.normal(size=pattern.n))
        solves = peers(pattern, False, False)
        if what != "small":
            del solves["JAX spsolve"]  # (it has no batching rule: jacrev and vmap raise NotImplementedError)
        k = min(200, pattern.n)
        print(f"--- {what}, n={pattern.n}: {load()}")
        if what == "jacrev":
            idx = jnp.asarray(np.linspace(0, pattern.n - 1, k).astype(int))
            sides = {n: jax.jit(jax.jacrev(lambda v, s=s, b=b, idx=idx: s(v, b)[idx])) for n, s in solves.items()}
            call: tuple = (values,)
        elif what == "vmap":
            bs = jnp.asarray(rng.normal(size=(k, pattern.n)))
            sides = {n: jax.jit(jax.vmap(s, in_axes=(None, 0))) for n, s in solves.items()}
            call = (values, bs)
        else:
            w = jnp.asarray(rng.normal(size=pattern.n))
            sides = {n: value_and_grad(n, loss_fns(s, w)["power"]) for n, s in solves.items()}
            call = (values, b)
            dense = loss_fns(lambda v, b, p=pattern: jnp.linalg.solve(p.todense(v), b), w)["power"]
            want = jax.value_and_grad(dense, argnums=(0, 1))(values, b)
            print(f"  deferax against a dense solve: {off(sides['deferax'](values, b), want):.1e} off")
        race(f"{what} n={pattern.n}", sides, call, repeats, warmup, summary)
    report(summary)


def report(summary: list[str]) -> None:
    """The load at the end, and `race`'s result lines again."""
    print(f"at the end: {load()}")
    print("summary (deferax against the fastest JAX peer, and against the fastest by hand):")
    for line in summary:
        print("  " + line)


if __name__ == "__main__":
    main()
