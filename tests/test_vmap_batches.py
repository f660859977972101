"""Sites under `jax.vmap` of the whole step run their batch at once: host sites submit it in
one go (or one call for a vectorized host function), a `dx.fuse` runs and compiles once."""

import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import deferax as dx

from .helpers import P0, W, assert_tree_allclose

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
    assert_tree_allclose(
        got, eqx.filter_value_and_grad(lambda p: jnp.sum(W * 2.0 * jnp.stack([p, 2 * p, 3 * p, p - 1])))(P0)
    )


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


# ----------------------------------------------------------------------------- a basis site under two vmaps


def test_basis_site_under_vmap_inside_a_vmap_of_the_whole_step():
    """A `dx.sparse_solve` vmapped over 3 wavelengths inside the loss (deferred-basis), the
    step vmapped over 2 designs: 6 systems, each factored once in its own `fused_batch`
    job with b and one adjoint solved, the gradient that of a vmapped dense solve."""

    from .test_sparse_solve import COMPLEX, Tally, dense, sparse, wavelengths

    values, pattern, b = COMPLEX
    vs = jnp.stack([values, 1.1 * values, values + 0.5])
    designs = jnp.stack([vs, 0.9 * vs])
    tally = Tally()
    loss = wavelengths(sparse(pattern, tally), b)
    expected = jax.vmap(jax.value_and_grad(wavelengths(dense(pattern), b)))(designs)
    for step in (jax.vmap(dx.filter_value_and_grad(loss)), jax.jit(jax.vmap(dx.filter_value_and_grad(loss)))):
        step(designs)
        tally.clear()
        with dx.record() as timeline:
            got = jax.block_until_ready(step(designs))
        assert_tree_allclose(got, expected, rtol=1e-10, atol=1e-12)
        assert timeline.counts() == {"fused_batch": 6}
        assert tally.counts == {"factor": 6, "solve": 12, "rhs": 12}
