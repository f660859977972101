"""Eager calls read afresh: whatever the loss reads (a list, an attribute, a NumPy array, a
global, settings of an implementation) is read on every call, while the analysis and the
compiled stages are cached on the traced program. Each against `eqx.filter_value_and_grad`
of the same program (float64), eagerly and under `eqx.filter_jit`, with execution counts."""

import dataclasses
import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx

from .helpers import P0, W, assert_tree_allclose, check_one_fused, make, plain, ref

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
    check_one_fused(loss, reference, P0, counter)


def test_attribute_changed_between_calls(counter):
    class Config:
        scale = 1.0

    config = Config()
    f = make(ref, ("fwd", "bwd", "fused"), counter)
    step = dx.filter_value_and_grad(lambda p: config.scale * jnp.sum(W * f(p)))
    step(P0)
    config.scale = -3.0
    assert_tree_allclose(step(P0), eqx.filter_value_and_grad(lambda p: -3.0 * jnp.sum(W * plain(p)))(P0))
    check_one_fused(lambda p: config.scale * jnp.sum(W * f(p)), lambda p: -3.0 * jnp.sum(W * plain(p)), P0, counter)


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
    loss = {
        "partial": ft.partial(_module_level_loss, f=f),
        "callable_object": _Callable(f),
        "bound_method": _Plain(f).loss,
    }[kind]
    step = dx.filter_value_and_grad(loss)
    try:
        SCALE = 1.0
        step(P0)
        SCALE = 5.0
        assert_tree_allclose(step(P0), eqx.filter_value_and_grad(lambda p: 5.0 * jnp.sum(W * plain(p)))(P0))
        check_one_fused(loss, lambda p: 5.0 * jnp.sum(W * plain(p)), P0, counter)
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
    from deferax._stages import _run

    f = make(ref, ("fwd", "bwd", "fused"), counter)
    loss = lambda p: (
        jnp.sum(W * f(p)) + jnp.sum(jax.nn.relu(p)) + jnp.sum(jax.nn.softmax(p) * W) + jnp.sum(_scaled_tanh(p))
    )  # noqa: E731
    reference = lambda p: (
        jnp.sum(W * plain(p)) + jnp.sum(jax.nn.relu(p)) + jnp.sum(jax.nn.softmax(p) * W) + jnp.sum(_scaled_tanh(p))
    )  # noqa: E731
    step = dx.filter_value_and_grad(loss)
    _run._CACHE.clear()
    try:
        for scale, new_entries in ((1.0, 1), (1.0, 0), (3.0, 1), (3.0, 0), (1.0, 0)):
            RULE_SCALE = scale
            before = len(_run._CACHE)
            counter.reset()
            got = step(P0)
            assert counter.as_dict() == {"fwd": 0, "bwd": 0, "fused": 1}
            assert_tree_allclose(got, jax.value_and_grad(reference)(P0))
            assert len(_run._CACHE) - before == new_entries, scale
        # a custom_vjp's backward rule cannot be keyed: not cached, run uncompiled, still right
        clipped = jax.custom_vjp(lambda x: x)
        clipped.defvjp(lambda x: (x, None), lambda _, ct: (jnp.clip(ct, -1.0, 1.0),))
        for _ in range(2):
            before = len(_run._CACHE)
            counter.reset()
            got = dx.filter_value_and_grad(lambda p: jnp.sum(W * f(clipped(p))))(P0)
            assert counter.as_dict() == {"fwd": 0, "bwd": 0, "fused": 1} and len(_run._CACHE) == before
            assert_tree_allclose(got, jax.value_and_grad(lambda p: jnp.sum(W * plain(clipped(p))))(P0))
        # a rule with symbolic zeros sees which tangents are zero: not keyed, still right
        sym = jax.custom_jvp(jnp.sin)
        sym.defjvp(
            lambda primals, tangents: (jnp.sin(primals[0]), jnp.cos(primals[0]) * tangents[0]), symbolic_zeros=True
        )
        for _ in range(2):
            assert_tree_allclose(
                dx.filter_value_and_grad(lambda p: jnp.sum(sym(p) * f(p)))(P0),
                jax.value_and_grad(lambda p: jnp.sum(sym(p) * plain(p)))(P0),
            )
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
