"""sparsax's `lu_solve` (KLU) and `solve` (CHOLMOD) in an unchanged loss, recognised: where a
factorisation of the pattern takes long enough to pay for a host site (as `dx.sparse_solve`
decides by default), the call becomes a `dx.sparse_solve` site, factored once per value and
gradient by deferax, with sparsax's own values and gradients (the same loss in plain JAX) and a
dense solve's; where it does not, the call is left as it is, and `explain` says why. sparsax
0.9 and 0.10 make a `custom_vjp` call; 0.11 a `jax.lax.custom_linear_solve`: both are matched."""

import gc
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse
import sparsax  # (in the tests extra)

import deferax as dx
from deferax._recognise import _sparsax as recognised_sparsax
from deferax._sparse import _factorisations, _program

from .helpers import assert_tree_allclose
from .helpers import run_recorded as run


def coo(m, spd, lower=True, duplicate=True):
    """A convection-diffusion operator (`spd`: its symmetric diffusion part) on an `m x m`
    grid as COO `(Ai, Aj, Ax)`: for `spd` with both triangles stored (sparsax's `solve` reads
    the upper one, so the lower entries are ignored; `lower=False` leaves them out), and with
    `duplicate`, one diagonal entry split in two (sparsax sums duplicates)."""
    d = scipy.sparse.diags([-1.0, 4.5, -1.0] if spd else [-1.3, 4.5, -0.7], [-1, 0, 1], shape=(m, m))
    e = scipy.sparse.diags([-1.0, -1.0] if spd else [-1.1, -0.9], [-1, 1], shape=(m, m))
    a = (scipy.sparse.kron(scipy.sparse.identity(m), d) + scipy.sparse.kron(e, scipy.sparse.identity(m))).tocoo()
    rows, cols, values = a.row, a.col, a.data
    if spd and not lower:
        keep = rows <= cols
        rows, cols, values = rows[keep], cols[keep], values[keep]
    if duplicate:
        k = int(np.flatnonzero(rows == cols)[3])
        rows, cols = np.append(rows, rows[k]), np.append(cols, cols[k])
        values = np.append(values, 0.25 * values[k])
        values[k] *= 0.75
    values = values * (1.0 + 0.05 * np.random.default_rng(0).normal(size=values.size))  # (each entry its own)
    if spd:  # (the stored upper entries define the matrix: ignored lower entries get other values)
        values = np.where(rows > cols, 7.0, values)
    return rows.astype(np.int32), cols.astype(np.int32), jnp.asarray(values)


M = 6
N = M * M
KINDS = {"lu_solve": coo(M, spd=False), "solve": coo(M, spd=True)}
B = jnp.asarray(np.random.default_rng(1).normal(size=N))
W = jnp.asarray(np.random.default_rng(2).normal(size=N))


def dense(which, Ax, b):
    rows, cols, _ = KINDS[which]
    if which == "solve":
        keep = rows <= cols
        upper = jnp.zeros((N, N)).at[rows[keep], cols[keep]].add(Ax[keep])
        a = upper + upper.T - jnp.diag(jnp.diag(upper))
    else:
        a = jnp.zeros((N, N)).at[rows, cols].add(Ax)
    return jnp.linalg.solve(a, b)


def losses(solve):
    return {
        "linear": lambda p: jnp.dot(W, solve(*p)) + jnp.sum(p[0] ** 2),
        "overlap": lambda p: jnp.dot(W, solve(*p)) ** 2,
        "power": lambda p: jnp.sum(solve(*p) ** 4),
    }


def with_sparsax(which):
    rows, cols, _ = KINDS[which]
    return lambda Ax, b: getattr(sparsax, which)(rows, cols, Ax, b)


@pytest.fixture
def paying(monkeypatch):
    """A factorisation of every pattern taken to last 50 ms: past the bound at which
    `dx.sparse_solve` solves on the host, so a recognised call pays (the decision checked on a
    fixed time; the measured one is the next test's)."""
    monkeypatch.setattr(_program, "trial_seconds", lambda pattern, complex_=False: 0.05)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("loss_name", ["linear", "overlap", "power"])
@pytest.mark.parametrize("which", ["lu_solve", "solve"])
def test_an_unchanged_loss_gets_one_factorisation_and_sparsax_s_gradients(paying, which, loss_name, jit):
    x = (KINDS[which][2], B)
    loss = losses(with_sparsax(which))[loss_name]
    fn = dx.filter_value_and_grad(loss)
    plan = dx.explain(fn, x)
    (site,) = plan.sites
    assert site.name == f"sparsax.{which} (recognised)", plan
    assert plan.recognised[0].site == 0 and plan.recognised[0].reason is None
    assert site.schedule == {"linear": "deferred", "overlap": "deferred-basis", "power": "standard"}[loss_name]
    got, timeline = run(fn, x, jit=jit)
    want = jax.value_and_grad(loss)(x)  # (sparsax's own derivatives, in plain JAX)
    assert_tree_allclose(got, want, rtol=1e-9, atol=1e-11)
    reference = jax.value_and_grad(losses(lambda Ax, b: dense(which, Ax, b))[loss_name])(x)
    assert_tree_allclose(got, reference, rtol=1e-9, atol=1e-11)
    if which == "solve" and loss_name != "linear":  # (the lower triangle's entries, ignored, get no gradient)
        rows, cols, _ = KINDS[which]
        assert np.all(np.asarray(got[1][0])[rows > cols] == 0.0)
    assert timeline.counts(steps=True)["factor"] == 1  # one factorisation for the value and every adjoint
    gc.collect()
    assert len(_factorisations.FACTORISATIONS) == 0


def test_a_quick_pattern_is_left_as_it_is_and_explain_says_why():
    """At the measured time (tens of microseconds here for 36 unknowns) `dx.sparse_solve` would
    solve inside the program with sparsax's KLU: the call stays sparsax's, and the program is
    the one traced; `recognise="always"` makes it a site."""
    x = (KINDS["lu_solve"][2], B)
    loss = losses(with_sparsax("lu_solve"))["power"]
    fn = dx.filter_value_and_grad(loss)
    got, timeline = run(fn, x)
    assert timeline.counts(steps=True) == {}
    assert_tree_allclose(got, jax.value_and_grad(loss)(x), rtol=1e-12, atol=1e-14)
    plan = dx.explain(fn, x)
    (call,) = plan.recognised
    assert call.call == "sparsax.lu_solve" and call.site is None
    assert re.search(
        r"would solve it inside the program with sparsax's KLU too \(a factorisation of its pattern takes "
        r"about [\d.e-]+ ms here",
        call.reason,
    ), call.reason
    assert "not recognised: `dx.sparse_solve` would solve it inside the program" in " ".join(str(plan).split())
    forced = dx.filter_value_and_grad(loss, recognise="always")
    assert dx.explain(forced, x).recognised[0].site == 0
    got, timeline = run(forced, x)
    assert_tree_allclose(got, jax.value_and_grad(loss)(x), rtol=1e-9, atol=1e-11)
    assert timeline.counts(steps=True)["factor"] == 1


@pytest.mark.parametrize("which", ["lu_solve", "solve"])
def test_several_right_hand_sides_share_one_factorisation(paying, which):
    rows, cols, values = KINDS[which]
    rhs = jnp.stack([B, 2.0 * B + 1.0, B[::-1]], axis=1)  # (n, 3): sparsax's several right-hand sides

    def loss(p):
        xs = getattr(sparsax, which)(rows, cols, p[0], p[1])
        return jnp.sum(jnp.sin(xs) * xs)

    fn = dx.filter_value_and_grad(loss)
    assert dx.explain(fn, (values, rhs)).sites[0].name == f"sparsax.{which} (recognised)"
    got, timeline = run(fn, (values, rhs))
    assert_tree_allclose(got, jax.value_and_grad(loss)((values, rhs)), rtol=1e-9, atol=1e-11)
    assert timeline.counts(steps=True)["factor"] == 1


def test_a_call_under_vmap_and_traced_indices_are_left_as_they_are(paying):
    rows, cols, values = KINDS["lu_solve"]
    batch = jnp.stack([values, 1.1 * values])

    def batched(p):  # (sparsax's batched foreign call)
        xs = jax.vmap(lambda v: sparsax.lu_solve(rows, cols, v, p[1]))(p[0])
        return jnp.sum(xs**2)

    fn = dx.filter_value_and_grad(batched)
    got, timeline = run(fn, (batch, B))
    assert timeline.counts(steps=True) == {}
    assert_tree_allclose(got, jax.value_and_grad(batched)((batch, B)), rtol=1e-12, atol=1e-14)
    (call,) = dx.explain(fn, (batch, B)).recognised
    assert call.site is None and "batched by `jax.vmap`" in call.reason, call

    def traced(v, r, c):
        return jnp.sum(sparsax.lu_solve(r, c, v, B) ** 2)

    plans = []

    @jax.jit
    def both(v, r, c):
        fn = dx.filter_value_and_grad(traced)
        plans.append(dx.explain(fn, v, r, c))
        return fn(v, r, c)

    got = both(values, rows, cols)
    assert_tree_allclose(got, jax.value_and_grad(traced)(values, rows, cols), rtol=1e-12, atol=1e-14)
    (call,) = plans[0].recognised
    assert call.site is None and "not known at trace time" in call.reason, call


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_bad_matrix_gives_what_sparsax_gives(paying, jit):
    """KLU gives NaN for a NaN entry (plain sparsax: where the solution depends on it; the
    rewritten call: everywhere); CHOLMOD fails on one, and so does the rewritten call."""
    rows, cols, values = KINDS["lu_solve"]
    loss = losses(with_sparsax("lu_solve"))["power"]
    bad = values.at[int(np.flatnonzero(rows == cols)[0])].set(jnp.nan)
    fn = dx.filter_value_and_grad(loss)
    got, timeline = run(fn, (bad, B), jit=jit)
    want = jax.value_and_grad(loss)((bad, B))
    assert not np.isfinite(float(want[0])) and not np.isfinite(float(got[0]))
    assert all(bool(jnp.all(jnp.isnan(g))) for g in jax.tree.leaves(got[1]))
    assert timeline.counts(steps=True).get("factor", 0) == 0

    rows, cols, values = KINDS["solve"]
    loss = losses(with_sparsax("solve"))["power"]
    bad = values.at[int(np.flatnonzero(rows == cols)[0])].set(jnp.nan)
    with pytest.raises(Exception, match="not positive definite"):
        jax.block_until_ready(jax.value_and_grad(loss)((bad, B)))
    fn = dx.filter_value_and_grad(loss)
    fn = jax.jit(fn) if jit else fn
    message = (
        r"sparsax\.solve \(recognised\).*`values` holds 1 NaN or infinite entries of \d+ \(the first: `values\[0\]"
    )
    with pytest.raises((dx.HostError, jax.errors.JaxRuntimeError), match=message):
        jax.block_until_ready(fn((bad, B)))


def test_the_measured_time_decides():
    """The decision is `dx.sparse_solve`'s own: past the bound a host site, below it sparsax's
    call; the trial is measured once a pattern (a 900-unknown KLU factorisation: well under a
    second here)."""
    rows, cols, _ = KINDS["lu_solve"]
    pattern = dx.SparsePattern(rows, cols, N)
    seconds = recognised_sparsax.trial_seconds(pattern)
    assert seconds is not None and 0 < seconds < 1.0
    quick = _program.refusal(pattern, np.dtype(np.float64), by_cost=True)
    assert (quick is None) == (seconds <= _program._ROUND_TRIPS * _program._cost.round_trip_seconds())


def test_float32_arguments_are_recognised_as_sparsax_converts_them(paying):
    """sparsax solves in float64 whatever it is given (its answer float64 too): a float32 loss
    gets the same sites and sparsax's float64 answer."""
    rows, cols, values = KINDS["lu_solve"]
    loss = losses(with_sparsax("lu_solve"))["overlap"]
    x = (values.astype(jnp.float32), B.astype(jnp.float32))
    fn = dx.filter_value_and_grad(loss)
    assert dx.explain(fn, x).sites[0].name == "sparsax.lu_solve (recognised)"
    got, timeline = run(fn, x)
    assert_tree_allclose(got, jax.value_and_grad(loss)(x), rtol=1e-6, atol=1e-8)
    assert timeline.counts(steps=True)["factor"] == 1


def test_a_custom_linear_solve_of_sparsax_s_kernel_with_another_matrix_is_not_taken_for_sparsax_s():
    """A hand-written `custom_linear_solve` whose `solve` is sparsax's foreign call but whose
    matrix-vector product is another (2 A): sparsax's call it is not, whatever its `solve`;
    left as it is, and its derivatives are the program's own (those of 2 A, by its matvec)."""
    rows, cols, values = KINDS["lu_solve"]

    def loss(p):
        v, b = p
        fixed = jax.lax.stop_gradient(v)

        def matvec(x):
            return 2.0 * jax.ops.segment_sum(v * x[cols], rows, N)

        x = jax.lax.custom_linear_solve(
            matvec,
            b,
            solve=lambda _, r: sparsax._lu_solve_ffi(rows, cols, fixed, r, 0),
            transpose_solve=lambda _, r: sparsax._lu_solve_ffi(rows, cols, fixed, r, 1),
        )
        return jnp.sum(x**2)

    fn = dx.filter_value_and_grad(loss, recognise="always")
    got, timeline = run(fn, (values, B))
    assert timeline.counts(steps=True) == {}
    assert_tree_allclose(got, jax.value_and_grad(loss)((values, B)), rtol=1e-12, atol=1e-14)
    (call,) = dx.explain(fn, (values, B)).recognised
    assert call.call == "sparsax.lu_solve" and call.site is None
    assert "not the solve `sparsax.lu_solve` makes of one system (its programs or operands differ)" in call.reason
