"""`dx.sparse_solve` inside the compiled program (sparsax's KLU through XLA FFI): a small real
system runs there by default, with no host job, one factorisation per value and gradient
(counted by sparsax), every derivative right against a dense solve in plain JAX; anything else
runs on the host, and `where=` says where, with errors that name the call (a NaN or infinite
entry raises the host path's error from inside the program too)."""

import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse
import sparsax  # (in the tests extra)

import deferax as dx
from deferax._sparse import _program

from .helpers import assert_tree_allclose, float32


def operator(m, spd=False):
    """A convection-diffusion operator on an `m x m` grid (`spd`: the symmetric diffusion part
    alone), `(values, pattern)`."""
    d = scipy.sparse.diags([-1.0, 4.5, -1.0] if spd else [-1.3, 4.5, -0.7], [-1, 0, 1], shape=(m, m))
    e = scipy.sparse.diags([-1.0, -1.0] if spd else [-1.1, -0.9], [-1, 1], shape=(m, m))
    a = scipy.sparse.kron(scipy.sparse.identity(m), d) + scipy.sparse.kron(e, scipy.sparse.identity(m))
    values, pattern = dx.SparsePattern.from_scipy(a.tocsc())
    return jnp.asarray(values), pattern


VALUES, PATTERN = operator(5)
SPD_VALUES, SPD_PATTERN = operator(5, spd=True)
N = PATTERN.n
RNG = np.random.default_rng(0)
B = jnp.asarray(RNG.normal(size=N))
W = jnp.asarray(RNG.normal(size=N))


def dense(v, b, pattern=PATTERN):
    return jnp.linalg.solve(pattern.todense(v), b)


def losses(solve):
    return {
        "linear": lambda v, b: jnp.dot(W, solve(v, b)),
        "overlap": lambda v, b: jnp.dot(W, solve(v, b)) ** 2,
        "power": lambda v, b: jnp.sum(solve(v, b) ** 2),
    }


class Counted:
    """sparsax's factorisations, and deferax's host jobs, while the block runs (sparsax's
    kept factors cleared first: sparsax keeps several sets per pattern, keyed by the entries, and
    an earlier test in the same worker may have factored these very entries; the four threads'
    test scales VALUES by the factors `new` uses, which made a later block count none)."""

    def __enter__(self):
        sparsax.clear_cache()
        self.start = sparsax.factorization_count()
        self._record = dx.record()
        self.timeline = self._record.__enter__()
        return self

    def __exit__(self, *exc):
        self._record.__exit__(*exc)
        self.factorisations = sparsax.factorization_count() - self.start
        self.jobs = sum(self.timeline.counts().values())


def new(v, k=[0]):  # noqa: B006  (each call a matrix never seen: sparsax keeps the last values' factorisation)
    k[0] += 1
    return v * (1.0 + 1e-3 * k[0])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("how", ["dx", "jax"])
@pytest.mark.parametrize("loss", ["linear", "overlap", "power"])
@pytest.mark.parametrize("spd", [False, True], ids=["unsymmetric", "spd"])
def test_gradients_match_a_dense_solve_with_one_factorisation_and_no_host_job(spd, loss, how, jit):
    values, pattern = (SPD_VALUES, SPD_PATTERN) if spd else (VALUES, PATTERN)
    ours = losses(lambda v, b: dx.sparse_solve(v, pattern, b))[loss]
    want_fn = losses(lambda v, b: dense(v, b, pattern))[loss]
    if how == "dx":
        fn = dx.filter_value_and_grad(lambda pair: ours(*pair))
    else:
        fn = jax.value_and_grad(lambda pair: ours(*pair))
    fn = jax.jit(fn) if jit else fn
    for _ in range(3):
        v = new(values)
        with Counted() as counted:
            got = fn((v, B))
            jax.block_until_ready(got)
        assert (counted.factorisations, counted.jobs) == (1, 0)
        assert_tree_allclose(got, jax.value_and_grad(lambda pair: want_fn(*pair))((v, B)), rtol=1e-9, atol=1e-11)
    if how == "dx":
        assert dx.explain(lambda pair: ours(*pair), (v, B)).sites == ()  # (no site: nothing on the host)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jacrev_and_vmap_factor_once(jit):
    wrap = jax.jit if jit else (lambda f: f)
    idx = jnp.arange(0, N, 3)
    jacrev = wrap(jax.jacrev(lambda v, b: dx.sparse_solve(v, PATTERN, b)[idx], argnums=(0, 1)))
    bs = jnp.asarray(RNG.normal(size=(7, N)))
    over_b = wrap(jax.vmap(lambda v, b: dx.sparse_solve(v, PATTERN, b), in_axes=(None, 0)))
    vs = jnp.stack([VALUES, 1.5 * VALUES, 2.0 * VALUES])
    over_values = wrap(jax.vmap(lambda v, b: dx.sparse_solve(v, PATTERN, b), in_axes=(0, None)))
    jacfwd = wrap(jax.jacfwd(lambda v: dx.sparse_solve(v, PATTERN, B)))
    for _ in range(2):
        v = new(VALUES)
        with Counted() as counted:
            got = jax.block_until_ready(jacrev(v, B))
        assert (counted.factorisations, counted.jobs) == (1, 0)
        assert_tree_allclose(got, jax.jacrev(lambda v, b: dense(v, b)[idx], argnums=(0, 1))(v, B))
        v = new(VALUES)
        with Counted() as counted:
            got = jax.block_until_ready(over_b(v, bs))
        assert (counted.factorisations, counted.jobs) == (1, 0)
        assert_tree_allclose(got, jax.vmap(dense, in_axes=(None, 0))(v, bs))
        with Counted() as counted:
            got = jax.block_until_ready(over_values(new(vs), B))
        assert (counted.factorisations, counted.jobs) == (3, 0)
        v = new(VALUES)
        with Counted() as counted:
            got = jax.block_until_ready(jacfwd(v))
        assert (counted.factorisations, counted.jobs) == (1, 0)
        assert_tree_allclose(got, jax.jacfwd(lambda v: dense(v, B))(v))
    got = over_values(vs, B)
    assert_tree_allclose(got, jax.vmap(dense, in_axes=(0, None))(vs, B))


def test_a_vmap_of_the_gradient_over_matrices_and_right_hand_sides():
    loss = losses(lambda v, b: dx.sparse_solve(v, PATTERN, b))["power"]
    want = losses(dense)["power"]
    vs = jnp.stack([VALUES, 1.3 * VALUES])
    bs = jnp.stack([B, 2.0 * B])
    got = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1))))(vs, bs)
    assert_tree_allclose(got, jax.vmap(jax.grad(want, argnums=(0, 1)))(vs, bs))


def test_float32_inputs_are_solved_in_float64_and_rounded():
    v32, b32 = VALUES.astype(jnp.float32), B.astype(jnp.float32)
    loss = losses(lambda v, b: dx.sparse_solve(v, PATTERN, b))["power"]
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(v32, b32)
    assert value.dtype == jnp.float32 and grads[0].dtype == grads[1].dtype == jnp.float32
    want_value, want_grads = jax.value_and_grad(losses(dense)["power"], argnums=(0, 1))(VALUES, B)
    assert_tree_allclose((value, grads), (want_value, want_grads), rtol=2e-6, atol=1e-6)


@pytest.mark.skipif(float32(), reason="inside the program sparsax factors in float64, which needs x64 (off here)")
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
def test_half_precision_inputs_are_solved_in_float64_and_rounded(dtype, jit):
    """float16 and bfloat16 (real, both) are promoted to float64 inside the program, and the
    value and gradients rounded back: against a dense float32 solve of the same rounded entries,
    to the half precision's accuracy (a few of its epsilons)."""
    v16, b16 = VALUES.astype(dtype), B.astype(dtype)
    loss = losses(lambda v, b: dx.sparse_solve(v, PATTERN, b, nonfinite="nan", where="program"))["power"]
    fn = jax.value_and_grad(loss, argnums=(0, 1))
    fn = jax.jit(fn) if jit else fn
    with Counted() as counted:
        got = jax.block_until_ready(fn(v16, b16))
    assert (counted.factorisations, counted.jobs) == (1, 0)
    assert all(a.dtype == dtype for a in jax.tree.leaves(got))
    want = jax.value_and_grad(losses(dense)["power"], argnums=(0, 1))(v16.astype(jnp.float32), b16.astype(jnp.float32))
    eps = float(jnp.finfo(dtype).eps)
    for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        w = np.asarray(w, np.float64)
        np.testing.assert_allclose(np.asarray(a, np.float64), w, rtol=4 * eps, atol=4 * eps * np.abs(w).max())


def test_symmetric_true_solves_the_adjoint_with_the_matrix_itself_as_the_host_does():
    values, pattern = operator(4)  # (not symmetric: the answers differ from the true gradient)
    b, w = jnp.asarray(RNG.normal(size=(2, pattern.n)))

    def loss(v, b, where="auto"):
        return jnp.dot(w, dx.sparse_solve(v, pattern, b, symmetric=True, where=where, nonfinite="nan")) ** 2

    with Counted() as counted:
        got = jax.grad(loss, argnums=(0, 1))(values, b)
    assert (counted.factorisations, counted.jobs) == (1, 0)
    want = jax.grad(lambda v, b: loss(v, b, where="host"), argnums=(0, 1))(values, b)
    assert_tree_allclose(got, want)

    # in plain JAX: a dense solve whose backward solves with `A` itself, as jax_fdm's does
    @jax.custom_vjp
    def assumed_symmetric(v, b):
        return dense(v, b, pattern)

    def fwd(v, b):
        x = dense(v, b, pattern)
        return x, (v, x)

    def bwd(res, ct):
        v, x = res
        lam = jnp.linalg.solve(pattern.todense(v), ct)
        return -lam[pattern.rows] * x[pattern.cols], lam

    assumed_symmetric.defvjp(fwd, bwd)
    plain = jax.grad(lambda v, b: jnp.dot(w, assumed_symmetric(v, b)) ** 2, argnums=(0, 1))(values, b)
    assert_tree_allclose(got, plain)
    true = jax.grad(lambda v, b: jnp.dot(w, dense(v, b, pattern)) ** 2, argnums=(0, 1))(values, b)
    assert not np.allclose(got[1], true[1])


def test_what_runs_on_the_host_and_why():
    """Complex inputs, a given solver, executor or cost, the host-only treatments, and a large
    pattern run on the host (with their jobs); `where="program"` says why it cannot."""
    complex_b = B.astype(jnp.complex128)
    cases = {
        "sparsax solves real matrices only": dict(b=complex_b),
        "a `solver` was given, which the host's solve uses": dict(solver=dx.SuperLU()),
        "a `cost` was given, which the host's solve uses": dict(cost=dx.Cost(setup=1.0)),
        "`nonfinite='warn'` and `singular='raise'` are kept on the host": dict(nonfinite="warn"),
        "`nonfinite='raise'` and `singular='nan'` are kept on the host (inside the program: `nonfinite` "
        '"raise" or "nan", `singular="raise"`)': dict(singular="nan"),
    }
    for why, options in cases.items():
        b = options.pop("b", B)
        with Counted() as counted:
            jax.block_until_ready(dx.sparse_solve(VALUES, PATTERN, b, **options))
        assert counted.jobs == 1 and counted.factorisations == 0, why
        message = (
            "`dx.sparse_solve(name='fe')`: `where=\"program\"`, but this solve cannot run inside the program: " + why
        )
        with pytest.raises(ValueError, match=re.escape(message)):
            dx.sparse_solve(VALUES, PATTERN, b, name="fe", where="program", **options)
    with Counted() as counted:
        jax.block_until_ready(dx.sparse_solve(VALUES, PATTERN, B, where="host"))
    assert (counted.jobs, counted.factorisations) == (1, 0)


def test_a_pattern_whose_factorisation_pays_for_round_trips_runs_on_the_host(monkeypatch):
    monkeypatch.setattr(_program, "trial_seconds", lambda pattern: 0.05)
    assert _program.refusal(PATTERN, np.dtype(np.float64), by_cost=True) == (
        "a factorisation takes about 50 ms here, which pays for a host site's round trips"
    )
    values = new(VALUES)
    with Counted() as counted:
        x = jax.block_until_ready(dx.sparse_solve(values, PATTERN, B))
    assert (counted.jobs, counted.factorisations) == (1, 0)
    with Counted() as counted:  # (`where="program"` takes it inside whatever it costs)
        y = jax.block_until_ready(dx.sparse_solve(values, PATTERN, B, where="program"))
    assert (counted.jobs, counted.factorisations) == (0, 1)
    assert_tree_allclose(x, y)


def test_the_trial_factorisation_measures_the_pattern_once():
    _, pattern = operator(7)
    t = _program.trial_seconds(pattern)
    assert 0 < t < 1 and _program.trial_seconds(pattern) == t
    permutation = dx.SparsePattern(np.array([0, 1]), np.array([1, 0]), 2)  # (no diagonal: random values)
    assert 0 < _program.trial_seconds(permutation) < 1
    empty_column = dx.SparsePattern(np.array([0, 1]), np.array([0, 0]), 2)
    assert _program.trial_seconds(empty_column) is None
    assert _program.refusal(empty_column, np.dtype(np.float64), by_cost=True) == (
        "a trial factorisation of its pattern failed (the pattern is structurally singular)"
    )


def test_without_x64_it_runs_on_the_host_in_every_thread():
    """`jax_enable_x64` is read where the solve is traced: a thread with it off runs the solve
    on the host, another thread with it on inside the program."""
    seen = {}

    def run(x64, key):
        with jax.enable_x64(x64):
            v, b = new(VALUES).astype(jnp.float32), B.astype(jnp.float32)
            with Counted() as counted:
                x = jax.block_until_ready(dx.sparse_solve(v, PATTERN, b))
            seen[key] = (counted.jobs, counted.factorisations, x.dtype)

    for x64 in (False, True):  # (one thread after the other: the counts are the process's)
        thread = threading.Thread(target=run, args=(x64, x64))
        thread.start()
        thread.join()
    assert seen == {False: (1, 0, jnp.float32), True: (0, 1, jnp.float32)}
    with jax.enable_x64(False):
        message = "sparsax factors in float64, which needs `jax_enable_x64`"
        with pytest.raises(ValueError, match=re.escape(message)):
            dx.sparse_solve(
                VALUES.astype(jnp.float32), PATTERN, B.astype(jnp.float32), nonfinite="nan", where="program"
            )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_nan_entry_gives_nan_inside_with_nonfinite_nan(jit):
    """`nonfinite="nan"` inside the program: the value and every gradient NaN, the next call right."""
    values = VALUES.at[3].set(jnp.nan)
    wrap = jax.jit if jit else (lambda f: f)
    loss = wrap(jax.value_and_grad(lambda v, b: jnp.sum(dx.sparse_solve(v, PATTERN, b, nonfinite="nan") ** 2), (0, 1)))
    with Counted() as counted:
        value, (g_values, g_b) = loss(values.at[5].set(jnp.inf), B)
    assert counted.jobs == 0 and np.isnan(value) and np.isnan(g_values).all() and np.isnan(g_b).all()
    assert_tree_allclose(loss(VALUES, B), jax.value_and_grad(losses(dense)["power"], (0, 1))(VALUES, B))


NOT_FINITE = (
    "`values` holds 2 NaN or infinite entries of {nnz} (the first: `values[3] = nan`, at row {row}, column {col}), "
    "so the matrix cannot be factored.\nFind where they come from, for example with "
    '`jax.config.update("jax_debug_nans", True)`, or `jnp.isfinite(values).all()` before the solve.'
)


@pytest.mark.parametrize(
    "how", ["eager", "jit", "grad", "jit grad", "jvp", "jit vmap", "jit vmap grad", "jit hessian", "value_and_grad"]
)
def test_a_nan_entry_raises_the_host_s_error_from_inside_the_program(how):
    """The default `nonfinite="raise"` inside the program: a NaN or infinite entry raises the
    host path's message, naming the call and the first entry: a `ValueError` where the values
    are concrete, from the compiled program otherwise (a `vmap` over matrices, one of them
    bad, raises for the step). No host job, and a program of finite entries runs no callback:
    the same programs give a dense solve's answers right after."""
    bad = VALUES.at[3].set(jnp.nan).at[5].set(jnp.inf)
    row, col = int(PATTERN.rows[3]), int(PATTERN.cols[3])
    message = "`dx.sparse_solve(name='fe')`, solved inside the program: " + NOT_FINITE.format(
        nnz=PATTERN.nnz, row=row, col=col
    )

    def loss(v, b):
        return jnp.sum(dx.sparse_solve(v, PATTERN, b, name="fe") ** 2)

    def want(v, b):
        return jnp.sum(dense(v, b) ** 2)

    grad = jax.grad(loss, (0, 1))
    programs = {
        "eager": (lambda v: dx.sparse_solve(v, PATTERN, B, name="fe"), lambda v: dense(v, B)),
        "jit": (jax.jit(lambda v: loss(v, B)), lambda v: want(v, B)),
        "grad": (lambda v: grad(v, B), lambda v: jax.grad(want, (0, 1))(v, B)),
        "jit grad": (jax.jit(lambda v: grad(v, B)), lambda v: jax.grad(want, (0, 1))(v, B)),
        "jvp": (
            lambda v: jax.jvp(lambda v: loss(v, B), (v,), (jnp.ones_like(v),)),
            lambda v: jax.jvp(lambda v: want(v, B), (v,), (jnp.ones_like(v),)),
        ),
        "jit vmap": (
            jax.jit(lambda v: jax.vmap(loss, (0, None))(jnp.stack([2.0 * VALUES, v]), B)),
            lambda v: jax.vmap(want, (0, None))(jnp.stack([2.0 * VALUES, v]), B),
        ),
        "jit vmap grad": (
            jax.jit(lambda v: jax.vmap(grad, (0, None))(jnp.stack([v, 2.0 * VALUES]), B)),
            lambda v: jax.vmap(jax.grad(want, (0, 1)), (0, None))(jnp.stack([v, 2.0 * VALUES]), B),
        ),
        "jit hessian": (jax.jit(lambda v: jax.hessian(loss)(v, B)), lambda v: jax.hessian(want)(v, B)),
        "value_and_grad": (
            lambda v: dx.filter_value_and_grad(lambda v: loss(v, B))(v),
            lambda v: jax.value_and_grad(lambda v: want(v, B))(v),
        ),
    }
    ours, reference = programs[how]
    concrete = how in ("eager", "grad", "jvp")
    with Counted() as counted:
        with pytest.raises(ValueError if concrete else jax.errors.JaxRuntimeError, match=re.escape(message)):
            jax.block_until_ready(ours(bad))
        assert_tree_allclose(ours(VALUES), reference(VALUES))
    assert counted.jobs == 0
    host = "`ExpensiveFn(name='fe')`: the host function `fwd` raised ValueError: " + NOT_FINITE.format(
        nnz=PATTERN.nnz, row=row, col=col
    )
    with pytest.raises(dx.HostError, match=re.escape(host)):  # (the host path's, word for word)
        dx.sparse_solve(bad, PATTERN, B, name="fe", where="host")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("where", ["auto", "program", "host"])
def test_a_nan_in_one_block_gives_nan_everywhere_on_every_path(where, jit):
    """A block-diagonal matrix with a NaN in its first block, and a loss of the second block's
    solution alone: the value, both gradients and a tangent are NaN on every path, as the docs
    promise for `nonfinite="nan"`, so that a NaN guard sees the step whatever the system's size.
    (Inside the program KLU gave NaN in the first block only, and the loss was finite.)"""
    two = jax.scipy.linalg.block_diag(PATTERN.todense(VALUES), PATTERN.todense(VALUES))
    values, pattern = dx.SparsePattern.from_scipy(scipy.sparse.csc_matrix(np.asarray(two)))
    values = jnp.asarray(values).at[0].set(jnp.nan)  # (column 0: the first block)
    b = jnp.concatenate([B, B])

    def loss(v, b):
        return jnp.sum(dx.sparse_solve(v, pattern, b, nonfinite="nan", where=where)[N:] ** 2)

    wrap = jax.jit if jit else (lambda f: f)
    with Counted() as counted:
        value, (g_values, g_b) = wrap(jax.value_and_grad(loss, (0, 1)))(values, b)
        _, tangent = wrap(lambda v, t: jax.jvp(lambda v: loss(v, b), (v,), (t,)))(values, jnp.ones_like(values))
    assert (counted.jobs > 0) == (where == "host")  # (inside the program: no host job)
    assert np.isnan(value) and np.isnan(g_values).all() and np.isnan(g_b).all() and np.isnan(tangent)
    # the same matrix without the NaN: the loss of the second block, finite, as a dense solve gives it
    finite = jnp.asarray(dx.SparsePattern.from_scipy(scipy.sparse.csc_matrix(np.asarray(two)))[0])
    want = jax.value_and_grad(lambda v, b: jnp.sum(jnp.linalg.solve(pattern.todense(v), b)[N:] ** 2), (0, 1))(finite, b)
    assert_tree_allclose(wrap(jax.value_and_grad(loss, (0, 1)))(finite, b), want)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nonfinite", ["raise", "nan"])
def test_four_threads_solve_at_once_without_a_hang(nonfinite):
    """Programs with the solve inside, run from four threads at once, each its own matrices,
    every answer against a dense solve (a host callback run on every call of the same program
    once hung this; with `nonfinite="raise"` the program holds one, on a branch it never takes)."""
    wrong = []

    def run(seed):
        values = VALUES * (1.0 + 0.1 * seed)
        grad = jax.jit(jax.grad(losses(lambda v, b: dx.sparse_solve(v, PATTERN, b, nonfinite=nonfinite))["power"]))
        want_fn = jax.grad(losses(dense)["power"])
        for i in range(40):
            v = values * (1.0 + 1e-3 * (i % 7))
            if not np.allclose(grad(v, B), want_fn(v, B), rtol=1e-9, atol=1e-12):
                wrong.append((seed, i))

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_a_singular_matrix_stops_the_program_with_sparsax_s_error():
    """Inside the program the factorisation's failure is sparsax's error (it cannot name the
    call); on the host it is deferax's (tests/test_sparse_solve.py)."""
    pattern = dx.SparsePattern(np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1]), 2)
    with pytest.raises(jax.errors.JaxRuntimeError, match="klu_factor failed .*singular"):
        jax.block_until_ready(dx.sparse_solve(jnp.array([1.0, 2.0, 2.0, 4.0]), pattern, jnp.ones(2)))


def test_a_bad_where_names_the_call():
    message = (
        '`dx.sparse_solve(name=\'fe\')`: `where` must be "auto", "host" or "program", but got \'gpu\'.\n'
        '"auto" (the default) solves a small real system inside the program and any other on the host.'
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        dx.sparse_solve(VALUES, PATTERN, B, name="fe", where="gpu")


def test_in_a_process_of_several_devices_nonfinite_raise_stays_on_the_host(monkeypatch):
    """With several devices, a NaN entry raised inside a program of sharded inputs stopped one
    device and left the other waiting in a collective (a hang, seen with two CPU devices): the
    default `nonfinite="raise"` stays on the host there, and `"nan"` runs inside."""
    monkeypatch.setattr(jax, "devices", lambda *a: [object(), object()])
    values = new(VALUES)
    with Counted() as counted:
        x = jax.block_until_ready(dx.sparse_solve(values, PATTERN, B))
    assert (counted.jobs, counted.factorisations) == (1, 0)
    assert_tree_allclose(x, dense(values, B))
    message = (
        "this solve cannot run inside the program: `nonfinite='raise'` is kept on the host in a process of several "
        "devices"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        dx.sparse_solve(VALUES, PATTERN, B, where="program")
    with Counted() as counted:
        jax.block_until_ready(dx.sparse_solve(new(VALUES), PATTERN, B, nonfinite="nan"))
    assert (counted.jobs, counted.factorisations) == (0, 1)
