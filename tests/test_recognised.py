"""Recognised calls: an unchanged loss with `klujax.solve` or JAX's `spsolve` gets
`dx.sparse_solve` sites, one factorisation per value and gradient on every schedule, eager
and under jit, and the values and gradients of plain JAX; calls that cannot be rewritten
soundly (or that would not pay) are left exactly as they are; the extension point."""

import gc
import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from scipy.sparse.linalg import MatrixRankWarning

import deferax as dx
from deferax._recognise import _cost as _recognise_cost
from deferax._sparse import _factorisations

from .helpers import assert_tree_allclose
from .helpers import run_recorded as run

klujax = pytest.importorskip("klujax", reason="klujax is not installed (on this Python or JAX): its tests are skipped")
from jax.experimental.sparse.linalg import spsolve  # noqa: E402


def grid(m, dtype):
    """A convection-diffusion operator on an `m x m` grid (COO, each entry once, rows sorted)."""
    rng = np.random.default_rng(0)
    rows, cols, vals = [], [], []
    for i in range(m * m):
        for j, v in sorted(((i, 4.5), (i - 1, -1.3), (i + 1, -0.7), (i - m, -1.1), (i + m, -0.9))):
            if 0 <= j < m * m:
                rows.append(i), cols.append(j), vals.append(v)
    values = np.array(vals) * (1.0 + rng.uniform(-0.1, 0.1, len(vals)))
    b = rng.normal(size=m * m)
    if np.issubdtype(dtype, np.complexfloating):
        values = values * (1.0 + 0.3j * rng.uniform(-1, 1, len(vals)))
        b = b + 1j * rng.normal(size=m * m)
    return np.array(rows), np.array(cols), jnp.asarray(values.astype(dtype)), jnp.asarray(b.astype(dtype))


M = 4  # 16 unknowns
ROWS, COLS, _, _ = grid(M, np.float64)
INDPTR = np.concatenate([[0], np.cumsum(np.bincount(ROWS, minlength=M * M))])
MODE = jnp.asarray(np.random.default_rng(1).normal(size=M * M))


def with_klujax(values, b):
    return klujax.solve(ROWS, COLS, values, b)


def with_spsolve(values, b):
    return spsolve(values, COLS, INDPTR, b)


SOLVES = {"klujax": with_klujax, "spsolve": with_spsolve}
NAMES = {"klujax": "klujax.solve", "spsolve": "jax.experimental.sparse.linalg.spsolve"}


def losses(solve):
    def overlap(x):
        return jnp.sum(MODE.astype(x.dtype) * x)

    return {
        "linear": lambda vb: jnp.real(overlap(solve(*vb))) + jnp.sum(jnp.abs(vb[0]) ** 2),
        "overlap": lambda vb: jnp.abs(overlap(solve(*vb))) ** 2,
        "power": lambda vb: jnp.sum(jnp.abs(solve(*vb)) ** 4),
    }


def problem(kind):
    _, _, values, b = grid(M, np.complex128 if kind == "complex" else np.float64)
    return values, b


# ----------------------------------------------------------------------------- rewritten: one factorisation


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("kind", ["real", "complex"])
@pytest.mark.parametrize("loss_name", ["linear", "overlap", "power"])
@pytest.mark.parametrize("library", ["klujax", "spsolve"])
def test_unchanged_loss_gets_one_factorisation_and_plain_jax_gradients(library, loss_name, kind, jit):
    x = problem(kind)
    loss = losses(SOLVES[library])[loss_name]
    fn = dx.filter_value_and_grad(loss, recognise="always")
    plan = dx.explain(fn, x)
    (site,) = plan.sites
    assert site.name == f"{NAMES[library]} (recognised)"
    assert plan.recognised[0].site == 0 and plan.recognised[0].reason is None
    expected = {"linear": "deferred", "overlap": "deferred-basis", "power": "standard"}[loss_name]
    assert site.schedule == expected
    got, timeline = run(fn, x, jit=jit)
    assert_tree_allclose(got, jax.value_and_grad(loss)(x), rtol=1e-8, atol=1e-10)
    steps = timeline.counts(steps=True)
    assert steps["factor"] == 1, steps  # one factorisation serves the forward and every adjoint
    gc.collect()  # (eagerly, a factorisation is kept until the forward's output is collected: cycles on jax 0.12)
    assert len(_factorisations.FACTORISATIONS) == 0


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_filter_grad_and_a_forced_standard_site(jit):
    """`filter_grad`, and `max_basis=0` (every site standard): the backward pass uses the
    forward's factorisation."""
    x = problem("complex")
    loss = losses(with_klujax)["overlap"]
    fn = dx.filter_grad(loss, recognise="always", max_basis=0)
    assert dx.explain(fn, x).sites[0].schedule == "standard"
    got, timeline = run(fn, x, jit=jit)
    assert_tree_allclose(got, jax.grad(loss)(x), rtol=1e-8, atol=1e-10)
    assert timeline.counts() == {"fwd": 1, "bwd": 1}
    assert timeline.counts(steps=True) == {"factor": 1, "solve": 2}


def test_explain_names_the_call_as_written():
    x = problem("complex")

    def loss(vb):
        y = klujax.solve(ROWS, COLS, vb[0], vb[1])  # the line explain shows
        return jnp.abs(jnp.sum(MODE.astype(y.dtype) * y)) ** 2

    text = str(dx.explain(dx.filter_value_and_grad(loss, recognise="always"), x))
    line = loss.__code__.co_firstlineno + 1  # (the line of the call, in this file)
    assert re.search(rf"#0 klujax\.solve \(recognised\) at \S*test_recognised\.py:{line}\b", text), text
    assert "estimated wall time" in text, text


def test_explain_names_this_call_after_klujax_traced_another():
    """klujax's `solve` is a `jax.jit`: its body comes from JAX's cache, traced from the first
    caller, whose lines its equations keep. The line shown is this loss's."""
    x = problem("real")
    jax.make_jaxpr(lambda vb: klujax.solve(ROWS, COLS, vb[0], vb[1]))(x)  # another caller first

    def loss(vb):
        z = klujax.solve(ROWS, COLS, vb[0], vb[1])  # this line
        return jnp.sum(z**2)

    (call,) = dx.explain(dx.filter_value_and_grad(loss, recognise="always"), x).recognised
    line = loss.__code__.co_firstlineno + 1
    assert re.search(rf"test_recognised\.py:{line}\b", str(call)), str(call)


def test_vmap_over_values_and_over_right_hand_sides():
    values, b = problem("complex")
    loss = losses(with_klujax)["overlap"]
    batch = jnp.stack([values, 1.1 * values, 0.9 * values])
    fn = dx.filter_value_and_grad(loss, recognise="always")
    got = jax.vmap(lambda v: fn((v, b)))(batch)
    want = jax.vmap(lambda v: jax.value_and_grad(loss)((v, b)))(batch)
    assert_tree_allclose(got, want, rtol=1e-8, atol=1e-10)

    rhs = jnp.stack([b, 2.0 * b, b[::-1]])

    def many(vb):  # vmap inside the loss: klujax folds the batch into its right-hand sides
        xs = jax.vmap(lambda r: klujax.solve(ROWS, COLS, vb[0], r))(vb[1])
        return jnp.sum(jnp.abs(xs @ MODE.astype(xs.dtype)) ** 2)

    for max_basis in (None, 0):  # deferred-basis x3, and standard
        fn = dx.filter_value_and_grad(many, recognise="always", max_basis=max_basis)
        assert dx.explain(fn, (values, rhs)).sites[0].name == "klujax.solve (recognised)"
        got, timeline = run(fn, (values, rhs))
        assert_tree_allclose(got, jax.value_and_grad(many)((values, rhs)), rtol=1e-8, atol=1e-10)
        # the three right-hand sides share one factorisation, on either schedule
        assert timeline.counts(steps=True)["factor"] == 1

    def systems(vb):  # several matrices in one call (klujax's `n_lhs`)
        xs = klujax.solve(ROWS, COLS, vb[0], vb[1])
        return jnp.sum(jnp.abs(xs) ** 2)

    x = (batch, rhs)
    got = dx.filter_value_and_grad(systems, recognise="always")(x)
    assert_tree_allclose(got, jax.value_and_grad(systems)(x), rtol=1e-8, atol=1e-10)


def test_forward_mode_over_the_gradient_is_left_to_plain_jax():
    """Under an enclosing `jax.jvp`/`jax.jacfwd` calls are not rewritten (a host site has no
    second derivative): the answer is plain JAX's."""
    values, b = problem("real")
    loss = losses(with_klujax)["power"]
    grad = dx.filter_grad(lambda v: loss((v, b)), recognise="always")
    want = jax.jacfwd(jax.grad(lambda v: loss((v, b))))(values)
    assert_tree_allclose(jax.jacfwd(grad)(values), want, rtol=1e-8, atol=1e-10)
    t = jnp.ones_like(values)
    assert_tree_allclose(jax.jvp(grad, (values,), (t,)), jax.jvp(jax.grad(lambda v: loss((v, b))), (values,), (t,)))


def test_inside_scan_is_left_as_is_and_right():
    values, b = problem("real")

    def loss(v):
        def step(carry, scale):
            return carry + jnp.sum(jnp.abs(klujax.solve(ROWS, COLS, scale * v, b)) ** 2), None

        return jax.lax.scan(step, 0.0, jnp.array([1.0, 1.5]))[0]

    fn = dx.filter_value_and_grad(loss, recognise="always")
    plan = dx.explain(fn, values)
    assert plan.sites == ()
    assert "inside lax.scan: left as is" in plan.recognised[0].reason
    got, timeline = run(fn, values)
    assert_tree_allclose(got, jax.value_and_grad(loss)(values), rtol=1e-10, atol=1e-12)
    assert timeline.counts(steps=True) == {}


# ----------------------------------------------------------------------------- left as it is


def untouched(loss, x, **kwargs):
    """The call runs as plain JAX would: no site, nothing factored by deferax, same answer."""
    fn = dx.filter_value_and_grad(loss, **kwargs)
    got, timeline = run(fn, x)
    assert timeline.counts(steps=True) == {}
    assert_tree_allclose(got, jax.value_and_grad(loss)(x), rtol=1e-10, atol=1e-12)
    return dx.explain(fn, x)


def test_the_switch_off_leaves_the_program_as_traced():
    x = problem("complex")
    plan = untouched(losses(with_klujax)["overlap"], x, recognise=False)
    assert plan.sites == () and plan.recognised == ()


def test_traced_indices_are_left_as_is():
    values, b = problem("real")

    def loss(v, rows, cols):
        return jnp.sum(klujax.solve(rows, cols, v, b) ** 2)

    plans = []

    @jax.jit
    def both(v, rows, cols):
        fn = dx.filter_value_and_grad(loss, recognise="always")
        plans.append(dx.explain(fn, v, rows, cols))
        return fn(v, rows, cols)

    with dx.record() as timeline:
        got = both(values, ROWS, COLS)
    assert timeline.counts(steps=True) == {}
    assert_tree_allclose(got, jax.value_and_grad(loss)(values, ROWS, COLS), rtol=1e-10, atol=1e-12)
    (call,) = plans[0].recognised
    assert call.site is None and "not known at trace time" in call.reason


def test_duplicate_entries_and_non_canonical_csr_are_left_as_is():
    values, b = problem("real")
    rows, cols = np.concatenate([ROWS, [0]]), np.concatenate([COLS, [0]])
    dup = jnp.concatenate([values, jnp.array([0.5])])
    # KLU cannot factor a pattern with duplicates: the original fails, so no rewrite may succeed
    fn = dx.filter_value_and_grad(lambda v: jnp.sum(klujax.solve(rows, cols, v, b) ** 2), recognise="always")
    (call,) = dx.explain(fn, dup).recognised
    assert call.site is None and "duplicate entries" in call.reason
    # a CSR whose first row's columns are not sorted: SciPy's CPU solve fails on it
    first = slice(INDPTR[0], INDPTR[1])
    cols = COLS.copy()
    cols[first] = cols[first][::-1]
    fn = dx.filter_value_and_grad(lambda v: jnp.sum(spsolve(v, cols, INDPTR, b) ** 2), recognise="always")
    (call,) = dx.explain(fn, values).recognised
    assert call.site is None and "canonical form" in call.reason


def test_handle_based_primitives_are_never_recognised():
    values, b = problem("real")
    symbolic = klujax.analyze(ROWS, COLS, M * M)

    def loss(v):
        return jnp.sum(klujax.solve_with_symbol(ROWS, COLS, v, b, symbolic) ** 2)

    plan = untouched(loss, values, recognise="always")
    assert plan.sites == ()
    assert all(c.site is None and "handle-based" in c.reason for c in plan.recognised)
    assert plan.recognised and plan.recognised[0].call.startswith("klujax.solve_with_symbol")


def test_a_small_system_is_left_in_place_by_cost(monkeypatch):
    """A 100-unknown system: one factorisation takes far less than a host round trip, so
    the rewrite cannot pay (what SAX's circuits are); `recognise="always"` forces it. (Its
    factorisation time is measured, tens of microseconds on a quiet machine; on a loaded
    one a measurement past two round trips (2 ms) would rightly flip the decision, so the
    decision is checked on a fixed time, and the measurement separately.)"""
    measured = _recognise_cost.trial_seconds
    monkeypatch.setattr(_recognise_cost, "trial_seconds", lambda pattern, complex_: 3e-5)
    n = 100
    rows = np.concatenate([np.arange(n), np.arange(1, n), np.arange(n - 1)])
    cols = np.concatenate([np.arange(n), np.arange(n - 1), np.arange(1, n)])
    values = jnp.asarray(np.concatenate([np.full(n, 4.0), np.full(2 * n - 2, -1.0)]) + 0j)
    b = jnp.ones(n, complex)

    def loss(v):
        return jnp.abs(jnp.sum(klujax.solve(rows, cols, v, b))) ** 2

    plan = untouched(loss, values)
    (call,) = plan.recognised
    assert call.site is None and "left in place by cost" in call.reason
    assert "not recognised: left in place by cost" in str(plan)
    assert dx.explain(dx.filter_value_and_grad(loss, recognise="always"), values).recognised[0].site == 0
    seconds = measured(dx.SparsePattern(rows, cols, n), True)
    assert seconds is not None and 0 < seconds < 1.0


# ----------------------------------------------------------------------------- the extension point

dense_solve_p = Primitive("test_dense_solve")  # (rows, cols, values, b) -> x: a test library's solve


def _dense(rows, cols, values, b):
    n = b.shape[0]
    return jnp.zeros((n, n), values.dtype).at[rows, cols].add(values)


dense_solve_p.def_impl(lambda rows, cols, values, b: jnp.linalg.solve(_dense(rows, cols, values, b), b))
dense_solve_p.def_abstract_eval(lambda rows, cols, values, b: jax.core.ShapedArray(b.shape, b.dtype))
mlir.register_lowering(dense_solve_p, mlir.lower_fun(dense_solve_p.impl, multiple_results=False))


def _dense_jvp(primals, tangents):
    rows, cols, values, b = primals
    _, _, t_values, t_b = (ad.instantiate_zeros(t) for t in tangents)
    a = _dense(rows, cols, values, b)
    x = jnp.linalg.solve(a, b)
    return x, jnp.linalg.solve(a, t_b - _dense(rows, cols, t_values, b) @ x)


ad.primitive_jvps[dense_solve_p] = _dense_jvp
batching.primitive_batchers[dense_solve_p] = None  # (not needed here)


def dense_rule(operands, params):
    rows, cols, values, b = operands
    if not isinstance(rows, np.ndarray) or not isinstance(cols, np.ndarray):
        return "its indices are traced"
    pattern = dx.SparsePattern(rows, cols, b.shape[0])  # entries at one position add up, as `_dense` does
    return dx.Recognition(pattern, lambda solve, rows, cols, values, b: solve(values, b), factorisations=2)


def test_a_registered_primitive_is_recognised():
    dx.register_recognition(dense_solve_p, dense_rule, name="mylib.solve")
    values, b = problem("real")

    def loss(v):
        return jnp.sum(MODE * dense_solve_p.bind(ROWS, COLS, v, b))

    fn = dx.filter_value_and_grad(loss, recognise="always")
    plan = dx.explain(fn, values)
    assert plan.sites[0].name == "mylib.solve (recognised)"
    assert plan.sites[0].schedule == "deferred"
    got, timeline = run(fn, values)
    assert_tree_allclose(got, jax.value_and_grad(loss)(values), rtol=1e-8, atol=1e-10)
    assert timeline.counts(steps=True)["factor"] == 1


def test_registration_errors():
    with pytest.raises(TypeError, match=r"`primitive` must be a `jax.extend.core.Primitive`.*but got 'solve'"):
        dx.register_recognition("solve", dense_rule, name="mylib.solve")
    with pytest.raises(TypeError, match=r"`rule` must be a function `rule\(operands, params\)"):
        dx.register_recognition(dense_solve_p, 3, name="mylib.solve")
    values, b = problem("real")

    def loss(v):
        return jnp.sum(dense_solve_p.bind(ROWS, COLS, v, b))

    dx.register_recognition(dense_solve_p, lambda operands, params: 42, name="mylib.solve")
    with pytest.raises(TypeError, match=r"the rule returned 42 for the call at .*returns a `dx.Recognition`"):
        dx.explain(loss, values)
    pattern = dx.SparsePattern(ROWS, COLS, M * M)
    wrong = dx.Recognition(pattern, lambda solve, rows, cols, values, b: solve(values, b)[:3])
    dx.register_recognition(dense_solve_p, lambda operands, params: wrong, name="mylib.solve")
    with pytest.raises(TypeError, match=r"returned float64\[3\], but the call returns float64\[16\]"):
        dx.filter_value_and_grad(loss, recognise="always")(values)
    dx.register_recognition(dense_solve_p, dense_rule, name="mylib.solve")
    with pytest.raises(ValueError, match=r"`recognise` must be True .* \"always\" .* or False .*, but got 'yes'"):
        dx.filter_value_and_grad(loss, recognise="yes")


def host_rule(operands, params):
    """`dense_solve_p` as a `dx.host` site of the rule's own (`Recognition(None, apply, site=)`):
    NumPy's dense solve forward, the transposed solve as the adjoint (`ct_values = -x ct_b`
    over the pattern, made by `combine`)."""
    rows, cols, values, b = operands
    if not isinstance(rows, np.ndarray) or not isinstance(cols, np.ndarray):
        return "its indices are traced"
    n = b.shape[0]

    def dense(v):
        return np.asarray(_dense(rows, cols, jnp.asarray(v), np.zeros(n)))

    site = dx.host(
        lambda vb: np.linalg.solve(dense(vb[0]), vb[1]),
        adjoint=lambda vb, ct: np.linalg.solve(dense(vb[0]).T, ct),
        combine=lambda vb, x, lam: (-lam[rows] * x[cols], lam),
        adjoint_out=jax.ShapeDtypeStruct((n,), b.dtype),
        out=jax.ShapeDtypeStruct((n,), b.dtype),
    )
    return dx.Recognition(None, lambda site, rows, cols, values, b: site((values, b)), site=site)


def test_a_rule_gives_a_site_of_its_own():
    dx.register_recognition(dense_solve_p, host_rule, name="mylib.solve")
    values, b = problem("real")

    def loss(vb):
        return jnp.sum(MODE * dense_solve_p.bind(ROWS, COLS, *vb))

    try:
        fn = dx.filter_value_and_grad(loss)  # (no cost rule: the rule decided)
        plan = dx.explain(fn, (values, b))
        assert plan.sites[0].name == "mylib.solve (recognised)" and plan.sites[0].schedule == "deferred"
        with dx.record() as timeline:
            got = eqx.filter_jit(fn)((values, b))
        assert timeline.counts() == {"fwd": 1, "adjoint": 1}
        assert_tree_allclose(got, jax.value_and_grad(loss)((values, b)), rtol=1e-8, atol=1e-10)
    finally:
        dx.register_recognition(dense_solve_p, dense_rule, name="mylib.solve")


def test_recognition_takes_a_pattern_or_a_site():
    pattern = dx.SparsePattern(ROWS, COLS, M * M)
    site = dx.host(np.sin, adjoint=np.cos, out=lambda x: x)
    expected = r"`dx.Recognition`: give exactly one of `pattern` .* and `site=` .*, but got "
    with pytest.raises(TypeError, match=expected + r"neither \(pattern=None, site=None\)"):
        dx.Recognition(None, lambda site, *operands: operands)
    with pytest.raises(TypeError, match=expected + r"both"):
        dx.Recognition(pattern, lambda site, *operands: operands, site=site)
    with pytest.raises(TypeError, match=expected + r"site='sin'"):
        dx.Recognition(None, lambda site, *operands: operands, site="sin")


# ----------------------------------------------------------------------------- a bad matrix: what the original gives


DIAGONAL = int(np.flatnonzero(ROWS == COLS)[5])  # (the entry at (5, 5))


def bad(values, case):
    """`values` with a NaN or an infinite entry on the diagonal, or row 5 zero (singular)."""
    if case == "singular":
        return values.at[np.flatnonzero(ROWS == 5)].set(0.0)
    return values.at[DIAGONAL].set(jnp.nan if case == "nan" else jnp.inf)


def two_calls(solve):
    """Two recognised calls, each standard, whose backward jobs run at once (`runs="together"`)."""
    return lambda vb: jnp.sum(solve(*vb) ** 4) + jnp.sum(solve(2 * vb[0], vb[1]) ** 4)


SCHEDULES = {"deferred": "linear", "deferred-basis": "overlap", "standard": "power", "together": None}


def bad_loss(library, schedule):
    solve = SOLVES[library]
    loss = two_calls(solve) if schedule == "together" else losses(solve)[SCHEDULES[schedule]]
    fn = dx.filter_value_and_grad(loss, recognise="always")
    plan = dx.explain(fn, problem("real"))
    assert [s.schedule for s in plan.sites][0] == ("standard" if schedule == "together" else schedule)
    if schedule == "together":
        assert all("backward jobs at once with #0, #1" in s.reason for s in plan.sites), plan
    return loss, fn


def finite(tree) -> bool:
    return all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(tree))


BAD = [("klujax", "nan"), ("klujax", "inf"), ("spsolve", "nan"), ("spsolve", "singular")]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize(("library", "case"), BAD)
def test_a_bad_matrix_gives_nan_as_the_original_does(library, case, schedule, jit):
    """`klujax.solve` with a NaN or an infinite entry, and SciPy's `spsolve` behind JAX's
    with a NaN entry or a singular matrix, give a NaN value and NaN gradients, eagerly and
    under `jit` (spsolve with its "Matrix is exactly singular" warning): the rewritten call
    gives NaN too, on every schedule, instead of `dx.sparse_solve`'s own errors, and factors
    nothing. (plain klujax leaves finite the entries that do not depend on the bad one; the
    rewritten call's are all NaN.)"""
    loss, fn = bad_loss(library, schedule)
    values, b = problem("real")
    x = (bad(values, case), b)
    plain = jax.jit(jax.value_and_grad(loss)) if jit else jax.value_and_grad(loss)
    with warnings.catch_warnings(record=True) as plain_warnings:
        warnings.simplefilter("always")
        want = jax.block_until_ready(plain(x))
    assert not finite(want[0]) and not finite(want[1])
    with warnings.catch_warnings(record=True) as got_warnings:
        warnings.simplefilter("always")
        got, timeline = run(fn, x, jit=jit)
    assert not finite(got[0])
    for g in jax.tree.leaves(got[1]):
        assert bool(jnp.all(jnp.isnan(g))), got[1]
    # (the other call of `together`, on `2 * values`, is bad too: no factorisation at all)
    assert timeline.counts(steps=True).get("factor", 0) == 0
    gc.collect()
    assert len(_factorisations.FACTORISATIONS) == 0
    warned = [str(w.message) for w in got_warnings if issubclass(w.category, MatrixRankWarning)]
    if library == "klujax":
        assert warned == []
        return
    assert any("Matrix is exactly singular" in str(w.message) for w in plain_warnings)
    if case == "nan":
        why = r"`values` holds 1 NaN or infinite entries \(the first: `values\[\d+\]`\)"
        flag = "`nonfinite='warn'`"
    else:
        why = "its solver raised LinAlgError: the matrix is singular: (SuperLU|KLU) found a zero pivot"
        flag = "`singular='warn'`"
    name = re.escape(f"`ExpensiveFn(name='{NAMES['spsolve']} (recognised)')`: ")
    message = rf"{name}{why}.*, so its solution and derivatives are NaN \({flag}\)\."
    assert warned and all(re.fullmatch(message, w) for w in warned), warned


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize(("library", "case"), [("klujax", "nan"), ("spsolve", "singular")])
def test_apply_if_finite_skips_the_bad_step_as_in_plain_jax(library, case, schedule, jit):
    """An optimiser guarded by `optax.apply_if_finite`: a batch that makes the matrix bad
    (a NaN entry for klujax, a singular matrix for spsolve) gives non-finite gradients, and
    the guard skips that step, through deferax as in plain JAX; the steps around it are
    plain JAX's."""
    optax = pytest.importorskip("optax")
    loss_vb, _ = bad_loss(library, schedule)
    values, b = problem("real")

    def loss(params, scale):
        return loss_vb((params["w"] * values * scale, b))

    optimiser = optax.apply_if_finite(optax.sgd(1e-3), max_consecutive_errors=3)
    good = jnp.ones_like(values)
    batches = [good, bad(good, case), 1.01 * good]

    def train(value_and_grad):
        def step(params, state, scale):
            value, grads = value_and_grad(params, scale)
            updates, state = optimiser.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        step = eqx.filter_jit(step) if jit else step
        params = {"w": jnp.ones_like(values)}
        state = optimiser.init(params)
        trace = []
        for scale in batches:
            params, state, value = step(params, state, scale)
            trace.append((params, bool(jnp.isfinite(value))))
        return trace, state

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MatrixRankWarning)  # (spsolve's, and the rewritten call's)
        want, want_state = train(jax.value_and_grad(loss))
        got, got_state = train(dx.filter_value_and_grad(loss, recognise="always"))
    assert [finite for _, finite in want] == [True, False, True]
    assert int(want_state.total_notfinite) == 1  # plain JAX skipped the bad step...
    assert_tree_allclose(want[1][0], want[0][0], rtol=0, atol=0)
    assert int(got_state.total_notfinite) == 1  # ...and so does deferax
    assert [finite for _, finite in got] == [True, False, True]
    for (g, _), (w, _) in zip(got, want, strict=True):
        assert_tree_allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_infinite_entry_in_spsolve_gives_nan_with_the_warning(jit):
    """With an infinite entry, SciPy's answer depends on the order it pivots in (for this
    matrix, a finite limit; NaN for others): the rewritten call gives NaN, value and
    gradient, with the warning, so that it is never finite where the original is not."""
    loss, fn = bad_loss("spsolve", "standard")
    values, b = problem("real")
    x = (bad(values, "inf"), b)
    with pytest.warns(MatrixRankWarning, match=r"`values` holds 1 NaN or infinite entries .*`nonfinite='warn'`"):
        got, timeline = run(fn, x, jit=jit)
    assert all(bool(jnp.all(jnp.isnan(g))) for g in jax.tree.leaves(got))
    assert timeline.counts(steps=True).get("factor", 0) == 0


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_singular_matrix_in_klujax_raises_as_klujax_does(jit):
    """klujax fails on a singular matrix ("klu_factor ... failed (singular matrix?)"), eagerly
    and under `jit`: so does the rewritten call, with `dx.sparse_solve`'s message."""
    loss, fn = bad_loss("klujax", "standard")
    values, b = problem("real")
    x = (bad(values, "singular"), b)
    plain = jax.jit(jax.value_and_grad(loss)) if jit else jax.value_and_grad(loss)
    with pytest.raises((ValueError, jax.errors.JaxRuntimeError), match=r"singular matrix\?"):
        plain(x)
    error = (jax.errors.JaxRuntimeError, ValueError) if jit else dx.HostError
    with pytest.raises(error, match="the matrix is singular: (SuperLU|KLU) found a zero pivot"):
        run(fn, x, jit=jit)


def test_recognition_says_what_a_bad_matrix_gives():
    pattern = dx.SparsePattern(ROWS, COLS, M * M)
    apply = lambda solve, rows, cols, values, b: solve(values, b)  # noqa: E731
    assert (dx.Recognition(pattern, apply).nonfinite, dx.Recognition(pattern, apply).singular) == ("nan", "nan")
    msg = (
        '`dx.Recognition`: `singular` must be "nan", "warn" or "raise" (what the original call gives for a '
        "singular matrix), but got 'ignore'."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        dx.Recognition(pattern, apply, singular="ignore")
