"""Recognised calls: sparse solves a loss already makes (`klujax.solve`, JAX's `spsolve`),
rewritten into `dx.sparse_solve` sites before the analysis. One file a recognised library,
and the extension point (`_registry`) through which others are added."""
