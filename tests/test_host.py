"""`dx.host`: host functions on every schedule, under jit and vmap, on executors; faults; the FDFD example."""

import collections
import concurrent.futures as cf
import multiprocessing
import os
import pathlib
import re
import threading
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx

from .helpers import (
    COMPLEX,
    assert_tree_allclose,
    finite_difference_grad,
    load_example,
    plain_fdfd_design,
    plain_fdfd_objective,
)

A0 = np.array([[4.0 + 1.0j, 1.0, 0.5j], [0.3, 3.0 - 0.5j, 1.0], [0.2j, -0.7, 5.0 + 0.2j]])  # not symmetric
SOURCE = np.array([1.0, -0.5j, 2.0])
X0 = jnp.array([0.3, -0.2, 0.8])
M1 = jnp.array([1.0 + 1.0j, 0.5 + 0.0j, -1.0j])
W = jnp.array([1.0 - 1.0j, 2.0, 0.5j])
FIELD = jax.ShapeDtypeStruct((3,), COMPLEX)


class Runs:
    """Thread-safe counts of how often each host function runs, and the shapes it saw."""

    def __init__(self):
        self.counts = collections.Counter()
        self.shapes = collections.defaultdict(list)
        self.lock = threading.Lock()

    def tick(self, key, x=None):
        with self.lock:
            self.counts[key] += 1
            if x is not None:
                self.shapes[key].append(np.shape(x))

    def __getitem__(self, key):
        return self.counts[key]

    def as_dict(self, *keys):
        return {k: self.counts[k] for k in keys}


# ----------------------------------------------------------------------------- a small "solver"
#
# E(x) = A(x)^-1 s with A(x) = A0 + diag(x), x real: the FDFD pattern in miniature (a complex,
# non-symmetric operator, so the adjoint needs the transpose). dE/dx = -A^-1 diag(E), so
#   ct_x = Re(J^T ct_E) = -Re(E * lam),   lam = A^-T ct_E.


def reference(x):
    return jnp.linalg.solve(jnp.asarray(A0) + jnp.diag(x.astype(COMPLEX)), jnp.asarray(SOURCE))


def solver(runs=None, barrier=None, **kwargs):
    def solve(x):
        if runs is not None:
            runs.tick("fwd", x)
        if barrier is not None:
            barrier.wait()
        return np.linalg.solve(A0 + np.diag(x), SOURCE).astype(FIELD.dtype)

    def solve_adjoint(x, ct):
        if runs is not None:
            runs.tick("adjoint", ct)
        if barrier is not None:
            barrier.wait()
        return np.linalg.solve((A0 + np.diag(x)).T, ct).astype(FIELD.dtype)

    def combine(x, e, lam):
        return -jnp.real(e * lam)

    kwargs.setdefault("name", "solver")
    kwargs.setdefault("max_basis", 2)  # a complex overlap is k = 2 (the default limit is 1)
    return dx.host(solve, adjoint=solve_adjoint, combine=combine, out=FIELD, adjoint_out=FIELD, **kwargs)


def linear_loss(f):
    return lambda x: jnp.sum(jnp.real(W * f(x))) + jnp.sum(x**2)


def overlap_loss(f):
    return lambda x: jnp.abs(jnp.vdot(M1, f(x))) ** 2


def power_loss(f):
    return lambda x: jnp.sum(jnp.abs(f(x)) ** 4)


LOSSES = {
    "linear": (linear_loss, "deferred"),
    "overlap": (overlap_loss, "deferred-basis"),
    "power": (power_loss, "standard"),
}


def run(loss, x, schedule="auto", jit=False, **kwargs):
    fn = dx.filter_value_and_grad(loss, schedule=schedule, **kwargs)
    if jit:
        fn = eqx.filter_jit(fn)
    return jax.block_until_ready(fn(x))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("schedule", ["auto", "standard"])
@pytest.mark.parametrize("loss_name", sorted(LOSSES))
def test_every_schedule_matches_jax_and_runs_each_solve_once(loss_name, schedule, jit):
    make_loss, expected_schedule = LOSSES[loss_name]
    runs = Runs()
    loss = make_loss(solver(runs))
    site = dx.explain(dx.filter_value_and_grad(loss, schedule=schedule), X0).sites[0]
    assert site.schedule == (expected_schedule if schedule == "auto" else "standard")
    if jit:
        run(loss, X0, schedule, jit=True)  # compile
    runs.counts.clear()
    got = run(loss, X0, schedule, jit=jit)
    assert_tree_allclose(got, eqx.filter_value_and_grad(make_loss(reference))(X0), rtol=1e-12, atol=1e-12)
    # deferred-basis without linear_adjoint: the overlap is complex, k = 2 adjoint solves
    adjoints = 2 if site.schedule == "deferred-basis" else 1
    assert runs.as_dict("fwd", "adjoint") == {"fwd": 1, "adjoint": adjoints}


def test_gradient_matches_finite_differences():
    loss = overlap_loss(solver())
    grad = dx.filter_grad(loss)(X0)
    assert_tree_allclose(grad, finite_difference_grad(loss, X0), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_linear_adjoint_solves_a_complex_multiple_once(jit):
    runs = Runs()
    loss = overlap_loss(solver(runs, linear_adjoint=True))
    run(loss, X0, jit=jit)
    runs.counts.clear()
    got = run(loss, X0, jit=jit)
    assert_tree_allclose(got, eqx.filter_value_and_grad(overlap_loss(reference))(X0), rtol=1e-12, atol=1e-12)
    assert runs.as_dict("fwd", "adjoint") == {"fwd": 1, "adjoint": 1}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("loss_name", ["linear", "overlap"])
def test_forward_and_adjoints_run_at_the_same_time(loss_name, jit):
    """Each host function waits at a barrier for all the others: the call can only finish
    if the forward solve and every adjoint solve run at the same time."""
    parties = 2 if loss_name == "linear" else 3  # the overlap: forward + 2 basis adjoints
    barrier = threading.Barrier(parties, timeout=10)
    with cf.ThreadPoolExecutor(4) as pool:
        loss = LOSSES[loss_name][0](solver(barrier=barrier, executor=pool))
        got = run(loss, X0, jit=jit)
    assert_tree_allclose(got, eqx.filter_value_and_grad(LOSSES[loss_name][0](reference))(X0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_several_sites_run_at_the_same_time(jit):
    barrier = threading.Barrier(6, timeout=10)  # 3 sites, forward and adjoint each
    with cf.ThreadPoolExecutor(8) as pool:
        fs = [solver(barrier=barrier, executor=pool, name=f"solver{i}") for i in range(3)]

        def loss(x):
            return sum(linear_loss(f)(x * (i + 1)) for i, f in enumerate(fs))

        got = run(loss, X0, jit=jit)

    def ref(x):
        return sum(linear_loss(reference)(x * (i + 1)) for i in range(3))

    assert_tree_allclose(got, eqx.filter_value_and_grad(ref)(X0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("jit", [False, True], ids=["plain", "jit"])
@pytest.mark.parametrize("loss_name", ["linear", "overlap"])
def test_vmap_submits_one_job_per_example_together(loss_name, jit):
    runs = Runs()
    barrier = threading.Barrier(6, timeout=10)  # 3 examples, forward and adjoint each
    xs = jnp.stack([X0, -X0, 2 * X0])
    make_loss = LOSSES[loss_name][0]
    with cf.ThreadPoolExecutor(8) as pool:
        loss = make_loss(
            solver(runs, barrier=barrier if loss_name == "linear" else None, executor=pool, linear_adjoint=True)
        )
        fn = jax.vmap(dx.filter_value_and_grad(loss))
        got = jax.block_until_ready((jax.jit(fn) if jit else fn)(xs))
    assert_tree_allclose(got, jax.vmap(eqx.filter_value_and_grad(make_loss(reference)))(xs), rtol=1e-12, atol=1e-12)
    assert runs.as_dict("fwd", "adjoint") == {"fwd": 3, "adjoint": 3}
    assert set(runs.shapes["fwd"]) == {(3,)}  # one example at a time


def test_nested_vmap_and_standard_schedule_under_vmap():
    runs = Runs()
    f = solver(runs)
    xs = jnp.stack([jnp.stack([X0, -X0, 2 * X0]), jnp.stack([X0, 0.5 * X0, X0 + 1])])
    loss, ref = power_loss(f), power_loss(reference)
    got = jax.vmap(jax.vmap(jax.value_and_grad(loss)))(xs)
    assert_tree_allclose(got, jax.vmap(jax.vmap(jax.value_and_grad(ref)))(xs), rtol=1e-12, atol=1e-12)
    assert runs.as_dict("fwd", "adjoint") == {"fwd": 6, "adjoint": 6}


def vectorized_solver(runs):
    """Host functions that take a leading batch axis on every argument."""

    def solve(x):
        runs.tick("fwd", x)
        return np.stack([np.linalg.solve(A0 + np.diag(xi), SOURCE) for xi in x])

    def solve_adjoint(x, ct):
        runs.tick("adjoint", ct)
        return np.stack([np.linalg.solve((A0 + np.diag(xi)).T, c) for xi, c in zip(x, ct, strict=True)])

    return dx.host(
        solve,
        adjoint=solve_adjoint,
        combine=lambda x, e, lam: -jnp.real(e * lam),
        out=FIELD,
        adjoint_out=FIELD,
        vectorized=True,
        max_basis=2,
    )


def test_vectorized_host_functions_get_whole_batches():
    runs = Runs()
    f = vectorized_solver(runs)
    xs = jnp.stack([X0, -X0, 2 * X0, X0 + 1])
    got = jax.vmap(dx.filter_value_and_grad(linear_loss(f)))(xs)
    assert_tree_allclose(got, jax.vmap(eqx.filter_value_and_grad(linear_loss(reference)))(xs), rtol=1e-12, atol=1e-12)
    assert runs.shapes == {"fwd": [(4, 3)], "adjoint": [(4, 3)]}
    # without vmap: a batch of one; the two basis cotangents: one adjoint call with a batch of two
    runs.shapes.clear()
    got = dx.filter_value_and_grad(overlap_loss(f))(X0)
    assert_tree_allclose(got, eqx.filter_value_and_grad(overlap_loss(reference))(X0), rtol=1e-12, atol=1e-12)
    assert runs.shapes == {"fwd": [(1, 3)], "adjoint": [(2, 3)]}


@pytest.mark.parametrize("jit", [False, True], ids=["plain", "jit"])
@pytest.mark.parametrize("loss_name", ["linear", "overlap"])
def test_several_vectorized_sites_under_vmap_get_whole_batches(loss_name, jit):
    """Two or three host sites under an outer `vmap`: each host function gets the batch of
    four in one call, as one site does."""
    make_loss = LOSSES[loss_name][0]
    runs = [Runs() for _ in range(3)]
    fs = [vectorized_solver(r) for r in runs]

    def loss(x):
        return sum(make_loss(f)(x * (i + 1)) for i, f in enumerate(fs))

    def ref(x):
        return sum(make_loss(reference)(x * (i + 1)) for i in range(3))

    xs = jnp.stack([X0, -X0, 2 * X0, X0 + 1])
    fn = jax.vmap(dx.filter_value_and_grad(loss))
    assert [s.schedule for s in dx.explain(dx.filter_value_and_grad(loss), X0).sites] == [LOSSES[loss_name][1]] * 3
    got = jax.block_until_ready((jax.jit(fn) if jit else fn)(xs))
    assert_tree_allclose(got, jax.vmap(eqx.filter_value_and_grad(ref))(xs), rtol=1e-12, atol=1e-12)
    adjoints = (4, 3) if loss_name == "linear" else (8, 3)  # the overlap: two basis cotangents each
    for r in runs:
        assert r.shapes == {"fwd": [(4, 3)], "adjoint": [adjoints]}


def test_vectorized_site_beside_fused_halves_under_vmap():
    """A host site beside a `dx.fuse` site under an outer `vmap` (one callback for both):
    the host functions get the whole batch; the halves run once per example."""
    runs = Runs()
    f = vectorized_solver(runs)

    def adjoint(x, ct):
        return jnp.linalg.solve((jnp.asarray(A0) + jnp.diag(x.astype(jnp.complex128))).T, ct)

    g = dx.ExpensiveFn(
        fwd=reference, fused=dx.fuse(reference, adjoint, combine=lambda x, e, lam: -jnp.real(e * lam)), name="halves"
    )
    loss = lambda x: linear_loss(f)(x) + linear_loss(g)(2 * x)  # noqa: E731
    xs = jnp.stack([X0, -X0, 2 * X0, X0 + 1])
    with dx.record() as timeline:
        got = jax.block_until_ready(jax.jit(jax.vmap(dx.filter_value_and_grad(loss)))(xs))
    assert_tree_allclose(
        got,
        jax.vmap(eqx.filter_value_and_grad(lambda x: linear_loss(reference)(x) + linear_loss(reference)(2 * x)))(xs),
    )
    assert runs.shapes == {"fwd": [(4, 3)], "adjoint": [(4, 3)]}
    assert timeline.counts("halves") == {"fwd": 4, "adjoint": 4}


def test_typed_prng_key_reaches_host_functions_as_its_data():
    """A typed PRNG key in a host site's input arrives as its raw data (`uint32`), as
    `jax.pure_callback` hands it, eagerly, under `jit` and under `vmap` of a key batch;
    against plain JAX. A key in `out=` is refused: NumPy cannot hold one."""
    runs = Runs()

    def solve(x):
        p, data = x
        runs.tick("fwd", data)
        return 2.0 * p + float(data.sum() % 7)

    def adjoint(x, ct):
        runs.tick("adjoint", x[1])
        return 2.0 * ct, np.zeros_like(x[1])

    f = dx.host(solve, adjoint=adjoint, out=jax.ShapeDtypeStruct((3,), jnp.float64), name="keyed")
    w = jnp.array([1.0, -2.0, 0.5])
    loss = lambda p, key: jnp.sum(w * f((p, key))) + jnp.sum(p**2)  # noqa: E731
    reference = lambda p, key: (
        jnp.sum(w * (2.0 * p + (jnp.sum(jax.random.key_data(key)) % 7).astype(p.dtype))) + jnp.sum(p**2)
    )  # noqa: E731
    key = jax.random.key(3)
    assert dx.explain(loss, X0, key).sites[0].schedule == "deferred"
    for jit in (False, True):
        runs.shapes.clear()
        fn = dx.filter_value_and_grad(loss)
        got = (eqx.filter_jit(fn) if jit else fn)(X0, key)
        assert_tree_allclose(got, eqx.filter_value_and_grad(reference)(X0, key), rtol=1e-12, atol=1e-12)
        assert runs.shapes == {"fwd": [(2,)], "adjoint": [(2,)]}
    keys = jax.random.split(key, 3)
    runs.shapes.clear()
    got = jax.vmap(dx.filter_value_and_grad(loss), in_axes=(None, 0))(X0, keys)
    assert_tree_allclose(
        got, jax.vmap(eqx.filter_value_and_grad(reference), in_axes=(None, 0))(X0, keys), rtol=1e-12, atol=1e-12
    )
    assert runs.shapes == {"fwd": [(2,)] * 3, "adjoint": [(2,)] * 3}

    g = dx.host(lambda x: x, out=jax.eval_shape(lambda: jax.random.key(0)), name="split")
    with pytest.raises(TypeError) as info:
        g(X0)
    assert str(info.value) == (
        "`ExpensiveFn(name='split')`: `out=` declares a typed PRNG key (key<fry>[]), but a host function returns \
NumPy arrays, which cannot\n"
        "hold one (nor can `jax.pure_callback` return one). Declare the key's raw data, and wrap it after the call:\n\n"
        "    data = sim(x)                       # out=jax.ShapeDtypeStruct((2,), jnp.uint32)\n"
        "    key = jax.random.wrap_key_data(data)"
    )


def test_bwd_that_needs_the_output_stays_standard():
    runs = Runs()

    def solve(x):
        runs.tick("fwd")
        return np.linalg.solve(A0 + np.diag(x), SOURCE)

    def bwd(x, e, ct):
        runs.tick("bwd")
        return -np.real(e * np.linalg.solve((A0 + np.diag(x)).T, ct))

    f = dx.host(solve, bwd=bwd, out=FIELD, name="needs_y")
    loss = linear_loss(f)
    site = dx.explain(loss, X0).sites[0]
    assert site.schedule == "standard"
    assert (
        site.reason == "no `fused` implementation, and its `bwd` reads `y` (give `adjoint` and `combine`, or `fused`)"
    )
    for jit in (False, True):
        runs.counts.clear()
        got = run(loss, X0, jit=jit)
        assert_tree_allclose(got, eqx.filter_value_and_grad(linear_loss(reference))(X0), rtol=1e-12, atol=1e-12)
        assert runs.as_dict("fwd", "bwd") == {"fwd": 1, "bwd": 1}


def counted_fused(runs):
    """A host `fused(x, ct)`: the forward and the adjoint solve in one job, counted."""

    def fused(x, ct):
        runs.tick("fused")
        a = A0 + np.diag(x)
        e = np.linalg.solve(a, SOURCE)
        return e, -np.real(e * np.linalg.solve(a.T, ct))

    return fused


def test_fused_host_function_alone():
    """A `fused`-only site: the standard schedule would call it twice (the forward, then
    the forward again with the adjoint); a complex overlap (k = 2) calls it once per basis
    cotangent, both in one stage (its real input's cotangent is not complex-linear in the
    output's: no call answers for another)."""
    runs = Runs()
    f = dx.host(fused=counted_fused(runs), out=FIELD, name="both")
    for make_loss, g, schedule, expected in ((linear_loss, f, "deferred", 1), (overlap_loss, f, "deferred-basis", 2)):
        assert dx.explain(make_loss(g), X0).sites[0].schedule == schedule
        for jit in (False, True):
            runs.counts.clear()
            got = run(make_loss(g), X0, jit=jit)
            assert_tree_allclose(got, eqx.filter_value_and_grad(make_loss(reference))(X0), rtol=1e-12, atol=1e-12)
            assert runs["fused"] == expected
    dx.forget_timings()  # (the calls above were timed)
    # two calls in one stage against two in two: at once on deferax's pool with 2 cores or more
    site = dx.explain(overlap_loss(f), X0).sites[0]
    deferred = 2.01 if len(os.sched_getaffinity(0)) >= 2 else 4.01
    assert site.estimates == dx.Estimates(standard=4.02, deferred=deferred, source="defaults")


def test_fused_batch_host_function_runs_once_for_all_basis_cotangents():
    runs = Runs()

    def fused_batch(x, cts):  # one factorisation, the forward and k adjoint right-hand sides
        runs.tick("fused_batch", cts)
        a = A0 + np.diag(x)
        e = np.linalg.solve(a, SOURCE)
        lams = np.linalg.solve(a.T, cts.T).T
        return e, -np.real(e * lams)

    f = dx.host(fused=counted_fused(runs), fused_batch=fused_batch, out=FIELD, name="both")
    for jit in (False, True):
        runs.counts.clear()
        runs.shapes.clear()
        got = run(overlap_loss(f), X0, jit=jit, max_basis=2)
        assert_tree_allclose(got, eqx.filter_value_and_grad(overlap_loss(reference))(X0), rtol=1e-12, atol=1e-12)
        assert runs.as_dict("fused", "fused_batch") == {"fused": 0, "fused_batch": 1}
        assert runs.shapes["fused_batch"] == [(2, 3)]


@pytest.mark.parametrize("loss_name, rows", [("linear", None), ("product", 6), ("power", 6)])
@pytest.mark.parametrize("hinted", [False, True], ids=["equal-costs", "setup-hint"])
def test_a_fused_only_site_with_a_fused_batch(loss_name, rows, hinted):
    """No `max_basis`: a linear loss runs `fused` once. A loss that needs the output's
    k = 6 real basis cotangents runs `fused_batch` once with all of them when a
    factorisation dominates (`cost=dx.Cost(setup=10)`: 10 + 1 + 6 + stage against
    2 * 12 + 2 stages for `fused` twice), but `fused` twice on the standard schedule with
    equal costs (1 + 1 + 6 against 2 * 2), as `explain` says: never `fused` once per
    cotangent."""
    runs = Runs()

    def fused_batch(x, cts):
        runs.tick("fused_batch", cts)
        a = A0 + np.diag(x)
        e = np.linalg.solve(a, SOURCE)
        return e, -np.real(e * np.linalg.solve(a.T, cts.T).T)

    losses = {
        "linear": lambda f: lambda x: jnp.real(jnp.vdot(W, f(x))),
        "product": lambda f: lambda x: jnp.real(jnp.prod(f(x))),  # needs all three entries: k = 6 real
        "power": lambda f: lambda x: jnp.sum(jnp.abs(f(x)) ** 4),
    }
    cost = dx.Cost(setup=10.0) if hinted else None
    f = dx.host(fused=counted_fused(runs), fused_batch=fused_batch, out=FIELD, name="both", cost=cost)
    site = dx.explain(losses[loss_name](f), X0).sites[0]
    if rows is None:
        expected, schedule = {"fused": 1, "fused_batch": 0}, "deferred"
    elif hinted:
        expected, schedule = {"fused": 0, "fused_batch": 1}, "deferred-basis"
        assert site.estimates == dx.Estimates(standard=24.002, deferred=17.001, source="hint")
    else:
        expected, schedule = {"fused": 2, "fused_batch": 0}, "standard"
        assert site.estimates == dx.Estimates(standard=4.02, deferred=7.01, source="defaults")
    assert (site.schedule, site.k) == (schedule, rows)
    for jit in (False, True):
        runs.counts.clear()
        runs.shapes.clear()
        got = run(losses[loss_name](f), X0, jit=jit)
        assert_tree_allclose(got, jax.value_and_grad(losses[loss_name](reference))(X0), rtol=1e-12, atol=1e-12)
        assert runs.as_dict("fused", "fused_batch") == expected
        assert runs.shapes["fused_batch"] == ([(rows, 3)] if expected["fused_batch"] else [])


def test_fused_batch_without_fused():
    with pytest.raises(
        TypeError, match=re.escape("`ExpensiveFn(name='both')`: `fused_batch` was given without `fused`.")
    ):
        dx.host(lambda x: x, fused_batch=lambda x, cts: (x, cts), out=FIELD, name="both")


def test_pytrees_in_and_out_with_the_default_combine():
    runs = Runs()

    def fwd(x):
        runs.tick("fwd")
        return {"y": np.sin(x["a"]) * x["b"], "z": np.sum(x["a"]) ** 2}

    def adjoint(x, ct):
        # y and z are not linear in x, but their derivative needs only x: no combine step
        runs.tick("adjoint")
        return {"a": np.cos(x["a"]) * x["b"] * ct["y"] + 2 * np.sum(x["a"]) * ct["z"], "b": np.sin(x["a"]) * ct["y"]}

    out = {"y": jax.ShapeDtypeStruct((3,), jnp.float64), "z": jax.ShapeDtypeStruct((), jnp.float64)}
    f = dx.host(fwd, adjoint=adjoint, out=out)

    def ref(x):
        return {"y": jnp.sin(x["a"]) * x["b"], "z": jnp.sum(x["a"]) ** 2}

    def make_loss(g):
        return lambda x: jnp.sum(jnp.array([1.0, -2.0, 0.5]) * g(x)["y"]) + 3.0 * g(x)["z"]

    x = {"a": X0, "b": jnp.array([1.0, 2.0, 3.0])}
    got = run(make_loss(f), x)
    assert dx.explain(make_loss(f), x).sites[0].schedule == "deferred"
    assert_tree_allclose(got, eqx.filter_value_and_grad(make_loss(ref))(x), rtol=1e-12, atol=1e-12)


class CountingExecutor(cf.Executor):
    """Runs each job at once in the caller's thread: any `concurrent.futures.Executor` works."""

    def __init__(self):
        self.submitted = 0

    def submit(self, fn, /, *args, **kwargs):
        self.submitted += 1
        future = cf.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as e:
            future.set_exception(e)
        return future


def test_any_executor():
    executor = CountingExecutor()
    got = run(linear_loss(solver(executor=executor)), X0)
    assert_tree_allclose(got, eqx.filter_value_and_grad(linear_loss(reference))(X0), rtol=1e-12, atol=1e-12)
    assert executor.submitted == 2  # forward and adjoint, submitted together

    def fails(x):
        raise ValueError("no convergence")

    f = dx.host(fails, adjoint=lambda x, ct: ct, out=FIELD, executor=executor, name="other")
    with pytest.raises(
        dx.HostError,
        match=re.escape("the host function `fwd` raised ValueError: no convergence (on a CountingExecutor)"),
    ):
        f(X0)


# ----------------------------------------------------------------------------- faults


def failing_solver(runs=None, **kwargs):
    """Raises when x[0] < 0, in the forward or the adjoint solve."""

    def solve(x):
        if x[0] < 0 and kwargs.get("fail") == "fwd":
            raise np.linalg.LinAlgError("Singular matrix")
        return np.linalg.solve(A0 + np.diag(x), SOURCE)

    def solve_adjoint(x, ct):
        if x[0] < 0 and kwargs.get("fail") == "adjoint":
            raise np.linalg.LinAlgError("Singular matrix")
        return np.linalg.solve((A0 + np.diag(x)).T, ct)

    return dx.host(
        solve,
        adjoint=solve_adjoint,
        combine=lambda x, e, lam: -jnp.real(e * lam),
        out=FIELD,
        adjoint_out=FIELD,
        name="fdfd",
        executor=kwargs.get("executor"),
    )


def caused_by(error, kind):
    """The exception of type `kind` in the chain of `error` (JAX's backward pass may insert
    its own stack-trace exception between the two)."""
    seen = error
    while seen is not None and not isinstance(seen, kind):
        seen = seen.__cause__ or seen.__context__
    assert seen is not None, f"no {kind.__name__} in the chain of {error!r}"
    return seen


def raised(impl, where="a thread of a ThreadPoolExecutor"):
    return re.escape(
        f"`ExpensiveFn(name='fdfd')`: the host function `{impl}` raised LinAlgError: Singular matrix (on {where}).\n"
        "The original exception "
    )


@pytest.mark.parametrize("schedule", ["auto", "standard"])
@pytest.mark.parametrize("fail", ["fwd", "adjoint"])
def test_exception_in_host_function_is_a_python_exception(fail, schedule):
    loss = linear_loss(failing_solver(fail=fail))
    with pytest.raises(dx.HostError, match=raised(fail)) as info:
        run(loss, -X0, schedule)
    original = caused_by(info.value, np.linalg.LinAlgError)
    assert str(original) == "Singular matrix"
    assert info.value.original is original  # whatever JAX's backward pass put in the chain
    if fail == "fwd" or schedule == "auto":  # (not on JAX's backward pass: there its own record is the cause)
        assert info.value.__cause__ is original
    # the executor (deferax's thread pool) is still usable
    assert_tree_allclose(
        run(loss, X0, schedule), eqx.filter_value_and_grad(linear_loss(reference))(X0), rtol=1e-12, atol=1e-12
    )


def test_exception_under_jit_carries_the_message():
    """Under jit the host function runs from a callback and JAX re-raises its failure with
    the `HostError`'s message in its own. Which type JAX raises depends on the jitted
    function's history (for the same input shapes): if its first call failed, every failing
    call raises `jax.errors.JaxRuntimeError`, even after successful calls; if its first call
    succeeded, later failing calls take JAX's C++ fast path and raise a plain `ValueError`.
    Neither type is a subclass of the other."""
    loss = linear_loss(failing_solver(fail="adjoint"))
    expected = eqx.filter_value_and_grad(linear_loss(reference))(X0)
    fn = eqx.filter_jit(dx.filter_value_and_grad(loss))
    for _ in range(2):  # the first call fails, and so does a second
        with pytest.raises(jax.errors.JaxRuntimeError, match=raised("adjoint")):
            jax.block_until_ready(fn(-X0))
    assert_tree_allclose(fn(X0), expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(jax.errors.JaxRuntimeError, match=raised("adjoint")):  # still the same type after a success
        jax.block_until_ready(fn(-X0))
    # a first call that succeeds: later failures are a `ValueError`, with the same message.
    # (A fresh `loss`: `eqx.filter_jit` of an equal wrapper of the same `loss` would reuse
    # the jitted function above, whose first call failed.)
    for wrap in (eqx.filter_jit, jax.jit):
        fn = wrap(dx.filter_value_and_grad(linear_loss(failing_solver(fail="adjoint"))))
        assert_tree_allclose(fn(X0), expected, rtol=1e-12, atol=1e-12)
        for _ in range(2):
            with pytest.raises(ValueError, match=raised("adjoint")) as info:
                jax.block_until_ready(fn(-X0))
            assert type(info.value) is ValueError
        assert_tree_allclose(fn(X0), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.serial  # (bounds the wall time of a timed-out job)
def test_timeout():
    def solve(x):
        if x[0] < 0:
            time.sleep(2.0)
        return np.linalg.solve(A0 + np.diag(x), SOURCE)

    f = dx.host(
        solve,
        adjoint=lambda x, ct: np.linalg.solve((A0 + np.diag(x)).T, ct),
        out=FIELD,
        adjoint_out=FIELD,
        combine=lambda x, e, lam: -jnp.real(e * lam),
        timeout=0.3,
        name="slow",
    )
    expected = (
        "`ExpensiveFn(name='slow')`: the host function `fwd` did not finish within timeout=0.3 s (on a thread of a "
        "ThreadPoolExecutor).\nJobs not yet started were cancelled; a job already running on a thread keeps its thread "
        "until it returns.\nRaise `timeout=` in `dx.host(...)`, or give `timeout=None` to wait without limit."
    )
    t0 = time.perf_counter()
    with pytest.raises(dx.HostError, match=re.escape(expected)):
        run(linear_loss(f), -X0)
    assert time.perf_counter() - t0 < 1.5
    assert_tree_allclose(
        run(linear_loss(f), X0), eqx.filter_value_and_grad(linear_loss(reference))(X0), rtol=1e-12, atol=1e-12
    )


def test_executor_that_was_shut_down():
    pool = cf.ThreadPoolExecutor(1)
    pool.shutdown()
    f = solver(executor=pool, name="solver")
    expected = (
        "`ExpensiveFn(name='solver')`: the host function `fwd` could not be submitted to a ThreadPoolExecutor: "
        "RuntimeError: cannot schedule new futures after shutdown.\nGive `dx.host(..., executor=...)` an executor that "
        "accepts jobs (not one that was shut down)."
    )
    with pytest.raises(dx.HostError, match=re.escape(expected)):
        f(X0)


def proc_solve(x):
    return np.linalg.solve(A0 + np.diag(x), SOURCE)


def proc_solve_adjoint(x, ct):
    if x[0] < 0:
        raise np.linalg.LinAlgError("Singular matrix")
    if x[0] > 100:
        os._exit(1)  # the worker process dies
    return np.linalg.solve((A0 + np.diag(x)).T, ct)


def test_process_pool_faults():
    pool = cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        f = dx.host(
            proc_solve,
            adjoint=proc_solve_adjoint,
            combine=lambda x, e, lam: -jnp.real(e * lam),
            out=FIELD,
            adjoint_out=FIELD,
            executor=pool,
            name="fdfd",
        )
        loss, expected = linear_loss(f), eqx.filter_value_and_grad(linear_loss(reference))(X0)
        assert_tree_allclose(run(loss, X0), expected, rtol=1e-12, atol=1e-12)
        where = "a process of a ProcessPoolExecutor"
        with pytest.raises(dx.HostError, match=raised("adjoint", where) + re.escape("came back from the worker")):
            run(loss, -X0)
        assert_tree_allclose(run(loss, X0), expected, rtol=1e-12, atol=1e-12)  # still usable
        with pytest.raises(dx.HostError) as info:
            run(loss, X0 + 200.0)
        assert str(info.value).startswith(
            "`ExpensiveFn(name='fdfd')`: the host function `adjoint` did not complete: the worker running it was lost "
            "(BrokenProcessPool: "
        )
        assert (
            "A `concurrent.futures.ProcessPoolExecutor` cannot be used once one of its workers has died: make a new \
one."
            in str(info.value)
        )
    finally:
        pool.shutdown(cancel_futures=True)


def test_not_picklable_for_a_process_pool():
    pool = cf.ProcessPoolExecutor(1)
    try:
        expected = (
            "`ExpensiveFn(name='local')`: `adjoint` cannot be sent to the worker processes of a ProcessPoolExecutor: "
            "pickle failed with "
        )
        with pytest.raises(TypeError, match=re.escape(expected)):
            dx.host(proc_solve, adjoint=lambda x, ct: ct, out=FIELD, executor=pool, name="local")
    finally:
        pool.shutdown()


# ----------------------------------------------------------------------------- wrong results


def test_wrong_dtype_from_fwd():
    f = dx.host(lambda x: np.zeros(3, np.complex64), out=FIELD, name="sim")
    expected = (
        "`ExpensiveFn(name='sim')`: the host function `fwd` returned complex64[3], where complex128[3] was expected "
        "(declared by `out=`).\nA host function must return NumPy arrays with exactly the declared shapes and dtypes "
        "(convert with\n`np.asarray(value, dtype=...)`), or the declaration must be corrected."
    )
    for _ in range(2):
        with pytest.raises(ValueError, match=re.escape(expected)):
            f(X0)
    jitted = jax.jit(f)
    for _ in range(2):  # a first call that fails, and a second: `JaxRuntimeError` each time
        with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(expected)):
            jax.block_until_ready(jitted(X0))
    # a wrong dtype only for x[0] < 0: once a first call has succeeded, JAX raises a plain `ValueError`
    g = dx.host(lambda x: np.zeros(3, np.complex64 if x[0] < 0 else np.complex128), out=FIELD, name="sim")
    jitted = jax.jit(g)
    np.testing.assert_array_equal(jitted(X0), np.zeros(3))
    for _ in range(2):
        with pytest.raises(ValueError, match=re.escape(expected)) as info:
            jax.block_until_ready(jitted(-X0))
        assert type(info.value) is ValueError


def test_wrong_shape_from_adjoint():
    f = dx.host(lambda x: 2 * x, adjoint=lambda x, ct: ct[:2], out=jax.ShapeDtypeStruct((3,), jnp.float64), name="sim")
    expected = (
        "`ExpensiveFn(name='sim')`: the host function `adjoint` returned float64[2], where float64[3] was expected "
        "(shaped like the input `x`, the default of `adjoint_out=`)."
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        run(lambda x: jnp.sum(f(x)), X0)
    g = dx.host(
        lambda x: 2 * x,
        adjoint=lambda x, ct: ct[:2],
        combine=lambda x, y, p: p,
        adjoint_out=jax.ShapeDtypeStruct((3,), jnp.float64),
        out=jax.ShapeDtypeStruct((3,), jnp.float64),
        name="sim",
    )
    with pytest.raises(
        ValueError,
        match=re.escape(
            expected.replace("shaped like the input `x`, the default of `adjoint_out=`", "declared by `adjoint_out=`")
        ),
    ):
        jax.grad(lambda x: jnp.sum(g(x)))(X0)


def test_wrong_structure_from_fused():
    f = dx.host(fused=lambda x, ct: 2 * x, out=jax.ShapeDtypeStruct((3,), jnp.float64), name="sim")
    expected = (
        "`ExpensiveFn(name='sim')`: the host function `fused` returned float64[3], where (float64[3], float64[3]) was "
        "expected (a pair `(y, ct_x)`: `y` declared by `out=`, `ct_x` shaped like the input `x`)."
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        run(lambda x: jnp.sum(f(x)), X0)


def test_wrong_result_from_combine_is_combines():
    """`combine` is the user's; the `bwd` and `fused` that deferax makes from it are not."""
    f = dx.host(
        np.sin,
        adjoint=lambda x, ct: np.cos(x) * ct,
        combine=lambda x, y, p: p[:2],
        out=jax.ShapeDtypeStruct((3,), jnp.float64),
        name="sim",
    )
    expected = (
        "`ExpensiveFn(name='sim')`: `combine` returned a cotangent that does not match the input `x`.\n"
        "Expected float64[3], found float64[2].\n"
        "`combine(x, y, partial)` must return a cotangent with the structure, shapes and dtypes of `x`."
    )
    for loss, transform in (
        (lambda x: jnp.sum(f(x)), dx.filter_grad),  # deferred: the fused made from fwd + adjoint
        (lambda x: jnp.sum(f(x) ** 2), jax.grad),  # standard: the bwd made from adjoint + combine
        (lambda x: jnp.sum(f(x) ** 2), lambda g: eqx.filter_jit(dx.filter_grad(g))),
    ):
        with pytest.raises(ValueError, match=re.escape(expected)):
            transform(loss)(X0)


def test_vectorized_result_without_the_batch_axis():
    f = dx.host(lambda x: x[0], out=jax.ShapeDtypeStruct((3,), jnp.float64), vectorized=True, name="sim")
    expected = (
        "`ExpensiveFn(name='sim')`: the host function `fwd` returned float64[3], where float64[1, 3] was expected "
        "(declared by `out=`, with a leading batch axis of length 1 (`vectorized=True`))."
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        f(X0)


# ----------------------------------------------------------------------------- construction


def test_construction_errors():
    out = jax.ShapeDtypeStruct((3,), jnp.float64)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "`ExpensiveFn(name='sim')`: host functions cannot be traced by JAX, so the output's shape and dtype \
must be declared with `out=`"
        ),
    ):
        dx.host(lambda x: x, name="sim")

    def solve_both(x, ct):
        return x, ct

    with pytest.raises(
        TypeError,
        match=re.escape("to one):\n\n    dx.host(fused=solve_both, out=jax.ShapeDtypeStruct((nx, ny), jnp.float64))"),
    ):
        dx.host(fused=solve_both, name="sim")
    with pytest.raises(
        TypeError,
        match=re.escape(
            "to one):\n\n    dx.host(fwd=..., adjoint=..., out=jax.ShapeDtypeStruct((nx, ny), jnp.float64))"
        ),
    ):
        dx.host(lambda x: x, adjoint=lambda x, ct: ct, name="sim")
    with pytest.raises(
        TypeError,
        match=re.escape(
            "`ExpensiveFn(name='sim')`: nothing computes the output. Give the forward host function `fwd(x) -> y`"
        ),
    ):
        dx.host(adjoint=lambda x, ct: ct, out=out, name="sim")
    with pytest.raises(
        TypeError, match=re.escape("`ExpensiveFn(name='sim')`: give `adjoint(x, ct_y)` or `bwd(x, y, ct_y)`, not both.")
    ):
        dx.host(lambda x: x, adjoint=lambda x, ct: ct, bwd=lambda x, y, ct: ct, out=out, name="sim")
    with pytest.raises(
        TypeError,
        match=re.escape(
            "`ExpensiveFn(name='sim')`: `combine` was given without `adjoint`; `combine` and `adjoint_out` describe \
what `adjoint` returns."
        ),
    ):
        dx.host(lambda x: x, combine=lambda x, y, p: p, out=out, name="sim")
    with pytest.raises(
        TypeError, match=re.escape("`ExpensiveFn(name='sim')`: `executor` must be a `concurrent.futures.Executor`")
    ):
        dx.host(lambda x: x, out=out, executor=4, name="sim")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`ExpensiveFn(name='sim')`: `timeout` must be a positive number of seconds or None, but got -1."
        ),
    ):
        dx.host(lambda x: x, out=out, timeout=-1, name="sim")
    with pytest.raises(
        TypeError, match=re.escape("`ExpensiveFn(name='sim')`: `adjoint` must be a callable or None, but got 3.")
    ):
        dx.host(lambda x: x, adjoint=3, out=out, name="sim")


def test_name_defaults_to_the_forward_function():
    def simulate(x):
        return x

    assert dx.host(simulate, out=jax.ShapeDtypeStruct((3,), jnp.float64)).name == "simulate"


# ----------------------------------------------------------------------------- the FDFD example


@pytest.fixture(scope="module")
def fdfd():
    return load_example("fdfd_inverse_design")


def test_fdfd_gradient_matches_finite_differences(fdfd):
    problem = fdfd.Helmholtz(20)
    objective = problem.objective(problem.field())
    x = jnp.asarray(np.random.default_rng(0).uniform(1.5, 3.0, problem.design_shape))
    assert dx.explain(objective, x).sites[0].schedule == "deferred-basis"
    value, grad = dx.filter_value_and_grad(objective)(x)
    # the same objective in plain JAX (a dense solve), and central differences of the loss
    value_r, grad_r = jax.value_and_grad(plain_fdfd_objective(problem))(x)
    scale = float(jnp.max(jnp.abs(grad_r)))
    np.testing.assert_allclose(value, value_r, rtol=1e-10)
    np.testing.assert_allclose(grad, grad_r, rtol=1e-8, atol=1e-10 * scale)
    assert_tree_allclose(
        (value, grad), dx.filter_value_and_grad(objective, schedule="standard")(x), rtol=1e-10, atol=1e-14
    )
    assert_tree_allclose(grad, finite_difference_grad(objective, x, eps=1e-6), rtol=1e-6, atol=1e-8 * scale)


def test_fdfd_design_improves_and_solves_once_each(fdfd):
    runs = Runs()

    class Counted(fdfd.Helmholtz):
        def solve(self, x):
            runs.tick("fwd")
            return super().solve(x)

        def solve_adjoint(self, x, ct):
            runs.tick("adjoint")
            return super().solve_adjoint(x, ct)

    history, _ = fdfd.design(Counted(24), steps=3, verbose=False)
    # the same design loop on the objective in plain JAX (a dense solve)
    np.testing.assert_allclose(history, plain_fdfd_design(fdfd.Helmholtz(24), steps=3), rtol=1e-8)
    assert history[-1] > 1.5 * history[0]
    assert all(b > a for a, b in zip(history[:-1], history[1:], strict=True))
    assert runs.as_dict("fwd", "adjoint") == {"fwd": 4, "adjoint": 4}  # one of each per step (linear_adjoint)


def test_linear_adjoint_recognises_multiples_and_zeros():
    from deferax._host._runner import _multiples

    v, w = np.array([1.0 + 1.0j, 0.5, -1.0j]), np.array([0.0, 1.0, 2.0 + 0j])
    rows = [v, 2j * v, np.zeros(3, complex), w, -3.0 * w]
    recipe, unique = _multiples(rows, jax.ShapeDtypeStruct((3,), jnp.complex128))
    assert unique == [0, 3]
    assert recipe == [(0, 1.0), (0, 2j), (None, 0.0), (1, 1.0), (1, -3.0)]
    # a real result cannot be a complex multiple: solved again
    recipe, unique = _multiples(rows, jax.ShapeDtypeStruct((3,), jnp.float64))
    assert unique == [0, 1, 3]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128])
def test_rows_taken_apart_early_get_what_the_whole_comparison_gives(monkeypatch, dtype):
    """A few rows (a sparse solve's `b` and its cotangent, a site's basis cotangents) that their
    first entries show are pairwise no multiple of each other skip the whole comparison
    (`_apart`): on every pair and group below the answer is the whole comparison's, and the
    early answer fires on the pairs that are apart."""
    from deferax._host import _runner

    rng = np.random.default_rng(0)
    complex_ = np.issubdtype(dtype, np.complexfloating)

    def draw(n=100):
        return (rng.normal(size=n) + (1j * rng.normal(size=n) if complex_ else 0)).astype(dtype)

    u, w = draw(), draw()
    same_start = u.copy()
    same_start[_runner._SAMPLE :] = w[_runner._SAMPLE :]  # (a multiple on the entries read early only)
    late = np.zeros_like(u)
    late[_runner._SAMPLE :] = w[_runner._SAMPLE :]  # (zero where read early)
    eps = np.finfo(dtype).eps
    pairs = {
        "random": ([u, w], True),
        "multiple": ([u, (-2.5 * u).astype(dtype)], False),
        "rounded multiple": ([u, (u * (1 + 10 * eps * rng.normal(size=u.size))).astype(dtype)], False),
        "imaginary multiple": ([u, (1j * u).astype(dtype) if complex_ else -u], False),
        "zero first": ([np.zeros_like(u), w], False),
        "zero second": ([u, np.zeros_like(u)], False),
        "NaN": ([u, np.where(np.arange(u.size) == 3, np.nan, w).astype(dtype)], None),
        "inf": ([np.where(np.arange(u.size) == 0, np.inf, u).astype(dtype), w], None),
        "alike early": ([u, same_start], False),
        "zero early": ([u, late], False),
    }
    x = draw()
    groups = {  # (more rows: each pair of them is asked)
        "three apart": ([u, w, x], True),
        "the third a multiple of the first": ([u, w, (3.0 * u).astype(dtype)], False),
        "the third zero": ([u, w, np.zeros_like(u)], False),
        "the third alike early": ([u, w, same_start], False),
        "past a few": ([draw() for _ in range(_runner._FEW + 1)], True),
    }
    for result in (dtype, np.float64):
        struct = jax.ShapeDtypeStruct((u.size,), result)
        for name, (rows, _) in groups.items():
            with monkeypatch.context() as m:
                m.setattr(_runner, "_apart", lambda u, v: False)
                whole = _runner._multiples(rows, struct)
            assert _runner._multiples(rows, struct) == whole, (name, result)
        for name, (rows, apart) in pairs.items():
            got = _runner._multiples(rows, struct)
            with monkeypatch.context() as m:
                m.setattr(_runner, "_apart", lambda u, v: False)
                whole = _runner._multiples(rows, struct)
            assert got == whole, (name, result)
            if apart is not None:
                assert _runner._apart(*rows) is apart, name


def test_wrong_out_is_reported_not_the_adjoint_it_broke():
    """`fwd` returns 3 numbers where `out=` declares 4; the adjoint, given a cotangent of the
    declared 4, fails on its own. The message names the real mistake: `fwd` against `out=`."""
    a = np.diag([2.0, 3.0, 4.0])

    def solve(b):
        return np.linalg.solve(a, b[:3])

    def adjoint(b, ct):
        return np.linalg.solve(a.T, ct)  # fails: ct has the declared 4 entries

    f = dx.host(
        solve,
        adjoint=adjoint,
        out=jax.ShapeDtypeStruct((4,), jnp.float64),
        adjoint_out=jax.ShapeDtypeStruct((4,), jnp.float64),
        name="wrong_out",
    )
    text = "`ExpensiveFn(name='wrong_out')`: the host function `fwd` returned float64[3], where float64[4] was \
expected (declared by `out=`)."
    step = dx.filter_value_and_grad(lambda x: jnp.sum(f(x)))
    for _ in range(2):
        with pytest.raises(ValueError, match=re.escape(text)):
            step(jnp.ones(4))
    jitted = eqx.filter_jit(step)
    for _ in range(2):  # the first call fails, and a second: `JaxRuntimeError` each time
        with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(text)):
            jax.block_until_ready(jitted(jnp.ones(4)))


def test_fdfd_example_with_dask_but_without_distributed_says_which_extra():
    """`examples/fdfd_inverse_design.py --dask 2` where Dask's `distributed` is missing (here
    hidden from the import system): a message naming the extra, not a bare
    ModuleNotFoundError."""
    import subprocess
    import sys

    example = pathlib.Path(__file__).parent.parent / "examples" / "fdfd_inverse_design.py"
    code = (
        "import runpy, sys; sys.modules['distributed'] = None; "
        f"sys.argv = ['fdfd', '--small', '--dask', '2']; runpy.run_path({str(example)!r}, run_name='__main__')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "--dask needs Dask's `distributed`: install it with `pip install -e .[dask]`" in out.stderr, out.stderr
    assert "ModuleNotFoundError" not in out.stderr
