"""deferax's sparse solve for Lineax and optimistix (needs `lineax`, which optimistix installs):

    import lineax as lx
    from deferax.lineax import SparseOperator, SparseSolver

    x = lx.linear_solve(SparseOperator(values, pattern), b, solver=SparseSolver()).value

See "Lineax and optimistix" in the sparse-solve docs.
"""

import importlib.util

if importlib.util.find_spec("lineax") is None:
    raise ImportError(
        "`deferax.lineax` needs Lineax, which is not installed: `pip install lineax` (optimistix installs it too)."
    )

from ._sparse._lineax import SparseOperator as SparseOperator  # noqa: E402
from ._sparse._lineax import SparseSolver as SparseSolver  # noqa: E402
