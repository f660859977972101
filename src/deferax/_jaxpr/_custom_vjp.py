"""A `jax.custom_vjp` call read as a site: its forward, and its backward split in two.

A `custom_vjp_call` equation keeps JAX's own record of the call (`_internals.
custom_vjp_parts`): the forward rule, traced for the inputs that are perturbed, returns
the residuals and the outputs, and `input_fwds` says which residuals are the call's own
inputs passed through. The backward rule is a Python function of `(residuals, ct)`,
traced here once on abstract values, then split by JAX's partial evaluation with the
residuals the forward *computes* unknown:

- `adjoint(x, ct) -> partial`: the part that reads only the call's inputs and the
  cotangent, which may run before the forward has finished, or beside it;
- `combine(x, y, partial) -> ct_x`: the rest, which reads the computed residuals (taken
  from the outputs where a residual is one, otherwise returned by the forward as extra
  outputs `y` of the site), after both.

All three are `Program`s: evaluated, never differentiated, and compared by what they
compute when evaluated, so that a program traced afresh on every call compiles once.
"""

from __future__ import annotations

import dataclasses
import functools as ft
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from . import _internals as _core
from ._dependence import Location, _location
from ._keys import evaluation_key
from ._program import interpret, open_consts
from ._work import work


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A program that is only evaluated: `closed` with its constants as leading inputs,
    compared (and hashed) by what it computes when evaluated (`evaluation_key`), so that
    the same program traced again is the same compiled function."""

    program: Any  # open: (consts, *args) -> outs
    key: Any  # `evaluation_key`, or None (then by identity)
    digest: int = dataclasses.field(init=False)  # (the key's hash, made once: a large program's key is long)

    def __post_init__(self):
        object.__setattr__(self, "digest", hash(self.key) if self.key is not None else id(self))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Program):
            return NotImplemented
        return self is other or (self.key is not None and self.digest == other.digest and self.key == other.key)

    def __hash__(self) -> int:
        return self.digest

    def __call__(self, consts: Sequence[Any], args: Sequence[Any]) -> list:
        return list(_evaluate(self, tuple(consts), tuple(args)))


def program(closed) -> tuple[Program, tuple]:
    """`(program, consts)` of a closed program to be evaluated."""
    opened, consts = open_consts(closed)
    return Program(opened, evaluation_key(opened)), tuple(consts)


@ft.partial(jax.jit, static_argnums=0)
def _evaluate(program: Program, consts: tuple, args: tuple) -> list:
    return interpret(program.program, [*consts, *args])


@dataclasses.dataclass(frozen=True)
class Residual:
    """A residual the forward computes and the backward's second part reads."""

    path: str  # where it is in the forward's residuals (`res[0][1]`)
    aval: jax.ShapeDtypeStruct  # its shape and dtype
    location: Location | None  # the operation of the forward that computes it


@dataclasses.dataclass(frozen=True)
class Split:
    """A `custom_vjp` call as a site: `fwd(x) -> (*outs, *extra)` on its explicit inputs
    `x` (`extra`: the computed residuals `combine` reads that are no output),
    `adjoint(x, cts) -> partial` with `cts` the cotangents of the outputs `ct_outputs`, and
    `combine(x, y, partial) -> cts` (None: `adjoint` returns them), `cts` those of the
    inputs `ct_inputs`. `work` estimates each part (`_work.work`); `needs` are the computed
    residuals that `combine` reads."""

    fwd: Any  # closed programs
    adjoint: Any
    combine: Any | None
    n_outs: int
    ct_outputs: tuple[int, ...]
    ct_inputs: tuple[int, ...]
    work: tuple[float, float, float]  # fwd, adjoint, combine
    needs: tuple[Residual, ...]


def _struct(aval) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def _inexact(aval) -> bool:
    return bool(jnp.issubdtype(aval.dtype, jnp.inexact))


class Unreadable(Exception):
    """The call cannot be read as a site: `reason` says why (for `explain`); `needs` and
    `work` as a `Split`'s where its backward could be read (one that closes over a value of
    the loss: it can be read, not run)."""

    def __init__(self, reason: str, needs: tuple = (), work: tuple | None = None):
        super().__init__(reason)
        self.reason, self.needs, self.work = reason, needs, work


def _stale(value) -> bool:
    return isinstance(value, _core.Tracer) and _core.has_ended(value)


_STALE = (
    "its {rule} closes over a value computed in the function (a tracer of the loss's trace), which cannot be "
    "evaluated outside it"
)


@dataclasses.dataclass(frozen=True)
class _Forward:
    """The forward rule, traced: `closed` takes the explicit inputs and returns
    `(*computed residuals, *outputs)`; `residuals[j]` is `("x", operand)` for a residual
    that is an input (constants first), `("r", k)` for the `k`-th computed one, and
    `("c", value)` for a computed one that is a Python constant (a flag), which the
    backward gets as it is, as from JAX."""

    closed: Any
    residuals: list
    res_tree: Any
    n_computed: int
    stale: bool  # it closes over a value of the loss's trace (it can be read, not run)

    @property
    def jaxpr(self):
        return self.closed.jaxpr

    @property
    def computed_avals(self) -> list:
        return [v.aval for v in self.jaxpr.outvars[: self.n_computed]]

    @property
    def traced(self) -> list:
        """The residuals the backward is traced on (not the constants)."""
        return [r for r in self.residuals if r[0] != "c"]


def _forward(params: dict, perturbed: Sequence[bool]) -> _Forward:
    """The forward rule traced for the explicit inputs `perturbed` (JAX's record of it)."""
    n_consts = params["num_consts"]
    try:
        fwd_jaxpr, fwd_consts, input_fwds, res_tree = _core.custom_vjp_parts(params, perturbed)
    except jax.errors.UnexpectedTracerError:  # (JAX >= 0.12.1 refuses to trace such a forward)
        raise Unreadable(_STALE.format(rule="forward rule")) from None
    except (KeyError, TypeError, ValueError, AttributeError) as error:  # (another JAX's record)
        raise Unreadable(f"its forward rule could not be read ({type(error).__name__}: {error})") from None
    if any(f is not None and f < n_consts for f in input_fwds):
        raise Unreadable("a residual of its forward is a value it closes over, which JAX does not pass on")
    computed = iter(range(len(input_fwds)))
    residuals = []
    for f in input_fwds:
        if f is not None:
            residuals.append(("x", f - n_consts))
            continue
        k = next(computed)
        v = fwd_jaxpr.outvars[k]
        if isinstance(v, _core.Literal):
            residuals.append(("c", v.val))
        elif v in fwd_jaxpr.invars:  # (an input JAX did not see forwarded: one of `symbolic_zeros`'s)
            residuals.append(("x", fwd_jaxpr.invars.index(v)))
        else:
            residuals.append(("r", k))
    n_computed = sum(f is None for f in input_fwds)
    stale = any(_stale(c) for c in fwd_consts)
    return _Forward(_core.close(fwd_jaxpr, fwd_consts), residuals, res_tree, n_computed, stale)


def split_custom_vjp(params: dict, in_avals: Sequence[Any], perturbed: Sequence[bool], used: Sequence[bool]) -> Split:
    """The call of a `custom_vjp_call` equation with `params`, operands of `in_avals`
    (the values it closes over first, then its explicit inputs) of which `perturbed` depend
    on the differentiated inputs, and outputs of which `used` are read, as a `Split` on its
    explicit inputs: JAX differentiates a `custom_vjp` through its rules alone, so what its
    function closes over plays no part. Raises `Unreadable`."""
    n_consts = params["num_consts"]
    arg_avals, perturbed = list(in_avals[n_consts:]), list(perturbed[n_consts:])
    out_avals = list(params["call_jaxpr"].out_avals)
    forward = _forward(params, perturbed)
    n_computed, computed_avals, traced = forward.n_computed, forward.computed_avals, forward.traced
    res_avals = [arg_avals[i] if kind == "x" else computed_avals[i] for kind, i in traced]
    if any(isinstance(a, _core.AbstractRef) for a in res_avals):
        raise Unreadable("a residual of its forward is a `jax.Ref`")
    symbolic = bool(params.get("symbolic_zeros", False))
    ct_outputs = tuple(i for i, a in enumerate(out_avals) if _inexact(a) and (used[i] or not symbolic))
    ct_inputs = tuple(i for i, a in enumerate(arg_avals) if perturbed[i] and _inexact(a))
    traced_as = (forward.residuals, res_avals, out_avals, ct_outputs, symbolic, arg_avals, ct_inputs)
    closed, stale = _traced_backward(params, *traced_as)
    # the part that reads no computed residual, and the rest
    unknowns = [kind == "r" for kind, _ in traced] + [False] * len(ct_outputs)
    known, unknown, out_unknowns = _core.split_known(closed, unknowns)
    n_pe = len(known.jaxpr.outvars) - out_unknowns.count(False)  # (the residuals between the parts)
    later = any(out_unknowns)
    forwarded = [i for kind, i in traced if kind == "x"]
    unknown_ins = [i for kind, i in traced if kind == "r"]  # (the computed residuals `unknown` takes)
    reads = dict.fromkeys(range(n_computed), False)
    if later:
        reads.update(zip(unknown_ins, _used_inputs(unknown, n_pe), strict=True))
    needs = tuple(_residual(forward, j) for j in range(n_computed) if reads[j])
    estimates = (work(forward.closed), work(known), work(unknown) if later else 0.0)
    if forward.stale or stale:
        rule = "forward rule" if forward.stale else "backward rule"
        raise Unreadable(_STALE.format(rule=rule), needs=needs, work=estimates)
    alias = _aliases(forward.jaxpr, n_computed)
    extra = [j for j in range(n_computed) if reads[j] and alias[j] is None]
    n_outs = len(out_avals)

    def fwd(*x):
        outs = interpret(forward.closed, list(x))
        computed, primal = outs[:n_computed], outs[n_computed:]
        return [*primal, *(computed[j] for j in extra)]

    def adjoint(x, cts):
        return interpret(known, [*(x[i] for i in forwarded), *cts])

    def combine(x, y, partial):
        known_outs, between = partial[: len(partial) - n_pe], partial[len(partial) - n_pe :]
        slot = {j: n_outs + k for k, j in enumerate(extra)}
        computed = [
            y[alias[j]] if alias[j] is not None else y[slot[j]] if j in slot else _zeros(computed_avals[j])  # (unread)
            for j in unknown_ins
        ]
        unknown_outs, known_it = iter(interpret(unknown, [*between, *computed])), iter(known_outs)
        return [next(unknown_outs) if u else next(known_it) for u in out_unknowns]

    x_structs = [_struct(a) for a in arg_avals]
    fwd_program = jax.make_jaxpr(fwd)(*x_structs)
    y_structs = [_struct(v.aval) for v in fwd_program.jaxpr.outvars]
    adjoint_program = jax.make_jaxpr(adjoint)(x_structs, [_ct_struct(out_avals[i]) for i in ct_outputs])
    combine_program = None
    if later:
        partial_structs = [_struct(v.aval) for v in adjoint_program.jaxpr.outvars]
        combine_program = jax.make_jaxpr(combine)(x_structs, y_structs, partial_structs)
    return Split(
        fwd=fwd_program,
        adjoint=adjoint_program,
        combine=combine_program,
        n_outs=n_outs,
        ct_outputs=ct_outputs,
        ct_inputs=ct_inputs,
        work=estimates,
        needs=needs,
    )


def _traced_backward(params, residuals, res_avals, out_avals, ct_outputs, symbolic: bool, arg_avals, wanted):
    """`(closed, stale)`: the backward rule traced on abstract values, `(traced residuals,
    cts) -> cts of the inputs `wanted``, the constant residuals given as they are; `stale`:
    it closes over a value of the loss's trace (it can be read, not run)."""
    backward = _backward(params["bwd"], residuals, out_avals, ct_outputs, symbolic, arg_avals, list(wanted))
    try:
        closed = jax.make_jaxpr(backward)(
            [_struct(a) for a in res_avals], [_ct_struct(out_avals[i]) for i in ct_outputs]
        )
    except Exception as error:  # noqa: BLE001 - whatever it raises, plain JAX raises too: the call stays
        raise Unreadable(
            f"its backward rule could not be traced on abstract values ({type(error).__name__}: {error})"
        ) from None
    return closed, any(_stale(c) for c in closed.consts)


def _ct_aval(aval):
    """The type of a cotangent of a value of type `aval` (`float0` for an integer)."""
    return aval.to_ct_aval() if hasattr(aval, "to_ct_aval") else aval.to_tangent_aval()


def _ct_struct(aval) -> jax.ShapeDtypeStruct:
    ct = _ct_aval(aval)
    return jax.ShapeDtypeStruct(ct.shape, ct.dtype)


def _zeros(aval):
    """Zeros of type `aval` (a NumPy `float0` array for `float0`, which JAX cannot make)."""
    if aval.dtype == jax.dtypes.float0:
        return np.zeros(aval.shape, aval.dtype)
    return jnp.zeros(aval.shape, aval.dtype)


def _backward(bwd, residuals, out_avals, ct_outputs, symbolic: bool, arg_avals, wanted: list[int]):
    """The backward rule as a function of `(residuals, cts)`, `cts` those of the outputs
    `ct_outputs` (the others given as JAX gives them: a symbolic zero with
    `symbolic_zeros`, zeros otherwise), returning the cotangents of the explicit inputs
    `wanted` (zeros where the rule returns None)."""

    def backward(traced, cts):
        it = iter(traced)
        res = [r[1] if r[0] == "c" else next(it) for r in residuals]
        given = dict(zip(ct_outputs, cts, strict=True))
        full = []
        for i, a in enumerate(out_avals):
            if i in given:
                full.append(given[i])
            elif symbolic:
                full.append(_core.SymbolicZero(_ct_aval(a)))
            else:
                full.append(_zeros(_ct_aval(a)))
        outs = _core.bwd_cotangents(bwd.call_wrapped(*res, *full))
        return [_dense(outs[j], arg_avals[j]) for j in wanted]

    return backward


def _dense(ct, aval):
    """A cotangent the rule returned, a symbolic zero made zeros."""
    if type(ct) is _core.Zero or isinstance(ct, _core.SymbolicZero):
        return _zeros(_ct_aval(aval))
    return ct


def _used_inputs(unknown, n_pe: int) -> list[bool]:
    """Which computed residuals (the inputs after the first `n_pe`) `unknown` reads."""
    _, used = _core.dce_jaxpr(unknown.jaxpr, [True] * len(unknown.jaxpr.outvars))
    return list(used[n_pe:])


def _aliases(fwd_jaxpr, n_computed: int) -> list[int | None]:
    """For each computed residual, the output it is (the same variable), or None."""
    outs = fwd_jaxpr.outvars[n_computed:]
    found = []
    for v in fwd_jaxpr.outvars[:n_computed]:
        same = [k for k, o in enumerate(outs) if o is v and not isinstance(v, _core.Literal)]
        found.append(same[0] if same else None)
    return found


def _residual(forward: _Forward, j: int) -> Residual:
    """The `j`-th computed residual, described: its path, its type, where it is computed."""
    dummy = jtu.tree_unflatten(forward.res_tree, [0] * len(forward.residuals))
    paths = [jtu.keystr(path) for path, _ in jtu.tree_flatten_with_path(dummy)[0]]
    position = forward.residuals.index(("r", j))
    var = forward.jaxpr.outvars[j]
    maker = next((e for e in forward.jaxpr.eqns if any(o is var for o in e.outvars)), None)
    aval = forward.computed_avals[j]
    struct = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
    return Residual(f"res{paths[position]}", struct, None if maker is None else _location(maker))
