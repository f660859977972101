"""A site under `jax.vmap` whose loss reaches each example's output through that example's
own frontier (an MSE over a linear readout): its basis is counted per example (k = 1, not
the batch), and each example's adjoint gets only its own cotangent rows. A loss that mixes
the examples after the frontier (a softmax across the batch) keeps that basis and stays
correct; a frontier that mixes them (a roll across the batch) keeps the whole count.
Gradients against plain JAX (the host layer replaced by the jnp function it stands for)
and against Equinox's `filter_value_and_grad`, eagerly and under `jit`."""

import functools
import importlib.util
import pathlib
import sys
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx

from .helpers import assert_tree_allclose

B, D, H, M = 8, 3, 5, 4
P = np.linspace(-1.0, 1.0, M * H).reshape(M, H)


class Runs:
    """What the host functions received: one entry a call, the number of cotangent rows."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls: dict[str, list[int]] = {"fwd": [], "adjoint": [], "fused_batch": []}

    def add(self, name, rows):
        with self.lock:
            self.calls[name].append(rows)

    def count(self, name):
        return len(self.calls[name])

    def rows(self, name):
        return sum(self.calls[name])


def physics(x):  # what the host layer stands for, in JAX
    return jnp.tanh(jnp.asarray(P) @ x)


def host_layer(runs, with_fused_batch=False, vectorized=False):
    def fwd(x):  # `x`: one example (H,), or the batch (B, H) for a vectorized layer
        runs.add("fwd", 0)
        return np.tanh(x @ P.T)

    def adjoint(x, ct):  # `ct`: one cotangent of y (M,), or a stack of them
        runs.add("adjoint", 1 if np.ndim(ct) == 1 else np.shape(ct)[0])
        return ((1 - np.tanh(x @ P.T) ** 2) * ct) @ P

    extra = {}
    if with_fused_batch:

        def fused(x, ct):
            return fwd(x), adjoint(x, ct)

        def fused_batch(x, cts):
            runs.add("fused_batch", np.shape(cts)[0])
            y = np.tanh(P @ x)
            return y, ((1 - y**2) * cts) @ P

        extra = {"fused": fused, "fused_batch": fused_batch}
    out = jax.ShapeDtypeStruct((M,), jnp.float64)
    return dx.host(fwd, adjoint=adjoint, out=out, vectorized=vectorized, name="physics", **extra)


def model_and_data():
    encoder = eqx.nn.MLP(D, H, 6, 1, activation=jnp.tanh, key=jax.random.PRNGKey(0))
    readout = eqx.nn.Linear(M, 1, key=jax.random.PRNGKey(1))
    xs = jax.random.normal(jax.random.PRNGKey(2), (B, D))
    ts = jax.random.normal(jax.random.PRNGKey(3), (B, 1))
    return (encoder, readout), xs, ts


def mse(layer):
    def loss(model, xs, ts):
        encoder, readout = model
        p = jax.vmap(readout)(jax.vmap(layer)(jax.vmap(encoder)(xs)))
        return jnp.mean((p - ts) ** 2)

    return loss


def softmax_across_batch(layer):  # a loss that mixes the examples after the frontier
    def loss(model, xs, ts):
        encoder, readout = model
        p = jax.vmap(readout)(jax.vmap(layer)(jax.vmap(encoder)(xs)))[:, 0]
        return -jnp.sum(jax.nn.log_softmax(p) * jax.nn.softmax(ts[:, 0]))

    return loss


def transposed_readout(layer):  # the examples on the last axis of the prediction: (1, B)
    def loss(model, xs, ts):
        encoder, readout = model
        p = readout.weight @ jax.vmap(layer)(jax.vmap(encoder)(xs)).T
        return jnp.mean(jnp.sin(p - ts.T))

    return loss


MIX = jnp.eye(B) + 0.25 * jnp.eye(B, k=1)


def mixed_by_a_matrix(layer):  # a frontier that mixes the examples: MIX @ p
    def loss(model, xs, ts):
        encoder, readout = model
        p = jax.vmap(readout)(jax.vmap(layer)(jax.vmap(encoder)(xs)))
        return jnp.mean((MIX @ p - ts) ** 2)

    return loss


def rolled(layer):  # a frontier that mixes the examples: p[b] - p[b - 1]
    def loss(model, xs, ts):
        encoder, readout = model
        p = jax.vmap(readout)(jax.vmap(layer)(jax.vmap(encoder)(xs)))
        return jnp.mean((p - jnp.roll(p, 1, axis=0) - ts) ** 2)

    return loss


def grads(value_and_grad, loss, model, xs, ts, jit):
    f = value_and_grad(loss)
    f = eqx.filter_jit(f) if jit else f
    return f(model, xs, ts)


def check(make_loss, jit, *, with_fused_batch=False, xs_nan=False, vectorized=False, **kwargs):
    runs = Runs()
    model, xs, ts = model_and_data()
    if xs_nan:
        xs = xs.at[2, 1].set(jnp.nan)
    loss = make_loss(host_layer(runs, with_fused_batch, vectorized))
    got = grads(lambda f: dx.filter_value_and_grad(f, **kwargs), loss, model, xs, ts, jit)
    expected = grads(eqx.filter_value_and_grad, make_loss(physics), model, xs, ts, jit)
    assert_tree_allclose(got, expected)
    equinox = grads(eqx.filter_value_and_grad, loss, model, xs, ts, jit)  # (the host layer standard there)
    assert_tree_allclose(got, equinox)
    plan = dx.explain(dx.filter_value_and_grad(loss, **kwargs), model, xs, ts)
    return runs, plan, got


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "make_loss", [mse, softmax_across_batch, transposed_readout], ids=["mse", "softmax-across-batch", "transposed"]
)
def test_a_readout_loss_is_one_cotangent_per_example(make_loss, jit):
    """k = 1 per example, not B: the site is deferred on its basis (estimated faster than
    standard: one stage of `fwd` and one adjoint against two), each example's adjoint gets
    its one row (B rows in all, where the whole batch's count gave it B each, B * B in all)."""
    runs, plan, _ = check(make_loss, jit)
    (site,) = plan.sites
    assert (site.schedule, site.k, site.batch) == ("deferred-basis", 1, (B,)), plan
    assert site.estimates is not None and site.estimates.deferred < site.estimates.standard
    assert plan.stages == (("physics: fused x8 (k=1 cotangents per example)",),)
    # one forward and one adjoint for each example (the Equinox run adds B and B)
    assert runs.count("fwd") == 2 * B and runs.count("adjoint") == 2 * B
    assert runs.rows("adjoint") == 2 * B


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_with_a_fused_batch_each_example_gets_its_own_rows(jit):
    runs, plan, _ = check(mse, jit, with_fused_batch=True)
    (site,) = plan.sites
    assert (site.schedule, site.k) == ("deferred-basis", 1), plan
    assert runs.count("fused_batch") == B and runs.rows("fused_batch") == B


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("make_loss", [rolled, mixed_by_a_matrix], ids=["rolled", "matrix"])
def test_a_frontier_mixing_the_examples_counts_the_whole_batch(make_loss, jit):
    """`p - roll(p)` or `MIX @ p` reach example b's output from two predictions: no
    per-example basis. The site stays standard (k = B, estimated slower); forced, each
    example's adjoint gets all B rows, and the gradient is right either way."""
    runs, plan, _ = check(make_loss, jit)
    (site,) = plan.sites
    assert (site.schedule, site.k) == ("standard", B), plan
    runs, plan, _ = check(make_loss, jit, max_basis=B)
    (site,) = plan.sites
    assert (site.schedule, site.k) == ("deferred-basis", B), plan
    assert plan.stages == (("physics: fused x8 (k=8 cotangents)",),)
    assert runs.rows("adjoint") == B * B + B  # (Equinox's run: B)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_vectorized_layer_gets_one_row_per_example_in_one_call(jit):
    """A host layer taking the whole batch: one forward call, and one adjoint call on B rows,
    one an example (the Equinox run adds one call of each, B rows)."""
    runs, plan, _ = check(mse, jit, vectorized=True)
    assert (plan.sites[0].schedule, plan.sites[0].k) == ("deferred-basis", 1), plan
    assert runs.count("fwd") == 2 and runs.calls["adjoint"] == [B, B]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nan_in_one_example(jit):
    """A NaN in one example's input: NaN where plain JAX and Equinox have it (the value and
    every shared parameter), the same numbers elsewhere."""
    _, plan, got = check(mse, jit, xs_nan=True)
    assert plan.sites[0].schedule == "deferred-basis"
    assert np.isnan(got[0])


def test_a_traced_fused_without_fused_batch_defers_per_example():
    """A JAX `fused` (no `fused_batch`) under `vmap`: before, the basis schedule needed a
    `fused_batch` there; per example it is `fused` batched over the example's one row."""

    def fused(x, ct):
        y, vjp = jax.vjp(physics, x)
        return y, vjp(ct)[0]

    layer = dx.ExpensiveFn(fwd=physics, fused=fused, name="traced")
    model, xs, ts = model_and_data()
    plan = dx.explain(mse(layer), model, xs, ts)
    assert (plan.sites[0].schedule, plan.sites[0].k) == ("deferred-basis", 1), plan
    for jit in (False, True):
        got = grads(dx.filter_value_and_grad, mse(layer), model, xs, ts, jit)
        assert_tree_allclose(got, grads(eqx.filter_value_and_grad, mse(physics), model, xs, ts, jit))


def test_a_complex_frontier_per_example():
    """A complex output and a complex readout: two rows per example (real and imaginary)."""
    Q = jnp.asarray(P, jnp.complex128) * (1.0 + 0.5j)

    def field(x):
        return jnp.exp(1j * (Q @ x.astype(jnp.complex128)))

    def fused(x, ct):
        y, vjp = jax.vjp(field, x)
        return y, vjp(ct)[0]

    layer = dx.ExpensiveFn(fwd=field, fused=fused, name="field")
    w = jnp.arange(1.0, M + 1.0, dtype=jnp.complex128) - 0.5j

    def make(f):
        def loss(h, ts):
            z = jax.vmap(lambda y: jnp.vdot(w, y))(jax.vmap(f)(h))
            return jnp.sum(jnp.abs(z - ts[:, 0].astype(jnp.complex128)) ** 2)

        return loss

    h = jax.random.normal(jax.random.PRNGKey(4), (B, H))
    ts = jax.random.normal(jax.random.PRNGKey(5), (B, 1))
    step = dx.filter_value_and_grad(make(layer), max_basis=2)
    plan = dx.explain(step, h, ts)
    assert (plan.sites[0].schedule, plan.sites[0].k) == ("deferred-basis", 2), plan
    got = step(h, ts)
    assert_tree_allclose(got, jax.value_and_grad(make(field))(h, ts))


W32 = jnp.arange(6.0).reshape(3, 2)
AXES = {
    "scaled, transposed": (lambda y: (2.0 * y).T, 1),
    "summed over an example's entries": (lambda y: jnp.sum(y, axis=1), 0),
    "a readout in a nested jit": (lambda y: jax.jit(lambda a: a @ W32)(y), 0),
    "reshaped, the examples kept": (lambda y: jnp.reshape(y, (4, 3, 1)), 0),
    "summed over the examples": (lambda y: jnp.sum(y, axis=0), "mixed"),
    "flattened": (lambda y: jnp.reshape(y, (12,)), "mixed"),
    "sliced across the examples": (lambda y: y[1:], "mixed"),
    "rolled across the examples": (lambda y: jnp.roll(y, 1, axis=0), "mixed"),
    "a matrix across the examples": (lambda y: jnp.eye(4) @ y, "mixed"),
}


@pytest.mark.parametrize("case", list(AXES))
def test_example_axes(case):
    """Which axis of a value indexes the examples of `y` (batched at 0), or "mixed"."""
    from deferax import _jaxpr

    f, expected = AXES[case]
    closed = jax.make_jaxpr(f)(jnp.ones((4, 3)))
    assert _jaxpr.example_axes(closed, [0]).get(closed.jaxpr.outvars[0]) == expected


@functools.cache
def load_benchmark():
    """`benchmarks/bench_supervised.py` as a module (once: its typed modules' annotations
    name its classes)."""
    folder = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
    spec = importlib.util.spec_from_file_location("bench_supervised", folder / "bench_supervised.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_supervised"] = module  # (its dataclasses look it up)
    sys.path.insert(0, str(folder))  # (it imports `_common` from there)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(folder))
    return module


@pytest.mark.parametrize("vectorized", [True, False], ids=["one-call", "a-call-an-example"])
def test_the_supervised_benchmark_step_equals_equinox_s(vectorized):
    """`benchmarks/bench_supervised.py` at a small size, without the sleep: the typed model's
    gradient equals Equinox's and plain JAX's (float32), and one jitted Adam step gives the
    same model and value as Equinox's step."""
    bench = load_benchmark()
    model, plain, xs, ts = bench.build(0.0, (8, 4, 16, 8, 4), vectorized)
    assert bench.check_gradients(model, plain, xs, ts) < 1e-5
    opt, _ = bench.adam()
    with jax.numpy_dtype_promotion("standard"):  # (optax's Adam mixes a Python float and its int32 count)
        state = opt.init(eqx.filter(model, eqx.is_array))
        got = bench.make_step(dx.filter_value_and_grad, opt)(model, state, xs, ts)
        expected = bench.make_step(eqx.filter_value_and_grad, opt)(model, state, xs, ts)
    assert_tree_allclose(eqx.filter(got, eqx.is_array), eqx.filter(expected, eqx.is_array), rtol=1e-5, atol=1e-6)


def test_the_benchmark_s_hand_written_adam_is_optax_s():
    """Where optax is absent the benchmark uses its own Adam: the same updates as optax's."""
    optax = pytest.importorskip("optax")
    bench = load_benchmark()
    hand, name = bench.adam(prefer_optax=False)
    assert name == "hand-written Adam"
    params = {"w": jnp.array([1.0, -2.0, 0.5], jnp.float32), "b": jnp.float32(0.25)}
    states = [hand.init(params), optax.adam(1e-3).init(params)]
    for i in range(3):
        g = jax.tree_util.tree_map(lambda p, i=i: jnp.sin(p * (i + 1)), params)
        u1, states[0] = hand.update(g, states[0], params)
        with jax.numpy_dtype_promotion("standard"):  # (optax's Adam mixes a Python float and its int32 count)
            u2, states[1] = optax.adam(1e-3).update(g, states[1])
        assert_tree_allclose(u1, u2, rtol=1e-5, atol=1e-9)
        params = jax.tree_util.tree_map(lambda p, u: p + u, params, u1)
