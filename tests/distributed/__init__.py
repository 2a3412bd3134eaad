"""Distributed tests: 2 gloo ranks on the CPU, each compared with one process."""
