"""Tests of computectx.memory.optim.state: the codecs, maps and stored form of optimizer state."""
