"""Typed modules: jaxtyping annotations checked at run time by beartype.

Checks run in Python when a function is called, so inside a jitted step they cost
nothing after tracing: shapes and dtypes are static, and the check happens while JAX
traces. Dimension names bind across one call: a module's fields, a method's arguments and
its return value share one set of bindings.

Below, what deferax learns of a user's implementation without running it: whether an error
raised while tracing it says that JAX cannot trace it (`untraceable`), and which function's
jaxtyping annotations a call of it checks (`checked_function`, `annotated`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools as ft
import inspect
import io
import sys
import typing
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jaxtyping
from beartype.door import is_bearable

from . import _runtime
from ._checks import _messages

_ENABLED = _runtime.TYPECHECKING


class AnnotationError(TypeError):
    """A value did not match its jaxtyping annotation (shape, dtype or structure)."""


def typechecking_enabled() -> bool:
    """Whether typed modules and typed implementations are checked now."""
    return _ENABLED.get()


def set_typechecking(enabled: bool) -> None:
    """Turn the run-time checks of typed modules on or off, from here on in the current context.

    The checks are those of a [`deferax.TypedModule`][]'s fields and annotated methods, and
    of the annotated implementations of an [`deferax.ExpensiveFn`][]. The setting is held
    in a `contextvars.ContextVar`: it holds for the current thread (or asyncio task) from
    now on, and for the threads deferax runs this context's work on, not for threads
    started elsewhere (a new thread starts with the default). Inside a jitted step it
    matters only while the step is traced, in the caller's thread: so, unlike
    [`deferax.set_concurrency`][] and [`deferax.set_devices`][] (read when the calls run,
    on any thread, for every thread), it can differ between two threads that trace. To
    change it for one block only, use [`deferax.typechecking`][].

    The default is on, unless the environment variable `DEFERAX_TYPECHECK` is `0`,
    `false`, `off` or `no` when deferax is imported.

    **Arguments:**

    - `enabled`: `True` to check, `False` not to (read as a bool).

    **Returns:**

    Nothing. [`deferax.typechecking_enabled`][] tells the current state.

    !!! Example

        ```python
        dx.set_typechecking(False)  # no shape checks from here on
        ```
    """
    _ENABLED.set(bool(enabled))


@contextlib.contextmanager
def typechecking(enabled: bool) -> Iterator[None]:
    """Context manager: run the block with the run-time checks of typed modules turned on or off.

    The checks are those that [`deferax.set_typechecking`][] turns on and off; on leaving
    the block, the setting from before it is back (also when the block raises). Inside a
    jitted step it matters only while the step is traced.

    **Arguments:**

    - `enabled`: `True` to check inside the block, `False` not to (read as a bool).

    **Returns:**

    A context manager that yields `None`.

    !!! Example

        ```python
        with dx.typechecking(False):
            loss = step(model, batch)  # no shape checks while tracing
        ```
    """
    token = _ENABLED.set(bool(enabled))
    try:
        yield
    finally:
        _ENABLED.reset(token)


# The module whose fields share the current bindings (set while a typed call is checked).
_FIELDS = _runtime.FIELDS


@typing.no_type_check  # runs in the caller's jaxtyping bindings
def _binding_lines() -> list[str]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        jaxtyping.print_bindings()
    return [line.strip() for line in buffer.getvalue().splitlines() if "=" in line]


@typing.no_type_check  # runs in the caller's jaxtyping bindings
def _bindings() -> str:
    """The current dimension bindings, each bound by a field of the module named with it."""
    lines = _binding_lines()
    if not lines:
        return "none yet"
    origins = _origins(_FIELDS.get())
    return ", ".join(
        f"{line} (field `{origins[line.split('=')[0]]}`)" if line.split("=")[0] in origins else line for line in lines
    )


def _origins(module: Any) -> dict[str, str]:
    """Which field binds each dimension name: each field checked alone, in fresh bindings
    (only when a message is being written: nothing is paid on the success path)."""
    origins: dict[str, str] = {}
    if module is None:
        return origins
    for name, hint in _field_hints(type(module)):
        with jaxtyping.jaxtyped("context"):
            if is_bearable(getattr(module, name), hint):
                for line in _binding_lines():
                    origins.setdefault(line.split("=")[0], name)
    return origins


def _hint_text(hint: Any) -> str:
    """`Float[Array, 'nx ny']` rather than the class's repr."""
    text = getattr(hint, "__name__", None) if isinstance(hint, type) else None
    text = text or repr(hint)
    for noise in ("jaxtyping.", "jaxlib._jax.", "jax.jaxlib._jax.", "<class '", "'>"):
        text = text.replace(noise, "")
    return text


_ANNOTATION = """{where}: {what} does not match its annotation.
  expected: {expected}
  received: {found}
  dimension bindings so far: {bindings}"""


@typing.no_type_check  # runs in the caller's jaxtyping bindings
def check(value: Any, hint: Any, where: str, what: str) -> None:
    """Check `value` against `hint` in the current bindings; raise `AnnotationError`."""
    if hint is Any or hint is inspect.Parameter.empty:
        return
    if not is_bearable(value, hint):
        raise AnnotationError(
            _ANNOTATION.format(
                where=where,
                what=what,
                expected=_hint_text(hint),
                found=_messages.tree_text(value),
                bindings=_bindings(),
            )
        )


@_runtime.cached(maxsize=None)
def _field_hints(cls: type) -> tuple[tuple[str, Any], ...]:
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except NameError:
        # a string annotation naming something not visible from the class's module (a class
        # defined inside a function): as with a plain `eqx.Module`, such a field is not
        # checked; the others still are
        hints = _resolvable_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    return tuple((name, hints[name]) for name in names if name in hints)


def _resolvable_hints(cls: type) -> dict[str, Any]:
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        module = sys.modules.get(klass.__module__)
        for name, annotation in vars(klass).get("__annotations__", {}).items():
            if isinstance(annotation, str):
                try:
                    annotation = eval(annotation, vars(module) if module else {}, dict(vars(klass)))  # noqa: S307
                except NameError:
                    hints.pop(name, None)
                    continue
            hints[name] = annotation
    return hints


@typing.no_type_check  # runs in the caller's jaxtyping bindings
def _check_fields(module: Any, where: str) -> None:
    for name, hint in _field_hints(type(module)):
        check(getattr(module, name), hint, where, f"field `{name}`")


@_runtime.cached(maxsize=4096)
def _signature(fn: Callable) -> tuple[inspect.Signature, dict[str, Any]]:
    return inspect.signature(fn), typing.get_type_hints(fn, include_extras=True)


@typing.no_type_check  # runs in the caller's jaxtyping bindings
def check_call(
    fn: Callable, where: str, args: tuple, kwargs: dict, *, self_fields: Any = None, call: Callable | None = None
):
    """Call `fn(*args, **kwargs)` checking annotated arguments and the return value in
    one set of dimension bindings (shared with `self_fields`' annotated fields)."""
    call = fn if call is None else call
    if not typechecking_enabled():
        return call(*args, **kwargs)
    try:
        signature, hints = _signature(fn)
    except (TypeError, ValueError, NameError):
        return call(*args, **kwargs)
    token = _FIELDS.set(self_fields)
    try:
        return _check_call(signature, hints, where, args, kwargs, self_fields, call)
    finally:
        _FIELDS.reset(token)


@typing.no_type_check  # runs in the caller's jaxtyping bindings
def _check_call(signature, hints, where, args, kwargs, self_fields, call):
    with jaxtyping.jaxtyped("context"):
        if self_fields is not None:
            _check_fields(self_fields, where)
        bound = signature.bind(*args, **kwargs)
        for name, value in bound.arguments.items():
            if name not in hints:
                continue
            kind = signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:  # the annotation is each element's, as in Python
                for i, item in enumerate(value):
                    check(item, hints[name], where, f"argument `*{name}` [{i}]")
            elif kind is inspect.Parameter.VAR_KEYWORD:
                for key, item in value.items():
                    check(item, hints[name], where, f"argument `{key}` (of `**{name}`)")
            else:
                check(value, hints[name], where, f"argument `{name}`")
        result = call(*args, **kwargs)
        if "return" in hints:
            check(result, hints["return"], where, "the return value")
    return result


def _typed_method(name: str, method: Callable) -> Callable:
    @typing.no_type_check  # runs in the caller's jaxtyping bindings
    @ft.wraps(method)
    def checked(self, *args, **kwargs):
        if not typechecking_enabled():
            return method(self, *args, **kwargs)
        # named by the instance's class: a subclass inherits the method, not the name
        where = f"`{type(self).__name__}.{name}`"
        return check_call(method, where, (self, *args), kwargs, self_fields=self)

    return checked


class TypedModule(eqx.Module):
    """An `eqx.Module` whose jaxtyping annotations are checked at run time.

    Annotated fields are checked when the module is constructed; annotated methods
    (`__call__` and any other) are checked at each call, arguments and return value,
    with the fields' dimension names bound in the same scope: a field
    `weight: Float[Array, "out in"]` and an argument `x: Float[Array, "in"]` must agree.
    Inside `jax.jit` the checks run once, while tracing. Turn them off with
    [`deferax.typechecking`][], [`deferax.set_typechecking`][] or the environment variable
    `DEFERAX_TYPECHECK=0`.

    A mismatch raises [`deferax.AnnotationError`][] naming the module, the method, the
    argument or field, the expected annotation, what was received and the dimension
    bindings so far.

    !!! Example

        ```python
        class Linear(dx.TypedModule):
            weight: Float[Array, "out in"]

            def __call__(self, x: Float[Array, "in"]) -> Float[Array, "out"]:
                return self.weight @ x
        ```
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name, attr in list(vars(cls).items()):
            if not inspect.isfunction(attr) or (name.startswith("__") and name != "__call__"):
                continue
            if getattr(attr, "__annotations__", None):
                setattr(cls, name, _typed_method(name, attr))

    @typing.no_type_check  # runs in the caller's jaxtyping bindings
    def __check_init__(self):
        if typechecking_enabled():
            token = _FIELDS.set(self)
            try:
                with jaxtyping.jaxtyped("context"):
                    _check_fields(self, f"`{type(self).__name__}(...)`")
            finally:
                _FIELDS.reset(token)


def untraceable(error: Exception) -> bool:
    """Whether `error`, raised by an implementation traced on abstract values, says that JAX
    cannot trace it (a NumPy or host function), rather than that it failed on this input."""
    if isinstance(error, UNTRACEABLE):
        return True
    # a compiled extension rejecting the tracer itself: SciPy's "argument 1 must be
    # numpy.ndarray, not DynamicJaxprTracer"
    return type(error) is TypeError and "Tracer" in str(error)


UNTRACEABLE = (
    jax.errors.TracerArrayConversionError,  # `np.asarray(x)`, a NumPy or SciPy function
    jax.errors.ConcretizationTypeError,  # `float(x)`, `int(x)`, `if x > 0:`, `x.item()`
    jax.errors.TracerIntegerConversionError,  # `x` as an index: `items[x]`, `range(x)`
)


def checked_function(fn: Any) -> Any:
    """The function whose annotations `ExpensiveFn._typed_call` checks for an implementation
    `fn`: `fn` itself (a function or a method), a Module's `__call__`, or None (a
    `TypedModule` checks its own wherever it is called; other callables are not checked)."""
    if isinstance(fn, TypedModule):
        return None
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        return fn
    method = type(fn).__call__ if isinstance(fn, eqx.Module) else None
    return method if inspect.isfunction(method) else None


def annotated(fn: Any) -> bool:
    """Whether `fn` has annotations that `ExpensiveFn._typed_call` would check."""
    return bool(getattr(checked_function(fn), "__annotations__", None))
