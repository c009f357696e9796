"""Shared layers. Each reads only ModelConfig sub-configs and gets per-step metadata as an argument."""
