"""Benchmarks and studies: trace replay through the real scheduler with a cost model (no tensors)."""
