"""Running work at the same time: two halves on threads, device placement, one site's placement
and the serial switch, native thread-pool limits."""
