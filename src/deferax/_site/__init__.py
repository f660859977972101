"""Each call of an `ExpensiveFn` as one equation: `Spec`, the site primitive and its rules."""
