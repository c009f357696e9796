"""Hyper-connections against transformers' GLM-5.3-Flash module (Glm5NextTextHyperConnection) and its decoder
layer's stream update, on random weights and odd sizes."""

from __future__ import annotations

import pytest
import torch

from recap.model.layers.hyper_connection import HyperConnection, hyper_head, hyper_streams

hf = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
hf_config = pytest.importorskip("transformers.models.glm5_next.configuration_glm5_next")


def _pair(seed: int, hidden: int, n: int, iters: int) -> tuple[HyperConnection, torch.nn.Module]:
    cfg = hf_config.Glm5NextTextConfig(hidden_size=hidden, hc_mult=n, hc_sinkhorn_iters=iters, rms_norm_eps=1e-5,
                                       num_hidden_layers=1, vocab_size=32)  # fmt: skip
    ref = hf.Glm5NextTextHyperConnection(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    ours = HyperConnection(hidden, n, iters, cfg.hc_eps, cfg.rms_norm_eps, torch.float32)
    ours.load_state_dict(ref.state_dict())
    return ours, ref


@pytest.mark.parametrize(("seed", "hidden", "n", "iters"), [(0, 16, 4, 20), (1, 13, 3, 5), (2, 8, 1, 1), (3, 24, 2, 7)])
def test_collapse_and_expand_match_transformers(seed: int, hidden: int, n: int, iters: int) -> None:
    ours, ref = _pair(seed, hidden, n, iters)
    gen = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(2, 7, n, hidden, generator=gen)
    out = torch.randn(2, 7, hidden, generator=gen)  # a block's output
    post_r, comb_r, inp_r = ref(x)
    mixed_r = post_r.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb_r.transpose(-1, -2), x)  # decoder layer
    post, comb, inp = ours.collapse(x.flatten(0, 1))
    torch.testing.assert_close(inp, inp_r.flatten(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(post, post_r.flatten(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(comb, comb_r.flatten(0, 1), rtol=1e-6, atol=1e-6)
    mixed = HyperConnection.expand(out.flatten(0, 1), post, comb, x.flatten(0, 1))
    torch.testing.assert_close(mixed, mixed_r.flatten(0, 1), rtol=1e-6, atol=1e-6)
    if iters >= 5:  # Sinkhorn converges: comb is (nearly) doubly stochastic
        torch.testing.assert_close(comb.sum(-2), torch.ones(14, n), rtol=0, atol=1e-4)


def test_streams_and_head() -> None:
    x = torch.randn(5, 6)
    s = hyper_streams(x, 3)
    assert s.shape == (5, 3, 6) and torch.equal(s[:, 2], x)
    torch.testing.assert_close(hyper_head(s), hf.Glm5NextTextHyperHead()(s[None])[0])


def test_wrong_stream_count_is_refused() -> None:
    hc = HyperConnection(8, 4, 3, 1e-6, 1e-5, torch.float32)
    with pytest.raises(ValueError, match="residual streams"):
        hc.collapse(torch.randn(3, 2, 8))
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        HyperConnection(8, 4, 0, 1e-6, 1e-5, torch.float32)
