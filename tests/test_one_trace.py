"""One trace per call: the failure classes of the multi-pass design, each against
`eqx.filter_value_and_grad` of the same program (float64), eagerly and under
`eqx.filter_jit`, with execution counts."""

import collections
import dataclasses
import functools as ft
import os
import re
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx

from .helpers import assert_tree_allclose, make


def ref(x):
    return jnp.sin(x) * jnp.exp(0.3 * x)


W = jnp.array([1.0, -2.0, 0.5, 3.0])
P0 = jnp.array([0.3, -0.2, 0.8, 0.1])


def plain(p):
    """The same function as `make(ref, ...)`, in plain JAX: the independent reference."""
    return ref(p)


def check(loss, reference, p, counter):
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


# ----------------------------------------------------------------------------- eager calls read afresh


def test_list_element_changed_between_calls(counter):
    f = make(ref, ("fwd", "bwd", "fused"), counter)
    weights = [W]
    loss = lambda p: jnp.sum(weights[0] * f(p))  # noqa: E731
    reference = lambda p: jnp.sum(weights[0] * plain(p))  # noqa: E731
    step = dx.filter_value_and_grad(loss)
    first = step(P0)
    weights[0] = 2.0 * W
    second = step(P0)  # the same function object, called again after the change
    assert_tree_allclose(second, eqx.filter_value_and_grad(reference)(P0))
    assert not np.allclose(first[0], second[0])
    check(loss, reference, P0, counter)


def test_attribute_changed_between_calls(counter):
    class Config:
        scale = 1.0

    config = Config()
    f = make(ref, ("fwd", "bwd", "fused"), counter)
    step = dx.filter_value_and_grad(lambda p: config.scale * jnp.sum(W * f(p)))
    step(P0)
    config.scale = -3.0
    assert_tree_allclose(step(P0), eqx.filter_value_and_grad(lambda p: -3.0 * jnp.sum(W * plain(p)))(P0))
    check(lambda p: config.scale * jnp.sum(W * f(p)), lambda p: -3.0 * jnp.sum(W * plain(p)), P0, counter)


def test_expensive_fn_in_a_dict_replaced(counter):
    fns = {"sim": make(ref, ("fwd", "bwd", "fused"), counter)}
    step = dx.filter_value_and_grad(lambda p: jnp.sum(W * fns["sim"](p)))
    step(P0)
    fns["sim"] = make(jnp.cos, ("fwd", "bwd", "fused"), counter)
    counter.reset()
    got = step(P0)
    jax.effects_barrier()
    assert_tree_allclose(got, eqx.filter_value_and_grad(lambda p: jnp.sum(W * jnp.cos(p)))(P0))
    assert counter.as_dict() == {"fwd": 0, "bwd": 0, "fused": 1}


@pytest.mark.parametrize("where", ["loss", "fwd"])
def test_numpy_array_changed_in_place(where, counter):
    weights = np.array([1.0, -2.0, 0.5, 3.0])
    if where == "loss":
        f = make(ref, ("fwd", "bwd", "fused"), counter)
        loss = lambda p: jnp.sum(weights * f(p))  # noqa: E731
    else:  # read by the implementations (the standard schedule, run eagerly)
        f = dx.ExpensiveFn(fwd=lambda x: x * weights, bwd=lambda x, y, ct: ct * weights, name="scale")
        loss = lambda p: jnp.sum(f(p) ** 2)  # noqa: E731
    step = dx.filter_value_and_grad(loss)
    step(P0)
    weights[:] = [4.0, 3.0, 2.0, 1.0]
    if where == "loss":
        expected = eqx.filter_value_and_grad(lambda p: jnp.sum(jnp.asarray(weights) * plain(p)))(P0)
    else:
        expected = eqx.filter_value_and_grad(lambda p: jnp.sum((p * jnp.asarray(weights)) ** 2))(P0)
    assert_tree_allclose(step(P0), expected)


SCALE = 1.0


def _module_level_loss(p, f):
    return SCALE * jnp.sum(W * f(p))


class _Callable:
    def __init__(self, f):
        self.f = f

    def __call__(self, p):
        return SCALE * jnp.sum(W * self.f(p))


class _Plain:
    def __init__(self, f):
        self.f = f

    def loss(self, p):
        return SCALE * jnp.sum(W * self.f(p))


@pytest.mark.parametrize("kind", ["partial", "callable_object", "bound_method"])
def test_rebound_global_read_through_a_wrapper(kind, counter):
    global SCALE
    f = make(ref, ("fwd", "bwd", "fused"), counter)
    loss = {"partial": ft.partial(_module_level_loss, f=f), "callable_object": _Callable(f), "bound_method": _Plain(f).loss}[kind]
    step = dx.filter_value_and_grad(loss)
    try:
        SCALE = 1.0
        step(P0)
        SCALE = 5.0
        assert_tree_allclose(step(P0), eqx.filter_value_and_grad(lambda p: 5.0 * jnp.sum(W * plain(p)))(P0))
        check(loss, lambda p: 5.0 * jnp.sum(W * plain(p)), P0, counter)
    finally:
        SCALE = 1.0


FWD_SCALE = 1.0


def test_site_fwd_reads_a_rebound_global(counter):
    """A standard site's implementation runs eagerly on every eager call, as in Equinox."""
    global FWD_SCALE
    f = dx.ExpensiveFn(fwd=lambda x: FWD_SCALE * jnp.sin(x), bwd=lambda x, y, ct: FWD_SCALE * ct * jnp.cos(x), name="g")
    step = dx.filter_value_and_grad(lambda p: jnp.sum(f(p) ** 2))
    try:
        step(P0)
        FWD_SCALE = 2.0
        assert_tree_allclose(step(P0), eqx.filter_value_and_grad(lambda p: jnp.sum((2.0 * jnp.sin(p)) ** 2))(P0))
    finally:
        FWD_SCALE = 1.0


@pytest.mark.parametrize("first, second", [(0.0, -0.0), (1, True)])
def test_static_arguments_equal_but_not_identical(first, second, counter):
    f = make(ref, ("fwd", "bwd", "fused"), counter)

    def program(y, p, s):
        angle = jnp.arctan2(jnp.float64(s), -1.0)  # pi for 0.0, -pi for -0.0
        return jnp.sum(W * y) * angle * (2.0 if s is True else 1.0)

    step = dx.filter_value_and_grad(lambda p, s: program(f(p), p, s))
    for s in (first, second, first):
        got = step(P0, s)
        assert_tree_allclose(got, eqx.filter_value_and_grad(lambda p, s: program(plain(p), p, s))(P0, s))


class _Signed(eqx.Module):
    """An implementation with a Python-number setting that `==` cannot tell from another."""

    s: float

    def __call__(self, x, ct=None):
        sign = np.copysign(1.0, self.s) * (2.0 if self.s is True else 1.0)
        return sign * ref(x) if ct is None else (sign * ref(x), jax.vjp(lambda x: sign * ref(x), x)[1](ct)[0])


@pytest.mark.parametrize("first, second", [(0.0, -0.0), (1, True)])
def test_implementation_settings_equal_but_not_identical(first, second):
    """A new `ExpensiveFn` whose implementation differs only by `0.0` against `-0.0` (or `1`
    against `True`) is a new program, not the cached one."""
    for s in (first, second, first):
        f = dx.ExpensiveFn(fwd=_Signed(s), fused=_Signed(s), name="signed")
        sign = np.copysign(1.0, s) * (2.0 if s is True else 1.0)
        got = dx.filter_value_and_grad(lambda p, f=f: jnp.sum(W * f(p)))(P0)
        assert_tree_allclose(got, jax.value_and_grad(lambda p, sign=sign: jnp.sum(W * sign * plain(p)))(P0))


@dataclasses.dataclass
class _Tolerance:
    """A mutable (not frozen) implementation: its settings can change after a call."""

    scale: float

    def __call__(self, x, ct=None):
        return self.scale * ref(x) if ct is None else (self.scale * ref(x), self.scale * jax.vjp(ref, x)[1](ct)[0])


def test_mutable_implementations_are_not_merged_by_their_current_settings():
    """Two mutable implementations with equal settings are different objects: after one is
    changed, a program with the other must not run it (nor the reverse)."""
    a, b = _Tolerance(1.0), _Tolerance(1.0)
    fa = dx.ExpensiveFn(fwd=a, fused=a, name="tol")
    fb = dx.ExpensiveFn(fwd=b, fused=b, name="tol")
    expected = lambda scale: jax.value_and_grad(lambda p: jnp.sum(W * scale * plain(p)))(P0)  # noqa: E731
    assert_tree_allclose(dx.filter_value_and_grad(lambda p: jnp.sum(W * fa(p)))(P0), expected(1.0))
    a.scale = 3.0
    assert_tree_allclose(dx.filter_value_and_grad(lambda p: jnp.sum(W * fb(p)))(P0), expected(1.0))
    assert_tree_allclose(dx.filter_value_and_grad(lambda p: jnp.sum(W * fa(p)))(P0), expected(3.0))


RULE_SCALE = 1.0  # read by the custom_jvp rule below; rebound by the test


@jax.custom_jvp
def _scaled_tanh(x):
    return jnp.tanh(x)


@_scaled_tanh.defjvp
def _scaled_tanh_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return jnp.tanh(x), RULE_SCALE * t / jnp.cosh(x) ** 2  # a deliberately "wrong" rule that reads a global


def test_custom_rules_in_the_loss_and_the_cache(counter):
    """`jax.nn.relu`, `jax.nn.softmax` and a user `custom_jvp` in the loss: the second call
    with the same program reuses the compiled stages (their rules are new objects every
    trace, keyed by what they compute); a rule that reads a rebound global is a new program.
    A `custom_vjp` (its backward rule cannot be keyed) is not cached, and still right."""
    global RULE_SCALE
    from deferax import _transform

    f = make(ref, ("fwd", "bwd", "fused"), counter)
    loss = lambda p: jnp.sum(W * f(p)) + jnp.sum(jax.nn.relu(p)) + jnp.sum(jax.nn.softmax(p) * W) + jnp.sum(_scaled_tanh(p))  # noqa: E731
    reference = lambda p: jnp.sum(W * plain(p)) + jnp.sum(jax.nn.relu(p)) + jnp.sum(jax.nn.softmax(p) * W) + jnp.sum(_scaled_tanh(p))  # noqa: E731
    step = dx.filter_value_and_grad(loss)
    _transform._CACHE.clear()
    try:
        for scale, new_entries in ((1.0, 1), (1.0, 0), (3.0, 1), (3.0, 0), (1.0, 0)):
            RULE_SCALE = scale
            before = len(_transform._CACHE)
            counter.reset()
            got = step(P0)
            assert counter.as_dict() == {"fwd": 0, "bwd": 0, "fused": 1}
            assert_tree_allclose(got, jax.value_and_grad(reference)(P0))
            assert len(_transform._CACHE) - before == new_entries, scale
        # a custom_vjp's backward rule cannot be keyed: not cached, run uncompiled, still right
        clipped = jax.custom_vjp(lambda x: x)
        clipped.defvjp(lambda x: (x, None), lambda _, ct: (jnp.clip(ct, -1.0, 1.0),))
        for _ in range(2):
            before = len(_transform._CACHE)
            counter.reset()
            got = dx.filter_value_and_grad(lambda p: jnp.sum(W * f(clipped(p))))(P0)
            assert counter.as_dict() == {"fwd": 0, "bwd": 0, "fused": 1} and len(_transform._CACHE) == before
            assert_tree_allclose(got, jax.value_and_grad(lambda p: jnp.sum(W * plain(clipped(p))))(P0))
        # a rule with symbolic zeros sees which tangents are zero: not keyed, still right
        sym = jax.custom_jvp(jnp.sin)
        sym.defjvp(lambda primals, tangents: (jnp.sin(primals[0]), jnp.cos(primals[0]) * tangents[0]), symbolic_zeros=True)
        for _ in range(2):
            assert_tree_allclose(dx.filter_value_and_grad(lambda p: jnp.sum(sym(p) * f(p)))(P0), jax.value_and_grad(lambda p: jnp.sum(sym(p) * plain(p)))(P0))
    finally:
        RULE_SCALE = 1.0


KEY = jax.random.key(3)


@jax.custom_jvp
def _keyed(x):
    return x


@_keyed.defjvp
def _keyed_jvp(primals, tangents):  # its rule closes over a PRNG key: a constant of an extended dtype
    return primals[0], tangents[0] * (1.0 + jax.random.uniform(KEY, (), dtype=primals[0].dtype))


def test_custom_jvp_rule_with_a_prng_key_constant(counter):
    """A rule whose program holds a PRNG key cannot be keyed by its constants' bytes: the
    program is not cached, and the result is still right."""
    f = make(ref, ("fwd", "bwd", "fused"), counter)
    loss = lambda p: jnp.sum(W * f(p)) + jnp.sum(_keyed(p))  # noqa: E731
    reference = lambda p: jnp.sum(W * plain(p)) + jnp.sum(_keyed(p))  # noqa: E731
    for _ in range(2):
        assert_tree_allclose(dx.filter_value_and_grad(loss)(P0), jax.value_and_grad(reference)(P0))


def test_typechecking_switched_on_after_a_first_call_with_it_off():
    from jaxtyping import Array, Float

    def fused(x: Float[Array, " 4"], ct: Float[Array, " 4"]):
        return jnp.sin(x), ct * jnp.cos(x)

    f = dx.ExpensiveFn(fwd=jnp.sin, fused=fused, name="typed")
    step = dx.filter_value_and_grad(lambda p: jnp.sum(W[:3] * f(p)))
    with dx.typechecking(False):
        step(P0[:3])  # a shape the annotation refuses, unchecked
    with dx.typechecking(True), pytest.raises(dx.AnnotationError, match="typed"):
        step(P0[:3])


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
        assert_tree_allclose(jax.block_until_ready(step(P0)), jax.value_and_grad(lambda p: jnp.log(jnp.sum(W * plain(p)) + 3.0))(P0))
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
    assert_tree_allclose(dx.filter_value_and_grad(no_site)(P0, jnp.asarray(3)), eqx.filter_value_and_grad(no_site)(P0, jnp.asarray(3)))


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


# ----------------------------------------------------------------------------- the caller's switches hold in every thread


def test_typechecking_off_holds_in_the_threads_of_several_sites():
    from jaxtyping import Array, Float

    def fused(x: Float[Array, " 4"], ct: Float[Array, " 4"]):
        return jnp.sin(x), ct * jnp.cos(x)

    fs = [dx.ExpensiveFn(fwd=jnp.sin, fused=fused, name=f"typed{i}") for i in range(3)]

    def loss(p):
        return sum(jnp.sum(f(p * (i + 1))) for i, f in enumerate(fs))

    reference = lambda p: sum(jnp.sum(jnp.sin(p * (i + 1))) for i in range(3))  # noqa: E731
    p = P0[:3]  # the annotation says 4: refused when checked
    with dx.typechecking(False):
        assert_tree_allclose(dx.filter_value_and_grad(loss)(p), eqx.filter_value_and_grad(reference)(p))
    with pytest.raises(dx.AnnotationError):
        dx.filter_value_and_grad(loss)(p)


def test_jax_config_context_holds_in_the_threads_of_several_sites():
    promotions = []

    def fused(x, ct):
        promotions.append(jax.config.jax_numpy_dtype_promotion)
        return jnp.sin(x), ct * jnp.cos(x)

    fs = [dx.ExpensiveFn(fwd=jnp.sin, fused=fused, name=f"s{i}") for i in range(3)]
    loss = lambda p: sum(jnp.sum(f(p * (i + 1))) for i, f in enumerate(fs))  # noqa: E731
    reference = lambda p: sum(jnp.sum(jnp.sin(p * (i + 1))) for i in range(3))  # noqa: E731
    with jax.numpy_dtype_promotion("standard"):
        got = dx.filter_value_and_grad(loss)(P0)
    assert promotions == ["standard"] * 3  # each site's `fused` once, on the pool's threads
    assert_tree_allclose(got, jax.value_and_grad(reference)(P0))


# ----------------------------------------------------------------------------- several host sites under vmap


def test_host_sites_under_vmap_submit_the_whole_batch_at_once():
    """Two host sites under `vmap` over 3 examples: every forward and adjoint (12 jobs)
    waits at one barrier, so the call finishes only if the whole batch is submitted at once."""
    import concurrent.futures as cf

    A = np.array([[2.0, 1.0, 0.0, 0.0], [1.0, 3.0, 0.5, 0.0], [0.0, 0.5, 4.0, 1.0], [0.0, 0.0, 1.0, 5.0]])
    barrier = threading.Barrier(12, timeout=20)

    def solve(b):
        barrier.wait()
        return np.linalg.solve(A, b)

    def adjoint(b, ct):
        barrier.wait()
        return np.linalg.solve(A.T, ct)

    out = jax.ShapeDtypeStruct((4,), jnp.float64)
    with cf.ThreadPoolExecutor(12) as pool:
        fs = [dx.host(solve, adjoint=adjoint, out=out, executor=pool, name=f"solve{i}") for i in range(2)]

        def loss(p):
            batch = jnp.stack([p, 2 * p, p + 1])
            return sum(jnp.sum(W * jax.vmap(f)(batch * (i + 1))) for i, f in enumerate(fs))

        plan = dx.explain(loss, P0)
        assert [s.schedule for s in plan.sites] == ["deferred", "deferred"] and plan.sites[0].batch == (3,)
        got = dx.filter_value_and_grad(loss)(P0)

    Ainv = jnp.asarray(np.linalg.inv(A))

    def reference(p):
        batch = jnp.stack([p, 2 * p, p + 1])
        return sum(jnp.sum(W * ((batch * (i + 1)) @ Ainv.T)) for i in range(2))

    assert_tree_allclose(got, eqx.filter_value_and_grad(reference)(P0))


def test_vectorized_host_site_gets_the_whole_batch():
    sizes = []

    def solve(b):
        sizes.append(b.shape[0])
        return 2.0 * b

    def adjoint(b, ct):
        sizes.append(ct.shape[0])
        return 2.0 * ct

    f = dx.host(solve, adjoint=adjoint, out=jax.ShapeDtypeStruct((4,), jnp.float64), vectorized=True, name="vec")

    def loss(p):
        return jnp.sum(W * jax.vmap(f)(jnp.stack([p, 2 * p, 3 * p, p - 1])))

    got = dx.filter_value_and_grad(loss)(P0)
    assert sizes == [4, 4]  # one forward and one adjoint call, each on the batch of 4
    assert_tree_allclose(got, eqx.filter_value_and_grad(lambda p: jnp.sum(W * 2.0 * jnp.stack([p, 2 * p, 3 * p, p - 1])))(P0))


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
    in the input; a float32 site next to a float64 one; a site seen only by aux."""
    f = make(ref, ("fwd", "bwd", "fused"), counter, name="f64")
    g = make(ref, ("fwd", "bwd", "fused"), counter, name="f32")
    params = {
        "a": P0, "n": jnp.array([1, 2, 3, 4]), "c": jnp.array([1.0 + 1j, 2.0 - 1j]),
        "h": jnp.array([0.5, 0.25, 1.0, 2.0], jnp.float32), "s": 3, "name": "x",
    }  # fmt: skip

    def program(p, f, g):
        y = f(p["a"] * p["n"].astype(jnp.float64))
        z = jnp.real(jnp.sum(p["c"] * jnp.conj(p["c"])))
        return jnp.sum(W * y) + z + jnp.sum(g(p["h"])).astype(jnp.float64) * p["s"], {"seen": f(p["a"]), "tag": p["name"]}

    loss = lambda p: program(p, f, g)  # noqa: E731
    reference = lambda p: program(p, plain, plain)  # noqa: E731
    plan = dx.explain(dx.filter_value_and_grad(loss, has_aux=True), params)
    assert [s.schedule for s in plan.sites] == ["deferred", "deferred", "deferred"]
    assert [s.in_shapes for s in plan.sites] == ["float64[4]", "float32[4]", "float64[4]"]
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
            assert aux["tag"] == "x" and grad["n"] is None and grad["name"] is None and grad["h"].dtype == jnp.float32
            np.testing.assert_allclose(value, value_r, rtol=1e-6)
            for key in ("a", "c", "h"):
                np.testing.assert_allclose(grad[key], grad_r[key], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(aux["seen"], aux_r["seen"], rtol=1e-12)


def test_jax_config_context_holds_in_the_threads_of_fuse():
    """`dx.fuse` runs its two halves on threads: they see the caller's dtype promotion."""
    seen = []

    def fwd(x):
        seen.append(jax.config.jax_numpy_dtype_promotion)
        return jnp.sin(x)

    def adjoint(x, ct):
        seen.append(jax.config.jax_numpy_dtype_promotion)
        return ct * jnp.cos(x)

    f = dx.ExpensiveFn(fwd=jnp.sin, fused=dx.fuse(fwd, adjoint), name="fused")
    with jax.numpy_dtype_promotion("standard"):
        got = dx.filter_value_and_grad(lambda p: jnp.sum(W * f(p)))(P0)
    assert seen == ["standard", "standard"]  # traced once each, on the pool's threads
    assert_tree_allclose(got, eqx.filter_value_and_grad(lambda p: jnp.sum(W * jnp.sin(p)))(P0))


def test_fuse_under_vmap_runs_the_batch_once_and_compiles_once():
    """A `dx.fuse` site under `vmap`: the whole batch's forward and adjoint run once each
    (not once per example), and repeated eager calls reuse the compiled halves."""
    traces, runs = [], []

    def fwd(x):
        traces.append("fwd")
        jax.debug.callback(lambda: runs.append("fwd"))
        return jnp.sin(x["a"]) * x["b"]

    def adjoint(x, ct):
        traces.append("adjoint")
        jax.debug.callback(lambda: runs.append("adjoint"))
        return {"a": ct * jnp.cos(x["a"]) * x["b"], "b": ct * jnp.sin(x["a"])}

    f = dx.ExpensiveFn(fwd=fwd, fused=dx.fuse(fwd, adjoint), name="fused")

    def loss(p):  # batched over `a`, `b` shared by the whole batch
        batch = jnp.stack([p["a"], 2 * p["a"], p["a"] - 1])
        return jnp.sum(jax.vmap(lambda a: f({"a": a, "b": p["b"]}))(batch) * W)

    def reference(p):
        batch = jnp.stack([p["a"], 2 * p["a"], p["a"] - 1])
        return jnp.sum(jnp.sin(batch) * p["b"] * W)

    p = {"a": P0, "b": jnp.array([1.0, 0.5, -1.0, 2.0])}
    step = dx.filter_value_and_grad(loss)
    step(p)
    for _ in range(2):
        jax.effects_barrier()
        traces.clear()
        runs.clear()
        got = step(p)
        jax.effects_barrier()
        assert sorted(runs) == ["adjoint", "fwd"] and traces == []
        assert_tree_allclose(got, eqx.filter_value_and_grad(reference)(p))
    assert_tree_allclose(eqx.filter_jit(step)(p), eqx.filter_value_and_grad(reference)(p))


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
        "`deferax.filter_value_and_grad`: schedule='deferred' was requested inside an enclosing differentiation (`jax.grad`,\n"
        "`jax.jacrev`, `jax.jvp`, ...), which would differentiate the deferred calls themselves. These sites' deferred calls\n"
        "run outside the program, through a callback that JAX cannot differentiate (a `dx.fuse`, halves made from `fwd` and\n"
        "`bwd` or `adjoint`, or a host function): `fused`. Use schedule='auto': under differentiation it keeps them standard."
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        jax.jacrev(dx.filter_grad(loss, schedule="deferred"))(P0)
    native = dx.ExpensiveFn(fwd=ref, bwd=lambda x, y, ct: adjoint(x, ct), fused=lambda x, ct: (ref(x), adjoint(x, ct)), name="native")
    native_loss = lambda p: jnp.sum(W * native(p)) + jnp.sum(p**3)  # noqa: E731
    assert_tree_allclose(jax.jacrev(dx.filter_grad(native_loss, schedule="deferred"))(P0), jax.hessian(reference)(P0))


# ----------------------------------------------------------------------------- custom rules that close over values of the loss


def _scaled_by_cos(x, kind):
    """`u -> u * scale` with `scale = stop_gradient(cos(x))` computed in the loss, and a
    custom rule that closes over `scale` (as fdtdx writes its time-reversal gradient)."""
    scale = jax.lax.stop_gradient(jnp.cos(x))
    if kind == "custom_vjp":
        f = jax.custom_vjp(lambda u: u * scale)
        f.defvjp(lambda u: (u * scale, None), lambda _, ct: (ct * scale,))
    else:
        f = jax.custom_jvp(lambda u: u * scale)
        f.defjvp(lambda primals, tangents: (primals[0] * scale, 2.0 * tangents[0] * scale))  # (a rule that is not the derivative)
    return f


@pytest.mark.parametrize("kind", ["custom_vjp", "custom_jvp"])
def test_custom_rule_closing_over_a_loss_value_runs_as_equinox(kind, counter):
    """A rule that closes over a value computed in the loss cannot run outside the trace it
    came from: the whole call runs as Equinox's does (with or without a site; the site on
    its standard schedule), and `explain` says why. Equinox is the reference (the rule is
    deliberately not the derivative for `custom_jvp`: its result is what Equinox returns)."""
    f = make(ref, ("fwd", "bwd", "fused"), counter, name="sim")
    cases = [
        (lambda p: jnp.sum(_scaled_by_cos(p, kind)(p) ** 2), {"fwd": 0, "bwd": 0, "fused": 0}),
        (lambda p: jnp.sum(W * f(_scaled_by_cos(p, kind)(p))), {"fwd": 1, "bwd": 1, "fused": 0}),
    ]
    for loss, counts in cases:
        plan = dx.explain(loss, P0)
        assert plan.fallback.startswith(f"a {kind} rule at {os.path.relpath(__file__)}:"), plan.fallback
        assert "closes over a value computed in the function" in plan.fallback
        assert "runs as `equinox.filter_value_and_grad` would" in str(plan)
        assert all(s.schedule == "standard" and s.reason == plan.fallback for s in plan.sites)
        for jit in (False, True):
            step = dx.filter_value_and_grad(loss)
            reference = eqx.filter_value_and_grad(loss)
            step, reference = (eqx.filter_jit(step), eqx.filter_jit(reference)) if jit else (step, reference)
            jax.effects_barrier()
            counter.reset()
            got = jax.block_until_ready(step(P0))
            jax.effects_barrier()
            assert counter.as_dict() == counts, (jit, counter.as_dict())
            assert_tree_allclose(got, reference(P0))
    # the plain-JAX reference agrees with Equinox here
    assert_tree_allclose(dx.filter_value_and_grad(cases[0][0])(P0), jax.value_and_grad(cases[0][0])(P0))


# ----------------------------------------------------------------------------- effects that must run once


class _Draws:
    """A host source of weights: each run returns the next draw, and counts."""

    def __init__(self):
        self.runs = 0

    def __call__(self):
        self.runs += 1
        return np.asarray(W) * (1.0 + self.runs)


@pytest.mark.parametrize("ordered", [True, False])
def test_io_callback_in_the_loss_runs_once_value_and_gradient_from_one_run(ordered, counter):
    """An `io_callback` that reads weights, for the cotangent or for the site's input: it
    runs once a call, as under Equinox, and value and gradient come from that one run (the
    site stays standard, and `explain` says why)."""
    f = make(ref, ("fwd", "bwd", "fused"), counter, name="sim")
    w = jax.ShapeDtypeStruct((4,), jnp.float64)

    def weights(draws):
        return jax.experimental.io_callback(draws, w, ordered=ordered)

    losses = {
        "cotangent": lambda p, draws: jnp.sum(weights(draws) * f(p)),  # io weights
        "input": lambda p, draws: jnp.sum(W * f(p * weights(draws))),
    }
    # one that no site needs ahead runs once, in the last stage: the site is deferred (on
    # the basis schedule, whose basis cotangents are computed from what they need alone)
    losses["not needed ahead"] = lambda p, draws: jnp.log(jnp.sum(W * f(p))) + jnp.sum(weights(draws) * p)
    for name, loss in losses.items():
        site = dx.explain(ft.partial(loss, draws=_Draws()), P0).sites[0]
        counts = {"fwd": 1, "bwd": 1, "fused": 0}
        if name == "not needed ahead":
            assert site.schedule == "deferred-basis" and site.k == 1
            counts = {"fwd": 0, "bwd": 0, "fused": 1}
        else:
            assert site.schedule == "standard", name
            assert site.reason.startswith(f"computing its input and cotangent ahead of the expensive calls runs `io_callback` at {os.path.relpath(__file__)}:"), site.reason
            assert site.reason.endswith("which must happen once a call, with the value")
        for jit in (False, True):
            draws, reference_draws = _Draws(), _Draws()
            step = dx.filter_value_and_grad(ft.partial(loss, draws=draws))
            reference = eqx.filter_value_and_grad(ft.partial(loss, draws=reference_draws))
            step, reference = (eqx.filter_jit(step), eqx.filter_jit(reference)) if jit else (step, reference)
            for call in range(1, 3):
                jax.effects_barrier()
                counter.reset()
                got = jax.block_until_ready(step(P0))
                jax.effects_barrier()
                assert draws.runs == call and counter.as_dict() == counts, (name, jit, draws.runs, counter.as_dict())
                assert_tree_allclose(got, reference(P0))
                assert reference_draws.runs == call


# ----------------------------------------------------------------------------- state in `jax.Ref`s


def _bwd_through_a_ref(x, y, ct):
    """`sin`'s backward rule that reads `y` only back from a `jax.Ref` it wrote it to."""
    box = jax.new_ref(jnp.zeros_like(y))
    box[...] = y
    return ct * jnp.sqrt(1.0 - box[...] ** 2)  # cos(x) for |x| < pi/2


def _write(box, value):
    box[...] = value


def _bwd_through_a_ref_in_a_jit(x, y, ct):
    box = jax.new_ref(jnp.zeros_like(y))
    jax.jit(_write)(box, y)  # written in a nested jaxpr
    return ct * jnp.sqrt(1.0 - box[...] ** 2)


def _bwd_through_a_ref_in_a_loop(x, y, ct):
    box = jax.new_ref(jnp.zeros_like(y))
    jax.lax.fori_loop(0, 2, lambda i, c: (_write(box, y), c)[1], 0.0)  # written in a loop body
    return ct * jnp.sqrt(1.0 - box[...] ** 2)


OUTSIDE = jax.new_ref(jnp.zeros(4))


def _bwd_keeping_y_outside(x, y, ct):
    OUTSIDE[...] = y  # read there after the call
    return ct * jnp.cos(x)


@pytest.mark.parametrize("bwd", [_bwd_through_a_ref, _bwd_through_a_ref_in_a_jit, _bwd_through_a_ref_in_a_loop, _bwd_keeping_y_outside])
def test_bwd_that_passes_y_through_a_ref_reads_y(bwd):
    """A `bwd` that reads `y` back from a `jax.Ref`, or leaves it in one from outside,
    reads `y`: no `fused` is made from it, and the gradient is `sin`'s."""
    runs = collections.Counter()
    counted = lambda name, fn: lambda *a: (jax.debug.callback(lambda: runs.update([name])), fn(*a))[1]  # noqa: E731
    f = dx.ExpensiveFn(fwd=counted("fwd", jnp.sin), bwd=counted("bwd", bwd), name="sin")
    loss = lambda p: jnp.sum(W * f(p))  # noqa: E731
    site = dx.explain(loss, P0).sites[0]
    assert site.schedule == "standard" and site.reason.startswith("no `fused` implementation, and its `bwd` reads `y`")
    OUTSIDE[...] = jnp.zeros(4)
    for jit in (False, True):
        step = eqx.filter_jit(dx.filter_value_and_grad(loss)) if jit else dx.filter_value_and_grad(loss)
        runs.clear()
        got = jax.block_until_ready(step(P0))
        jax.effects_barrier()
        assert runs == {"fwd": 1, "bwd": 1}, (jit, runs)
        assert_tree_allclose(got, jax.value_and_grad(lambda p: jnp.sum(W * jnp.sin(p)))(P0))
    if bwd is _bwd_keeping_y_outside:
        assert_tree_allclose(OUTSIDE[...], jnp.sin(P0))


def _through_a_ref(y):
    box = jax.new_ref(jnp.zeros_like(y))
    box[...] = y
    return box[...]


def test_loss_that_passes_values_through_refs(counter):
    """A loss that passes the output through a `jax.Ref` depends on it there (it was taken
    as not, and got a zero gradient); one that passes a coefficient through one is deferred
    with the coefficient it wrote (a read there was evaluated without the write)."""
    f = make(ref, ("fwd", "bwd", "fused"), counter, name="sim")
    square = lambda p: jnp.sum(W * _through_a_ref(f(p)) ** 2)  # noqa: E731
    site = dx.explain(square, P0).sites[0]
    assert site.schedule == "standard" and site.reason.startswith("its cotangent depends on its own output"), site.reason
    linear = lambda p: jnp.sum(_through_a_ref(2.0 * p) * f(p))  # noqa: E731
    assert dx.explain(linear, P0).sites[0].schedule == "deferred"
    for loss, reference, counts in (
        (square, lambda p: jnp.sum(W * plain(p) ** 2), {"fwd": 1, "bwd": 1, "fused": 0}),
        (linear, lambda p: jnp.sum(2.0 * p * plain(p)), {"fwd": 0, "bwd": 0, "fused": 1}),
    ):
        for jit in (False, True):
            step = eqx.filter_jit(dx.filter_value_and_grad(loss)) if jit else dx.filter_value_and_grad(loss)
            jax.effects_barrier()
            counter.reset()
            got = jax.block_until_ready(step(P0))
            jax.effects_barrier()
            assert counter.as_dict() == counts, (jit, counter.as_dict())
            assert_tree_allclose(got, jax.value_and_grad(reference)(P0))


def test_loss_that_writes_a_ref_from_outside():
    """A loss that writes a `jax.Ref` from outside: a write that its cotangent needs keeps
    the site standard (it would happen twice); one it does not need happens once a call, in
    the last stage, and the site is deferred. As under Equinox."""
    counter = jax.new_ref(jnp.zeros(()))
    coefficient = jax.new_ref(jnp.zeros(4))
    runs = collections.Counter()
    f = make(ref, ("fwd", "bwd", "fused"), name="sim")

    def loss(p, needed):
        counter[...] += 1.0
        coefficient[...] = 2.0 * jax.lax.stop_gradient(p)
        c = coefficient[...] if needed else W
        return jnp.sum(c * f(p))

    for needed, schedule in ((True, "standard"), (False, "deferred")):
        site = dx.explain(ft.partial(loss, needed=needed), P0).sites[0]
        assert site.schedule == schedule, needed
        if needed:
            assert site.reason.startswith("computing its input and cotangent ahead of the expensive calls writes to a `jax.Ref` from outside the function at ")
        for jit in (False, True):
            counter[...] = 0.0
            step = dx.filter_value_and_grad(ft.partial(loss, needed=needed))
            step = eqx.filter_jit(step) if jit else step
            got = [jax.block_until_ready(step(P0)) for _ in range(2)]
            assert float(counter[...]) == 2.0, (needed, jit)
            runs.clear()
            want = eqx.filter_value_and_grad(ft.partial(loss, needed=needed))
            for g in got:
                assert_tree_allclose(g, jax.value_and_grad(lambda p, c=(2.0 * P0 if needed else W): jnp.sum(c * plain(p)))(P0))
            assert_tree_allclose(got[0], want(P0))
