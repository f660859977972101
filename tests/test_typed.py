"""Typed modules and typed implementations: shapes checked at run time."""

import os
import re
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jaxtyping import Array, Float, PyTree

import deferax as dx
import deferax._typed

from .helpers import assert_tree_allclose


class Linear(dx.TypedModule):
    weight: Float[Array, "out in"]
    bias: Float[Array, " out"]

    def __call__(self, x: Float[Array, " in"]) -> Float[Array, " out"]:
        return self.weight @ x + self.bias

    def pair(self, a: Float[Array, "batch in"], b: Float[Array, "batch in"]) -> Float[Array, "batch out"]:
        return (a + b) @ self.weight.T

    def tree(self, t: PyTree[Float[Array, " in"], "T"], s: PyTree[Float[Array, " in"], "T"]) -> Float[Array, ""]:
        return sum(jnp.sum(a * b) for a, b in zip(jax.tree.leaves(t), jax.tree.leaves(s), strict=True))

    def broken(self, x: Float[Array, " in"]) -> Float[Array, " out"]:
        return x  # wrong: returns an "in"-sized vector


def linear(n_in=3, n_out=2):
    return Linear(jnp.ones((n_out, n_in)), jnp.zeros(n_out))


def expect(exc_info, *, where, what, expected, found, bindings):
    text = str(exc_info.value)
    assert text.startswith(f"{where}: {what} does not match its annotation."), text
    assert f"expected: {expected}" in text, text
    assert f"received: {found}" in text, text
    assert f"dimension bindings so far: {bindings}" in text, text


def test_passing_calls_eager_jit_vmap():
    m = linear()
    x = jnp.arange(3.0)
    expected = m.weight @ x
    assert_tree_allclose(m(x), expected)
    assert_tree_allclose(eqx.filter_jit(m)(x), expected)
    assert_tree_allclose(jax.vmap(m)(jnp.stack([x, x])), jnp.stack([expected, expected]))
    assert_tree_allclose(m.pair(jnp.ones((4, 3)), jnp.ones((4, 3))), jnp.full((4, 2), 6.0))


def test_wrong_rank():
    with pytest.raises(dx.AnnotationError) as info:
        linear()(jnp.ones((3, 3)))
    expect(
        info,
        where="`Linear.__call__`",
        what="argument `x`",
        expected="Float[Array, 'in']",
        found="float64[3, 3]",
        bindings="out=2 (field `weight`), in=3 (field `weight`)",
    )


class ScaledLinear(Linear):
    """A subclass that inherits the annotated `__call__`."""

    scale: float = 2.0


def test_inherited_method_named_by_the_instance_class():
    m = ScaledLinear(jnp.ones((2, 3)), jnp.zeros(2))
    with pytest.raises(dx.AnnotationError) as info:
        m(jnp.ones(4))
    expect(
        info,
        where="`ScaledLinear.__call__`",
        what="argument `x`",
        expected="Float[Array, 'in']",
        found="float64[4]",
        bindings="out=2 (field `weight`), in=3 (field `weight`)",
    )


def test_wrong_size_of_named_dimension_bound_by_a_field():
    with pytest.raises(dx.AnnotationError) as info:
        linear()(jnp.ones(4))
    expect(
        info,
        where="`Linear.__call__`",
        what="argument `x`",
        expected="Float[Array, 'in']",
        found="float64[4]",
        bindings="out=2 (field `weight`), in=3 (field `weight`)",
    )


def test_inconsistent_dimension_between_two_arguments():
    with pytest.raises(dx.AnnotationError) as info:
        linear().pair(jnp.ones((4, 3)), jnp.ones((5, 3)))
    expect(
        info,
        where="`Linear.pair`",
        what="argument `b`",
        expected="Float[Array, 'batch in']",
        found="float64[5, 3]",
        bindings="out=2 (field `weight`), in=3 (field `weight`), batch=4",
    )


def test_wrong_dtype():
    with pytest.raises(dx.AnnotationError) as info:
        linear()(jnp.arange(3))
    expect(
        info,
        where="`Linear.__call__`",
        what="argument `x`",
        expected="Float[Array, 'in']",
        found="int64[3]",
        bindings="out=2 (field `weight`), in=3 (field `weight`)",
    )


def test_field_of_wrong_shape_at_construction():
    with pytest.raises(dx.AnnotationError) as info:
        Linear(jnp.ones((2, 3)), jnp.zeros(3))
    expect(
        info,
        where="`Linear(...)`",
        what="field `bias`",
        expected="Float[Array, 'out']",
        found="float64[3]",
        bindings="out=2 (field `weight`), in=3 (field `weight`)",
    )


def test_wrong_return_value():
    with pytest.raises(dx.AnnotationError) as info:
        linear().broken(jnp.ones(3))
    expect(
        info,
        where="`Linear.broken`",
        what="the return value",
        expected="Float[Array, 'out']",
        found="float64[3]",
        bindings="out=2 (field `weight`), in=3 (field `weight`)",
    )


def test_pytree_of_wrong_structure():
    m = linear()
    t = {"a": jnp.ones(3), "b": jnp.ones(3)}
    assert_tree_allclose(m.tree(t, t), jnp.asarray(6.0))
    with pytest.raises(dx.AnnotationError) as info:
        m.tree(t, (jnp.ones(3), jnp.ones(3)))
    assert str(info.value).startswith("`Linear.tree`: argument `s` does not match its annotation.")
    assert "received: (float64[3], float64[3])" in str(info.value)


def test_errors_under_jit_and_vmap():
    m = linear()
    with pytest.raises(dx.AnnotationError, match=re.escape("received: float64[4]")):
        eqx.filter_jit(m)(jnp.ones(4))
    # under vmap, the checked shapes are per example
    with pytest.raises(dx.AnnotationError, match=re.escape("received: float64[4]")):
        jax.vmap(m)(jnp.ones((7, 4)))


def test_switch_off_with_context_manager_and_function():
    m = linear()
    assert dx.typechecking_enabled()
    with dx.typechecking(False):
        assert not dx.typechecking_enabled()
        Linear(jnp.ones((2, 3)), jnp.zeros(3))  # not checked
        with pytest.raises(ValueError) as info:  # jnp's own error, not ours
            m(jnp.ones((3, 3, 3)))
        assert not isinstance(info.value, dx.AnnotationError)
    assert dx.typechecking_enabled()
    dx.set_typechecking(False)
    try:
        Linear(jnp.ones((2, 3)), jnp.zeros(3))
    finally:
        dx.set_typechecking(True)
    with pytest.raises(dx.AnnotationError):
        Linear(jnp.ones((2, 3)), jnp.zeros(3))


def test_switch_off_with_environment_variable():
    code = (
        "import jax.numpy as jnp, deferax as dx\n"
        "from jaxtyping import Array, Float\n"
        "class M(dx.TypedModule):\n"
        "    w: Float[Array, 'n']\n"
        "    def __call__(self, x: Float[Array, 'n']) -> Float[Array, 'n']:\n"
        "        return self.w\n"
        "print(dx.typechecking_enabled(), M(jnp.ones(2))(jnp.ones(5)).shape)\n"
    )
    env = {**os.environ, "DEFERAX_TYPECHECK": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False (2,)"


def test_checks_cost_nothing_after_tracing(monkeypatch):
    calls = []
    original = deferax._typed.check

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(deferax._typed, "check", counting)
    m = linear()
    step = eqx.filter_jit(lambda m, x: m(x))
    step(m, jnp.ones(3))
    traced = len(calls)
    assert traced > 0
    for _ in range(3):
        step(m, jnp.ones(3) * 2.0)
    assert len(calls) == traced


# ----------------------------------------------------------------------------- typed implementations


def fdtd(x: Float[Array, "nx ny"]) -> Float[Array, "nx ny"]:
    return jnp.sin(x) * 2.0


def fdtd_adjoint(
    x: Float[Array, "nx ny"], y: Float[Array, "nx ny"], ct: Float[Array, "nx ny"]
) -> Float[Array, "nx ny"]:
    return 2.0 * jnp.cos(x) * ct


def fdtd_fused(
    x: Float[Array, "nx ny"], ct: Float[Array, "nx ny"]
) -> tuple[Float[Array, "nx ny"], Float[Array, "nx ny"]]:
    return fdtd(x), 2.0 * jnp.cos(x) * ct


def bad_fwd(x: Float[Array, "nx ny"]) -> Float[Array, "nx ny"]:
    return x.T  # wrong for non-square grids


def bad_fused(
    x: Float[Array, "nx ny"], ct: Float[Array, "nx ny"]
) -> tuple[Float[Array, "nx ny"], Float[Array, "nx ny"]]:
    return fdtd(x), (2.0 * jnp.cos(x) * ct).T


@pytest.mark.parametrize("schedule", ["standard", "deferred"])
def test_typed_implementations_pass_on_every_schedule(schedule):
    f = dx.ExpensiveFn(fwd=fdtd, bwd=fdtd_adjoint, fused=fdtd_fused, name="fdtd")
    loss = lambda x: jnp.sum(f(x) * 3.0)  # noqa: E731
    x = jnp.ones((4, 5)) * 0.3
    got = dx.filter_value_and_grad(loss, schedule=schedule)(x)
    assert_tree_allclose(got, eqx.filter_value_and_grad(lambda x: jnp.sum(fdtd(x) * 3.0))(x))


# What the message says when `bad_fwd` returns `(5, 4)` for an input of `(4, 5)`.
BAD_FWD_SHAPE = dict(
    where="`ExpensiveFn(name='fdtd')` `fwd`",
    what="the return value",
    expected="Float[Array, 'nx ny']",
    found="float64[5, 4]",
    bindings="nx=4, ny=5",
)


def test_typed_fwd_returning_wrong_shape():
    f = dx.ExpensiveFn(fwd=bad_fwd, bwd=fdtd_adjoint, out=jax.ShapeDtypeStruct((4, 5), jnp.float64), name="fdtd")
    with pytest.raises(dx.AnnotationError) as info:
        f(jnp.ones((4, 5)))
    expect(info, **BAD_FWD_SHAPE)


@pytest.mark.parametrize("weights", [None, jnp.ones((4, 5))], ids=["sum", "weighted"])
def test_typed_fwd_returning_wrong_shape_on_the_deferred_schedule(weights):
    """Without `out=`, the output structure comes from tracing `fwd`: its annotations are
    checked there, so the error is `fwd`'s, as Equinox (which runs it) reports it, and not
    `fused`'s cotangent or a shape mismatch in the loss."""
    f = dx.ExpensiveFn(fwd=bad_fwd, bwd=fdtd_adjoint, fused=fdtd_fused, name="fdtd")
    loss = (lambda x: jnp.sum(f(x))) if weights is None else (lambda x: jnp.sum(weights * f(x)))
    for run in (dx.filter_value_and_grad(loss), eqx.filter_value_and_grad(loss), lambda x: dx.explain(loss, x)):
        with pytest.raises(dx.AnnotationError) as info:
            run(jnp.ones((4, 5)))
        expect(info, **BAD_FWD_SHAPE)


def test_typed_fused_checked_on_deferred_schedule():
    f = dx.ExpensiveFn(fwd=fdtd, bwd=fdtd_adjoint, fused=bad_fused, name="fdtd")
    with pytest.raises(dx.AnnotationError) as info:
        dx.filter_value_and_grad(lambda x: jnp.sum(f(x)), schedule="deferred")(jnp.ones((4, 5)))
    assert str(info.value).startswith(
        "`ExpensiveFn(name='fdtd')` `fused`: the return value does not match its annotation."
    )
    assert "received: (float64[4, 5], float64[5, 4])" in str(info.value)
    assert "nx=4, ny=5" in str(info.value)


def test_typed_bwd_given_wrong_input_is_caught():
    f = dx.ExpensiveFn(fwd=fdtd, bwd=fdtd_adjoint, name="fdtd")
    with pytest.raises(dx.AnnotationError) as info:
        f(jnp.ones(3))
    expect(
        info,
        where="`ExpensiveFn(name='fdtd')` `fwd`",
        what="argument `x`",
        expected="Float[Array, 'nx ny']",
        found="float64[3]",
        bindings="none yet",
    )


# ----------------------------------------------------------------------------- the canonical pattern


class Simulator(dx.TypedModule):
    """A typed wrapper carrying an `ExpensiveFn`."""

    sim: dx.ExpensiveFn
    source: Float[Array, "nx ny"]

    def __call__(self, eps: Float[Array, "nx ny"]) -> Float[Array, "nx ny"]:
        return self.sim(eps * self.source)


class Design(eqx.Module):
    decoder: eqx.nn.MLP
    simulator: Simulator
    shape: tuple[int, int] = eqx.field(static=True)

    def __call__(self, z):
        eps = jnp.reshape(self.decoder(z), self.shape)
        return self.simulator(eps)


def test_canonical_pattern_composes_with_eqx_nn():
    key = jax.random.PRNGKey(0)
    f = dx.ExpensiveFn(fwd=fdtd, bwd=fdtd_adjoint, fused=fdtd_fused, name="fdtd")
    model = Design(eqx.nn.MLP(2, 12, 8, 1, key=key), Simulator(f, jnp.ones((3, 4))), (3, 4))
    target = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    loss = lambda m, z: jnp.sum(target * m(z))  # noqa: E731
    z = jnp.array([0.5, -0.5])
    assert dx.explain(loss, model, z).sites[0].schedule == "deferred"
    assert_tree_allclose(dx.filter_value_and_grad(loss)(model, z), eqx.filter_value_and_grad(loss)(model, z))
    wrong = Design(eqx.nn.MLP(2, 12, 8, 1, key=key), Simulator(f, jnp.ones((3, 4))), (4, 3))
    with pytest.raises(
        dx.AnnotationError, match=re.escape("`Simulator.__call__`: argument `eps` does not match its annotation.")
    ):
        dx.filter_value_and_grad(loss)(wrong, z)


def test_star_args_and_kwargs_annotations_apply_to_each_element():
    """As in Python, `*xs: Float[Array, " n"]` annotates each positional element (and
    `**kw` each value), all in one set of dimension bindings."""

    class Summer(dx.TypedModule):
        def total(self, *xs: Float[Array, " n"], **weights: Float[Array, ""]) -> Float[Array, " n"]:
            return sum(xs) * sum(weights.values())

    s = Summer()
    out = s.total(jnp.ones(3), jnp.ones(3), a=jnp.array(2.0))
    assert out.shape == (3,)
    with pytest.raises(dx.AnnotationError, match=re.escape("argument `*xs` [1] does not match its annotation")):
        s.total(jnp.ones(3), jnp.ones(4))
    with pytest.raises(
        dx.AnnotationError, match=re.escape("argument `a` (of `**weights`) does not match its annotation")
    ):
        s.total(jnp.ones(3), a=jnp.ones(2))


def test_string_annotation_naming_a_local_class():
    """A string annotation naming a class defined inside a function works as in a plain
    `eqx.Module` (that field is not checked); the other fields still are."""

    class Inner(eqx.Module):
        w: jax.Array

    class Outer(dx.TypedModule):
        inner: "Inner"
        scale: Float[Array, " n"]

    outer = Outer(Inner(jnp.ones(2)), jnp.ones(3))
    assert outer.inner.w.shape == (2,)
    with pytest.raises(dx.AnnotationError, match=re.escape("field `scale` does not match its annotation")):
        Outer(Inner(jnp.ones(2)), jnp.ones((3, 3)))


def test_a_large_pytree_received_is_named_not_printed():
    class Layer(dx.TypedModule):
        weight: Float[Array, "out in"]

    mlp = eqx.nn.MLP(4, 2, 8, 3, key=jax.random.key(0))
    with pytest.raises(dx.AnnotationError) as info:
        Layer(mlp)
    text = str(info.value)
    assert re.search(r"received: MLP \(a pytree of \d+ leaves\)", text), text
    assert len(text.splitlines()) <= 6
