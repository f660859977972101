"""Run by `tests/test_devices.py` in a subprocess with `XLA_FLAGS` forcing 4 CPU devices:
where the deferred stage places each half of a `fused` made from `fwd` + `bwd`, and that
values and gradients match the plain-JAX program. Eagerly, the halves run on a pair of
devices from two threads; under `jit`, in the program (no callback starts JAX work there),
or, on the devices `dx.set_devices` names, one half a device in a `shard_map`. Prints `ok`
at the end."""

import os
import threading

assert "xla_force_host_platform_device_count=4" in os.environ.get("XLA_FLAGS", ""), "run with 4 forced devices"

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import deferax as dx  # noqa: E402
from deferax._concurrency import _devices  # noqa: E402
from deferax._concurrency import _threads as _concurrent  # noqa: E402

devices = jax.local_devices()
assert len(devices) == 4, devices
A = jnp.asarray(np.random.default_rng(0).normal(size=(3, 3)), jnp.float32)
B = jnp.asarray(np.random.default_rng(1).normal(size=(3, 3)), jnp.float32)


def plain_a(x):
    return jnp.tanh(A @ x)


def plain_b(x):
    return jnp.sin(B @ x)


def expensive(plain, name):
    def bwd(x, y, ct):  # reads x and the cotangent only
        _, vjp = jax.vjp(plain, x)
        return vjp(ct)[0]

    return dx.ExpensiveFn(fwd=jax.jit(plain), bwd=bwd, name=name)


seen: list = []  # (which half, the device its arguments were on), in the order they ran
lock = threading.Lock()


def note(name, args):
    leaves = [a for a in jax.tree_util.tree_leaves(args) if isinstance(a, jax.Array)]
    if not any(isinstance(a, jax.core.Tracer) for a in leaves):  # (not when shapes are traced)
        (device,) = {d for a in leaves for d in a.devices()}
        with lock:
            seen.append((name, device.id))


def spy(run):
    """`run(batched, f, *args)` (a half called eagerly, compiled or not), noting it first."""

    def spied(batched, f, *args):
        note(getattr(f, "impl", type(f).__name__), args)
        return run(batched, f, *args)

    return spied


traced_half = _concurrent._TracedHalf.__call__


def spied_traced_half(self, device, consts, *args):  # a half made from fwd + bwd, run from the callback
    note(self.name, _devices.on(device, args))
    return traced_half(self, device, consts, *args)


_concurrent._dispatch = spy(_concurrent._dispatch)  # `dx.fuse` halves
_concurrent._direct = spy(_concurrent._direct)  # halves made from fwd + bwd, eagerly
_concurrent._TracedHalf.__call__ = spied_traced_half
sim_a, sim_b = expensive(plain_a, "a"), expensive(plain_b, "b")
x = jnp.array([0.3, -0.2, 0.8], jnp.float32)
w = jnp.array([1.0, -2.0, 0.5], jnp.float32)


def check(loss, reference, expected, wrap=lambda f: f, arg=x):
    seen.clear()
    (value, grad) = wrap(dx.filter_value_and_grad(loss))(arg, w)
    ref_value, ref_grad = jax.value_and_grad(reference)(arg, w)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert sorted(seen) == sorted(expected), (seen, expected)
    return grad


def one(sim, plain_=plain_a):
    return lambda x, w: jnp.sum(w * sim(x)), lambda x, w: jnp.sum(w * plain_(x))


# one site: eagerly, forward on device 0, adjoint on device 1; under jit, in the program (no
# half is started from a callback: nothing is seen running on concrete arrays)
loss, reference = one(sim_a)
grad = check(loss, reference, [("fwd", 0), ("bwd", 1)])
assert grad.devices() == {devices[0]}, grad.devices()
for wrap in (eqx.filter_jit, jax.jit):
    check(loss, reference, [], wrap)
    program = str(jax.make_jaxpr(wrap(dx.filter_value_and_grad(loss)))(x, w))
    assert "callback" not in program, program

# two sites of one step: the second on the next pair of devices
both = lambda x, w: jnp.sum(w * sim_a(x)) + jnp.sum(w * sim_b(2 * x))  # noqa: E731
both_ref = lambda x, w: jnp.sum(w * plain_a(x)) + jnp.sum(w * plain_b(2 * x))  # noqa: E731
pairs = [("fwd", 0), ("bwd", 1), ("fwd", 2), ("bwd", 3)]
check(both, both_ref, pairs)
check(both, both_ref, [], eqx.filter_jit)

# dx.fuse: the same placement for its two jitted halves
fused = dx.ExpensiveFn(
    fwd=plain_a,
    bwd=lambda x, y, ct: A.T @ (ct * (1 - y**2)),
    fused=dx.fuse(
        plain_a, lambda x, ct: A.T @ ct, combine=lambda x, y, p: A.T @ (jnp.linalg.solve(A.T, p) * (1 - y**2))
    ),
)
check(*one(fused), [("function", 0), ("function", 1)])

# inputs the user put on device 3: the results come back there
arg = jax.device_put(x, devices[3])
seen.clear()
value, grad = dx.filter_value_and_grad(loss)(arg, jax.device_put(w, devices[3]))
assert grad.devices() == {devices[3]}, grad.devices()
np.testing.assert_allclose(grad, jax.grad(reference)(x, w), rtol=1e-5, atol=1e-6)

# dx.set_devices: only the two given, in that order; one device keeps everything in place
dx.set_devices([devices[2], devices[1]])
check(both, both_ref, [("fwd", 2), ("bwd", 1), ("fwd", 2), ("bwd", 1)])
# ... and under jit, one half a device of those named, inside the program: a `shard_map`
# over them, no callback; the first site's halves on devices 2 and 1, the second's on 2 and 1
# (a step is placed when it is traced: each loss below is a new function, so that neither
# `jax.jit` nor `eqx.filter_jit` reuses a step traced under another setting)
for wrap in (eqx.filter_jit, jax.jit):
    check(lambda x, w: both(x, w), both_ref, [], wrap)
    program = str(jax.make_jaxpr(wrap(dx.filter_value_and_grad(lambda x, w: both(x, w))))(x, w))
    assert program.count("shard_map[") == 2 and "callback" not in program, program
    with dx.record() as timeline:  # (each half of each site once a step, where it runs)
        jax.block_until_ready(wrap(dx.filter_value_and_grad(lambda x, w: both(x, w)))(x, w))
    assert timeline.counts() == {"fwd": 2, "bwd": 2}, timeline
dx.set_devices(devices)
check(lambda x, w: both(x, w), both_ref, [], jax.jit)
dx.set_devices(devices[:1])
check(both, both_ref, [("fwd", 0), ("bwd", 0), ("fwd", 0), ("bwd", 0)])
check(lambda x, w: both(x, w), both_ref, [], jax.jit)  # (one device named: in the program, as with none)
program = str(jax.make_jaxpr(jax.jit(dx.filter_value_and_grad(lambda x, w: both(x, w))))(x, w))
assert "shard_map" not in program and "callback" not in program, program
dx.set_devices(None)
check(loss, reference, [("fwd", 0), ("bwd", 1)])
print("ok")
