"""Device placement: which devices the deferred stage spreads its JAX-native work over."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from .. import _runtime

_BAD_DEVICES = """`deferax.set_devices`: `devices` must be None (every local device) or a non-empty list of \
`jax.Device`s, such as
`jax.local_devices()[:2]`, but got {found}."""


def set_devices(devices: Any = None) -> None:  # (`Any`: a wrong value must reach the message below)
    """Choose the devices that the deferred stage spreads its JAX-native work over.

    When JAX sees several devices (several GPUs; on a CPU, with
    `XLA_FLAGS=--xla_force_host_platform_device_count=N`), the forward and the adjoint of
    a `fused` made by [`deferax.fuse`][] (or derived from `fwd` and a `bwd` that does not
    read `y`) run on two different devices, and the sites of one step on different pairs
    of devices, round robin; their results come back to the device the inputs were on.

    **Arguments:**

    - `devices`: a list of `jax.Device`s to use, in order; `None` (the default) for all
      of `jax.local_devices()`. A list of one device keeps all the work on that device.

    Under `jax.jit` (or any trace), the halves run inside the compiled program: with two
    or more devices named here, a `shard_map` over them runs the forward on one device and
    the adjoint on the next (the step's arrays must then live on these devices, or be
    uncommitted, as for any `shard_map` over them); without this call, or with one device,
    one after the other, where the program runs (a host callback that started JAX work on
    other devices could stall the program's collectives). See "Accelerators and several
    devices" in the docs.

    Like [`deferax.set_concurrency`][], the setting is the process's, for every thread. It is
    read when eager calls run, and when a step is traced: a step compiled before keeps the
    placement it was traced with.
    """
    if devices is None:
        _runtime.SWITCHES.devices = None
        return
    if isinstance(devices, str | jax.Device) or not isinstance(devices, Sequence) or not devices:
        raise TypeError(_BAD_DEVICES.format(found=repr(devices)[:80]))
    bad = [d for d in devices if not isinstance(d, jax.Device)]
    if bad:
        raise TypeError(_BAD_DEVICES.format(found=f"{bad[0]!r:.80} among them"))
    _runtime.SWITCHES.devices = list(devices)


def pair(slot: int) -> tuple[jax.Device | None, jax.Device | None]:  # pyright: ignore[reportInvalidTypeForm]  (jax.Device: compiled, no stub)
    """`(forward's device, adjoint's device)` for the `slot`-th site of one step;
    `(None, None)` on one device."""
    chosen = _runtime.SWITCHES.devices
    devices = jax.local_devices() if chosen is None else chosen
    if len(devices) < 2:
        return None, None
    first = (2 * slot) % len(devices)
    return devices[first], devices[(first + 1) % len(devices)]


def on(device: jax.Device | None, tree: Any) -> Any:  # pyright: ignore[reportInvalidTypeForm]  (jax.Device: compiled, no stub)
    """`tree` with its arrays on `device` (unchanged for `None`)."""
    if device is None:
        return tree
    return jtu.tree_map(lambda a: jax.device_put(a, device) if isinstance(a, jax.Array | np.ndarray) else a, tree)
