"""Property-based tests: random downstream programs at random inputs, gradients checked
against the same program in plain JAX (and against Equinox running the same `ExpensiveFn`s)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import deferax as dx

from .helpers import Counter, assert_tree_allclose, make

N = 4
CONST = jnp.array([0.5, -1.5, 2.0, 0.25])

LINEAR_OPS = {
    "scale": lambda y, p: 1.7 * y,
    "weights": lambda y, p: CONST * y,
    "reverse": lambda y, p: y[::-1],
    "roll_slice": lambda y, p: jnp.concatenate([y[1:], y[:1]]),
    "fft_real": lambda y, p: jnp.real(jnp.fft.fft(y)),
    "fft_imag": lambda y, p: jnp.imag(jnp.fft.fft(y)),
    "cumsum": lambda y, p: jnp.cumsum(y),
    "mul_param": lambda y, p: jnp.tanh(p) * y,
    "add_param": lambda y, p: y + jnp.sin(p),
    "reshape_T": lambda y, p: jnp.reshape(jnp.reshape(y, (2, 2)).T, (N,)),
    "where_param": lambda y, p: jnp.where(p > 0, y, -2.0 * y),
    "matmul": lambda y, p: jnp.outer(CONST, CONST[::-1]) @ y,
}
NONLINEAR_OPS = {
    "square": lambda y, p: y**2,
    "sin": lambda y, p: jnp.sin(y),
    "exp": lambda y, p: jnp.exp(0.1 * y),
    "abs": lambda y, p: jnp.abs(y) + 0.1,
    "inverse": lambda y, p: 1.0 / (y**2 + 1.0),
    "where_y": lambda y, p: jnp.where(y > 0, y, 0.5 * y),
}
REFS = [jnp.sin, lambda x: jnp.exp(0.2 * x) * x, lambda x: jnp.cos(x) ** 2]


@st.composite
def programs(draw):
    n_sites = draw(st.integers(1, 3))
    sites = []
    for k in range(n_sites):
        nonlinear_allowed = draw(st.booleans())
        ops = draw(
            st.lists(
                st.sampled_from(sorted(LINEAR_OPS) + (sorted(NONLINEAR_OPS) if nonlinear_allowed else [])),
                min_size=0,
                max_size=4,
            )
        )
        sites.append(
            {
                "ref": draw(st.integers(0, len(REFS) - 1)),
                "ops": ops,
                "chain_from": draw(st.one_of(st.none(), st.integers(0, k - 1))) if k > 0 else None,
                "scale_in": draw(st.sampled_from([1.0, -0.5, 2.0])),
                "cond": draw(st.booleans()),
                # how the site is called: directly, under `vmap` over two inputs, in a
                # nested `jit`, or under `checkpoint`
                "wrap": draw(st.sampled_from([None, "vmap", "jit", "checkpoint"])),
            }
        )
    product = draw(st.booleans()) if n_sites > 1 else False
    pytree_input = draw(st.booleans())
    return {"sites": sites, "product": product, "pytree_input": pytree_input}


def arrays(n):
    """Float64 arrays of `n` elements with magnitudes in [0.05, 2]: bounded, and away from
    zero, where `where_param` and `abs`/`where_y` (of a site's output, zero at zero) have kinks."""
    magnitude = st.floats(0.05, 2.0, allow_nan=False, allow_infinity=False)
    element = st.builds(lambda m, negative: -m if negative else m, magnitude, st.booleans())
    return st.lists(element, min_size=n, max_size=n).map(lambda v: jnp.array(v, dtype=jnp.float64))


@st.composite
def inputs(draw, pytree_input):
    p = draw(arrays(N))
    if not pytree_input:
        return p
    return {"p": p, "q": draw(arrays(2))}


def _wrapped(fn, wrap):
    if wrap == "vmap":
        return lambda x: (lambda ys: ys[0] - 0.5 * ys[1])(jax.vmap(fn)(jnp.stack([x, 0.5 * x + 0.1])))
    if wrap == "jit":
        return jax.jit(fn)
    if wrap == "checkpoint":
        return jax.checkpoint(fn)
    return fn


def build(spec, counters, plain=False, layouts=None):
    """The program; with `plain=True` each `ExpensiveFn` is replaced by the function it
    stands for (the independent reference); with `layouts`, by a `jax.custom_vjp` of it
    whose residuals are laid out as `layouts[k]` says (`custom_vjp_of`)."""

    def site(k, s):
        if plain:
            return REFS[s["ref"]]
        if layouts is not None:
            return custom_vjp_of(REFS[s["ref"]], layouts[k], counters[k])
        return make(REFS[s["ref"]], ("fwd", "bwd", "fused"), counters[k], name=f"site{k}")

    fns = [_wrapped(site(k, s), s["wrap"]) for k, s in enumerate(spec["sites"])]

    def loss(params):
        p = params["p"] + params["q"][0] if spec["pytree_input"] else params
        outs = []
        for k, s in enumerate(spec["sites"]):
            x = p * s["scale_in"] if s["chain_from"] is None else outs[s["chain_from"]]
            y = fns[k](x)
            for op in s["ops"]:
                fn = LINEAR_OPS.get(op) or NONLINEAR_OPS[op]
                y = fn(y, p)
            if s["cond"]:
                y = jax.lax.cond(jnp.sum(p) > 0, lambda v: 2.0 * v, lambda v: v[::-1], y)
            outs.append(y)
        total = sum(jnp.sum(CONST * y) for y in outs)
        if spec["product"]:
            total = total + jnp.sum(outs[0] * outs[-1])
        return total + 0.1 * jnp.sum(p**2)

    return loss


def obviously_linear(spec) -> bool:
    return (
        not spec["product"]
        and all(not s["cond"] and s["chain_from"] is None for s in spec["sites"])
        and all(op in LINEAR_OPS for s in spec["sites"] for op in s["ops"])
        and not any(any(t["chain_from"] == k for t in spec["sites"]) for k in range(len(spec["sites"])))
    )


def well_conditioned(spec, params, expected) -> bool:
    """The reference is finite and moderate, and the program's input `p` is away from the
    kinks of `where_param` (p = 0) and of the `cond` (sum(p) = 0)."""
    p = params["p"] + params["q"][0] if spec["pytree_input"] else params
    leaves = [np.asarray(v) for v in jtu.tree_leaves(expected)]
    return (
        bool(np.all(np.abs(np.asarray(p)) > 1e-2))
        and abs(float(jnp.sum(p))) > 1e-2
        and all(np.all(np.isfinite(v)) and np.all(np.abs(v) < 1e6) for v in leaves)
    )


# Examples a run: each run draws new programs (where hypothesis is not derandomised), in
# two legs; 40 and 30 a run took 54 and 77-115 s of the suite's 1,460 s of worker time.
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data(), spec=programs())
def test_random_programs_match_equinox(data, spec):
    params = data.draw(inputs(spec["pytree_input"]), label="params")
    counters = [Counter() for _ in spec["sites"]]
    loss = build(spec, counters)
    # the independent reference: the same program in plain JAX, differentiated by JAX
    expected = jax.value_and_grad(build(spec, counters, plain=True))(params)
    assume(well_conditioned(spec, params, expected))
    plan = dx.explain(loss, params)
    if obviously_linear(spec):
        assert all(s.schedule == "deferred" for s in plan.sites), str(plan)
    for c in counters:
        c.reset()
    got = dx.filter_value_and_grad(loss)(params)
    jax.effects_barrier()
    for site, c in zip(plan.sites, counters, strict=True):
        # a site under vmap runs batched: one call for the batch
        if site.schedule == "deferred":
            assert c.as_dict() == {"fwd": 0, "bwd": 0, "fused": 1}, str(plan)
        else:
            assert c.as_dict() == {"fwd": 1, "bwd": 1, "fused": 0}, str(plan)
    for s, site in zip(spec["sites"], plan.sites, strict=True):
        assert site.batch == ((2,) if s["wrap"] == "vmap" else ())
    assert_tree_allclose(got, expected, rtol=1e-9, atol=1e-9)
    assert_tree_allclose(eqx.filter_value_and_grad(loss)(params), expected, rtol=1e-9, atol=1e-9)
    assert_tree_allclose(eqx.filter_jit(dx.filter_value_and_grad(loss))(params), expected, rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------- `jax.custom_vjp` programs
#
# The same random programs with each site a `jax.custom_vjp` of its (element-wise) reference,
# as users write one, its residuals laid out in one of these ways; each rule is the exact
# derivative, read from its residuals differently, so that the split of the backward (the
# part that reads only the inputs and the cotangent, and the part that reads what the forward
# computed) takes every shape.
LAYOUTS = ("input", "input and output", "derivative", "half and half", "symbolic zeros")


def custom_vjp_of(ref, layout: str, counter):
    """`ref` as a `jax.custom_vjp`, whose forward keeps the residuals `layout` says; the
    forward and the backward each tick `counter` ("fwd", "bwd") when they run."""

    def derivative(x):  # (element-wise: the Jacobian's diagonal)
        return jax.jvp(ref, (x,), (jnp.ones_like(x),))[1]

    @jax.custom_vjp
    def f(x):
        return ref(x)

    def f_fwd(x):
        if layout == "symbolic zeros":
            x = x.value
        counter.tick("fwd")
        y = ref(x)
        res = {
            "input": x,
            "input and output": (x, y),
            "derivative": derivative(x),
            "half and half": (x, derivative(x)),
            "symbolic zeros": x,
        }[layout]
        return y, res

    def f_bwd(res, ct):
        counter.tick("bwd")
        if layout == "input and output":
            x, y = res
            return (jax.vjp(ref, x)[1](ct)[0] + 0.0 * y,)  # (reads the output: a second part)
        if layout == "derivative":
            return (ct * res,)
        if layout == "half and half":
            x, d = res
            return (0.5 * jax.vjp(ref, x)[1](ct)[0] + 0.5 * ct * d,)
        if layout == "symbolic zeros" and type(ct) is jax.custom_derivatives.SymbolicZero:
            return (None,)
        return jax.vjp(ref, res)[1](ct)

    f.defvjp(f_fwd, f_bwd, symbolic_zeros=layout == "symbolic zeros")
    return f


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data(), spec=programs())
def test_random_custom_vjp_programs_match_plain_jax(data, spec):
    """Every `custom_vjp` call rewritten where it is sound (`recognise="always"`): the value and
    gradient of plain JAX running the same program (and of the references differentiated by
    JAX), eagerly and under `jit`, each rule's forward and backward run once a call (plain
    JAX runs them as often, or, under `checkpoint`, the forward twice)."""
    params = data.draw(inputs(spec["pytree_input"]), label="params")
    layouts = [data.draw(st.sampled_from(LAYOUTS), label=f"layout {k}") for k in range(len(spec["sites"]))]
    counters = [Counter() for _ in spec["sites"]]
    loss = build(spec, counters, layouts=layouts)
    expected = jax.value_and_grad(build(spec, counters, plain=True))(params)
    assume(well_conditioned(spec, params, expected))
    plain_jax = jax.value_and_grad(loss)
    step = dx.filter_value_and_grad(loss, recognise="always")
    plan = dx.explain(step, params)
    assert len(plan.sites) == len(spec["sites"]) and all(r.site is not None for r in plan.recognised), str(plan)
    if obviously_linear(spec):
        assert all(s.schedule == "deferred" for s in plan.sites), str(plan)
    for fn in (plain_jax, step, jax.jit(step)):
        jax.block_until_ready(fn(params))  # (compiled)
    jax.effects_barrier()
    runs = []
    for fn in (plain_jax, step, jax.jit(step)):
        for c in counters:
            c.reset()
        got = jax.block_until_ready(fn(params))
        jax.effects_barrier()
        runs.append([dict(c.counts) for c in counters])
        assert_tree_allclose(got, expected, rtol=1e-9, atol=1e-9)
        assert_tree_allclose(got, plain_jax(params), rtol=1e-12, atol=1e-12)
    once = [{"fwd": 1, "bwd": 1}] * len(counters)
    assert runs[1] == once and runs[2] == once, (runs, str(plan))
    assert runs[0] == [{"fwd": 2 if s["wrap"] == "checkpoint" else 1, "bwd": 1} for s in spec["sites"]], runs
