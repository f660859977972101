"""Several devices: the deferred stage puts the forward and the adjoint of a site on two
devices, and the sites of one step on different pairs (`dx.set_devices` to choose)."""

import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

import deferax as dx


def test_halves_and_sites_on_different_devices():
    """The checks live in `scripts/devices.py`: JAX must see 4 CPU devices, which is fixed
    when JAX starts, so they run in a fresh interpreter."""
    script = pathlib.Path(__file__).parent / "scripts" / "devices.py"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-3000:] + out.stderr[-3000:]


def test_every_kind_of_site_with_inputs_sharded_over_eight_devices():
    """The checks live in `scripts/sharded.py` (8 CPU devices, a fresh interpreter): a
    JAX-native `ExpensiveFn`, a `dx.fuse`, a recognised custom_vjp, a host site and a sparse
    solve, each eager, under `jax.jit` and with shardings: plain JAX's values and gradients.
    (Before, the first three raised eagerly and aborted the process under `jit`.)"""
    script = pathlib.Path(__file__).parent / "scripts" / "sharded.py"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-3000:] + out.stderr[-3000:]


def test_a_bwd_that_reads_y_on_a_later_call_with_sharded_inputs():
    """The checks live in `scripts/flip_sharded.py` (2 CPU devices, a fresh interpreter): with
    the input sharded the halves run in the program, and a `bwd` left unread for a call is
    read before the forward; one that reads `y` by then runs after it. Plain JAX's values."""
    script = pathlib.Path(__file__).parent / "scripts" / "flip_sharded.py"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-3000:] + out.stderr[-3000:]


def test_second_order_with_sharded_inputs_under_jit():
    """The checks live in `scripts/hvp_sharded.py` (2 CPU devices, a fresh interpreter): a
    Hessian-vector product through `dx.sparse_solve` with its inputs sharded, under `jit`, is
    the dense program's, one factorisation."""
    script = pathlib.Path(__file__).parent / "scripts" / "hvp_sharded.py"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.parametrize(
    "bad, found",
    [
        (jax.devices()[0], "TFRT_CPU_0|CpuDevice"),
        ([], r"\[\]\."),
        (["cpu:0"], "'cpu:0' among them"),
        ((jax.devices()[0], 0), "0 among them"),
        ("cpu", "'cpu'"),
    ],
)
def test_set_devices_refuses_what_is_not_a_list_of_devices(bad, found):
    with pytest.raises(
        TypeError,
        match=r"`deferax.set_devices`: `devices` must be None \(every local device\) or a non-empty list of "
        r"`jax.Device`s",
    ) as info:
        dx.set_devices(bad)
    assert re.search(f"but got .*({found})", str(info.value)), str(info.value)
    dx.set_devices(None)


def test_lineax_and_a_recognised_sparsax_call_with_sharded_inputs():
    """The checks live in `scripts/lineax_sharded.py` (2 CPU devices, a fresh interpreter):
    `deferax.lineax`'s solve inside the program and on the host, and a recognised
    `sparsax.lu_solve`, with the entries and `b` sharded, eagerly and under `jit`: the dense
    program's values, gradients and Hessian-vector product."""
    script = pathlib.Path(__file__).parent / "scripts" / "lineax_sharded.py"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-3000:] + out.stderr[-3000:]
