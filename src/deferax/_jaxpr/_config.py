"""The caller's JAX configuration and context variables, carried to other threads."""

from __future__ import annotations

import contextlib
import contextvars


def local_config() -> dict:
    """The JAX configuration values in force in this thread (those a context manager such
    as `jax.numpy_dtype_promotion("strict")` may have set here only)."""
    from jax._src import config

    values = {}
    for name, state in config.config_states.items():
        if hasattr(state, "swap_local"):
            try:
                values[name] = state.value
            except Exception:  # noqa: BLE001 - a state without a readable value is not carried
                continue
    return values


@contextlib.contextmanager
def apply_config(values: dict):
    """Set, in this thread, every JAX configuration value of `values` that differs here."""
    from jax._src import config

    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            state = config.config_states[name]
            if state.value != value:
                stack.enter_context(state(value))
        yield


def carry_context(fn):
    """`fn` to run on another thread with the caller's context: its context variables (the
    typechecking switch) and its thread-local JAX configuration (`jax.numpy_dtype_promotion`,
    ... set with context managers)."""
    context = contextvars.copy_context()
    config = local_config()

    def run(*args):
        with apply_config(config):
            return context.copy().run(fn, *args)

    return run
