"""Sites inside `jax.shard_map`: each shard calls the function on its own block, and the values
and gradients are those of the same program in plain JAX and with `jax.custom_vjp`."""

import os
import pathlib
import subprocess
import sys


def test_sites_inside_shard_map():
    """The checks live in `scripts/shard_map_sites.py`: JAX must see 8 CPU devices, which is
    fixed when JAX starts, so they run in a fresh interpreter (about two minutes: outside
    `jit`, JAX compiles each operation of a `shard_map` body on its own)."""
    script = pathlib.Path(__file__).parent / "scripts" / "shard_map_sites.py"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-3000:] + out.stderr[-3000:]
