"""`dx.filter_value_and_grad` behaves as `eqx.filter_value_and_grad` does: the Python
function runs once per call, aux comes back as it was returned, data arguments stay
concrete, user custom rules may call sites, other inputs differentiated are told apart, and
an enclosing derivative gets the standard schedule. Each against Equinox on the same
program (float64), eagerly and under `eqx.filter_jit`, with execution counts."""

import collections
import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import deferax as dx

from .helpers import (
    FLOAT,
    FLOAT_NAME,
    P0,
    W,
    assert_tree_allclose,
    finite_difference_grad,
    float32,
    hlo_ops,
    make,
    plain,
    ref,
)

# ----------------------------------------------------------------------------- Python runs once per call


def test_python_function_runs_once_per_eager_call(counter):
    f = make(ref, ("fwd", "bwd", "fused"), counter)
    runs = []

    def loss(p):
        runs.append(1)
        return jnp.sum(W * f(p))

    step = dx.filter_value_and_grad(loss)
    for n in range(1, 4):
        step(P0)
        assert len(runs) == n


def test_python_randomness_value_and_gradient_from_one_draw(counter):
    f = make(ref, ("fwd", "bwd", "fused"), counter)
    rng = np.random.default_rng(0)

    def loss(p):
        idx = rng.choice(4, size=2, replace=False)  # a NumPy-drawn subsample
        return jnp.sum(W[idx] * f(p)[idx]), idx

    for _ in range(5):
        (value, idx), grad = dx.filter_value_and_grad(loss, has_aux=True)(P0)
        expected = eqx.filter_value_and_grad(lambda p, idx=idx: jnp.sum(W[idx] * plain(p)[idx]))(P0)
        assert_tree_allclose((value, grad), expected)


def test_debug_print_fires_once_with_real_values(counter, capfd):
    f = make(ref, ("fwd", "bwd", "fused"), counter)
    seen = []

    def loss(p):
        y = f(p)
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), y)
        jax.debug.print("loss sees {}", jnp.sum(y))
        return jnp.sum(W * y)

    for jit in (False, True):
        seen.clear()
        step = dx.filter_value_and_grad(loss)
        step = eqx.filter_jit(step) if jit else step
        jax.block_until_ready(step(P0))
        jax.effects_barrier()
        assert len(seen) == 1, jit
        np.testing.assert_allclose(seen[0], plain(P0))
    out = capfd.readouterr().out
    assert out.count("loss sees") == 2 and "loss sees 0.0" not in out
    # on the basis schedule too (its basis cotangents were computed from the whole program,
    # the callback included, with a zero stand-in for the output)

    def basis_loss(p):
        y = f(p)
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), y)
        return jnp.log(jnp.sum(W * y) + 3.0)

    assert dx.explain(basis_loss, P0).sites[0].schedule == "deferred-basis"
    for jit in (False, True):
        seen.clear()
        step = dx.filter_value_and_grad(basis_loss)
        step = eqx.filter_jit(step) if jit else step
        assert_tree_allclose(
            jax.block_until_ready(step(P0)), jax.value_and_grad(lambda p: jnp.log(jnp.sum(W * plain(p)) + 3.0))(P0)
        )
        jax.effects_barrier()
        assert len(seen) == 1, jit
        np.testing.assert_allclose(seen[0], plain(P0))


# ----------------------------------------------------------------------------- aux as Equinox returns it


def test_non_array_aux_returned_as_it_was(counter):
    f = make(ref, ("fwd", "bwd", "fused"), counter)
    marker = object()
    table = np.arange(3.0)

    def program(g):
        def loss(p):
            y = g(p)
            return jnp.sum(W * y), {"label": "run-1", "fn": jnp.sin, "obj": marker, "table": table, "y": y, "n": 3}

        return loss

    loss = program(f)
    counter.reset()
    (value, aux), grad = dx.filter_value_and_grad(loss, has_aux=True)(P0)
    jax.effects_barrier()
    assert counter.as_dict() == {"fwd": 0, "bwd": 0, "fused": 1}
    (value_e, aux_e), grad_e = eqx.filter_value_and_grad(loss, has_aux=True)(P0)  # Equinox: the aux types
    (value_r, _), grad_r = jax.value_and_grad(program(plain), has_aux=True)(P0)  # plain JAX: the numbers
    assert aux["label"] == "run-1" and aux["fn"] is jnp.sin and aux["obj"] is marker and aux["n"] == 3
    assert type(aux["table"]) is type(aux_e["table"]) and type(aux["table"]) is np.ndarray
    assert_tree_allclose((value, aux["y"], grad), (value_r, plain(P0), grad_r))
    # a string as the whole aux, under jit too
    got = eqx.filter_jit(dx.filter_value_and_grad(lambda p: (jnp.sum(W * f(p)), "label"), has_aux=True))(P0)
    assert got[0][1] == "label"


# ----------------------------------------------------------------------------- concrete arguments stay concrete


def test_python_values_from_data_arguments(counter):
    f = make(ref, ("fwd", "bwd", "fused"), counter)

    def program(g):
        def loss(p, n, flag, data):
            total = jnp.zeros(())
            for i in range(int(n)):  # `int` of a data argument
                total = total + float(i + 1) * jnp.sum(W * g(p))
            if flag:  # a Python branch on a data argument
                total = total + jnp.sum(p**2)
            scaled = np.asarray(data) * 2.0  # NumPy preprocessing of a data argument
            return total + jnp.sum(jnp.asarray(scaled) * p)

        return loss

    loss, reference = program(f), program(plain)
    data = jnp.array([1.0, 2.0, 3.0, 4.0])
    for n, flag in [(jnp.asarray(2), True), (jnp.asarray(1), False)]:
        counter.reset()
        got = dx.filter_value_and_grad(loss)(P0, n, flag, data)
        jax.effects_barrier()
        assert counter.as_dict() == {"fwd": 0, "bwd": 0, "fused": int(n)}  # one site per loop turn
        assert_tree_allclose(got, jax.value_and_grad(reference)(P0, n, flag, data))
    # and in a program with no expensive function at all
    no_site = lambda p, n: jnp.sum(p ** int(n))  # noqa: E731
    assert_tree_allclose(
        dx.filter_value_and_grad(no_site)(P0, jnp.asarray(3)), eqx.filter_value_and_grad(no_site)(P0, jnp.asarray(3))
    )


# ----------------------------------------------------------------------------- code that needs concrete values
# jax-fem's `ad_wrapper` pattern: a custom_vjp whose forward is a Newton loop on concrete values
# (the residual in JAX, its norm tested in a Python `while`, the Jacobian's entries to NumPy and
# a SciPy solve), and whose backward is a SciPy adjoint solve. Its users call `jax.grad` of it
# outside `jit`, where the custom_vjp's forward gets concrete values.

_STIFFNESS = np.array([[4.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 2.0]])
_LOAD = jnp.array([1.0, 2.0, 3.0])
_WEIGHTS = jnp.array([1.0, -0.5, 2.0])
# Newton's iterations stop at this norm of the residual: float32's rounding leaves one of about
# 1e-7 (with x64 on, the test's 1e-12).
_NEWTON_TOL = 1e-5 if float32() else 1e-12


def _residual(u, p):
    return jnp.asarray(_STIFFNESS) @ u + u**3 - p


def _newton_solve(runs):
    """`p -> u` with `K u + u**3 = p`, as a custom_vjp on concrete values; `runs` counts the
    forward solves and the adjoint solves that ran."""

    @jax.custom_vjp
    def solve(p):
        u = jnp.zeros_like(p)
        norm = jnp.linalg.norm(_residual(u, p))
        while float(norm) > _NEWTON_TOL:
            jacobian = np.array(jax.jacfwd(_residual)(u, p))
            u = u - jnp.asarray(scipy.linalg.solve(jacobian, np.array(_residual(u, p))))
            norm = jnp.linalg.norm(_residual(u, p))
        runs["fwd"] += 1
        return u

    def solve_fwd(p):
        u = solve(p)
        return u, u

    def solve_bwd(u, ct):
        runs["bwd"] += 1
        jacobian = _STIFFNESS + np.diag(3.0 * np.array(u) ** 2)
        return (jnp.asarray(scipy.linalg.solve(jacobian.T, np.array(ct))),)

    solve.defvjp(solve_fwd, solve_bwd)
    return solve


def test_a_custom_vjp_on_concrete_values_runs_as_equinox(counter):
    """Tracing it on abstract values fails at the `while`: the call runs as Equinox's does
    (the Newton solve on concrete values, once; its adjoint once; a site beside it standard),
    with plain JAX's value and gradient and the finite differences', and `explain` names the
    line that needs the concrete value."""
    runs = collections.Counter()
    solve = _newton_solve(runs)
    f = make(ref, ("fwd", "bwd", "fused"), counter, name="sim")
    loss = lambda p: jnp.sum(_WEIGHTS * jnp.sin(solve(p))) + jnp.sum(W * f(P0 * p[0]))  # noqa: E731
    reference = lambda p: jnp.sum(_WEIGHTS * jnp.sin(solve(p))) + jnp.sum(W * plain(P0 * p[0]))  # noqa: E731
    plan = dx.explain(loss, _LOAD)
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if "while float(norm)" in text)
    assert plan.sites == () and plan.fallback == (
        f"it needs a concrete value at {os.path.relpath(__file__)}:{line} `while float(norm) > _NEWTON_TOL:` "
        "(tracing it on abstract values raised `ConcretizationTypeError`), so deferax cannot trace it to look for "
        "expensive calls; called outside `jit` it gets concrete values there, as in Equinox"
    )
    assert "the call runs as `equinox.filter_value_and_grad` would: it needs a concrete value" in str(plan)
    assert dx.explain(jax.jit(dx.filter_value_and_grad(loss)), _LOAD).fallback == plan.fallback
    expected = jax.value_and_grad(reference)(_LOAD)  # plain JAX, outside `jit`
    assert_tree_allclose(expected[1], finite_difference_grad(reference, _LOAD), rtol=1e-6, atol=1e-8)
    for step in (dx.filter_value_and_grad(loss), dx.filter_value_and_grad(loss, max_basis=0)):
        runs.clear()
        counter.reset()
        got = step(_LOAD)
        jax.effects_barrier()
        assert dict(runs) == {"fwd": 1, "bwd": 1}
        assert counter.as_dict() == {"fwd": 1, "bwd": 1, "fused": 0}
        assert_tree_allclose(got, expected, rtol=1e-12, atol=1e-12)
        assert_tree_allclose(got, eqx.filter_value_and_grad(loss)(_LOAD), rtol=1e-12, atol=1e-12)
    assert_tree_allclose(dx.filter_grad(loss)(_LOAD), expected[1], rtol=1e-12, atol=1e-12)
    (value, aux), grad = dx.filter_value_and_grad(lambda p: (loss(p), "aux"), has_aux=True)(_LOAD)
    assert aux == "aux"
    assert_tree_allclose((value, grad), expected, rtol=1e-12, atol=1e-12)


def test_where_a_library_needs_the_concrete_value_the_users_line_is_named():
    """SciPy converting the value: the user's line, then the installed package's."""

    @jax.custom_vjp
    def solve(p):
        return jnp.asarray(scipy.linalg.solve(_STIFFNESS, p))

    solve.defvjp(lambda p: (solve(p), None), lambda _, ct: (jnp.asarray(scipy.linalg.solve(_STIFFNESS.T, ct)),))
    loss = lambda p: jnp.sum(solve(p) ** 2)  # noqa: E731
    fallback = dx.explain(loss, _LOAD).fallback
    line = next(
        i for i, text in enumerate(open(__file__).read().splitlines(), 1) if "linalg.solve(_STIFFNESS, p)" in text
    )
    assert fallback.startswith(
        f"it needs a concrete value at {os.path.relpath(__file__)}:{line} `return jnp.asarray(scipy.linalg.solve("
        "_STIFFNESS, p))` (in "
    ), fallback
    # (NumPy's line is named too, wherever NumPy is installed: a site-packages, or an image's folder)
    assert f"{os.sep}numpy{os.sep}" in fallback and "raised `TracerArrayConversionError`" in fallback
    grad = jnp.asarray(2.0 * np.linalg.solve(_STIFFNESS.T, np.linalg.solve(_STIFFNESS, np.asarray(_LOAD))))
    assert_tree_allclose(dx.filter_grad(loss)(_LOAD), grad)


def _eager_errors(loss, x):
    """The error Equinox raises for `loss` and the one deferax raises, each `(type, first line)`."""
    found = []
    for transform in (eqx.filter_value_and_grad, dx.filter_value_and_grad):
        with pytest.raises(Exception) as error:  # noqa: PT011 - compared below
            transform(loss)(x)
        found.append((type(error.value), str(error.value).splitlines()[0]))
    return found


def test_code_needing_concrete_values_raises_what_equinox_raises():
    """Where Equinox cannot give a concrete value either, the error is Equinox's: under `jit`
    (the Newton custom_vjp: `ConcretizationTypeError` at its `while`), and outside it for a
    differentiated value converted to NumPy or to a float in the loss itself (a bug of the
    loss's); a Python branch on a differentiated value works outside `jit`, as in Equinox."""
    runs = collections.Counter()
    solve = _newton_solve(runs)
    loss = lambda p: jnp.sum(_WEIGHTS * jnp.sin(solve(p)))  # noqa: E731
    errors = []
    for step in (jax.jit(dx.filter_value_and_grad(loss)), jax.jit(lambda p: eqx.filter_value_and_grad(loss)(p))):
        with pytest.raises(jax.errors.ConcretizationTypeError) as error:
            step(_LOAD)
        errors.append(type(error.value))
    assert errors == [jax.errors.ConcretizationTypeError] * 2
    for bug in (lambda p: jnp.sum(jnp.asarray(np.array(p))), lambda p: jnp.sum(p) * float(p[0])):
        (want, want_text), (got, got_text) = _eager_errors(bug, _LOAD)
        assert got is want and got_text == want_text
        assert want in (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError)
    branch = lambda p: jnp.sum(p**2) if p[0] > 0 else jnp.sum(p)  # noqa: E731
    assert_tree_allclose(dx.filter_value_and_grad(branch)(_LOAD), jax.value_and_grad(branch)(_LOAD))
    assert_tree_allclose(dx.filter_value_and_grad(branch)(-_LOAD), jax.value_and_grad(branch)(-_LOAD))


def test_schedule_deferred_on_code_needing_concrete_values_says_why():
    solve = _newton_solve(collections.Counter())
    loss = lambda p: jnp.sum(_WEIGHTS * solve(p))  # noqa: E731
    expected = (
        "`deferax.filter_value_and_grad`: schedule='deferred' was requested, but the function cannot be traced to "
        f"find its call sites: it needs a concrete value at {os.path.relpath(__file__)}:"
    )
    for call in (
        lambda: dx.filter_value_and_grad(loss, schedule="deferred")(_LOAD),
        lambda: dx.explain(dx.filter_grad(loss, schedule="deferred"), _LOAD),
    ):
        with pytest.raises(ValueError, match=re.escape(expected)) as error:
            call()
        assert str(error.value).endswith(
            "Use schedule='auto' to run it as `equinox.filter_value_and_grad` would, or compute what needs the "
            "concrete value from a non-differentiated argument (which stays concrete)."
        )


# ----------------------------------------------------------------------------- no site: Equinox's program

_DIAGONAL = np.array([2.0, 3.0, 4.0, 5.0])


def _host_solve(u):
    return jax.pure_callback(
        lambda v: np.asarray(v / _DIAGONAL), jax.ShapeDtypeStruct(u.shape, u.dtype), u, vmap_method="sequential"
    )


@jax.custom_vjp
def _solved(u):
    """A SciPy-style solve on the host as a custom_vjp (as jax_fdm writes its sparse solve)."""
    return _host_solve(u)


_solved.defvjp(lambda u: (_host_solve(u), None), lambda _, ct: (_host_solve(ct),))


@pytest.mark.parametrize("has_aux", [False, True])
def test_a_loss_with_no_site_compiles_to_equinox_s_program(has_aux):
    """With no site, the jitted step lowers to the program Equinox's does (the same
    operations, the same callbacks): the analysis runs while tracing and leaves nothing."""
    losses = [
        lambda p: jnp.sum(jnp.sin(p) ** 2),
        lambda p: jnp.sum(_solved(jnp.cos(p)) ** 2) + jnp.sum(p * _solved(p)),
    ]
    for loss in losses:
        fun = (lambda p, loss=loss: (loss(p), {"sum": jnp.sum(p), "n": 3})) if has_aux else loss
        got = hlo_ops(dx.filter_value_and_grad(fun, has_aux=has_aux), P0)
        assert got == hlo_ops(lambda p, fun=fun: eqx.filter_value_and_grad(fun, has_aux=has_aux)(p), P0)
        assert_tree_allclose(
            jax.jit(dx.filter_value_and_grad(fun, has_aux=has_aux))(P0),
            jax.jit(jax.value_and_grad(fun, has_aux=has_aux))(P0),
        )


# ----------------------------------------------------------------------------- user custom rules that call sites


def test_user_custom_rules_that_call_a_site(counter):
    f = make(ref, ("fwd", "bwd", "fused"), counter, name="inside_rule")

    @jax.custom_vjp
    def g(p):
        return f(p)

    def g_fwd(p):
        return f(p), p

    def g_bwd(p, ct):
        return (jax.vjp(f, p)[1](ct)[0],)

    g.defvjp(g_fwd, g_bwd)

    @jax.custom_jvp
    def h(p):
        return f(p)

    @h.defjvp
    def h_jvp(primals, tangents):
        (p,), (t,) = primals, tangents
        return f(p), jnp.cos(p) * jnp.exp(0.3 * p) * t + 0.3 * ref(p) * t

    for wrapped in (g, h):
        loss = lambda p, w=wrapped: jnp.sum(W * w(p))  # noqa: E731
        plan = dx.explain(loss, P0)
        assert plan.sites[0].schedule == "standard" and plan.sites[0].reason.startswith("called inside a custom_")
        for jit in (False, True):
            step = dx.filter_value_and_grad(loss)
            step = eqx.filter_jit(step) if jit else step
            assert_tree_allclose(step(P0), eqx.filter_value_and_grad(lambda p: jnp.sum(W * plain(p)))(P0))


def test_same_equations_with_other_inputs_differentiated():
    """Two programs with the same equations: one multiplies by a captured constant, the
    other by a second differentiated input. The cache must tell them apart."""
    w = jnp.array([1.0, 2.0, 3.0, 4.0])
    captured = lambda p: jnp.sum(p * w)  # noqa: E731
    both = lambda pw: jnp.sum(pw[0] * pw[1])  # noqa: E731
    for _ in range(2):
        assert_tree_allclose(dx.filter_value_and_grad(captured)(P0), eqx.filter_value_and_grad(captured)(P0))
        assert_tree_allclose(dx.filter_value_and_grad(both)((P0, w)), eqx.filter_value_and_grad(both)((P0, w)))


def test_mixed_leaves_nan_float32_and_aux_only_site(counter):
    """Integer, complex, float32 and non-array leaves in the differentiated argument; a NaN
    in the input; a float32 site next to a float64 one; a site seen only by aux. (In the
    float32 suite, a float16 leaf and site next to float32 ones: a narrower float beside the
    default one.)"""
    narrow = jnp.dtype(jnp.float16 if float32() else jnp.float32)
    f = make(ref, ("fwd", "bwd", "fused"), counter, name="f64")
    g = make(ref, ("fwd", "bwd", "fused"), counter, name="f32")
    params = {
        "a": P0,
        "n": jnp.array([1, 2, 3, 4]),
        "c": jnp.array([1.0 + 1j, 2.0 - 1j]),
        "h": jnp.array([0.5, 0.25, 1.0, 2.0], narrow),
        "s": 3,
        "name": "x",
    }

    def program(p, f, g):
        y = f(p["a"] * p["n"].astype(FLOAT))
        z = jnp.real(jnp.sum(p["c"] * jnp.conj(p["c"])))
        return jnp.sum(W * y) + z + jnp.sum(g(p["h"])).astype(FLOAT) * p["s"], {
            "seen": f(p["a"]),
            "tag": p["name"],
        }

    loss = lambda p: program(p, f, g)  # noqa: E731
    reference = lambda p: program(p, plain, plain)  # noqa: E731
    plan = dx.explain(dx.filter_value_and_grad(loss, has_aux=True), params)
    assert [s.schedule for s in plan.sites] == ["deferred", "deferred", "deferred"]
    assert [s.in_shapes for s in plan.sites] == [f"{FLOAT_NAME}[4]", f"{narrow.name}[4]", f"{FLOAT_NAME}[4]"]
    for p in (params, {**params, "a": P0.at[1].set(jnp.nan)}):
        for jit in (False, True):
            got_fn = dx.filter_value_and_grad(loss, has_aux=True)
            got_fn = eqx.filter_jit(got_fn) if jit else got_fn
            jax.effects_barrier()
            counter.reset()
            (value, aux), grad = got_fn(p)
            jax.effects_barrier()
            assert counter.as_dict() == {"fwd": 0, "bwd": 0, "fused": 3}
            (value_r, aux_r), grad_r = eqx.filter_value_and_grad(reference, has_aux=True)(p)
            assert aux["tag"] == "x" and grad["n"] is None and grad["name"] is None and grad["h"].dtype == narrow
            np.testing.assert_allclose(value, value_r, rtol=1e-6)
            for key in ("a", "c", "h"):
                # (the narrow leaf to a few of its own ulps: float16's, 4e-3, in the float32 suite)
                tol = max(1e-6, 4 * float(jnp.finfo(grad[key].dtype).eps))
                np.testing.assert_allclose(grad[key], grad_r[key], rtol=tol, atol=tol)
            np.testing.assert_allclose(aux["seen"], aux_r["seen"], rtol=1e-12)


def test_inside_an_enclosing_derivative_the_standard_schedule_is_used(counter):
    """`jax.grad` of a `dx.filter_value_and_grad` value, or `jax.jacrev` of its gradient (a
    Hessian): the enclosing derivative differentiates what runs, so the standard schedule
    runs (a `dx.fuse` callback has no derivative), and the results are right."""

    def adjoint(x, ct):
        return jax.vjp(ref, x)[1](ct)[0]

    f = dx.ExpensiveFn(fwd=ref, bwd=lambda x, y, ct: adjoint(x, ct), fused=dx.fuse(ref, adjoint), name="fused")
    loss = lambda p: jnp.sum(W * f(p)) + jnp.sum(p**3)  # noqa: E731
    reference = lambda p: jnp.sum(W * plain(p)) + jnp.sum(p**3)  # noqa: E731
    assert dx.explain(loss, P0).sites[0].schedule == "deferred"  # on its own it is deferred
    assert_tree_allclose(jax.grad(lambda p: dx.filter_value_and_grad(loss)(p)[0])(P0), jax.grad(reference)(P0))
    assert_tree_allclose(jax.jacrev(dx.filter_grad(loss))(P0), jax.hessian(reference)(P0))
    assert_tree_allclose(jax.jit(jax.jacrev(dx.filter_grad(loss)))(P0), jax.hessian(reference)(P0))
    assert_tree_allclose(jax.grad(jax.jit(lambda p: dx.filter_value_and_grad(loss)(p)[0]))(P0), jax.grad(reference)(P0))
    # schedule='deferred' asked for explicitly: a site whose deferred call leaves the program
    # cannot be differentiated, and the error says which and what to do (it was JAX's
    # "Pure callbacks do not support JVP"); a JAX-native `fused` can be, and is
    expected = (
        "`deferax.filter_value_and_grad`: schedule='deferred' was requested inside an enclosing differentiation "
        "(`jax.grad`,\n`jax.jacrev`, `jax.jvp`, ...), which would differentiate the deferred calls themselves. "
        "These sites' deferred calls\nrun outside the program, through a callback that JAX cannot differentiate, "
        "or (in the program, on an accelerator) as\ntheir implementations' halves, which JAX would differentiate in "
        "place of your rules (a `dx.fuse`, halves made from\n`fwd` and `bwd` or `adjoint`, or a host function): "
        "`fused`. Use schedule='auto': under differentiation it keeps them\nstandard."
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        jax.jacrev(dx.filter_grad(loss, schedule="deferred"))(P0)
    native = dx.ExpensiveFn(
        fwd=ref, bwd=lambda x, y, ct: adjoint(x, ct), fused=lambda x, ct: (ref(x), adjoint(x, ct)), name="native"
    )
    native_loss = lambda p: jnp.sum(W * native(p)) + jnp.sum(p**3)  # noqa: E731
    assert_tree_allclose(jax.jacrev(dx.filter_grad(native_loss, schedule="deferred"))(P0), jax.hessian(reference)(P0))


@pytest.mark.parametrize("wrap", ["eager", "jax.jit", "eqx.filter_jit"])
def test_constant_array_aux_is_an_array_as_equinox_returns_it(wrap):
    """An aux leaf that is a constant of the program (`jnp.array(False)`, `jnp.array(1.0)`)
    comes back as an array with Equinox's dtype and weak type, under `eqx.filter_jit` too,
    where a Python scalar would be taken for static (and recompile a step whose state holds it)."""
    f = make(ref, ("fwd", "bwd", "fused"), name="sim")

    def loss(p):
        return jnp.sum(W * f(p)), {"flag": jnp.array(False), "f": jnp.array(1.0), "n": 3, "x": jnp.sum(p)}

    transform = {
        "eager": lambda g: g,
        "jax.jit": lambda g: jax.jit(lambda p: g(p)),
        "eqx.filter_jit": eqx.filter_jit,
    }[wrap]
    (_, got), _ = transform(dx.filter_value_and_grad(loss, has_aux=True))(P0)
    (_, want), _ = transform(eqx.filter_value_and_grad(loss, has_aux=True))(P0)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for key in ("flag", "f", "x"):
        assert isinstance(got[key], jax.Array), (key, got[key])
        assert (got[key].dtype, got[key].weak_type) == (want[key].dtype, want[key].weak_type)
    assert got["n"] == 3 and isinstance(got["n"], jax.Array) == (wrap == "jax.jit")
    assert_tree_allclose(got, want)


def test_a_batchnorm_step_in_ema_mode_compiles_as_often_as_with_equinox():
    """`eqx.nn.BatchNorm`'s default mode keeps a first-time flag (a constant array) in its
    state: the jitted step must be traced as often as with Equinox (once), not again when
    the flag comes back as a Python bool."""
    f = make(ref, ("fwd", "bwd", "fused"), name="sim")
    xs = jnp.asarray(np.random.default_rng(0).normal(size=(5, 4)))

    def traces_of(value_and_grad):
        model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, axis_name="batch")
        traces = []

        def loss(model, state, xs):
            traces.append(1)
            ys, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(xs, state)
            return jnp.sum(W * f(ys[0])), state

        @eqx.filter_jit
        def step(model, state, xs):
            (value, state), grads = value_and_grad(loss, has_aux=True)(model, state, xs)
            return value, state, grads

        results = [step(model, state, xs)]
        for _ in range(3):
            results.append(step(model, results[-1][1], xs))
        return len(traces), results

    got, got_results = traces_of(dx.filter_value_and_grad)
    want, want_results = traces_of(eqx.filter_value_and_grad)
    assert got == want == 1
    assert_tree_allclose(
        [(v, g) for v, _, g in got_results], [(v, g) for v, _, g in want_results], rtol=1e-6, atol=1e-6
    )
