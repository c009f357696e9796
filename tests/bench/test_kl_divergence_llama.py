"""benchmarks/kl_divergence.py's reading of llama-perplexity's --kl-divergence-base file and its printed statistics,
against a writer that follows llama.cpp's (tools/perplexity/perplexity.cpp: log_softmax and the header)."""

from __future__ import annotations

import importlib.util
import re
import struct
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _module() -> ModuleType:  # benchmarks/ is scripts, not a package
    spec = importlib.util.spec_from_file_location("kl_divergence_bench", ROOT / "benchmarks" / "kl_divergence.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kl_divergence_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def _encode(logits: np.ndarray, nv: int) -> np.ndarray:
    """One position as llama.cpp writes it: (scale, min log-prob) as two floats, then 16-bit codes."""
    mx, mn = float(logits.max()), max(float(logits.min()), float(logits.max()) - 16)
    lse = float(np.log(np.exp(logits.astype(np.float64) - mx).sum()))
    scale = (mx - mn) / 65535.0
    out = np.zeros(nv, dtype=np.uint16)
    out[:4] = np.array([scale, mn - mx - lse], dtype=np.float32).view(np.uint16)
    out[4 : 4 + len(logits)] = np.where(logits > mn, np.rint((logits - mn) / scale), 0)
    return out


def _write_base(path: Path, tokens: list[int], n_ctx: int, logits: np.ndarray) -> None:
    """logits [chunks, positions, V]."""
    n_chunk, per_chunk, n_vocab = logits.shape
    nv = 2 * ((n_vocab + 1) // 2) + 4
    body = np.stack([_encode(p, nv) for c in logits for p in c])
    path.write_bytes(struct.pack("<8s3i", b"_logits_", n_ctx, n_vocab, n_chunk) + np.array(tokens, np.int32).tobytes()
                     + body.tobytes())  # fmt: skip


def test_the_base_file_decodes_to_the_log_probs_and_drops_what_llama_cpp_drops(tmp_path: Path) -> None:
    mod = _module()
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 51)).astype(np.float32)  # n_ctx 8: positions 4..6 of each chunk
    logits[1, 2, 7] = 40.0  # every other logit more than 16 below: clipped, probability 0
    tokens = list(range(100, 116))
    _write_base(tmp_path / "b.kld", tokens, 8, logits)
    got = list(mod.llama_base_logprobs(tmp_path / "b.kld"))
    assert [tuple(g.shape) for g in got] == [(3, 51), (3, 51)]
    want = torch.log_softmax(torch.from_numpy(logits).double(), -1)
    assert torch.allclose(got[0], want[0], atol=1e-4)
    assert torch.allclose(got[1][:2], want[1][:2], atol=1e-4)
    assert got[1][2, 7] == pytest.approx(0.0, abs=1e-4) and (got[1][2].isinf().sum() == 50)

    windows = [tokens[:8], tokens[8:]]
    assert mod.base_file_check(tmp_path / "b.kld", windows, None, 8) == 6
    assert mod.base_file_check(tmp_path / "b.kld", [[0, *w[1:]] for w in windows], 0, 8) == 6  # BOS in front
    with pytest.raises(SystemExit, match="not recap's"):
        mod.base_file_check(tmp_path / "b.kld", [tokens[:8], tokens[:8]], None, 8)


def test_printed_statistics_are_read_with_their_signs() -> None:
    mod = _module()
    text = ("Mean PPL(Q)                   : 222.470000 ±   6.9\nMean    KLD:  -0.000000 ±   0.000000\n"
            "Maximum KLD:   0.000041\n99.0%   KLD:   0.000021\nSame top p: 99.951 ± 0.02 %\n")  # fmt: skip
    got = {k: float(re.search(p, text).group(1)) for k, p in mod._LLAMA_STATS.items()}
    assert got == {"mean_kl": -0.0, "mean_kl_pm": 0.0, "kl_p99": 0.000021, "max_kl": 0.000041,
                   "top1_agreement": 99.951, "perplexity": 222.47}  # fmt: skip
