"""The memory a backend's decode graphs will hold, estimated from the model config and the row counts before any
graph is captured, so that the start-up memory plan (runner/memory.py) counts it and refuses a plan it breaks.

CPU decode graphs (decode_graph.py): one per row count 1..MAX_ROWS, each with its own fp32 activation buffers
[rows, n], one per call that writes a new buffer: the embedding's rows, each norm's output, each linear layer's
output, the activation's, attention's output (and its per-head q/k norms', and a gated attention's q / gate
split), the short conv's, the Mamba2 step's scratch ([conv_dim | heads | d_inner] per row, y a view of its tail)
and the GDN step's scratch ([conv_dim | 2 Hv] per row) and output. A graph of r rows thus holds
r * `decode_graph_row_floats` fp32 values; the graphs of every row count hold the sum over r. Only the layer
layouts the graphs capture are counted (`row_floats` None otherwise: no graph is held); an option a part refuses
at capture time (a multiplier, a window, a MoE behind a dense layer kind) makes the estimate an over-count, never
an under-count. Tested against the buffers capturing allocates (tests/backends/test_graph_memory.py).

CUDA graphs (cuda_graph.py): per captured shape (a row count of GRAPH_ROWS, a block-table width, with the head or
not: at most MAX_GRAPHS) the packed metadata buffer the step's inputs are copied into (int64, its size from a
padding template built as the backend builds one: tested against the reference capture on the CPU) and the
step's outputs (hidden [rows, D] and the head's ids). The graphs share one memory pool for their intermediates;
it is estimated as a step's live activations at the largest row count: model/footprint.py's ACTIVATION_COPIES fp32
copies of the widest layer but the head (the basis the plan takes for a prefill step's activations) and the head's
fp32 logits. That pool figure is an estimate, not measured on a card.
"""

from __future__ import annotations

from dataclasses import dataclass

from recap.model.model_config import ModelConfig

FP32 = 4


@dataclass(frozen=True)
class StepLimits:
    """What bounds the decode steps a backend may capture: the rows of a step, a row's length, the KV block size."""

    max_num_seqs: int
    max_model_len: int
    block_size: int
# The layer kinds a CPU decode graph captures (the blocks' and mixers' capture_decode) and the feed-forwards.
_GRAPH_KINDS = ("attention", "mamba2", "short_conv", "gdn", "none")
_GRAPH_MLPS = ("dense", "none")


def _attention_floats(config: ModelConfig, layer: int) -> int:
    """q, k, v projections (+ per-head q/k norms), the attention output, o_proj's output; with an output gate,
    q_proj's [q | gate] output and its split into q and sigmoid(gate)."""
    a = config.attention_for(layer)
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    norms = q + kv if a.qk_norm == "head" else 0
    gate = 3 * q if a.output_gate else 0
    return q + 2 * kv + norms + gate + q + config.hidden_size


def _gdn_floats(config: ModelConfig) -> int | None:
    """Qwen3.5's GDN layout (the one the graphs capture): the qkv, z, b and a projections, the native step's scratch
    ([conv_dim | 2 Hv]) and output, out_proj's output."""
    g = config.gdn
    if g is None or g.projection != "qwen3_5" or g.activation not in ("silu", "swish") or g.beta_scale != 1.0:
        return None
    hv, vd = g.num_v_heads, g.value_dim
    return (g.conv_dim + vd + 2 * hv) + (g.conv_dim + 2 * hv) + vd + config.hidden_size


def _mixer_floats(config: ModelConfig, layer: int) -> int | None:
    """The buffers of layer `layer`'s mixer per row; None where the graph does not capture it."""
    kind, d = config.layer_types[layer], config.hidden_size
    if kind == "attention":
        return None if config.window_of(layer) else _attention_floats(config, layer)
    if kind == "mamba2" and config.mamba2 is not None:
        m = config.mamba2  # in_proj's output, the native step's scratch (y its tail), out_proj's output
        return m.in_proj_dim + (m.conv_dim + m.num_heads + m.d_inner) + d
    if kind == "gdn":
        return _gdn_floats(config)
    if kind == "short_conv" and config.short_conv is not None:
        return 3 * config.short_conv.dim + config.short_conv.dim + d  # in_proj, the gated conv, out_proj
    return 0 if kind == "none" else None


def _mlp_floats(config: ModelConfig, layer: int) -> int | None:
    """The buffers of layer `layer`'s feed-forward per row (0: none); None where the graph does not capture it."""
    if config.mlp_types[layer] == "none":
        return 0
    if config.mlp is None:
        return None
    i = config.mlp.intermediate_size  # gate and up (or up alone), the activation, down's output
    return (2 * i if config.mlp.gated else i) + i + config.hidden_size


def decode_graph_row_floats(config: ModelConfig, fp32: bool) -> int | None:
    """The fp32 values per row a CPU decode graph of `config` holds (module docstring); None where none is captured
    (activations not fp32, a layer kind or feed-forward the graphs do not capture, post norms)."""
    if not fp32 or config.post_norms or any(t not in _GRAPH_KINDS for t in config.layer_types):
        return None
    if any(t not in _GRAPH_MLPS for t in config.mlp_types):
        return None
    d, total = config.hidden_size, 2 * config.hidden_size  # the embedded rows and the final norm's output
    for layer in range(config.num_layers):
        mixer, mlp = _mixer_floats(config, layer), _mlp_floats(config, layer)
        if mixer is None or mlp is None:
            return None
        steps = (config.layer_types[layer] != "none") + (config.mlp_types[layer] != "none")
        total += mixer + mlp + steps * d  # each residual step's norm output
    return total


def decode_graph_bytes(config: ModelConfig, fp32: bool, rows: int) -> int:
    """The bytes the CPU decode graph of `rows` rows holds for `config` (0: no graph captured)."""
    floats = decode_graph_row_floats(config, fp32)
    return 0 if floats is None else rows * floats * FP32


def decode_graphs_bytes(config: ModelConfig, fp32: bool, max_rows: int) -> int:
    """The bytes the CPU decode graphs of 1..max_rows rows hold together."""
    return sum(decode_graph_bytes(config, fp32, r) for r in range(1, max_rows + 1))
