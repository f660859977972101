"""The deferred VJP: the static check, `explain`, and the deferred execution."""

import importlib
import inspect
import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx
import deferax._analysis._analysis

from .helpers import COMPLEX, FLOAT, FLOAT_NAME, Counter, assert_tree_allclose, finite_difference_grad, make


def ref(x):
    """The expensive function's reference implementation: nonlinear, (4,) -> (4,)."""
    return jnp.sin(x) * jnp.exp(0.3 * x)


W = jnp.array([1.0, -2.0, 0.5, 3.0])
P0 = jnp.array([0.3, -0.2, 0.8, 0.1])


def line_of(marker: str) -> int:
    """The line number of this file that carries `# <marker>`."""
    lines = inspect.getsource(inspect.getmodule(line_of)).splitlines()
    hits = [i + 1 for i, text in enumerate(lines) if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def check_against_equinox(loss, p, counter, *, deferred, has_aux=False, jit=False):
    """Values and gradients equal Equinox's and, independently of any derivative deferax
    computes, central differences of the loss's value (`fwd` is the plain reference
    function); count executions of each implementation."""
    transform = dx.filter_value_and_grad(loss, has_aux=has_aux)
    reference = eqx.filter_value_and_grad(
        loss,
        has_aux=has_aux,
    )
    if jit:
        transform, reference = eqx.filter_jit(transform), eqx.filter_jit(reference)
        transform(p)  # compile, then count one steady-state call
        jax.effects_barrier()
    counter.reset()
    got = transform(p)
    jax.block_until_ready(got)
    jax.effects_barrier()
    counts = counter.as_dict()
    expected = reference(p)
    assert_tree_allclose(got, expected)
    value_of = (lambda q: loss(q)[0]) if has_aux else loss
    grad = got[1]
    assert_tree_allclose(
        eqx.filter(grad, eqx.is_array),
        eqx.filter(finite_difference_grad(value_of, p), eqx.is_array),
        rtol=1e-6,
        atol=1e-7,
    )
    return counts


# ----------------------------------------------------------------------------- linear downstream code is deferred

LINEAR = {
    "weighted_sum": lambda y, p: jnp.sum(W * y) + jnp.sum(p**2),
    "dot_constant": lambda y, p: jnp.dot(W, y) * 2.0 + jnp.sin(p[0]),
    "slicing": lambda y, p: jnp.sum(y[1:3]) - y[0] + jnp.sum(p),
    "reshape_transpose": lambda y, p: jnp.sum(jnp.reshape(y, (2, 2)).T * jnp.array([[1.0, 2.0], [3.0, 4.0]])),
    "real_imag": lambda y, p: (
        jnp.sum(jnp.real(y.astype(COMPLEX) * (1 + 2j))) + jnp.sum(jnp.imag(y.astype(COMPLEX) * (0.5 + 1j)))
    ),
    "fft": lambda y, p: jnp.sum(jnp.real(jnp.fft.fft(y)) * W) + jnp.sum(jnp.imag(jnp.fft.fft(y))),
    "concatenate": lambda y, p: jnp.sum(jnp.concatenate([y, 2.0 * y, p]) * jnp.arange(12.0)),
    "params_times_output": lambda y, p: jnp.sum(p * y) + jnp.sum(p**2),
    "nonlinear_in_params_only": lambda y, p: jnp.sum(jnp.exp(p) * y) / jnp.sum(p**2 + 1),
}


@pytest.mark.parametrize("name", LINEAR)
def test_linear_downstream_is_deferred(name, counter):
    f = make(ref, ("fwd", "bwd", "fused"), counter, name="sim")
    post = LINEAR[name]
    loss = lambda p: post(f(p * 1.5), p)  # noqa: E731
    plan = dx.explain(loss, P0)
    assert [s.schedule for s in plan.sites] == ["deferred"]
    assert plan.sites[0].reason is None and plan.sites[0].name == "sim"
    counts = check_against_equinox(loss, P0, counter, deferred=True)
    # Equinox's own run is standard: count the deferred run alone
    assert counts == {"fwd": 0, "bwd": 0, "fused": 1}
    counts = check_against_equinox(loss, P0, counter, deferred=True, jit=True)
    assert counts == {"fwd": 0, "bwd": 0, "fused": 1}


# ------------------------------------------------------------------------- nonlinear code stays standard, with the line


def loss_square(p, f):
    y = f(p)
    return jnp.sum(W * y**2)  # square


def loss_abs(p, f):
    y = f(p)
    return jnp.sum(jnp.abs(y))  # abs


def loss_exp(p, f):
    y = f(p)
    return jnp.sum(jnp.exp(y) * W)  # exp


def loss_y_times_y(p, f):
    y = f(p)
    return jnp.sum(y * y)  # y*y


def loss_divide(p, f):
    y = f(p) + 3.0
    return jnp.sum(W / y)  # divide


def loss_log(p, f):
    y = f(p) + 3.0
    return jnp.sum(W * jnp.log(y))  # log


@pytest.mark.parametrize(
    "loss, marker, operation",
    [
        (loss_square, "square", "integer_pow"),
        (loss_abs, "abs", "abs"),
        (loss_exp, "exp", "exp"),
        (loss_y_times_y, "y*y", "mul"),
        (loss_divide, "divide", "div"),
        (loss_log, "log", "log"),
    ],
    ids=["square", "abs", "exp", "y*y", "divide", "log"],
)
def test_nonlinear_downstream_is_standard_with_line(loss, marker, operation, counter):
    """The reason names the user's line and the operation written there (`/` is `div`, not
    the `mul` of its derivative; `log` is not the `div` of its derivative)."""
    f = make(ref, ("fwd", "bwd", "fused"), counter, name="sim")
    plan = dx.explain(lambda p: loss(p, f), P0)
    (site,) = plan.sites
    assert site.schedule == "standard"
    assert site.reason.startswith("its cotangent depends on its own output")
    assert site.location.startswith(f"`{operation}` at {os.path.relpath(__file__)}:{line_of(marker)} "), site.location
    assert f", through `{operation}` at {os.path.relpath(__file__)}:{line_of(marker)} " in site.reason
    assert f"{os.path.relpath(__file__)}:{line_of(marker)}" in str(plan)
    counts = check_against_equinox(lambda p: loss(p, f), P0, counter, deferred=False)
    assert counts == {"fwd": 1, "bwd": 1, "fused": 0}


LIBRARY_LOSS = """
import jax.numpy as jnp


def transmission(y):
    return jnp.sum(y ** 2)  # a nonlinear figure of merit, written in a library
"""


def test_reason_names_the_users_line_before_a_librarys(tmp_path, monkeypatch):
    """A loss computed in an installed package (a figure of merit from a library): the
    reason names the first line of the user's own code, then the library's line."""
    package = tmp_path / "site-packages"
    package.mkdir()
    (package / "deferax_test_library.py").write_text(LIBRARY_LOSS)
    monkeypatch.syspath_prepend(str(package))
    library = importlib.import_module("deferax_test_library")
    f = make(ref, ("fwd", "bwd", "fused"), name="sim")

    def loss(p):
        return library.transmission(f(p))  # users-line

    (site,) = dx.explain(loss, P0).sites
    assert site.schedule == "standard"
    mine = f"{os.path.relpath(__file__)}:{line_of('users-line')}"
    assert site.location.startswith(f"`integer_pow` at {mine} `return library.transmission(f(p))"), site.location
    assert site.location.endswith(f"(in {package / 'deferax_test_library.py'}:6)"), site.location
    assert_tree_allclose(dx.filter_value_and_grad(loss)(P0), jax.value_and_grad(lambda p: jnp.sum(ref(p) ** 2))(P0))


def test_explain_text_fits_100_columns():
    """The table holds short cells and each reason is a numbered note under it, wrapped:
    no line over 100 characters, even for long names, structures and reasons."""
    long_name = "a_simulation_with_a_rather_long_descriptive_name"
    f = make(ref, ("fwd", "bwd", "fused"), name=long_name)
    g = dx.ExpensiveFn(fwd=lambda d: {"field_one": d["u"] * 2.0, "field_two": d["v"] + d["u"]}, name="tree")

    def loss(p):
        out = g({"u": p, "v": 2.0 * p})  # a pytree in and out: long shape cells
        nonlinear = jnp.sum(f(p) ** 2) * jnp.sum(f(2.0 * p) ** 3)  # two long reasons
        return nonlinear + jnp.sum(W * f(3.0 * p)) + jnp.sum(f(f(out["field_one"])))  # chained

    plan = dx.explain(loss, P0)
    text = str(plan)
    assert max(len(line) for line in text.splitlines()) <= 100, text
    reasons = list(dict.fromkeys(s.reason for s in plan.sites if s.reason))
    assert len(reasons) >= 3 and any(s.schedule == "deferred" for s in plan.sites)
    rows = text.splitlines()[3 : 3 + len(plan.sites)]
    for site, row in zip(plan.sites, rows, strict=True):
        assert row.startswith(f"{site.index}  ")
        marker = f"[{reasons.index(site.reason) + 1}]" if site.reason else None
        assert re.search(r"\[\d+\]$", row) is None if marker is None else row.endswith(marker), row
    notes = text.split("\n[")[1:]  # each note, its wrapped lines rejoined
    assert [" ".join(n.split("] ", 1)[1].split()).split(" expensive stages")[0] for n in notes] == [
        " ".join(r.split()) for r in reasons
    ]
    # An extreme reason: one unbreakable 250-character word, a 60-character structure.
    site = dx.Site(
        index=0,
        name="x" * 40,
        in_shapes="f" * 60,
        out_shapes="g" * 60,
        schedule="standard",
        reason="because " + "y" * 250,
    )
    extreme = str(dx.Plan(sites=(site,), stages=(("x: fwd",), ("x: bwd",)), requested="auto"))
    assert max(len(line) for line in extreme.splitlines()) <= 100, extreme
    assert "".join(extreme.split("[1] ", 1)[1].split()).startswith("because" + "y" * 250)


def test_schedule_deferred_raises_naming_site_and_line():
    f = make(ref, ("fwd", "bwd", "fused"), name="fdtd")
    with pytest.raises(ValueError) as info:
        dx.filter_value_and_grad(lambda p: loss_square(p, f), schedule="deferred")(P0)
    text = str(info.value)
    assert text.startswith(
        "`deferax.filter_value_and_grad`: schedule='deferred' was requested, but these call sites cannot be deferred:"
    )
    assert "site #0 `fdtd`: its cotangent depends on its own output, through" in text
    assert f"{os.path.relpath(__file__)}:{line_of('square')}" in text


def test_schedule_deferred_runs_when_possible(counter):
    f = make(ref, ("fwd", "bwd", "fused"), counter)
    loss = lambda p: jnp.sum(W * f(p))  # noqa: E731
    counter.reset()
    got = dx.filter_value_and_grad(loss, schedule="deferred")(P0)
    jax.effects_barrier()
    assert counter.as_dict() == {"fwd": 0, "bwd": 0, "fused": 1}
    assert_tree_allclose(got, eqx.filter_value_and_grad(loss)(P0))


def test_schedule_standard_is_equinox(counter):
    f = make(ref, ("fwd", "bwd", "fused"), counter)
    loss = lambda p: jnp.sum(W * f(p))  # noqa: E731
    counter.reset()
    got = dx.filter_value_and_grad(loss, schedule="standard")(P0)
    jax.effects_barrier()
    assert counter.as_dict() == {"fwd": 1, "bwd": 1, "fused": 0}
    assert_tree_allclose(got, eqx.filter_value_and_grad(loss)(P0))
    plan = dx.explain(dx.filter_value_and_grad(loss, schedule="standard"), P0)
    assert plan.sites[0].schedule == "standard" and "schedule='standard'" in plan.sites[0].reason


def test_site_without_fused(counter):
    """With `fwd` and a `bwd` that does not read `y` (the reference `bwd` recomputes what it
    needs from `x`), the deferred schedule runs them together; without `bwd` it cannot."""
    f = make(ref, ("fwd", "bwd"), counter, name="nofused")
    loss = lambda p: jnp.sum(W * f(p))  # noqa: E731
    plan = dx.explain(loss, P0)
    assert plan.sites[0].schedule == "deferred" and plan.stages == (("nofused: fwd + bwd",),)
    assert check_against_equinox(loss, P0, counter, deferred=True) == {"fwd": 1, "bwd": 1, "fused": 0}
    g = make(ref, ("fwd",), counter, name="fwd_only")
    plan = dx.explain(lambda p: jnp.sum(W * g(p)), P0)
    assert plan.sites[0].schedule == "standard" and plan.sites[0].reason == "no `fused` implementation"


# ----------------------------------------------------------------------------- several sites


def test_independent_sites_and_same_function_twice(counter):
    f = make(ref, ("fwd", "bwd", "fused"), counter, name="f")

    def loss(p):
        return jnp.sum(W * f(p)) + jnp.dot(f(2.0 * p), W[::-1]) + jnp.sum(p**3)

    plan = dx.explain(loss, P0)
    assert [s.schedule for s in plan.sites] == ["deferred", "deferred"]
    assert plan.stages == (("f: fused", "f: fused"),)
    assert check_against_equinox(loss, P0, counter, deferred=True) == {"fwd": 0, "bwd": 0, "fused": 2}


def test_chained_sites_stay_standard(counter):
    f = make(ref, ("fwd", "bwd", "fused"), counter, name="f")
    loss = lambda p: jnp.sum(W * f(f(p)))  # noqa: E731
    plan = dx.explain(loss, P0)
    assert [s.schedule for s in plan.sites] == ["standard", "standard"]
    assert plan.sites[0].reason == "its output feeds the input of site #1 `f`"
    assert plan.sites[1].reason == "its input depends on the output of site #0 `f`"
    assert check_against_equinox(loss, P0, counter, deferred=False) == {"fwd": 2, "bwd": 2, "fused": 0}
    # the second without a `fused` of its own (one could be made from `fwd` and `bwd`): the
    # same (it was deferred with its input computed from a stand-in, and crashed)
    g = make(ref, ("fwd", "bwd"), counter, name="g")
    loss = lambda p: jnp.sum(W * g(f(p)))  # noqa: E731
    plan = dx.explain(loss, P0)
    assert [s.schedule for s in plan.sites] == ["standard", "standard"]
    assert plan.sites[1].reason == "its input depends on the output of site #0 `f`"
    assert check_against_equinox(loss, P0, counter, deferred=False) == {"fwd": 2, "bwd": 2, "fused": 0}


def test_product_of_two_sites_stays_standard():
    f = make(ref, ("fwd", "bwd", "fused"), name="a")
    g = make(jnp.cos, ("fwd", "bwd", "fused"), name="b")
    plan = dx.explain(lambda p: jnp.sum(f(p) * g(p)), P0)
    assert plan.sites[0].reason.startswith("its cotangent depends on the output of site #1 `b`")
    assert plan.sites[1].reason.startswith("its cotangent depends on the output of site #0 `a`")


def test_mixed_standard_and_deferred(counter):
    lin = make(ref, ("fwd", "bwd", "fused"), counter, name="lin")
    sq_counter = type(counter)()
    sq = make(jnp.cos, ("fwd", "bwd", "fused"), sq_counter, name="sq")

    def loss(p):
        return jnp.sum(W * lin(p)) + jnp.sum(sq(p) ** 2)

    plan = dx.explain(loss, P0)
    assert [s.schedule for s in plan.sites] == ["deferred", "standard"]
    assert plan.stages == (("lin: fused", "sq: fwd"), ("sq: bwd",))  # sq needs no expensive output
    assert check_against_equinox(loss, P0, counter, deferred=True) == {"fwd": 0, "bwd": 0, "fused": 1}
    sq_counter.reset()
    dx.filter_value_and_grad(loss)(P0)
    jax.effects_barrier()
    assert sq_counter.as_dict() == {"fwd": 1, "bwd": 1, "fused": 0}


def test_deferred_input_from_standard_site_is_not_deferred():
    s = make(jnp.cos, ("fwd", "bwd", "fused"), name="upstream")
    d = make(ref, ("fwd", "bwd", "fused"), name="downstream")
    plan = dx.explain(lambda p: jnp.sum(W * d(s(p))), P0)
    assert [x.schedule for x in plan.sites] == ["standard", "standard"]


# ----------------------------------------------------------------------------- pytrees, complex, aux, methods


def ref_tree(x):
    return {"field": jnp.sin(x["a"]) * x["b"][0], "power": jnp.cos(x["a"]).astype(COMPLEX) * (1 + 1j)}


def test_pytree_inputs_and_outputs_and_complex(counter):
    f = make(ref_tree, ("fwd", "bwd", "fused"), counter, name="tree")
    mode = jnp.array([1 - 1j, 2j, 0.5, -1.0])

    def loss(params):
        y = f({"a": params["a"] * 2.0, "b": params["b"]})
        return jnp.sum(W * y["field"]) + jnp.real(jnp.vdot(mode, y["power"])) + jnp.sum(params["b"] ** 2)

    params = {"a": P0, "b": jnp.array([0.7, -0.4])}
    assert dx.explain(loss, params).sites[0].schedule == "deferred"
    assert check_against_equinox(loss, params, counter, deferred=True) == {"fwd": 0, "bwd": 0, "fused": 1}
    assert check_against_equinox(loss, params, counter, deferred=True, jit=True) == {"fwd": 0, "bwd": 0, "fused": 1}


def test_has_aux_sees_real_outputs(counter):
    f = make(ref, ("fwd", "bwd", "fused"), counter)

    def loss(p):
        y = f(p)
        return jnp.sum(W * y), {"y": y, "norm": jnp.sum(y**2)}

    assert dx.explain(dx.filter_value_and_grad(loss, has_aux=True), P0).sites[0].schedule == "deferred"
    assert check_against_equinox(loss, P0, counter, deferred=True, has_aux=True) == {"fwd": 0, "bwd": 0, "fused": 1}
    grads, aux = dx.filter_grad(loss, has_aux=True)(P0)
    assert_tree_allclose(aux["y"], ref(P0))
    assert_tree_allclose(grads, eqx.filter_grad(loss, has_aux=True)(P0)[0])
    # the pair as a list, which JAX and Equinox unpack too
    as_list = lambda p: list(loss(p))  # noqa: E731
    (value, aux), grads = dx.filter_value_and_grad(as_list, has_aux=True)(P0)
    (value_e, aux_e), grads_e = eqx.filter_value_and_grad(as_list, has_aux=True)(P0)
    (value_r, _), grads_r = jax.value_and_grad(lambda p: (jnp.sum(W * ref(p)), None), has_aux=True)(P0)
    assert_tree_allclose((value, aux, grads), (value_e, aux_e, grads_e))
    assert_tree_allclose((value, grads), (value_r, grads_r))


class Design(eqx.Module):
    """A model with a differentiable design, a non-differentiable int and a sim inside."""

    design: jax.Array
    steps: int
    sim: dx.ExpensiveFn
    label: str = eqx.field(static=True)

    def loss(self, w):
        return jnp.sum(w * self.sim(self.design)) + self.steps * jnp.sum(self.design**2)

    @dx.filter_value_and_grad
    def value_and_grad_method(self, w):
        return self.loss(w)


def test_models_filtering_methods_and_decorators(counter):
    model = Design(P0, 3, make(ref, ("fwd", "bwd", "fused"), counter), "m")

    def loss(m, w):
        return m.loss(w)

    got = dx.filter_value_and_grad(loss)(model, W)
    expected = eqx.filter_value_and_grad(loss)(model, W)
    assert_tree_allclose(got, expected)
    assert got[1].steps is None and got[1].label == "m"
    assert dx.explain(loss, model, W).sites[0].schedule == "deferred"
    # as a decorator on a method, and with arguments
    assert_tree_allclose(model.value_and_grad_method(W), expected)
    decorated = dx.filter_grad(schedule="auto")(loss)
    assert_tree_allclose(decorated(model, W), eqx.filter_grad(loss)(model, W))
    # keyword arguments after the first positional one
    assert_tree_allclose(dx.filter_value_and_grad(loss)(model, w=W), expected)


# ----------------------------------------------------------------------------- under transformations


def test_inside_jit_and_vmap_per_example(counter):
    f = make(ref, ("fwd", "bwd", "fused"), counter)

    def loss(p, target):
        return jnp.sum(target * f(p)) + jnp.sum(p**2)

    batch_p = jnp.stack([P0, 2 * P0, -P0])
    batch_t = jnp.stack([W, W[::-1], 2 * W])
    got = jax.vmap(dx.filter_value_and_grad(loss))(batch_p, batch_t)
    expected = jax.vmap(eqx.filter_value_and_grad(loss))(batch_p, batch_t)
    assert_tree_allclose(got, expected)
    got = jax.jit(jax.vmap(dx.filter_value_and_grad(loss)))(batch_p, batch_t)
    assert_tree_allclose(got, expected)
    got = jax.vmap(eqx.filter_jit(dx.filter_value_and_grad(loss)))(batch_p, batch_t)
    assert_tree_allclose(got, expected)
    counter.reset()
    jax.block_until_ready(jax.jit(dx.filter_value_and_grad(loss))(P0, W))
    jax.effects_barrier()
    assert counter.as_dict() == {"fwd": 0, "bwd": 0, "fused": 1}


NESTED = {
    "vmap": lambda f: lambda p: jnp.sum(jax.vmap(f)(jnp.stack([p, 2 * p])) * W),
    "scan": lambda f: lambda p: jnp.sum(jax.lax.scan(lambda c, _: (c + 0.1 * f(c), None), p, None, length=3)[0] * W),
    "cond": lambda f: lambda p: jnp.sum(jax.lax.cond(p[0] > 0, f, lambda v: 2.0 * v, p) * W),
    "checkpoint": lambda f: lambda p: jnp.sum(jax.checkpoint(f)(p) * W),
    "nested_jit": lambda f: lambda p: jnp.sum(jax.jit(f)(p) * W),
    "filter_jit": lambda f: lambda p: jnp.sum(eqx.filter_jit(lambda q: f(q))(p) * W),
}


@pytest.mark.parametrize("kind", NESTED)
def test_sites_under_nested_transformations(kind, counter):
    """Under vmap, a nested jit or checkpoint a site is deferred (one batched `fused`);
    under scan and cond it stays standard and explain names the construct."""
    f = make(ref, ("fwd", "bwd", "fused"), counter, name="inner")
    loss = NESTED[kind](f)
    plan = dx.explain(loss, P0)
    (site,) = plan.sites
    if kind in ("scan", "cond"):
        assert site.schedule == "standard"
        assert site.reason == f"called inside lax.{kind}; sites there stay standard"
    else:
        assert site.schedule == "deferred", str(plan)
        assert site.batch == ((2,) if kind == "vmap" else ())
    for point in (P0, -P0):
        for jit in (False, True):
            counts = check_against_equinox(loss, point, counter, deferred=True, jit=jit)
            if site.schedule == "deferred":
                assert counts == {"fwd": 0, "bwd": 0, "fused": 1}
            else:
                assert counts["fused"] == 0 and counts["fwd"] == counts["bwd"]


def test_nested_site_mixed_with_direct_site(counter):
    """A direct linear site stays deferred next to an unrelated site inside a scan."""
    lin = make(ref, ("fwd", "bwd", "fused"), counter, name="lin")
    inner = make(jnp.cos, ("fwd", "bwd", "fused"), name="inner")

    def loss(p):
        carry = jax.lax.scan(lambda c, _: (c + 0.1 * inner(c), None), p, None, length=2)[0]
        return jnp.sum(W * lin(p)) + jnp.sum(carry**2)

    plan = dx.explain(loss, P0)
    assert [s.schedule for s in plan.sites] == ["standard", "deferred"]
    assert check_against_equinox(loss, P0, counter, deferred=True) == {"fwd": 0, "bwd": 0, "fused": 1}

    def coupled(p):
        carry = jax.lax.scan(lambda c, _: (c + 0.1 * inner(c), None), p, None, length=2)[0]
        return jnp.sum(carry * lin(p))

    assert dx.explain(coupled, P0).sites[1].schedule == "standard"
    assert_tree_allclose(dx.filter_value_and_grad(coupled)(P0), eqx.filter_value_and_grad(coupled)(P0))

    def feeds_nested(p):
        y = lin(p)
        return jnp.sum(jax.lax.scan(lambda c, _: (c + 0.1 * inner(c), None), y, None, length=2)[0])

    assert [s.schedule for s in dx.explain(feeds_nested, P0).sites] == ["standard", "standard"]
    assert_tree_allclose(dx.filter_value_and_grad(feeds_nested)(P0), eqx.filter_value_and_grad(feeds_nested)(P0))


# ---------------------------------------------------------------------------- analysis happens once per input structure


def test_no_reanalysis_on_repeated_calls(monkeypatch, counter):
    calls = []
    original = deferax._analysis._analysis.analyse

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr("deferax._stages._run.analyse", counting)
    f = make(ref, ("fwd", "bwd", "fused"), counter)
    loss = lambda p: jnp.sum(W * f(p))  # noqa: E731
    step = dx.filter_value_and_grad(loss)
    for _ in range(3):
        step(P0)
    assert len(calls) == 1
    step(jnp.ones(4, dtype=FLOAT) * 0.5)
    assert len(calls) == 1
    jitted = eqx.filter_jit(step)
    for _ in range(3):
        jitted(P0)
    assert len(calls) == 2  # traced once under jit
    counter.reset()
    step(P0)
    jax.effects_barrier()
    assert counter.as_dict() == {"fwd": 0, "bwd": 0, "fused": 1}


# ----------------------------------------------------------------------------- errors


def test_error_bad_schedule():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`deferax.filter_value_and_grad`: `schedule` must be one of 'auto', 'standard' or 'deferred', but got \
'fast'."
        ),
    ):
        dx.filter_value_and_grad(lambda p: jnp.sum(p), schedule="fast")


def test_error_no_positional_argument():
    with pytest.raises(
        TypeError,
        match=re.escape(
            "`deferax.filter_value_and_grad`: the function must be called with at least one positional argument"
        ),
    ):
        dx.filter_value_and_grad(lambda p: jnp.sum(p))(p=P0)


def test_error_has_aux_without_a_pair():
    with pytest.raises(
        TypeError,
        match=re.escape(
            "`deferax.filter_value_and_grad`: with `has_aux=True` the differentiated function must return a pair \
`(value, aux)`, "
            f"but it returned {FLOAT_NAME}[]."
        ),
    ):
        dx.filter_value_and_grad(lambda p: jnp.sum(p), has_aux=True)(P0)
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"must return a pair `(value, aux)`, but it returned ({FLOAT_NAME}[], {FLOAT_NAME}[], {FLOAT_NAME}[])."
        ),
    ):
        dx.filter_value_and_grad(lambda p: (jnp.sum(p), p[0], p[1]), has_aux=True)(P0)


def test_error_non_scalar_loss():
    f = make(ref, ("fwd", "bwd", "fused"))
    with pytest.raises(
        TypeError,
        match=re.escape(
            "`deferax.filter_value_and_grad`: the differentiated function must return a real scalar, but it \
returned "
            f"{FLOAT_NAME}[4]."
        ),
    ):
        dx.filter_value_and_grad(lambda p: f(p))(P0)


def test_error_wrong_out_declared():
    """A wrong `out=` that makes the user's code fail while it is traced is reported as
    Equinox reports it (which runs `fwd` first), eager and under `jit`, not as the shape
    mismatch it caused; a trace error with a right `out=` stands as it is."""
    wrong = jax.ShapeDtypeStruct((5,), P0.dtype)
    expected = (
        "`ExpensiveFn(name='declared')`: `fwd` returned an output that does not match the output \
structure.\n"
        f"Expected {FLOAT_NAME}[5], found {FLOAT_NAME}[4]."
    )
    f = dx.ExpensiveFn(fwd=ref, fused=lambda x, ct: (ref(x), ct), out=wrong, name="declared")
    loss = lambda p: jnp.sum(W * f(p))  # noqa: E731
    for transform in (
        dx.filter_value_and_grad(loss),
        eqx.filter_jit(dx.filter_value_and_grad(loss)),
        eqx.filter_value_and_grad(loss),
    ):
        with pytest.raises(ValueError, match=re.escape(expected)):
            transform(P0)
    with pytest.raises(ValueError, match=re.escape(expected)) as info:
        dx.filter_value_and_grad(loss)(P0)
    assert isinstance(info.value.__cause__, TypeError)  # what failed in the loss, kept
    right = dx.ExpensiveFn(fwd=ref, out=jax.ShapeDtypeStruct((4,), P0.dtype), name="declared")
    with pytest.raises(TypeError, match="incompatible shapes"):
        dx.filter_value_and_grad(lambda p: jnp.sum(jnp.ones(3) * right(p)))(P0)
    # the Equinox pattern: the function inside the differentiated model, its arrays traced
    inside = dx.ExpensiveFn(fwd=_ScaledRef(jnp.ones(4)), fused=lambda x, ct: (ref(x), ct), out=wrong, name="declared")
    model_loss = lambda m: jnp.sum(W * m[1](m[0]))  # noqa: E731
    with pytest.raises(ValueError, match=re.escape(expected)):
        dx.filter_value_and_grad(model_loss)((P0, inside))


class _ScaledRef(eqx.Module):
    s: jax.Array

    def __call__(self, x):
        return self.s * ref(x)


WEIGHTS = jnp.array([1.0, 2.0, 3.0, 4.0])


def test_rebinding_a_captured_global_array_is_not_stale():
    global WEIGHTS
    f = make(ref, ("fwd", "bwd", "fused"))

    def loss(p):
        return jnp.sum(WEIGHTS * f(p))

    step = dx.filter_value_and_grad(loss)
    first = step(P0)
    assert_tree_allclose(first, eqx.filter_value_and_grad(loss)(P0))
    saved = WEIGHTS
    try:
        WEIGHTS = -2.0 * saved
        assert_tree_allclose(step(P0), eqx.filter_value_and_grad(loss)(P0))
    finally:
        WEIGHTS = saved


def test_rebinding_a_closed_over_array_is_not_stale():
    f = make(ref, ("fwd", "bwd", "fused"))
    weights = W

    def loss(p):
        return jnp.sum(weights * f(p))

    step = dx.filter_value_and_grad(loss)
    step(P0)
    weights = 3.0 * W  # noqa: F841 (read by loss through its closure)
    assert_tree_allclose(step(P0), eqx.filter_value_and_grad(loss)(P0))


SIM = make(ref, ("fwd", "bwd", "fused"), name="global-sim")


def _helper_reading_global_sim(p):
    return SIM(p)


def test_rebinding_a_global_expensive_fn_is_not_stale():
    global SIM

    def loss(p):
        return jnp.sum(W * _helper_reading_global_sim(p))  # reaches SIM through a helper

    step = dx.filter_value_and_grad(loss)
    step(P0)
    saved = SIM
    try:
        SIM = make(jnp.cos, ("fwd", "bwd", "fused"), name="global-sim")
        assert_tree_allclose(step(P0), eqx.filter_value_and_grad(loss)(P0))
    finally:
        SIM = saved


def test_stage_order_runs_independent_standard_forwards_with_fused(counter):
    d = make(ref, ("fwd", "bwd", "fused"), counter, name="d")
    c1, c2 = type(counter)(), type(counter)()
    s1 = make(jnp.cos, ("fwd", "bwd", "fused"), c1, name="s1")
    s2 = make(jnp.sin, ("fwd", "bwd"), c2, name="s2")

    def loss(p):
        return jnp.sum(W * d(p)) + jnp.sum(s2(s1(p) ** 2) ** 2)

    plan = dx.explain(loss, P0)
    assert [s.schedule for s in plan.sites] == ["deferred", "standard", "standard"]
    # s1 needs no expensive output: its fwd runs with d's fused; s2 needs s1's output.
    assert plan.stages == (("d: fused", "s1: fwd"), ("s2: fwd",), ("s2: bwd",), ("s1: bwd",))
    for jit in (False, True):
        assert check_against_equinox(loss, P0, counter, deferred=True, jit=jit) == {"fwd": 0, "bwd": 0, "fused": 1}
        for c in (c1, c2):
            c.reset()
        step = eqx.filter_jit(dx.filter_value_and_grad(loss)) if jit else dx.filter_value_and_grad(loss)
        jax.block_until_ready(step(P0))
        jax.effects_barrier()
        assert c1.as_dict() == {"fwd": 1, "bwd": 1, "fused": 0}
        assert c2.as_dict() == {"fwd": 1, "bwd": 1, "fused": 0}


READS = "x"  # which argument `_branching_bwd` computes from; rebound by the test


def _branching_bwd(x, y, ct):
    """The derivative of `exp`, from `x` or (reading `y`) from `y`, as a global says."""
    return ct * (jnp.exp(x) if READS == "x" else y)


def test_rebinding_a_global_that_bwd_branches_on_is_not_stale():
    """Whether `bwd` reads `y` is decided afresh: `explain` and the step agree, on the same
    function and on a new `ExpensiveFn` made from the same `bwd`."""
    global READS
    plain = lambda p: jnp.sum(W * jnp.exp(p)) + jnp.sum(p**2)  # noqa: E731
    runs = Counter()

    def fwd(p):
        runs.tick("fwd")
        return jnp.exp(p)

    def bwd(p, y, ct):
        runs.tick("bwd")
        return _branching_bwd(p, y, ct)

    def loss_of(f):
        return lambda p: jnp.sum(W * f(p)) + jnp.sum(p**2)

    f = dx.ExpensiveFn(fwd=fwd, bwd=bwd, name="exp")
    step = dx.filter_value_and_grad(loss_of(f))
    try:
        for reads, schedule in (("x", "deferred"), ("y", "standard"), ("x", "deferred")):
            READS = reads
            for g in (f, dx.ExpensiveFn(fwd=fwd, bwd=bwd, name="exp")):
                assert dx.explain(loss_of(g), P0).sites[0].schedule == schedule
                for run in (step, dx.filter_value_and_grad(loss_of(g))):
                    runs.reset()
                    got = run(P0)
                    jax.effects_barrier()
                    assert runs.as_dict() == {"fwd": 1, "bwd": 1, "fused": 0}
                    assert_tree_allclose(got, jax.value_and_grad(plain)(P0))
    finally:
        READS = "x"


# ----------------------------------------------------------------------------- typed PRNG keys


def noisy(p, key):
    """`ref(p)` scaled by noise drawn from a typed PRNG key."""
    return ref(p) * (1.0 + 0.1 * jax.random.normal(key, p.shape))


def keyed(counter):
    """A site whose input `(p, key)` and output `{"y", "key"}` hold a typed key (`key<fry>`)."""

    def fwd(x):
        counter.tick("fwd")
        p, key = x
        return {"y": noisy(p, key), "key": jax.random.split(key)[0]}

    def bwd(x, y, ct):
        counter.tick("bwd")
        p, key = x
        (ct_p,) = jax.vjp(lambda p: noisy(p, key), p)[1](ct["y"])
        return ct_p, np.zeros(key.shape, jax.dtypes.float0)  # a key's cotangent, as JAX's

    def fused(x, ct):
        counter.tick("fused")
        p, key = x
        return {"y": noisy(p, key), "key": jax.random.split(key)[0]}, (
            jax.vjp(lambda p: noisy(p, key), p)[1](ct["y"])[0],
            np.zeros(key.shape, jax.dtypes.float0),
        )

    return dx.ExpensiveFn(fwd=fwd, bwd=bwd, fused=fused, name="keyed")


def keyed_plain(x):
    p, key = x
    return {"y": noisy(p, key), "key": jax.random.split(key)[0]}


def keyed_loss(f, square):
    """Keys in the differentiated argument, in the site's input and output, in a
    non-differentiated argument and in aux."""

    def loss(params, data_key):
        out = f((params["p"], params["key"]))
        y = out["y"] ** 2 if square else out["y"]
        value = (
            jnp.sum(W * y)
            + jnp.sum(jax.random.uniform(out["key"], (4,)) * params["p"])
            + jnp.sum(jax.random.normal(data_key, (4,)))
        )
        return value, {"key": out["key"], "data_key": data_key, "draw": jax.random.normal(out["key"], ())}

    return loss


@pytest.mark.parametrize("square", [False, True], ids=["linear", "square"])
def test_typed_prng_keys_in_inputs_outputs_and_aux(counter, square):
    """New-style keys (`jax.random.key`, an extended dtype) anywhere in the program, as
    Equinox handles them: float0 cotangents, no gradient for the key; eagerly, under
    `eqx.filter_jit` and under `vmap` over a batch of keys."""
    f = keyed(counter)
    loss, reference = keyed_loss(f, square), keyed_loss(keyed_plain, square)
    params = {"p": P0, "key": jax.random.key(0)}
    data_key = jax.random.key(1)
    site = dx.explain(dx.filter_value_and_grad(loss, has_aux=True), params, data_key).sites[0]
    assert (site.schedule, site.in_shapes, site.out_shapes) == (
        "standard" if square else "deferred",
        f"({FLOAT_NAME}[4], key<fry>[])",
        f"(key<fry>[], {FLOAT_NAME}[4])",
    )
    expected_counts = {"fwd": 1, "bwd": 1, "fused": 0} if square else {"fwd": 0, "bwd": 0, "fused": 1}

    def same(got, expected):
        (value, aux), grads = got
        (value_, aux_), grads_ = expected
        assert_tree_allclose((value, aux["draw"], grads["p"]), (value_, aux_["draw"], grads_["p"]))
        assert grads["key"] is None and grads_["key"] is None
        for a, b in zip(
            jax.tree.leaves((aux["key"], aux["data_key"])),
            jax.tree.leaves((aux_["key"], aux_["data_key"])),
            strict=True,
        ):
            assert jax.random.key_data(a).tolist() == jax.random.key_data(b).tolist()

    for jit in (False, True):
        got_fn = dx.filter_value_and_grad(loss, has_aux=True)
        ref_fn = eqx.filter_value_and_grad(reference, has_aux=True)
        if jit:
            got_fn, ref_fn = eqx.filter_jit(got_fn), eqx.filter_jit(ref_fn)
            got_fn(params, data_key)
        jax.effects_barrier()
        counter.reset()
        got = got_fn(params, data_key)
        jax.effects_barrier()
        assert counter.as_dict() == expected_counts
        same(got, ref_fn(params, data_key))

    grads, aux = dx.filter_grad(loss, has_aux=True)(params, data_key)
    grads_, aux_ = eqx.filter_grad(reference, has_aux=True)(params, data_key)
    assert_tree_allclose((grads["p"], aux["draw"]), (grads_["p"], aux_["draw"]))

    keys = jax.random.split(jax.random.key(2), 3)
    batched = lambda fn: jax.vmap(lambda k: fn({"p": P0, "key": k}, data_key))  # noqa: E731
    counter.reset()
    got = batched(dx.filter_value_and_grad(loss, has_aux=True))(keys)
    jax.effects_barrier()
    assert counter.as_dict() == expected_counts  # (once per batch: the counter's callback takes no batched argument)
    same(got, batched(eqx.filter_value_and_grad(reference, has_aux=True))(keys))
