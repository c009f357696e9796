"""Strict safetensors loader: every model weight must be in the checkpoint and vice versa, same shapes.

Reads `model.safetensors` or a sharded `model.safetensors.index.json`, from a local folder or a hub
id (downloaded with huggingface_hub when not a local path). The on-disk key layout is the one
`save_pretrained` writes (see HF_NOTES); a family may rename legacy keys (`rename_checkpoint_key`).

Memory: no second copy of the model at any time. Each tensor is read straight into its parameter
(model/safetensors_file.py: no mapped file, no intermediate buffer where the file's dtype is the model's), and
the parameters `build_model` allocated are not resident until written. With a quantization, each linear layer
is quantized as soon as its weight and bias are in and its full-precision weight freed at once
(`Linear.set_backend`, Linear.release_weight), and the embedding made int8 rows as soon as its table is in, so
the peak is the quantized model plus one layer (read in the checkpoint's dtype where that widens exactly to the
model's: QuantizeWhenLoaded); the freed memory goes back to the OS (recap/process/heap.py) before the next
layer is read.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recap.model.families import family
from recap.model.head_format import head_backend
from recap.model.hf_config import architecture_of, read_hf_config, translate_config
from recap.model.importance import INT4_FORMATS, layer_importance, log_coverage
from recap.model.layers.embedding import Embedding, int8_tiles_of
from recap.model.layers.linear import LINEAR_BACKENDS, Linear, onednn_available
from recap.model.model_config import ModelConfig
from recap.model.models.base import CausalLM
from recap.model.prequantized import (
    Prequantized,
    PrequantizedCheckpointError,
    prequantized_format,
    serving_format,
)
from recap.model.prequantized_load import QuantizedLinears
from recap.model.quant import QUANTIZATIONS
from recap.model.safetensors_file import SafetensorsFormatError, StoredTensor, copy_stored, stored_tensors
from recap.model.trained_default import WEIGHTS_DIR
from recap.process.heap import return_free_heap

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightLoadError(RuntimeError):
    """A checkpoint does not match the model: missing / unexpected key, shape mismatch, bad files."""


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    path: Path
    ignored_weights: dict[str, int] = field(default_factory=dict)  # skipped checkpoint tensors per prefix
    # How the caller asked the model to run, acted on by the runner's backend (recap/backends/): the linear
    # layers' backend ("torch", "onednn" or "int8") and whether decode takes the native fast path.
    linear_backend: str = "torch"
    native_decode: bool = False
    # The output head's backend where the model is quantized (model/head_format.py: int8 under int4 by default);
    # None: as `linear_backend`.
    head_backend: str | None = None


def resolve_model_path(model: str | Path) -> Path:
    """A local folder as is; otherwise a hub repo id, fetched (config, weights, tokenizer) into the HF cache."""
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    if isinstance(model, Path) or str(model).startswith((".", "/", "~")) or str(model).count("/") > 1:
        raise FileNotFoundError(f"model folder {p} does not exist")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    return Path(snapshot_download(repo_id=str(model), allow_patterns=patterns))


def _shards(path: Path) -> list[Path]:
    if (path / INDEX_FILE).is_file():
        with open(path / INDEX_FILE) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise WeightLoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


def iter_checkpoint(path: Path) -> Iterator[tuple[StoredTensor, Any, str]]:
    """(where the tensor is, the open shard, the shard's name) for every tensor of the checkpoint, in file order."""
    for shard in _shards(path):
        if not shard.is_file():
            raise WeightLoadError(f"shard {shard.name} listed in the index is missing")
        with open(shard, "rb") as f:
            try:
                for stored in stored_tensors(f, shard.name):
                    yield stored, f, shard.name
            except SafetensorsFormatError as e:
                raise WeightLoadError(str(e)) from e


def checkpoint_keys(path: Path) -> list[str]:
    """Every tensor name of the checkpoint (headers only)."""
    return [stored.key for stored, _, _ in iter_checkpoint(path)]


def load_weights(model: CausalLM, path: Path, on_loaded: Callable[[nn.Module], None] | None = None,
                 quantized: QuantizedLinears | None = None,
                 reads_stored: Callable[[nn.Module], bool] | None = None) -> dict[str, int]:  # fmt: skip
    """Read every checkpoint tensor into the model, strictly (cast to the model's dtype).

    Keys under the model's `ignored_checkpoint_prefixes` (a vision tower, an MTP head) are skipped; returns how
    many were skipped per prefix (also logged). `on_loaded(module)` runs as soon as every tensor of a module's
    own (a Linear's weight and bias) is in, before the next tensor is read. `quantized`: a pre-quantized
    checkpoint's layers, whose parts (model/prequantized_load.py) stand in for their `weight` keys.
    `reads_stored(module)`: a module whose `weight` is read in the checkpoint's dtype where that widens exactly
    to the model's (QuantizeWhenLoaded.reads_stored: `on_loaded` quantizes it, reading it as fp32 either way).
    """
    params = model.state_dict(keep_vars=True)  # each entry dropped once filled: a released weight is then freed
    expected = set(params)
    owner = {key: key.rpartition(".")[0] for key in params}  # the module holding each tensor
    pending = Counter(owner.values())
    modules = dict(model.named_modules())
    seen: set[str] = set()
    ignored: Counter[str] = Counter()

    def filled(key: str) -> None:
        seen.add(key)
        pending[owner[key]] -= 1
        if on_loaded is not None and pending[owner[key]] == 0:
            on_loaded(modules[owner[key]])

    for stored, f, shard in iter_checkpoint(path):
        raw_key = stored.key
        prefix = next((p for p in model.ignored_checkpoint_prefixes if raw_key.startswith(p)), None)
        if prefix is not None:
            ignored[prefix] += 1
            continue
        done = None if quantized is None else _claim(quantized, stored, f, shard)
        if done is not None:
            if done:  # a quantized layer complete: its weight key is filled
                del params[done]
                filled(done)
            continue
        key = _model_key(model, raw_key, expected, seen, shard)
        if key is None:
            continue
        dst = params.pop(key)
        if reads_stored is not None and _widens_exactly(stored.dtype, dst.dtype) and key.endswith(".weight"):
            module = modules[owner[key]]
            if reads_stored(module) and module.weight is dst:
                dst.data = torch.empty(dst.shape, dtype=stored.dtype)  # read in place: no cast buffer either
        _copy_checked(f, stored, dst, shard)
        filled(key)
    missing = sorted(expected - seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightLoadError(f"missing key {missing[0]!r} in {path}: {', '.join(missing[:5])}{more}")
    for prefix, n in sorted(ignored.items()):
        logger.info("%s: skipped %d checkpoint tensors under %r (not part of %s)", path, n, prefix,
                    model.config.architecture)  # fmt: skip
    return dict(ignored)


def _model_key(model: CausalLM, raw_key: str, expected: set[str], seen: set[str], shard: str) -> str | None:
    """The model's name of checkpoint tensor `raw_key`, or None where the model does not read it (a weight the
    family declares unused, e.g. Nemotron-H's MTP head; a tied head stored too, equal to the embedding)."""
    key = model.rename_checkpoint_key(raw_key)
    if key is None or (key not in expected and model.config.tie_word_embeddings and key == "lm_head.weight"):
        return None
    if key not in expected:
        raise WeightLoadError(f"unexpected key {raw_key!r} in {shard} (the model has no such weight)")
    if key in seen:
        raise WeightLoadError(f"duplicate key {raw_key!r} in {shard}")
    return key


def _claim(quantized: QuantizedLinears, stored: StoredTensor, f: Any, shard: str) -> str | None:
    try:
        return quantized.claim(stored, f, shard)
    except (PrequantizedCheckpointError, SafetensorsFormatError) as e:
        raise WeightLoadError(str(e)) from e


def _copy_checked(f: Any, stored: StoredTensor, dst: torch.Tensor, shard: str) -> None:
    if stored.shape != tuple(dst.shape):
        raise WeightLoadError(f"shape mismatch for {stored.key!r}: checkpoint {stored.shape}, "
                              f"model {tuple(dst.shape)}")  # fmt: skip
    try:
        with torch.no_grad():
            copy_stored(f, stored, dst.data, shard)
    except SafetensorsFormatError as e:
        raise WeightLoadError(str(e)) from e


class QuantizeWhenLoaded:
    """load_weights' `on_loaded` for a model served quantized on the CPU (`quantization`, the output head at
    `head`: model/head_format.py): each Linear is quantized as soon as it is loaded, its full-precision weight
    freed and handed back to the OS; the backend's prepare keeps it (Linear.set_backend). A layer a pre-quantized
    checkpoint's codes built (already quantized) keeps them: quantizing them again would add error, not precision.
    The embedding becomes int8 rows as soon as its table is in (a tied head first takes its own layout from it),
    as the backend's prepare would make it (backends/base.py): a 7B model's fp32 table is 2 GiB that would
    otherwise stay beside the whole quantized model until then.
    `reads_stored(module)`: whether `module`'s weight (a Linear's, the embedding's table) is read in the
    checkpoint's own dtype where that widens exactly to the model's (bf16 or fp16 into fp32) rather than cast
    first: quantizing it gives the same codes (every quantizer reads its rows as fp32), and a bf16 head or table
    is half the fp32 one beside the model (it is the load's largest transient)."""

    def __init__(self, net: CausalLM, quantization: str, head: str | None,
                 importance: dict[Linear, torch.Tensor] | None = None) -> None:  # fmt: skip
        self.net, self.quantization, self.importance = net, quantization, importance or {}
        self.head = head or quantization
        self.tied = net.config.tie_word_embeddings
        self.formats = {} if head is None or self.tied else {net.head(): head}
        self.embedding = net.embedding() if _has_embedding(net) else None

    def reads_stored(self, module: nn.Module) -> bool:
        if isinstance(module, Linear):
            return not module.reads_weight and module.backend not in QUANTIZATIONS
        return module is self.embedding and not self.embedding.released

    def __call__(self, module: nn.Module) -> None:
        if isinstance(module, Linear):
            if self.reads_stored(module):
                backend = self.formats.get(module, self.quantization)
                row = self.importance.get(module) if backend in INT4_FORMATS else None  # (an int8 head: none)
                module.set_backend(backend, importance=row)
                return_free_heap()
        elif module is self.embedding and not self.embedding.released:
            head = self.net.head() if self.tied else None
            if head is not None:  # the head's own layout from the table before the table goes
                head.set_backend(self.head)
            self.embedding.quantize_int8(int8_tiles_of(head))
            return_free_heap()


def _has_embedding(net: CausalLM) -> bool:
    try:
        return isinstance(net.embedding(), Embedding)
    except (NotImplementedError, AttributeError):
        return False


def _widens_exactly(stored: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether every `stored` value is exactly a `dtype` value (bf16 or fp16 into fp32), and they differ."""
    return stored != dtype and stored.is_floating_point and torch.promote_types(stored, dtype) == dtype


def build_model(
    config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> CausalLM:
    """An unloaded model (uninitialized weights) for `config`, its tensors allocated on `device`."""
    with torch.device(device):
        return family(config.architecture).model_class()(config, dtype).eval()


def _load_into(net: CausalLM, path: Path, fmt: Prequantized | None, quantization: str | None,
               on_cpu: bool, head: str | None, imatrix: str | Path | None = None) -> dict[str, int]:  # fmt: skip
    """load_weights with each layer quantized as it is loaded (on the CPU; an untied head to `head`), and for a
    pre-quantized checkpoint its layers' parts converted (model/prequantized_load.py) and the conversion logged."""
    importance = None if imatrix is None else layer_importance(net, imatrix, quantization, fmt is not None)
    on_loaded = QuantizeWhenLoaded(net, quantization, head, importance) if quantization and on_cpu else None
    reads_stored = None if on_loaded is None else on_loaded.reads_stored
    if fmt is None:
        ignored = load_weights(net, path, on_loaded, reads_stored=reads_stored)
        if importance is not None:
            log_coverage(importance, net, imatrix)
        return ignored
    try:
        quantized = QuantizedLinears(fmt, net, checkpoint_keys(path), quantization, on_cpu)
    except PrequantizedCheckpointError as e:
        raise WeightLoadError(str(e)) from e
    ignored = load_weights(net, path, quantized.on_loaded(on_loaded), quantized, reads_stored)
    dtype = str(net.dtype).removeprefix("torch.")
    logger.info("%s: %s", path, quantized.summary(dtype))
    return ignored


def _served_head(net: CausalLM, head: str | None, on_cpu: bool, path: Path) -> str | None:
    """The head's backend as loaded: `head`, or a pre-quantized checkpoint's own int4 codes for an untied head
    (kept by quantize_when_loaded: int8 from them would cost bytes and gain nothing)."""
    if head is None or not on_cpu or net.config.tie_word_embeddings or net.head().backend == head:
        return head
    logger.info("%s: the output head keeps the checkpoint's %s codes", path, net.head().backend)
    return net.head().backend


def load_model(
    model: str | Path,
    dtype: torch.dtype = torch.float32,
    linear_backend: str = "auto",
    quantization: str | None = None,
    native_decode: bool = True,
    device: str | torch.device = "cpu",
    dequantize: bool = False,
    head_quantization: str = "auto",
    quantization_imatrix: str | Path | None = None,
) -> LoadedModel:
    """Translate config.json, build the family's model and load its weights strictly (the modules on their
    reference paths); the flags below are checked and recorded in the result, and the backend the runner
    builds from it (recap.backends.backend_for / prepare) acts on them. quantization_imatrix: model/importance.py.

    linear_backend: "torch" (reference F.linear), "onednn", or "auto" (oneDNN for fp32 and bf16 when
    available; measured fastest here for every row count, see layers/linear.py).
    quantization: None, or "int8" (every linear layer's weight as per-channel int8, model/quant.py; the
    rest of the model stays in `dtype`). It takes the place of the linear backend. On the CPU each layer is
    quantized as it is loaded and its fp32 weight freed (the model holds no fp32 copy of it afterwards).
    native_decode: decode takes recap's CPU fast path (recap/backends/cpu.py: native kernels, weights on huge
    pages, decode graphs), built once per machine with the C compiler (about a second). Where it cannot be
    built, or with the "torch" linear backend, the model keeps torch's kernels (a warning says why). False:
    torch's kernels only (vLLM's --enforce-eager; on a GPU: no CUDA graphs, recap/backends/cuda.py).
    device: where the weights live; off the CPU the linears are torch's and the CPU fast path does not apply.
    A pre-quantized checkpoint (config.json's `quantization_config`: model/prequantized.py) runs, with
    quantization None, in recap's nearest format: GPTQ / AWQ / compressed-tensors 4-bit as int4 (its own codes
    and scales), FP8 dequantized and quantized again as int8; a quantization named runs that instead, and
    `dequantize` (or a device other than the CPU) keeps the dequantized weights in `dtype`. One log line says
    which conversion ran; UnsupportedQuantizationError for a method recap does not read.
    head_quantization: the output head's precision under a quantization (model/head_format.py): "auto" (int8),
    "int8" or "same" (the linears'); ValueError for another value, or "int8" where the model is not quantized."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {QUANTIZATIONS} or None")
    if linear_backend not in ("auto", *LINEAR_BACKENDS):
        raise ValueError(f"unknown linear backend {linear_backend!r}; choose one of {LINEAR_BACKENDS} or 'auto'")
    if quantization is not None and linear_backend not in ("auto", quantization):
        raise ValueError(f"quantization {quantization!r} replaces the linear backend; got {linear_backend!r}")
    path = resolve_model_path(model)
    hf = read_hf_config(path)
    architecture_of(hf)  # raises UnsupportedArchitectureError before touching weights
    config = translate_config(hf)
    fmt = prequantized_format(hf)  # UnsupportedQuantizationError before building anything
    on_cpu = torch.device(device).type == "cpu"
    if fmt is not None:
        quantization = serving_format(fmt, quantization, dequantize, on_cpu)
    head = head_backend(quantization, head_quantization)
    net = build_model(config, dtype, device)
    ignored = _load_into(net, path, fmt, quantization, on_cpu, head, quantization_imatrix)
    return_free_heap()
    head = _served_head(net, head, on_cpu, path)
    if quantization is not None:
        linear_backend = quantization
    elif not on_cpu:
        linear_backend = "torch"
    elif linear_backend == "auto":
        fast = dtype in (torch.float32, torch.bfloat16) and onednn_available(dtype)
        linear_backend = "onednn" if fast else "torch"
    return LoadedModel(model=net, config=config, path=path, ignored_weights=ignored, linear_backend=linear_backend,
                       native_decode=native_decode, head_backend=head)  # fmt: skip


def load_tokenizer(path: str | Path, chat_template: str | None = None) -> Any:
    """The checkpoint's tokenizer: what transformers' AutoTokenizer loads (`load_tokenizer_auto`). For the
    shipped default models, whose tokenizer_config names TokenizersBackend, that class directly: importing
    AutoTokenizer scans every model folder of transformers (~1 s of CPU, half of a warm `recap serve` start's
    tokenizer time); the test compares the two. `chat_template` replaces the checkpoint's (`--chat-template`:
    the engine and the ingresses that hash its prompts load it alike)."""
    if bundled_tokenizers_backend(path):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        tokenizer = TokenizersBackend.from_pretrained(str(path))
    else:
        tokenizer = load_tokenizer_auto(path)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def load_tokenizer_auto(path: str | Path) -> Any:
    """The checkpoint's tokenizer through transformers' AutoTokenizer (the reference of `load_tokenizer`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def bundled_tokenizers_backend(path: str | Path) -> bool:
    """Whether `path` is one of the shipped default models' folders (recap/model/weights/) and its
    tokenizer_config.json names TokenizersBackend with no remote code: AutoTokenizer's pick for it."""
    folder = Path(path).resolve()
    if folder.parent != WEIGHTS_DIR.resolve():
        return False
    try:
        with open(folder / "tokenizer_config.json") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False
    return cfg.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in cfg
