"""`ExpensiveFn` on the standard schedule: values, gradients, composition, counts, errors."""

import itertools
import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx

from .helpers import COMPLEX, FLOAT, FLOAT_NAME, assert_tree_allclose, finite_difference_grad, float32, make

COMBINATIONS = [
    ("fwd",),
    ("fwd", "bwd"),
    ("fused",),
    ("fwd", "fused"),
    ("bwd", "fused"),
    ("fwd", "bwd", "fused"),
]


def ref_pytree(x):
    """A nonlinear function of a pytree, to a pytree."""
    u, v = x["u"], x["v"]
    return {"s": jnp.sin(u) * v[0], "c": jnp.cos(u * v[1]) + v[2] ** 2}


def x_pytree(dtype=FLOAT):
    return {"u": jnp.linspace(0.1, 0.9, 4, dtype=dtype), "v": jnp.array([0.5, 1.5, -0.3], dtype=dtype)}


W_S = jnp.array([1.0, -2.0, 0.5, 3.0])
W_C = jnp.array([0.3, 0.1, -1.0, 2.0])


def loss_with(f):
    def loss(x):
        y = f(x)
        return jnp.sum(W_S * y["s"]) + jnp.sum(jnp.tanh(y["c"])) + jnp.sum(x["u"] ** 2)

    return loss


REF_LOSS = loss_with(ref_pytree)


@pytest.mark.parametrize("given", COMBINATIONS, ids="+".join)
def test_value_and_grad_match_jax_and_finite_differences(given):
    f = make(ref_pytree, given)
    x = x_pytree()
    value, grad = jax.value_and_grad(loss_with(f))(x)
    ref_value, ref_grad = jax.value_and_grad(REF_LOSS)(x)
    assert_tree_allclose(value, ref_value)
    assert_tree_allclose(grad, ref_grad)
    assert_tree_allclose(grad, finite_difference_grad(REF_LOSS, x), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("given", COMBINATIONS, ids="+".join)
def test_composes_with_jit_vmap_and_equinox(given):
    f = make(ref_pytree, given)
    x = x_pytree()
    ref = jax.value_and_grad(REF_LOSS)
    assert_tree_allclose(jax.jit(jax.value_and_grad(loss_with(f)))(x), ref(x))
    assert_tree_allclose(eqx.filter_jit(eqx.filter_value_and_grad(loss_with(f)))(x), ref(x))
    batch = jax.tree.map(lambda a: jnp.stack([a, 2 * a, -a]), x)
    assert_tree_allclose(jax.vmap(jax.value_and_grad(loss_with(f)))(batch), jax.vmap(ref)(batch))
    assert_tree_allclose(jax.jit(jax.vmap(jax.grad(loss_with(f))))(batch), jax.vmap(jax.grad(REF_LOSS))(batch))
    y, vjp = jax.vjp(f, x)
    y_ref, vjp_ref = jax.vjp(ref_pytree, x)
    ct = jax.tree.map(jnp.ones_like, y_ref)
    assert_tree_allclose(y, y_ref)
    assert_tree_allclose(vjp(ct), vjp_ref(ct))


@pytest.mark.parametrize("given", COMBINATIONS, ids="+".join)
def test_inside_scan_cond_and_checkpoint(given):
    f = make(jnp.sin, given)

    def scanned(g):
        def loss(x):
            def body(carry, w):
                return carry + w * g(carry), None

            out, _ = jax.lax.scan(body, x, jnp.array([0.5, -0.2, 0.1]))
            return jnp.sum(out**2)

        return loss

    def conditioned(g):
        def loss(x):
            y = jax.lax.cond(jnp.sum(x) > 0, lambda v: g(v) * 2.0, lambda v: g(v) - v, x)
            return jnp.sum(y * jnp.arange(3.0))

        return loss

    def checkpointed(g):
        return lambda x: jnp.sum(jax.checkpoint(lambda v: g(v) ** 2)(x))

    x = jnp.array([0.3, -0.1, 0.7])
    for build in (scanned, conditioned, checkpointed):
        for point in (x, -x):
            assert_tree_allclose(jax.value_and_grad(build(f))(point), jax.value_and_grad(build(jnp.sin))(point))


@pytest.mark.parametrize(
    "dtype",
    [
        jnp.float32,
        pytest.param(
            jnp.float64,
            marks=pytest.mark.skipif(float32(), reason="float64 arrays cannot be made with x64 off (float32 suite)"),
        ),
    ],
)
def test_float32_and_float64(dtype):
    f = make(ref_pytree, ("fwd", "bwd"))
    x = x_pytree(dtype)
    loss = lambda x: jnp.sum(f(x)["s"]) + jnp.sum(f(x)["c"])  # noqa: E731
    ref = lambda x: jnp.sum(ref_pytree(x)["s"]) + jnp.sum(ref_pytree(x)["c"])  # noqa: E731
    value, grad = jax.value_and_grad(loss)(x)
    assert value.dtype == dtype
    assert all(g.dtype == dtype for g in jax.tree.leaves(grad))
    tol = 1e-5 if dtype == jnp.float32 else 1e-12
    assert_tree_allclose((value, grad), jax.value_and_grad(ref)(x), rtol=tol, atol=tol)


def ref_complex(x):
    """Real input, complex output: a field exp(i k x) scaled by x."""
    z = x.astype(COMPLEX)
    return z * jnp.exp(1j * jnp.array([1.0, 2.0, 3.0], dtype=COMPLEX) * z)


@pytest.mark.parametrize("given", COMBINATIONS, ids="+".join)
def test_complex_outputs_follow_jax_convention(given):
    f = make(ref_complex, given)
    mode = jnp.array([1.0 + 2.0j, -0.5j, 0.3])

    def loss_of(g):
        return lambda x: jnp.abs(jnp.vdot(mode, g(x))) ** 2 + jnp.sum(jnp.real(g(x)))

    x = jnp.array([0.2, 0.4, -0.6])
    assert_tree_allclose(jax.value_and_grad(loss_of(f))(x), jax.value_and_grad(loss_of(ref_complex))(x))
    assert_tree_allclose(jax.grad(loss_of(f))(x), finite_difference_grad(loss_of(ref_complex), x), rtol=1e-6, atol=1e-7)


def test_hand_written_complex_bwd_convention():
    """A hand-written `bwd` for y = c * x (c complex, x real): ct_x = real(c * ct_y)."""
    c = jnp.array([1.0 + 1.0j, 2.0 - 0.5j])
    f = dx.ExpensiveFn(fwd=lambda x: c * x.astype(c.dtype), bwd=lambda x, y, ct: jnp.real(c * ct))
    loss = lambda x: jnp.abs(jnp.sum(f(x))) ** 2  # noqa: E731
    ref = lambda x: jnp.abs(jnp.sum(c * x.astype(c.dtype))) ** 2  # noqa: E731
    x = jnp.array([0.3, -0.7])
    assert_tree_allclose(jax.grad(loss)(x), jax.grad(ref)(x))
    assert_tree_allclose(jax.grad(loss)(x), finite_difference_grad(ref, x), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("given", COMBINATIONS, ids="+".join)
def test_execution_counts_standard_schedule(given, counter):
    f = make(ref_pytree, given, counter)
    x = x_pytree()
    step = jax.jit(jax.value_and_grad(loss_with(f)))
    step(x)  # compile
    counter.reset()
    got = jax.block_until_ready(step(x))
    jax.effects_barrier()
    assert_tree_allclose(got, jax.value_and_grad(REF_LOSS)(x))
    expected = {
        ("fwd",): {"fwd": 1, "bwd": 0, "fused": 0},
        ("fwd", "bwd"): {"fwd": 1, "bwd": 1, "fused": 0},
        # primal from fused with a zero cotangent, reverse mode from fused again
        ("fused",): {"fwd": 0, "bwd": 0, "fused": 2},
        ("fwd", "fused"): {"fwd": 1, "bwd": 0, "fused": 1},
        ("bwd", "fused"): {"fwd": 0, "bwd": 1, "fused": 1},
        ("fwd", "bwd", "fused"): {"fwd": 1, "bwd": 1, "fused": 0},
    }[given]
    assert counter.as_dict() == expected


def test_eager_counts_and_no_recompute(counter):
    f = make(ref_pytree, ("fwd", "bwd", "fused"), counter)
    got = jax.value_and_grad(loss_with(f))(x_pytree())
    jax.effects_barrier()
    assert counter.as_dict() == {"fwd": 1, "bwd": 1, "fused": 0}
    assert_tree_allclose(got, jax.value_and_grad(REF_LOSS)(x_pytree()))


class Source(eqx.Module):
    """An implementation carrying non-differentiable configuration (a source array)."""

    source: jax.Array
    scale: float = eqx.field(static=True)

    def __call__(self, x):
        return self.scale * jnp.sin(x) * self.source


class SourceAdjoint(eqx.Module):
    source: jax.Array
    scale: float = eqx.field(static=True)

    def __call__(self, x, y, ct):
        return self.scale * ct * self.source * jnp.cos(x)


class Model(eqx.Module):
    weight: jax.Array
    sim: dx.ExpensiveFn

    def __call__(self, x):
        return jnp.sum(jnp.arange(3.0) * self.sim(self.weight * x))


def test_configuration_arrays_get_no_gradient():
    source = jnp.array([1.0, 2.0, 3.0])
    sim = dx.ExpensiveFn(fwd=Source(source, 2.0), bwd=SourceAdjoint(source, 2.0), name="src")
    model = Model(jnp.array([0.5, -1.0, 2.0]), sim)
    x = jnp.array([0.1, 0.2, 0.3])
    value, grads = eqx.filter_value_and_grad(lambda m: m(x))(model)

    def ref(w):
        return jnp.sum(jnp.arange(3.0) * 2.0 * jnp.sin(w * x) * source)

    ref_value, ref_grad = jax.value_and_grad(ref)(model.weight)
    assert_tree_allclose(value, ref_value)
    assert_tree_allclose(grads.weight, ref_grad)
    assert np.all(np.asarray(grads.sim.fwd.source) == 0.0)
    assert np.all(np.asarray(grads.sim.bwd.source) == 0.0)
    # and under filter_jit
    value2, grads2 = eqx.filter_jit(eqx.filter_value_and_grad(lambda m: m(x)))(model)
    assert_tree_allclose((value2, grads2.weight), (ref_value, ref_grad))


def test_name_defaults_and_explicit():
    assert dx.ExpensiveFn(fwd=jnp.sin).name == "sin"
    assert dx.ExpensiveFn(fwd=jnp.sin, name="fdtd").name == "fdtd"
    assert dx.ExpensiveFn(fwd=Source(jnp.ones(2), 1.0)).name == "Source"


def test_out_declared_for_fused_only():
    out = jax.ShapeDtypeStruct((3,), FLOAT)
    f = dx.ExpensiveFn(fused=lambda x, ct: (jnp.sin(x), ct * jnp.cos(x)), out=out)
    x = jnp.array([0.1, 0.2, 0.3])
    assert_tree_allclose(jax.grad(lambda x: jnp.sum(f(x)))(x), jnp.cos(x))


# ----------------------------------------------------------------------------- errors


def match(text):
    return re.escape(text)


def test_error_no_primal():
    with pytest.raises(
        TypeError, match=match("`ExpensiveFn(name='adj')`: nothing can compute the output. Give `fwd(x) -> y`")
    ):
        dx.ExpensiveFn(bwd=lambda x, y, ct: ct, name="adj")


def test_error_not_callable():
    with pytest.raises(TypeError, match=match("`ExpensiveFn(name='f')`: `bwd` must be a callable or None, but got 3.")):
        dx.ExpensiveFn(fwd=jnp.sin, bwd=3, name="f")


def test_error_bad_out():
    with pytest.raises(
        TypeError, match=match("`ExpensiveFn(name='f')`: `out` must be a pytree of `jax.ShapeDtypeStruct`")
    ):
        dx.ExpensiveFn(fwd=jnp.sin, out=(3,), name="f")


def test_error_no_out_for_fused_only():
    def solve_both(x, ct):
        return x, ct

    f = dx.ExpensiveFn(fused=solve_both, bwd=lambda x, y, ct: ct, name="solver")
    with pytest.raises(
        TypeError,
        match=match(
            "`ExpensiveFn(name='solver')`: the output shape is unknown. With nothing to infer it from (no `fwd` or \
`jvp` was given, "
            "and `fused` takes a cotangent shaped like the output), declare it with `out=`, a pytree of\n"
            "`jax.ShapeDtypeStruct` (or a function from the input's structure to one):\n\n"
            "    dx.ExpensiveFn(bwd=..., fused=solve_both, out=jax.ShapeDtypeStruct((nx, ny), jnp.float64))"
        ),
    ):
        f(jnp.ones(3))


def test_error_no_out_for_untraceable_jvp():
    """A `jvp`-only function infers its output from `jvp`; one that JAX cannot trace needs `out=`."""

    def host_jvp(x, t):
        return jnp.asarray(np.sin(np.asarray(x))), t

    f = dx.ExpensiveFn(jvp=host_jvp, name="host")
    with pytest.raises(
        TypeError,
        match=match(
            "`ExpensiveFn(name='host')`: the output shape is unknown. With nothing to infer it from (`jvp` is not \
JAX-traceable: "
            "TracerArrayConversionError), declare it with `out=`, a pytree of\n`jax.ShapeDtypeStruct` (or a \
function from the "
            "input's structure to one):\n\n    dx.ExpensiveFn(jvp=host_jvp, out=jax.ShapeDtypeStruct((nx, ny), \
jnp.float64))"
        ),
    ):
        jax.jit(f)(jnp.ones(3))
    assert_tree_allclose(dx.ExpensiveFn(jvp=host_jvp, out=lambda s: s)(jnp.ones(3)), jnp.sin(jnp.ones(3)))


def test_error_no_out_for_untraceable_fwd():
    f = dx.ExpensiveFn(fwd=lambda x: np.sin(np.asarray(x)), bwd=lambda x, y, ct: ct, name="host")
    text = "(`fwd` is not JAX-traceable: TracerArrayConversionError), declare it with `out=`"
    example = "\n\n    dx.ExpensiveFn(fwd=..., bwd=..., out=jax.ShapeDtypeStruct((nx, ny), jnp.float64))"
    with pytest.raises(
        TypeError,
        match=match(
            text + ", a pytree of\n`jax.ShapeDtypeStruct` (or a function from the input's structure to one):" + example
        ),
    ):
        jax.jit(f)(jnp.ones(3))
    jitted = jax.jit(jax.grad(lambda x: jnp.sum(f(x))))
    for _ in range(2):  # raised while tracing: a second call traces again and raises the same
        with pytest.raises(TypeError, match=match(text)):
            jitted(jnp.ones(3))
    step = dx.filter_value_and_grad(lambda x: jnp.sum(f(x)))
    for _ in range(2):
        with pytest.raises(TypeError, match=match(text)):  # the deferred schedule's analysis traces it
            step(jnp.ones(3))
    jitted_step = eqx.filter_jit(step)
    for _ in range(2):
        with pytest.raises(TypeError, match=match(text)):
            jitted_step(jnp.ones(3))
    with pytest.raises(TypeError, match=match(text)):  # an eager grad needs the structure too
        jax.grad(lambda x: jnp.sum(f(x)))(jnp.ones(3))
    # on concrete arrays outside any transformation the host function simply runs
    assert_tree_allclose(f(jnp.ones(3)), jnp.sin(jnp.ones(3)))


def test_error_bwd_wrong_shape():
    f = dx.ExpensiveFn(fwd=jnp.sin, bwd=lambda x, y, ct: ct[:2], name="fdtd")
    expected = (
        "`ExpensiveFn(name='fdtd')`: `bwd` returned a cotangent that does not match the input `x`.\n"
        f"Expected {FLOAT_NAME}[3], found {FLOAT_NAME}[2].\n"
        "`bwd(x, y, ct_y)` must return a cotangent with the structure, shapes and dtypes of `x`."
    )
    with pytest.raises(ValueError, match=match(expected)):
        jax.grad(lambda x: jnp.sum(f(x)))(jnp.ones(3))


def test_error_bwd_wrong_dtype_and_structure():
    narrower = jnp.dtype(jnp.float16 if float32() else jnp.float32)  # than the default float
    f = dx.ExpensiveFn(fwd=lambda x: jnp.sin(x["a"]), bwd=lambda x, y, ct: {"a": ct.astype(narrower)}, name="f")
    with pytest.raises(ValueError, match=match(f"Expected {FLOAT_NAME}[3] at ['a'], found {narrower.name}[3].")):
        jax.grad(lambda x: jnp.sum(f(x)))({"a": jnp.ones(3)})
    g = dx.ExpensiveFn(fwd=lambda x: jnp.sin(x["a"]), bwd=lambda x, y, ct: ct, name="g")
    with pytest.raises(
        ValueError,
        match=r"`bwd` returned a cotangent that does not match the input `x`.\nExpected structure "
        r"PyTreeDef\(\{'a': \*\}\), found PyTreeDef\(\*\)",
    ):
        jax.grad(lambda x: jnp.sum(g(x)))({"a": jnp.ones(3)})


def test_error_fwd_does_not_match_declared_out():
    f = dx.ExpensiveFn(fwd=jnp.sin, bwd=lambda x, y, ct: ct, out=jax.ShapeDtypeStruct((4,), FLOAT), name="f")
    with pytest.raises(
        ValueError,
        match=match(
            "`ExpensiveFn(name='f')`: `fwd` returned an output that does not match the output structure.\n"
            f"Expected {FLOAT_NAME}[4], found {FLOAT_NAME}[3]."
        ),
    ):
        f(jnp.ones(3))


def test_error_fused_wrong_output():
    out = jax.ShapeDtypeStruct((3,), FLOAT)
    f = dx.ExpensiveFn(fused=lambda x, ct: (x[:2], ct), out=out, name="f")
    with pytest.raises(
        ValueError,
        match=match(
            "`fused` returned an output `y` that does not match the output structure.\n"
            f"Expected {FLOAT_NAME}[3], found {FLOAT_NAME}[2].\n`fused(x, ct_y)` must return a pair"
        ),
    ):
        f(jnp.ones(3))
    g = dx.ExpensiveFn(fwd=jnp.sin, fused=lambda x, ct: (jnp.sin(x), ct[:1]), name="g")
    with pytest.raises(
        ValueError,
        match=match(
            "`ExpensiveFn(name='g')`: `fused` returned a cotangent that does not match the input `x`.\n"
            f"Expected {FLOAT_NAME}[3], found {FLOAT_NAME}[1]."
        ),
    ):
        jax.grad(lambda x: jnp.sum(g(x)))(jnp.ones(3))


def test_error_fused_not_a_pair():
    f = dx.ExpensiveFn(fwd=jnp.sin, fused=lambda x, ct: jnp.sin(x), name="f")
    with pytest.raises(ValueError, match=match("`ExpensiveFn(name='f')`: `fused` returned a ArrayImpl, not a pair.")):
        jax.grad(lambda x: jnp.sum(f(x)))(jnp.ones(3))
    g = dx.ExpensiveFn(fwd=jnp.sin, fused=lambda x, ct: (x, ct, x), name="g")
    with pytest.raises(ValueError, match=match("`fused` returned a tuple of length 3, not a pair.")):
        jax.grad(lambda x: jnp.sum(g(x)))(jnp.ones(3))


@pytest.mark.parametrize("given", [("fwd", "bwd"), ("fwd", "fused"), ("fused",)], ids="+".join)
def test_error_forward_mode(given):
    f = make(jnp.sin, given, name="sim")
    how = "given by `bwd`" if "bwd" in given else "derived from `fused`"
    text = "`ExpensiveFn(name='sim')`: forward-mode differentiation (`jax.jvp`, `jax.jacfwd`"
    with pytest.raises(TypeError, match=match(text)) as info:
        jax.jvp(f, (jnp.ones(3),), (jnp.ones(3),))
    assert f"this function's derivative is {how}, which serves reverse mode only" in str(info.value)
    with pytest.raises(TypeError, match=match(text)):
        jax.jacfwd(lambda x: jnp.sum(f(x)))(jnp.ones(3))


def test_forward_mode_works_with_fwd_only():
    f = dx.ExpensiveFn(fwd=jnp.sin)
    x = jnp.array([0.1, 0.2])
    y, t = jax.jvp(f, (x,), (jnp.ones(2),))
    assert_tree_allclose((y, t), (jnp.sin(x), jnp.cos(x)))
    assert_tree_allclose(jax.jacfwd(f)(x), jnp.diag(jnp.cos(x)))


def test_reverse_mode_still_works_after_forward_mode_refusal():
    f = make(jnp.sin, ("fwd", "bwd"))
    with pytest.raises(TypeError):
        jax.jvp(f, (jnp.ones(2),), (jnp.ones(2),))
    assert_tree_allclose(jax.grad(lambda x: jnp.sum(f(x)))(jnp.zeros(2)), jnp.ones(2))


def test_all_combinations_listed():
    # every non-empty subset that contains a way to get the primal
    subsets = [c for n in (1, 2, 3) for c in itertools.combinations(("fwd", "bwd", "fused"), n)]
    valid = [c for c in subsets if "fwd" in c or "fused" in c]
    assert sorted(valid) == sorted(COMBINATIONS)


@pytest.mark.parametrize(
    "impl, fn, expected, found",
    [
        ("bwd", lambda x, ct: ct, "bwd(x, y, ct_y)", "bwd(x, ct)"),
        ("fused", lambda x: (x, x), "fused(x, ct_y)", "fused(x)"),
        ("fwd", lambda x, y: x, "fwd(x)", "fwd(x, y)"),
        ("jvp", lambda x: (x, x), "jvp(x, t_x)", "jvp(x)"),
        ("adjoint", lambda x, y, ct: ct, "adjoint(x, ct_y)", "adjoint(x, y, ct)"),
    ],
)
def test_error_implementation_with_the_wrong_signature(impl, fn, expected, found):
    given = {"fwd": jnp.sin, impl: fn}
    with pytest.raises(
        TypeError,
        match=match(
            f"`ExpensiveFn(name='sim')`: `{impl}` cannot be called as `{expected}`: its signature is `{found}`"
        ),
    ):
        dx.ExpensiveFn(**given, name="sim")
    # dx.host checks its host functions the same way
    if impl in ("bwd", "fused", "jvp", "adjoint"):
        with pytest.raises(TypeError, match=match(f"`{impl}` cannot be called as `{expected}`")):
            dx.host(np.sin, **{impl: fn}, out=jax.ShapeDtypeStruct((3,), FLOAT), name="sim")


def test_error_nothing_given_names_the_class():
    with pytest.raises(TypeError, match=match("`ExpensiveFn(name='ExpensiveFn')`: nothing can compute the output.")):
        dx.ExpensiveFn()


def test_error_64_bit_output_declared_with_x64_off():
    """With JAX's 64-bit mode off, a float64 `out=` (or a host's `adjoint_out=`) cannot be
    met: the message names the call and says why, eagerly and under `jit`, where JAX's own
    error named nothing of the user's (in a subprocess: the test suite runs with x64 on)."""
    import subprocess
    import sys

    code = """
import warnings
import jax, jax.numpy as jnp, numpy as np
import deferax as dx
warnings.simplefilter("error", UserWarning)  # (after the imports: a TPU's runtime warns at JAX's import)
wide = jax.ShapeDtypeStruct((3,), jnp.float64)
f = dx.ExpensiveFn(fwd=jnp.sin, bwd=lambda x, y, ct: ct, out=wide, name="f64")
h = dx.host(np.sin, adjoint=lambda x, ct: ct, out=jax.ShapeDtypeStruct((3,), jnp.float32), adjoint_out=wide, name="h64")
for label, run in (
    ("grad", lambda: jax.grad(lambda x: jnp.sum(f(x)))(jnp.ones(3))),
    ("jit", lambda: jax.jit(dx.filter_value_and_grad(lambda x: jnp.sum(f(x))))(jnp.ones(3))),
    ("host jit", lambda: jax.jit(dx.filter_value_and_grad(lambda x: jnp.sum(h(x))))(jnp.ones(3))),
):
    try:
        run()
    except ValueError as e:
        print(label, "|", str(e).replace(chr(10), " "))
"""
    # (on the CPU: an accelerator is held by this process)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    hint = 'a 64-bit dtype. JAX\'s 64-bit mode is off (`jax_enable_x64`), so JAX computes in 32 bits: declare 32-bit \
dtypes in `out=`, or turn it on first with `jax.config.update("jax_enable_x64", True)`.'
    lines = out.stdout.splitlines()
    assert lines == [
        f"grad | `ExpensiveFn(name='f64')`: `out=` declares float64[3], {hint}",
        f"jit | `ExpensiveFn(name='f64')`: `out=` declares float64[3], {hint}",
        f"host jit | `ExpensiveFn(name='h64')`: `adjoint_out=` declares float64[3], {hint}",
    ], out.stdout
