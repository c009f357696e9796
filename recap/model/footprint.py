"""The bytes a model's weights take: measured on a loaded model, or bounded below before loading.

`held_weight_bytes` walks what the model holds (parameters, buffers, and every tensor each linear layer's
implementation keeps: oneDNN's packed copy, int8 weights and scales, fbgemm's packed weight, the native
kernels' panels and tiles) and counts each storage once, so whatever layout the linear layers choose, the
figure is the bytes they hold, not a formula of them.

`serving_weight_bytes_lower_bound` is what the weights take at least in the serving format, computed from the
model built on the meta device (its parameters are exactly the checkpoint's tensors: the loader is strict),
before a byte is read: one copy of every tensor at the serving dtype, with linear weights at their quantized
width. A checkpoint that cannot fit even so is refused before loading.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from recap.model.layers.embedding import Embedding
from recap.model.layers.int4_linear import INT4_ASYM, INT4_GROUP
from recap.model.layers.linear import Linear

# Bytes per weight of a quantized linear layer's matrix, its scales included: int4 keeps an fp16 scale (and, if
# asymmetric, an fp16 min) per group of INT4_GROUP inputs (4.5 bits a weight at g32), int8 one fp32 scale per
# output row (SCALE_BYTES_PER_ROW; its row sums come on top).
QUANTIZED_BYTES_PER_WEIGHT = {"int8": 1.0, "int4": 0.5 + (4 if INT4_ASYM else 2) / INT4_GROUP,
                              "int4_k": 0.5 + 1.5 / 32 + 4 / 256}  # fmt: skip
SCALE_BYTES_PER_ROW = {"int8": 4, "int4": 0, "int4_k": 0}


@dataclass(frozen=True)
class WeightBytes:
    parameters: int  # the model's parameters and buffers
    linear_copies: int  # what the linear layers hold beyond those (packed, quantized, native-kernel copies)

    @property
    def total(self) -> int:
        return self.parameters + self.linear_copies


class _StorageCounter:
    """Bytes that live tensors reach, each byte once: per storage, the union of the ranges its tensors view (a
    view, a tied weight or a tensor kept twice counts once; tensors carved from one arena count apart)."""

    def __init__(self) -> None:
        self.ranges: dict[int, list[tuple[int, int]]] = {}  # storage -> (start, end) addresses viewed
        self.opaque = 0  # bytes of tensors with no storage to share (oneDNN's layout, fbgemm's packed weights)
        self.seen: set[int] = set()  # ids of the opaque ones

    def add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        if t.is_mkldnn:  # oneDNN's opaque layout: no storage to share, its elements are its bytes
            if id(t) not in self.seen:
                self.seen.add(id(t))
                self.opaque += t.nbytes
            return
        s = t.untyped_storage()
        start = t.data_ptr()
        end = start + _extent(t)
        self.ranges.setdefault(s.data_ptr(), []).append((start, end))

    @property
    def total(self) -> int:
        covered = 0
        for spans in self.ranges.values():
            last = -1
            for start, end in sorted(spans):
                start = max(start, last)
                if end > start:
                    covered += end - start
                    last = end
        return covered + self.opaque

    def walk(self, obj: object, depth: int = 0) -> None:
        """Every tensor `obj` holds: itself, in containers, dataclass fields, fbgemm's packed weights, and the
        attributes of recap's own objects (a kernel binding keeps tensors alive too)."""
        if depth > 6 or obj is None or isinstance(obj, (int, float, str, bool, bytes)):
            return
        if isinstance(obj, torch.Tensor):
            self.add(obj)
        elif isinstance(obj, torch.ScriptObject):
            self._packed_params(obj)
        elif isinstance(obj, (list, tuple, set)):
            for x in obj:
                self.walk(x, depth + 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                self.walk(x, depth + 1)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                self.walk(getattr(obj, f.name), depth + 1)
        elif type(obj).__module__.startswith("recap.") and hasattr(obj, "__dict__"):
            for x in vars(obj).values():
                self.walk(x, depth + 1)

    def _packed_params(self, obj: torch.ScriptObject) -> None:
        """fbgemm's packed linear weight: opaque; it holds the int8 matrix (its unpacked size) and the bias."""
        if id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        try:
            weight, bias = torch.ops.quantized.linear_unpack(obj)
        except RuntimeError:
            return  # not a packed linear weight: nothing known to count
        self.opaque += weight.numel() * weight.element_size() + (0 if bias is None else bias.nbytes)



ACTIVATION_COPIES = 3  # fp32 [tokens, widest layer output] tensors a step holds live at once


def prefill_activation_bytes(max_num_batched_tokens: int, widest_linear: int) -> int:
    """A step's largest live activations: ACTIVATION_COPIES fp32 [tokens, widest layer output] tensors."""
    return ACTIVATION_COPIES * max_num_batched_tokens * widest_linear * 4

def _extent(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to one past its last (its strides may skip some)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


def linear_layers(model: nn.Module) -> list[Linear]:
    """Every Linear of the model, and its tied head (a Linear over the embedding that is not a submodule)."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    config = getattr(model, "config", None)
    head = getattr(model, "head", None)
    if config is not None and getattr(config, "tie_word_embeddings", False) and callable(head):
        tied = head()
        if all(tied is not m for m in layers):
            layers.append(tied)
    return layers


def held_weight_bytes(model: nn.Module) -> WeightBytes:
    """What the loaded model holds (each storage once): its parameters and buffers, then what its linear layers'
    implementations keep beside them."""
    count = _StorageCounter()
    for t in [*model.parameters(), *model.buffers()]:
        count.add(t)
    parameters = count.total
    for layer in linear_layers(model):
        count.walk(layer.impl)
    return WeightBytes(parameters, count.total - parameters)


def serving_weight_bytes_lower_bound(model: nn.Module, quantization: str | None, head: str | None = None) -> int:
    """At least what `model` (built on the meta device, in the serving dtype) will hold once loaded: every
    parameter and buffer once at its dtype, a quantized linear layer's matrix at its quantized width with its
    scales (QUANTIZED_BYTES_PER_WEIGHT, SCALE_BYTES_PER_ROW), the output head at `head`'s format (None:
    `quantization`'s; model/head_format.py), tied or not (a tied int8 head's tiles are the embedding's int8
    rows: one matrix), an embedding table then as int8 rows (layers/embedding.py) (any packed copy comes on top).
    A quantization whose width is not in QUANTIZED_BYTES_PER_WEIGHT counts its matrices as nothing: still a lower
    bound."""
    formats: dict[int, str] = {}
    if quantization:
        formats = {id(m.weight): quantization for m in model.modules() if isinstance(m, Linear)}
        formats |= {id(m.weight): "int8" for m in model.modules() if isinstance(m, Embedding)}
    total = sum(_bytes_at(t, formats.get(id(t)) if t.dim() == 2 else None) for t in _unique_tensors(model))
    if quantization:
        head_format = head or quantization
        for layer in linear_layers(model):
            if layer.shares_weight and head_format != "int8":  # a tied head: its copy beside the int8 rows
                total += _bytes_at(layer.weight, head_format)  # (an int8 one's tiles are the rows themselves)
            elif _is_head(model, layer):
                total += _bytes_at(layer.weight, head_format) - _bytes_at(layer.weight, formats[id(layer.weight)])
    return total


def _unique_tensors(model: nn.Module) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen.setdefault(id(t), t)
    return list(seen.values())


def _bytes_at(t: torch.Tensor, fmt: str | None) -> int:
    """A tensor's bytes at its dtype (fmt None), or as a matrix in quantization `fmt` (its scales included)."""
    if fmt is None:
        return t.numel() * t.element_size()
    return int(t.numel() * QUANTIZED_BYTES_PER_WEIGHT.get(fmt, 0.0)) + t.shape[0] * SCALE_BYTES_PER_ROW.get(fmt, 0)


def _is_head(model: nn.Module, layer: Linear) -> bool:
    head = getattr(model, "head", None)
    return callable(head) and head() is layer


def widest_linear(model: nn.Module, vocab_size: int) -> int:
    """The widest output of the model's linear layers other than the vocabulary head (a prefill's largest
    activation per token; the head runs on sampled rows only)."""
    widths = [m.out_features for m in model.modules() if isinstance(m, Linear) and m.out_features != vocab_size]
    return max(widths, default=0)
