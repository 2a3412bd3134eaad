"""Tests of computectx.fp8.linear: Fp8Linear, the router, the two families, fp8_autocast, recompute."""
