"""Running work at the same time: two halves on threads, device placement, the serial switch,
one site's placement, native thread-pool limits."""
