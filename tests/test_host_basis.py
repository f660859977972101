"""`dx.host` sites on the deferred-basis schedule: a user's `fused_batch` is the one job that
runs (and the one `explain` estimates) even beside `fwd`, `adjoint` and `fused`; a typed
PRNG key in the input works there as on the other schedules."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx
from deferax._plan import _cost

from .helpers import assert_tree_allclose
from .test_host import A0, FIELD, M1, SOURCE, X0, Runs, reference, run

M2 = jnp.array([0.5 + 0.0j, -1.0j, 1.0 + 0.5j])


def one_overlap(f):  # k = 2: the real and imaginary parts of one complex overlap
    return lambda x: jnp.abs(jnp.vdot(M1, f(x))) ** 2


def two_overlaps(f):  # k = 4: two complex overlaps, through a nonlinear sum
    def loss(x):
        y = f(x)
        return jnp.log(jnp.abs(jnp.vdot(M1, y)) ** 2 + jnp.abs(jnp.vdot(M2, y)) ** 2)

    return loss


def every_implementation(runs, **kwargs):
    """A host site with `fwd`, `adjoint` (and `combine`), `fused` and `fused_batch`, each
    counted: E(x) = (A0 + diag(x))^-1 s, as `test_host.solver`."""

    def fwd(x):
        runs.tick("fwd", x)
        return np.linalg.solve(A0 + np.diag(x), SOURCE)

    def adjoint(x, ct):
        runs.tick("adjoint", ct)
        return np.linalg.solve((A0 + np.diag(x)).T, ct)

    def fused(x, ct):
        runs.tick("fused", ct)
        a = A0 + np.diag(x)
        e = np.linalg.solve(a, SOURCE)
        return e, -np.real(e * np.linalg.solve(a.T, ct))

    def fused_batch(x, cts):  # one factorisation: the forward and all k adjoint right-hand sides
        runs.tick("fused_batch", cts)
        a = A0 + np.diag(x)
        e = np.linalg.solve(a, SOURCE)
        return e, -np.real(e * np.linalg.solve(a.T, cts.T).T)

    return dx.host(
        fwd,
        adjoint=adjoint,
        combine=lambda x, e, lam: -jnp.real(e * lam),
        fused=fused,
        fused_batch=fused_batch,
        out=FIELD,
        adjoint_out=FIELD,
        name="every",
        **kwargs,
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("make_loss, k", [(one_overlap, 2), (two_overlaps, 4)], ids=["k=2", "k=4"])
def test_a_users_fused_batch_is_the_one_job_beside_fwd_and_adjoint(make_loss, k, jit):
    """With `cost=dx.Cost(setup=10, fwd=1, bwd=1)` (seconds), `_schedules._deferred.estimate`'s formulas give
        standard       = (setup + fwd) + setup + bwd + 2 * stage = 11 + 11 + 0.002 = 22.002
        deferred-basis = one job: setup + fwd + k * bwd + stage  = 11 + k + 0.001
    (13.001 for k = 2, 15.001 for k = 4; `stage` is 1 ms once numbers are given). So the
    site is deferred on its basis, and `fused_batch` must be what runs: once per gradient,
    with all `k` cotangents, and no `fwd`, `adjoint` or `fused` job (before, the forward
    and `k` adjoints ran as `k + 1` jobs, `k + 1` factorisations, against the estimate's
    one)."""
    runs = Runs()
    f = every_implementation(runs, cost=dx.Cost(setup=10.0, fwd=1.0, bwd=1.0))
    loss = make_loss(f)
    site = dx.explain(loss, X0).sites[0]
    assert (site.schedule, site.k) == ("deferred-basis", k)
    assert site.estimates == dx.Estimates(standard=22.002, deferred=11.0 + k + 0.001, source="hint")
    assert site.estimates.deferred == pytest.approx(10.0 + 1.0 + k * 1.0 + _cost.STAGE_SECONDS)
    if jit:
        run(loss, X0, jit=True)  # compile
    runs.counts.clear()
    runs.shapes.clear()
    with dx.record() as timeline:
        got = run(loss, X0, jit=jit)
    assert_tree_allclose(got, eqx.filter_value_and_grad(make_loss(reference))(X0), rtol=1e-12, atol=1e-12)
    assert runs.as_dict("fwd", "adjoint", "fused", "fused_batch") == {
        "fwd": 0,
        "adjoint": 0,
        "fused": 0,
        "fused_batch": 1,
    }
    assert runs.shapes["fused_batch"] == [(k, 3)]
    assert timeline.counts() == {"fused_batch": 1}


# ----------------------------------------------------------------------------- a typed PRNG key in the input

W1 = jnp.array([1.0, -2.0, 0.5])
W2 = jnp.array([0.3, 0.7, -1.1])


def keyed_site(runs, impls):
    """y = 2 p + (sum of the key's data mod 7): the key reaches the host as `uint32[2]`.
    `impls`: `fwd` and `adjoint`; with a `combine` (a JAX function, which gets the key's
    data as the adjoint's result); or with `fused` and `fused_batch` too."""

    def fwd(x):
        p, data = x
        runs.tick("fwd", data)
        return 2.0 * p + float(data.sum() % 7)

    def adjoint(x, ct):
        runs.tick("adjoint", x[1])
        return 2.0 * ct, np.zeros_like(x[1])

    def fused(x, ct):
        runs.tick("fused", x[1])
        return fwd(x), adjoint(x, ct)

    def fused_batch(x, cts):
        p, data = x
        runs.tick("fused_batch", data)
        return 2.0 * p + float(data.sum() % 7), (2.0 * cts, np.zeros((len(cts), *data.shape), data.dtype))

    extra = {
        "fwd+adjoint": {},
        "combine": {"combine": lambda x, y, partial: (partial[0] * jnp.ones_like(y), partial[1])},
        "fused_batch": {"fused": fused, "fused_batch": fused_batch},
    }[impls]
    return dx.host(fwd, adjoint=adjoint, out=jax.ShapeDtypeStruct((3,), jnp.float64), name="keyed", **extra)


def keyed_reference(p, key):
    return 2.0 * p + (jnp.sum(jax.random.key_data(key)) % 7).astype(p.dtype)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("impls", ["fwd+adjoint", "combine", "fused_batch"])
@pytest.mark.parametrize("schedule", ["auto", "standard"])
@pytest.mark.parametrize("k", [1, 2])
def test_a_typed_key_in_the_input_on_the_basis_schedule(k, schedule, impls, jit):
    """A typed PRNG key (`jax.random.key`, dtype key<fry>) in a host site's input, on the
    deferred-basis schedule (k = 1 and k = 2) and, for comparison, the standard one:
    value and gradient against plain JAX, eagerly and under `jit`. The host functions get
    the key's raw data, `uint32[2]`; the key's cotangent is JAX's float0 zero."""
    runs = Runs()
    f = keyed_site(runs, impls)
    if k == 1:
        loss = lambda p, key: jnp.sum(W1 * f((p, key))) ** 2 + jnp.sum(p**2)  # noqa: E731
        ref = lambda p, key: jnp.sum(W1 * keyed_reference(p, key)) ** 2 + jnp.sum(p**2)  # noqa: E731
    else:

        def loss(p, key):
            y = f((p, key))
            return jnp.log(jnp.sum(W1 * y) ** 2 + jnp.sum(W2 * y) ** 2)

        def ref(p, key):
            y = keyed_reference(p, key)
            return jnp.log(jnp.sum(W1 * y) ** 2 + jnp.sum(W2 * y) ** 2)

    key = jax.random.key(3)
    fn = dx.filter_value_and_grad(loss, schedule=schedule, max_basis=2)
    site = dx.explain(fn, X0, key).sites[0]
    assert (site.schedule, site.k) == (("deferred-basis", k) if schedule == "auto" else ("standard", None))
    if jit:
        fn = eqx.filter_jit(fn)
    runs.shapes.clear()
    got = fn(X0, key)
    assert_tree_allclose(got, eqx.filter_value_and_grad(ref)(X0, key), rtol=1e-12, atol=1e-12)
    assert {shape for shapes in runs.shapes.values() for shape in shapes} == {(2,)}  # the key's data
    if schedule == "auto":
        assert set(runs.shapes) == ({"fused_batch"} if impls == "fused_batch" else {"fwd", "adjoint"})


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_fused_once_per_cotangent_is_what_the_estimate_describes(jit):
    """A site with `fwd`, `bwd` and `fused` (no `adjoint`, no `fused_batch`) runs `fused`
    once per cotangent on the deferred-basis schedule: `k` jobs, each a set-up, a forward
    and an adjoint. With `Cost(setup=10, fwd=1, bwd=1)`, k = 2 (one complex overlap) on
    2 workers (the suite's two cores):
        standard       = (setup + fwd) + setup + bwd + 2 * stage = 22.002
        deferred-basis = max(longest job, all jobs / workers) + stage
                       = max(12, 24 / 2) + 0.001 = 12.001
    (before, the estimate counted a forward job and 2 adjoint jobs: max(11, 33 / 2) + 0.001 = 16.501)."""
    runs = Runs()

    def fwd(x):
        runs.tick("fwd", x)
        return np.linalg.solve(A0 + np.diag(x), SOURCE)

    def bwd(x, e, ct):
        runs.tick("bwd", ct)
        return -np.real(e * np.linalg.solve((A0 + np.diag(x)).T, ct))

    def fused(x, ct):
        runs.tick("fused", ct)
        e = np.linalg.solve(A0 + np.diag(x), SOURCE)
        return e, -np.real(e * np.linalg.solve((A0 + np.diag(x)).T, ct))

    f = dx.host(fwd, bwd=bwd, fused=fused, out=FIELD, name="fwd-bwd-fused", cost=dx.Cost(setup=10.0, fwd=1.0, bwd=1.0))
    loss = one_overlap(f)
    site = dx.explain(loss, X0).sites[0]
    assert (site.schedule, site.k) == ("deferred-basis", 2)
    assert site.estimates.standard == pytest.approx(22.0 + 2 * _cost.STAGE_SECONDS)
    assert site.estimates.deferred == pytest.approx(12.0 + _cost.STAGE_SECONDS)
    if jit:
        run(loss, X0, jit=True)
    runs.counts.clear()
    got = run(loss, X0, jit=jit)
    assert_tree_allclose(got, eqx.filter_value_and_grad(one_overlap(reference))(X0), rtol=1e-12, atol=1e-12)
    assert runs.as_dict("fwd", "bwd", "fused") == {"fwd": 0, "bwd": 0, "fused": 2}
