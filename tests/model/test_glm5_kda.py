"""GLM-5.3-Flash's KDA (checkpoint layout: {q,k,v}_conv1d, flat gate weights, A_log [H]; the lower-bounded
sigmoid gate, or softplus without a bound) against transformers' Glm5NextTextLinearAttention (torch fallback,
no cache; its in-memory fused conv1d and forget_gate module mapped to the layout save_pretrained writes), in
one pass and in chunks carried through a state slot."""

from __future__ import annotations

import pytest
import torch

from recap.kernels.batch import build_forward_batch
from recap.kernels.metadata import ForwardBatch, SeqSpec
from recap.model.cache import UNWRITTEN, ModelCaches, StateCache
from recap.model.layers.kda import KDAMixer
from recap.model.mixer_configs import KDAConfig

hf = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
hf_config = pytest.importorskip("transformers.models.glm5_next.configuration_glm5_next")

HIDDEN, HEADS, HEAD_DIM, KERNEL = 16, 2, 8, 4


def _pair(seed: int, bound: float | None) -> tuple[torch.nn.Module, KDAMixer]:
    cfg = hf_config.Glm5NextTextConfig(hidden_size=HIDDEN, linear_num_heads=HEADS, linear_head_dim=HEAD_DIM,
                                       linear_conv_kernel_dim=KERNEL, linear_lower_bound=bound, rms_norm_eps=1e-5,
                                       num_hidden_layers=1, layer_types=["linear_attention"], vocab_size=32)
    ref = hf.Glm5NextTextLinearAttention(cfg, 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
    ours = KDAMixer(HIDDEN, KDAConfig(HEADS, HEAD_DIM, KERNEL, 1e-5, layout="glm5", gate_lower_bound=bound),
                    torch.float32)  # fmt: skip
    ours.load_state_dict(_on_disk(ref.state_dict()))
    return ref, ours


def _on_disk(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory names -> the checkpoint's (its conversion mapping, read off save_pretrained)."""
    out = {k.removeprefix("forget_gate."): v for k, v in state.items() if k != "conv1d.weight"}
    for x, w in zip("qkv", state["conv1d.weight"].chunk(3, dim=0)):
        out[f"{x}_conv1d.weight"] = w
    return out


def _caches(layer: KDAMixer) -> ModelCaches:
    state = StateCache({s.name: torch.zeros(3, *s.shape, dtype=s.dtype) for s in layer.cfg.state_specs()})
    return ModelCaches(kv={}, state={0: state}, slot_positions=torch.full((3,), UNWRITTEN, dtype=torch.long),
                       block_size=4, num_kv_blocks=0, num_state_slots=3)  # fmt: skip


def _batch(n: int, ctx: int) -> ForwardBatch:
    spec = SeqSpec(token_ids=[0] * n, context_len=ctx, block_ids=[], state_slot=1)
    return build_forward_batch([spec], block_size=4, chunk_size=8, with_attention=False, with_ssm=True)


@pytest.mark.parametrize(("seed", "bound", "length"), [(0, -5.0, 21), (1, None, 13), (2, -2.0, 30)])
def test_matches_transformers_whole_and_chunked(seed: int, bound: float | None, length: int) -> None:
    ref, ours = _pair(seed, bound)
    x = torch.randn(1, length, HIDDEN, generator=torch.Generator().manual_seed(40 + seed))
    with torch.no_grad():
        expected = ref(x)[0]
        torch.testing.assert_close(ours(x[0], _batch(length, 0), _caches(ours), 0), expected, rtol=1e-4, atol=1e-5)
        caches, outs = _caches(ours), []
        for s, e in [(0, 5), (5, 6), (6, length)]:
            outs.append(ours(x[0, s:e], _batch(e - s, s), caches, 0))
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-4, atol=1e-5)


def test_layout_is_checked() -> None:
    with pytest.raises(ValueError, match="layout"):
        KDAConfig(2, 8, 4, layout="fla")
    assert KDAMixer(16, KDAConfig(2, 8, 4, layout="glm5"), torch.float32).A_log.shape == (2,)
