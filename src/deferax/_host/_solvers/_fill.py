"""The fill SuperLU's factors showed on each sparsity pattern, by which the solvers that do not
report their factors' size (`KLU`, `Cholmod`) estimate it for the factorisation budget."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ... import _runtime
from .._sparse_solver import _pattern_key

# by pattern (`_pattern_key`): the entries of SuperLU's factors `L + U` with each ordering tried
# (`AutoSparseSolver`'s trials record them; `dx.SuperLU()`'s own trial is `_runtime.ORDERINGS`)
_FILL: dict[tuple, dict[str, int]] = _runtime.store({})
# by pattern: the entries of its lower triangle, diagonal included (the estimate where no fill was measured)
_LOWER: dict[tuple, int] = _runtime.store({})
_LOCK = threading.Lock()


def record(matrix: Any, ordering: str, entries: int) -> None:
    """`entries`: those of SuperLU's factors of `matrix` with `ordering`."""
    with _LOCK:
        _FILL.setdefault(_pattern_key(matrix), {})[ordering] = int(entries)


def estimated_entries(matrix: Any, cholesky: bool) -> tuple[int, bool]:
    """`(entries, measured)`: the entries an LU (or, with `cholesky`, a Cholesky factor `L`)
    of `matrix` holds, estimated from SuperLU's fill on its pattern (the least of its
    orderings', halved for `L`) where it was measured (`measured`); else at least the
    matrix's own entries (those of its lower triangle for `L`), a lower bound."""
    key = _pattern_key(matrix)
    with _LOCK:
        fills = list(_FILL.get(key, {}).values())
    known = _runtime.ORDERINGS.get(key)
    if known is not None:
        fills += list(known[1].values())
    n = matrix.shape[0]
    if fills:
        least = min(fills)
        return ((least + n) // 2 if cholesky else least), True
    if cholesky:
        with _LOCK:
            lower = _LOWER.get(key)
        if lower is None:  # (1.2 ms on the 180 x 60 beam: counted once a pattern)
            coo = matrix.tocoo()
            lower = int(np.count_nonzero(coo.row >= coo.col))
            with _LOCK:
                _LOWER[key] = lower
        return lower, False
    return int(matrix.nnz), False
