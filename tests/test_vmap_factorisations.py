"""One factorisation a matrix under `jax.vmap` over right-hand sides, on every schedule, and no
factorisation held after a jitted step for the solves that nothing differentiates.

`dx.sparse_solve` vmapped over 6 right-hand sides (inside the loss, and a `vmap` of the whole
step) and an unchanged loss with `klujax.solve` of `b[n, 6]` (recognised): every value and
gradient factors the matrix once and solves its right-hand sides together (one host job a
request, one call of the solver), eagerly and under `jit`, 20 times over, where the rows' jobs
once shared a factorisation only when they happened to overlap in time. A jitted step whose
loss also solves with `values` it does not differentiate leaves nothing in the store: no
backward pass comes for that solve, and deferax plans the step knowing it. `jax.jacrev` (a
`vmap` of the VJP over its rows) and a `vmap` of a forward solve alone factor once too, and
solve all their rows in one host job.

Gradients against the same loss with a dense `jnp.linalg.solve`, in plain JAX. Factorisations
and solve calls counted by the solver (`CountingLU`) or the recording (`dx.record`, for the
recognised call, which makes its own site); host jobs by the recording."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse

import deferax as dx
from deferax._sparse import _factorisations

from .helpers import CountingLU, Tally, assert_tree_allclose

REPEATS = 20
STORE = _factorisations.FACTORISATIONS

M = 6  # a 6 x 6 grid: 36 unknowns


def operator(m):
    """A convection-diffusion operator on an `m x m` grid (not symmetric), `(values, pattern)`."""
    d = scipy.sparse.diags([-1.3, 4.5, -0.7], [-1, 0, 1], shape=(m, m))
    e = scipy.sparse.diags([-1.1, -0.9], [-1, 1], shape=(m, m))
    a = scipy.sparse.kron(scipy.sparse.identity(m), d) + scipy.sparse.kron(e, scipy.sparse.identity(m))
    values, pattern = dx.SparsePattern.from_scipy(a.tocsc())
    return jnp.asarray(values), pattern


VALUES, PATTERN = operator(M)
N = M * M
RNG = np.random.default_rng(0)
BS = jnp.asarray(RNG.normal(size=(6, N)))  # six right-hand sides
MODE = jnp.asarray(RNG.normal(size=N))


def sparse(tally, **options):
    return lambda v, b: dx.sparse_solve(v, PATTERN, b, solver=CountingLU(tally), **options)


def dense(v, b):
    return jnp.linalg.solve(PATTERN.todense(v), b)


# the readouts of the solutions `xs` (6 x N), the schedule each gets, and its `max_basis`
READOUTS = {
    "deferred": (lambda xs: jnp.sum(xs @ MODE), None),
    "deferred-basis": (lambda xs: jnp.sum((xs @ MODE) ** 2), None),  # k = 1 per right-hand side
    "standard": (lambda xs: jnp.sum(xs**4), 0),
}
# the host jobs of one value and gradient: one a request, whatever the number of right-hand sides
JOBS = {"deferred": {"fused": 1}, "deferred-basis": {"fused_batch": 1}, "standard": {"fwd": 1, "bwd": 1}}


def inside(solve, readout):
    """The loss of `(values, bs)`: `vmap` over the right-hand sides inside it."""
    return lambda vb: readout(jax.vmap(lambda b: solve(vb[0], b))(vb[1]))


def whole_step(make, solve, readout, max_basis):
    """`vmap` over the right-hand sides of the whole step, `make` (`dx.filter_value_and_grad`
    or `jax.value_and_grad`) of a loss of one."""
    loss = lambda vb: readout(solve(vb[0], vb[1])[None])  # noqa: E731
    kwargs = {} if make is jax.value_and_grad else {"max_basis": max_basis}
    return jax.vmap(make(loss, **kwargs), in_axes=((None, 0),))


def counted(fn, x, tally):
    """`fn(x)` and what one step ran, after the store is emptied: `(factorisations, solve
    calls, host jobs)`, the first two as the solver `tally` counts them, or, without one, as
    the recording does (a recognised call makes its own site)."""
    STORE.clear()
    if tally is not None:
        tally.factor = tally.solves = 0
    with dx.record() as timeline:
        got = jax.block_until_ready(fn(x))
    steps = timeline.counts(steps=True)
    factor, solves = (tally.factor, tally.solves) if tally is not None else (steps.get("factor"), steps.get("solve"))
    return got, (factor, solves, timeline.counts())


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("where", ["inside the loss", "around the step"])
@pytest.mark.parametrize("schedule", list(READOUTS))
def test_vmap_over_right_hand_sides_factors_once(schedule, where, jit):
    """20 values and gradients, each: one factorisation, the six right-hand sides in one
    solve call (the adjoints in another), one host job a request; plain JAX's numbers."""
    readout, max_basis = READOUTS[schedule]
    tally = Tally()
    if where == "inside the loss":
        fn = dx.filter_value_and_grad(inside(sparse(tally), readout), max_basis=max_basis)
        want = jax.value_and_grad(inside(dense, readout))((VALUES, BS))
        plan = dx.explain(fn, (VALUES, BS))
    else:
        fn = whole_step(dx.filter_value_and_grad, sparse(tally), readout, max_basis)
        want = whole_step(jax.value_and_grad, dense, readout, max_basis)((VALUES, BS))
        plan = dx.explain(
            dx.filter_value_and_grad(lambda vb: readout(sparse(tally)(*vb)[None]), max_basis=max_basis), (VALUES, BS[0])
        )
    assert [s.schedule for s in plan.sites] == [schedule]
    fn = jax.jit(fn) if jit else fn
    if jit:
        jax.block_until_ready(fn((VALUES, BS)))  # (compiled)
    seen = []
    for _ in range(REPEATS):
        got, counts = counted(fn, (VALUES, BS), tally)
        assert_tree_allclose(got, want, rtol=1e-10, atol=1e-12)
        seen.append(counts)
    assert seen == [(1, 2, JOBS[schedule])] * REPEATS, seen


# ----------------------------------------------------------------------------- klujax, recognised


def coo(m):
    """The same kind of operator as COO indices, each entry once, rows sorted (as KLU wants them)."""
    rows, cols, vals = [], [], []
    for i in range(m * m):
        for j, v in sorted(((i, 4.5), (i - 1, -1.3), (i + 1, -0.7), (i - m, -1.1), (i + m, -0.9))):
            if 0 <= j < m * m:
                rows.append(i), cols.append(j), vals.append(v)
    values = np.array(vals) * (1.0 + RNG.uniform(-0.1, 0.1, len(vals)))
    return np.array(rows), np.array(cols), jnp.asarray(values)


ROWS, COLS, KLU_VALUES = coo(M)
B = BS.T  # (n, 6): six right-hand sides in one call


def klu_dense(v, b):
    return jnp.linalg.solve(jnp.zeros((N, N), v.dtype).at[ROWS, COLS].add(v), b)


KLU_READOUTS = {  # of the solutions `x` (N x 6)
    "deferred": (lambda x: jnp.sum(MODE @ x), None),
    "deferred-basis": (lambda x: jnp.sum((MODE @ x) ** 2), None),
    "standard": (lambda x: jnp.sum(x**4), 0),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("schedule", list(KLU_READOUTS))
def test_klujax_with_six_right_hand_sides_factors_once(schedule, jit):
    """An unchanged loss with `klujax.solve(Ai, Aj, Ax, b[n, 6])`, recognised: 20 values and
    gradients, each one factorisation, one solve call a request, one host job a request;
    plain JAX's numbers."""
    klujax = pytest.importorskip("klujax", reason="klujax is not installed (on this Python or JAX)")
    readout, max_basis = KLU_READOUTS[schedule]

    def loss(vb, solve=lambda v, b: klujax.solve(ROWS, COLS, v, b)):
        return readout(solve(*vb))

    fn = dx.filter_value_and_grad(loss, recognise="always", max_basis=max_basis)
    plan = dx.explain(fn, (KLU_VALUES, B))
    assert [(s.name, s.schedule) for s in plan.sites] == [("klujax.solve (recognised)", schedule)]
    want = jax.value_and_grad(lambda vb: loss(vb, klu_dense))((KLU_VALUES, B))
    fn = jax.jit(fn) if jit else fn
    if jit:
        jax.block_until_ready(fn((KLU_VALUES, B)))  # (compiled)
    seen = []
    for _ in range(REPEATS):
        got, counts = counted(fn, (KLU_VALUES, B), None)
        assert_tree_allclose(got, want, rtol=1e-8, atol=1e-10)
        seen.append(counts)
    assert seen == [(1, 2, JOBS[schedule])] * REPEATS, seen


# ----------------------------------------------------------------------------- jacrev and a forward vmap

EVERY_OTHER = jnp.arange(0, N, 2)  # 18 outputs: jacrev's rows


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("argnums", [0, 1, (0, 1)], ids=["values", "b", "both"])
def test_jacrev_factors_once_and_solves_its_rows_in_one_job(argnums, jit):
    """`jax.jacrev` of 18 entries of `x = A^-1 b`, 20 times: each one factorisation, one
    forward job with one solve call, and one backward job whose one solve call takes all 18
    cotangents (jacrev is a `vmap` of the VJP over its rows); the dense Jacobian's numbers."""
    tally = Tally()
    fn = jax.jacrev(lambda v, b: sparse(tally)(v, b)[EVERY_OTHER], argnums=argnums)
    want = jax.jacrev(lambda v, b: dense(v, b)[EVERY_OTHER], argnums=argnums)(VALUES, BS[0])
    fn = jax.jit(fn) if jit else fn
    if jit:
        jax.block_until_ready(fn(VALUES, BS[0]))  # (compiled)
    seen = []
    for _ in range(REPEATS):
        got, counts = counted(lambda vb: fn(*vb), (VALUES, BS[0]), tally)
        assert_tree_allclose(got, want, rtol=1e-10, atol=1e-12)
        seen.append(counts)
    assert seen == [(1, 2, {"fwd": 1, "bwd": 1})] * REPEATS, seen


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_vmap_of_a_forward_solve_over_many_right_hand_sides_is_one_job(jit):
    """`jax.vmap` of a forward solve over 40 right-hand sides, 20 times: one factorisation,
    one solve call, one host job; the dense solve's numbers."""
    tally = Tally()
    bs = jnp.asarray(RNG.normal(size=(40, N)))
    fn = jax.vmap(lambda b: sparse(tally)(VALUES, b))
    want = jax.vmap(lambda b: dense(VALUES, b))(bs)
    fn = jax.jit(fn) if jit else fn
    if jit:
        jax.block_until_ready(fn(bs))  # (compiled)
    seen = []
    for _ in range(REPEATS):
        got, counts = counted(fn, bs, tally)
        assert_tree_allclose(got, want, rtol=1e-10, atol=1e-12)
        seen.append(counts)
    assert seen == [(1, 1, {"fwd": 1})] * REPEATS, seen
