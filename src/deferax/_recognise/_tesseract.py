"""`tesseract_jax.apply_tesseract`: its primitive `tesseract_dispatch_p`, recognised for the
Tesseracts declared with `dx.recognise_tesseract`.

A declared call becomes one `dx.host` site: its forward is the Tesseract's `apply`
endpoint, its adjoint the `vector_jacobian_product` endpoint, which takes the inputs and the
output cotangent and reads no output. So the deferred schedules submit the two requests
together (plain tesseract-jax sends the VJP request only after `apply` has answered and the
loss has been evaluated). Both requests are made exactly as tesseract-jax makes them (its
own `Jaxeract.apply` and `.vector_jacobian_product`, with the call's own parameters), so the
values are the endpoints' own.

Only the user can say that a Tesseract is pure (the same inputs give the same outputs, and
no request changes what a later one answers): deferax then runs its requests in another
order, and at once. An undeclared Tesseract's calls are left as they are.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np

from .. import _runtime
from .._checks._messages import tree_text
from .._host._host import host
from . import _registry

NAME = "tesseract_jax.apply_tesseract"

_DECLARED = _runtime.TESSERACTS
_LOCK = threading.Lock()

_BAD_TESSERACT = """`dx.recognise_tesseract`: `tesseract` must be a `tesseract_core.Tesseract` (the object \
passed to `tesseract_jax.apply_tesseract`), but got {found}.
Make one with `Tesseract.from_tesseract_api(...)`, `Tesseract.from_image(...)` or `Tesseract.from_url(...)`."""

_NOT_DECLARED = (
    "its Tesseract is not declared pure, so its requests keep their order: declare it with "
    "`dx.recognise_tesseract(tesseract)` (for the object passed to `apply_tesseract`) if the same "
    "inputs always give the same outputs and no request changes a later one's answer"
)


def recognise_tesseract(tesseract: Any) -> Any:
    """Declare `tesseract` pure, so that its `tesseract_jax.apply_tesseract` calls in a loss
    given to [`deferax.filter_value_and_grad`][] or [`deferax.filter_grad`][] become
    [`deferax.host`][] sites: the Tesseract's `apply` endpoint is the forward, its
    `vector_jacobian_product` endpoint the adjoint (which reads no output), and the deferred
    schedules send the two requests together. See "Tesseract components" in "Faster without
    rewriting".

    Pure means: the same inputs always give the same outputs, and no request changes what a
    later one answers (no hidden state, no counter). deferax cannot check it; it then sends
    the requests in another order, and at once.

    **Arguments:**

    - `tesseract`: the `tesseract_core.Tesseract` that the loss passes to
      `apply_tesseract` (matched by identity: a `with_encoding(...)` view is another object).
      deferax keeps no reference to it.

    **Returns:**

    `tesseract`, so that `t = dx.recognise_tesseract(Tesseract.from_url(...))` reads well.
    """
    Tesseract = _tesseract_class()
    if Tesseract is None or not isinstance(tesseract, Tesseract):
        raise TypeError(_BAD_TESSERACT.format(found=tree_text(tesseract)))
    with _LOCK:
        _DECLARED.add(tesseract)
    return tesseract


def _tesseract_class():
    try:
        from tesseract_core import Tesseract  # pyright: ignore[reportMissingImports]  (optional: Python 3.12+, the tesseract extra)
    except ImportError:
        return None
    return Tesseract


def _declared(tesseract: Any) -> bool:
    with _LOCK:
        return tesseract in _DECLARED


class _Slot:
    """An operand's place, as a leaf that no static argument can be mistaken for."""

    def __init__(self, index: int):
        self.index = index


def rule(operands, params):
    from tesseract_jax.tree_util import dummy_output_tree, pytree_to_path_dict, unflatten_args  # pyright: ignore[reportMissingImports]  (optional: Python 3.12+, the tesseract extra)

    p = params["params"]
    if p.eval_func != "apply":
        return f"it requests the `{p.eval_func}` endpoint (a derivative); only `apply` requests are recognised"
    client = p.client
    if not _declared(client.client):
        return _NOT_DECLARED
    if "vector_jacobian_product" not in client.available_methods:
        return "its Tesseract has no `vector_jacobian_product` endpoint, which the site's adjoint would be"
    traced = [i for i, o in enumerate(operands) if isinstance(o, jax.ShapeDtypeStruct)]
    if not traced:
        return "none of its inputs depends on the loss's arguments: there is nothing to differentiate"
    slots = tuple(_Slot(i) for i in range(len(operands)))
    slots = unflatten_args(slots, p.static_args, p.input_pytreedef, p.static_input_mask)
    paths = pytree_to_path_dict(slots, schema_paths=client.differentiable_input_paths)
    # (one entry per leaf, in the leaves' order; None where the path is not differentiable)
    for (path, mark), slot in zip(paths.items(), jax.tree.leaves(slots), strict=True):
        if isinstance(slot, _Slot) and slot.index in traced:
            if mark is None:
                return (
                    f"its input `{path}` depends on the loss's arguments but is not `Differentiable` in the "
                    "Tesseract's schema (plain tesseract-jax fails only if a gradient reaches it); pass it as a "
                    "constant to have the call recognised"
                )
            if not np.issubdtype(operands[slot.index].dtype, np.inexact):
                return f"its input `{path}` is traced with the integer dtype {operands[slot.index].dtype}"
    outputs = dummy_output_tree(p.output_pytreedef, len(p.output_avals), p.static_output_mask)
    out_paths = pytree_to_path_dict(outputs, schema_paths=client.differentiable_output_paths)
    for path, v in out_paths.items():
        if v is None:
            return (
                f"its output `{path}` is not `Differentiable` in the Tesseract's schema (tesseract-jax checks "
                "that no gradient reaches it; the site could not)"
            )
        if not np.issubdtype(p.output_avals[v].dtype, np.inexact):
            return f"its output `{path}` has the integer dtype {p.output_avals[v].dtype}"
    return _registry.Recognition(None, _apply(traced), site=_site(operands, p, traced))


def _site(operands, p, traced: list[int]):
    """The `dx.host` site: `x` the traced operands (the known ones closed over)."""
    known = {i: o for i, o in enumerate(operands) if i not in traced}
    outs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in p.output_avals)
    grads = tuple(jax.ShapeDtypeStruct(operands[i].shape, operands[i].dtype) for i in traced)
    vjp_params = p.replace(
        eval_func="vector_jacobian_product",
        has_tangent=tuple(i in traced for i in range(len(operands))),
        has_cotangent=(True,) * len(outs),
    )

    def full(x):
        given = dict(zip(traced, x, strict=True))
        return tuple(given[i] if i in given else known[i] for i in range(len(operands)))

    def apply(x):
        return _cast(p.client.apply(full(x), p), outs)

    def vector_jacobian_product(x, ct_y):
        return _cast(p.client.vector_jacobian_product((*full(x), *ct_y), vjp_params), grads)

    return host(apply, adjoint=vector_jacobian_product, out=outs, adjoint_out=grads, name=NAME)


def _cast(results, structs) -> tuple:
    return tuple(np.asarray(r, dtype=s.dtype) for r, s in zip(results, structs, strict=True))


def _apply(traced: list[int]):
    def apply(site, *operands):
        return list(site(tuple(operands[i] for i in traced)))

    return apply


def register():
    from tesseract_jax.primitive import tesseract_dispatch_p  # pyright: ignore[reportMissingImports]  (optional: Python 3.12+, the tesseract extra)

    _registry.register_recognition(tesseract_dispatch_p, rule, name=NAME)
