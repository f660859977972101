"""Forward and reverse mode on one `ExpensiveFn`: `jvp`/`jvp_batch`, the forward-basis
strategy, the per-site choice, `dx.jacobian`; each against plain JAX on the same program."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx

from .helpers import Counter, assert_tree_allclose, reference_impls


def ref(x):
    """What the expensive function stands for: nonlinear, a pytree in, a pytree out
    (one output complex)."""
    field = jax.lax.complex(x["u"] * jnp.cos(x["v"]), x["u"] * jnp.sin(x["v"]))
    return {"field": field, "power": jnp.sum(x["u"] ** 2 * jnp.cos(x["v"]))}


X = {"u": jnp.array([0.3, -0.2, 0.8]), "v": jnp.array([0.1, 0.5, -0.4])}
T = {"u": jnp.array([1.0, 2.0, -1.0]), "v": jnp.array([0.5, -0.3, 2.0])}
N = 6  # input numbers


OUT = jax.eval_shape(ref, X)


def make(given, counter, **kwargs):
    chosen = {k: v for k, v in reference_impls(ref, counter).items() if k in given}
    if not {"fwd", "jvp", "jvp_batch"} & set(given):  # (`jvp` alone tells the output's structure)
        kwargs["out"] = OUT
    return dx.ExpensiveFn(**chosen, name="sim", **kwargs)


def counts(counter):
    jax.effects_barrier()
    return {k: v for k, v in counter.counts.items() if v}


FORWARD_CAPABLE = [
    ("fwd", "jvp"),
    ("jvp",),
    ("jvp_batch",),
    ("fwd", "bwd", "jvp"),
    ("fwd", "bwd", "jvp_batch"),
    ("fused", "jvp_batch"),
    ("fwd", "jvp", "jvp_batch"),
]


def loss_of(f):
    def loss(x):
        y = f(x)  # one call: one site
        return jnp.sum(jnp.abs(y["field"]) ** 2 * jnp.array([1.0, -2.0, 0.5])) + jnp.sin(y["power"])

    return loss


# ----------------------------------------------------------------------------- forward mode everywhere


@pytest.mark.parametrize("given", FORWARD_CAPABLE, ids="+".join)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_forward_mode_matches_jax(given, jit):
    counter = Counter()
    f = make(given, counter)
    wrap = jax.jit if jit else (lambda g: g)
    for run in (
        lambda: wrap(lambda x, t: jax.jvp(f, (x,), (t,)))(X, T),
        lambda: wrap(lambda x, t: jax.jvp(f, (x,), (t,)))(X, T),
    ):
        run()  # compile
    counter.reset()
    got = wrap(lambda x, t: jax.jvp(f, (x,), (t,)))(X, T)
    assert_tree_allclose(got, jax.jvp(ref, (X,), (T,)))
    c = counts(counter)
    # one expensive call for the tangent (plus `fwd` for the primal on the standard strategy)
    assert sum(c.values()) <= 2 and (c.get("jvp", 0) + c.get("jvp_batch", 0)) == 1, c
    counter.reset()
    got = wrap(jax.jacfwd(f))(X)
    assert_tree_allclose(got, jax.jacfwd(ref)(X))
    c = counts(counter)
    assert (c.get("jvp", 0) + c.get("jvp_batch", 0)) == 1 and c.get("fwd", 0) <= 1, c  # one batched tangent call
    primal, f_jvp = jax.linearize(f, X)
    assert_tree_allclose((primal, f_jvp(T)), jax.jvp(ref, (X,), (T,)))


@pytest.mark.parametrize("given", FORWARD_CAPABLE, ids="+".join)
def test_forward_mode_under_vmap(given):
    counter = Counter()
    f = make(given, counter)
    xs = jax.tree_util.tree_map(lambda a: jnp.stack([a, 2 * a]), X)
    ts = jax.tree_util.tree_map(lambda a: jnp.stack([a, -a]), T)
    got = jax.vmap(lambda x, t: jax.jvp(f, (x,), (t,)))(xs, ts)
    assert_tree_allclose(got, jax.vmap(lambda x, t: jax.jvp(ref, (x,), (t,)))(xs, ts))
    got = jax.jit(jax.vmap(jax.jacfwd(f)))(xs)
    assert_tree_allclose(got, jax.vmap(jax.jacfwd(ref))(xs))


@pytest.mark.parametrize("given", FORWARD_CAPABLE, ids="+".join)
def test_jacfwd_with_respect_to_one_leaf(given):
    # `u`'s tangent is a zero that `jacfwd`'s level (2 tangents) does not batch; with
    # max_tangents=0, forward mode runs `jvp`/`jvp_batch` on the tangents, not forward-basis
    f = make(given, Counter(), max_tangents=0)

    def of(fn):
        return lambda v2: fn({"u": X["u"], "v": jnp.concatenate([v2, X["v"][2:]])})

    assert_tree_allclose(jax.jacfwd(of(f))(X["v"][:2]), jax.jacfwd(of(ref))(X["v"][:2]))


# ----------------------------------------------------------------------------- reverse mode, per-site strategy


REVERSE = {
    ("fwd", "bwd"): ("standard", {"fwd": 1, "bwd": 1}),
    ("jvp",): ("forward-basis", {"jvp": 1}),
    ("jvp_batch",): ("forward-basis", {"jvp_batch": 1}),
    ("fwd", "bwd", "jvp_batch"): ("forward-basis", {"jvp_batch": 1}),
    ("fwd", "bwd", "jvp"): ("forward-basis", {"jvp": 1}),
}


@pytest.mark.parametrize("given", list(REVERSE), ids="+".join)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_reverse_mode_strategy_and_counts(given, jit):
    counter = Counter()
    f = make(given, counter)
    schedule, expected = REVERSE[given]
    loss = loss_of(f)
    site = dx.explain(loss, X).sites[0]
    assert site.schedule == schedule and site.n == (N if schedule == "forward-basis" else None)
    if schedule == "forward-basis":
        why = (
            "forward-basis: the output and n=6 tangents in one call, one stage where `fwd` then `bwd` take two"
            if "bwd" in given
            else "reverse mode from its forward-mode implementation: the output and n=6 tangents in one call"
        )
        # with `bwd` (which does not read `y`) the site could be deferred, but the loss is nonlinear
        first = "its cotangent depends on its own output" if "bwd" in given else "no `fused` implementation"
        assert site.reason.startswith(first) and site.reason.endswith(f"; {why}")
    for transform in (lambda g: jax.value_and_grad(g), lambda g: dx.filter_value_and_grad(g)):
        fn = transform(loss)
        fn = jax.jit(fn) if jit else fn
        fn(X)
        counter.reset()
        got = fn(X)
        assert counts(counter) == expected
        assert_tree_allclose(got, jax.value_and_grad(loss_of(ref))(X))
    assert_tree_allclose(jax.jacrev(lambda x: f(x)["power"])(X), jax.jacrev(lambda x: ref(x)["power"])(X))


@pytest.mark.parametrize("given", [("jvp",), ("jvp_batch",), ("fused", "jvp")], ids="+".join)
def test_output_structure_inferred_from_jvp(given):
    """Without `fwd` or `out=`, the output's structure is what `jvp` (or `jvp_batch`)
    returns, found by tracing it: nothing runs until the function is called."""
    counter = Counter()
    impls = reference_impls(ref, counter)
    f = dx.ExpensiveFn(**{k: impls[k] for k in given}, name="sim")
    assert f.out_struct(X) == OUT
    assert counts(counter) == {}
    counter.reset()
    assert_tree_allclose(f(X), ref(X))  # eagerly: the primal from one call, with a zero tangent (or cotangent)
    assert counts(counter) == {given[0]: 1}
    for run in (dx.filter_value_and_grad(loss_of(f)), jax.jit(jax.value_and_grad(loss_of(f)))):
        counter.reset()
        got = run(X)
        assert counts(counter) == {given[-1]: 1}  # forward-basis: one call for the output and its tangents
        assert_tree_allclose(got, jax.value_and_grad(loss_of(ref))(X))


def test_reverse_mode_under_vmap_both_ways():
    counter = Counter()
    f = make(("jvp_batch",), counter)
    xs = jax.tree_util.tree_map(lambda a: jnp.stack([a, 2 * a, -a]), X)
    got = jax.vmap(jax.grad(loss_of(f)))(xs)
    assert_tree_allclose(got, jax.vmap(jax.grad(loss_of(ref)))(xs))
    total = lambda g: (
        lambda x: jnp.sum(jax.vmap(loss_of(g))(jax.tree_util.tree_map(lambda a: jnp.stack([a, 2 * a]), x)))
    )  # noqa: E731
    counter.reset()
    assert_tree_allclose(jax.grad(total(f))(X), jax.grad(total(ref))(X))
    assert counts(counter) == {"jvp_batch": 1}  # one batched call for the batch of 2


def test_prefer_forces_a_strategy():
    counter = Counter()
    f = make(("fwd", "bwd", "fused", "jvp_batch"), counter, prefer="standard")
    linear = lambda g: lambda x: (lambda y: jnp.sum(jnp.real(y["field"])) + y["power"])(g(x))  # noqa: E731
    plan = dx.explain(linear(f), X)
    assert plan.sites[0].schedule == "standard" and plan.sites[0].reason == "prefer='standard' was given"
    counter.reset()
    assert_tree_allclose(dx.filter_value_and_grad(linear(f))(X), jax.value_and_grad(linear(ref))(X))
    assert counts(counter) == {"fwd": 1, "bwd": 1}
    g = make(("fwd", "bwd", "fused", "jvp_batch"), counter, prefer="forward-basis")
    assert dx.explain(linear(g), X).sites[0].schedule == "forward-basis"
    counter.reset()
    assert_tree_allclose(dx.filter_value_and_grad(linear(g))(X), jax.value_and_grad(linear(ref))(X))
    assert counts(counter) == {"jvp_batch": 1}
    # without `prefer`, a site that can be deferred is: fused (2 solves) beats n + 1 = 7
    h = make(("fwd", "bwd", "fused", "jvp_batch"), counter)
    assert dx.explain(linear(h), X).sites[0].schedule == "deferred"
    counter.reset()
    assert_tree_allclose(dx.filter_value_and_grad(linear(h))(X), jax.value_and_grad(linear(ref))(X))
    assert counts(counter) == {"fused": 1}
    # many inputs: above max_tangents the standard strategy is kept
    k = make(("fwd", "bwd", "jvp_batch"), counter, max_tangents=4)
    assert dx.explain(loss_of(k), X).sites[0].schedule == "standard"
    counter.reset()
    assert_tree_allclose(dx.filter_value_and_grad(loss_of(k))(X), jax.value_and_grad(loss_of(ref))(X))
    assert counts(counter) == {"fwd": 1, "bwd": 1}


def test_network_mixing_a_jvp_only_site_and_a_bwd_only_site():
    """Seed 002: a layer with only a JVP and a layer with only a VJP in one gradient."""
    counter = Counter()
    tangent_layer = make(("jvp",), counter)
    adjoint_layer = dx.ExpensiveFn(fwd=jnp.tanh, bwd=lambda x, y, ct: ct * (1 - y**2), name="adjoint_layer")

    class Net(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            h = tangent_layer(x)
            z = adjoint_layer(self.w * jnp.real(h["field"]) + h["power"])
            return jnp.sum(z**2)

    def plain(net, x):
        h = ref(x)
        return jnp.sum(jnp.tanh(net.w * jnp.real(h["field"]) + h["power"]) ** 2)

    net = Net(jnp.array([1.0, -0.5, 2.0]))
    loss = lambda nx: nx[0](nx[1])  # noqa: E731  (the input differentiated too: through both layers)
    plan = dx.explain(dx.filter_value_and_grad(loss), (net, X))
    assert [s.schedule for s in plan.sites] == ["forward-basis", "standard"]
    counter.reset()
    value, grads = dx.filter_value_and_grad(loss)((net, X))
    assert counts(counter) == {"jvp": 1}
    value_r, grads_r = eqx.filter_value_and_grad(lambda nx: plain(*nx))((net, X))
    assert_tree_allclose((value, grads[0].w, grads[1]), (value_r, grads_r[0].w, grads_r[1]))
    assert_tree_allclose(jax.grad(lambda x: net(x))(X), jax.grad(lambda x: plain(net, x))(X))
    # with respect to the weights only, nothing differentiates the tangent layer: its output, no tangents
    plan = dx.explain(dx.filter_value_and_grad(lambda net, x: net(x)), net, X)
    assert [s.schedule for s in plan.sites] == ["standard", "standard"]
    assert plan.sites[0].reason == "its input depends on no differentiated argument: no backward pass runs for it"
    counter.reset()
    value, grads = dx.filter_value_and_grad(lambda net, x: net(x))(net, X)
    assert counts(counter) == {"jvp": 1}
    value_r, grads_r = eqx.filter_value_and_grad(plain)(net, X)
    assert_tree_allclose((value, grads.w), (value_r, grads_r.w))


def test_hessian_forward_over_reverse():
    """`jax.hessian` is forward over reverse: the standard strategy needs `jvp` for the
    forward pass and a JAX-traceable `bwd`; the forward-basis strategy a JAX-traceable `jvp`."""
    loss = lambda g: lambda x: (lambda y: y["power"] ** 2 + jnp.sum(jnp.real(y["field"]) ** 3))(g(x))  # noqa: E731
    for given, prefer in [(("fwd", "bwd", "jvp"), "standard"), (("jvp_batch",), None)]:
        f = make(given, Counter(), prefer=prefer)
        assert_tree_allclose(jax.hessian(loss(f))(X), jax.hessian(loss(ref))(X))


# ----------------------------------------------------------------------------- dx.jacobian


def test_jacobian_chooses_forward_or_reverse():
    counter = Counter()
    f = make(("fwd", "bwd", "jvp"), counter, prefer="standard")
    wide = lambda x: f(x)["field"]  # 6 numbers in, 6 (complex 3) out: forward  # noqa: E731
    counter.reset()
    got = dx.jacobian(wide)(X)
    assert_tree_allclose(got, jax.jacfwd(lambda x: ref(x)["field"])(X))
    assert counts(counter) == {"fwd": 1, "jvp": 1}
    narrow = lambda x: f(x)["power"]  # 6 in, 1 out: reverse  # noqa: E731
    counter.reset()
    got = dx.jacobian(narrow)(X)
    assert_tree_allclose(got, jax.jacrev(lambda x: ref(x)["power"])(X))
    assert counts(counter) == {"fwd": 1, "bwd": 1}
    # Equinox filtering: non-array leaves are not differentiated; has_aux
    got, aux = dx.jacobian(lambda p, s: (f(p["x"])["power"] * s, p["tag"]), has_aux=True)({"x": X, "tag": "t"}, 2.0)
    assert aux == "t" and got["tag"] is None
    assert_tree_allclose(got["x"], jax.jacrev(lambda x: ref(x)["power"] * 2.0)(X))
    assert_tree_allclose(dx.jacobian(narrow, mode="forward")(X), jax.jacrev(lambda x: ref(x)["power"])(X))


# ----------------------------------------------------------------------------- host functions


def test_host_jvp():
    A = np.array([[2.0, 1.0, 0.0], [1.0, 3.0, 0.5], [0.0, 0.5, 4.0]])
    calls = []

    def solve(d):  # y = (A + diag(d))^-1 b
        calls.append("fwd")
        return np.linalg.solve(A + np.diag(d), np.ones(3))

    def solve_jvp(d, t):  # one factorisation: y and dy = -M^-1 diag(t) y
        calls.append("jvp")
        m = A + np.diag(d)
        y = np.linalg.solve(m, np.ones(3))
        return y, np.linalg.solve(m, -t * y)

    f = dx.host(solve, jvp=solve_jvp, out=jax.ShapeDtypeStruct((3,), jnp.float64), name="host_solve")
    plain = lambda d: jnp.linalg.solve(jnp.asarray(A) + jnp.diag(d), jnp.ones(3))  # noqa: E731
    d, t = jnp.array([0.1, 0.2, 0.3]), jnp.array([1.0, -1.0, 0.5])
    assert_tree_allclose(jax.jvp(f, (d,), (t,)), jax.jvp(plain, (d,), (t,)))
    calls.clear()
    assert_tree_allclose(jax.jit(jax.jacfwd(f))(d), jax.jacfwd(plain)(d))
    assert calls == ["jvp", "jvp", "jvp"]  # forward-basis: one `jvp` per input number, submitted together
    calls.clear()
    loss = lambda g: lambda d: jnp.sum(g(d) ** 2)  # noqa: E731
    assert_tree_allclose(dx.filter_value_and_grad(loss(f))(d), jax.value_and_grad(loss(plain))(d))
    assert calls.count("fwd") == 0 and calls.count("jvp") == 3  # forward-basis: 3 tangents, no `fwd`


# ----------------------------------------------------------------------------- errors


def match(text):
    return re.escape(text)


def test_error_forward_mode_without_jvp():
    f = dx.ExpensiveFn(fwd=jnp.sin, bwd=lambda x, y, ct: ct * jnp.cos(x), name="adjoint_only")
    with pytest.raises(
        TypeError,
        match=match(
            "`ExpensiveFn(name='adjoint_only')`: forward-mode differentiation (`jax.jvp`, `jax.jacfwd`, \
`jax.linearize`, `jax.hessian`) needs a\nforward-mode implementation, but this function's derivative is given by `bwd`"
        ),
    ):
        jax.jvp(f, (jnp.ones(3),), (jnp.ones(3),))
    with pytest.raises(TypeError, match=match("Give\n`jvp(x, t_x) -> (y, t_y)`")):
        jax.jacfwd(f)(jnp.ones(3))


def test_error_reverse_mode_without_bwd_and_too_many_inputs():
    f = dx.ExpensiveFn(
        jvp=lambda x, t: (jnp.sin(x), jnp.cos(x) * t),
        out=jax.ShapeDtypeStruct((5,), jnp.float64),
        max_tangents=3,
        name="tangent_only",
    )
    assert_tree_allclose(jax.jvp(f, (jnp.ones(5),), (jnp.ones(5),))[1], jnp.cos(jnp.ones(5)))  # forward mode works
    with pytest.raises(
        TypeError,
        match=match(
            "`ExpensiveFn(name='tangent_only')`: reverse-mode differentiation (`jax.grad`, `jax.vjp`, `jax.jacrev`) \
needs `bwd` or `fused`, or the\nforward-basis strategy: the primal with one tangent per input number. This input \
has n=5 numbers, more than\nmax_tangents=3. Give `bwd(x, y, ct_y) -> ct_x` (an adjoint), or raise `max_tangents`."
        ),
    ):
        jax.grad(lambda x: jnp.sum(f(x)))(jnp.ones(5))


def test_error_bad_prefer_and_max_tangents_and_mode():
    with pytest.raises(
        ValueError,
        match=match("`ExpensiveFn(name='sin')`: `prefer` must be None, 'standard' or 'forward-basis', but got 'fast'."),
    ):
        dx.ExpensiveFn(fwd=jnp.sin, prefer="fast")
    with pytest.raises(
        TypeError,
        match=match(
            "`ExpensiveFn(name='sin')`: prefer='forward-basis' needs `jvp` or `jvp_batch`, which was not given."
        ),
    ):
        dx.ExpensiveFn(fwd=jnp.sin, bwd=lambda x, y, ct: ct, prefer="forward-basis")
    with pytest.raises(
        TypeError,
        match=match("`ExpensiveFn(name='sin')`: prefer='standard' needs `bwd` or `fused`, which was not given."),
    ):
        dx.ExpensiveFn(fwd=jnp.sin, jvp=lambda x, t: (x, t), prefer="standard")
    with pytest.raises(
        ValueError,
        match=match("`ExpensiveFn(name='sin')`: `max_tangents` must be a non-negative int or None, but got -1."),
    ):
        dx.ExpensiveFn(fwd=jnp.sin, max_tangents=-1)
    with pytest.raises(
        ValueError,
        match=match("`deferax.jacobian`: `mode` must be 'auto', 'forward' or 'reverse', but got 'sideways'."),
    ):
        dx.jacobian(jnp.sin, mode="sideways")


def test_error_jvp_returns_wrong_things():
    f = dx.ExpensiveFn(fwd=jnp.sin, jvp=lambda x, t: jnp.cos(x) * t, name="bad_jvp")
    with pytest.raises(
        ValueError,
        match=match(
            "`ExpensiveFn(name='bad_jvp')`: `jvp` returned float64[3], not a pair.\n`jvp(x, t_x)` must return a \
pair `(y, t_y)`"
        ),
    ):
        jax.jvp(f, (jnp.ones(3),), (jnp.ones(3),))
    g = dx.ExpensiveFn(fwd=jnp.sin, jvp_batch=lambda x, ts: (jnp.sin(x), ts[:, :2]), name="bad_batch")
    with pytest.raises(
        ValueError,
        match=match(
            "`ExpensiveFn(name='bad_batch')`: `jvp_batch` returned a batch of tangents that does not match the \
output with a leading axis of one tangent each.\nExpected float64[3, 3], found float64[3, 2]."
        ),
    ):
        jax.jacfwd(g)(jnp.ones(3))


def test_warning_jvp_that_vmap_cannot_separate():
    """A `jvp` whose primal comes from a host callback: the forward-basis strategy warns that
    the primal runs once per tangent, and is still right."""

    def jvp(x, t):
        # a host function that takes the tangent too (as `dx.host`'s do): `y` looks batched
        y = jax.pure_callback(
            lambda x, t: np.sin(x), jax.ShapeDtypeStruct(x.shape, x.dtype), x, t, vmap_method="sequential"
        )
        return y, jnp.cos(x) * t

    f = dx.ExpensiveFn(jvp=jvp, out=lambda s: s, name="callback_jvp")
    x = jnp.array([0.1, 0.2, 0.3])
    with pytest.warns(
        UserWarning,
        match=match(
            "`ExpensiveFn(name='callback_jvp')`: `jvp` could not be batched over the tangent with the primal \
computed once"
        ),
    ):
        got = jax.grad(lambda x: jnp.sum(f(x) ** 2))(x)
    assert_tree_allclose(got, jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(x))


def test_integer_leaves_in_input_and_output_on_every_strategy():
    """`{"p": p, "n": 3} -> {"u": field, "iters": 7}` on the standard and forward-basis
    strategies, reverse and forward mode (an integer output's tangent is `float0`)."""

    def solver(x):
        return {"u": jnp.sin(x["p"]) * x["n"].astype(jnp.float64), "iters": jnp.array(7)}

    def bwd(x, y, ct):
        ct_p = jax.vjp(lambda p: solver({"p": p, "n": x["n"]}), x["p"])[1](ct)[0]
        return {"p": ct_p, "n": np.zeros((), jax.dtypes.float0)}

    def jvp(x, t):
        return jax.jvp(lambda p: solver({"p": p, "n": x["n"]}), (x["p"],), (t["p"],))

    x = {"p": jnp.array([0.3, -0.2, 0.8]), "n": jnp.array(3)}
    t = {"p": jnp.array([1.0, 0.5, -2.0]), "n": np.zeros((), jax.dtypes.float0)}
    w = jnp.array([1.0, 2.0, -1.0])
    program = lambda g: lambda x: (lambda y: jnp.sum(y["u"] ** 2 * w) + 0.0 * y["iters"].astype(jnp.float64))(g(x))  # noqa: E731
    for given, schedule in [
        ({"bwd": bwd}, "standard"),
        ({"jvp": jvp}, "forward-basis"),
        ({"bwd": bwd, "jvp": jvp}, "forward-basis"),
    ]:
        f = dx.ExpensiveFn(fwd=solver, **given, name="int_leaves")
        assert dx.explain(program(f), x).sites[0].schedule == schedule
        for jit in (False, True):
            step = dx.filter_value_and_grad(program(f))
            got = (eqx.filter_jit(step) if jit else step)(x)
            assert_tree_allclose(got, eqx.filter_value_and_grad(program(solver))(x))
        if "jvp" in given:
            y, t_y = jax.jvp(f, (x,), (t,))
            y_r, t_r = jax.jvp(solver, (x,), (t,))
            assert_tree_allclose((y, t_y["u"]), (y_r, t_r["u"]))
            assert t_y["iters"].dtype == jax.dtypes.float0
