"""The caller's JAX configuration and context variables, carried to other threads."""

from __future__ import annotations

import contextlib
import contextvars


def local_config() -> dict:
    """The JAX configuration values set in this thread only (by a context manager such as
    `jax.numpy_dtype_promotion("strict")`)."""
    from ._internals import config

    values = {}
    for name, state in config.config_states.items():
        value = state.get_local()
        if value is not config.config_ext.unset:
            values[name] = value
    return values


@contextlib.contextmanager
def apply_config(values: dict):
    """Set, in this thread, every JAX configuration value of `values` that differs here."""
    from ._internals import config

    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            state = config.config_states[name]
            if state.value != value:
                stack.enter_context(state(value))
        yield


@contextlib.contextmanager
def setting(var: contextvars.ContextVar, value):
    """Inside: the context variable `var` is `value` (in this thread, and in what
    `carry_context` carries from here)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


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
