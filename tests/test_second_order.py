"""Second order through `dx.sparse_solve` on the host: Hessian-vector products, Hessians and
gradients of gradients, with respect to the entries and `b`, real, complex and float32,
eagerly and under `jit` and `vmap`, each against the same program with a dense solve in
plain JAX, and the factorisations counted through the solver (one a Hessian-vector product);
through `dx.filter_value_and_grad` on its schedules, and a loss that differentiates itself
inside `dx.filter_value_and_grad`."""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx
from deferax import _runtime
from deferax._sparse import _factorisations, _second_order

from .helpers import CountingLU, Tally

N = 12


def system(dtype=np.float64, seed=0):
    """A non-symmetric `N x N` system (a ring of neighbours and a few far entries), well
    conditioned, as a sparse pattern, its entries and a right-hand side of `dtype`."""
    rng = np.random.default_rng(seed)
    i = np.arange(N)
    rows = np.r_[i, i, i, [0, 3, 7]]
    cols = np.r_[i, (i + 1) % N, (i - 1) % N, [6, 9, 2]]
    pattern = dx.SparsePattern(rows, cols, N)

    def draw(k):
        a = rng.normal(size=k)
        return a + 1j * rng.normal(size=k) if np.issubdtype(dtype, np.complexfloating) else a

    values = np.r_[np.full(N, 5.0), draw(pattern.nnz - N)].astype(dtype)
    return pattern, jnp.asarray(values), jnp.asarray(draw(N).astype(dtype))


def loss_of(solve):
    """A loss nonlinear in `x` (so its Hessian is not made of the first derivatives alone)."""

    def loss(v, b):
        x = solve(v, b)
        return jnp.sum(jnp.abs(x) ** 2) + jnp.sum(jnp.cos(jnp.real(x))) + jnp.real(jnp.sum(x**3))

    return loss


def ours(pattern, tally, **kwargs):
    return loss_of(lambda v, b: dx.sparse_solve(v, pattern, b, solver=CountingLU(tally), **kwargs))


def dense(pattern):
    def solve(v, b):
        dtype = np.promote_types(np.promote_types(v.dtype, b.dtype), np.float64)
        return jnp.linalg.solve(pattern.todense(v.astype(dtype)), b.astype(dtype))

    return loss_of(solve)


def close(got, want, rtol=1e-10, atol=1e-11):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def hvp(loss, v, b, tv, tb):
    """The Hessian-vector product (and gradient) of `loss` with respect to `(v, b)`."""
    return jax.jvp(lambda v, b: jax.grad(loss, argnums=(0, 1))(v, b), (v, b), (tv, tb))


_SCALES = itertools.count(1)  # (never 0: a fresh matrix is never the one it is made from)


def fresh(v):
    """`v` scaled a little: new entries, so that no factorisation kept from an earlier call is found."""
    return v * (1.0 + 1e-3 * next(_SCALES))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", [np.float64, np.complex128, np.float32], ids=["real", "complex", "float32"])
def test_a_hessian_vector_product_equals_a_dense_one_with_one_factorisation(dtype, jit):
    """Entries and `b` both move: `x`, its tangent, the adjoint and the adjoint's tangent are
    four solves of one factorisation, each call (new entries each time). Complex: JAX's
    convention (the gradient of a real loss of complex inputs is the conjugate of the
    Wirtinger one), as the dense program gives it. float32: solved in float64, rounded."""
    pattern, values, b = system(dtype)
    rng = np.random.default_rng(5)
    tv = jnp.asarray(rng.normal(size=values.shape).astype(values.dtype))
    tb = jnp.asarray(rng.normal(size=b.shape).astype(b.dtype))
    tally = Tally()
    run = ft_jit(lambda v: hvp(ours(pattern, tally), v, b, tv, tb), jit)
    tol = {"rtol": 2e-4, "atol": 2e-4} if dtype == np.float32 else {}
    for _ in range(3):
        v = fresh(values)
        tally.factor = tally.solves = 0
        got = jax.block_until_ready(run(v))
        assert (tally.factor, tally.solves) == (1, 4)
        want = hvp(dense(pattern), *(wide(a) for a in (v, b, tv, tb)))
        close(got, want, **tol)
        assert all(g.dtype == values.dtype for g in jax.tree.leaves(got[1]))  # (float32 in, float32 out)


def wide(a):
    """`a` in float64 (complex128): the reference's precision."""
    return a.astype(np.promote_types(a.dtype, np.float64))


def ft_jit(fn, jit):
    return jax.jit(fn) if jit else fn


SECOND_ORDER = {
    "hessian": lambda f: jax.hessian(f),
    "jacfwd(jacrev)": lambda f: jax.jacfwd(jax.jacrev(f)),
    "jacrev(jacrev)": lambda f: jax.jacrev(jax.jacrev(f)),
    "grad(grad)": lambda f: jax.grad(lambda v: jnp.sum(jax.grad(f)(v) ** 2)),
    "jvp(jit(grad))": lambda f: lambda v: jax.jvp(jax.jit(jax.grad(f)), (v,), (jnp.cos(v),))[1],
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("order", list(SECOND_ORDER))
def test_every_second_derivative_of_the_entries_equals_the_dense_one(order, jit):
    """The whole Hessian (its rows and columns vmapped: one solve of all columns a step),
    a gradient of a gradient, and a `jit` inside the derivative: one factorisation each."""
    pattern, values, b = system()
    tally = Tally()
    fn = ft_jit(SECOND_ORDER[order](lambda v: ours(pattern, tally)(v, b)), jit)
    v = fresh(values)
    got = jax.block_until_ready(fn(v))
    close(got, SECOND_ORDER[order](lambda v: dense(pattern)(v, b))(v), rtol=1e-9, atol=1e-10)
    assert tally.factor == 1


def test_second_order_with_respect_to_b_alone_and_under_vmap_over_systems():
    """The Hessian in `b` (the entries constant), and a `vmap` over three matrices of the
    Hessian-vector product: each matrix factored once."""
    pattern, values, b = system()
    tally = Tally()
    got = jax.jit(jax.hessian(lambda b: ours(pattern, tally)(values, b)))(b)
    close(got, jax.hessian(lambda b: dense(pattern)(values, b))(b), rtol=1e-9, atol=1e-10)
    assert tally.factor == 1
    vs = jnp.stack([fresh(values), fresh(values), fresh(values)])
    tv, tb = jnp.sin(values), jnp.cos(b)
    tally.factor = 0
    got = jax.jit(jax.vmap(lambda v: hvp(ours(pattern, tally), v, b, tv, tb)))(vs)
    close(got, jax.vmap(lambda v: hvp(dense(pattern), v, b, tv, tb))(vs))
    assert tally.factor == 3


def test_a_vmap_over_tangents_solves_them_together():
    """Several Hessian-vector products of one point (`vmap` over the tangent): one
    factorisation, and each solve has all the tangents' right-hand sides at once."""
    pattern, values, b = system()
    rng = np.random.default_rng(2)
    tvs = jnp.asarray(rng.normal(size=(5, *values.shape)))
    tally = Tally()
    v = fresh(values)
    run = jax.jit(jax.vmap(lambda tv: hvp(ours(pattern, tally), v, b, tv, jnp.zeros_like(b)), in_axes=0))
    got = run(tvs)
    close(got, jax.vmap(lambda tv: hvp(dense(pattern), v, b, tv, jnp.zeros_like(b)))(tvs))
    assert tally.factor == 1
    assert tally.solves <= 4  # (x and the adjoint once; each tangent's solves as columns of one)


@pytest.mark.parametrize("schedule", ["auto", "standard"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_the_hessian_vector_product_of_a_filter_value_and_grad_loss(schedule, jit):
    """`jax.jvp` of `dx.filter_value_and_grad`'s gradient (the standard schedule under an
    enclosing differentiation): the dense program's, one factorisation."""
    pattern, values, b = system()
    tally = Tally()
    loss = ours(pattern, tally)
    tv = jnp.sin(values)
    step = dx.filter_value_and_grad(lambda v: loss(v, b), schedule=schedule)
    run = ft_jit(lambda v: jax.jvp(step, (v,), (tv,)), jit)
    v = fresh(values)
    got = run(v)
    want = jax.jvp(jax.value_and_grad(lambda v: dense(pattern)(v, b)), (v,), (tv,))
    close(got, want)
    assert tally.factor == 1


def test_a_loss_that_differentiates_itself_inside_filter_value_and_grad():
    """A loss made of a gradient (a Gauss-Newton or a sensitivity penalty): deferax traces it,
    the inner `jax.grad` differentiates the solve, and deferax differentiates that again."""
    pattern, values, b = system()
    tally = Tally()
    tv = jnp.sin(values)

    def penalty(loss):
        return lambda v: jnp.vdot(jax.grad(lambda v: loss(v, b))(v), tv)

    v = fresh(values)
    got = dx.filter_value_and_grad(penalty(ours(pattern, tally)))(v)
    close(got, jax.value_and_grad(penalty(dense(pattern)))(v))
    assert tally.factor == 1


def test_nan_and_raise_in_second_order():
    """`nonfinite="nan"`: the Hessian-vector product is NaN (a NaN guard sees it);
    `"raise"` (the default): the host's error, with its count and place, in JAX's."""
    pattern, values, b = system()
    bad = values.at[3].set(jnp.nan)
    tally = Tally()
    out = hvp(ours(pattern, tally, nonfinite="nan"), bad, b, values, b)
    assert all(np.isnan(np.asarray(a)).all() for a in jax.tree.leaves(out))
    assert tally.factor == 0
    with pytest.raises(Exception, match=re.escape("`values` holds 1 NaN or infinite entries of")):
        jax.block_until_ready(hvp(ours(pattern, tally), bad, b, values, b))


def test_symmetric_true_on_a_symmetric_matrix():
    """`symmetric=True` (the adjoint solves with `A` itself) on matrices kept symmetric (the
    entries at `(i, j)` and `(j, i)` one parameter, so that every tangent is symmetric too):
    the dense Hessian."""
    pattern, values, b = system()
    a = np.asarray(pattern.todense(values))
    a = a + a.T
    rows, cols = np.nonzero(a)
    sym = dx.SparsePattern(rows, cols, N)
    upper = rows <= cols
    index = np.searchsorted(np.flatnonzero(upper), np.flatnonzero(upper))  # (each upper entry's parameter)
    param = np.empty(len(rows), int)
    param[upper] = index
    position = {(r, c): k for k, (r, c) in enumerate(zip(rows, cols, strict=True))}
    param[~upper] = [param[position[(c, r)]] for r, c in zip(rows[~upper], cols[~upper], strict=True)]
    w = jnp.asarray(a[rows[upper], cols[upper]])
    tally = Tally()
    got = jax.hessian(lambda w: ours(sym, tally, symmetric=True)(w[param], b))(w)
    close(got, jax.hessian(lambda w: dense(sym)(w[param], b))(w), rtol=1e-9, atol=1e-10)
    assert tally.factor == 1


def test_the_kept_factorisations_are_bounded_and_let_go_on_reset():
    """Each matrix solved in second order keeps its factorisation for the next solves, the
    latest `PINNED` only: the store never holds more, the oldest is factored again when it
    comes back, and a reset lets them all go."""
    pattern, values, b = system()
    tally = Tally()
    tv = jnp.sin(values)
    run = jax.jit(lambda v: hvp(ours(pattern, tally), v, b, tv, b))
    first = fresh(values)
    for k in range(_second_order.PINNED + 2):
        jax.block_until_ready(run(first if k == 0 else fresh(values)))
        assert len(_factorisations.FACTORISATIONS) <= _second_order.PINNED
    assert tally.factor == _second_order.PINNED + 2
    jax.block_until_ready(run(first))  # (its pin let go: factored again)
    assert tally.factor == _second_order.PINNED + 3
    _runtime.reset()
    assert len(_factorisations.FACTORISATIONS) == 0


def test_first_order_keeps_its_site():
    """One derivative is the site's own (standard schedule: the forward's factorisation for
    the backward pass; deferred: one job), not the second-order formulation."""
    pattern, values, b = system()
    tally = Tally()
    loss = ours(pattern, tally)
    v = fresh(values)
    with dx.record() as timeline:
        jax.grad(loss, argnums=(0, 1))(v, b)
    assert timeline.counts() == {"fwd": 1, "bwd": 1}
    assert tally.factor == 1
    tally.factor = 0
    with dx.record() as timeline:
        dx.filter_value_and_grad(lambda v: jnp.sum(dx.sparse_solve(v, pattern, b, solver=CountingLU(tally))))(fresh(v))
    assert timeline.counts() == {"fused": 1}
    assert tally.factor == 1


def test_the_second_order_solves_are_recorded_as_the_sites():
    """`dx.record` sees each solve of a Hessian-vector product as a call of the site on the
    `"second order"` schedule: two solves with `A`, two with `A^T`, one factorisation."""
    pattern, values, b = system()
    with dx.record() as timeline:
        jax.block_until_ready(hvp(ours(pattern, Tally()), fresh(values), b, jnp.sin(values), b))
    assert timeline.counts() == {"solve": 2, "transposed solve": 2}
    assert timeline.counts(steps=True) == {"factor": 1, "solve": 4}
    assert {(c.site, c.schedule) for c in timeline.calls} == {("sparse_solve", "second order")}


def converted(transform, f, v):
    """`transform(f)` made a jaxpr first (`jax.closure_convert`, as Optimistix does with the
    functions it is given), then called: JAX differentiates the jaxpr, not the Python."""
    g, consts = jax.closure_convert(transform(f), v)
    return lambda v: g(v, *consts)


LATER = {
    "jvp(closure_convert(grad))": lambda f, v, t: jax.jvp(converted(jax.grad, f, v), (v,), (t,)),
    "jacfwd(closure_convert(jacfwd))": lambda f, v, t: jax.jacfwd(converted(jax.jacfwd, f, v))(v),
    "grad(closure_convert(jvp))": lambda f, v, t: jax.grad(
        lambda v: jnp.sum(converted(lambda f: lambda v: jax.jvp(f, (v,), (t,))[1], f, v)(v) ** 2)
    )(v),
    "jvp(linearize function)": lambda f, v, t: jax.jvp(jax.linearize(f, v)[1], (t,), (t,)),
    "jvp(vjp function)": lambda f, v, t: jax.jvp(jax.vjp(f, v)[1], (jnp.ones(()),), (jnp.ones(()),)),
}


@pytest.mark.parametrize("case", list(LATER))
def test_a_derivative_made_first_and_differentiated_later(case):
    """The first derivative traced where no enclosing differentiation could be seen (a jaxpr
    made of it, a `jax.vjp` or `jax.linearize` function), differentiated afterwards: its
    host calls are differentiated through the second-order formulation; the dense program's
    answer, one factorisation."""
    pattern, values, b = system()
    tally = Tally()
    v, t = fresh(values), jnp.sin(values)
    got = LATER[case](lambda v: ours(pattern, tally)(v, b), v, t)
    close(got, LATER[case](lambda v: dense(pattern)(v, b), v, t), rtol=1e-9, atol=1e-10)
    assert tally.factor == 1


def test_a_host_site_differentiated_later_names_itself():
    """A `dx.host` site (no second-order formulation) in a forward-mode jaxpr differentiated
    again: the site's refusal, not JAX's "Differentiation rule not implemented"."""
    sim = dx.host(lambda x: np.sin(x), jvp=lambda x, t: (np.sin(x), np.cos(x) * t), out=lambda s: s, name="sim")
    x = jnp.array([0.1, 0.2])
    with pytest.raises(TypeError, match=re.escape("`ExpensiveFn(name='sim')`: second order is not supported")):
        jax.jacfwd(converted(jax.jacfwd, lambda x: jnp.sum(sim(x) ** 2), x))(x)


def test_newton_with_optimistix_on_a_sparse_solve_loss():
    """Optimistix's Newton root find on the gradient of a misfit (springs' log stiffnesses
    fitted to measured displacements): it converges to the dense program's answer, one
    factorisation a Newton step (the gradient, and the Hessian that Lineax materialises)."""
    optx = pytest.importorskip("optimistix")
    n = 16
    i = np.arange(n)
    pattern = dx.SparsePattern(np.r_[i, i[1:], i[:-1]], np.r_[i, i[:-1], i[1:]], n)
    load = jnp.ones(n)

    def stiffness(log_k):
        k = jnp.exp(log_k)
        return jnp.concatenate([k[:-1] + k[1:], -k[1:-1], -k[1:-1]])

    true = jnp.asarray(np.sin(np.linspace(0, 3, n + 1)))
    start = true + 0.2 * jnp.cos(jnp.arange(n + 1.0))

    def newton(solve):
        measured = solve(stiffness(true), load)

        def misfit(log_k, args):
            u = solve(stiffness(log_k), load)
            return 0.5 * jnp.sum((u - measured) ** 2) / jnp.sum(measured**2) + 1e-4 * jnp.sum(jnp.diff(log_k) ** 2)

        found = optx.root_find(jax.grad(misfit), optx.Newton(rtol=1e-10, atol=1e-10), start, max_steps=30)
        return found.value, int(found.stats["num_steps"])

    tally = Tally()
    got, steps = newton(lambda v, b: dx.sparse_solve(v, pattern, b, solver=CountingLU(tally)))
    want, dense_steps = newton(lambda v, b: jnp.linalg.solve(pattern.todense(v), b))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-10)
    assert steps == dense_steps
    assert tally.factor == steps + 1  # (each step's matrix once, and the measured displacements')


# ----------------------------------------------------------------------------- a host site with `higher_order`

A = np.array([[2.0, 1.0], [1.0, 3.0]])


def host_solve(matrix, calls):
    def solve(_, r):  # (a callback: NumPy's solve of `matrix r`)
        def run(r):
            calls.append("higher_order")
            return np.linalg.solve(matrix, r)

        return jax.pure_callback(run, jax.ShapeDtypeStruct(r.shape, r.dtype), r, vmap_method="sequential")

    return solve


def solve_site(calls, higher_order=True):
    """docs/troubleshooting.md's site: NumPy's solve, its adjoint, and the same solve as a
    `custom_linear_solve` for second order (each host call counted)."""

    def fwd(b):
        calls.append("fwd")
        return np.linalg.solve(A, b)

    def adjoint(b, ct):
        calls.append("adjoint")
        return np.linalg.solve(A.T, ct)

    def as_linear_solve(b):
        return jax.lax.custom_linear_solve(
            lambda x: jnp.asarray(A) @ x, b, host_solve(A, calls), host_solve(A.T, calls)
        )

    return dx.host(
        fwd,
        adjoint=adjoint,
        out=jax.ShapeDtypeStruct((2,), jnp.float64),
        name="solve",
        higher_order=as_linear_solve if higher_order else None,
    )


HOST_ORDERS = {
    **SECOND_ORDER,
    "jvp(closure_convert(grad))": lambda f: lambda b: LATER["jvp(closure_convert(grad))"](f, b, jnp.cos(b))[1],
    "jvp(dx.filter_grad)": lambda f: lambda b: jax.jvp(dx.filter_grad(f), (b,), (jnp.cos(b),))[1],
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("order", list(HOST_ORDERS))
def test_a_host_site_with_higher_order_has_second_derivatives(order, jit):
    """`dx.host(..., higher_order=f)`: every second derivative is the plain JAX program's,
    through `f`'s host calls; where the derivative is seen to be differentiated as it is
    traced, the site's own host functions do not run at all."""
    calls = []
    site = solve_site(calls)
    b = jnp.array([0.3, 0.7])
    fn = ft_jit(HOST_ORDERS[order](lambda b: jnp.sum(site(b) ** 3)), jit)
    got = fn(b)
    want = HOST_ORDERS[order](lambda b: jnp.sum(jnp.linalg.solve(jnp.asarray(A), b) ** 3))(b)
    close(got, want)
    assert "higher_order" in calls
    if "closure_convert" not in order:
        assert set(calls) == {"higher_order"}
    else:  # (the first derivative in a jaxpr: the forward ran, its derivatives through `f`)
        assert set(calls) == {"fwd", "higher_order"}


def test_a_host_site_with_higher_order_keeps_its_first_derivatives():
    """First derivatives do not call `higher_order`: the host functions, on their schedules."""
    calls = []
    site = solve_site(calls)
    b = jnp.array([0.3, 0.7])
    jax.grad(lambda b: jnp.sum(site(b) ** 3))(b)
    assert calls == ["fwd", "adjoint"]
    calls.clear()
    dx.filter_value_and_grad(lambda b: jnp.sum(site(b)))(b)
    assert sorted(calls) == ["adjoint", "fwd"]


def test_a_bad_higher_order_is_refused_by_name():
    with pytest.raises(TypeError) as info:
        dx.host(lambda b: b, out=jax.ShapeDtypeStruct((2,), jnp.float64), name="solve", higher_order=3)
    assert str(info.value) == (
        "`ExpensiveFn(name='solve')`: `higher_order` must be a JAX function of `x` that returns `y` (one JAX can "
        "differentiate to\nevery order), or None, but got 3."
    )


def test_higher_order_gives_forward_mode_where_no_jvp_is_given():
    """Forward mode through a host site with `adjoint` alone and `higher_order`: `jax.jacfwd`
    is the plain JAX program's, through `higher_order`'s host calls (without it, "give `jvp`")."""
    calls = []
    b = jnp.array([0.3, 0.7])
    got = jax.jacfwd(solve_site(calls))(b)
    close(got, jax.jacfwd(lambda b: jnp.linalg.solve(jnp.asarray(A), b))(b))
    assert "higher_order" in calls and "adjoint" not in calls
    with pytest.raises(TypeError, match="needs a\nforward-mode implementation"):
        jax.jacfwd(solve_site([], higher_order=False))(b)


def test_the_hessians_of_several_systems_under_vmap():
    """`vmap` over two matrices of the whole Hessian: each matrix's right-hand sides (a
    column each) solved together, each matrix factored once."""
    pattern, values, b = system()
    tally = Tally()
    vs = jnp.stack([fresh(values), fresh(values)])
    got = jax.jit(jax.vmap(jax.hessian(lambda v: ours(pattern, tally)(v, b))))(vs)
    close(got, jax.vmap(jax.hessian(lambda v: dense(pattern)(v, b)))(vs), rtol=1e-9, atol=1e-10)
    assert tally.factor == 2
    assert tally.solves <= 8  # (two matrices, at most four solve calls each: their columns together)


def test_a_host_site_with_an_integer_leaf_in_second_order():
    """`x = (b, k)` with `k` an integer (no tangent, no cotangent): the Hessian in `b`, and a
    forward-mode derivative traced into a jaxpr and differentiated again, are plain JAX's."""

    def fwd(x):
        b, k = x
        return k * np.linalg.solve(A, b)

    def adjoint(x, ct):
        b, k = x
        return k * np.linalg.solve(A.T, ct), np.zeros((), np.int32)

    def as_linear_solve(x):
        b, k = x
        solved = jax.lax.custom_linear_solve(lambda y: jnp.asarray(A) @ y, b, host_solve(A, []), host_solve(A.T, []))
        return k.astype(b.dtype) * solved

    site = dx.host(fwd, adjoint=adjoint, out=jax.ShapeDtypeStruct((2,), jnp.float64), higher_order=as_linear_solve)
    k = jnp.int32(3)
    b = jnp.array([0.3, 0.7])
    plain = lambda b: jnp.sum((3.0 * jnp.linalg.solve(jnp.asarray(A), b)) ** 3)  # noqa: E731
    ours = lambda b: jnp.sum(site((b, k)) ** 3)  # noqa: E731
    close(jax.hessian(ours)(b), jax.hessian(plain)(b))
    close(jax.jacfwd(converted(jax.jacfwd, ours, b))(b), jax.jacfwd(jax.jacfwd(plain))(b))
