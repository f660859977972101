"""sparsax's `lu_solve` (KLU) and `solve` (CHOLMOD), recognised, rewritten into
`dx.sparse_solve` on the matrix's pattern: sparsax 0.9 and 0.10 make a `jax.custom_vjp` call,
matched by its backward rule's function, the foreign call inside it and the indices that rule
holds; sparsax 0.11 a `jax.lax.custom_linear_solve`, matched where it is, equation for
equation, the call sparsax makes of the same indices (traced here: `linear_solve_rule`).

`sparsax.lu_solve(Ai, Aj, Ax, b)` solves `A x = b` for the COO matrix `A` (duplicates summed),
its backward `A^T v = g`, `ct_b = v`, `ct_Ax[k] = -v[Ai[k]] x[Aj[k]]`: the true derivatives,
those `dx.sparse_solve` gives on the same pattern. `sparsax.solve(Ai, Aj, Ax, b)` takes `A` from
the upper triangle (an entry with `Ai > Aj` is ignored, one with `Ai < Aj` stands for both
`(i, j)` and `(j, i)`), and its backward is that matrix's true derivative: the rewritten call
solves the full symmetric matrix (each upper entry gathered twice, so that its cotangent is
the two positions' sum) with `symmetric=True`. `b` of shape `(n, k)` is `k` right-hand sides on
one factorisation.

sparsax keeps the last factorisations of a pattern by their entries, so its value and gradient
factor once already; what the rewrite brings is what a `dx.sparse_solve` site has: the adjoint
solved with the forward where the loss allows, overlap with other work, and the factorisation
measured fastest on the pattern. So a call is rewritten where `dx.sparse_solve` would solve it
on the host (its factorisation takes long enough to pay for a host site's round trips); a
smaller one would be solved inside the program with sparsax's own KLU, the call as it is, so it
is left (`recognise="always"` rewrites it anyway).

What the rewritten call gives for a bad matrix: KLU returns NaN for a matrix with a NaN or
infinite entry (where the solution depends on it; the rewrite gives NaN for all of `x`) and
fails on a singular one; CHOLMOD fails on both, and on a matrix that is not positive definite,
which the rewritten call solves (an answer where sparsax gives an error, never another answer).

A call batched by `jax.vmap` binds sparsax's batched foreign call and is left as it is (said in
`explain`).
"""

from __future__ import annotations

import functools as ft
import sys
import types
from typing import Any

import jax
import numpy as np

from .. import _jaxpr
from .._sparse import _program
from .._sparse._pattern import SparsePattern
from .._sparse._solver import trial_seconds
from . import _registry

MODULE = "sparsax"

# The function of each sparsax solve whose calls are recognised, its foreign call and that
# call's attribute that must be 0 (the plain solve `A x = b`, not a transposed or a factor's).
_SOLVES = types.MappingProxyType(
    {"lu_solve": ("sparsax_lu_solve_f64", "trans"), "solve": ("sparsax_solve_f64", "mode")}
)
# The foreign call each makes under `jax.vmap` (left as it is)
_BATCHED = types.MappingProxyType({"sparsax_lu_solve_batched_f64": "lu_solve", "sparsax_solve_batched_f64": "solve"})
_BATCHED_REASON = "a call batched by `jax.vmap` (sparsax's batched foreign call), which is left as it is"


def name_of(params: dict) -> str | None:
    """`"sparsax.lu_solve"` for a `custom_vjp` call made by sparsax's `lu_solve` (its
    backward rule `lu_solve.<locals>._bwd`), and so on; None for any other."""
    which = _which(params)
    return None if which is None else f"{MODULE}.{which}"


def _which(params: dict) -> str | None:
    if MODULE not in sys.modules or "bwd" not in params:
        return None
    for f in _jaxpr.rule_functions(params["bwd"]):
        if getattr(f, "__module__", None) == MODULE:
            for name in _SOLVES:
                if getattr(f, "__qualname__", None) == f"{name}.<locals>._bwd":
                    return name
    return None


def rule_for(params: dict):
    """The rule for a `custom_vjp` call made by a sparsax solve (None for any other)."""
    which = _which(params)
    return None if which is None else ft.partial(rule, which)


def rule(which: str, found, mode) -> Any:
    """A `Recognition` of sparsax's `which` call `found`, or why it is left as it is."""
    target, attribute = _SOLVES[which]
    call = _foreign_call(found.params.get("call_jaxpr"))
    if call is None or call[0] != target:
        return (
            f"not the solve `sparsax.{which}` makes of one system (batched by `jax.vmap`, or another sparsax release's)"
        )
    _, attributes, positions = call
    if attributes.get(attribute, 0) != 0 or positions != [0, 1, 2, 3] or len(found.operands) != 4:
        return f"a solve of a factor's part (`{attribute}` {attributes.get(attribute)}), not `A x = b`"
    Ai, Aj, Ax, b = found.operands
    if not (isinstance(Ai, np.ndarray) and isinstance(Aj, np.ndarray)):
        return (
            "its indices `Ai`, `Aj` are not known at trace time (they depend on an argument of the loss, or on a "
            "value traced by an enclosing transformation); make them constants to have it recognised"
        )
    if not _backward_reads(found.params, which, {"Ai": Ai, "Aj": Aj}):
        return "its backward rule's indices are not the call's"
    return _recognition(which, Ai, Aj, b, mode, _apply)


# ----------------------------------------------------------------------------- sparsax 0.11: custom_linear_solve


def linear_solve_which(params: dict) -> str | None:
    """The sparsax solve (`"lu_solve"`, `"solve"`) whose foreign call a `custom_linear_solve`
    call's `solve` makes (None for any other call)."""
    if MODULE not in sys.modules:
        return None
    call = _foreign_call(getattr(params.get("jaxprs"), "solve", None))
    if call is None:
        return None
    return next((name for name, (target, _) in _SOLVES.items() if call[0] == target), _BATCHED.get(call[0]))


def linear_solve_name_of(params: dict) -> str:
    which = linear_solve_which(params)
    return "jax.lax.custom_linear_solve" if which is None else f"{MODULE}.{which}"


def linear_solve_rule(found, mode) -> Any:
    """A `Recognition` of a `custom_linear_solve` call that sparsax 0.11's `which` made, or why
    it is left as it is. The call is sparsax's where it is, equation for equation, the call
    sparsax makes of the same indices (traced here): the same four programs, the same known
    operands, and each other operand the same value of the loss, made into it by the same
    `stop_gradient`s and changes of shape as sparsax's."""
    which = linear_solve_which(found.params)
    call = _foreign_call(found.params["jaxprs"].solve)
    if which is None or call is None:  # (never: the rule claims only these calls)
        return "not a sparsax solve"
    lengths = found.params["const_lengths"]
    target, attributes, positions = call
    if target in _BATCHED:
        return _BATCHED_REASON
    attribute = _SOLVES[which][1]
    if attributes.get(attribute, 0) != 0:
        return f"a solve of a factor's part (`{attribute}` {attributes.get(attribute)}), not `A x = b`"
    start = lengths.matvec + lengths.vecmat
    consts = found.operands[start : start + lengths.solve]
    if None in positions[:2] or max(positions[:2]) >= len(consts):
        return f"not the solve `sparsax.{which}` makes"
    Ai, Aj, b = consts[positions[0]], consts[positions[1]], found.operands[-1]
    if not (isinstance(Ai, np.ndarray) and isinstance(Aj, np.ndarray)):
        return (
            "its indices `Ai`, `Aj` are not known at trace time (they depend on an argument of the loss, or on a "
            "value traced by an enclosing transformation); make them constants to have it recognised"
        )
    if len(b.shape) not in (1, 2) or Ai.ndim != 1:
        return f"not the solve `sparsax.{which}` makes"
    reference = _sparsax_s_own(which, Ai, Aj, b, found.primitive)
    at = None if reference is None else _same_call(found, reference)
    if at is None:
        return f"not the solve `sparsax.{which}` makes of one system (its programs or operands differ)"
    return _recognition(which, Ai, Aj, b, mode, ft.partial(_apply_linear_solve, at=at))


def _sparsax_s_own(which: str, Ai: np.ndarray, Aj: np.ndarray, b, primitive):
    """The `Found` of the `custom_linear_solve` call `sparsax.which(Ai, Aj, Ax, b)` makes, traced
    here with `Ax` and `b` the program's inputs 0 and 1; None where it makes another."""
    library = sys.modules[MODULE]
    structs = (jax.ShapeDtypeStruct(Ai.shape, np.float64), jax.ShapeDtypeStruct(b.shape, np.float64))
    try:
        closed = jax.make_jaxpr(lambda Ax, b: getattr(library, which)(Ai, Aj, Ax, b))(*structs)
    except Exception:  # (sparsax refused these indices or shapes: not its call, then)
        return None
    seen = []
    _jaxpr.rewrite(closed, lambda p: p is primitive, lambda f: seen.append(f))
    return seen[0] if len(seen) == 1 else None


def _same_call(found, reference) -> int | None:
    """Where `found` is `reference` (sparsax's own call, `Ax` and `b` its inputs 0 and 1) made
    of other values of `Ax` and `b`, the position of the operand through which the
    derivatives with respect to `Ax` flow (`Ax` without a `stop_gradient`); None otherwise."""
    params, own = found.params, reference.params
    if params["const_lengths"] != own["const_lengths"] or len(found.operands) != len(reference.operands):
        return None
    for program, sparsax_s in zip(params["jaxprs"], own["jaxprs"], strict=True):
        if (program is None) != (sparsax_s is None) or (program is not None and str(program) != str(sparsax_s)):
            return None
    values: dict = {}
    for operand, source, expected, role in zip(
        found.operands, found.sources, reference.operands, reference.sources, strict=True
    ):
        if isinstance(expected, np.ndarray):  # (known in sparsax's: the indices, and what is made of them)
            if not (
                isinstance(operand, np.ndarray)
                and operand.dtype == expected.dtype
                and np.array_equal(operand, expected, equal_nan=operand.dtype.kind in "fc")
            ):
                return None
            continue
        if role is None or source is None or role[0][0] != "input" or role[1] != _as_given(source[1]):
            return None
        if values.setdefault(role[0], source[0]) != source[0]:
            return None
    positions = [i for i, role in enumerate(reference.sources) if role == (("input", 0), ())]
    if not positions or reference.sources[-1] != (("input", 1), ()):
        return None
    return positions[0]


def _as_given(how: tuple) -> tuple:
    """`how` an operand was made, less the conversion to float64 made first (sparsax's own
    `jnp.asarray(Ax, jnp.float64)` of a float32 argument: its call of the converted value is
    the call traced here, of a float64 one)."""
    while how and how[-1][0] == "convert_element_type" and "float64" in how[-1][1]:
        how = how[:-1]
    return how


def _apply_linear_solve(solve, *operands, at, gather):
    return _apply(solve, None, None, operands[at], operands[-1], gather=gather)


def _recognition(which: str, Ai: np.ndarray, Aj: np.ndarray, b, mode, apply) -> Any:
    """The call of sparsax's `which` on the indices `Ai`, `Aj` as `dx.sparse_solve` sites
    (`apply(solve, *operands, gather=...)` its outputs), where that pays (`mode` True) or
    always; otherwise why not."""
    n = b.shape[0]
    rows, cols = Ai.astype(np.int64), Aj.astype(np.int64)
    if rows.size and (min(rows.min(), cols.min()) < 0 or max(rows.max(), cols.max()) >= n):
        return f"its indices reach outside [0, {n}), which sparsax's factorisation rejects"
    if which == "lu_solve":
        gather, pattern, symmetric, nonfinite = None, SparsePattern(rows, cols, n), False, "nan"
    else:  # (the upper triangle, each entry off the diagonal at both its positions)
        upper, diagonal = np.flatnonzero(rows < cols), np.flatnonzero(rows == cols)
        gather = np.concatenate([diagonal, upper, upper])
        full_rows = np.concatenate([rows[diagonal], rows[upper], cols[upper]])
        full_cols = np.concatenate([cols[diagonal], cols[upper], rows[upper]])
        pattern, symmetric, nonfinite = SparsePattern(full_rows, full_cols, n), True, "raise"
    recognition = _registry.Recognition(
        pattern,
        ft.partial(apply, gather=None if gather is None else _registry.Static(gather)),
        factorisations=1,  # (sparsax keeps the factorisation of the forward for the backward)
        round_trips=0,
        nonfinite=nonfinite,
        singular="raise",
        symmetric=symmetric,
    )
    if mode == "always":
        return recognition
    reason = _program.refusal(pattern, np.dtype(np.float64), by_cost=True)
    if reason is None:
        seconds = trial_seconds(pattern)
        return (
            "`dx.sparse_solve` would solve it inside the program with sparsax's KLU too (a "
            f"factorisation of its pattern takes about {(seconds or 0.0) * 1e3:.2g} ms here, too little to pay for a "
            'host site\'s round trips); `recognise="always"` makes it a site'
        )
    if "pays for a host site" not in reason:
        return reason
    return _registry.Weighed(recognition)


def _backward_reads(params: dict, which: str, indices: dict) -> bool:
    """Whether sparsax's backward rule of the call closes over the indices the call's forward
    reads (its cells `Ai`, `Aj`: the same arrays, unless a tracer of the loss, which the
    forward's constants then are too)."""
    for f in _jaxpr.rule_functions(params["bwd"]):
        if getattr(f, "__qualname__", None) == f"{which}.<locals>._bwd":
            cells = dict(zip(f.__code__.co_freevars, f.__closure__ or (), strict=False))
            for name, known in indices.items():
                try:
                    held = cells[name].cell_contents
                except (KeyError, ValueError):
                    return False
                if _jaxpr.is_concrete(held) and not np.array_equal(np.asarray(held), known):
                    return False
            return True
    return False


def _foreign_call(closed) -> tuple[str, dict, list] | None:
    """`(target, attributes, positions)` of the one foreign call a sparsax solve's jaxpr makes
    (through its `custom_vmap`), `positions` the jaxpr's input that each of its operands is
    (None for another value); None where the jaxpr is anything else."""
    jaxpr = getattr(closed, "jaxpr", closed)
    if jaxpr is None or len(jaxpr.eqns) != 1 or getattr(closed, "consts", ()):
        return None
    (eqn,) = jaxpr.eqns
    if list(jaxpr.outvars) != list(eqn.outvars):
        return None
    index = {id(v): i for i, v in enumerate(jaxpr.invars)}
    positions = [index.get(id(v)) for v in eqn.invars]
    if eqn.primitive.name == "custom_vmap_call":
        inner = _foreign_call(eqn.params.get("call"))
        if inner is None:
            return None
        target, attributes, inner_positions = inner
        return target, attributes, [None if p is None else positions[p] for p in inner_positions]
    if eqn.primitive.name != "ffi_call":
        return None
    return eqn.params.get("target_name"), dict(eqn.params.get("attributes", ())), positions


def _apply(solve, Ai, Aj, Ax, b, gather):
    """`x = A^-1 b`, the columns of `b` one batch on one factorisation."""
    values = Ax if gather is None else Ax[gather.array]
    if b.ndim == 1:
        return [solve(values, b)]
    return [jax.vmap(solve, in_axes=(None, 1), out_axes=1)(values, b)]


def register() -> None:
    """Register the rule for `custom_linear_solve` (sparsax 0.11's solves; sparsax 0.9's
    `custom_vjp` calls go through that primitive's rule, `_custom_vjp`)."""
    _registry.register_builtin(
        _jaxpr.linear_solve_primitive(),
        linear_solve_rule,
        linear_solve_name_of,
        claims=lambda params: linear_solve_which(params) is not None,
    )
