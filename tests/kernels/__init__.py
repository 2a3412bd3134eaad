"""Kernel tests: Triton kernels against their pure-torch twins."""
