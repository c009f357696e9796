"""Shared builders for the kernel tests: random requests, batches of rows, and one adapter per SSM kernel.

A *case* wraps one SSM kernel (conv1d, Mamba1 selective scan, Mamba2 SSD, the gated delta rule) behind the
same small surface, so the invariant tests (chunking, packing, checkpoints, padding, decode) run on all alike.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from recap.core.output import PAD_SLOT_ID
from recap.kernels.batch import build_forward_batch
from recap.kernels.conv1d import causal_conv1d, causal_conv1d_ref, causal_conv1d_update
from recap.kernels.gdn import gated_delta_rule, gated_delta_rule_ref, gdn_gates, l2_normalize
from recap.kernels.gdn_decode import gated_delta_rule_update
from recap.kernels.kda import kda, kda_ref, kda_state_update
from recap.kernels.metadata import SeqSpec, SSMMetadata
from recap.kernels.rglru import rglru_scan, rglru_scan_ref, rglru_update
from recap.kernels.selective_scan import selective_scan, selective_scan_ref, selective_state_update
from recap.kernels.ssd import ssd, ssd_ref
from recap.kernels.ssd_decode import ssd_state_update
from recap.kernels.ssd_walk import ssd_native
from recap.kernels.varlen import record_decode_positions
from recap.kernels.wkv import wkv_scan, wkv_scan_ref, wkv_update

from .mlstm_case import MLSTM_SHAPE, mlstm_fast, mlstm_inputs, mlstm_ref, mlstm_update_step

Tensors = dict[str, torch.Tensor]


@dataclass
class Row:
    """One row of a step: per-token inputs for its new tokens, where it starts, its slots."""

    inputs: Tensors  # each [n, ...]
    context_len: int
    slot: int
    checkpoints: list[tuple[int, int]] = field(default_factory=list)
    padding: bool = False

    @property
    def n(self) -> int:
        return next(iter(self.inputs.values())).shape[0]


def slice_inputs(inputs: Tensors, start: int, end: int) -> Tensors:
    return {k: v[start:end] for k, v in inputs.items()}


def build_meta(rows: list[Row], chunk_size: int) -> SSMMetadata:
    specs = [
        SeqSpec(
            token_ids=[0] * r.n,
            context_len=r.context_len,
            state_slot=PAD_SLOT_ID if r.padding else r.slot,
            checkpoints=r.checkpoints,
            padding=r.padding,
        )
        for r in rows
    ]
    fb = build_forward_batch(specs, block_size=16, chunk_size=chunk_size, with_attention=False, with_ssm=True)
    assert fb.ssm is not None
    return fb.ssm


@dataclass
class Case:
    """One SSM kernel: how to draw its inputs and run its fast, reference and decode forms."""

    name: str
    token_inputs: Callable[[int, torch.Generator], Tensors]  # n tokens -> per-token inputs
    params: Callable[[torch.Generator], Tensors]
    cache_shape: tuple[int, ...]  # per slot
    fast: Callable[..., torch.Tensor]  # (inputs, params, cache, meta, slot_positions) -> y
    ref: Callable[..., torch.Tensor]
    update: Callable[..., torch.Tensor]  # (inputs, params, cache, state_indices, slot_positions, positions) -> y
    writes_positions: bool = True
    # (slots, generator) -> a random cache, where plain normal values are no valid state (WKV's denominators)
    cache_init: Callable[[int, torch.Generator], torch.Tensor] | None = None

    def new_cache(self, slots: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.cache_init is not None:
            return self.cache_init(slots, gen).to(dtype)
        return torch.randn(slots, *self.cache_shape, generator=gen).to(dtype)

    def run(
        self,
        impl: str,
        rows: list[Row],
        params: Tensors,
        cache: torch.Tensor,
        chunk_size: int,
        slot_positions: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Run one packed step of `rows`; returns each row's output."""
        meta = build_meta(rows, chunk_size)
        inputs = {k: torch.cat([r.inputs[k] for r in rows]) for k in rows[0].inputs}
        fn = self.fast if impl == "fast" else self.ref
        y = fn(inputs, params, cache, meta, slot_positions)
        qsl = meta.query_start_loc_list
        return [y[qsl[i] : qsl[i + 1]] for i in range(len(rows))]


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


# conv1d: D channels, kernel K
CONV_D, CONV_K = 6, 4


def _conv_case(positions: bool = False) -> Case:
    """positions: the conv records slot positions itself (a layer whose whole state is the conv window)."""

    def fast(inp: Tensors, p: Tensors, cache: torch.Tensor, meta: SSMMetadata, sp: torch.Tensor | None):
        return causal_conv1d(inp["x"], p["w"], p["b"], cache, meta, "silu", sp if positions else None)

    def ref(inp: Tensors, p: Tensors, cache: torch.Tensor, meta: SSMMetadata, sp: torch.Tensor | None):
        return causal_conv1d_ref(inp["x"], p["w"], p["b"], cache, meta, "silu", sp if positions else None)

    def update(inp: Tensors, p: Tensors, cache: torch.Tensor, idx: torch.Tensor, sp, pos) -> torch.Tensor:
        y = causal_conv1d_update(inp["x"], cache, p["w"], p["b"], idx)
        if positions:
            record_decode_positions(sp, idx, pos)
        return y

    return Case(
        name="conv1d_positions" if positions else "conv1d",
        token_inputs=lambda n, g: {"x": _randn(g, n, CONV_D)},
        params=lambda g: {"w": _randn(g, CONV_D, CONV_K), "b": _randn(g, CONV_D)},
        cache_shape=(CONV_D, CONV_K - 1),
        fast=fast,
        ref=ref,
        update=update,
        writes_positions=positions,
    )


# Mamba1: I channels, N state size
M1_I, M1_N = 5, 4


def _mamba1_case(block: int) -> Case:
    def args(inp: Tensors, p: Tensors) -> tuple:
        return inp["u"], inp["dt"], p["A"], inp["B"], inp["C"], p["D"], inp["z"], p["dt_bias"], True

    def fast(inp: Tensors, p: Tensors, cache: torch.Tensor, meta: SSMMetadata, sp: torch.Tensor | None):
        return selective_scan(*args(inp, p), cache, meta, sp, block=block)

    def ref(inp: Tensors, p: Tensors, cache: torch.Tensor, meta: SSMMetadata, sp: torch.Tensor | None):
        return selective_scan_ref(*args(inp, p), cache, meta, sp)

    def update(inp: Tensors, p: Tensors, cache: torch.Tensor, idx: torch.Tensor, sp, pos) -> torch.Tensor:
        u, dt, A, B, C, D, z, dt_bias, soft = args(inp, p)
        return selective_state_update(cache, u, dt, A, B, C, D, z, dt_bias, soft, idx, sp, pos)

    return Case(
        name=f"mamba1_block{block}",
        token_inputs=lambda n, g: {
            "u": _randn(g, n, M1_I),
            "dt": _randn(g, n, M1_I),
            "B": _randn(g, n, M1_N),
            "C": _randn(g, n, M1_N),
            "z": _randn(g, n, M1_I),
        },
        params=lambda g: {
            "A": -torch.rand(M1_I, M1_N, generator=g) * 4,
            "D": _randn(g, M1_I),
            "dt_bias": _randn(g, M1_I),
        },
        cache_shape=(M1_I, M1_N),
        fast=fast,
        ref=ref,
        update=update,
    )


# Mamba2: H heads of dim P, G groups, N state size; the native walk at a shape its register tiles take
M2_H, M2_P, M2_G, M2_N = 4, 3, 2, 5
M2_NATIVE_SHAPE = (4, 32, 2, 8)
DT_LIMIT = (0.0, 4.0)


def _mamba2_case(sub_chunk: int, native: bool = False) -> Case:
    h, p, g, n = M2_NATIVE_SHAPE if native else (M2_H, M2_P, M2_G, M2_N)

    def args(inp: Tensors, prm: Tensors) -> tuple:
        return inp["x"], inp["dt"], prm["A"], inp["B"], inp["C"], prm["D"], prm["dt_bias"], True, DT_LIMIT

    def fast(inp: Tensors, prm: Tensors, cache: torch.Tensor, meta: SSMMetadata, sp: torch.Tensor | None):
        return (ssd_native if native else ssd)(*args(inp, prm), cache, meta, sp, sub_chunk=sub_chunk)

    def ref(inp: Tensors, prm: Tensors, cache: torch.Tensor, meta: SSMMetadata, sp: torch.Tensor | None):
        return ssd_ref(*args(inp, prm), cache, meta, sp)

    def update(inp: Tensors, prm: Tensors, cache: torch.Tensor, idx: torch.Tensor, sp, pos) -> torch.Tensor:
        return ssd_state_update(cache, *args(inp, prm), idx, sp, pos)

    return Case(
        name="mamba2_native" if native else f"mamba2_sub{sub_chunk}",
        token_inputs=lambda k, gen: {
            "x": _randn(gen, k, h, p),
            "dt": _randn(gen, k, h),
            "B": _randn(gen, k, g, n),
            "C": _randn(gen, k, g, n),
        },
        params=lambda gen: {
            "A": -torch.rand(h, generator=gen) * 3,
            "D": _randn(gen, h),
            "dt_bias": _randn(gen, h),
        },
        cache_shape=(h, p, n),
        fast=fast,
        ref=ref,
        update=update,
    )


# Gated DeltaNet: Hk key heads of dim Dk, Hv value heads of dim Dv (Hv a multiple of Hk)
GDN_DK, GDN_DV = 4, 3


def gdn_args(inp: Tensors, p: Tensors) -> tuple[torch.Tensor, ...]:
    """(q, k, v, g, beta) as the GDN layer hands them to the kernels: q, k L2-normalized, q scaled."""
    g, beta = gdn_gates(inp["a"], inp["b"], p["A_log"], p["dt_bias"])
    q = l2_normalize(inp["q"]) * inp["q"].shape[-1] ** -0.5
    return q.to(inp["q"].dtype), l2_normalize(inp["k"]).to(inp["k"].dtype), inp["v"], g, beta


def _gdn_case(hk: int, hv: int) -> Case:
    def fast(inp: Tensors, p: Tensors, cache: torch.Tensor, meta: SSMMetadata, sp: torch.Tensor | None):
        return gated_delta_rule(*gdn_args(inp, p), cache, meta, sp)

    def ref(inp: Tensors, p: Tensors, cache: torch.Tensor, meta: SSMMetadata, sp: torch.Tensor | None):
        return gated_delta_rule_ref(*gdn_args(inp, p), cache, meta, sp)

    def update(inp: Tensors, p: Tensors, cache: torch.Tensor, idx: torch.Tensor, sp, pos) -> torch.Tensor:
        return gated_delta_rule_update(cache, *gdn_args(inp, p), idx, sp, pos)

    return Case(
        name=f"gdn_k{hk}_v{hv}",
        token_inputs=lambda n, g: {
            "q": _randn(g, n, hk, GDN_DK),
            "k": _randn(g, n, hk, GDN_DK),
            "v": _randn(g, n, hv, GDN_DV),
            "a": _randn(g, n, hv),
            "b": _randn(g, n, hv),
        },
        params=lambda g: {"A_log": torch.rand(hv, generator=g) * 2 - 1, "dt_bias": _randn(g, hv)},
        cache_shape=(hv, GDN_DK, GDN_DV),
        fast=fast,
        ref=ref,
        update=update,
    )


# KDA: H heads, K key dim, V value dim
KDA_H, KDA_K, KDA_V = 3, 4, 5


def _kda_case() -> Case:
    def args(inp: Tensors) -> tuple:
        return inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"]

    def fast(inp: Tensors, p: Tensors, cache: torch.Tensor, meta: SSMMetadata, sp: torch.Tensor | None):
        return kda(*args(inp), cache, meta, sp)

    def ref(inp: Tensors, p: Tensors, cache: torch.Tensor, meta: SSMMetadata, sp: torch.Tensor | None):
        return kda_ref(*args(inp), cache, meta, sp)

    def update(inp: Tensors, p: Tensors, cache: torch.Tensor, idx: torch.Tensor, sp, pos) -> torch.Tensor:
        return kda_state_update(*args(inp), cache, idx, sp, pos)

    return Case(
        name="kda",
        token_inputs=lambda n, g: {
            "q": _randn(g, n, KDA_H, KDA_K),
            "k": _randn(g, n, KDA_H, KDA_K),
            "v": _randn(g, n, KDA_H, KDA_V),
            "g": -torch.rand(n, KDA_H, KDA_K, generator=g) * 2,  # per-channel log decay
            "beta": torch.rand(n, KDA_H, generator=g),
        },
        params=lambda g: {},
        cache_shape=(KDA_H, KDA_K, KDA_V),
        fast=fast,
        ref=ref,
        update=update,
    )


# RG-LRU: W channels; decays in [0, 1) with some exact zeros (a reset) and some near 1 (long memory)
RG_W = 7


def _rglru_decay(n: int, g: torch.Generator) -> torch.Tensor:
    a = torch.rand(n, RG_W, generator=g) ** 0.25
    return a.masked_fill_(torch.rand(n, RG_W, generator=g) < 0.05, 0.0)


def _rglru_case() -> Case:
    def fast(inp: Tensors, p: Tensors, cache: torch.Tensor, meta: SSMMetadata, sp: torch.Tensor | None):
        return rglru_scan(inp["x"], inp["a"], cache, meta, sp)

    def ref(inp: Tensors, p: Tensors, cache: torch.Tensor, meta: SSMMetadata, sp: torch.Tensor | None):
        return rglru_scan_ref(inp["x"], inp["a"], cache, meta, sp)

    def update(inp: Tensors, p: Tensors, cache: torch.Tensor, idx: torch.Tensor, sp, pos) -> torch.Tensor:
        return rglru_update(inp["x"], inp["a"], cache, idx, sp, pos)

    return Case(
        name="rglru",
        token_inputs=lambda n, g: {"x": _randn(g, n, RG_W), "a": _rglru_decay(n, g)},
        params=lambda g: {},
        cache_shape=(RG_W,),
        fast=fast,
        ref=ref,
        update=update,
    )


# WKV (RWKV-4): A channels; states (num, den, max) with positive denominators, keys on a wide range
WKV_A = 9


def wkv_state(slots: int, gen: torch.Generator, a: int = WKV_A) -> torch.Tensor:
    """Random valid WKV states [slots, 3, a]: any num, den in [0.5, 1.5), max exponents around 0."""
    return torch.stack((torch.randn(slots, a, generator=gen), torch.rand(slots, a, generator=gen) + 0.5,
                        torch.randn(slots, a, generator=gen) * 3), dim=1)  # fmt: skip


def wkv_params(gen: torch.Generator, a: int = WKV_A) -> Tensors:
    """w = -exp(time_decay) (slow and fast decays), u = time_first."""
    return {"w": -torch.exp(torch.randn(a, generator=gen) * 2), "u": torch.randn(a, generator=gen)}


def _wkv_case() -> Case:
    def fast(inp: Tensors, p: Tensors, cache: torch.Tensor, meta: SSMMetadata, sp: torch.Tensor | None):
        return wkv_scan(inp["k"], inp["v"], p["w"], p["u"], cache, meta, sp)

    def ref(inp: Tensors, p: Tensors, cache: torch.Tensor, meta: SSMMetadata, sp: torch.Tensor | None):
        return wkv_scan_ref(inp["k"], inp["v"], p["w"], p["u"], cache, meta, sp)

    def update(inp: Tensors, p: Tensors, cache: torch.Tensor, idx: torch.Tensor, sp, pos) -> torch.Tensor:
        return wkv_update(inp["k"], inp["v"], p["w"], p["u"], cache, idx, sp, pos)

    return Case(
        name="wkv",
        token_inputs=lambda n, g: {"k": _randn(g, n, WKV_A) * 3, "v": _randn(g, n, WKV_A)},
        params=wkv_params,
        cache_shape=(3, WKV_A),
        fast=fast,
        ref=ref,
        update=update,
        cache_init=wkv_state,
    )


# Small Mamba1 blocks and SSD sub-chunks exercise the state carried between blocks on short rows; the native SSD
# walk (kernels/ssd_walk.py) runs beside the torch op; GDN runs with equal heads and with 2 and 3 value heads per
# key head.
CASES = [
    _conv_case(), _conv_case(positions=True), _mamba1_case(block=5), _mamba1_case(block=16), _mamba2_case(3),
    _mamba2_case(64), _mamba2_case(64, native=True), _gdn_case(2, 2), _gdn_case(2, 4), _gdn_case(1, 3), _kda_case(),
    _rglru_case(), _wkv_case(),
    Case("mlstm", mlstm_inputs, lambda g: {}, MLSTM_SHAPE, mlstm_fast, mlstm_ref, mlstm_update_step),
]  # fmt: skip


def random_rows(
    case: Case, rng: random.Random, gen: torch.Generator, num_slots: int, *, max_len: int = 40, padding: bool = True
) -> list[Row]:
    """1-4 rows with odd lengths, random contexts (some from scratch), random checkpoints, maybe padding rows.

    Slots are distinct and drawn from [0, num_slots).
    """
    free = list(range(num_slots))
    rng.shuffle(free)
    rows = []
    for _ in range(rng.randint(1, 4)):
        n = rng.randint(1, max_len)
        if padding and rng.random() < 0.25:
            rows.append(Row(case.token_inputs(n, gen), 0, PAD_SLOT_ID, padding=True))
            continue
        ctx = rng.choice([0, 0, rng.randint(1, 50)])
        cps = rng.sample(range(ctx + 1, ctx + n + 1), k=min(n, rng.randint(0, 3)))
        rows.append(Row(case.token_inputs(n, gen), ctx, free.pop(), [(p, free.pop()) for p in sorted(cps)]))
    return rows


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 2e-5) -> None:
    """fp32 comparison relative to the tensor's scale: |a - e| <= tol * (1 + |e|)."""
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)
