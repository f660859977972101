"""Forward and adjoint together without a hand-written `fused`: from `fwd` and a `bwd` that
does not read `y`, or from `fwd`, `adjoint` and `combine`; several JAX-native deferred
sites at once under `jit`. Overlap is shown with a barrier that every forward and adjoint
must reach before any can go on: the call finishes only if they all run at the same time."""

import functools as ft
import re
import threading
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx

from .helpers import Counter, assert_tree_allclose

A = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4)))
W = jnp.array([1.0, -2.0, 0.5, 3.0])
X = jnp.array([0.3, -0.2, 0.8, 0.1])


def plain(x):
    """What the expensive function stands for: nonlinear."""
    return jnp.tanh(A @ x)


def meeting(barrier, counter, key):
    """A `jax.debug.callback` that counts a run and waits at `barrier` (if any)."""

    def hit():
        if barrier is not None:
            barrier.wait()

    counter.tick(key)
    jax.debug.callback(hit, ordered=False)


def sim(barrier=None, counter=None, kind="bwd", name="sim"):
    counter = counter or Counter()

    def fwd(x):
        meeting(barrier, counter, "fwd")
        return plain(x)

    def bwd(x, y, ct):  # reads only `x` and the cotangent
        meeting(barrier, counter, "bwd")
        return A.T @ (ct * (1 - jnp.tanh(A @ x) ** 2))

    def adjoint(x, ct):  # the part that needs no `y` ...
        meeting(barrier, counter, "bwd")
        return ct

    def combine(x, y, partial):  # ... and the cheap step that does
        return A.T @ (partial * (1 - y**2))

    if kind == "bwd":
        return dx.ExpensiveFn(fwd=fwd, bwd=bwd, name=name)
    return dx.ExpensiveFn(fwd=fwd, adjoint=adjoint, combine=combine, name=name)


def linear(f):
    return lambda x: jnp.sum(W * f(x)) + 0.1 * jnp.sum(x**2)


@pytest.mark.parametrize("kind", ["bwd", "adjoint"])
@pytest.mark.parametrize("where", ["eager", "jit", "vmap"])
def test_forward_and_adjoint_overlap_without_fused(kind, where):
    counter = Counter()
    barrier = threading.Barrier(2, timeout=20)
    f = sim(barrier, counter, kind)
    loss, reference = linear(f), linear(plain)
    if where == "vmap":
        loss = (lambda g: lambda x: jnp.sum(jax.vmap(g)(jnp.stack([x, 2 * x, -x]))))(linear(f))
        reference = (lambda g: lambda x: jnp.sum(jax.vmap(g)(jnp.stack([x, 2 * x, -x]))))(linear(plain))
    plan = dx.explain(loss, X)
    assert plan.sites[0].schedule == "deferred" and plan.sites[0].reason is None
    assert plan.stages[0][0].startswith(f"sim: fwd + {kind}")
    step = dx.filter_value_and_grad(loss)
    step = eqx.filter_jit(step) if where == "jit" else step
    got = jax.block_until_ready(step(X))  # would raise BrokenBarrierError if run one after the other
    jax.effects_barrier()
    assert counter.counts == {"fwd": 1, "bwd": 1}  # each once (once per batch under vmap)
    assert_tree_allclose(got, jax.value_and_grad(reference)(X))


def test_bwd_that_reads_y_stays_standard():
    f = dx.ExpensiveFn(fwd=plain, bwd=lambda x, y, ct: A.T @ (ct * (1 - y**2)), name="reads_y")
    (site,) = dx.explain(linear(f), X).sites
    assert site.schedule == "standard"
    assert (
        site.reason == "no `fused` implementation, and its `bwd` reads `y` (give `adjoint` and `combine`, or `fused`)"
    )
    assert_tree_allclose(dx.filter_value_and_grad(linear(f))(X), jax.value_and_grad(linear(plain))(X))
    # a `bwd` that cannot be traced (NumPy on its arguments) counts as reading `y`
    opaque = dx.ExpensiveFn(fwd=plain, bwd=lambda x, y, ct: jnp.asarray(np.asarray(ct)), name="opaque")
    assert (
        dx.explain(linear(opaque), X).sites[0].reason.startswith("no `fused` implementation, and its `bwd` reads `y`")
    )
    # one that reads `y` only through a host callback's arguments reads it too
    callback = dx.ExpensiveFn(
        fwd=plain, bwd=lambda x, y, ct: jax.pure_callback(lambda c, y: np.asarray(c), ct, ct, y), name="cb"
    )
    assert dx.explain(linear(callback), X).sites[0].schedule == "standard"


def test_combine_on_fuse_and_expensive_fn():
    adjoint = lambda x, ct: ct  # noqa: E731
    combine = lambda x, y, partial: A.T @ (partial * (1 - y**2))  # noqa: E731
    fused = dx.fuse(plain, adjoint, combine)
    f = dx.ExpensiveFn(fwd=plain, fused=fused, name="fused")
    g = dx.ExpensiveFn(fwd=plain, adjoint=adjoint, combine=combine, name="split")
    for h in (f, g):
        for loss, reference in (
            (linear(h), linear(plain)),
            (lambda x, h=h: jnp.sum(h(x) ** 2), lambda x: jnp.sum(plain(x) ** 2)),
        ):
            assert_tree_allclose(dx.filter_value_and_grad(loss)(X), jax.value_and_grad(reference)(X))
            assert_tree_allclose(jax.value_and_grad(loss)(X), jax.value_and_grad(reference)(X))
    # the deferred-basis schedule (a scalar of the output) with the split and with `fuse`
    scalar = lambda h: lambda x: jnp.log(1.0 + jnp.dot(W, h(x)) ** 2)  # noqa: E731
    for h in (f, g):
        assert dx.explain(scalar(h), X).sites[0].schedule == "deferred-basis"
        assert_tree_allclose(dx.filter_value_and_grad(scalar(h))(X), jax.value_and_grad(scalar(plain))(X))


@pytest.mark.parametrize("n_sites", [2, 4])
def test_several_jax_native_sites_overlap_under_jit(n_sites):
    barrier = threading.Barrier(2 * n_sites, timeout=20)
    counter = Counter()
    fs = [sim(barrier, counter, "bwd" if i % 2 else "adjoint", name=f"sim{i}") for i in range(n_sites)]

    def loss(x):
        return sum(jnp.sum(W * f(x * (i + 1))) for i, f in enumerate(fs))

    def reference(x):
        return sum(jnp.sum(W * plain(x * (i + 1))) for i in range(n_sites))

    for step in (dx.filter_value_and_grad(loss), eqx.filter_jit(dx.filter_value_and_grad(loss))):
        counter.reset()
        got = jax.block_until_ready(step(X))
        jax.effects_barrier()
        assert counter.counts == {"fwd": n_sites, "bwd": n_sites}
        assert_tree_allclose(got, jax.value_and_grad(reference)(X))


SCALE = 1.0  # a global that the implementations below read; rebound by the test
SOURCE = np.ones(4, X.dtype)  # a NumPy array they read; changed in place by the test


def _reads_globals(x):
    return SCALE * jnp.asarray(SOURCE) * jnp.sin(x)


def _reads_globals_adjoint(x, ct):
    return SCALE * jnp.asarray(SOURCE) * ct * jnp.cos(x)


def _jitted_afresh(f):
    """`jax.jit` of a new function each time (`jax.jit` keeps its traces on the function object)."""
    return jax.jit(lambda x: f(x))


@pytest.mark.parametrize("kind", ["bwd", "adjoint"])
def test_halves_made_from_fwd_and_bwd_read_what_they_read_afresh(kind):
    """The `fused` made from `fwd` + `bwd` calls them as the standard schedule would: what
    they read (a global rebound, a NumPy array changed in place) is read on every eager call,
    and at trace time under `jit`, as in the same program written in plain JAX."""
    global SCALE
    if kind == "bwd":
        f = dx.ExpensiveFn(fwd=_reads_globals, bwd=lambda x, y, ct: _reads_globals_adjoint(x, ct), name="sim")
    else:
        f = dx.ExpensiveFn(fwd=_reads_globals, adjoint=_reads_globals_adjoint, name="sim")
    loss, reference = linear(f), linear(_reads_globals)
    assert dx.explain(loss, X).stages[0][0] == f"sim: fwd + {kind}"
    step = dx.filter_value_and_grad(loss)
    try:
        for scale, fill in ((1.0, 2.0), (-3.0, 2.0), (-3.0, 0.5)):
            SCALE, SOURCE[:] = scale, fill
            jitted, jitted_reference = _jitted_afresh(step), _jitted_afresh(jax.value_and_grad(reference))
            assert_tree_allclose(step(X), jax.value_and_grad(reference)(X), rtol=1e-6)
            assert_tree_allclose(jitted(X), jitted_reference(X), rtol=1e-6)
            SCALE, SOURCE[:] = 10.0, 10.0  # after the trace: neither compiled program sees it
            assert_tree_allclose(jitted(X), jitted_reference(X), rtol=1e-6)
            assert_tree_allclose(
                jitted(X)[1], jax.grad(linear(ft.partial(lambda k, x: k * jnp.sin(x), scale * fill)))(X), rtol=1e-6
            )
    finally:
        SCALE, SOURCE[:] = 1.0, 1.0


def test_two_sites_of_halves_under_jit_are_compiled_and_read_at_trace_time():
    """Two sites made from `fwd` + `adjoint` under `jit` leave the program through one
    callback: their halves are what was traced with the program (compiled once: the Python
    of `fwd` does not run again on later calls), reading a global at trace time, as plain
    JAX does."""
    global SCALE
    runs = Counter()

    def fwd(x):
        runs.counts["python fwd"] += 1  # (once per trace, not per run, when compiled)
        return _reads_globals(x)

    fs = [dx.ExpensiveFn(fwd=fwd, adjoint=_reads_globals_adjoint, name=f"sim{i}") for i in range(2)]
    loss = lambda x: jnp.sum(W * fs[0](x)) + jnp.sum(W * fs[1](2.0 * x))  # noqa: E731
    reference = lambda x: jnp.sum(W * _reads_globals(x)) + jnp.sum(W * _reads_globals(2.0 * x))  # noqa: E731
    assert dx.explain(loss, X).stages == (("sim0: fwd + adjoint", "sim1: fwd + adjoint"),)
    try:
        for scale in (1.0, -2.0):
            SCALE = scale
            step, step_reference = (
                _jitted_afresh(dx.filter_value_and_grad(loss)),
                _jitted_afresh(jax.value_and_grad(reference)),
            )
            assert_tree_allclose(step(X), step_reference(X), rtol=1e-6)
            runs.reset()
            SCALE = 10.0  # after the trace: neither compiled program sees it
            for _ in range(2):
                assert_tree_allclose(step(X), step_reference(X), rtol=1e-6)
            assert runs.counts["python fwd"] == 0
    finally:
        SCALE = 1.0


def test_two_sites_of_halves_under_jit_with_traced_values():
    """Two sites made from `fwd` + `adjoint` under `jit`: one whose implementation closes
    over a value of the jitted function (it cannot run from one callback for both: each
    leaves through its own), and under `vmap` inside `jit`; against plain JAX."""

    def step(s, x):
        scaled = dx.ExpensiveFn(
            fwd=lambda x: s * jnp.sin(x), adjoint=lambda x, ct: s * ct * jnp.cos(x), name="closes_over_s"
        )
        other = dx.ExpensiveFn(fwd=plain, adjoint=lambda x, ct: A.T @ (ct * (1 - jnp.tanh(A @ x) ** 2)), name="other")
        return dx.filter_value_and_grad(lambda x: jnp.sum(W * scaled(x)) + jnp.sum(W * other(2.0 * x)))(x)

    def reference(s, x):
        return jax.value_and_grad(lambda x: jnp.sum(W * s * jnp.sin(x)) + jnp.sum(W * plain(2.0 * x)))(x)

    assert_tree_allclose(jax.jit(step)(3.0, X), reference(3.0, X))
    xs = jnp.stack([X, 2.0 * X, -X])
    assert_tree_allclose(jax.jit(jax.vmap(lambda x: step(3.0, x)))(xs), jax.vmap(lambda x: reference(3.0, x))(xs))
    assert_tree_allclose(
        jax.jit(jax.vmap(step))(jnp.array([1.0, -2.0]), jnp.stack([X, X])),
        jax.vmap(reference)(jnp.array([1.0, -2.0]), jnp.stack([X, X])),
    )


class _Scaled(eqx.Module):
    """An implementation that is a Module holding an array (its configuration)."""

    s: jax.Array

    def __call__(self, x):
        return self.s * jnp.sin(x)


class _ScaledAdjoint(eqx.Module):
    s: jax.Array

    def __call__(self, x, ct):
        return self.s * ct * jnp.cos(x)


class _ScaledBwd(eqx.Module):
    s: jax.Array

    def __call__(self, x, y, ct):
        return self.s * ct * jnp.cos(x)


@pytest.mark.parametrize("how", ["dx.fuse", "fwd + adjoint", "fwd + fused only"])
def test_halves_that_hold_arrays_traced_by_jit_or_vmap(how):
    """A Module half whose arrays are tracers (the model passed through `jit`, or batched by
    `vmap`): they enter the callback as operands, as in plain JAX."""

    def make(s):
        if how == "dx.fuse":
            return dx.ExpensiveFn(
                fwd=_Scaled(s), bwd=_ScaledBwd(s), fused=dx.fuse(_Scaled(s), _ScaledAdjoint(s)), name="sim"
            )
        if how == "fwd + adjoint":
            return dx.ExpensiveFn(fwd=_Scaled(s), adjoint=_ScaledAdjoint(s), name="sim")
        return dx.ExpensiveFn(
            fwd=_Scaled(s), fused=dx.fuse(_Scaled(s), _ScaledAdjoint(s)), name="sim"
        )  # bwd from fused

    s = jnp.array([1.0, -1.0, 2.0, 0.5])
    model = (X, make(s))
    loss = lambda m: jnp.sum(W * m[1](m[0]))  # noqa: E731
    expected = jax.value_and_grad(lambda x: jnp.sum(W * s * jnp.sin(x)))(X)
    for step in (dx.filter_value_and_grad(loss), eqx.filter_value_and_grad(loss)):
        value, grads = eqx.filter_jit(step)(model)
        assert_tree_allclose((value, grads[0]), expected, rtol=1e-6)
    # batched by vmap over the configuration: one implementation per element
    scales = jnp.stack([s, 2 * s, -s])
    batched = lambda x: jnp.sum(jax.vmap(lambda s_: W * make(s_)(x))(scales))  # noqa: E731
    expected = jax.value_and_grad(lambda x: jnp.sum(jax.vmap(lambda s_: W * s_ * jnp.sin(x))(scales)))(X)
    for step in (
        dx.filter_value_and_grad(batched),
        eqx.filter_value_and_grad(batched),
        eqx.filter_jit(dx.filter_value_and_grad(batched)),
    ):
        assert_tree_allclose(step(X), expected, rtol=1e-6)


def test_errors_adjoint_with_bwd_and_combine_without_adjoint():
    with pytest.raises(
        TypeError,
        match=re.escape("`ExpensiveFn(name='both')`: give `adjoint(x, ct_y)` or `bwd(x, y, ct_y)`, not both."),
    ):
        dx.ExpensiveFn(fwd=plain, bwd=lambda x, y, ct: ct, adjoint=lambda x, ct: ct, name="both")
    with pytest.raises(
        TypeError, match=re.escape("`ExpensiveFn(name='lonely')`: `combine` was given without `adjoint`")
    ):
        dx.ExpensiveFn(fwd=plain, bwd=lambda x, y, ct: ct, combine=lambda x, y, p: p, name="lonely")
    bad = dx.ExpensiveFn(fwd=plain, adjoint=lambda x, ct: ct, combine=lambda x, y, p: p[:2], name="bad_combine")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`ExpensiveFn(name='bad_combine')`: `combine` returned a cotangent that does not match the input `x`."
        ),
    ):
        jax.grad(lambda x: jnp.sum(bad(x)))(X)


# ----------------------------------------------------------------------------- implementations that are not thread-safe


class Workspace:
    """A host solver with one shared workspace: entering it twice at once corrupts the
    results. Records the most calls ever inside at once."""

    def __init__(self, delay=0.05):
        self.delay = delay
        self.buffer = np.zeros(4)
        self.inside = 0
        self.peak = 0
        self.lock = threading.Lock()

    def _solve(self, matrix, rhs):
        with self.lock:
            self.inside += 1
            self.peak = max(self.peak, self.inside)
        self.buffer[:] = rhs
        time.sleep(self.delay)  # another caller would overwrite the buffer meanwhile
        out = np.linalg.solve(matrix, self.buffer.copy())
        with self.lock:
            self.inside -= 1
        return out

    def site(self, name="solver", **kwargs):
        a = np.asarray(A)
        return dx.host(
            lambda b: self._solve(a + 4 * np.eye(4), b),
            adjoint=lambda b, ct: self._solve((a + 4 * np.eye(4)).T, ct),
            out=jax.ShapeDtypeStruct((4,), jnp.float64),
            name=name,
            **kwargs,
        )


def solved(x):
    return jnp.linalg.solve(A + 4 * jnp.eye(4), x)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_function_that_is_not_thread_safe_is_never_entered_twice(jit):
    wrap = eqx.filter_jit if jit else (lambda f: f)
    # by default the deferred schedule overlaps the forward and the adjoint
    ws = Workspace()
    wrap(dx.filter_value_and_grad(linear(ws.site())))(X)
    assert ws.peak == 2
    # declared not thread-safe: one at a time, and the right result; two sites of it, a batch
    ws = Workspace()
    f, g = ws.site("f", thread_safe=False), ws.site("g", thread_safe=False)
    loss = lambda x: linear(f)(x) + jnp.sum(jax.vmap(g)(jnp.stack([x, 2 * x, -x])))  # noqa: E731
    reference = lambda x: linear(solved)(x) + jnp.sum(jax.vmap(solved)(jnp.stack([x, 2 * x, -x])))  # noqa: E731
    assert [s.schedule for s in dx.explain(loss, X).sites] == ["deferred", "deferred"]
    got = wrap(dx.filter_value_and_grad(loss))(X)
    assert ws.peak == 1
    assert_tree_allclose(got, jax.value_and_grad(reference)(X))


def test_concurrency_switched_off_for_every_function():
    ws = Workspace()
    f, g = ws.site("f"), ws.site("g")
    loss = lambda x: linear(f)(x) + linear(g)(2 * x)  # noqa: E731
    dx.set_concurrency(False)
    try:
        got = dx.filter_value_and_grad(loss)(X)
    finally:
        dx.set_concurrency(True)
    assert ws.peak == 1
    assert_tree_allclose(got, jax.value_and_grad(lambda x: linear(solved)(x) + linear(solved)(2 * x))(X))
    ws.peak = 0
    dx.filter_value_and_grad(loss)(X)
    assert ws.peak > 1  # switched back on


# ----------------------------------------------------------------------------- what `fwd` and `bwd` may share


B = np.array([1.0, -1.0, 2.0, 0.5])


def kept_plain(x):
    """What the solver below stands for, in plain JAX: `u = (A + 4 I + diag(x))^-1 b`."""
    return jnp.linalg.solve(A + 4 * jnp.eye(4) + jnp.diag(x), B)


class KeptState:
    """The common host-solver pattern: `fwd` (a `jax.pure_callback`) solves and keeps its
    matrix and field in the object; `bwd` ignores its `y` argument and reuses them. Right
    when `bwd` runs after `fwd`; beside it, `bwd` would reuse the previous call's."""

    def __init__(self):
        self.kept = None
        self.runs = {"fwd": 0, "bwd": 0}

    def forward(self, x):
        self.runs["fwd"] += 1
        matrix = np.asarray(A) + 4 * np.eye(4) + np.diag(np.asarray(x))
        time.sleep(0.05)  # an expensive solve
        u = np.linalg.solve(matrix, B)
        self.kept = (matrix, u)
        return u

    def adjoint(self, ct):
        self.runs["bwd"] += 1
        matrix, u = self.kept
        return -np.linalg.solve(matrix.T, np.asarray(ct)) * u

    def site(self):
        struct = jax.ShapeDtypeStruct((4,), jnp.float64)
        return dx.ExpensiveFn(
            fwd=lambda x: jax.pure_callback(self.forward, struct, x),
            bwd=lambda x, y, ct: jax.pure_callback(self.adjoint, struct, ct),  # no `y`: the object has it
            name="kept",
        )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_bwd_that_calls_what_deferax_cannot_read_runs_after_fwd(jit):
    solver = KeptState()
    solver.forward(np.asarray(2.0 * X))  # an earlier call left its state behind
    loss = linear(solver.site())
    (site,) = dx.explain(loss, X).sites
    assert site.schedule == "standard"
    assert site.reason.startswith("no `fused` implementation, and its `bwd` calls `pure_callback` at ")
    assert site.reason.endswith(
        ", whose body deferax cannot read: it may use what `fwd` left behind (a factorisation kept in a Python \
object), "
        "so it runs after `fwd`. If it does not, give `adjoint(x, ct_y)` instead of `bwd`, or "
        "`fused=dx.fuse(fwd, adjoint)`: they run at the same time"
    )
    step = dx.filter_value_and_grad(loss)
    step = eqx.filter_jit(step) if jit else step
    for x in (X, -X, X):
        solver.runs = {"fwd": 0, "bwd": 0}
        got = jax.block_until_ready(step(x))
        assert solver.runs == {"fwd": 1, "bwd": 1}
        assert_tree_allclose(got, jax.value_and_grad(linear(kept_plain))(x))


def test_debug_callback_on_y_in_bwd_sees_the_real_output():
    """A `jax.debug.callback` on `y` inside `bwd` sees what it sees on the standard schedule
    (Equinox's), not the zeros a `fused` made from `fwd` and a `y`-free `bwd` would pass."""
    seen = []

    def bwd(x, y, ct):
        jax.debug.callback(lambda y_: seen.append(np.asarray(y_)), y)
        return A.T @ (ct * (1 - jnp.tanh(A @ x) ** 2))

    f = dx.ExpensiveFn(fwd=plain, bwd=bwd, name="shows_y")
    (site,) = dx.explain(linear(f), X).sites
    assert site.schedule == "standard"
    assert site.reason.startswith("no `fused` implementation, and its `bwd` reads `y` through `debug_callback` at ")
    assert site.reason.endswith(" (give `adjoint` and `combine`, or `fused`)")
    expected = eqx.filter_value_and_grad(linear(f))(X)
    jax.effects_barrier()
    (standard,) = seen
    seen.clear()
    for step in (dx.filter_value_and_grad(linear(f)), eqx.filter_jit(dx.filter_value_and_grad(linear(f)))):
        got = step(X)
        jax.effects_barrier()
        (shown,) = seen
        seen.clear()
        assert_tree_allclose(shown, standard)
        assert_tree_allclose(got, expected)
    assert_tree_allclose(standard, plain(X))


def _unsafe_site(ws, how):
    """A site on `ws`'s one shared workspace, whose forward and adjoint may run at once."""
    if how == "host":
        return ws.site()
    matrix = np.asarray(A) + 4 * np.eye(4)
    struct = jax.ShapeDtypeStruct((4,), jnp.float64)
    fwd = lambda b: jax.pure_callback(lambda b_: ws._solve(matrix, b_), struct, b)  # noqa: E731
    adjoint = lambda b, ct: jax.pure_callback(lambda ct_: ws._solve(matrix.T, ct_), struct, ct)  # noqa: E731
    if how == "adjoint":
        return dx.ExpensiveFn(fwd=fwd, adjoint=adjoint, name="solver")
    return dx.ExpensiveFn(fwd=fwd, bwd=lambda b, y, ct: adjoint(b, ct), fused=dx.fuse(fwd, adjoint), name="solver")


@pytest.mark.parametrize("how", ["host", "adjoint", "dx.fuse"])
def test_concurrency_switched_off_after_the_step_was_compiled(how):
    """`set_concurrency` is read when the step runs, not when it was compiled."""
    ws = Workspace(delay=0.3)  # (long enough for the other half to start on a busy machine)
    loss = linear(_unsafe_site(ws, how))
    step = eqx.filter_jit(dx.filter_value_and_grad(loss))
    step(X)  # compiled with concurrency on: the halves overlap (and corrupt the workspace)
    assert ws.peak == 2
    ws.peak = 0
    dx.set_concurrency(False)
    try:
        got = step(X)
    finally:
        dx.set_concurrency(True)
    assert ws.peak == 1
    assert_tree_allclose(got, jax.value_and_grad(linear(solved))(X))
    ws.peak = 0
    step(X)
    assert ws.peak == 2  # switched back on
    # and the other way: compiled while it was off
    dx.set_concurrency(False)
    try:
        step = eqx.filter_jit(dx.filter_value_and_grad(linear(_unsafe_site(ws, how))))
        step(X)
    finally:
        dx.set_concurrency(True)
    ws.peak = 0
    step(X)
    assert ws.peak == 2
