"""The sparse-solve family: `dx.sparse_solve`, its pattern, its solvers (`_solvers/`), the
factorisations kept for backward passes, and its path inside the compiled program."""
