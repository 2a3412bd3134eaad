"""Tests of computectx.formats.scaling: operand and layer scaling state, checkpoints, load."""
