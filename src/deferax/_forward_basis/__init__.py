"""The forward-basis strategy (its primitive) and forward mode (`jvp`, `jvp_batch`, unit tangents)."""
