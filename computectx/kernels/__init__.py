"""Triton kernels and their launchers; nothing here reads a ``ComputeCtx``.

Named ``computectx.kernels`` rather than a top-level ``kernels`` package: the import name
``kernels`` belongs to another PyPI distribution. Importing a kernel module imports triton,
so ``computectx`` imports these lazily and works without triton installed.
"""
