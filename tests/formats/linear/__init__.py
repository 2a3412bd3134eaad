"""Tests of computectx.formats.linear: QuantizedLinear, the router, the families, recompute."""
