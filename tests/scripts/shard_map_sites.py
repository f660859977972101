"""Run by `tests/test_shard_map.py` in a subprocess with `XLA_FLAGS` forcing 8 CPU devices:
`ExpensiveFn` sites called per shard inside `jax.shard_map`. Values and gradients match the
same program in plain JAX and with `jax.custom_vjp`, under `jax.grad`, `jax.jit(jax.grad)` and
`dx.filter_value_and_grad` (eager and jitted), with the site's input sharded or replicated,
results reduced with `psum` or left sharded, `check_vma` on and off, in float32 and float64;
the implementations run as often as expected. Prints `ok` at the end.

Inside `shard_map` (with `check_vma`), a value's type says along which mesh axes it varies. A
site's outputs were typed invariant whatever its inputs: taken for replicated, the output's
cotangent was summed over the shards once more (an 8 times too large gradient, silently), and a
residual `y` left the forward program as one shard's block for all."""

import collections
import os
import threading

assert "xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", ""), "run with 8 forced devices"

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import deferax as dx  # noqa: E402

X64 = os.environ.get("DEFERAX_TESTS_X64", "1") != "0"  # (off: as on an accelerator, float32 only)
jax.config.update("jax_enable_x64", X64)
jax.config.update("jax_numpy_dtype_promotion", "strict")

devices = jax.devices()
assert len(devices) == 8, devices
mesh = jax.sharding.Mesh(devices, ("i",))
N = 3  # the length of one shard's block
DTYPES = (np.float32, np.float64) if X64 else (np.float32,)
TOLERANCE = {np.float32: 2e-5, np.float64: 1e-10}

# How often each implementation was called: a Python counter (host functions run on
# executor threads). A JAX implementation is called when it is traced, a host one each time a
# shard runs it.
calls: collections.Counter = collections.Counter()
ran: collections.Counter = collections.Counter()  # JAX implementations run, by `jax.debug.callback`
lock = threading.Lock()


def called(key):
    with lock:
        calls[key] += 1


def tick(key):
    """In a JAX implementation: counts the call (a trace), and each run of it (once a shard)."""
    called(key)

    def bump():
        with lock:
            ran[key] += 1

    jax.debug.callback(bump, ordered=False)


def reset():
    jax.effects_barrier()
    with lock:
        calls.clear()
        ran.clear()


def counts(prefix):
    jax.effects_barrier()
    with lock:
        return {k.split(".", 1)[1]: v for k, v in calls.items() if k.startswith(prefix + ".")}


def runs(prefix):
    jax.effects_barrier()
    with lock:
        return {k.split(".", 1)[1]: v for k, v in ran.items() if k.startswith(prefix + ".")}


def varying(tree):
    """Every leaf cast to vary along `i` (a no-op for those that do, and with `check_vma`
    off): what a `jax.custom_vjp` needs of a replicated input, whose `bwd` returns a cotangent
    that varies from shard to shard (JAX then sums it over them)."""

    def one(a):
        t = jax.typeof(a)
        mat = getattr(t, "manual_axis_type", None)
        vma = mat.varying if mat is not None else getattr(t, "vma", frozenset())
        return a if "i" in vma else jax.lax.pcast(a, "i", to="varying")

    return jax.tree_util.tree_map(one, tree)


def close(got, want, dtype, what):
    tol = TOLERANCE[dtype]
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert g.dtype == w.dtype == dtype, (what, g.dtype, w.dtype)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol, err_msg=str(what))


# ----------------------------------------------------------------------------- the per-shard functions


class Kind:
    """One per-shard function `f(p)`, its hand-written derivative `df(p, y, ct) -> ct_p` (it
    reads `y` where that is natural), an `adjoint(p, ct)` with `combine(p, y, partial)` (None:
    `partial` is `ct_p`), and host (NumPy) versions of `f` and `adjoint` where there are."""

    def __init__(self, name, f, df, adjoint, combine=None, f_np=None, adjoint_np=None):
        self.name, self.f, self.df, self.adjoint, self.combine = name, f, df, adjoint, combine
        self.f_np, self.adjoint_np = f_np, adjoint_np

    def custom_vjp(self):
        f = jax.custom_vjp(self.f)

        def fwd(p):
            y = self.f(p)
            return y, (p, y)

        def bwd(res, ct):
            p, y = res
            return (self.df(p, y, ct),)

        f.defvjp(fwd, bwd)
        return lambda p: f(varying(p))

    def site(self, variant):
        """A fresh `ExpensiveFn` (new functions: JAX has traced none of them) for `variant`."""
        key = f"{self.name}:{variant}"

        def fwd(p):
            tick(f"{key}.fwd")
            return self.f(p)

        def bwd(p, y, ct):
            tick(f"{key}.bwd")
            return self.df(p, y, ct)

        def adjoint(p, ct):
            tick(f"{key}.adjoint")
            return self.adjoint(p, ct)

        def fused(p, ct):
            tick(f"{key}.fused")
            y = self.f(p)
            return y, self.df(p, y, ct)

        def jvp(p, t):
            tick(f"{key}.jvp")
            return jax.jvp(self.f, (p,), (t,))

        def host_fwd(p):
            called(f"{key}.fwd")
            return self.f_np(p)

        def host_adjoint(p, ct):
            called(f"{key}.adjoint")
            return self.adjoint_np(p, ct)

        if variant == "fwd+bwd":
            return dx.ExpensiveFn(fwd=fwd, bwd=bwd, name=key)
        if variant == "fwd+adjoint":
            return dx.ExpensiveFn(fwd=fwd, adjoint=adjoint, combine=self.combine, name=key)
        if variant == "fwd+bwd+fused":
            return dx.ExpensiveFn(fwd=fwd, bwd=bwd, fused=fused, name=key)
        if variant == "fwd+jvp":  # (reverse mode on the forward-basis strategy: 3 numbers a shard)
            return dx.ExpensiveFn(fwd=fwd, jvp=jvp, name=key)
        if variant == "fwd":  # (JAX differentiates `fwd`)
            return dx.ExpensiveFn(fwd=fwd, name=key)
        assert variant == "host", variant
        return dx.host(host_fwd, adjoint=host_adjoint, combine=self.combine, out=lambda s: s, name=key)


rng = np.random.default_rng(0)
A_NP = rng.normal(size=(N, N)) / 2


def a_of(p):  # the replicated matrix closed over, in the dtype of the input
    return jnp.asarray(A_NP, p.dtype)


SINE = Kind(  # x in (0, pi / 2): cos(x) = sqrt(1 - sin(x)^2), so `bwd` can read `y`
    "sine",
    f=jnp.sin,
    df=lambda x, y, ct: ct * jnp.sqrt(1 - y**2),
    adjoint=lambda x, ct: ct * jnp.cos(x),
    f_np=np.sin,
    adjoint_np=lambda x, ct: ct * np.cos(x),
)
LINEAR = Kind(  # a replicated matrix closed over
    "linear",
    f=lambda x: a_of(x) @ x,
    df=lambda x, y, ct: a_of(x).T @ ct,
    adjoint=lambda x, ct: a_of(x).T @ ct,
    f_np=lambda x: A_NP.astype(x.dtype) @ x,
    adjoint_np=lambda x, ct: A_NP.astype(x.dtype).T @ ct,
)


def pair_df(p, y, ct):
    a, x = p
    g = ct * (1 - y**2)
    return jnp.outer(g, x), a.T @ g


PAIR = Kind(  # the matrix is a differentiable input too: `(a, x) -> tanh(a @ x)`
    "pair",
    f=lambda p: jnp.tanh(p[0] @ p[1]),
    df=pair_df,
    adjoint=lambda p, ct: ct,  # (the adjoint solve is trivial here; `combine` reads `y`)
    combine=pair_df,
)


# ----------------------------------------------------------------------------- the programs


class Layout:
    """How the site's input enters `shard_map` and what leaves it: `x_spec`, the spec of
    the input (`P("i")`: each shard a block of `N`; `P()`: all shards the same `N`), the
    weights `w` always sharded (so that the shards' contributions differ), and `out`, `P()`
    (the loss reduced with `psum` in the body) or `P("i")` (each shard's terms, summed outside)."""

    def __init__(self, x_spec, out):
        self.x_spec, self.out = x_spec, out

    def __repr__(self):
        return f"in={self.x_spec} out={self.out}"

    def loss(self, g, check_vma):
        def body(x, w):
            terms = w * g(x) ** 2
            return jax.lax.psum(jnp.sum(terms), "i") if self.out == P() else terms

        smap = jax.shard_map(body, mesh=mesh, in_specs=(self.x_spec, P("i")), out_specs=self.out, check_vma=check_vma)
        return lambda x, w: jnp.sum(smap(x, w))

    def x(self, dtype):
        n = N * 8 if self.x_spec == P("i") else N
        return jnp.asarray(np.linspace(0.1, 1.4, n), dtype)


LAYOUTS = [Layout(P("i"), P()), Layout(P("i"), P("i")), Layout(P(), P()), Layout(P(), P("i"))]
W = np.linspace(-1.0, 2.0, N * 8)


def transforms(loss, eager=False):
    """The ways of taking the value and the gradient with respect to the first argument:
    compiled, and with `eager`, also eagerly (slow: outside `jit`, JAX compiles each operation
    of a `shard_map` body on its own, about 1.5 s a gradient here)."""
    compiled = {
        "jax.jit(jax.grad)": jax.jit(jax.value_and_grad(loss)),
        "jax.jit(dx.filter_value_and_grad)": jax.jit(dx.filter_value_and_grad(loss)),
    }
    if not eager:
        return compiled
    return {
        "jax.grad": jax.value_and_grad(loss),
        "dx.filter_value_and_grad": dx.filter_value_and_grad(loss),
        **compiled,
    }


def cases():
    """`(dtype, check_vma, layouts)`: every layout in the widest dtype, with `check_vma` on
    and off; float32 too, on the two layouts that reduce with `psum`."""
    yield DTYPES[-1], True, LAYOUTS
    yield DTYPES[-1], False, LAYOUTS
    if len(DTYPES) > 1:
        yield DTYPES[0], True, [LAYOUTS[0], LAYOUTS[2]]


def check_kind(kind, variants):
    for dtype, check_vma, layouts in cases():
        w = jnp.asarray(W, dtype)
        for layout in layouts:
            x = layout.x(dtype)
            want = jax.jit(jax.value_and_grad(layout.loss(kind.f, check_vma)))(x, w)
            where = (kind.name, layout, f"check_vma={check_vma}", dtype.__name__)
            close(jax.jit(jax.value_and_grad(layout.loss(kind.custom_vjp(), check_vma)))(x, w), want, dtype, where)
            # (with `check_vma` off the site's rules change nothing: the main variants suffice)
            for variant in variants if check_vma else ["fwd+bwd", "fwd+adjoint", "host"]:
                loss = layout.loss(kind.site(variant), check_vma)
                for name, transform in transforms(loss).items():
                    close(transform(x, w), want, dtype, (*where, variant, name))


check_kind(SINE, ["fwd+bwd", "fwd+adjoint", "fwd+bwd+fused", "fwd+jvp", "fwd", "host"])
check_kind(LINEAR, ["fwd+bwd", "fwd+adjoint", "fwd+bwd+fused", "host"])


# `(a, x) -> tanh(a @ x)`, both differentiated: the matrix replicated and the vector sharded,
# and the other way round (a block of rows of `a` a shard); `jax.custom_vjp` needs its
# replicated input cast to vary (`varying`), as JAX asks of it; a site does that itself.
def pair_loss(g, a_spec, x_spec, check_vma):
    def body(a, x, w):
        return jax.lax.psum(jnp.sum(w * g((a, x)) ** 2), "i")

    specs = (a_spec, x_spec, P("i"))
    smap = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=check_vma)
    return lambda p, w: smap(p[0], p[1], w)


for dtype, check_vma, _ in cases():
    w = jnp.asarray(W, dtype)
    for a_spec, x_spec in ((P(), P("i")), (P("i"), P())):
        a = jnp.asarray(rng.normal(size=(N * 8 if a_spec == P("i") else N, N)) / 2, dtype)
        x = jnp.asarray(np.linspace(-1.0, 1.0, N * 8 if x_spec == P("i") else N), dtype)
        want = jax.jit(jax.value_and_grad(pair_loss(PAIR.f, a_spec, x_spec, check_vma)))((a, x), w)
        where = ("pair", a_spec, x_spec, f"check_vma={check_vma}", dtype.__name__)
        got = jax.jit(jax.value_and_grad(pair_loss(PAIR.custom_vjp(), a_spec, x_spec, check_vma)))((a, x), w)
        close(got, want, dtype, where)
        for variant in ("fwd+bwd", "fwd+adjoint", "fwd+bwd+fused"):
            loss = pair_loss(PAIR.site(variant), a_spec, x_spec, check_vma)
            for name, transform in transforms(loss).items():
                close(transform((a, x), w), want, dtype, (*where, variant, name))


# An implementation holding an array (an `eqx.Module`: a constant to the derivative) that
# differs from shard to shard, the input replicated: its cotangent is the sum of every shard's.
class Scaled(eqx.Module):
    scale: jax.Array

    def __call__(self, x):
        tick("held.fwd")
        return self.scale * jnp.sin(x)


class ScaledBwd(eqx.Module):
    scale: jax.Array

    def __call__(self, x, y, ct):
        tick("held.bwd")
        return ct * self.scale * jnp.cos(x)


def held_loss(make, check_vma):
    def body(scale, x, w):
        return jax.lax.psum(jnp.sum(w * make(scale)(x) ** 2), "i")

    smap = jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P(), P("i")), out_specs=P(), check_vma=check_vma)
    return lambda x, scale, w: smap(scale, x, w)


for dtype, check_vma, _ in cases():
    w = jnp.asarray(W, dtype)
    scale = jnp.asarray(np.linspace(0.5, 2.0, N * 8), dtype)
    x = jnp.asarray(np.linspace(0.1, 1.4, N), dtype)
    want = jax.jit(jax.value_and_grad(held_loss(lambda s: lambda v: s * jnp.sin(v), check_vma)))(x, scale, w)
    site = lambda s: dx.ExpensiveFn(fwd=Scaled(s), bwd=ScaledBwd(s), name="held")  # noqa: E731
    for name, transform in transforms(held_loss(site, check_vma)).items():
        close(transform(x, scale, w), want, dtype, ("held", f"check_vma={check_vma}", dtype.__name__, name))


# ----------------------------------------------------------------------------- more transformations

dtype = DTYPES[-1]
w = jnp.asarray(W, dtype)

# eagerly, without differentiation: each shard's own block of the output
xs = LAYOUTS[0].x(dtype)
for variant in ("fwd+bwd", "host"):
    smap = jax.shard_map(SINE.site(variant), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    close(smap(xs), jnp.sin(xs), dtype, (variant, "eager shard_map"))
    close(jax.jit(smap)(xs), jnp.sin(xs), dtype, (variant, "jit(shard_map)"))


def tangent(g, check_vma):
    """`jax.jvp` of the loss of `g` on the first layout, compiled."""
    loss = LAYOUTS[0].loss(g, check_vma)
    return jax.jit(lambda x, t: jax.jvp(lambda v: loss(v, w), (x,), (t,)))


# forward mode through the shard_map, and `vmap` inside it
for check_vma in (True, False):
    want = tangent(jnp.sin, check_vma)(xs, jnp.cos(xs))
    got = tangent(SINE.site("fwd+jvp"), check_vma)(xs, jnp.cos(xs))
    close(got, want, dtype, ("jvp", check_vma))
    rows = xs.reshape(8, N)

    def batched(g, check_vma=check_vma):
        body = lambda r, w: jax.lax.psum(jnp.sum(w * jax.vmap(g)(r) ** 2), "i")  # noqa: E731
        smap = jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P("i")), out_specs=P(), check_vma=check_vma)
        return lambda r: smap(r, w.reshape(8, N))

    want = jax.jit(jax.value_and_grad(batched(jnp.sin)))(rows)
    for variant in ("fwd+bwd", "fwd+adjoint", "host"):
        close(jax.jit(jax.value_and_grad(batched(SINE.site(variant))))(rows), want, dtype, ("vmap", variant, check_vma))


# ----------------------------------------------------------------------------- eagerly; how often implementations run
#
# A JAX implementation is called when the program is traced: `fwd` twice (once by
# `jax.eval_shape`, for the output's structure, once into the program), `bwd` (or `adjoint`)
# once, `fused` never on this schedule; eagerly, a second call traces again (`fwd` once:
# `jax.eval_shape` is cached), under `jit` not at all. When the compiled program runs, each
# shard runs `fwd` and `bwd` once (counted by `jax.debug.callback`, which JAX runs inside a
# `shard_map` in compiled programs only). A host function runs once a shard, each call.

JAX_KEEPS_EAGER_FORWARD = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)
expected_traced = {
    "fwd+bwd": {"fwd": 2, "bwd": 1},
    "fwd+adjoint": {"fwd": 2, "adjoint": 1},
    "fwd+bwd+fused": {"fwd": 2, "bwd": 1},
    "host": None,
}
for layout in (LAYOUTS[0], LAYOUTS[2]):  # the input sharded, and replicated
    x = layout.x(dtype)
    want = jax.jit(jax.value_and_grad(layout.loss(jnp.sin, True)))(x, w)
    for variant, traced in expected_traced.items():
        if layout is LAYOUTS[2] and variant not in ("fwd+bwd", "host"):
            continue
        key = f"sine:{variant}"
        for name in transforms(jnp.sin, eager=True):
            # (a new function for each: none of its implementations traced yet)
            transform = transforms(layout.loss(SINE.site(variant), True), eager=True)[name]
            jitted = name.startswith("jax.jit")
            for again in (False, True):
                reset()
                close(jax.block_until_ready(transform(x, w)), want, dtype, (layout, variant, name, again))
                if traced is None:  # a host function: once a shard, each call
                    assert counts(key) == {"fwd": 8, "adjoint": 8}, (layout, name, again, counts(key))
                    continue
                expected = traced if not again else {} if jitted else {impl: 1 for impl in traced}
                found = counts(key)
                if again and not jitted and "fwd" in expected and JAX_KEEPS_EAGER_FORWARD:
                    # (jax >= 0.12 keeps the forward's trace of an eager `shard_map` between calls:
                    # the forward is not traced again)
                    expected = {impl: n for impl, n in expected.items() if impl != "fwd"}
                assert found == expected, (layout, variant, name, again, found, expected)
                if jitted:
                    assert runs(key) == {impl: 8 for impl in traced}, (layout, variant, name, again, runs(key))


# ----------------------------------------------------------------------------- what cannot work raises

# An unreduced partial sum (each shard holds a term of it): the function would see a term.
xs = LAYOUTS[0].x(dtype)
site = SINE.site("fwd+bwd")
smap = jax.shard_map(
    lambda x: jax.lax.psum(site(jax.lax.pcast(x, "i", to="unreduced")), "i"), mesh=mesh, in_specs=P("i"), out_specs=P()
)
try:
    jax.jit(smap)(xs)
except TypeError as e:
    message = str(e)
    assert message.startswith("`ExpensiveFn(name='sine:fwd+bwd')`: called on its input `x`, which is unreduced"), (
        message
    )
    assert "jax.lax.psum(x, 'i')" in message, message
else:
    raise AssertionError("a site on an unreduced value did not raise")

print("ok")
