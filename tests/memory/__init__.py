"""Memory-policy tests: the accumulators, the optimizers and their state, weight loading."""
