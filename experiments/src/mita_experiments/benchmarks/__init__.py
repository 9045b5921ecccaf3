"""Benchmarks: the demo and the speed and memory suite."""
