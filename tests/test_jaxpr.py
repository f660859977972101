"""The program analyses of `deferax._jaxpr`, each on small programs whose answer is known by
hand: which inputs an output depends on (`dependencies`), and where a program stops being
linear in an input (`linear_frontier`, `frontier_size`)."""

import jax
import jax.numpy as jnp
import pytest

from deferax import _jaxpr

Y = jnp.array([0.5, -1.0, 2.0, 0.25])
P = jnp.array([1.0, 2.0, -3.0, 0.5])
M = jnp.array([1.0 + 1.0j, 0.5, -1.0j, 2.0])


def program(fn, *args):
    closed, _ = _jaxpr.trace(fn, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args))
    return closed


# ----------------------------------------------------------------------------- dependencies


@pytest.mark.parametrize(
    "fn, expected",
    [
        (lambda a, b: (2.0 * a, a + b, jnp.ones(4)), [{"a"}, {"a", "b"}, set()]),
        (lambda a, b: (jnp.sin(b), jnp.where(a > 0, 1.0, 0.0)), [{"b"}, {"a"}]),  # a comparison still depends
        # inside a nested jit: looked into, so each output keeps its own input
        (lambda a, b: jax.jit(lambda u, v: (u * 2.0, v + 1.0))(a, b), [{"a"}, {"b"}]),
        # inside scan: conservative, every output depends on every input of the loop
        (lambda a, b: jax.lax.scan(lambda c, x: (c + 1.0, x * 2.0), a, b), [{"a", "b"}, {"a", "b"}]),
        # stop_gradient stops no dependence: the value still comes from `a`
        (lambda a, b: (jax.lax.stop_gradient(a) * b,), [{"a", "b"}]),
    ],
    ids=["arithmetic", "comparison", "nested jit", "scan", "stop_gradient"],
)
def test_dependencies(fn, expected):
    got = _jaxpr.dependencies(program(fn, Y, P), ["a", "b"])
    assert [set(s) for s in got] == expected


def test_dependencies_of_unlabelled_inputs_are_empty():
    got = _jaxpr.dependencies(program(lambda a, b: (a * b,), Y, P), [None, "b"])
    assert [set(s) for s in got] == [{"b"}]


# ----------------------------------------------------------------------------- linearity


def frontier(fn, *args, source=(True, False)):
    closed = _jaxpr.merge_duplicates(program(fn, *args))  # as the analysis sees a program
    variables = _jaxpr.linear_frontier(closed, list(source), [False] * len(args))
    return _jaxpr.frontier_size(variables)


@pytest.mark.parametrize(
    "fn, k",
    [
        (lambda y, p: jnp.sum(p * y) + jnp.sum(p**2), 1),  # affine in y: the value itself
        (lambda y, p: jnp.dot(p, y) ** 2, 1),  # nonlinear in one number, w.y
        (lambda y, p: (jnp.dot(p, y) - 1.0) ** 2 + jnp.dot(p, y), 1),  # the same number twice: one
        (lambda y, p: jnp.log(jnp.sum(y)) * jnp.dot(p, y), 2),  # two numbers
        (lambda y, p: jnp.sum(y**2), 4),  # every entry: y itself
        (lambda y, p: jnp.sum(jnp.sin(y[:3])) + jnp.sum(jnp.cos(y[1:])), 4),  # overlapping views: never more than y
        (lambda y, p: jnp.max(jnp.fft.fft(y).real), 4),  # through an FFT, the whole output
        (lambda y, p: (y * 2.0)[jnp.argmax(y * 2.0)], 4),  # the same view computed twice
    ],
    ids=[
        "affine",
        "one number",
        "one number twice",
        "two numbers",
        "every entry",
        "overlapping views",
        "fft",
        "view twice",
    ],
)
def test_frontier_size_of_real_programs(fn, k):
    assert frontier(fn, Y, P) == k


def test_a_complex_number_counts_twice():
    y = Y.astype(jnp.complex128) if jax.config.jax_enable_x64 else Y.astype(jnp.complex64)
    m = M if jax.config.jax_enable_x64 else M.astype(jnp.complex64)
    assert frontier(lambda y, m: jnp.abs(jnp.vdot(m, y)) ** 2, y, m) == 2
    assert frontier(lambda y, m: jnp.real(jnp.vdot(m, y)), y, m) == 1  # linear (real part of a linear map)


def test_a_coefficient_that_depends_on_the_source_is_nonlinear():
    # p * y is linear in y; y * y is not, even though each factor is linear
    assert frontier(lambda y, p: jnp.sum(y * jax.lax.stop_gradient(y)), Y, P) == 4
    assert frontier(lambda y, p: jnp.sum(p * y), Y, P) == 1


# ----------------------------------------------------------------------------- programs


def test_constants_as_inputs_and_back_compute_the_same():
    """`open_consts` turns a program's constants into leading inputs (`close` binds them
    again): the program computes the same on every JAX in the tested range."""
    weights = jnp.arange(4.0)
    closed = program(lambda y: (jnp.sum(weights * y), y * weights[::-1]), Y)
    opened, consts = _jaxpr.open_consts(closed)
    assert len(consts) == len(closed.consts) >= 1 and not opened.consts
    expected = _jaxpr.interpret(closed, [Y])
    got = _jaxpr.interpret(opened, [*consts, Y])
    for a, b in zip(got, expected, strict=True):
        assert jnp.array_equal(a, b)
    assert [float(v) for v in jnp.ravel(expected[1])] == [float(v) for v in Y * weights[::-1]]


def test_merge_duplicates_keeps_one_of_each_computation():
    closed = program(lambda y, p: (jnp.dot(p, y), jnp.dot(p, y) + 1.0, jnp.dot(y, p)), Y, P)
    merged = _jaxpr.merge_duplicates(closed)
    dots = [e for e in merged.jaxpr.eqns if str(e.primitive) == "dot_general"]
    assert len(dots) == 2  # `dot(p, y)` twice is one; `dot(y, p)` has its operands the other way
    for a, b in zip(_jaxpr.interpret(merged, [Y, P]), _jaxpr.interpret(closed, [Y, P]), strict=True):
        assert jnp.array_equal(a, b)
