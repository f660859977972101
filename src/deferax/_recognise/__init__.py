"""Recognised calls: sparse solves a loss already makes (`klujax.solve`, JAX's `spsolve`, sparsax's solves),
rewritten into `dx.sparse_solve` sites before the analysis. One file a recognised library,
and the extension point (`_registry`) through which others are added, with the rewrite
itself; the choice by cost (`_cost`)."""

from . import _custom_vjp, _klujax, _lineax, _sparsax, _spsolve, _tesseract

# The built-in rules: `(module, register)`, each registered once its library is imported
# (`_registry.rules`). Here, above the rules, which import the registry: it imports none of them.
BUILTINS = (
    ("jax", _custom_vjp.register),
    ("klujax", _klujax.register),
    ("jax.experimental.sparse.linalg", _spsolve.register),
    ("sparsax", _sparsax.register),
    ("lineax", _lineax.register),
    ("tesseract_jax", _tesseract.register),
)
