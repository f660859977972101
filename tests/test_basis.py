"""The deferred-basis schedule: cotangents that depend on the output through a few numbers."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deferax as dx

from .helpers import Counter, assert_tree_allclose, make

P0 = jnp.array([0.3, -0.2, 0.8])
M1 = jnp.array([1.0 + 1.0j, 0.5 + 0.0j, -1.0j])
M2 = jnp.array([0.3 + 0.0j, 1.0j, 1.0 - 0.5j])


class Parts(eqx.Module):
    """A `fused` whose primal part and adjoint part are counted separately.

    The primal tick takes `x` (not batched over cotangents) and fires once per run of the
    primal; the adjoint tick takes the cotangent and fires once per cotangent.
    """

    ref: object = eqx.field(static=True)
    counter: object = eqx.field(static=True)

    def __call__(self, x, ct):
        jax.debug.callback(lambda _: self.counter.counts.update(["primal"]), x)
        y, vjp = jax.vjp(self.ref, x)
        (ct_x,) = vjp(ct)
        jax.debug.callback(lambda _: self.counter.counts.update(["adjoint"]), jax.tree.leaves(ct)[0])
        return y, ct_x


def sim(ref, counter, name="sim", **kwargs):
    def fwd(x):
        counter.tick("fwd")
        return ref(x)

    def bwd(x, y, ct):
        counter.tick("bwd")
        return jax.vjp(ref, x)[1](ct)[0]

    return dx.ExpensiveFn(fwd=fwd, bwd=bwd, fused=Parts(ref, counter), name=name, **kwargs)


def scalar_ref(x):
    return jnp.sum(jnp.sin(x) ** 2) + 0.5


def field_ref(x):
    z = x.astype(jnp.complex128)
    return z * jnp.exp(1j * jnp.array([1.0, 2.0, 3.0], dtype=jnp.complex128) * z)


def counts(counter):
    return {k: counter.counts[k] for k in ("fwd", "bwd", "primal", "adjoint")}


def run_and_compare(loss, reference, p, counter, *, max_basis=2, jit=False):
    """Run `loss` under `dx.filter_value_and_grad` (`max_basis=None`: the default) and
    compare with `reference`, the same program in plain JAX (each `ExpensiveFn` replaced by
    the function it stands for), differentiated by `jax.value_and_grad`; return the counts."""
    transform = dx.filter_value_and_grad(loss, **({} if max_basis is None else {"max_basis": max_basis}))
    if jit:
        transform = eqx.filter_jit(transform)
        transform(p)
        jax.effects_barrier()
    counter.reset()
    got = transform(p)
    jax.block_until_ready(got)
    jax.effects_barrier()
    seen = counts(counter)
    assert_tree_allclose(got, jax.value_and_grad(reference)(p), rtol=1e-10, atol=1e-12)
    return seen


SCALAR_LOSSES = {
    "log": lambda y, p: jnp.log(y) + jnp.sum(p**2),
    "square": lambda y, p: y**2 * jnp.sum(p),
    "sin": lambda y, p: jnp.sin(3.0 * y),
    "inverse": lambda y, p: 1.0 / y + jnp.sum(jnp.cos(p)),
}


@pytest.mark.parametrize("name", SCALAR_LOSSES)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_scalar_output(name, jit):
    counter = Counter()
    f = sim(scalar_ref, counter)
    program = lambda g: lambda p: SCALAR_LOSSES[name](g(p), p)  # noqa: E731
    loss = program(f)
    (site,) = dx.explain(loss, P0).sites
    assert site.schedule == "deferred-basis" and site.k == 1 and site.reason is None
    assert run_and_compare(loss, program(scalar_ref), P0, counter, jit=jit) == {
        "fwd": 0,
        "bwd": 0,
        "primal": 1,
        "adjoint": 1,
    }


def overlap(f):
    return lambda p: jnp.abs(jnp.vdot(M1, f(p))) ** 2


def test_overlap_squared_complex_field():
    counter = Counter()
    f = sim(field_ref, counter, name="fdfd")
    loss, reference = overlap(f), overlap(field_ref)
    (site,) = dx.explain(dx.filter_value_and_grad(loss, max_basis=2), P0).sites
    assert site.schedule == "deferred-basis" and site.k == 2
    # a complex number counts as two real numbers: one primal, two adjoints
    assert run_and_compare(loss, reference, P0, counter) == {"fwd": 0, "bwd": 0, "primal": 1, "adjoint": 2}
    assert run_and_compare(loss, reference, P0, counter, jit=True) == {"fwd": 0, "bwd": 0, "primal": 1, "adjoint": 2}


def two_overlaps(f):
    def loss(p):
        e = f(p)
        return jnp.abs(jnp.vdot(M1, e)) ** 2 + 0.5 * jnp.abs(jnp.vdot(M2, e)) ** 2

    return loss


def test_sum_of_two_overlaps_k4():
    counter = Counter()
    loss = two_overlaps(sim(field_ref, counter))
    plan = dx.explain(dx.filter_value_and_grad(loss, max_basis=4), P0)
    assert plan.sites[0].schedule == "deferred-basis" and plan.sites[0].k == 4
    assert run_and_compare(loss, two_overlaps(field_ref), P0, counter, max_basis=4) == {
        "fwd": 0,
        "bwd": 0,
        "primal": 1,
        "adjoint": 4,
    }


def test_k_above_max_basis_stays_standard_and_says_why():
    counter = Counter()
    loss = two_overlaps(sim(field_ref, counter))
    (site,) = dx.explain(dx.filter_value_and_grad(loss, max_basis=2), P0).sites
    assert site.schedule == "standard" and site.k == 4
    assert "it is a combination of k=4 fixed cotangents, more than max_basis=2" in site.reason
    assert run_and_compare(loss, two_overlaps(field_ref), P0, counter) == {
        "fwd": 1,
        "bwd": 1,
        "primal": 0,
        "adjoint": 0,
    }


def real_overlap(f):
    return lambda p: jnp.abs(jnp.sum(jnp.real(f(p)))) ** 2


def test_default_equal_costs_defer_one_cotangent_not_two():
    counter = Counter()
    f = sim(field_ref, counter)
    complex_overlap = dx.explain(overlap(f), P0).sites[0]
    assert complex_overlap.schedule == "standard" and complex_overlap.k == 2
    # the forward and two adjoints (3) against a forward and one adjoint (2) in a stage more
    assert complex_overlap.reason.endswith(
        "deferring its k=2 fixed cotangents is estimated slower: standard 2.02, deferred 3.01 (equal costs assumed)"
    )
    assert complex_overlap.estimates == dx.Estimates(standard=2.02, deferred=3.01, source="defaults")
    assert run_and_compare(overlap(f), overlap(field_ref), P0, counter, max_basis=None) == {
        "fwd": 1,
        "bwd": 1,
        "primal": 0,
        "adjoint": 0,
    }
    site = dx.explain(real_overlap(f), P0).sites[0]
    assert site.schedule == "deferred-basis" and site.k == 1
    assert run_and_compare(real_overlap(f), real_overlap(field_ref), P0, counter, max_basis=None) == {
        "fwd": 0,
        "bwd": 0,
        "primal": 1,
        "adjoint": 1,
    }


def test_per_function_max_basis_takes_precedence():
    counter = Counter()
    loss = two_overlaps(sim(field_ref, counter, max_basis=4))
    assert dx.explain(loss, P0).sites[0].schedule == "deferred-basis"
    assert run_and_compare(loss, two_overlaps(field_ref), P0, counter, max_basis=None) == {
        "fwd": 0,
        "bwd": 0,
        "primal": 1,
        "adjoint": 4,
    }
    scalar = sim(scalar_ref, counter, max_basis=0)
    log_of = lambda g: lambda p: jnp.log(g(p))  # noqa: E731
    site = dx.explain(log_of(scalar), P0).sites[0]
    assert site.schedule == "standard" and "more than max_basis=0" in site.reason
    assert run_and_compare(log_of(scalar), log_of(scalar_ref), P0, counter, max_basis=4) == {
        "fwd": 1,
        "bwd": 1,
        "primal": 0,
        "adjoint": 0,
    }


def ratio(f):
    def loss(p):
        e = f(p)
        return jnp.abs(jnp.vdot(M1, e)) ** 2 / jnp.abs(jnp.vdot(M2, e)) ** 2

    return loss


def test_ratio_of_two_powers():
    counter = Counter()
    loss = ratio(sim(field_ref, counter))
    assert dx.explain(dx.filter_value_and_grad(loss, max_basis=4), P0).sites[0].k == 4
    assert run_and_compare(loss, ratio(field_ref), P0, counter, max_basis=4) == {
        "fwd": 0,
        "bwd": 0,
        "primal": 1,
        "adjoint": 4,
    }


def test_power_of_whole_field_has_large_k():
    counter = Counter()
    f = sim(field_ref, counter)
    log_power = lambda g: lambda p: jnp.log(jnp.sum(jnp.abs(g(p)) ** 2))  # noqa: E731
    site = dx.explain(log_power(f), P0).sites[0]
    assert site.schedule == "standard" and site.k == 6
    assert run_and_compare(log_power(f), log_power(field_ref), P0, counter, max_basis=4) == {
        "fwd": 1,
        "bwd": 1,
        "primal": 0,
        "adjoint": 0,
    }


def test_mixed_with_deferred_and_standard_sites():
    c_lin, c_basis, c_std = Counter(), Counter(), Counter()
    lin = sim(jnp.cos, c_lin, name="lin")
    basis = sim(field_ref, c_basis, name="overlap")
    std = sim(jnp.sin, c_std, name="std")

    def program(lin, basis, std):
        return lambda p: (
            jnp.sum(lin(p) * jnp.arange(3.0)) + jnp.log(jnp.abs(jnp.vdot(M1, basis(p))) ** 2) + jnp.sum(std(p) ** 3)
        )

    loss = program(lin, basis, std)

    plan = dx.explain(dx.filter_value_and_grad(loss, max_basis=2), P0)
    assert [s.schedule for s in plan.sites] == ["deferred", "deferred-basis", "standard"]
    for c in (c_lin, c_basis, c_std):
        c.reset()
    got = dx.filter_value_and_grad(loss, max_basis=2)(P0)
    jax.effects_barrier()
    assert counts(c_lin) == {"fwd": 0, "bwd": 0, "primal": 1, "adjoint": 1}
    assert counts(c_basis) == {"fwd": 0, "bwd": 0, "primal": 1, "adjoint": 2}
    assert counts(c_std) == {"fwd": 1, "bwd": 1, "primal": 0, "adjoint": 0}
    assert_tree_allclose(got, jax.value_and_grad(program(jnp.cos, field_ref, jnp.sin))(P0))


def test_inside_vmap_and_jit():
    f = sim(field_ref, Counter())

    def program(g):
        return lambda p, m: jnp.abs(jnp.vdot(m, g(p))) ** 2 + jnp.sum(p**2)

    loss = program(f)
    ps = jnp.stack([P0, -P0, 2 * P0])
    ms = jnp.stack([M1, M2, M1 * 2])
    expected = jax.vmap(jax.value_and_grad(program(field_ref)))(ps, ms)
    assert_tree_allclose(jax.vmap(dx.filter_value_and_grad(loss))(ps, ms), expected)
    assert_tree_allclose(jax.jit(jax.vmap(dx.filter_value_and_grad(loss)))(ps, ms), expected)


def test_fused_batch_is_used():
    counter = Counter()

    def fused_batch(x, cts):
        counter.counts.update(["batch"])  # a host-level implementation, run eagerly
        y, vjp = jax.vjp(field_ref, x)
        return y, jax.vmap(lambda c: vjp(c)[0])(cts)

    f = dx.ExpensiveFn(fwd=field_ref, fused_batch=fused_batch, name="batched", max_basis=2)
    loss = overlap(f)
    assert dx.explain(loss, P0).sites[0].schedule == "deferred-basis"
    got = dx.filter_value_and_grad(loss)(P0)
    assert counter.counts["batch"] == 1
    assert_tree_allclose(got, jax.value_and_grad(overlap(field_ref))(P0))


def batched_site(counter, **kwargs):
    def fused_batch(x, cts):
        counter.counts.update(["batch"])
        y, vjp = jax.vjp(field_ref, x)
        return y, jax.vmap(lambda c: vjp(c)[0])(cts)

    def fused(x, ct):
        y, vjp = jax.vjp(field_ref, x)
        return y, vjp(ct)[0]

    implementations = {"fused_batch": fused_batch, "fused": fused}
    chosen = {k: implementations[k] for k in kwargs.pop("with_")}
    return dx.ExpensiveFn(fwd=field_ref, name="batched", **chosen, **kwargs)


def vmapped(f):
    """A loss with the site under `vmap` over two levels (3 x 2 examples), the overlap's
    mode batched over the inner level only."""
    modes = jnp.stack([M1, M2])
    return lambda ps: jnp.sum(
        jax.vmap(lambda p2: jax.vmap(lambda p, m: jnp.abs(jnp.vdot(m, f(p))) ** 2)(p2, modes))(ps)
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_fused_batch_under_vmap_is_deferred_basis(jit):
    """A site with `fused_batch` under two `vmap` levels: deferred-basis, each example on
    every basis cotangent, the gradient that of plain JAX."""
    counter = Counter()
    # (each job gets all 12 basis cotangents: `max_basis` caps that number)
    loss = vmapped(batched_site(counter, with_=("fused_batch",), max_basis=12))
    ps = jnp.stack([jnp.stack([P0, -P0]), jnp.stack([2 * P0, P0 + 0.1]), jnp.stack([P0 * P0, -0.5 * P0])])
    site = dx.explain(loss, ps).sites[0]
    assert (site.schedule, site.k, site.batch) == ("deferred-basis", 12, (3, 2))
    fn = eqx.filter_jit(dx.filter_value_and_grad(loss)) if jit else dx.filter_value_and_grad(loss)
    counter.reset()
    with dx.record() as timeline:
        got = fn(ps)
    assert_tree_allclose(got, jax.value_and_grad(vmapped(field_ref))(ps), rtol=1e-12, atol=1e-12)
    # one call of `fused_batch`, batched by `vmap` over the 6 examples (a JAX function)
    assert timeline.counts() == {"fused_batch": 1} and counter.counts["batch"] == 1


def test_fused_only_under_vmap_stays_standard():
    loss = vmapped(batched_site(Counter(), with_=("fused",), max_basis=12))
    ps = jnp.stack([jnp.stack([P0, -P0])] * 3)
    site = dx.explain(loss, ps).sites[0]
    assert site.schedule == "standard"
    assert site.reason.startswith("its cotangent depends on its own output")
    assert site.reason.endswith("; the basis schedule is used for a site under `vmap` only with a `fused_batch`")
    assert_tree_allclose(dx.filter_value_and_grad(loss)(ps), jax.value_and_grad(vmapped(field_ref))(ps))


def test_fuse_batched_runs_forward_once():
    """`dx.fuse` on the basis schedule: the forward runs once for all `k` adjoints (the
    adjoint once, batched), counted on the host; values against plain JAX."""
    counter = Counter()

    def forward(x):
        counter.tick("fwd")
        return field_ref(x)

    def adjoint(x, ct):
        counter.tick("adjoint")
        return jax.vjp(field_ref, x)[1](ct)[0]

    f = dx.ExpensiveFn(fwd=forward, bwd=lambda x, y, ct: adjoint(x, ct), fused=dx.fuse(forward, adjoint))
    loss = two_overlaps(f)
    assert dx.explain(dx.filter_value_and_grad(loss, max_basis=4), P0).sites[0].k == 4
    expected = jax.value_and_grad(two_overlaps(field_ref))(P0)
    for step in (
        dx.filter_value_and_grad(loss, max_basis=4),
        eqx.filter_jit(dx.filter_value_and_grad(loss, max_basis=4)),
    ):
        step(P0)
        jax.effects_barrier()
        counter.reset()
        assert_tree_allclose(step(P0), expected)
        jax.effects_barrier()
        assert counter.counts == {"fwd": 1, "adjoint": 1}


def test_error_fused_batch_wrong_shape():
    f = dx.ExpensiveFn(
        fwd=field_ref, fused_batch=lambda x, cts: (field_ref(x), jnp.zeros((1, 3))), name="bad", max_basis=2
    )
    loss = lambda p: jnp.abs(jnp.vdot(M1, f(p))) ** 2  # noqa: E731
    expected = (
        "`ExpensiveFn(name='bad')`: `fused_batch` returned a batch of cotangents that does not match the input `x` "
        "with a leading axis of one cotangent each.\nExpected float64[2, 3], found float64[1, 3]."
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        dx.filter_value_and_grad(loss)(P0)


SHARED = {
    # several sites' outputs meet in one linear combination before the nonlinearity: that
    # combination is on every site's frontier, and each must get its cotangent
    "square of a sum": (2, lambda ys: (jnp.sum(ys[0]) + jnp.sum(ys[1])) ** 2),
    "sum inside": (2, lambda ys: jnp.sum(ys[0] + ys[1]) ** 2),
    "sine of a difference": (2, lambda ys: jnp.sin(jnp.sum(ys[0]) - 3.0 * jnp.sum(ys[1]))),
    "three sites": (3, lambda ys: jnp.log1p((jnp.sum(ys[0]) + jnp.sum(ys[1]) - jnp.sum(ys[2])) ** 2)),
    "shared and own": (2, lambda ys: (lambda a: jnp.sin(a) * jnp.cos(a + jnp.sum(ys[1])))(jnp.sum(ys[0]))),
}


@pytest.mark.parametrize("case", list(SHARED))
def test_sites_that_share_a_frontier_variable(case):
    n, head = SHARED[case]
    counter = Counter()
    fs = [sim(jnp.sin, counter, name=f"sim{i}") for i in range(n)]
    loss = lambda x: head([f((i + 1) * x) for i, f in enumerate(fs)])  # noqa: E731
    reference = lambda x: head([jnp.sin((i + 1) * x) for i in range(n)])  # noqa: E731
    assert [s.schedule for s in dx.explain(loss, P0).sites] == ["deferred-basis"] * n
    for step in (dx.filter_value_and_grad(loss), eqx.filter_jit(dx.filter_value_and_grad(loss))):
        counter.reset()
        got = jax.block_until_ready(step(P0))
        jax.effects_barrier()
        assert counter.counts == {"primal": n, "adjoint": n}
        assert_tree_allclose(got, jax.value_and_grad(reference)(P0), rtol=1e-9, atol=1e-12)


def test_error_bad_max_basis():
    # (a value of another type is refused before this check when the tests run with the
    # jaxtyping hook on deferax, as pyproject.toml sets them up)
    for bad in (-1, True):
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"`deferax.filter_value_and_grad`: `max_basis` must be a non-negative int or None, but got {bad!r}."
            ),
        ):
            dx.filter_value_and_grad(lambda p: p.sum(), max_basis=bad)
    for bad in (-2, True):  # a function's None means "the transform's limit"
        expected = f"`ExpensiveFn(name='f')`: `max_basis` must be a non-negative int (or None: the limit of \
`filter_value_and_grad`), but got {bad!r}."
        with pytest.raises(ValueError, match=re.escape(expected)):
            dx.ExpensiveFn(fwd=jnp.sin, name="f", max_basis=bad)
    dx.ExpensiveFn(fwd=jnp.sin, name="f", max_basis=None)


# ----------------------------------------------------------------------------- property-based

PROJECTIONS = {
    "dot": lambda y: jnp.dot(jnp.array([0.5, -1.0, 2.0]), y),
    "slice": lambda y: y[1],
    "sum": lambda y: jnp.sum(y),
    "weighted_slice": lambda y: 3.0 * y[0] - y[2],
    "fft0_real": lambda y: jnp.real(jnp.fft.fft(y)[1]),
}
AFTER = {
    "log": lambda z: jnp.log(z**2 + 1.0),
    "square": lambda z: z**2,
    "sin": lambda z: jnp.sin(z),
    "product": lambda z: z * jnp.tanh(z),
    "exp": lambda z: jnp.exp(0.3 * z),
}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    projections=st.lists(st.sampled_from(sorted(PROJECTIONS)), min_size=1, max_size=3, unique=True),
    after=st.lists(st.sampled_from(sorted(AFTER)), min_size=1, max_size=3),
    couple=st.booleans(),
    # every function of the program is smooth: any bounded input will do
    p=st.lists(st.floats(-2.0, 2.0, allow_nan=False, allow_infinity=False), min_size=3, max_size=3).map(
        lambda v: jnp.array(v, dtype=jnp.float64)
    ),
)
def test_random_projection_then_nonlinear(projections, after, couple, p):
    counter = Counter()
    ref = lambda x: jnp.sin(x) * jnp.exp(0.2 * x)  # noqa: E731
    f = sim(ref, counter)

    def program(g):
        return lambda p: downstream(g(p), p)

    def downstream(y, p):
        zs = [PROJECTIONS[name](y) for name in projections]
        total = 0.0
        for z in zs:
            for name in after:
                z = AFTER[name](z)
            total = total + z
        if couple and len(zs) > 1:
            total = total + zs[0] * zs[1]  # nonlinear coupling of two projections
        return total + jnp.sum(p**2)

    loss = program(f)
    site = dx.explain(dx.filter_value_and_grad(loss, max_basis=3), p).sites[0]
    assert site.schedule == "deferred-basis"
    assert site.k == len(projections)
    assert run_and_compare(loss, program(ref), p, counter, max_basis=3) == {
        "fwd": 0,
        "bwd": 0,
        "primal": 1,
        "adjoint": len(projections),
    }


def test_weak_typed_scalar_input():
    f = dx.ExpensiveFn(fwd=jnp.sin, fused=lambda x, ct: (jnp.sin(x), ct * jnp.cos(x)), name="sin")
    program = lambda g: lambda x: jnp.log(g(x) + 2.0)  # noqa: E731
    loss = program(f)
    x = jnp.asarray(1.0)  # weak-typed
    expected = jax.value_and_grad(program(jnp.sin))(x)
    assert_tree_allclose(dx.filter_value_and_grad(loss)(x), expected)
    assert_tree_allclose(eqx.filter_jit(dx.filter_value_and_grad(loss))(x), expected)


def test_callback_fused_without_fused_batch_warns_and_is_correct():
    import numpy as np

    calls = []

    def host_fused(x, ct):
        calls.append(1)
        y, vjp = jax.vjp(field_ref, jnp.asarray(x))
        return np.asarray(y), np.asarray(vjp(jnp.asarray(ct))[0])

    def fused(x, ct):
        out = (jax.ShapeDtypeStruct((3,), jnp.complex128), jax.ShapeDtypeStruct((3,), jnp.float64))
        return jax.pure_callback(host_fused, out, x, ct, vmap_method="sequential")

    f = dx.ExpensiveFn(fwd=field_ref, fused=fused, name="host", max_basis=2)
    loss = overlap(f)
    with pytest.warns(
        UserWarning,
        match=re.escape(
            "`ExpensiveFn(name='host')`: `fused` could not be batched over the cotangent with the primal computed once"
        ),
    ):
        got = dx.filter_value_and_grad(loss)(P0)
    assert len(calls) == 2  # k = 2 runs, each with its own primal; no wasted trial run
    assert_tree_allclose(got, jax.value_and_grad(overlap(field_ref))(P0))


# ----------------------------------------------------------------------------- exact coefficients (no projection)

X4 = jnp.array([0.3, -0.2, 0.8, 0.1])
W4 = jnp.array([1.0, -2.0, 0.5, 3.0])


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_infinite_slope_gives_inf_where_plain_jax_does(dtype):
    """`sqrt(y[0] - c)` at its singular point next to a finite `y[1]**2`: the coefficients are
    the frontier's own cotangents, so the gradient has `inf` in one entry and finite values
    elsewhere, as plain JAX gives (a projection turned every entry into NaN)."""
    scalar_ref = lambda x: jnp.sin(x) * jnp.exp(0.3 * x)  # noqa: E731
    f = make(scalar_ref, ("fwd", "bwd", "fused"), max_basis=2)
    x = X4.astype(dtype)
    c = scalar_ref(x)[0]

    def loss(g):
        return lambda p: (lambda y: jnp.sqrt(y[0] - c) + y[1] ** 2)(g(p))

    assert dx.explain(loss(f), x).sites[0].schedule == "deferred-basis"
    for jit in (False, True):
        # under jit XLA may round `y[0] - c` below zero, for plain JAX as for deferax: the
        # NaN/inf pattern is compared with plain JAX under jit
        wrap = eqx.filter_jit if jit else (lambda g: g)
        got = wrap(dx.filter_value_and_grad(loss(f)))(x)
        expected = wrap(jax.value_and_grad(loss(scalar_ref)))(x)
        np.testing.assert_array_equal(np.isinf(got[1]), np.isinf(expected[1]))
        np.testing.assert_array_equal(np.isnan(got[1]), np.isnan(expected[1]))
        np.testing.assert_array_equal(np.isnan(got[0]), np.isnan(expected[0]))
        finite = np.isfinite(expected[1])
        np.testing.assert_allclose(np.asarray(got[1])[finite], np.asarray(expected[1])[finite], rtol=1e-5)
    got = dx.filter_value_and_grad(loss(f))(x)
    assert int(np.isinf(got[1]).sum()) == 1 and int(np.isnan(got[1]).sum()) == 0


@pytest.mark.parametrize("dtype, eps, atol", [(jnp.float64, 1e-10, 1e-14), (jnp.float32, 1e-4, 2e-6)])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nearly_parallel_monitors(dtype, eps, atol, jit):
    """`dot(w, y) / dot(w + eps v, y)`: two nearly parallel basis cotangents. No projection,
    no residual check (it used to raise "left the span"): the gradient matches plain JAX up
    to the cancellation of two O(1) terms (`atol`), the problem's own conditioning."""
    scalar_ref = lambda x: jnp.sin(x) * jnp.exp(0.3 * x)  # noqa: E731
    f = make(scalar_ref, ("fwd", "bwd", "fused"), max_basis=2)
    v = jnp.array([0.3, 0.1, -1.0, 2.0])

    def loss(g):
        return lambda p: (lambda y: jnp.dot(W4.astype(dtype), y) / jnp.dot((W4 + eps * v).astype(dtype), y))(g(p))

    x = X4.astype(dtype)
    assert dx.explain(loss(f), x).sites[0].schedule == "deferred-basis"
    step = dx.filter_value_and_grad(loss(f))
    step = eqx.filter_jit(step) if jit else step
    got = step(x)
    expected = jax.value_and_grad(loss(scalar_ref))(x)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], expected[1], rtol=0, atol=atol)


def test_integer_leaves_in_input_and_output():
    """A solver taking `{"p": p, "n": 3}` and returning `{"u": field, "iters": 7}`, on the
    deferred and the deferred-basis schedules."""

    def solver(x):
        return {"u": jnp.sin(x["p"]) * x["n"].astype(jnp.float64), "iters": jnp.array(7)}

    def fused(x, ct):
        y, vjp = jax.vjp(lambda p: solver({"p": p, "n": x["n"]}), x["p"])
        return y, {"p": vjp(ct)[0], "n": np.zeros((), jax.dtypes.float0)}

    f = dx.ExpensiveFn(fwd=solver, fused=fused, name="int_leaves", max_basis=2)
    x = {"p": jnp.array([0.3, -0.2, 0.8]), "n": jnp.array(3)}
    w = jnp.array([1.0, 2.0, -1.0])
    programs = {
        "deferred": lambda g: lambda x: (lambda y: jnp.dot(w, y["u"]) + 0.0 * y["iters"].astype(jnp.float64))(g(x)),
        "deferred-basis": lambda g: lambda x: (lambda y: jnp.log(1 + jnp.dot(w, y["u"]) ** 2))(g(x)),
    }
    for schedule, program in programs.items():
        assert dx.explain(program(f), x).sites[0].schedule == schedule
        for jit in (False, True):
            step = dx.filter_value_and_grad(program(f))
            got = (eqx.filter_jit(step) if jit else step)(x)
            expected = eqx.filter_value_and_grad(program(solver))(x)
            assert got[1]["n"] is None
            assert_tree_allclose(got, expected)


# ----------------------------------------------------------------------------- k counts independent numbers


def grid_ref(x):
    """(3,) -> (2, 2): four numbers."""
    return jnp.reshape(jnp.concatenate([jnp.sin(x), jnp.cos(x[:1])]), (2, 2))


SAME_VIEW = {
    # the same view of the output computed twice is one frontier variable
    "argmax of the flattened output": (4, lambda y: jnp.ravel(y)[jnp.argmax(jnp.ravel(y))]),
    "the same slice twice": (2, lambda y: jnp.sum(jnp.ravel(y)[1:3]) * jnp.prod(jnp.ravel(y)[1:3])),
    # overlapping views hold more numbers than the output: the output itself is the frontier
    "two overlapping slices": (4, lambda y: jnp.sum(jnp.ravel(y)[:3] ** 2) + jnp.sum(jnp.ravel(y)[1:] ** 3)),
}


@pytest.mark.parametrize("case", list(SAME_VIEW))
def test_k_counts_independent_numbers_at_most_the_output_size(case):
    k, head = SAME_VIEW[case]
    counter = Counter()
    loss = lambda p: head(sim(grid_ref, counter)(p))  # noqa: E731
    (site,) = dx.explain(dx.filter_value_and_grad(loss, max_basis=4), P0).sites
    assert site.schedule == "deferred-basis" and site.k == k, (site.schedule, site.k, site.reason)
    for jit in (False, True):
        seen = run_and_compare(loss, lambda p: head(grid_ref(p)), P0, counter, max_basis=4, jit=jit)
        assert seen == {"fwd": 0, "bwd": 0, "primal": 1, "adjoint": k}
    # with a limit below k it stays standard and says k
    (site,) = dx.explain(dx.filter_value_and_grad(loss, max_basis=k - 1), P0).sites
    assert site.schedule == "standard" and site.reason.endswith(
        f"it is a combination of k={k} fixed cotangents, more than max_basis={k - 1}"
    )
