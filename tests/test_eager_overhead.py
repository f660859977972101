"""What an eager call does again on a cache hit (counted: one trace of the loss, one cache
key, one trace of a `fwd` + `bwd` site's `bwd` for the check that it does not read `y`, on
the adjoint's thread once a call has read it; no analysis, no compilation), that a changed
program misses the cache, that a `bwd` that starts reading `y` runs after the forward, and
that the cache key tells apart what a cheaper key could take for equal. Gradients against
plain JAX."""

import collections
import dataclasses
import functools as ft
import threading
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deferax as dx
from deferax import _jaxpr
from deferax._jaxpr import _keys
from deferax._site import _spec
from deferax._stages import _run

from .helpers import P0, W, assert_tree_allclose


@pytest.fixture
def spied(monkeypatch):
    """Counts of the analysis, the cache keys and the compiled stages made by eager calls."""
    counts: collections.Counter = collections.Counter()
    analyse, key, compiled = _run.analyse, _jaxpr.structural_key, _run.Compiled

    def counted_analyse(*args, **kwargs):
        counts["analyse"] += 1
        return analyse(*args, **kwargs)

    def counted_key(program):
        counts["key"] += 1
        return key(program)

    class CountedCompiled(compiled):
        def __init__(self, *args, **kwargs):
            counts["compiled"] += 1
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(_run, "analyse", counted_analyse)
    monkeypatch.setattr(_jaxpr, "structural_key", counted_key)
    monkeypatch.setattr(_run, "Compiled", CountedCompiled)
    return counts


def _site(runs: collections.Counter, scale=1.0, reads_y: bool = False):
    """`sin` with `fwd` and `bwd` only, counting in Python how often each body runs (a trace,
    or an eager run op by op)."""

    def fwd(x):
        runs["fwd"] += 1
        return scale * jnp.sin(x)

    def bwd(x, y, ct):
        runs["bwd"] += 1
        return ct * (jnp.sqrt(scale**2 - y**2) if reads_y else scale * jnp.cos(x))

    return dx.ExpensiveFn(fwd=fwd, bwd=bwd, name="sin")


def _plain(scale=1.0):
    return lambda p: jnp.sum(W * scale * jnp.sin(p)) + jnp.sum(p**2)


def test_a_cache_hit_traces_once_and_analyses_nothing(spied):
    """Over N eager calls of a loss with a `fwd` + `bwd` site (deferred, with a `fused` made
    from them): the first analyses and compiles; every later one traces the loss once,
    computes one key, traces `bwd` once for the check (and runs it once), runs `fwd` once."""
    runs: collections.Counter = collections.Counter()
    f = _site(runs)

    def loss(p):
        runs["loss"] += 1
        return jnp.sum(W * f(p)) + jnp.sum(p**2)

    step = dx.filter_value_and_grad(loss)
    assert dx.explain(step, P0).sites[0].schedule == "deferred"
    spied.clear()
    expected = jax.value_and_grad(_plain())(P0)
    assert_tree_allclose(step(P0), expected)
    assert (spied["analyse"], spied["compiled"]) == (1, 1)
    n = 4
    runs.clear()
    spied.clear()
    for _ in range(n):
        assert_tree_allclose(step(P0), expected)
    jax.effects_barrier()
    assert dict(spied) == {"key": n}
    assert dict(runs) == {"loss": n, "bwd": 2 * n, "fwd": n}


def test_a_replaced_bwd_misses_the_cache(spied):
    """The site in a global dict is replaced by one whose `bwd` reads `y`: the program
    changed (standard now), and replaced back, the first plan is found again."""
    runs: collections.Counter = collections.Counter()
    sites = {"sin": _site(runs)}
    step = dx.filter_value_and_grad(lambda p: jnp.sum(W * sites["sin"](p)) + jnp.sum(p**2))
    expected = jax.value_and_grad(_plain())(P0)
    first = sites["sin"]
    for f, schedule, analysed in (
        (first, "deferred", 1),
        (_site(runs, reads_y=True), "standard", 1),
        (first, "deferred", 0),
    ):
        sites["sin"] = f
        spied.clear()
        assert_tree_allclose(step(P0), expected)
        assert spied["analyse"] == analysed
        assert dx.explain(step, P0).sites[0].schedule == schedule


@pytest.mark.parametrize("how", ["numpy changed in place", "closure rebound"])
def test_a_closure_whose_captured_array_changes(how, spied):
    """`fwd` and `bwd` close over an array that changes between eager calls: each call
    uses the new values (the same program: the cache is hit; the values reach it afresh)."""
    scale_np = np.array([1.0, 2.0, 3.0, 4.0])
    box = {"scale": jnp.asarray(scale_np)}

    def current():
        return jnp.asarray(scale_np) if how == "numpy changed in place" else box["scale"]

    f = dx.ExpensiveFn(
        fwd=lambda x: current() * jnp.sin(x), bwd=lambda x, y, ct: ct * current() * jnp.cos(x), name="scaled"
    )
    step = dx.filter_value_and_grad(lambda p: jnp.sum(W * f(p)) + jnp.sum(p**2))
    for new in ([1.0, 2.0, 3.0, 4.0], [-0.5, 4.0, 0.25, 1.5]):
        if how == "numpy changed in place":
            scale_np[:] = new
        else:
            box["scale"] = jnp.asarray(new)
        expected = jax.value_and_grad(_plain(jnp.asarray(new)))(P0)
        assert_tree_allclose(step(P0), expected)
    assert dx.explain(step, P0).sites[0].schedule == "deferred"


# ----------------------------------------------------------------------------- a `bwd` read beside the forward


@pytest.fixture
def checked(monkeypatch):
    """The threads on which each eager call read a `bwd` (`Spec.why_bwd_blocks_fused`), and
    those of the up-front reads (`bwd_decisions`, on the caller's thread)."""
    seen: dict[str, list] = {"check": [], "up front": []}
    why, decisions = _spec.Spec.why_bwd_blocks_fused, _run.bwd_decisions

    def counted_why(self, fn_avals):
        seen["check"].append(threading.get_ident())
        return why(self, fn_avals)

    def counted_decisions(program):
        seen["up front"].append(threading.get_ident())
        return decisions(program)

    monkeypatch.setattr(_spec.Spec, "why_bwd_blocks_fused", counted_why)
    monkeypatch.setattr(_run, "bwd_decisions", counted_decisions)
    return seen


def test_after_a_call_that_read_the_bwd_it_is_read_beside_the_forward(checked):
    """The first eager call reads the `bwd` before the halves (on the caller's thread); once a
    call has read that it does not read `y`, the later calls read it on the adjoint's thread,
    beside the forward, once a call: nothing is traced between the loss and the halves.
    Plain JAX's values, `fwd` and `bwd` once a call."""
    runs: collections.Counter = collections.Counter()
    f = _site(runs)
    step = dx.filter_value_and_grad(lambda p: jnp.sum(W * f(p)) + jnp.sum(p**2))
    expected = jax.value_and_grad(_plain())(P0)
    me = threading.get_ident()
    for call in range(4):
        checked["check"].clear()
        checked["up front"].clear()
        with dx.record() as timeline:
            assert_tree_allclose(step(P0), expected)
        assert timeline.counts() == {"fwd": 1, "bwd": 1}
        assert len(checked["check"]) == 1
        if call == 0:
            assert checked["up front"] == [me] and checked["check"] == [me]
        else:
            assert checked["up front"] == [] and checked["check"][0] != me
        # (the two halves at once: the adjoint's thread is not the forward's)
        fwd, bwd = (next(c for c in timeline.calls if c.impl == impl) for impl in ("fwd", "bwd"))
        assert fwd.thread != bwd.thread


READS = {"y": False, "numpy": False}


def _branching(runs: collections.Counter) -> dx.ExpensiveFn:
    """`exp`, whose `bwd` reads `y` (or NumPy's copy of `ct`, which cannot be traced) when a
    global says so."""

    def fwd(x):
        runs["fwd"] += 1
        return jnp.exp(x)

    def bwd(x, y, ct):
        runs["bwd"] += 1
        if READS["numpy"]:
            ct = jnp.asarray(np.asarray(ct))
        return ct * (y if READS["y"] else jnp.exp(x))

    return dx.ExpensiveFn(fwd=fwd, bwd=bwd, name="exp")


@pytest.mark.parametrize("how", ["y", "numpy"])
def test_a_bwd_that_reads_y_on_a_later_call_runs_after_the_forward(how, checked):
    """A `bwd` read as not reading `y` on one call that reads it on the next (a global it
    branches on rebound; or NumPy on its arguments, which cannot be traced): that call, whose
    plan was taken without reading it, runs it after the forward, on the forward's `y`
    (recorded after it ended); the next call reads it before the halves and runs the
    standard schedule, as `explain` says; once it stops reading `y`, the deferred schedule
    is back. Plain JAX's values at every call, `fwd` and `bwd` once a call."""
    runs: collections.Counter = collections.Counter()
    f = _branching(runs)
    loss = lambda p: jnp.sum(W * f(p)) + jnp.sum(p**2)  # noqa: E731
    step = dx.filter_value_and_grad(loss)
    expected = jax.value_and_grad(lambda p: jnp.sum(W * jnp.exp(p)) + jnp.sum(p**2))(P0)
    me = threading.get_ident()
    try:
        # (reads y, read up front on the caller's thread, the halves at once)
        for reads, up_front, together in (
            (False, True, True),
            (False, False, True),
            (True, False, False),  # the plan of the call before; its half finds that it reads y
            (True, True, False),  # read up front: the standard schedule
            (False, True, True),  # read up front (the last call's read did not allow it): deferred again
            (False, False, True),
        ):
            READS[how] = reads
            checked["up front"].clear()
            with dx.record() as timeline:
                assert_tree_allclose(step(P0), expected)
            assert checked["up front"] == ([me] if up_front else [])
            # (`explain` reads the `bwd` afresh: after the step, not to read it for the step)
            assert dx.explain(loss, P0).sites[0].schedule == ("standard" if reads else "deferred")
            assert timeline.counts() == {"fwd": 1, "bwd": 1}
            fwd, bwd = (next(c for c in timeline.calls if c.impl == impl) for impl in ("fwd", "bwd"))
            assert fwd.start is not None and fwd.end is not None and bwd.start is not None
            if together:
                assert fwd.thread != bwd.thread and bwd.schedule == "deferred"
            else:
                assert bwd.start >= fwd.end
    finally:
        READS.update(y=False, numpy=False)


def test_a_bwd_that_reads_y_later_under_vmap_and_in_a_basis(checked):
    """The same flip for a site under `vmap` inside the loss and for a deferred-basis site
    (a scalar of the output): there the unread `bwd` is read before both halves, and one
    that reads `y` runs after the forward. Plain JAX's values at every call."""
    runs: collections.Counter = collections.Counter()
    f = _branching(runs)
    losses = {
        "deferred": (
            lambda p: jnp.sum(W * jax.vmap(f)(jnp.stack([p, 2 * p]))[1]) + jnp.sum(p**2),
            lambda p: jnp.sum(W * jnp.exp(2 * p)) + jnp.sum(p**2),
        ),
        "deferred-basis": (
            lambda p: jnp.log(1.0 + jnp.dot(W, f(p)) ** 2),
            lambda p: jnp.log(1.0 + jnp.dot(W, jnp.exp(p)) ** 2),
        ),
    }
    me = threading.get_ident()
    try:
        for schedule, (loss, plain) in losses.items():
            step = dx.filter_value_and_grad(loss)
            expected = jax.value_and_grad(plain)(P0)
            for reads, up_front in ((False, True), (False, False), (True, False), (True, True), (False, True)):
                READS["y"] = reads
                checked["up front"].clear()
                checked["check"].clear()
                assert_tree_allclose(step(P0), expected)
                assert checked["up front"] == ([me] if up_front else [])
                assert checked["check"] == [me]  # (up front, or here before both halves)
                assert dx.explain(loss, P0).sites[0].schedule == ("standard" if reads else schedule)
    finally:
        READS.update(y=False, numpy=False)


# ----------------------------------------------------------------------------- the key tells apart


def _key(fun, *args):
    return _keys.structural_key(jax.make_jaxpr(fun)(*args))


def test_key_equal_for_the_same_program_traced_twice():
    def fun(x):
        return jnp.sum(jnp.tanh(x) * 2.0) + jax.lax.integer_pow(x, 3)[0]

    assert _key(fun, P0) is not None
    assert _key(fun, P0) == _key(fun, P0)


@pytest.mark.parametrize(
    "first, second",
    [
        (lambda x: x * 0.0, lambda x: x * -0.0),  # a literal by its bits
        (lambda x: jax.lax.integer_pow(x, 2), lambda x: jax.lax.integer_pow(x, 3)),  # an int parameter
        (lambda x: jnp.sum(x, axis=0), lambda x: jnp.max(x, axis=0)),  # the operation
    ],
)
def test_key_tells_programs_apart(first, second):
    assert _key(first, P0) != _key(second, P0)


@pytest.mark.parametrize(
    "first, second",
    [
        (jnp.zeros(3, jnp.float32), jnp.zeros(3, jnp.float64)),
        (jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.float32)),
        (jnp.zeros(3), jnp.zeros(4)),
        (jax.ShapeDtypeStruct((), jnp.float64, weak_type=True), jax.ShapeDtypeStruct((), jnp.float64)),
    ],
)
def test_key_tells_inputs_apart(first, second):
    def fun(x):
        return x + 1

    assert _key(fun, first) != _key(fun, second)


@dataclasses.dataclass(frozen=True)
class _Setting:
    value: Any


class _ModuleSetting(eqx.Module):
    value: Any


@pytest.mark.parametrize("kind", [_Setting, _ModuleSetting])
@pytest.mark.parametrize(
    "first, second",
    [(0.0, -0.0), (1, True), (1, 1.0), (1.0, np.float32(1.0)), (2**70, 2**70 + 1), ("a", "b"), (np.sin, np.cos)],
)
def test_key_tells_settings_apart(kind, first, second):
    """A parameter (an immutable dataclass or Module, such as a site's `ExpensiveFn`) field by
    field: values that `==` takes for equal, by type and bits."""
    assert _keys._param_key(kind(first)) != _keys._param_key(kind(second))
    assert _keys._param_key(kind(first)) == _keys._param_key(kind(first))


def test_a_sparse_patterns_index_arrays_are_not_copied_into_the_key(monkeypatch, spied):
    """A `dx.sparse_solve`'s pattern (immutable, hashed once) is keyed by itself: its index
    arrays are not copied and hashed on every eager call (12 copies of 2 x 5.5 MB a call on
    the 180 x 60 beam before). Two patterns of the same size that differ get different
    keys, and each call's result is its own matrix's (against a dense solve)."""
    seen = []
    value_key = _keys._value_key
    monkeypatch.setattr(_keys, "_value_key", lambda v: seen.append(np.size(v)) or value_key(v))
    n = 40
    diagonal = np.arange(n)
    upper = dx.SparsePattern(np.r_[diagonal, diagonal[:-1]], np.r_[diagonal, diagonal[1:]], n)
    lower = dx.SparsePattern(np.r_[diagonal, diagonal[1:]], np.r_[diagonal, diagonal[:-1]], n)
    values = jnp.asarray(np.r_[np.full(n, 4.0), np.linspace(0.5, 1.5, n - 1)])
    b = jnp.linspace(1.0, 2.0, n)

    def loss(v, pattern):  # (on the host: a system this small is otherwise solved inside the program)
        return jnp.sum(dx.sparse_solve(v, pattern, b, where="host") ** 2)

    for pattern in (upper, lower, upper):
        value, grad = dx.filter_value_and_grad(loss)(values, pattern)
        dense = ft.partial(lambda v, p: jnp.sum(jnp.linalg.solve(p.todense(v), b) ** 2), p=pattern)
        want_value, want_grad = jax.value_and_grad(dense)(values)
        assert_tree_allclose((value, grad), (want_value, want_grad), rtol=1e-10, atol=1e-12)
    assert max(seen, default=0) < n  # (no index array of the pattern: 2n - 1 entries)
    assert spied["analyse"] == 2  # (the third call, `upper` again, hit the cache)
