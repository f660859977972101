"""The implementations: the interfaces, `ExpensiveFn`, `dx.fuse`, the `fused` made from `fwd` and `adjoint`."""
