"""The captured decode step (backends/decode_graph.py) against the module path it replays, the CPU backend's
keeping of its graphs, and the graph's ops (kernels/decode_ops.py) against their torch references."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from recap.backends import CpuBackend, TorchBackend, prepare
from recap.backends.decode_graph import MAX_ROWS, DecodeGraph
from recap.kernels import decode_ops
from recap.kernels.conv1d import causal_conv1d_update
from recap.kernels.kernel_set import KernelSet
from recap.kernels.linear_rows import Int8Rows, linear_rows_available
from recap.kernels.metadata import ForwardBatch, SeqSpec
from recap.kernels.native import load_library
from recap.kernels.paged_attention import write_kv
from recap.kernels.varlen import record_decode_positions
from recap.model.cache import ModelCaches
from recap.model.layers.activation import activation
from recap.model.layers.rotary import RotaryEmbedding
from recap.model.loader import load_model
from recap.model.models.base import CausalLM
from recap.model.quant import quantize_int8_tiles, quantize_int8_weight
from recap.model.testing import forward_step

pytestmark = pytest.mark.skipif(
    not (linear_rows_available() and decode_ops.decode_ops_available()), reason="no C compiler for native kernels"
)

BLOCK = 16


def _caches(model: CausalLM, tokens: int, rows: int = 1) -> tuple[ModelCaches, list[list[int]]]:
    """Caches for `rows` sequences of up to `tokens` tokens (running slots 2.., then a checkpoint slot per row),
    and each sequence's blocks."""
    per = 1 + tokens // BLOCK
    n = rows * per + 1
    caches = ModelCaches.allocate(model.config, n, BLOCK, 2 * rows + 2, model.dtype, num_window_blocks=n)
    return caches, [list(range(1 + r * per, 1 + (r + 1) * per)) for r in range(rows)]


def _prepared(path: Path, **flags: str | None) -> tuple[CausalLM, CpuBackend]:
    """The model of a checkpoint and the CPU backend that prepared it."""
    lm = load_model(path, **flags)  # type: ignore[arg-type]
    backend = prepare(lm)
    assert isinstance(backend, CpuBackend)
    return lm.model, backend


@dataclass
class _ModulePath:
    """The model's forward every step, with the backend's kernel set (its native prefill kernels included)."""

    kernels: KernelSet

    def forward(self, model: CausalLM, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        return model(batch, caches)


def _decode_both(
    model: CausalLM, backend: CpuBackend, prompts: list[list[int]], steps: int
) -> tuple[list, list, ModelCaches, ModelCaches]:
    """The same greedy decode of len(prompts) rows run twice on fresh caches: through the backend (the graph),
    and through the model's forward (the module path with the same native kernels and kernel set). A step whose
    token completes a block checkpoints that row (its slot rows + 2 + r, overwritten at each boundary), as the
    scheduler plans it. Returns the per-step hidden states of both and both caches."""
    rows, runs = len(prompts), []
    for through in (backend, _ModulePath(backend.kernels)):
        caches, blocks = _caches(model, max(map(len, prompts)) + steps, rows)
        specs = [SeqSpec(p, 0, blocks[r], state_slot=r + 2) for r, p in enumerate(prompts)]
        hidden, batch = forward_step(model, caches, specs, through)
        nxt = model.compute_logits(hidden[batch.logits_indices]).argmax(-1).tolist()
        pos, outs = [len(p) for p in prompts], []
        for _ in range(steps):
            specs = [SeqSpec([nxt[r]], pos[r], blocks[r], state_slot=r + 2,
                             checkpoints=[(pos[r] + 1, rows + 2 + r)] if (pos[r] + 1) % BLOCK == 0 else [])
                     for r in range(rows)]  # fmt: skip
            h, _ = forward_step(model, caches, specs, through)
            outs.append(h)
            nxt, pos = model.compute_logits(h).argmax(-1).tolist(), [q + 1 for q in pos]
        runs.append((outs, caches))
    return runs[0][0], runs[1][0], runs[0][1], runs[1][1]


def _close_but_for_code_flips(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> None:
    """Where the graph rounds other than the module path ahead of a quantized linear layer (its own norms and
    activations), a last-bit difference now and then lands an int8 / int4 activation on the next code: one step of
    that block's grid, which a recurrent state then carries to later steps (seen on Qwen3.5 at int4: 64 of 512
    hidden values off by up to 0.04). Most values must still agree to the fp32 tolerance and none by more than a
    few grid steps' worth; a wrong gate, slot or scale is off everywhere, by the values' own size."""
    near = torch.isclose(a, b, rtol=rtol, atol=atol)
    worst = float((a - b).abs().max()) if a.numel() else 0.0
    assert float(near.float().mean()) >= 0.75, f"{int((~near).sum())} of {a.numel()} values differ"
    assert worst <= 0.1 * max(float(b.abs().max()), 1.0), f"a value differs by {worst}"


@pytest.mark.parametrize(
    ("arch", "quantization", "rows", "exact"),
    [
        ("mamba2", None, 1, True), ("mamba2", "int8", 1, True), ("bamba", None, 1, False), ("bamba", "int8", 1, False),
        ("mamba2", None, 8, True), ("bamba", None, 3, False), ("bamba", "int8", 2, False), ("mamba2", "int8", 5, True),
        ("mamba2", "int4", 1, True), ("mamba2", "int4", 6, True), ("bamba", "int4", 2, False),
        ("nemotron_h_relu2", None, 1, False), ("nemotron_h_relu2", None, 4, False),
        ("nemotron_h_relu2", "int8", 2, False), ("nemotron_h_gelu_tanh", None, 1, False),
        ("nemotron_h_gelu", None, 3, False),
        ("granite_dense", None, 1, False), ("granite_dense", None, 4, False), ("granite_dense", "int8", 2, False),
        ("granite_dense", "int4", 1, False), ("granite_dense_rope", None, 3, False),
        ("lfm2", None, 1, False), ("lfm2", "int4", 1, False), ("lfm2", "int8", 3, False),
        ("qwen3_5", None, 1, False), ("qwen3_5", None, 3, False), ("qwen3_5", None, 8, False),
        ("qwen3_5", "int8", 3, False), ("qwen3_5", "int4", 1, False), ("qwen3_5", "int4", 8, False),
    ],
)  # fmt: skip
def test_graph_replays_the_module_path(
    arch: str, quantization: str | None, rows: int, exact: bool, graph_checkpoint: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Every step's hidden states and every cache after the run equal the module path's: bit for bit where the
    graph runs the same kernels (Mamba2), to fp32 rounding where it has its own activation and RoPE (Bamba's
    gated silu; Nemotron-H's non-gated MLP with relu2, gelu_tanh or gelu, and its attention); int8 weights at
    every row count; Granite-4.0-H's dense variant with its embedding, residual and attention multipliers; LFM2's
    short convs and q/k-normed attention; Qwen3.5's GDN layers, gated attention with partial RoPE and zero-centred
    norms."""
    model, backend = _prepared(graph_checkpoint(arch), quantization=quantization)
    replays: list[int] = []
    real = DecodeGraph.run
    monkeypatch.setattr(DecodeGraph, "run", lambda self, b, c: (replays.append(1), real(self, b, c))[1])
    seed = torch.randint(0, 2**31, ()).item()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.config.vocab_size, (int(torch.randint(17, 40, (), generator=g)),),
                             generator=g).tolist() for _ in range(rows)]  # fmt: skip
    steps = 19  # with the prompts, crosses block boundaries: K/V pages and state checkpoints
    graph_h, module_h, graph_c, module_c = _decode_both(model, backend, prompts, steps)
    assert len(replays) == steps, f"the graph replayed {len(replays)} of {steps} (seed {seed})"
    tol = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-5, "atol": 1e-5}
    if arch == "qwen3_5":  # the delta rule's matrix state carries the sums' last-bit differences from step to step
        tol = {"rtol": 1e-4, "atol": 1e-4}
    close = _close_but_for_code_flips if quantization and not exact else torch.testing.assert_close
    for a, b in zip(graph_h, module_h):
        close(a, b, **tol)
    for layer, st in module_c.state.items():
        for name, t in st.tensors.items():
            close(graph_c.state[layer][name], t, **tol)
            assert not graph_c.state[layer][name][:2].any(), f"layer {layer}: slots 0 and 1 (no row's) written"
    for layer, kv in module_c.kv.items():
        for name, t in kv.tensors.items():
            close(graph_c.kv[layer].tensors[name], t, **tol)
    torch.testing.assert_close(graph_c.slot_positions, module_c.slot_positions, rtol=0, atol=0)


@pytest.mark.parametrize(("arch", "why"), [("nemotron_h", "MoE"), ("nemotron_h_gelu_fast", "activation 'gelu_fast'"),
                                         ("granite_hybrid", "MoE"), ("qwen3_5_moe", "SparseMoE"),
                                         ("qwen3_next", "'qwen3_next' layout")])
def test_a_model_with_parts_it_does_not_capture_keeps_the_module_path(
    arch: str, why: str, graph_checkpoint: Callable[[str], Path], caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Nemotron-H's MoE layers, an MLP activation without a native op, Qwen3.5-MoE's experts and Qwen3-Next's
    fused GDN projections are not captured: the backend logs why once and decodes through the modules."""
    model, backend = _prepared(graph_checkpoint(arch))
    caches, (blocks,) = _caches(model, 40)
    replays: list[int] = []
    monkeypatch.setattr(DecodeGraph, "run", lambda *a: replays.append(1))
    with caplog.at_level(logging.INFO, logger="recap.backends.cpu"):
        forward_step(model, caches, [SeqSpec(list(range(5, 25)), 0, blocks, state_slot=1)], backend)
        for pos in range(20, 23):
            forward_step(model, caches, [SeqSpec([7], pos, blocks, state_slot=1)], backend)
    assert not replays and {backend.decode_graph(model, caches, r) for r in range(1, MAX_ROWS + 1)} == {None}
    logged = [r.message for r in caplog.records if "decode graph not captured" in r.message]
    assert len(logged) == 1 and why in logged[0], logged


def test_graphs_are_kept_per_model_and_cache_set_and_dropped_when_kernels_are_bound_anew(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    model, backend = _prepared(tiny_checkpoint("mamba2"))
    caches, (blocks,) = _caches(model, 40)
    forward_step(model, caches, [SeqSpec(list(range(5, 25)), 0, blocks, state_slot=1)], backend)
    forward_step(model, caches, [SeqSpec([7], 20, blocks, state_slot=1)], backend)
    first = backend.decode_graph(model, caches, 1)
    assert isinstance(first, DecodeGraph) and backend.decode_graph(model, caches, 1) is first  # kept
    other, _ = _caches(model, 40)  # a new cache set: captured anew
    assert backend.decode_graph(model, other, 1) is not first
    backend.prepare(model)  # the kernels bound anew (the weights moved again): the old graphs are gone
    assert backend.decode_graph(model, caches, 1) is not first
    int8 = CpuBackend("int8")
    int8.prepare(model)
    forward_step(model, caches, [SeqSpec([7], 21, blocks, state_slot=1)], int8)
    assert isinstance(int8.decode_graph(model, caches, 1), DecodeGraph)
    with pytest.raises(RuntimeError, match="prepared last"):  # its graphs would call the int8 kernels' old memory
        forward_step(model, caches, [SeqSpec([7], 22, blocks, state_slot=1)], backend)
    eager = TorchBackend("int8")
    eager.prepare(model)  # the native kernels off: the module path, and no CPU backend's graph runs
    forward_step(model, caches, [SeqSpec([7], 22, blocks, state_slot=1)], eager)
    with pytest.raises(RuntimeError, match="prepared last"):
        forward_step(model, caches, [SeqSpec([7], 23, blocks, state_slot=1)], int8)


def test_bad_inputs_are_errors_not_reads_out_of_bounds(tiny_checkpoint: Callable[[str], Path]) -> None:
    model, backend = _prepared(tiny_checkpoint("bamba"))
    caches, (blocks,) = _caches(model, 40)
    forward_step(model, caches, [SeqSpec(list(range(5, 25)), 0, blocks, state_slot=1)], backend)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        forward_step(model, caches, [SeqSpec([model.config.vocab_size], 20, blocks, state_slot=1)], backend)
    bad = [blocks[0], 10_000] + blocks[2:]  # the block the step reads is not in the cache
    with pytest.raises(ValueError, match="outside the cache"):
        forward_step(model, caches, [SeqSpec([7], 20, bad, state_slot=1)], backend)


@pytest.mark.parametrize(("rot", "dh", "angles", "rows"), [(8, 8, None, 1), (6, 10, None, 3), (16, 24, 3, 2),
                                                     (0, 12, None, 4)])  # fmt: skip
def test_rope_write_kv_matches_rotary_and_write_kv(rot: int, dh: int, angles: int | None, rows: int) -> None:
    g = torch.Generator().manual_seed(rot * 100 + dh)
    hq, hkv, nb, bs = 6, 2, 5, 4
    q, k, v = (torch.randn(rows, h, dh, generator=g) for h in (hq, hkv, hkv))
    pos = torch.randint(0, 50, (rows,), generator=g)
    caches = [torch.zeros(nb, bs, hkv, dh) for _ in range(4)]
    slots = torch.randperm(nb * bs, generator=g)[:rows]
    q_ref, k_ref = q.clone(), k.clone()
    inv = None
    if rot:
        rope = RotaryEmbedding(rot, 10000.0, angles)
        cos, sin = rope.cos_sin(pos, torch.float32)
        q_ref, k_ref = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        inv = rope.inv_freq
    write_kv(k_ref, v, caches[2], caches[3], slots)
    decode_ops.rope_write_kv(q, k, v, pos, inv, caches[0], caches[1], slots)
    torch.testing.assert_close(q, q_ref, rtol=0, atol=0)
    torch.testing.assert_close(caches[0], caches[2], rtol=0, atol=0)
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0)
    with pytest.raises(ValueError, match="outside"):
        decode_ops.rope_write_kv(q, k, v, pos, inv, caches[0], caches[1], torch.full((rows,), nb * bs))


@pytest.mark.parametrize(("rot", "theta"), [(64, 10000.0), (128, 1e6), (32, 5e5)])
def test_rope_write_kv_is_bit_exact_over_long_contexts(rot: int, theta: float) -> None:
    """The native RoPE's cos/sin (libm, fp64 rounded) against RotaryEmbedding's (torch, fp64 rounded) over
    positions up to 256k: equal bit for bit, so a verify or decode graph and the module path quantize the same
    attention outputs (fp32 cos/sin differed in the last bit for ~10% of angles and moved int8 activations)."""
    g = torch.Generator().manual_seed(rot)
    rows, hq, dh = 4096, 1, rot
    pos = torch.cat((torch.arange(1024), torch.randint(1024, 1 << 18, (rows - 1024,), generator=g)))
    q, k, v = torch.randn(rows, hq, dh, generator=g), torch.randn(rows, hq, dh, generator=g), torch.zeros(rows, hq, dh)
    rope = RotaryEmbedding(rot, theta)
    cos, sin = rope.cos_sin(pos, torch.float32)
    q_ref = rope.apply(q, cos, sin)
    decode_ops.rope_write_kv(q, k, v, pos, rope.inv_freq, torch.zeros(rows, 1, hq, dh), torch.zeros(rows, 1, hq, dh),
                             torch.arange(rows))  # fmt: skip
    torch.testing.assert_close(q, q_ref, rtol=0, atol=0)


@pytest.mark.parametrize(("rows", "n"), [(1, 1), (1, 15), (3, 16), (2, 1023)])
def test_small_ops_match_torch(rows: int, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    h, x = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g)
    torch.testing.assert_close(decode_ops.add_(h.clone(), x), h + x, rtol=0, atol=0)
    for m in (0.22, 12.0, 1.0 / 3):  # muP multipliers (Granite's residual and embedding ones): rounded as torch's
        torch.testing.assert_close(decode_ops.add_scaled_(h.clone(), x, m), h + x * m, rtol=0, atol=0)
        torch.testing.assert_close(decode_ops.scale_(x.clone(), m), x * m, rtol=0, atol=0)
    weight = torch.randn(11, n, generator=g)
    ids = torch.randint(0, 11, (rows,), generator=g)
    assert torch.equal(decode_ops.embed_rows(weight, ids), F.embedding(ids, weight))
    for bad in (-1, 11):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            decode_ops.embed_rows(weight, torch.tensor([0, bad]))
    q, scales = quantize_int8_weight(weight)
    table = Int8Rows.table(q, scales)
    want = q[ids].float() * scales[ids][:, None]
    assert torch.equal(table.lookup_ref(ids), want) and torch.equal(decode_ops.embed_rows_int8(table, ids), want)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decode_ops.embed_rows_int8(table, torch.tensor([11]))


@pytest.mark.parametrize(("vocab", "d"), [(11, 5), (16, 64), (37, 130), (9, 200)])
def test_int8_rows_read_from_a_tied_heads_tiles_equal_the_table(vocab: int, d: int) -> None:
    """The tiles of quantize_int8_tiles (rows in groups of 8, values 64 at a time, padded) read as the table
    quantize_int8_weight makes: the reference and the native lookup, every row, ragged last group and chunk."""
    weight = torch.randn(vocab, d, generator=torch.Generator().manual_seed(vocab * d))
    q, scales = quantize_int8_weight(weight)
    t = quantize_int8_tiles(weight, None)
    tiled, ids = Int8Rows.tiled(t.tiles, t.scales, d), torch.arange(vocab).flip(0)
    want = Int8Rows.table(q, scales).lookup_ref(ids)
    assert torch.equal(tiled.lookup_ref(ids), want) and torch.equal(decode_ops.embed_rows_int8(tiled, ids), want)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decode_ops.embed_rows_int8(tiled, torch.tensor([vocab]))


@pytest.mark.parametrize(("rows", "n"), [(1, 1), (1, 15), (3, 16), (2, 1023), (5, 37)])
@pytest.mark.parametrize("name", sorted(decode_ops.NATIVE_ACTIVATIONS))
def test_activation_ops_match_torch_gated_and_not(name: str, rows: int, n: int) -> None:
    """Each native activation against layers/activation.py's: act(gate) * up over the column halves of one
    [gate | up] buffer, and act(x) alone; relu and relu2 exactly, the others to fp32 rounding."""
    g = torch.Generator().manual_seed(n + rows)
    gate_up = torch.randn(rows, 2 * n, generator=g) * 4
    gate_up[0, 0] = 0.0
    gate, up = gate_up[:, :n], gate_up[:, n:]
    act = activation(name)
    # gelu: 1 + erf(v) cancels in the negative tail, where libm's erf and torch's differ in the last bits
    tol = {"rtol": 0.0, "atol": 0.0} if name.startswith("relu") else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(decode_ops.activation_mul(name, gate, up), act(gate) * up, **tol)
    x = torch.empty(rows, n).copy_(gate)  # rows n floats apart, not 2n
    torch.testing.assert_close(decode_ops.activation_mul(name, x), act(x), **tol)
    with pytest.raises(ValueError, match="row stride"):
        decode_ops.activation_mul(name, x, up)
    with pytest.raises(KeyError):
        decode_ops.activation_mul("gelu_fast", x)


@pytest.mark.parametrize(("rows", "d", "k", "bias"), [(1, 1, 2, False), (1, 48, 3, True), (3, 37, 4, False),
                                                      (2, 64, 65, True)])  # fmt: skip
def test_short_conv_step_matches_the_module_path(rows: int, d: int, k: int, bias: bool) -> None:
    """recap_short_conv_step against ShortConv's decode arithmetic (B * x, causal_conv1d_update, C * y,
    record_decode_positions): outputs, windows and slot positions bit for bit; with destination slots, a chain
    (row r reading what row r - 1 wrote) equals the rows stepped one at a time; bad slots are errors."""
    g = torch.Generator().manual_seed(d + k)
    proj, w = torch.randn(rows, 3 * d, generator=g), torch.randn(d, k, generator=g)
    b = torch.randn(d, generator=g) if bias else None
    state = torch.randn(rows + 3, d, k - 1, generator=g)
    slots, positions = torch.randperm(rows + 3, generator=g)[:rows], torch.randint(0, 99, (rows,), generator=g)
    sp, sp_ref, state_ref = torch.full((rows + 3,), -1), torch.full((rows + 3,), -1), state.clone()
    out = decode_ops.short_conv_step(proj, w, b, state, slots, positions, sp)
    bb, c, x = proj.chunk(3, dim=-1)
    ref = c * causal_conv1d_update(bb * x, state_ref, w, b, slots, None)
    record_decode_positions(sp_ref, slots, positions)
    for got, want in ((out, ref), (state, state_ref), (sp, sp_ref)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    src, dst = torch.tensor([0] + [rows + r for r in range(rows - 1)]), torch.arange(rows) + rows  # a chain
    chained, one_by_one = state.clone(), state.clone()
    out = decode_ops.short_conv_step(proj, w, b, chained, src, positions, sp, dst)
    for r in range(rows):
        one_by_one[dst[r]] = one_by_one[src[r]]
        want = decode_ops.short_conv_step(proj[r : r + 1], w, b, one_by_one, dst[r : r + 1], positions[r : r + 1], sp)
        torch.testing.assert_close(out[r : r + 1], want, rtol=0, atol=0)
    torch.testing.assert_close(chained, one_by_one, rtol=0, atol=0)
    with pytest.raises(ValueError, match="outside the state"):
        decode_ops.short_conv_step(proj, w, b, state, torch.full((rows,), rows + 3), positions, sp)


@pytest.mark.parametrize("flags", [(), ("-mno-avx512f",), ("-mno-avx2",)])
def test_silu_vector_paths_match_torch_over_the_whole_range(flags: tuple[str, ...]) -> None:
    """recap_silu_f32 built for AVX-512, AVX2 (+ FMA) and neither (the build falls back): torch's silu to fp32
    rounding from -120 to 120, and its zeros, infinities and NaN, gated and not, with a tail past the lanes."""
    if "-mno-avx512f" in flags and "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("no AVX2 here")
    fn = load_library("decode_ops", flags).recap_silu_f32
    x = torch.cat([torch.linspace(-120, 120, 4001), torch.randn(1000) * 4,
                   torch.tensor([0.0, -0.0, 1e30, -1e30, float("inf"), -float("inf"), float("nan"), -89.5, -105.0])])
    up = torch.randn(x.numel())
    for gate in (None, up):
        out = torch.empty_like(x)
        fn(ctypes.c_void_p(x.data_ptr()), None if gate is None else ctypes.c_void_p(gate.data_ptr()),
           ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(1), ctypes.c_int64(x.numel()), ctypes.c_int64(x.numel()))
        want = F.silu(x) if gate is None else F.silu(x) * gate
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-30, equal_nan=True)
