"""Running work at the same time: two halves on threads, device placement, the serial switch,
the gathered callback's state, native thread-pool limits."""
