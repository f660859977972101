"""`jax.custom_vjp` calls, recognised: each becomes an `ExpensiveFn` site whose `fwd` is
the call's forward rule and whose `adjoint` and `combine` are its backward rule split in
two (`_jaxpr.split_custom_vjp`): the part that reads only the call's inputs and the
cotangent, and the part that reads the residuals the forward computes. So where the loss's
cotangent at the call's outputs needs no output (a loss affine in them, or a few numbers
through the basis schedule), the forward and the first part run at once, as for any site
given `fwd` and `adjoint`.

A call is rewritten only where that is sound and pays:

- the first part must read nothing the forward may have left behind: a host callback
  (`pure_callback`, `io_callback`), a foreign function or a `jax.Ref` in it keeps the call
  as it is, unless the user declares the function's callbacks independent
  (`dx.recognise_custom_vjp`);
- the forward and the first part must each be estimated to take longer than the round
  trip a deferred site costs (`_jaxpr.work`, in element operations, at
  `SECONDS_PER_OPERATION`): a straight-through estimator, gradient clipping or a
  numerically stable rule stays in the program, which is then the program as traced.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import _jaxpr, _runtime, _site
from .._checks._messages import tree_text
from .._implementation._expensive import ExpensiveFn
from .._jaxpr import shape_text, zero_like
from .._plan import _cost
from . import _jax_fdm, _registry, _sparsax

NAME = "custom_vjp"

# What one element operation is taken to cost (a CPU core's order; a wave stepper's 2.5e8
# estimated operations measured 50 ms on the 2-core machine, so this is on the safe side).
SECONDS_PER_OPERATION = 1e-9
# A split pays where the smaller of the forward and the first part of the backward saves more
# than the deferred site's round trips cost (`_cost.STAGE_SECONDS` each).
PAYS_FROM = 2 * _cost.STAGE_SECONDS

_DECLARED = _runtime.CUSTOM_VJPS
_LOCK = threading.Lock()

_BAD_FUNCTION = """`dx.recognise_custom_vjp`: `f` must be a `jax.custom_vjp` function with its rules defined \
(`f.defvjp(f_fwd, f_bwd)`), but got {found}."""

_CALLBACKS = (
    "the part of its backward that needs no computed residual {what}, which may read what its forward left "
    "behind (state in a Python object, a `jax.Ref`), so it must run after the forward: left as is. If it reads "
    "nothing the forward wrote, declare it: `dx.recognise_custom_vjp({name}, callbacks_independent=True)`"
)


def recognise_custom_vjp(f: Any, *, callbacks_independent: bool = True) -> Any:
    """Declare that the host callbacks (`jax.pure_callback`, `jax.experimental.io_callback`),
    foreign functions and `jax.Ref`s in the backward rule of the `jax.custom_vjp` function
    `f` read nothing its forward rule wrote, so that the part of the backward that needs no
    residual computed by the forward may run beside the forward (see "custom_vjp calls" in
    "Faster without rewriting").

    A `custom_vjp` call whose backward calls such a function is otherwise left as it is:
    deferax cannot see whether the callback reads state the forward left behind (a
    finite-element problem whose forward sets its parameters on a Python object, say).

    **Arguments:**

    - `f`: the `jax.custom_vjp` function (after `f.defvjp(f_fwd, f_bwd)`), matched by its
      backward rule `f_bwd` (deferax keeps no reference to either).
    - `callbacks_independent`: `True` to declare it; `False` takes a declaration back.

    **Returns:**

    `f`, so that `solve = dx.recognise_custom_vjp(solve)` reads well.
    """
    bwd = _jaxpr.backward_rule(f)
    if bwd is None:
        raise TypeError(_BAD_FUNCTION.format(found=tree_text(f)))
    with _LOCK:
        if callbacks_independent:
            _DECLARED[bwd] = True
        else:
            _DECLARED.pop(bwd, None)
    return f


def _declared(params: dict) -> bool:
    """Whether the call's backward rule was declared (`recognise_custom_vjp`)."""
    with _LOCK:
        declared = list(_DECLARED.keys())
    return any(fn in declared for fn in _jaxpr.rule_functions(params.get("bwd")))


def _function_name(params: dict) -> str | None:
    call = params.get("call_jaxpr")  # (none in the parameters `name_of` is asked about first: `{}`)
    return None if call is None else _jaxpr.function_name(call)


def name_of(params: dict) -> str:
    """How `explain` names the call: "custom_vjp `f`" ("sparsax.lu_solve" for a library's solve)."""
    library = _sparsax.name_of(params) if params else None  # (`{}`: asked once, at registration)
    if library is not None:
        return library
    name = _function_name(params)
    return f"{NAME} `{name}`" if name else NAME


def decide(found, mode) -> Any:
    """A `Recognition` of the call `found` (a `_jaxpr.Found`), or why it is left as it is.
    `mode`: True (where it pays) or "always" (wherever it is sound)."""
    params = found.params
    n_consts = params.get("num_consts", 0)
    if any(_jaxpr.is_ref_type(a) for a in found.in_avals):
        return "it takes a `jax.Ref`, whose writes a site could not keep in order"
    perturbed = [d and _inexact(a) for d, a in zip(found.differentiated, found.in_avals, strict=True)]
    if not any(perturbed):
        return "none of its inputs depends on the differentiated arguments: there is nothing to differentiate"
    # (a library's solve, matched by its backward rule: shared, not split)
    library = _jax_fdm.rule_for(params) or _sparsax.rule_for(params)
    if library is not None:
        return library(found, mode)
    call = params["call_jaxpr"]
    if _calls_a_site(call):
        return "its function calls a deferax site, which keeps its own schedule"
    cost = _jaxpr.work(call)
    if mode is True and not _pays(cost):  # (a cheap function is left before its rules are traced)
        return _by_cost("its function", cost)
    try:
        split = _jaxpr.split_custom_vjp(params, found.in_avals, perturbed, found.used)
    except _jaxpr.Unreadable as unreadable:
        late = unreadable.work is not None and _late(unreadable.needs, unreadable.work)
        return f"{late}; and {unreadable.reason}" if late else unreadable.reason
    parts = [p for p in (split.fwd, split.adjoint, split.combine) if p is not None]
    if any(_calls_a_site(p) for p in parts):
        return "its rules call a deferax site, which keeps its own schedule"
    opaque = _jaxpr.opaque_call(split.adjoint)
    if opaque is not None or _jaxpr.uses_refs(split.adjoint):
        if not _declared(params):
            what = f"calls {opaque}" if opaque is not None else "uses a `jax.Ref`"
            return _CALLBACKS.format(what=what, name=_function_name(params) or "f")
    if mode is True:
        fwd, early, _ = split.work
        late = _late(split.needs, split.work)
        if late:
            return late
        if not (_pays(fwd) and _pays(early)):
            return _by_cost(
                f"its forward ({_estimate(fwd)}) beside the part of its backward that needs no computed residual",
                early,
            )
    site = _Site(split, n_consts)
    return _registry.Recognition(None, site.apply, site=site.template())


_NEEDS_RESIDUALS = (
    "its backward's work ({later}) needs {needs}, so it cannot start before the forward ends: left as is (the "
    "standard schedule); the part of its backward that needs no computed residual is {early}"
)


def _late(needs: tuple, work: tuple) -> str | None:
    """Why nothing worth running early is left of the backward, where its work needs the
    residuals the forward computes (`needs`); None otherwise."""
    _, early, later = work
    if _pays(early) or not _pays(later) or not needs:
        return None
    return _NEEDS_RESIDUALS.format(later=_estimate(later), needs=_residuals(needs), early=_estimate(early))


def _residuals(needs) -> str:
    """ "the residual `res[0]` (float64[20, 20]) that its forward computes (`scan` at ...)"."""
    named = [f"`{r.path}` ({shape_text(r.aval)})" for r in needs[:3]] + (
        [f"{len(needs) - 3} more"] if len(needs) > 3 else []
    )
    listed = named[0] if len(named) == 1 else ", ".join(named[:-1]) + " and " + named[-1]
    where = next((r.location for r in needs if r.location is not None), None)
    made = f" ({where})" if where is not None else ""
    return f"the residual{'s' if len(needs) > 1 else ''} {listed} that its forward computes{made}"


def _inexact(aval) -> bool:
    return bool(jnp.issubdtype(aval.dtype, jnp.inexact))


def _calls_a_site(closed) -> bool:
    return any(_jaxpr.contains(e, _site.PRIMITIVES) for e in closed.jaxpr.eqns)


def _pays(operations: float) -> bool:
    return operations * SECONDS_PER_OPERATION > PAYS_FROM


def _estimate(operations: float) -> str:
    if operations == float("inf"):
        return "a host call of unknown cost"
    seconds = operations * SECONDS_PER_OPERATION
    return f"about {operations:.2g} operations, {seconds * 1e3:.2g} ms"


def _by_cost(what: str, operations: float) -> str:
    return (
        f"left in place by cost: {what} is estimated at {_estimate(operations)}, too little to pay for a deferred "
        f'site\'s round trips (about {PAYS_FROM * 1e3:.2g} ms); `recognise="always"` rewrites it anyway'
    )


# ----------------------------------------------------------------------------- the site
#
# The site's input `x` is the call's explicit inputs: JAX differentiates a `custom_vjp`
# through its rules alone, and what its function closes over plays no part in them. The
# arrays its programs close over are fields of its implementations: constants to the
# derivative, and operands of the site equation.


class _Forward(eqx.Module):
    """The call's forward rule: `x -> (*outputs, *computed residuals the second part reads)`."""

    program: _jaxpr.Program = eqx.field(static=True)
    consts: tuple

    def __call__(self, x):
        return tuple(self.program(self.consts, x))


class _Cotangents(eqx.Module):
    """Where the rule's input cotangents go among the inputs `x` (zeros for those not
    differentiated)."""

    inputs: tuple[int, ...] = eqx.field(static=True)

    def __call__(self, x, cts):
        given = dict(zip(self.inputs, cts, strict=True))
        return tuple(given[i] if i in given else zero_like(a) for i, a in enumerate(x))


class _Adjoint(eqx.Module):
    """The part of the backward that reads only the call's inputs and the cotangent."""

    program: _jaxpr.Program = eqx.field(static=True)
    consts: tuple
    outputs: tuple[int, ...] = eqx.field(static=True)  # the outputs whose cotangents it reads
    placed: _Cotangents | None  # (without a second part: its result is the input cotangents)

    def __call__(self, x, ct):
        out = self.program(self.consts, (*x, *(ct[i] for i in self.outputs)))
        return tuple(out) if self.placed is None else self.placed(x, out)


class _Combine(eqx.Module):
    """The part of the backward that reads the residuals the forward computed (from `y`)."""

    program: _jaxpr.Program = eqx.field(static=True)
    consts: tuple
    placed: _Cotangents

    def __call__(self, x, y, partial):
        return self.placed(x, self.program(self.consts, (*x, *y, *partial)))


class _Site:
    """The site of one call, and how the call's outputs are computed with it (`apply`)."""

    def __init__(self, split, n_consts: int):
        self.n_consts, self.n_outs = n_consts, split.n_outs
        placed = _Cotangents(split.ct_inputs)
        combine = None if split.combine is None else _Combine(*_jaxpr.program(split.combine), placed)
        adjoint = _Adjoint(*_jaxpr.program(split.adjoint), split.ct_outputs, placed if combine is None else None)
        out = tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in split.fwd.jaxpr.outvars)
        fwd = _Forward(*_jaxpr.program(split.fwd))
        self.site = ExpensiveFn(fwd=fwd, adjoint=adjoint, combine=combine, out=out, name=NAME)

    def template(self) -> ExpensiveFn:
        """The site with the structures of its arrays in their place (what a `Recognition`
        holds, in a static field, which holds no array)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), self.site)

    def apply(self, site: ExpensiveFn, *operands):
        """The call's outputs from its operands (the values it closes over first): the site,
        named as `site` (the template, renamed after the call)."""
        named = dataclasses.replace(self.site, name=site.name)
        return list(named(tuple(operands[self.n_consts :])))[: self.n_outs]


def register() -> None:
    """Register the rule for `custom_vjp_call`, as a built-in (`_registry.register_builtin`)."""
    _registry.register_builtin(_jaxpr.custom_vjp_call_primitive(), decide, name_of)
