"""The host family: `dx.host`, its job runner and executors, `dx.sparse_solve` and its solvers."""
