"""What is decided: the public `Plan` and `Site`, the per-site `Decision`, the cost model."""
