"""Tests of computectx.memory.optim: the optimizers, their step and their checkpoints."""
