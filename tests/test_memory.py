"""The memory of `dx.sparse_solve`'s factorisations kept between the forward and the backward
pass: the store bounded by bytes (`dx.set_factorisation_budget`), the fallback past the
budget (the backward pass factors again, and the plan says so), and a process pool, whose
workers keep none (its backward job may land in another process).

Gradients against a dense `jnp.linalg.solve`; factorisations counted through the solver hook
(in this process, or by files that the pool's workers leave)."""

import concurrent.futures as cf
import gc
import multiprocessing
import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse

import deferax as dx
from deferax._sparse import _factorisations

from .helpers import CountingLU, RecordingLU, Tally, assert_tree_allclose, runs

M = 6  # a 6 x 6 grid: 36 unknowns


def operator(m, shift):
    """A convection-diffusion operator on an `m x m` grid (not symmetric), `(values, pattern)`."""
    d = scipy.sparse.diags([-1.3, 4.5 + shift, -0.7], [-1, 0, 1], shape=(m, m))
    e = scipy.sparse.diags([-1.1, -0.9], [-1, 1], shape=(m, m))
    a = scipy.sparse.kron(scipy.sparse.identity(m), d) + scipy.sparse.kron(e, scipy.sparse.identity(m))
    values, pattern = dx.SparsePattern.from_scipy(a.tocsc())
    return jnp.asarray(values), pattern


SITES = [operator(M, 0.0), operator(M, 0.5)]  # two matrices, two sites
B = jnp.linspace(1.0, 2.0, M * M)


def loss_of(solve):
    """Not linear in the solutions (a standard schedule for `jax.grad`, and for
    `dx.filter_value_and_grad` with `max_basis=0`)."""

    def loss(vs):
        return sum(jnp.sum(solve(v, p) ** 2) for v, (_, p) in zip(vs, SITES, strict=True))

    return loss


def dense(v, p):
    return jnp.linalg.solve(p.todense(v), B)


VALUES = tuple(v for v, _ in SITES)
EXPECTED = jax.value_and_grad(loss_of(dense))(VALUES)


def one_factorisation_nbytes():
    """The bytes of one site's factorisation, as the store counts them."""
    v, p = SITES[0]
    values = np.asarray(v, np.float64)
    lu = dx.SuperLU().factor(scipy.sparse.csc_matrix((values, (p.rows, p.cols)), shape=(p.n, p.n)))
    return dx.SuperLU().nbytes(lu, np.dtype(np.float64))


def gradient(how, tally, jit):
    solve = lambda v, p: dx.sparse_solve(v, p, B, solver=CountingLU(tally), max_basis=0)  # noqa: E731
    fn = jax.value_and_grad(loss_of(solve)) if how == "jax.grad" else dx.filter_value_and_grad(loss_of(solve))
    return eqx.filter_jit(fn) if jit else fn


# ----------------------------------------------------------------------------- past the budget


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("how", ["jax.grad", "dx.filter_value_and_grad"])
@pytest.mark.parametrize("past", [False, True], ids=["under the budget", "past the budget"])
def test_past_the_budget_the_backward_pass_factors_again(how, jit, past):
    """Two sites on the standard schedule: one factorisation a site per gradient under the
    budget (the backward pass finds the forward's), two past it (none is kept); the right
    gradient either way, and the store never holds more than the budget."""
    nbytes = one_factorisation_nbytes()
    budget = nbytes // 2 if past else 2 * nbytes  # (past: neither fits; under: both fit, each kept for a while)
    dx.set_factorisation_budget(budget)
    tally = Tally()
    step = gradient(how, tally, jit)
    for _ in range(2):  # (under `jit`: the first call compiles)
        tally.factor = 0
        got = jax.block_until_ready(step(VALUES))
        assert_tree_allclose(got, EXPECTED, rtol=1e-11, atol=1e-12)
        assert tally.factor == (4 if past else 2)  # two sites
        assert tally.most <= budget
        gc.collect()
        assert _factorisations.FACTORISATIONS.nbytes <= budget
    gc.collect()  # (eagerly, kept until the forward's output is collected)
    assert len(_factorisations.FACTORISATIONS) == 0


def test_the_store_keeps_the_newest_that_fit_the_budget():
    """Three forward passes whose backward passes have not come (a `jax.vjp` each, its
    output alive), in a budget for two: the oldest is dropped; a smaller budget drops the
    next. Their backward passes factor again where theirs is gone, with the right gradient."""
    nbytes = one_factorisation_nbytes()
    dx.set_factorisation_budget(2 * nbytes + nbytes // 2)
    tally = Tally()
    v, p = SITES[0]
    solve = lambda v: dx.sparse_solve(v, p, B, solver=CountingLU(tally))  # noqa: E731
    passes = [jax.vjp(solve, v * (1.0 + 0.1 * i)) for i in range(3)]
    assert len(_factorisations.FACTORISATIONS) == 2
    assert _factorisations.FACTORISATIONS.nbytes <= 2 * nbytes + nbytes // 2
    assert tally.factor == 3
    dx.set_factorisation_budget(nbytes + nbytes // 2)  # (room for one: the newest)
    assert len(_factorisations.FACTORISATIONS) == 1
    assert _factorisations.FACTORISATIONS.nbytes <= nbytes + nbytes // 2
    for i in (2, 1, 0):  # the newest reuses its factorisation, the two others factor again
        w = v * (1.0 + 0.1 * i)
        expected = jax.vjp(lambda w: jnp.linalg.solve(p.todense(w), B), w)[1](B)
        assert_tree_allclose(passes[i][1](B), expected, rtol=1e-11, atol=1e-12)
    assert tally.factor == 3 + 2
    assert tally.most <= 2 * nbytes + nbytes // 2
    del passes
    gc.collect()
    assert len(_factorisations.FACTORISATIONS) == 0


def test_a_store_never_holds_more_than_its_budget():
    """The store alone, with made-up sizes: each made factorisation is fitted in, dropping
    the oldest; one past the budget on its own is returned but not kept."""
    store = _factorisations.Store(limit=8, budget=100)
    sizes = {"a": 40, "b": 40, "c": 40, "big": 150}
    for key in ("a", "b", "c"):
        assert store.acquire(key, lambda key=key: f"lu {key}", lambda lu: sizes[lu.split()[1]]) == f"lu {key}"
        assert store.nbytes <= 100
    assert list(store._entries) == ["b", "c"]
    assert store.acquire("big", lambda: "lu big", lambda lu: sizes["big"]) == "lu big"
    assert list(store._entries) == ["b", "c"] and store.nbytes == 80
    store.set_budget(50)
    assert list(store._entries) == ["c"] and store.nbytes == 40


def test_explain_says_past_the_budget_and_estimates_the_second_factorisation():
    """Known before any factorisation (the matrix's own entries are past a tiny budget), then
    from the first's measured bytes; the standard schedule's estimate counts the second
    factorisation, so a site whose deferred-basis schedule was estimated slower is deferred."""
    v, p = SITES[0]
    cost = dx.Cost(setup=10.0, fwd=1.0, bwd=1.0)

    def loss(v, b):  # two fixed cotangents (k = 2)
        x = dx.sparse_solve(v, p, b, cost=cost)
        return x[0] * x[1]

    stage = 1e-3
    site = dx.explain(loss, v, B).sites[0]
    assert site.schedule == "standard"  # 10 + 1 + 1 + 2 stages < 10 + 1 + 2 + 1 stage
    assert site.estimates == dx.Estimates(standard=12.0 + 2 * stage, deferred=13.0 + stage, source="hint")

    dx.set_factorisation_budget(100)
    site = dx.explain(loss, v, B).sites[0]
    assert site.schedule == "deferred-basis"  # 10 + 1 + 10 + 1 + 2 stages > 13 + 1 stage
    assert (site.estimates.standard, site.estimates.deferred) == (22.0 + 2 * stage, 13.0 + stage)
    nnz_bytes = len(set(zip(p.rows.tolist(), p.cols.tolist(), strict=True))) * 8
    assert nnz_bytes == 1248  # (156 positions of 8 bytes)
    assert site.estimates.note == (
        "its factorisation (at least 1.25 KB, its matrix's entries) is past the factorisation budget (100 bytes, "
        "`dx.set_factorisation_budget`): it is not kept for the backward pass, which factors again"
    )

    def superlu(v):  # (SuperLU: the bytes its factors hold are known exactly)
        return jnp.sum(dx.sparse_solve(v, p, B, solver=dx.SuperLU()) ** 2)

    jax.grad(superlu)(v)  # (one factorisation: its bytes measured)
    note = dx.explain(superlu, v).sites[0].estimates.note
    measured = one_factorisation_nbytes()
    assert note.startswith(f"its factorisation ({measured / 1e3:.3g} KB) is past the factorisation budget")
    assert f"{measured / 1e3:.3g} KB" in str(dx.explain(superlu, v))

    dx.set_factorisation_budget(None)
    assert dx.explain(loss, v, B).sites[0].estimates.note is None


def test_the_default_budget_is_a_quarter_of_the_machines_memory():
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert dx.factorisation_budget() == memory // 4
    assert dx.set_factorisation_budget(1000) == memory // 4
    assert dx.factorisation_budget() == 1000
    assert dx.set_factorisation_budget(None) == 1000
    assert dx.factorisation_budget() == memory // 4


@pytest.mark.parametrize("found", [-1, 1.5, True, "1GB"])
def test_a_wrong_budget_is_refused(found):
    default = _factorisations._bytes_text(_factorisations.default_budget())
    message = (
        "`dx.set_factorisation_budget`: `nbytes` must be a non-negative int (bytes), or None for the default "
        f"({default}, a quarter of this machine's memory), but got {found!r}.\n"
        "Give a number of bytes, for example `dx.set_factorisation_budget(2 * 2**30)` for 2 GiB."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        dx.set_factorisation_budget(found)


def test_a_solvers_factorisation_bytes():
    """SuperLU's: its factors' entries, an index each, and its permutations; a dense LU's
    (NumPy arrays, the hook's default) their own bytes."""
    v, p = SITES[0]
    matrix = scipy.sparse.csc_matrix((np.asarray(v), (p.rows, p.cols)), shape=(p.n, p.n))
    lu = scipy.sparse.linalg.splu(matrix)
    assert dx.SuperLU().nbytes(lu, np.dtype(np.complex128)) == lu.nnz * 20 + 2 * 4 * p.n
    dense_lu = scipy.linalg.lu_factor(matrix.toarray())

    class DenseLU(dx.AbstractSparseSolver):
        def factor(self, matrix):
            return scipy.linalg.lu_factor(matrix.toarray())

        def solve(self, factorisation, rhs, transpose):
            return scipy.linalg.lu_solve(factorisation, rhs, trans=1 if transpose else 0)

    assert DenseLU().nbytes(dense_lu, np.dtype(np.float64)) == p.n * p.n * 8 + dense_lu[1].nbytes
    assert DenseLU().nbytes(lu, np.dtype(np.float64)) == lu.nnz * 12 + 2 * 4 * p.n  # (`splu`'s, recognised)


# ----------------------------------------------------------------------------- a process pool


def worker_store(barrier):
    """In a worker: its process id and the factorisations its store keeps (after waiting for
    the other worker, so that each worker answers once)."""
    barrier.wait(timeout=60)
    from deferax._sparse import _factorisations

    return os.getpid(), len(_factorisations.FACTORISATIONS), _factorisations.FACTORISATIONS.nbytes


@pytest.fixture(scope="module")
def pool():
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, cf.ProcessPoolExecutor(2, mp_context=context) as pool:
        barrier = manager.Barrier(2)
        both = [pool.submit(worker_store, barrier) for _ in range(2)]  # (both workers started)
        assert len({f.result(timeout=120)[0] for f in both}) == 2
        yield pool, barrier


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_process_pools_workers_keep_no_factorisation(pool, tmp_path, jit):
    """A process pool cannot send a backward job to the process that factored: its workers
    keep nothing (they kept each forward's factorisation, up to the store's limit each, when
    the backward job landed in the other), and the backward passes factor again: two
    factorisations a site, the right gradient, and the plan says so."""
    pool, barrier = pool
    directory = str(tmp_path)
    solve = lambda v, p: dx.sparse_solve(v, p, B, solver=RecordingLU(directory), executor=pool)  # noqa: E731
    fn = jax.value_and_grad(loss_of(solve))
    fn = jax.jit(fn) if jit else fn
    for _ in range(3):
        got = fn(VALUES)
        assert_tree_allclose(got, EXPECTED, rtol=1e-11, atol=1e-12)
    stores = [f.result(timeout=120) for f in [pool.submit(worker_store, barrier) for _ in range(2)]]
    assert len({pid for pid, _, _ in stores}) == 2
    assert [(kept, nbytes) for _, kept, nbytes in stores] == [(0, 0), (0, 0)]
    counts, _ = runs(directory)
    assert counts == {"factor": 3 * 4}  # per gradient: two sites, each factored forward and backward
    note = dx.explain(loss_of(solve), VALUES).sites[0].estimates.note
    assert note == (
        "its jobs run on a ProcessPoolExecutor, which cannot send the backward job to the process that factored: "
        "the factorisation is not kept for the backward pass, which factors again"
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_forward_beside_a_deferred_site_keeps_its_factorisation(jit):
    """A standard site's forward runs in stage 2 beside a deferred site (under `jit`, inside
    their one callback): its factorisation waits for the backward pass all the same, one
    factorisation a step (it was two under `jit`: the callback's output let it go)."""
    tally = Tally()
    m = np.diag([2.0, 3.0, 4.0])
    d = dx.host(lambda x: m @ x, adjoint=lambda x, ct: m.T @ ct, out=lambda s: s, name="d")
    v, p = SITES[0]

    def loss(args, d=d, solve=lambda v: dx.sparse_solve(v, p, B, solver=CountingLU(tally), max_basis=0)):
        v, x = args
        return jnp.sum(d(x)) + jnp.sum(solve(v) ** 2)

    assert dx.explain(loss, (v, B[:3])).stages[0] == ("d: fused", "sparse_solve: fwd")
    fn = dx.filter_value_and_grad(loss)
    fn = jax.jit(fn) if jit else fn
    want = jax.value_and_grad(lambda args: loss(args, lambda x: jnp.asarray(m) @ x, lambda v: dense(v, p)))((v, B[:3]))
    for _ in range(2):
        # (eagerly the forward's factorisation is leased to its output until that is collected:
        # on jax 0.12 a cycle holds it past the call, and a next call of the same matrix would
        # find it kept)
        gc.collect()
        tally.factor = 0
        assert_tree_allclose(fn((v, B[:3])), want, rtol=1e-11, atol=1e-12)
        assert tally.factor == 1
    gc.collect()
    assert len(_factorisations.FACTORISATIONS) == 0


# ----------------------------------------------------------------------------- solves that nothing differentiates

STEPS = 20
SCALES = jnp.array([1.0, 1.1])
RIGHT_HAND_SIDES = jnp.stack([B, 2.0 * B, B[::-1]])


def still_losses(solve, still):
    """Losses of `(v, w)` whose solves with `w` (`still(w, pattern, b)`; `dx.filter_value_and_grad`
    differentiates `v` only) nothing differentiates, beside other sites (`solve`)."""
    (_, p), (_, q) = SITES
    return {
        # (the deferred site runs in stage 2: the other's forward beside it, ahead)
        "beside a deferred site": lambda v, w: jnp.sum(solve(v, p, B)) + jnp.sum(still(w, q, B) ** 2),
        # (the two forward jobs at once, one backward job)
        "beside a standard site": lambda v, w: jnp.sum(solve(v, p, B) ** 2) + jnp.sum(still(w, q, B) ** 2),
        # (the solve runs in the program)
        "alone": lambda v, w: jnp.sum(v**2) + jnp.sum(still(w, q, B) ** 2),
        "inside lax.scan": lambda v, w: (
            jnp.sum(v**2) + jax.lax.scan(lambda c, s: (c + jnp.sum(still(s * w, q, B) ** 2), None), 0.0, SCALES)[0]
        ),
        "under vmap over b": lambda v, w: (
            jnp.sum(solve(v, p, B)) + jnp.sum(jax.vmap(lambda b: still(w, q, b))(RIGHT_HAND_SIDES) ** 2)
        ),
    }


# per step: (factorisations, solve calls); and the top-level positions of the solves with `w`
STILL = {
    "beside a deferred site": ((2, 3), [1]),  # v: one job, b and the adjoint; w: b
    "beside a standard site": ((2, 3), [1]),  # v: b, then the adjoint; w: b (no adjoint)
    "alone": ((1, 1), [0]),
    "inside lax.scan": ((2, 2), []),  # (two matrices, `s * w`; no plan row of its own)
    "under vmap over b": ((2, 3), [1]),  # w: its 3 right-hand sides in one call
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", list(STILL))
def test_a_step_leaves_nothing_for_solves_that_nothing_differentiates(case, jit):
    """`jax.jit(dx.filter_value_and_grad(loss))`, whose loss also solves with `values` it does
    not differentiate: after each of 20 steps, the store holds nothing (no backward pass comes
    for that solve, and its forward keeps nothing for one: deferax planned the step so), each
    matrix factored once a step, no adjoint solved for it; plain JAX's value and gradient.
    Eagerly the same, once the step's outputs are collected."""
    tally = Tally()
    solve = lambda v, p, b, name="sparse_solve": dx.sparse_solve(v, p, b, solver=CountingLU(tally), name=name)  # noqa: E731
    loss = still_losses(solve, lambda w, q, b: solve(w, q, b, "still"))[case]
    dense = lambda v, p, b: jnp.linalg.solve(p.todense(v), b)  # noqa: E731
    want = jax.jit(jax.value_and_grad(still_losses(dense, dense)[case]))
    (counts, still), (v, w) = STILL[case], VALUES
    fn = dx.filter_value_and_grad(loss)
    step = jax.jit(fn) if jit else fn
    for n in range(STEPS):
        scale = 1.0 + 0.01 * n  # (a new matrix each step: a factorisation left behind would stay)
        tally.factor = tally.solves = 0
        got = jax.block_until_ready(step(scale * v, scale * w))
        assert_tree_allclose(got, want(scale * v, scale * w), rtol=1e-10, atol=1e-12)
        del got
        if not jit:  # (eagerly, a differentiated forward's factorisation is leased to its output)
            gc.collect()
        assert len(_factorisations.FACTORISATIONS) == 0, n
        assert (tally.factor, tally.solves) == counts, n
    plan = dx.explain(fn, v, w)
    for i in still:
        assert plan.sites[i].name == "still" and plan.sites[i].schedule == "standard"
        assert plan.sites[i].reason.startswith(
            "its input depends on no differentiated argument: no backward pass runs for it"
        )
    if still:  # (no backward row for it in the plan)
        assert [row for stage in plan.stages for row in stage if row.startswith("still: bwd")] == []


@pytest.mark.parametrize("vmapped", [False, True], ids=["one", "vmap over b"])
def test_a_call_outside_any_transformation_keeps_nothing(vmapped):
    """`dx.sparse_solve` called on concrete arrays, outside any transformation, 20 times: no
    backward pass can follow such a call, so the store holds nothing right after it (while its
    output is alive; it once held the factorisation until the output was collected, which on
    jax 0.12 waits for the garbage collector), each call factors once, and the dense solve's
    answer."""
    tally = Tally()
    v, p = SITES[0]
    for n in range(STEPS):
        scale = 1.0 + 0.01 * n
        tally.factor = 0
        if vmapped:
            bs = jnp.stack([B, 2.0 * B])
            x = jax.vmap(lambda b, s=scale: dx.sparse_solve(s * v, p, b, solver=CountingLU(tally)))(bs)
            want = jax.vmap(lambda b, s=scale: jnp.linalg.solve(p.todense(s * v), b))(bs)
        else:
            x = dx.sparse_solve(scale * v, p, B, solver=CountingLU(tally))
            want = dense(scale * v, p)
        assert len(_factorisations.FACTORISATIONS) == 0, n
        assert tally.factor == 1, n
        assert_tree_allclose(x, want, rtol=1e-10, atol=1e-12)


AUX_LOSSES = {
    "standard": lambda x: jnp.sum(x**2),  # (the forward's factorisation waits for the adjoint)
    "deferred": lambda x: jnp.sum(x),  # (one job: factor, solve both)
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("schedule", list(AUX_LOSSES))
def test_an_aux_that_returns_the_solution_keeps_no_factorisation(schedule, jit):
    """Five steps whose aux returns the solution `x`, every aux kept by the caller: once
    `dx.filter_value_and_grad` has returned, no backward pass of its own can come, so the store
    holds nothing (eagerly the forward's factorisation was leased to `x` for as long as the
    caller held it: five steps held five). One factorisation a step; plain JAX's answers."""
    tally = Tally()
    v, p = SITES[0]
    term = AUX_LOSSES[schedule]

    def loss(v, solve):
        x = solve(v)
        return term(x), x

    fn = dx.filter_value_and_grad(
        lambda v: loss(v, lambda v: dx.sparse_solve(v, p, B, solver=CountingLU(tally))), has_aux=True
    )
    assert dx.explain(fn, v).sites[0].schedule == schedule
    step = jax.jit(fn) if jit else fn
    want = jax.jit(jax.value_and_grad(lambda v: loss(v, lambda v: dense(v, p)), has_aux=True))
    kept = []
    for n in range(5):
        scale = 1.0 + 0.01 * n  # (a new matrix each step)
        tally.factor = 0
        got = step(scale * v)
        kept.append(got)
        assert_tree_allclose(got, want(scale * v), rtol=1e-10, atol=1e-12)
        assert tally.factor == 1, n
        assert len(_factorisations.FACTORISATIONS) == 0, n
    # a `jax.vjp` function may still be called later: its forward's lease lasts while `x` lives
    x, pullback = jax.vjp(lambda v: dx.sparse_solve(v, p, B, solver=CountingLU(tally)), v)
    assert len(_factorisations.FACTORISATIONS) == 1
    tally.factor = 0
    for _ in range(2):
        assert_tree_allclose(pullback(x), jax.vjp(lambda v: dense(v, p), v)[1](x), rtol=1e-10, atol=1e-12)
    assert tally.factor == 0  # (the forward's factorisation, found twice)


def test_matrices_whose_entries_hash_alike_keep_their_own_factorisations():
    """A factorisation's key hashes the entries' 64-bit words by their sum:
    entries in another order hash alike, and are told apart by their words. Two such matrices
    in one gradient: each solved with its own factorisation, against a dense solve."""
    from deferax._sparse._on_host import _Entries

    values, pattern = operator(6, 0.3)
    reordered = values[::-1]
    a, b, again = (_Entries(np.array(v)) for v in (values, reordered, values))
    assert hash(a) == hash(b) and a != b
    assert a == again and again.words is a.words  # (equal keys: the words compared once, then shared)
    assert _Entries(-0.0 * np.ones(3)) != _Entries(np.zeros(3))  # (bit for bit, as before)
    assert _Entries(np.ones(3, np.float32)) != _Entries(np.ones(2, np.float32))  # (12 and 8 bytes: words of a byte)
    rhs = jnp.linspace(1.0, 2.0, pattern.n)

    def loss(v, w, solve):
        return jnp.sum(solve(v, rhs) ** 2) + jnp.sum(jnp.sin(solve(w, rhs)))

    ours = lambda v, w: loss(v, w, lambda v, b: dx.sparse_solve(v, pattern, b, where="host"))  # noqa: E731
    reference = lambda v, w: loss(v, w, lambda v, b: jnp.linalg.solve(pattern.todense(v), b))  # noqa: E731
    with dx.record() as timeline:
        got = jax.value_and_grad(ours, argnums=(0, 1))(values, reordered)
    assert timeline.counts(steps=True)["factor"] == 2
    assert_tree_allclose(got, jax.value_and_grad(reference, argnums=(0, 1))(values, reordered), rtol=1e-9, atol=1e-12)
