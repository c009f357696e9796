"""`CausalLM`: the forward every family shares, over blocks built from `config.layer_types`.

A family file only lays out the modules under the names its checkpoints use (so that the strict
loader can compare `state_dict()` keys with the file) and says where the embedding, the blocks,
the final norm and the head live.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn

from recap.kernels.metadata import ForwardBatch
from recap.model.cache import ModelCaches
from recap.model.decode_graph import MAX_ROWS, DecodeGraph, capture
from recap.model.huge_pages import HUGE_PAGE_MIN_BYTES, huge_page_zeros
from recap.model.layers.embedding import Embedding
from recap.model.layers.linear import Linear, tied_linear
from recap.model.layers.mlp import MLP
from recap.model.layers.moe import SparseMoE
from recap.model.layers.norm import RMSNorm
from recap.model.model_config import ModelConfig

logger = logging.getLogger(__name__)


def build_mlp(config: ModelConfig, layer: int, dtype: torch.dtype, **moe_names: str) -> nn.Module | None:
    """The feed-forward of layer `layer` (None if it has none); `moe_names` name the MoE's parts as on disk."""
    kind = config.mlp_types[layer]
    if kind == "moe" and config.moe is not None:
        return SparseMoE(config.hidden_size, config.moe, dtype, **moe_names)
    if kind == "dense" and config.mlp is not None:
        return MLP(config.hidden_size, config.mlp, dtype)
    return None


class CausalLM(nn.Module):
    """Decoder-only LM over a packed batch: `forward` -> final hidden [T, D]; `compute_logits` -> [N, V]."""

    # Checkpoint key prefixes this model deliberately does not load (a vision tower, an MTP head): the loader
    # skips, counts and logs them instead of refusing them as unexpected.
    ignored_checkpoint_prefixes: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self._on_huge_pages = False  # set_native_decode moved the weights (model/huge_pages.py)
        self._native_decode = False
        # The decode graphs (model/decode_graph.py) captured for one cache set by row count, None where one
        # could not be: (weak reference to those caches, graphs). Dropped whenever the kernels are bound anew.
        self._graph: tuple[weakref.ref[ModelCaches], dict[int, DecodeGraph | None]] | None = None

    # Where the parts live (a family's layout decides).
    def embedding(self) -> Embedding:
        raise NotImplementedError

    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    def final_norm(self) -> RMSNorm:
        raise NotImplementedError

    def head(self) -> Linear:
        """The output projection: `lm_head`, or a view of the embedding when tied."""
        if self.config.tie_word_embeddings:
            if getattr(self, "_tied_head", None) is None:
                # Not registered as a submodule: the tied weight has one key on disk (the embedding's).
                object.__setattr__(self, "_tied_head", tied_linear(self.embedding().weight))
            return self._tied_head
        return self.lm_head

    @staticmethod
    def rename_checkpoint_key(key: str) -> str | None:
        """Map a legacy on-disk key to this layout's key (identity by default); None: a weight the family
        knowingly does not use (named in its model file), skipped rather than refused."""
        return key

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Run every layer over the packed tokens; updates KV/state caches as the metadata says."""
        if self._native_decode and batch.num_tokens == batch.num_seqs <= MAX_ROWS:
            graph = self._decode_graph(caches, batch.num_seqs)
            if graph is not None and graph.takes(batch):
                return graph.run(batch, caches)
        h = self.embed(batch.input_ids)
        for i, block in enumerate(self.blocks()):
            h = block(h, batch, caches, i)
        return self.final_norm()(h)

    def _decode_graph(self, caches: ModelCaches, rows: int) -> DecodeGraph | None:
        """The decode graph of `rows` rows over `caches` (every row count captured at the first decode step over
        them; None: the model has a part the graph does not capture at that row count, logged once)."""
        if self._graph is None or self._graph[0]() is not caches:
            self._graph = (weakref.ref(caches), capture(self, caches, logger.info))
        return self._graph[1][rows]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embedding()(ids)
        m = self.config.embedding_multiplier
        return h if m == 1.0 else h * m

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] (rows of `forward`'s output) -> logits [N, V] in fp32 (times `logits_multiplier`)."""
        logits = self.head()(hidden.to(self.dtype)).float()
        m = self.config.logits_multiplier
        return logits if m == 1.0 else logits.mul_(m)

    def set_linear_backend(self, backend: str) -> None:
        """Switch every Linear (a tied lm_head included) to `backend`: "torch" (reference), "onednn" or "int8"."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.set_backend(backend)
        if self.config.tie_word_embeddings:
            self.head().set_backend(backend)
        self._graph = None  # it holds the old kernels' addresses

    def set_native_decode(self, on: bool) -> None:
        """Decode through recap's native kernels or not: every Linear's one-row inputs with fp32 or int8 weights
        take kernels/linear_rows.py, Mamba2 mixers' plain decode steps kernels/mamba2_step.py, attention's decode
        rows kernels/paged_decode.py (every module with a `set_native` switch). Call after set_linear_backend.
        The first time it is switched on, the weights move to transparent huge pages (model/huge_pages.py)."""
        self._native_decode, self._graph = on, None
        self._switch_native(on)
        if on and not self._on_huge_pages:
            self._on_huge_pages = self._move_weights_to_huge_pages()
            self._switch_native(on)  # bind the kernels to the moved weights

    def _switch_native(self, on: bool) -> None:
        for m in self.modules():
            if hasattr(m, "set_native"):
                m.set_native(on)
        if self.config.tie_word_embeddings:
            self.head().set_native(on)

    @property
    def on_huge_pages(self) -> bool:
        """Whether set_native_decode moved the weights to huge pages (the caches then follow: ModelCaches)."""
        return self._on_huge_pages

    def _move_weights_to_huge_pages(self) -> bool:
        """Every parameter of HUGE_PAGE_MIN_BYTES or more, and the int8 weights' packed copies, into one huge-page
        mapping; False where there is nothing to move or the platform cannot."""
        params = [p for p in self.parameters() if p.nbytes >= HUGE_PAGE_MIN_BYTES and p.is_contiguous()]
        linears = [m for m in self.modules() if isinstance(m, Linear) and m._int8_rows is not None]
        paneled = [m for m in self.modules() if isinstance(m, Linear) and m._panels is not None]
        if self.config.tie_word_embeddings and self.head()._panels is not None:
            paneled.append(self.head())
        olds = [p.data for p in params] + [m._int8_rows for m in linears] + [m._panels for m in paneled]
        news = huge_page_zeros([(tuple(t.shape), t.dtype) for t in olds])
        del olds
        if news is None:
            return False
        # one tensor at a time, each old copy freed as its new one is in place: the peak is the model plus
        # its largest tensor, not twice the model
        for p, t in zip(params, news):
            p.data = t.copy_(p.data)
        for m, t in zip(linears, news[len(params) :]):
            m._int8_rows = t.copy_(m._int8_rows)  # type: ignore[arg-type]
        for m, t in zip(paneled, news[len(params) + len(linears) :]):
            m._panels = t.copy_(m._panels)  # type: ignore[arg-type]
        return True
