"""The walk of one gradient, counted: README's example (one deferred site), and the deferax
files and cross-file calls it enters on a first eager call, a repeat and a first `jit` trace,
on the calling thread (what deferax's pools run for it, the `fused` call, is not counted).

docs/design.md ("The walk of one gradient") quotes these figures; rerun them after a change:

    python .ci/walk.py
"""

from __future__ import annotations

import collections
import pathlib
import sys

import jax
import jax.numpy as jnp

import deferax as dx

PACKAGE = str(pathlib.Path(dx.__file__).resolve().parent)


def walked(fn, *args) -> tuple[collections.Counter, int]:
    """The deferax files `fn(*args)` enters on this thread (calls into each) and its calls from
    one deferax file into another."""
    files: collections.Counter = collections.Counter()
    crossing = 0

    def profile(frame, event, _):
        nonlocal crossing
        if event != "call":
            return
        here = frame.f_code.co_filename
        if not here.startswith(PACKAGE):
            return
        name = here[len(PACKAGE) + 1 :]
        files[name] += 1
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        if caller.startswith(PACKAGE) and caller != here:
            crossing += 1

    sys.setprofile(profile)
    try:
        jax.block_until_ready(fn(*args))
    finally:
        sys.setprofile(None)
    return files, crossing


def main():
    f = dx.ExpensiveFn(
        fwd=jnp.sin, bwd=lambda x, y, ct: ct * jnp.cos(x), fused=lambda x, ct: (jnp.sin(x), ct * jnp.cos(x)), name="sin"
    )
    weights = jnp.array([1.0, 2.0, 3.0])

    def loss(x):
        return jnp.sum(weights * f(x)) + 1.0

    x = jnp.array([0.0, 0.5, 1.0])
    step = dx.filter_value_and_grad(loss)
    for what, fn in (("first eager call", step), ("a repeat", step), ("first jit trace", jax.jit(step))):
        files, crossing = walked(fn, x)
        print(f"{what}: {len(files)} files, {crossing} cross-file calls")
        print("  " + ", ".join(f"{name} {n}" for name, n in sorted(files.items())))


if __name__ == "__main__":
    main()
