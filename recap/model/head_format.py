"""The output head's precision under a quantization: llama-quantize's `--output-tensor-type` (llama.cpp's 4-bit
formats keep `output.weight` wider: q6_K in Q4_K_M, Q4_0's own q6_K too).

`head_quantization` (load_model, EngineConfig, LLM, `recap serve --head-quantization`):
- "auto" (default): int8 under int4 and under int8. The head is the one linear layer whose error lands on the
  logits directly: on the trained default model int4 everywhere lost 0.53% perplexity to fp32 and int4 with an
  int8 head 0.27%, ahead of llama.cpp's Q4_K_M (docs/default_model.md); at 1B shapes it costs 10-14% of
  batch-1 decode time under int4 (docs/performance.md); "same" gives that back.
- "int8": the head as per-channel int8 (model/quant.py) whatever the other linears' quantization.
- "same": the head in the other linears' quantization.
Without a quantization the head stays as the other linears are: "int8" is refused there (a dense model's head
is not quantized on its own).
A tied head (a view of the embedding's table) and an untied `lm_head` both take it, each as it is loaded (on the
CPU; a tied one from the table as soon as that is in, before the table becomes int8: model/loader.py).
"""

from __future__ import annotations

from recap.model.quant import QUANTIZATIONS

HEAD_QUANTIZATIONS = ("auto", "int8", "same")


def check_head_quantization(head_quantization: str) -> None:
    """ValueError for a value not in HEAD_QUANTIZATIONS."""
    if head_quantization not in HEAD_QUANTIZATIONS:
        raise ValueError(f"unknown head_quantization {head_quantization!r}; choose one of {HEAD_QUANTIZATIONS}")


def head_backend(quantization: str | None, head_quantization: str = "auto") -> str | None:
    """The output head's linear backend under `quantization` (one of QUANTIZATIONS or None), or None where the
    model is not quantized (the head is then as the other linears). ValueError for an unknown value, and for
    "int8" without a quantization."""
    check_head_quantization(head_quantization)
    if quantization is None:
        if head_quantization == "int8":
            raise ValueError("head_quantization 'int8' applies under a quantization (int8 or int4); "
                             "this model is not quantized")  # fmt: skip
        return None
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {QUANTIZATIONS} or None")
    return quantization if head_quantization == "same" else "int8"
