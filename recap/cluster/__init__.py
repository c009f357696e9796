"""Scaling out: replicas, the checkpoint-aware router, Ray Serve."""
