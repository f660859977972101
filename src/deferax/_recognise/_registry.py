"""The extension point: which primitives are recognised, and how each becomes a site.

A *rule* looks at one equation of its primitive (its operands known at trace time as NumPy
arrays, the others as `jax.ShapeDtypeStruct`s, and its parameters) and answers either a
[`deferax.Recognition`][] (how the equation's outputs are computed from its inputs: with
`dx.sparse_solve` on a pattern, or with an `ExpensiveFn` of the rule's, such as a `dx.host`
site), or a string: why this call is left as it is.

Below: the rewrite of a traced program's recognised calls (`recognise`), and what the plan
says of them (`annotate`).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import _jaxpr, _runtime
from .._checks._messages import tree_text
from .._implementation._expensive import ExpensiveFn
from .._jaxpr import shape_text
from .._plan._plan import Plan, Recognised
from .._sparse._on_host import TREATMENTS
from .._sparse._pattern import SparsePattern
from .._sparse._solve import sparse_solve
from . import _cost

_BAD_PRIMITIVE = """`dx.register_recognition`: `primitive` must be a `jax.extend.core.Primitive` (the object \
that the call binds, as `klujax.solve_f64`), but got {found}.
Find it in the library's module, or in the program: `jax.make_jaxpr(loss)(x).eqns[i].primitive`."""

_BAD_RULE = """`dx.register_recognition(name={name!r})`: `rule` must be a function \
`rule(operands, params) -> dx.Recognition | str`, but got {found}."""

_BAD_ANSWER = """`dx.register_recognition(name={name!r})`: the rule returned {found} for the call {where}. \
A rule returns a `dx.Recognition` (to rewrite the call) or a string (why it is left as it is)."""

_BAD_KIND = """`dx.Recognition`: give exactly one of `pattern` (a `dx.SparsePattern`: the call becomes \
`dx.sparse_solve` sites) and `site=` (a `dx.ExpensiveFn`, such as one made by `dx.host`: the call becomes that \
site), but got {found}."""


_BAD_TREATMENT = """`dx.Recognition`: `{what}` must be "nan", "warn" or "raise" (what the original call gives \
for {case}), but got {found!r}."""


class Recognition(eqx.Module):
    """A rule's answer for a call it rewrites: the call becomes [`deferax.sparse_solve`][]
    sites on `pattern`, or the site `site` (see "Faster without rewriting" in the docs).

    **Arguments:**

    - `pattern`: the matrix's [`deferax.SparsePattern`][], built from the call's index
      operands (which the rule receives as NumPy arrays); `None` with `site=`.
    - `apply`: `apply(solve, *operands) -> outputs`: the call's outputs (one array, or a
      list for a primitive with several) from its operands, as traced arrays, where
      `solve(values, b)` is `dx.sparse_solve(values, pattern, b)` for `values` of shape
      `(nnz,)` and `b` of shape `(n,)` (it works under `jax.vmap`). With `site=`, the
      first argument is that site instead (named after the recognised call).
    - `factorisations`: how many times the original call factors the matrix for one value
      and gradient (for the choice by cost; the rewritten call factors once).
    - `round_trips`: how many host round trips the original makes for one value and
      gradient (0 for a solver compiled into the program; a callback's count otherwise).
    - `nonfinite`, `singular`: what the original call gives for a matrix with a NaN or
      infinite entry, and for a singular one: `"nan"` (the default, JAX's way: NaN values
      and derivatives, no error), `"warn"` (NaN with a warning, as SciPy's `spsolve`), or
      `"raise"` (an error, as `klujax.solve` on a singular matrix); the rewritten call does
      the same (`dx.sparse_solve`'s arguments of those names). Only with a `pattern`.
    - `symmetric`: `True` where the original takes the matrix as symmetric without checking
      (its adjoint solves with `A` itself): the rewritten call does the same
      (`dx.sparse_solve`'s `symmetric`). Only with a `pattern`.
    - `site`: a [`deferax.ExpensiveFn`][] (one made by [`deferax.host`][], say) that
      computes the call, instead of a `pattern`. Such a call is rewritten whenever the rule
      answers so (there is no factorisation to weigh: the rule decides, and returns a
      string where the rewrite would not pay).
    """

    pattern: SparsePattern | None = eqx.field(static=True)
    apply: Callable = eqx.field(static=True)
    factorisations: int = eqx.field(default=2, static=True)
    round_trips: int = eqx.field(default=0, static=True)
    nonfinite: str = eqx.field(default="nan", static=True)
    singular: str = eqx.field(default="nan", static=True)
    symmetric: bool = eqx.field(default=False, static=True)
    # (typed `Any` so that a wrong value reaches the check below, whose message says what to give)
    site: Any = eqx.field(default=None, static=True)

    def __check_init__(self):
        if (self.pattern is None) == (self.site is None):
            given = "both" if self.site is not None else "neither"
            found = f"{given} (pattern={tree_text(self.pattern)}, site={tree_text(self.site)})"
            raise TypeError(_BAD_KIND.format(found=found))
        if self.pattern is not None and not isinstance(self.pattern, SparsePattern):
            raise TypeError(_BAD_KIND.format(found=f"pattern={tree_text(self.pattern)}"))
        if self.site is not None and not isinstance(self.site, ExpensiveFn):
            raise TypeError(_BAD_KIND.format(found=f"site={tree_text(self.site)}"))
        for what, case in (("nonfinite", "a matrix with a NaN or infinite entry"), ("singular", "a singular matrix")):
            if getattr(self, what) not in TREATMENTS:
                raise ValueError(_BAD_TREATMENT.format(what=what, case=case, found=getattr(self, what)))


class Static:
    """A NumPy array as a static argument of a rewrite (`Recognition.apply`'s), equal by its
    contents (so that equal programs compare equal)."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self._bytes = array.tobytes()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and self._bytes == other._bytes

    def __hash__(self) -> int:
        return hash(self._bytes)


@dataclasses.dataclass(frozen=True)
class Weighed:
    """A built-in rule's `Recognition` whose cost the rule weighed itself (sparsax's solve,
    which factors once already: what pays there is not the factorisations saved)."""

    recognition: Recognition


_RULES = _runtime.RECOGNITION_RULES
_LOCK = threading.Lock()
_BUILTIN_LOADED = _runtime.RECOGNITION_BUILTINS


# (`rule` typed `Any` so that a wrong value reaches the check below, whose message names the call)
def register_recognition(primitive: Any, rule: Any, *, name: str) -> None:
    """Register `rule` for the calls of `primitive`, so that [`deferax.filter_value_and_grad`][],
    [`deferax.filter_grad`][] and [`deferax.explain`][] rewrite them into
    [`deferax.sparse_solve`][] sites (or a site of the rule's own) where the rule says they can.

    **Arguments:**

    - `primitive`: the `jax.extend.core.Primitive` the call binds (matched by identity,
      never by name).
    - `rule`: `rule(operands, params) -> dx.Recognition | str`, called once per call at
      trace time. `operands` has an entry per operand of the equation: a NumPy array when
      its value is known at trace time (computed from constants alone), a
      `jax.ShapeDtypeStruct` otherwise; `params` are the equation's parameters. Return a
      [`deferax.Recognition`][] only when the rewritten call provably equals the original,
      otherwise a string saying why not ([`deferax.explain`][] shows it).
    - `name`: the call as the user writes it (`"klujax.solve"`), shown by `explain` and
      in the site's name (`"klujax.solve (recognised)"`).

    Registering a primitive again replaces its rule.
    """
    if not _jaxpr.is_primitive(primitive):
        raise TypeError(_BAD_PRIMITIVE.format(found=tree_text(primitive)))
    if not callable(rule):
        raise TypeError(_BAD_RULE.format(name=name, found=tree_text(rule)))
    with _LOCK:
        _RULES[primitive] = (str(name), rule)


class Builtin:
    """A rule built into deferax that sees the whole call (a `_jaxpr.Found`) and the
    `recognise` mode, and names each call itself (a `custom_vjp` call by its function):
    `rule(found, mode) -> Recognition | Weighed | str`, `name_of(params) -> str`, and
    `claims(params) -> bool`: whether a call of the primitive is one the rule is about at all
    (`custom_linear_solve` is, for sparsax's rule, only where sparsax's solve is inside it; the
    others are not listed in `explain`)."""

    def __init__(self, rule: Callable, name_of: Callable[[dict], str], claims: Callable[[dict], bool] | None = None):
        self.rule, self.name_of = rule, name_of
        self.claims = claims or (lambda params: True)

    def __call__(self, found: Any, mode: Any) -> Any:
        return self.rule(found, mode)


def register_builtin(
    primitive: Any, rule: Callable, name_of: Callable[[dict], str], claims: Callable[[dict], bool] | None = None
) -> None:
    """Register a `Builtin` rule for `primitive`, unless a rule was registered for it
    (`register_recognition`'s, which replaces it)."""
    with _LOCK:
        _RULES.setdefault(primitive, (name_of({}), Builtin(rule, name_of, claims)))


def rules(builtins: Iterable[tuple[str, Callable[[], None]]]) -> dict[Any, tuple[str, Callable]]:
    """The registered rules by primitive, with the built-in ones (`builtins`: `(module, register)`
    pairs, the rule modules' own table, `_recognise.BUILTINS`) for the libraries imported so far
    (looked up here, so that deferax imports none of them)."""
    for module, load in builtins:
        if module in sys.modules and module not in _BUILTIN_LOADED:
            with _LOCK:
                _BUILTIN_LOADED.add(module)
            load()
    with _LOCK:
        return dict(_RULES)


def bad_answer(name: str, where: str, found: Any) -> TypeError:
    return TypeError(_BAD_ANSWER.format(name=name, where=where, found=tree_text(found)))


_BAD_OUTPUT = """`dx.register_recognition(name={name!r})`: the rewrite of the call {where} returned {found}, \
but the call returns {expected}. `Recognition.apply` must return arrays of the call's own shapes and dtypes."""


@dataclasses.dataclass(frozen=True)
class RegisteredCall:
    """A call of a registered primitive in the loss, and what became of it."""

    name: str  # as the user wrote it: "klujax.solve"
    where: str  # "at loss.py:12 `code`"
    site: str | None  # the site's name when it was rewritten
    reason: str | None  # why it was left as it is


def recognise(closed, mode, builtins: Iterable[tuple[str, Callable[[], None]]]) -> tuple:
    """`(program, calls)`: `closed` with its recognised calls rewritten (`mode`: True, by
    cost; "always"; False: none), and a `RegisteredCall` for each call of a registered primitive
    (`builtins`: the built-in rules, as `rules` takes them)."""
    if mode is False:
        return closed, ()
    table = rules(builtins)
    if not table:
        return closed, ()
    calls: list[RegisteredCall] = []

    def decide(found):
        name, rule = table[found.primitive]
        where = _where(found.location)
        if isinstance(rule, Builtin):
            name, answer = rule.name_of(found.params), rule(found, mode)
        else:
            answer = rule(found.operands, found.params)
        if isinstance(answer, str):
            calls.append(RegisteredCall(name, where, None, answer))
            return None
        weighed = isinstance(answer, Weighed) and isinstance(rule, Builtin)
        answer = answer.recognition if weighed else answer
        if not isinstance(answer, Recognition):
            raise bad_answer(name, where, answer)
        site = f"{name} (recognised)"
        if answer.site is not None:  # (the rule's own site: no factorisation to weigh, the rule decided)
            first = dataclasses.replace(answer.site, name=site)
        else:
            complex_ = any(jnp.issubdtype(o.dtype, jnp.complexfloating) for o in found.operands)
            reason = None if mode == "always" or weighed else _cost.refusal(answer, complex_)
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

    def claims(primitive, params) -> bool:
        rule = table[primitive][1]
        return not isinstance(rule, Builtin) or rule.claims(params)

    closed, nested = _jaxpr.rewrite(closed, lambda p: p in table, decide, claims)
    for n in nested:
        if not claims(n.primitive, n.params):
            continue
        reason = f"inside {n.kind}: left as is (calls at the top level of the loss, or in a nested `jit`, are)"
        calls.append(RegisteredCall(_name(table[n.primitive], n.params), _where(n.location), None, reason))
    return closed, tuple(calls)


def _name(entry, params: dict) -> str:
    name, rule = entry
    return rule.name_of(params) if isinstance(rule, Builtin) else name


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
