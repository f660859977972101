"""Shared test helpers: tolerant tree comparison, finite differences, execution counters."""

import collections
import importlib.util
import os
import pathlib
import re
import threading
import uuid

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

import deferax as dx
from deferax._sparse import _factorisations

# In float32 (the suite with `DEFERAX_TESTS_X64=0`, as on an accelerator), a comparison is made
# to float32's accuracy: tolerances are at least these (see `float32_tolerances` in conftest.py).
FLOAT32_RTOL, FLOAT32_ATOL = 1e-3, 1e-4
# ... and central differences step by this much (float32's rounding of the loss, about 1e-7 of
# it, divided by the step, stays under the tolerance; the truncation, the step squared, too).
FLOAT32_EPS = 4e-3


def float32() -> bool:
    """Whether the suite runs in float32 (x64 off)."""
    return not jax.config.jax_enable_x64


# The default float and complex dtypes (what `jnp.array(1.0)` and `jnp.array(1j)` make):
# float64 and complex128 with x64 on, float32 and complex64 in the float32 suite. A test about
# "the default float" uses these, and checks the same thing in both suites. (Read at import: in a
# process the tests spawn, where conftest.py did not turn x64 on, they are the float32 ones.)
FLOAT = jnp.dtype(jnp.result_type(float))
FLOAT_NAME = FLOAT.name
COMPLEX = jnp.dtype(jnp.result_type(complex))
COMPLEX_NAME = COMPLEX.name


def tolerances(rtol: float, atol: float) -> tuple[float, float]:
    """`(rtol, atol)`, at least float32's in the float32 suite."""
    return (max(rtol, FLOAT32_RTOL), max(atol, FLOAT32_ATOL)) if float32() else (rtol, atol)


def tree_allclose(a, b, *, rtol=1e-10, atol=1e-10) -> bool:
    rtol, atol = tolerances(rtol, atol)
    return eqx.tree_equal(a, b, rtol=rtol, atol=atol) is True


def assert_tree_allclose(a, b, *, rtol=1e-10, atol=1e-10):
    assert jtu.tree_structure(a) == jtu.tree_structure(b), (jtu.tree_structure(a), jtu.tree_structure(b))
    for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def hlo_ops(fn, *args) -> collections.Counter:
    """How many of each operation `jax.jit(fn)` lowers to for `args` (StableHLO and function
    calls, and each custom call's target): equal for programs that compile to the same one,
    whatever their values are named."""
    text = jax.jit(fn).lower(*args).as_text()
    ops = re.findall(r'(?:= |^\s*)"?((?:stablehlo|func|chlo|mhlo|sdy)\.[a-z_]+)', text, re.MULTILINE)
    targets = re.findall(r"stablehlo\.custom_call @(\w+)", text)
    return collections.Counter(ops) + collections.Counter(f"custom_call @{t}" for t in targets)


def finite_difference_grad(loss, x, eps=None):
    """Central differences of a real scalar `loss` with respect to every float leaf of `x`
    (a step of 1e-6, or `FLOAT32_EPS` in the float32 suite)."""
    eps = eps if eps is not None else FLOAT32_EPS if float32() else 1e-6
    leaves, treedef = jtu.tree_flatten(x)
    grads = []
    for i, leaf in enumerate(leaves):
        leaf = np.asarray(leaf, dtype=np.float64)
        g = np.zeros_like(leaf)
        for idx in np.ndindex(leaf.shape):
            plus, minus = leaf.copy(), leaf.copy()
            plus[idx] += eps
            minus[idx] -= eps
            lp = [*leaves[:i], jnp.asarray(plus), *leaves[i + 1 :]]
            lm = [*leaves[:i], jnp.asarray(minus), *leaves[i + 1 :]]
            g[idx] = (float(loss(jtu.tree_unflatten(treedef, lp))) - float(loss(jtu.tree_unflatten(treedef, lm)))) / (
                2 * eps
            )
        grads.append(jnp.asarray(g))
    return jtu.tree_unflatten(treedef, grads)


class Counter:
    """Counts how often implementations *execute*, through `jax.debug.callback`.

    A callback inside a traced function fires each time the compiled program runs the
    operation, not each time it is traced. The counts are read, and reset, once every
    program started has run its callbacks (`jax.effects_barrier`): on an accelerator a
    call returns before its program has run.
    """

    def __init__(self):
        self.counts = collections.Counter()

    def tick(self, key):
        def bump():
            self.counts[key] += 1

        jax.debug.callback(bump, ordered=False)

    def __getitem__(self, key):
        jax.effects_barrier()
        return self.counts[key]

    def reset(self):
        jax.effects_barrier()
        self.counts.clear()

    def as_dict(self):
        jax.effects_barrier()
        return {k: self.counts[k] for k in ("fwd", "bwd", "fused")}


def reference_impls(ref, counter=None):
    """`fwd`, `bwd`, `fused`, `jvp` and `jvp_batch` for a JAX-traceable reference function
    `ref`, by name.

    The derivatives use `jax.vjp` and `jax.jvp` of `ref`, so the tests check the machinery
    of `ExpensiveFn` and the schedules against plain JAX autodiff of the same function.
    """

    def tick(key):
        if counter is not None:
            counter.tick(key)

    def fwd(x):
        tick("fwd")
        return ref(x)

    def bwd(x, y, ct):
        tick("bwd")
        return jax.vjp(ref, x)[1](ct)[0]

    def fused(x, ct):
        tick("fused")
        y, vjp = jax.vjp(ref, x)
        return y, vjp(ct)[0]

    def jvp(x, t):
        tick("jvp")
        return jax.jvp(ref, (x,), (t,))

    def jvp_batch(x, ts):
        tick("jvp_batch")
        return ref(x), jax.vmap(lambda t: jax.jvp(ref, (x,), (t,))[1])(ts)

    return {"fwd": fwd, "bwd": bwd, "fused": fused, "jvp": jvp, "jvp_batch": jvp_batch}


def make(ref, given, counter=None, **kwargs):
    """An `ExpensiveFn` for `ref` with only the implementations named in `given`."""
    impls = reference_impls(ref, counter)
    chosen = {k: (impls[k] if k in given else None) for k in impls}
    if "fwd" not in given and "out" not in kwargs:
        kwargs["out"] = lambda x: jax.eval_shape(ref, x)
    return dx.ExpensiveFn(**chosen, **kwargs)


def plain_fdfd_objective(problem):
    """The FDFD example's objective `x -> |<m, E(x)>|**2` in plain JAX, independent of
    deferax: the sparse SciPy solve replaced by a dense `jnp.linalg.solve` of the same
    operator `laplacian + k0**2 diag(eps(x))`, differentiated by JAX."""
    laplacian = jnp.asarray(problem.laplacian.toarray()).astype(jnp.complex128)
    background = jnp.asarray(problem.eps_background)
    source, mode = jnp.asarray(problem.source.ravel()), jnp.asarray(problem.mode.ravel())

    def objective(x):
        eps = background.at[problem.design].set(x.astype(jnp.complex128))
        e = jnp.linalg.solve(laplacian + jnp.diag(problem.k0**2 * eps.ravel()), source)
        return jnp.abs(jnp.vdot(mode, e)) ** 2

    return objective


def plain_fdfd_design(problem, steps, rate=0.4):
    """The example's `design` loop (gradient ascent from x = 2, normalised steps, clipped to
    [1, 4]) on `plain_fdfd_objective`: the objective at each step."""
    value_and_grad = jax.jit(jax.value_and_grad(lambda x: -plain_fdfd_objective(problem)(x)))
    x = jnp.full(problem.design_shape, 2.0, dtype=jnp.float64)
    history = []
    for step in range(steps + 1):
        loss, grad = value_and_grad(x)
        history.append(-float(loss))
        if step < steps:
            x = jnp.clip(x - rate * grad / jnp.max(jnp.abs(grad)), 1.0, 4.0)
    return history


# ----------------------------------------------------------------------------- one fused call a step


def ref(x):
    return jnp.sin(x) * jnp.exp(0.3 * x)


W = jnp.array([1.0, -2.0, 0.5, 3.0])
P0 = jnp.array([0.3, -0.2, 0.8, 0.1])


def plain(p):
    """The same function as `make(ref, ...)`, in plain JAX: the independent reference."""
    return ref(p)


def check_one_fused(loss, reference, p, counter):
    """dx on `loss` equals Equinox on `reference` (the same program in plain JAX), eagerly
    and under `eqx.filter_jit` (fresh wrappers), with one `fused` and no `fwd`/`bwd` a call."""
    for use_jit in (False, True):
        got_fn = dx.filter_value_and_grad(loss)
        want_fn = eqx.filter_value_and_grad(reference)
        if use_jit:
            got_fn, want_fn = eqx.filter_jit(got_fn), eqx.filter_jit(want_fn)
        jax.effects_barrier()
        counter.reset()
        got = jax.block_until_ready(got_fn(p))
        jax.effects_barrier()
        assert counter.as_dict() == {"fwd": 0, "bwd": 0, "fused": 1}, use_jit
        assert_tree_allclose(got, want_fn(p))


def load_example(name: str, module_name: str | None = None):
    """`examples/<name>.py`, imported as a module named `module_name` (default `name`)."""
    path = pathlib.Path(__file__).parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(module_name or name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Runs counted across processes (process pools, Dask workers): a file a run.


def record(directory, what):
    """Leave a file per run: `runs/<what>-<pid>-<unique>`."""
    os.makedirs(os.path.join(directory, "runs"), exist_ok=True)
    pathlib.Path(directory, "runs", f"{what}-{os.getpid()}-{uuid.uuid4().hex}").touch()


def runs(directory):
    """{what: number of runs}, and the set of process ids that ran them."""
    counts, pids = {}, set()
    for path in pathlib.Path(directory, "runs").iterdir():
        what, pid, _ = path.name.rsplit("-", 2)
        counts[what] = counts.get(what, 0) + 1
        pids.add(int(pid))
    return counts, pids


def host_sine(calls, **kwargs):
    """`sin` as host code with its derivatives (`bwd` reads `y`: it cannot be deferred)."""

    def fwd(x):
        calls.append("fwd")
        return np.sin(x)

    def bwd(x, y, ct):
        calls.append("bwd")
        return ct * np.sqrt(1 - y**2)  # cos(x), for x in (-pi/2, pi/2)

    def jvp_batch(x, ts):
        calls.append("jvp_batch")
        return np.sin(x), ts * np.cos(x)

    def jvp(x, t):
        calls.append("jvp")
        return np.sin(x), t * np.cos(x)

    forward = {"jvp": jvp} if kwargs.pop("jvp_only", False) else {"jvp_batch": jvp_batch}
    return dx.host(fwd, bwd=bwd, **forward, out=lambda s: s, name="sine", **kwargs)


class Tally:
    """Thread-safe count of factorisations and of the solver's solve calls, and the most bytes
    the store held at any factorisation."""

    def __init__(self):
        self.factor = 0
        self.solves = 0
        self.most = 0
        self.lock = threading.Lock()


class CountingLU(dx.AbstractSparseSolver):
    """SciPy's `splu`, counting its factorisations (reading the store's bytes at each) and its
    solve calls (one for all the right-hand sides it is given at once)."""

    tally: Tally = eqx.field(static=True)

    def factor(self, matrix):
        held = _factorisations.FACTORISATIONS.nbytes
        with self.tally.lock:
            self.tally.factor += 1
            self.tally.most = max(self.tally.most, held)
        return dx.SuperLU().factor(matrix)

    def solve(self, factorisation, rhs, transpose):
        with self.tally.lock:
            self.tally.solves += 1
        return dx.SuperLU().solve(factorisation, rhs, transpose)


class RecordingLU(dx.AbstractSparseSolver):
    """SciPy's `splu`, each factorisation leaving a file in `directory` (`record`: from any
    process, a pool's worker or a Dask worker)."""

    directory: str = eqx.field(static=True)

    def factor(self, matrix):
        record(self.directory, "factor")
        return dx.SuperLU().factor(matrix)

    def solve(self, factorisation, rhs, transpose):
        return dx.SuperLU().solve(factorisation, rhs, transpose)


def run_recorded(fn, *args, jit=False):
    """`(fn(*args), the record of its host jobs)`, with no factorisation kept from before
    (`jit`: compiled, and run once untimed first, so that the record is of a compiled call)."""
    if jit:
        fn = eqx.filter_jit(fn)
        jax.block_until_ready(fn(*args))  # compile
    _factorisations.FACTORISATIONS.clear()
    with dx.record() as timeline:
        got = jax.block_until_ready(fn(*args))
    return got, timeline
