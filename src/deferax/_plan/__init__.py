"""What is decided: the public `Plan` and `Site`, the cost model."""
