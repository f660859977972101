"""The rewrite itself: each recognised call of a traced loss becomes `dx.sparse_solve` sites,
or the site its rule gives (a `dx.host` site for a Tesseract)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import _jaxpr
from .._host._sparse_solve import sparse_solve
from .._misc import shape_text
from .._plan._plan import Plan, Recognised
from . import _cost, _custom_vjp, _klujax, _registry, _spsolve, _tesseract

# The built-in rules: `(module, register)`, each registered once its library is imported.
BUILTINS = (
    ("jax", _custom_vjp.register),
    ("klujax", _klujax.register),
    ("jax.experimental.sparse.linalg", _spsolve.register),
    ("tesseract_jax", _tesseract.register),
)

_BAD_OUTPUT = """`dx.register_recognition(name={name!r})`: the rewrite of the call {where} returned {found}, \
but the call returns {expected}. `Recognition.apply` must return arrays of the call's own shapes and dtypes."""


@dataclasses.dataclass(frozen=True)
class RegisteredCall:
    """A call of a registered primitive in the loss, and what became of it."""

    name: str  # as the user wrote it: "klujax.solve"
    where: str  # "at loss.py:12 `code`"
    site: str | None  # the site's name when it was rewritten
    reason: str | None  # why it was left as it is


def recognise(closed, mode) -> tuple:
    """`(program, calls)`: `closed` with its recognised calls rewritten (`mode`: True, by
    cost; "always"; False: none), and a `RegisteredCall` for each call of a registered primitive."""
    if mode is False:
        return closed, ()
    rules = _registry.rules(BUILTINS)
    if not rules:
        return closed, ()
    calls: list[RegisteredCall] = []

    def decide(found):
        name, rule = rules[found.primitive]
        where = _where(found.location)
        if isinstance(rule, _registry.Builtin):
            name, answer = rule.name_of(found.params), rule(found, mode)
        else:
            answer = rule(found.operands, found.params)
        if isinstance(answer, str):
            calls.append(RegisteredCall(name, where, None, answer))
            return None
        if not isinstance(answer, _registry.Recognition):
            raise _registry.bad_answer(name, where, answer)
        site = f"{name} (recognised)"
        if answer.site is not None:  # (the rule's own site: no factorisation to weigh, the rule decided)
            first = dataclasses.replace(answer.site, name=site)
        else:
            complex_ = any(jnp.issubdtype(o.dtype, jnp.complexfloating) for o in found.operands)
            reason = None if mode == "always" else _cost.refusal(answer, complex_)
            if reason is not None:
                calls.append(RegisteredCall(name, where, None, reason))
                return None

            def first(values, b, answer=answer):
                # (a matrix with a NaN or infinite entry, or a singular one, gives what the original gives)
                return sparse_solve(
                    values,
                    answer.pattern,
                    b,
                    name=site,
                    nonfinite=answer.nonfinite,
                    singular=answer.singular,
                    symmetric=answer.symmetric,
                    where="host",  # (a site: what `explain` lists, on the host's schedules)
                )

        calls.append(RegisteredCall(name, where, site, None))

        def rewritten(*ins):
            out = answer.apply(first, *ins)
            outs = list(out) if found.multiple_results else [out]
            got = [jax.ShapeDtypeStruct(jnp.shape(o), jnp.result_type(o)) for o in outs]
            if got != list(found.outs):
                expected = _text(found.outs)
                raise TypeError(_BAD_OUTPUT.format(name=name, where=where, found=_text(got), expected=expected))
            return outs

        return rewritten

    closed, nested = _jaxpr.rewrite(closed, lambda p: p in rules, decide)
    for n in nested:
        reason = f"inside {n.kind}: left as is (calls at the top level of the loss, or in a nested `jit`, are)"
        calls.append(RegisteredCall(_name(rules[n.primitive], n.params), _where(n.location), None, reason))
    return closed, tuple(calls)


def _name(entry, params: dict) -> str:
    name, rule = entry
    return rule.name_of(params) if isinstance(rule, _registry.Builtin) else name


def _where(location) -> str:
    """`at file:line `code`` of the user's line (not the library's inside it)."""
    return dataclasses.replace(location, library=None).where()


def _text(structs) -> str:
    return ", ".join(shape_text(s) for s in structs)


def annotate(plan: Plan, calls: tuple) -> Plan:
    """`plan` with its recognised calls, each rewritten one pointing at its site."""
    if not calls:
        return plan
    used: set[int] = set()
    entries = []
    for c in calls:
        index = None
        if c.site is not None:
            index = next((s.index for s in plan.sites if s.name == c.site and s.index not in used), None)
            if index is not None:
                used.add(index)
        entries.append(Recognised(call=c.name, where=c.where, site=index, reason=c.reason))
    return dataclasses.replace(plan, recognised=tuple(entries))
