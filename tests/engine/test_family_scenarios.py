"""DESIGN invariant 1 on the newest hybrid families, with the GDN suite's scenarios (test_gdn_equivalence.py):
an incremental prompt inserting content mid-prompt, a prompt shorter than one block sent twice, a prompt of
exactly k blocks sent twice, four requests sharing a system prompt at once. Caching on answers exactly as
caching off, with the same hits (they depend on blocks and policies, not on the layer kinds). Qwen4-Exp's tiny
model has per-layer n-gram embeddings with a nonzero dilated conv: both of their windows live in the slot.
Inkling's and Inkling-2's layers hold KV (full or window blocks) and four conv windows each; Inkling-2's full
layers' dynamic convs read those windows directly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recap.engine.outputs import RequestOutput
from tests.engine.conftest import tiny_model_dir
from tests.engine.test_equivalence import assert_same, make_llm
from tests.engine.test_gdn_equivalence import EXPECTED_HITS, POLICIES, SCENARIOS

# RWKV, xLSTM: attention-free, their whole context in the slot
ARCHS = ["bailing_hybrid", "qwen4_exp", "inkling", "inkling2", "rwkv", "xlstm", "zaya"]
_REFERENCE: dict[tuple[str, str], list[RequestOutput]] = {}


def _nonzero_ple_conv(path: Path) -> Path:
    """Qwen4-Exp's PLE conv weights are 0 as transformers initializes them: random ones, so that the conv's
    window in the state slot matters to what the model says."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    weights = load_file(file)
    gen = torch.Generator().manual_seed(0)
    for name, t in weights.items():
        if name.endswith("ple.conv1d.weight"):
            weights[name] = torch.randn(t.shape, generator=gen) * 0.3
    save_file(weights, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def family_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    paths = {arch: tiny_model_dir(root, arch) for arch in ARCHS}
    _nonzero_ple_conv(paths["qwen4_exp"])
    return paths


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("policy", POLICIES)
def test_family_caching_on_equals_off(family_paths: dict[str, Path], arch: str, policy: str) -> None:
    path = family_paths[arch]
    for name, run in SCENARIOS.items():
        if (arch, name) not in _REFERENCE:
            _REFERENCE[arch, name] = run(make_llm(path, caching=False))
        llm = make_llm(path, caching=True, policy=policy)
        got = run(llm)
        assert_same(got, _REFERENCE[arch, name], f"{arch}/{policy}/{name}")
        assert [o.num_cached_tokens for o in got] == EXPECTED_HITS[name][policy], f"{arch}/{policy}/{name}"
        llm.engine.scheduler.check_integrity()
