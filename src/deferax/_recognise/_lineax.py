"""`lineax.linear_solve` with a splineax solver: seen, listed in `explain`, and left as it is.

splineax's sparse direct solvers (its `KLU`, `Pardiso`, `Spsolve`, `AutoSparseLinearSolver`,
...) factor in Lineax's `init`, before the solve, through primitives of their own that return
handles (`analyze`, `factor_f64`): the factorisation is hidden state behind a handle, which a
rewrite of the solve cannot see or drop, as with klujax's handle-based API. So such a call is
never rewritten; `explain` says so, and names `deferax.lineax.SparseSolver`, the same solve
chosen by name. Other `linear_solve` calls (Lineax's own solvers, deferax's) are not listed.
"""

from __future__ import annotations

import sys
from typing import Any

from . import _registry

MODULE = "lineax"
LIBRARY = "splineax"

_LEFT = (
    "splineax's `{solver}` factors in Lineax's `init`, before the solve, and keeps the factorisation behind a "
    "handle (its `analyze`/`factor` calls), which a rewrite cannot see: never rewritten. "
    "`deferax.lineax.SparseSolver()` with a `deferax.lineax.SparseOperator` is deferax's solve, chosen by name"
)


def solver_of(params: dict) -> type | None:
    """The class of the Lineax solver of a `linear_solve` call, where it is splineax's."""
    lineax = sys.modules.get(MODULE)
    treedef = params.get("treedef")
    if lineax is None or treedef is None:
        return None
    found = None
    todo = [treedef]
    while todo:
        node = todo.pop()
        data = node.node_data()
        kind = data[0] if data is not None else None
        if isinstance(kind, type) and issubclass(kind, lineax.AbstractLinearSolver):
            found = kind
        todo.extend(node.children())
    module = getattr(found, "__module__", "") or ""
    return found if module.split(".")[0] == LIBRARY else None


def name_of(params: dict) -> str:
    solver = solver_of(params)
    return "lineax.linear_solve" if solver is None else f"lineax.linear_solve with {LIBRARY}.{solver.__name__}"


def rule(found: Any, mode: Any) -> str:
    solver = solver_of(found.params)
    return _LEFT.format(solver=getattr(solver, "__name__", "solver"))


def register() -> None:
    """Register the rule for Lineax's `linear_solve` primitive (its calls with a splineax solver)."""
    from lineax import _solve

    _registry.register_builtin(
        _solve.linear_solve_p, rule, name_of, claims=lambda params: solver_of(params) is not None
    )
