"""Benchmarks: the demo and ``mita bench``, the timing suite (the ops, whole ViTs, VideoMAE, LRA models)."""
