"""The host family: `dx.host`, its job runner and executors, and their timing."""
