"""rope_qk's fused cache write (kernels/triton/rope_qk.py's `kv_write`) against the unfused path: rope_qk, then
triton/paged_attention.py's write_kv. Steps of several sequences (prefill over a cached prefix, fresh prefill,
decode rows, a padding row) whose tokens straddle block boundaries, odd head counts, GQA, partial RoPE, head
dims that are not powers of two, with and without norms and the gate. The prepared q, k and the gate and every
cache byte must equal the unfused path's; slots the step does not own (and the last slot, where a PAD_SLOT_ID
of -1 would land if it were used as an index) keep their bits. Through an attention layer (layers/qk_rope.py),
the fused write equals the module ops followed by the torch reference's write_kv (fp32 tolerance), and a cache
of another dtype is left to the attention op. fp32 on the interpreter, bf16 too on a GPU; the kernel compiles for
sm_90 with and without the write.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import AttentionMetadata, KVWrite, SeqSpec
from recap.kernels.paged_attention import write_kv as write_kv_ref
from recap.kernels.triton.paged_attention import write_kv
from recap.kernels.triton.rope_qk import rope_qk

from .device_rows import TOL
from .hopper import compile_for_hopper
from .test_rope_qk import DTYPES, VARIANTS, _head_norms, _layer

BLOCK, NUM_BLOCKS = 4, 24
# (Hq, Hk, D, rotary dim, norm: None / "plain" / "offset", gate)
CASES = [
    (5, 1, 40, 10, "plain", False),  # odd heads, partial RoPE
    (6, 2, 24, 24, None, True),  # GQA, full RoPE, the gate
    (3, 3, 20, 0, "offset", True),  # zero-centred norms without RoPE
    (4, 2, 32, 8, "offset", True),  # Qwen3.5's shape: a quarter rotated
]


def _step(rng: random.Random) -> AttentionMetadata:
    """A mixed step on shuffled blocks (block 0 and the last block owned by no row): a prefill over a cached
    prefix ending mid-block, a fresh prefill across blocks, a padding row, two decode rows (one at a block's
    first slot)."""
    blocks = rng.sample(range(1, NUM_BLOCKS - 1), 12)
    specs = [
        SeqSpec(token_ids=[0] * 7, context_len=rng.choice([2, 3, 5]), block_ids=blocks[0:4]),
        SeqSpec(token_ids=[0] * rng.choice([5, 9]), block_ids=blocks[4:7]),
        SeqSpec(token_ids=[0] * 2, padding=True),
        SeqSpec(token_ids=[0], context_len=rng.choice([4, 8]), block_ids=blocks[7:10]),
        SeqSpec(token_ids=[0], context_len=6, block_ids=blocks[10:12]),
    ]
    fb = build_forward_batch(specs, block_size=BLOCK, chunk_size=16, with_attention=True, with_ssm=False)
    assert fb.attn is not None and PAD_SLOT_ID in fb.attn.slot_mapping.tolist()
    return fb.attn


def _caches(hk: int, d: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(NUM_BLOCKS, BLOCK, hk, d).to(dtype) for _ in range(2))  # type: ignore[return-value]


def _positions(meta: AttentionMetadata) -> torch.Tensor:
    """Each token's position: its row's context plus its index in the row (padding rows: 0..)."""
    qsl, ctx = meta.query_start_loc_list, meta.context_lens_list
    return torch.tensor([ctx[r] + i for r in range(len(ctx)) for i in range(qsl[r + 1] - qsl[r])])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [23, 58])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_fused_write_equals_rope_qk_then_write_kv(case: int, seed: int, dtype: torch.dtype) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    hq, hk, d, rot, norm, gated = CASES[case]
    meta = _step(rng)
    t = meta.slot_mapping.shape[0]
    qg = (torch.randn(t, hq, 2 * d) * 2.0).to(dtype)  # q and the gate as the halves of q_proj's rows (strided)
    q, gate = qg[..., :d], (qg[..., d:] if gated else None)
    k = (torch.randn(t, hk, d) * 2.0).to(dtype)
    v = torch.randn(t, hk * d + 3).to(dtype)[:, 1 : 1 + hk * d].view(t, hk, d)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)) if rot else None
    weights = None if norm is None else (torch.randn(d) * 0.3 + 1.0, torch.randn(d) * 0.3)
    kw = {"weights": weights, "eps": 1e-6, "offset": norm == "offset", "gate": gate}
    positions = _positions(meta)
    before = _caches(hk, d, dtype)
    want_kc, want_vc = (c.clone() for c in before)
    want = rope_qk(q, k, positions, inv_freq, **kw)  # type: ignore[arg-type]
    write_kv(want[1], v, want_kc, want_vc, meta.slot_mapping)
    kc, vc = (c.clone() for c in before)
    got = rope_qk(q, k, positions, inv_freq, **kw, kv_write=KVWrite(v, kc, vc, meta.slot_mapping))  # type: ignore[arg-type]
    for name, g, w in zip(("q", "k", "gate"), got, want, strict=True):
        assert (g is None and w is None) or torch.equal(g, w), name  # type: ignore[arg-type]
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc), "the caches hold the unfused path's bits"
    owned = torch.zeros(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    owned[meta.slot_mapping[meta.slot_mapping != PAD_SLOT_ID]] = True
    assert not owned[-1], "the last slot (index -1) belongs to no row"
    for cache, old in zip((kc, vc), before, strict=True):
        flat, flat_old = cache.view(-1, hk, d), old.view(-1, hk, d)
        assert torch.equal(flat[~owned], flat_old[~owned]), "a slot the step does not own changed"
        assert not torch.equal(flat[owned], flat_old[owned])  # the test writes something


@pytest.mark.parametrize("variant", [3, 5])  # LFM3's Attention (norms, proportional RoPE), Qwen3.5's GatedAttention
def test_a_layer_writes_what_module_ops_and_the_reference_write_would(variant: int) -> None:
    torch.manual_seed(variant)
    layer = _layer(*VARIANTS[variant], torch.float32)
    cfg = layer.cfg  # type: ignore[attr-defined]
    meta = _step(random.Random(variant))
    t, hq, hk, d = meta.slot_mapping.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hk, d), torch.randn(t, hk, d)
    gate = torch.randn(t, hq, d) if cfg.output_gate else None
    positions, norms = _positions(meta) * 37, _head_norms(layer)
    before = _caches(hk, d)
    want_kc, want_vc = (c.clone() for c in before)
    want = layer.prepare_qk(q, k, positions, norms, gate, KVWrite(v, want_kc, want_vc, meta.slot_mapping))
    assert want[3] is False and torch.equal(want_kc, before[0]), "the module ops leave the write to the attention op"
    write_kv_ref(want[1], v, want_kc, want_vc, meta.slot_mapping)
    layer.set_rope_kernel(rope_qk)
    kc, vc = (c.clone() for c in before)
    got = layer.prepare_qk(q, k, positions, norms, gate, KVWrite(v, kc, vc, meta.slot_mapping))
    assert got[3] is True
    for name, g, w in ((n, g, w) for n, g, w in zip(("q", "k", "gate", "k cache", "v cache"),
                                                    (*got[:3], kc, vc), (*want[:3], want_kc, want_vc), strict=True)
                       if w is not None):  # fmt: skip
        torch.testing.assert_close(g, w, rtol=TOL, atol=TOL, msg=name)
    half = tuple(c.bfloat16() for c in before)
    other = layer.prepare_qk(q, k, positions, norms, gate, KVWrite(v, *half, meta.slot_mapping))
    assert other[3] is False and all(torch.equal(c, o.bfloat16()) for c, o in zip(half, before, strict=True))


def test_cache_writes_it_cannot_serve_are_refused() -> None:
    q, k, v, pos = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16), torch.arange(3)
    kc, vc, slots = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16), torch.tensor([1, PAD_SLOT_ID, 5])
    inv = torch.ones(4)
    with pytest.raises(ValueError, match="shaped as k"):
        rope_qk(q, k, pos, inv, kv_write=KVWrite(v[:, :1], kc, vc, slots))
    with pytest.raises(ValueError, match="of k's heads"):
        rope_qk(q, k, pos, inv, kv_write=KVWrite(v, kc[:, :, :1], vc, slots))
    with pytest.raises(ValueError, match="dtype"):
        rope_qk(q, k, pos, inv, kv_write=KVWrite(v, kc.double(), vc.double(), slots))
    with pytest.raises(ValueError, match="block_id"):
        rope_qk(q, k, pos, inv, kv_write=KVWrite(v, kc.transpose(0, 1), vc.transpose(0, 1), slots))
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_qk(q, k, pos, inv, kv_write=KVWrite(v, kc, vc, slots[:2]))


def compile_rope_qk(write: bool) -> None:
    """The kernel at Qwen3.5's shape (bf16, 256-dim heads, a quarter rotated, zero-centred norms, the gate)."""
    from recap.kernels.triton import rope_qk as module

    names = ("q_ptr", "k_ptr", "g_ptr", "qw_ptr", "kw_ptr", "qo_ptr", "ko_ptr", "go_ptr", "v_ptr", "kc_ptr", "vc_ptr")
    pointers = {**dict.fromkeys(names, "*bf16"), "pos_ptr": "*i64", "inv_ptr": "*fp32", "slot_ptr": "*i64"}
    consts = dict(HQ=8, HK=2, D=256, R=64, BLOCK_HQ=8, BLOCK_HK=2, BLOCK_D=256, NORM=2, GATE=True, WRITE=write)
    ptx = compile_for_hopper(module._rope_qk_kernel, pointers, consts, 4, floats=("eps",))
    assert ptx.count("st.global") > (8 if write else 0)  # q, k, the gate, and with the write k's and v's cache rows


def test_kernel_compiles_for_hopper() -> None:
    """With and without the cache write, in a fresh process with the interpreter off (triton/hopper.py)."""
    code = "from tests.kernels.triton.test_rope_qk_kv_write import compile_rope_qk as c\nc(False)\nc(True)"
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
