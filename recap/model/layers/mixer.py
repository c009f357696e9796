"""The token mixer's call contract: `mixer(x, batch, caches, layer)` -> [T, D], for every mixer a block holds.

A mixer declares the cache group it reads and writes (`cache_group`: "kv", "window" (a sliding-window
layer's blocks), "state", or None for a feed-forward standing as a layer's mixer) and takes layer `layer`'s
tensors of that group through `layer_cache`, so blocks call every mixer alike and nothing dispatches on
its class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from recap.model.cache import KVCache, ModelCaches, StateCache

CACHE_GROUPS = ("kv", "window", "state")


class Mixer(nn.Module):
    cache_group: str | None = None

    def layer_cache(self, caches: ModelCaches, layer: int) -> KVCache | StateCache:
        """Layer `layer`'s tensors in this mixer's cache group."""
        group = self.cache_group
        if group not in CACHE_GROUPS:
            raise ValueError(f"{type(self).__name__} reads no cache (cache group {group!r})")
        return getattr(caches, group)[layer]
