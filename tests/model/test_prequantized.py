"""Pre-quantized checkpoints (model/prequantized*.py): a tiny Bamba written in each format loads, its layers hold
the checkpoint's own codes (int4: recap's packed form bit for bit, its outputs equal int4_linear_ref on the same
codes) or dequantized weights (FP8, and `dequantize`: equal to the format's w = s (q - z) / weight * scale), the
model's logits match the fp32 model on the dequantized weights within the served format's error, and what recap
does not read is refused with a typed error.

The layouts are written by hand after each format's documentation (no CUDA-free writer library installs here):
GPTQ: AutoGPTQ's / gptqmodel's `pack` (qweight [in/8, out], qzeros [groups, out/8] storing z - 1 in v1);
AWQ: AutoAWQ's GEMM packing (words along the outputs in the order 0 2 4 6 1 3 5 7); compressed-tensors:
`pack_to_int32` (q + 8, 8 per int32 along the last dim; zero points packed along the outputs) and the
float-quantized layout; FP8 block scales: cross-checked against transformers' own dequantization.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from recap.backends import prepare
from recap.kernels.linear_int4 import TILE, dequantize_int4, int4_linear_ref, pack
from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.layers.int4_linear import Int4Linear
from recap.model.layers.linear import Linear
from recap.model.loader import LoadedModel, WeightLoadError, load_model
from recap.model.prequantized import UnsupportedQuantizationError
from recap.model.testing import forward_step
from tests.model.test_quant import INT8_DRIFT

ARCH = "bamba"
Parts = dict[str, torch.Tensor]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _words(nib: torch.Tensor) -> torch.Tensor:
    """[..., 8n] codes 0..15 -> int32 [..., n], code k of each 8 at bits 4k."""
    v = nib.long().reshape(*nib.shape[:-1], -1, 8) << (4 * torch.arange(8))
    w = v.sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def _quantize(w: torch.Tensor, group_of: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A plain 4-bit quantization by group label: codes [out, in], fp16-exact scales and zeros [out, groups]."""
    ng = int(group_of.max()) + 1
    codes = torch.empty(w.shape, dtype=torch.long)
    scales, zeros = torch.empty(w.shape[0], ng), torch.empty(w.shape[0], ng, dtype=torch.long)
    for g in range(ng):
        cols = w[:, group_of == g]
        if sym:
            s, z = (cols.abs().amax(1) / 7).half().float(), torch.full((w.shape[0],), 8)
        else:
            lo, hi = cols.amin(1), cols.amax(1)
            s = ((hi - lo) / 15).half().float()
            z = torch.round(-lo / s).clamp(1, 15).long()
        codes[:, group_of == g] = (torch.round(cols / s[:, None]) + z[:, None]).clamp(0, 15).long()
        scales[:, g], zeros[:, g] = s, z
    return codes, scales, zeros


def _reference(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_of: torch.Tensor) -> torch.Tensor:
    return scales[:, group_of] * (codes - zeros[:, group_of]).float()


def _int4_writer(method: str, group: int, sym: bool, act_order: str | None = None):  # noqa: ANN202
    """(weight -> (parts, dequantized weight, (codes, scales, zeros, group_of))) for a 4-bit format."""

    def convert(w: torch.Tensor) -> tuple[Parts, torch.Tensor, tuple]:
        out, k = w.shape
        gs = k if group == -1 else group
        group_of = torch.arange(k) // gs
        if act_order == "blocks":  # 32-input blocks dealt round-robin over the groups: each block in one group
            group_of = (torch.arange(k) // 32) % (-(-k // gs))
        elif act_order == "shuffled":
            group_of = group_of[torch.randperm(k, generator=torch.Generator().manual_seed(k))]
        codes, scales, zeros = _quantize(w, group_of, sym)
        ref = _reference(codes, scales, zeros, group_of)
        if method == "gptq":
            parts = {"qweight": _words(codes).T.contiguous(), "qzeros": _words((zeros - 1).T.contiguous()),
                     "scales": scales.T.half().contiguous(), "g_idx": group_of.int()}  # fmt: skip
        elif method == "awq":
            reorder = lambda t: t.reshape(t.shape[0], -1, 8)[..., AWQ_ORDER].reshape(t.shape)  # noqa: E731
            parts = {"qweight": _words(reorder(codes.T.contiguous())), "qzeros": _words(reorder(zeros.T.contiguous())),
                     "scales": scales.T.half().contiguous()}  # fmt: skip
        else:
            scales = scales.bfloat16().float()  # llm-compressor saves scales in the model dtype
            ref = _reference(codes, scales, zeros, group_of)
            parts = {"weight_packed": _words(F.pad(codes, (0, -k % 8))), "weight_scale": scales.bfloat16(),
                     "weight_shape": torch.tensor([out, k])}  # fmt: skip
            if not sym:
                parts["weight_zero_point"] = _words(F.pad(zeros.T, (0, -out % 8))).T.contiguous()
        return parts, ref, (codes, scales, zeros, group_of)

    return convert


def _fp8_writer(method: str, strategy: str):  # noqa: ANN202
    def convert(w: torch.Tensor) -> tuple[Parts, torch.Tensor, tuple]:
        out, k = w.shape
        if strategy == "tensor":
            scale = w.abs().amax().reshape(()) / 448
            grid = scale.reshape(1, 1)
        elif strategy == "channel":
            scale = w.abs().amax(1, keepdim=True) / 448
            grid = scale
        else:  # 16 x 32 blocks
            scale = F.pad(w, (0, -k % 32, 0, -out % 16)).abs().reshape(-(-out // 16), 16, -1, 32).amax((1, 3)) / 448
            grid = scale.repeat_interleave(16, 0)[:out].repeat_interleave(32, 1)[:, :k]
        q = (w / grid).to(torch.float8_e4m3fn)
        name = "weight_scale_inv" if method == "fp8" else "weight_scale"
        parts = {"weight": q, name: scale.float()}
        if method != "fp8":
            parts["input_scale"] = torch.tensor(0.01)  # static activation scale: read and dropped
        return parts, q.float() * grid, ()

    return convert


def _write(src: Path, dst: Path, qcfg: dict, convert: Callable) -> tuple[Path, dict[str, tuple]]:
    """src's checkpoint with every linear weight (the head too) in a pre-quantized format (dst/quant), and the
    dense checkpoint of the dequantized weights (dst/dense); returns (dst, the codes of each layer)."""
    tensors = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    quant, dense, codes = {}, {}, {}
    for key, t in tensors.items():
        if key.endswith(".weight") and t.dim() == 2 and "embed" not in key:
            parts, dense[key], codes[key[: -len(".weight")]] = convert(t.float())
            quant.update({f"{key[: -len('.weight')]}.{p}": v for p, v in parts.items()})
        else:
            quant[key] = dense[key] = t
    for name, state, qc in (("quant", quant, qcfg), ("dense", dense, None)):
        shutil.copytree(src, dst / name)  # the tokenizer too, where there is one
        save_file({k: v.contiguous() for k, v in state.items()}, dst / name / "model.safetensors")
        (dst / name / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc} if qc else cfg))
    return dst, codes


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}


def _ct(group: int, sym: bool) -> dict:
    w = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group", "group_size": group}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"weights": w, "targets": ["Linear"]}}, "ignore": ["lm_head"]}  # fmt: skip


def _ct_fp8(strategy: str) -> dict:
    w = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"weights": w, "targets": ["Linear"]}}}  # fmt: skip


INT4_CASES = {
    "gptq-g128-asym": (GPTQ, _int4_writer("gptq", 128, False)),
    "gptq-g32-sym": ({**GPTQ, "group_size": 32, "sym": True}, _int4_writer("gptq", 32, True)),
    "gptq-actorder-blocks": ({**GPTQ, "group_size": 64, "desc_act": True}, _int4_writer("gptq", 64, False, "blocks")),
    "awq-g64": (AWQ, _int4_writer("awq", 64, False)),
    "ct-g32-sym": (_ct(32, True), _int4_writer("ct", 32, True)),
    "ct-g128-asym": (_ct(128, False), _int4_writer("ct", 128, False)),
}
FP8_CASES = {
    "ct-fp8-channel": (_ct_fp8("channel"), _fp8_writer("ct", "channel")),
    "fp8-block": ({"quant_method": "fp8", "weight_block_size": [16, 32], "activation_scheme": "dynamic"},
                  _fp8_writer("fp8", "block")),
    "modelopt-fp8": ({"quant_method": "modelopt", "quant_algo": "FP8"}, _fp8_writer("modelopt", "tensor")),
}  # fmt: skip


def _logits(lm: LoadedModel, ids: list[int]) -> torch.Tensor:
    backend = prepare(lm)
    caches = ModelCaches.allocate(lm.config, 8, 16, 2, torch.float32)
    with torch.inference_mode():
        hidden, _ = forward_step(lm.model, caches, [SeqSpec(ids, 0, list(range(1, 8)), state_slot=1)], backend)
        return lm.model.compute_logits(hidden)


def _linears(lm: LoadedModel) -> dict[str, Linear]:
    return {n: m for n, m in lm.model.named_modules() if isinstance(m, Linear)}


def _one_group_per_block(group_of: torch.Tensor, g: int) -> bool:
    return all(len(set(group_of[i : i + g].tolist())) == 1 for i in range(0, len(group_of), g))


def _expected_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_of: torch.Tensor,
                   g: int) -> tuple[torch.Tensor, bool]:  # fmt: skip
    """recap's packed tiles for these codes, built directly: each g-input block takes its group's scale."""
    out, k = codes.shape
    src = F.pad(group_of, (0, -k % g))[::g]
    outp = -(-out // TILE) * TILE
    q = F.pad(codes, (0, -k % g, 0, outp - out), value=8).reshape(outp, -1, g).to(torch.uint8)
    s = F.pad(scales[:, src], (0, 0, 0, outp - out)).half()
    z = F.pad(zeros[:, src], (0, 0, 0, outp - out), value=8)
    asym = not bool((z == 8).all())
    return pack(q, s, (-(s.float() * z)).half() if asym else None), asym


@pytest.mark.parametrize("case", sorted(INT4_CASES))
def test_int4_formats_load_exactly(case: str, tiny_checkpoint: Callable[[str], Path], tmp_path: Path,
                                   caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    qcfg, convert = INT4_CASES[case]
    root, codes = _write(tiny_checkpoint(ARCH), tmp_path, qcfg, convert)
    with caplog.at_level(logging.INFO, logger="recap.model.loader"):
        lm = load_model(root / "quant")
    assert lm.linear_backend == "int4"
    assert f"4-bit g{qcfg.get('group_size', 32)}" in caplog.text or "compressed-tensors" in caplog.text
    assert f"-> recap int4 g{64 if qcfg.get('group_size') == 64 else 32}" in caplog.text
    layers = _linears(lm)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(3))
    for name, (q, s, z, group_of) in codes.items():
        impl = layers[name].impl
        assert isinstance(impl, Int4Linear) and layers[name].released, name  # no fp32 weight was ever held
        g = 64 if qcfg.get("group_size") == 64 and _one_group_per_block(group_of, 64) else 32
        packed, asym = _expected_int4(q, s, z, group_of, g)
        assert impl.quantized.group == g and impl.quantized.asym == asym
        assert torch.equal(impl.quantized.packed, packed), name
        xi = x[:, : impl.quantized.in_features]
        assert torch.equal(layers[name](xi), int4_linear_ref(xi, impl.quantized)), name
        ref = _reference(q, s, z, group_of)
        err = (dequantize_int4(impl.quantized) - ref).abs().max().item()
        assert err <= (2**-11 * 15 * s.max().item() if asym else 0.0), (name, err)
    ids = torch.randint(0, lm.config.vocab_size, (23,), generator=torch.Generator().manual_seed(4)).tolist()
    want, got = _logits(load_model(root / "dense"), ids), _logits(lm, ids)
    rel = float((got - want).norm() / want.norm())
    assert rel < 0.05, rel  # the checkpoint's weights: only int4's 8-bit activation codes differ (0.028-0.034)


@pytest.mark.parametrize("case", sorted(INT4_CASES) + sorted(FP8_CASES))
def test_dequantized_weights_equal_the_format(case: str, tiny_checkpoint: Callable[[str], Path],
                                              tmp_path: Path) -> None:  # fmt: skip
    """dequantize=True: every layer holds w = s (q - z) (or weight * scale), so the logits equal the dense
    checkpoint's exactly; by default FP8 serves as int8: recap's int8 of those weights."""
    qcfg, convert = {**INT4_CASES, **FP8_CASES}[case]
    root, _ = _write(tiny_checkpoint(ARCH), tmp_path, qcfg, convert)
    dense, deq = load_model(root / "dense"), load_model(root / "quant", dequantize=True)
    for name, layer in _linears(dense).items():
        assert torch.equal(_linears(deq)[name].weight, layer.weight), name
    ids = torch.randint(0, dense.config.vocab_size, (17,), generator=torch.Generator().manual_seed(5)).tolist()
    want = _logits(dense, ids)
    assert torch.equal(_logits(deq, ids), want)
    if case in FP8_CASES:
        lm = load_model(root / "quant")
        assert lm.linear_backend == "int8"
        got = _logits(lm, ids)  # requantized: recap's int8 of the dequantized weights, exactly
        assert torch.equal(got, _logits(load_model(root / "dense", quantization="int8"), ids))
        rel = float((got - want).norm() / want.norm())
        assert rel < INT8_DRIFT, rel  # int8's per-row 8-bit activations on this tiny model: 0.045-0.049


def test_fp8_blocks_match_transformers_dequantization() -> None:
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from recap.model.prequantized import prequantized_format
    from recap.model.prequantized_fp8 import dequantize_fp8

    w = torch.randn(37, 70, generator=torch.Generator().manual_seed(6))
    parts, ref, _ = _fp8_writer("fp8", "block")(w)
    fmt = prequantized_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 32]}})
    assert fmt is not None
    got = dequantize_fp8(fmt, parts, 37, 70, "layer")
    theirs = _dequantize_fp8_weight(parts["weight"], parts["weight_scale_inv"], [16, 32], torch.float32)
    assert torch.equal(got, theirs) and torch.equal(got, ref)


@pytest.mark.parametrize("qcfg", [
    {**GPTQ, "bits": 8}, {**AWQ, "version": "gemv"}, {"quant_method": "bitsandbytes", "load_in_4bit": True},
    {**_ct(32, True), "format": "int-quantized"}, {**GPTQ, "group_size": 48},
    {"quant_method": "modelopt", "quant_algo": "NVFP4"},
])  # fmt: skip
def test_unsupported_configs_are_refused(qcfg: dict, tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    src = tiny_checkpoint(ARCH)
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((src / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}))
    with pytest.raises(UnsupportedQuantizationError, match="recap loads"):
        load_model(tmp_path / "m")


def _edit(root: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(root / "quant" / "model.safetensors")
    change(tensors)
    save_file(tensors, root / "quant" / "model.safetensors")


def test_strict_keys_and_act_order(tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """The parts replace `weight` exactly: a missing part, a stray key, a dense weight beside the codes fail; an
    act-order g_idx that splits a 32-input block is refused by name."""
    src = tiny_checkpoint(ARCH)
    layer = "model.layers.0.feed_forward.down_proj"
    edits: list[tuple[Callable[[dict[str, torch.Tensor]], None], str]] = [
        (lambda t: t.pop(f"{layer}.qzeros"), "missing key"),
        (lambda t: t.update({f"{layer}.bogus": torch.zeros(2)}), "unexpected key"),
        (lambda t: t.update({f"{layer}.weight": torch.zeros(64, 128)}), "both a dense weight"),
        (lambda t: t.update({f"{layer}.scales": t[f"{layer}.scales"][:, :32].contiguous()}), "shape"),
    ]
    for i, (change, message) in enumerate(edits):
        root, _ = _write(src, tmp_path / str(i), GPTQ, _int4_writer("gptq", 128, False))
        _edit(root, change)
        with pytest.raises(WeightLoadError, match=message):
            load_model(root / "quant")
    shuffled = _int4_writer("gptq", 32, False, "shuffled")
    root, _ = _write(src, tmp_path / "shuffled", {**GPTQ, "group_size": 32, "desc_act": True}, shuffled)
    with pytest.raises(WeightLoadError, match="act-order"):
        load_model(root / "quant")
    assert torch.equal(_linears(load_model(root / "quant", dequantize=True))[layer].weight,
                       _linears(load_model(root / "dense"))[layer].weight)  # fmt: skip


@pytest.mark.parametrize("case", ["gptq-g128-asym", "fp8-block"])
def test_bf16_model(case: str, tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """A bf16 model: int4 layers keep the checkpoint's tiles (bf16 in and out), FP8 dequantizes into bf16."""
    qcfg, convert = {**INT4_CASES, **FP8_CASES}[case]
    root, codes = _write(tiny_checkpoint(ARCH), tmp_path, qcfg, convert)
    lm, fp32 = load_model(root / "quant", dtype=torch.bfloat16), load_model(root / "quant")
    deq = load_model(root / "quant", dtype=torch.bfloat16, dequantize=True)
    dense = load_model(root / "dense")
    for name, layer in _linears(dense).items():
        assert torch.equal(_linears(deq)[name].weight, layer.weight.bfloat16()), name
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    name = "model.layers.1.self_attn.q_proj"  # no bias (a bf16 model's bias is rounded)
    got, want = _linears(lm)[name](x), _linears(fp32)[name](x.float())
    assert got.dtype == torch.bfloat16
    if case in INT4_CASES:
        assert torch.equal(got, want.bfloat16())  # the same tiles: only the output's rounding
