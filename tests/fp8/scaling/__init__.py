"""Tests of computectx.fp8.scaling: the operand and layer scaling state, its checkpoints, its load."""
