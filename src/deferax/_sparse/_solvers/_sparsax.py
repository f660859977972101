"""sparsax (SuiteSparse's CHOLMOD and KLU, with the BLAS its wheel ships), where a release
tested here is installed: its FFI solve inside the program (`_program`) and its NumPy
CHOLMOD on the host (`_cholmod`)."""

from __future__ import annotations

import importlib.util
from typing import Any

from ... import _runtime

# The sparsax releases tested here: 0.9 (the last for Python 3.11) to 0.11. Each has the FFI
# solve `_lu_solve_ffi(Ai, Aj, Ax, b, trans)` and, in its compiled module, `solve_np`,
# `logdet_np` and `factorization_count`, with the same arguments.
_VERSIONS = ((0, 9), (0, 12))
_NAMES = ("solve_np", "logdet_np", "factorization_count")


@_runtime.cached(maxsize=1)
def module() -> Any:
    """sparsax, where a tested release is installed; else None."""
    if importlib.util.find_spec("sparsax") is None:
        return None
    import sparsax

    version = tuple(int(p) for p in sparsax.__version__.split(".")[:2])
    low, high = _VERSIONS
    if not (low <= version < high) or not hasattr(sparsax, "_lu_solve_ffi"):
        return None
    if not all(hasattr(sparsax._cpp, name) for name in _NAMES):
        return None
    return sparsax


def available() -> bool:
    """Whether a tested sparsax release is installed."""
    return module() is not None
