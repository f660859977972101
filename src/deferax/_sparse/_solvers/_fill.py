"""The fill SuperLU's factors showed on each sparsity pattern, by which the solvers that do not
report their factors' size (`KLU`, `Cholmod`) estimate it for the factorisation budget."""

from __future__ import annotations

import threading
from typing import Any

from ... import _runtime
from .._solver import _pattern_key

# by pattern (`_pattern_key`): the entries of SuperLU's factors `L + U` with each ordering tried
# (`AutoSparseSolver`'s trials record them; `dx.SuperLU()`'s own trial is `_runtime.ORDERINGS`)
_FILL: dict[tuple, dict[str, int]] = _runtime.store({})
_LOCK = threading.Lock()


def record(matrix: Any, ordering: str, entries: int) -> None:
    """`entries`: those of SuperLU's factors of `matrix` with `ordering`."""
    with _LOCK:
        _FILL.setdefault(_pattern_key(matrix), {})[ordering] = int(entries)


def estimated_entries(matrix: Any, triangle: int | None = None) -> tuple[int, bool]:
    """`(entries, measured)`: the entries an LU of `matrix` holds (or, given `triangle`, the
    entries of one triangle of a symmetric matrix, those of its Cholesky factor `L`),
    estimated from SuperLU's fill on its pattern (the least of its orderings', halved for
    `L`) where it was measured (`measured`); else at least the matrix's own entries
    (`triangle` for `L`), a lower bound."""
    key = _pattern_key(matrix)
    with _LOCK:
        fills = list(_FILL.get(key, {}).values())
    known = _runtime.ORDERINGS.get(key)
    if known is not None:
        fills += list(known[1].values())
    n = matrix.shape[0]
    if fills:
        least = min(fills)
        return ((least + n) // 2 if triangle is not None else least), True
    return (int(matrix.nnz) if triangle is None else triangle), False
