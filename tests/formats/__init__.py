"""fp8 tests: the training layer on the reference backend, and the twins the kernels match."""
