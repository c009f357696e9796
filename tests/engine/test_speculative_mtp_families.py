"""Speculative method "mtp" beyond Qwen (tests/engine/test_speculative_mtp.py): the heads Nemotron-H (`mtp.layers.*`:
an attention block, then a MoE block) and Ling 3.0 (DeepSeek-V3 style, `model.layers.{N}.*`: an MLA + MoE decoder
layer) checkpoints ship where their configs declare next-token-prediction layers. transformers drops these weights,
so they are written by hand beside a save_pretrained checkpoint, under the hub's names. The loader reads them only
when asked and logs it; the drafter's drafts equal the plain one-row reference; greedy output equals the
unspeculated run token for token; a checkpoint without a head gets a typed error."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from recap.model.layers.mtp import _one_row
from recap.model.loader import load_model
from recap.model.mtp_load import MTPWeightsMissingError, UnsupportedMTPHeadError, load_mtp_head, mtp_layer_config
from recap.model.testing import tiny_hf_config
from recap.runner.mtp_drafter import MTPDrafter
from tests.engine.conftest import tiny_model_dir
from tests.engine.test_speculative_draft import GREEDY, make, tokens
from tests.engine.test_speculative_mtp import _prompts, assert_drafts_equal_the_reference, spec, unit_rms_embedding

Head = Callable[[dict[str, torch.Tensor], torch.Generator], dict[str, torch.Tensor]]


def _block(weights: dict[str, torch.Tensor], src: str, dst: str, g: torch.Generator | None) -> dict[str, torch.Tensor]:
    """Layer `src`'s weights renamed under `dst`: random N(0, 0.1) (norm weights 1 + that), or copied (g None)."""
    out = {}
    for k, t in weights.items():
        if k.startswith(src):
            rand = torch.randn(t.shape, generator=g) * 0.1 if g is not None else None
            out[dst + k.removeprefix(src)] = t.clone() if rand is None else rand + (k.endswith("norm.weight") * 1.0)
    assert out, src
    return out


def _fusion(prefix: str, d: int, g: torch.Generator | None) -> dict[str, torch.Tensor]:
    """enorm, hnorm, eh_proj: random, or (g None) the embedding alone through unit norms: fc = [I, 0]."""
    if g is None:
        return {f"{prefix}enorm.weight": torch.ones(d), f"{prefix}hnorm.weight": torch.ones(d),
                f"{prefix}eh_proj.weight": torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1)}  # fmt: skip
    return {f"{prefix}enorm.weight": 1 + torch.randn(d, generator=g) * 0.1,
            f"{prefix}hnorm.weight": 1 + torch.randn(d, generator=g) * 0.1,
            f"{prefix}eh_proj.weight": torch.randn(d, 2 * d, generator=g) * 0.1}  # fmt: skip


def nemotron_head(weights: dict[str, torch.Tensor], g: torch.Generator | None, attn: int = 2,
                  moe: int = 1) -> dict[str, torch.Tensor]:  # fmt: skip
    """`mtp.layers.0` shaped as attention layer `attn` (with the fusion), `mtp.layers.1` as MoE layer `moe` (with
    final_layernorm): Nemotron-3's default mtp_layers_block_type."""
    d = weights["backbone.norm_f.weight"].shape[0]
    head = {**_block(weights, f"backbone.layers.{attn}.", "mtp.layers.0.", g), **_fusion("mtp.layers.0.", d, g),
            **_block(weights, f"backbone.layers.{moe}.", "mtp.layers.1.", g)}  # fmt: skip
    final = weights["backbone.norm_f.weight"]
    head["mtp.layers.1.final_layernorm.weight"] = final.clone() if g is None else 1 + torch.randn(d, generator=g) * 0.1
    return head


def ling_head(weights: dict[str, torch.Tensor], g: torch.Generator | None, n: int = 4) -> dict[str, torch.Tensor]:
    """`model.layers.{n}`: the fusion, a decoder layer shaped as the last one (MLA + MoE), final_layernorm, and the
    shared embedding and head copies the hub stores there too (skipped by the loader)."""
    d = weights["model.norm.weight"].shape[0]
    p = f"model.layers.{n}."
    head = {**_block(weights, f"model.layers.{n - 1}.", p, g), **_fusion(p, d, g)}
    head[p + "final_layernorm.weight"] = 1 + torch.randn(d, generator=g) * 0.1
    head[p + "embed_tokens.weight"] = weights["model.word_embeddings.weight"].clone()
    head[p + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    return head


def with_head(src: Path, dst: Path, head: Head | Callable[..., dict[str, torch.Tensor]], seed: int | None = 0) -> Path:
    """A copy of `src` with the head's weights added to its safetensors file (seed None: the copy head)."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    g = None if seed is None else torch.Generator().manual_seed(seed)
    save_file({**weights, **head(weights, g)}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _quiet_mamba(path: Path) -> Path:
    """Layer 0's (Mamba2) output projection scaled by 0.05 and every embedding row to RMS 1: the copy head (unit
    norms, fc = [I, 0]), which lacks layer 0, then drafts what the target computes, mostly."""
    return unit_rms_embedding(path, "backbone.embeddings.weight", {"backbone.layers.0.mixer.out_proj.weight": 0.05})


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec_mtp_families")
    nh = tiny_model_dir(root / "nh", "nemotron_h", num_nextn_predict_layers=1)
    ling = tiny_model_dir(root / "ling", "bailing_hybrid", num_mtp_layers=1)
    small = _quiet_mamba(tiny_model_dir(root / "small", "nemotron_h", num_nextn_predict_layers=1,
                                        layers_block_type=["mamba", "attention", "moe"]))
    return {"nemotron": nh, "nemotron-mtp": with_head(nh, root / "nemotron-mtp", nemotron_head),
            "ling": ling, "ling-mtp": with_head(ling, root / "ling-mtp", ling_head),
            "small": small, "copy": with_head(small, root / "copy", lambda w, g: nemotron_head(w, g, 1, 2), None),
            "nemotron-plain": tiny_model_dir(root / "plain", "nemotron_h")}  # fmt: skip


PAIRS = {"nemotron-mtp": "nemotron", "ling-mtp": "ling", "copy": "small"}


@pytest.mark.parametrize("name", ["nemotron-mtp", "ling-mtp"])
def test_loader_reads_the_head_only_when_asked(models: dict[str, Path], name: str,
                                               caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """The target's load skips the head; load_mtp_head reads every weight of it (the fusion, each block, the final
    norm) under the hub's names, skips the shared embedding / head copies, and logs what it read."""
    loaded = load_model(models[name])
    stored = load_file(str(models[name] / "model.safetensors"))
    if name == "nemotron-mtp":  # skipped by declared prefix, counted
        assert loaded.ignored_weights["mtp."] == sum(k.startswith("mtp.") for k in stored)
    with caplog.at_level(logging.INFO, logger="recap.model.mtp_load"):
        head = load_mtp_head(loaded.path, loaded.model, loaded.config, torch.float32)
    params = head.state_dict()
    assert f"read the MTP head ({len(params)} tensors" in caplog.text
    by_head_name = {loaded.model.mtp_weight_name(k): t for k, t in stored.items()}
    by_head_name.pop(None)
    assert set(by_head_name) == set(params) and len(head.layers) == len(loaded.config.mtp_layer_types)
    assert {k.split(".")[0] for k in params} == {"fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "layers", "norm"}
    for key, t in params.items():
        torch.testing.assert_close(t, by_head_name[key])


def test_a_checkpoint_without_a_head_gets_a_typed_error(models: dict[str, Path], tmp_path: Path) -> None:
    """Config declaring no MTP layers; declaring them without the weights; a head with a recurrent block."""
    plain = load_model(models["nemotron-plain"])
    with pytest.raises(MTPWeightsMissingError, match="declares no multi-token-prediction layers"):
        load_mtp_head(plain.path, plain.model, plain.config, torch.float32)
    with pytest.raises(MTPWeightsMissingError, match="declares no multi-token-prediction layers"):
        make(models["nemotron-plain"], spec())
    for bare in ("nemotron", "ling"):
        with pytest.raises(MTPWeightsMissingError, match="holds no MTP head weights"):
            make(models[bare], spec())
    mamba = tiny_model_dir(tmp_path, "nemotron_h", num_nextn_predict_layers=1, mtp_layers_block_type=["mamba", "moe"])
    inkling = tiny_model_dir(tmp_path, "inkling", num_mtp_layers=1)  # conv-attention: its output convs keep state
    for path, kinds in ((mamba, ("mamba2", "none")), (inkling, ("conv_attention",))):
        loaded = load_model(path)
        assert loaded.config.mtp_layer_types == kinds
        with pytest.raises(UnsupportedMTPHeadError, match="recurrent blocks"):
            load_mtp_head(loaded.path, loaded.model, loaded.config, torch.float32)


def test_omni_names_its_head_under_language_model(tmp_path: Path) -> None:
    """Nemotron-3 Nano Omni: the text model's `mtp.layers.*` under `language_model.`, skipped by the target's load."""
    loaded = load_model(tiny_model_dir(tmp_path, "nemotron_h_omni", text_config={"num_nextn_predict_layers": 1}))
    assert loaded.config.mtp_layer_types == ("attention", "none")
    name = loaded.model.mtp_weight_name
    assert "language_model.mtp." in loaded.model.ignored_checkpoint_prefixes
    assert name("language_model.mtp.layers.0.eh_proj.weight") == "fc.weight"
    assert name("language_model.mtp.layers.1.mixer.gate.weight") == "layers.1.mixer.gate.weight"
    assert name("language_model.mtp.layers.1.final_layernorm.weight") == "norm.weight"
    assert name("mtp.layers.0.eh_proj.weight") is None and name("language_model.backbone.norm_f.weight") is None


@pytest.mark.parametrize("name", ["nemotron-mtp", "ling-mtp"])
def test_drafts_equal_the_one_row_reference(models: dict[str, Path], name: str) -> None:
    """Every step's drafts (folded chunks across steps and requests, paged K/V of each attention block, chained
    rows) equal the reference's from scratch over the request's committed tokens; caching off."""
    assert_drafts_equal_the_reference(make(models[name], spec(), caching=False, max_num_batched_tokens=24),
                                      _prompts()[:4])  # fmt: skip


@pytest.mark.parametrize("name", ["nemotron-mtp", "ling-mtp", "copy"])
def test_mtp_equals_plain_greedy(models: dict[str, Path], name: str) -> None:
    """Prefix caching on (prompts sharing a 40-token prefix, run twice: the second pass hits a checkpoint), chunked
    prefill (a 24-token budget), a batch of five; the drafter's pool is whole again once the requests leave. The
    copy head (Nemotron-H's attention and MoE layers copied, the Mamba2 layer nearly silent) has most drafts
    accepted, so accepted drafts are exercised as well as rejected ones."""
    prompts = _prompts()
    want = tokens(make(models[PAIRS[name]], None, caching=False), prompts)
    llm = make(models[name], spec(), max_num_batched_tokens=24)
    drafter = llm.engine.runner.drafter
    assert isinstance(drafter, MTPDrafter)
    free = drafter.num_free_blocks
    assert tokens(llm, prompts) == want
    again = llm.generate(prompts, GREEDY)  # the repeated prompts hit the checkpoints the first pass wrote
    assert [o.outputs[0].token_ids for o in again] == want
    assert all(o.num_cached_tokens > 0 for o, p in zip(again, prompts) if len(p) > 16)
    llm.engine.step()
    assert drafter.num_free_blocks == free and not drafter._seqs
    s = llm.engine.scheduler.stats.spec
    assert s.num_drafts > 10 and s.num_draft_tokens >= s.num_drafts
    if name == "copy":
        assert s.num_accepted_tokens > 0.5 * s.num_draft_tokens, s



@torch.inference_mode()
def test_ling_head_equals_transformers_mtp_layer(tmp_path: Path) -> None:
    """recap's Ling 3.0 head (fusion, MLA + MoE block, final_layernorm) equals transformers' MtpLayer (enorm first,
    the family's decoder layer, post norm) over one row, given the same target hidden states. transformers cannot
    derive the module's layer types for bailing_hybrid (its get_mtp_config asks for mtp_layer_types), so the test
    names them; the module's block is saved through the main model's layer 3 to get the hub's names."""
    import transformers as tf
    from transformers.modeling_layers import MtpModel

    cfg = tiny_hf_config("bailing_hybrid", num_mtp_layers=1)
    torch.manual_seed(0)
    hf = tf.BailingHybridForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "base")
    cfg.mtp_layer_types, cfg.mtp_mlp_layer_types = ["full_attention"], ["sparse"]
    mtp = MtpModel(hf, 1).eval()
    g = torch.Generator().manual_seed(1)
    for n, p in mtp.layers.named_parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if n.endswith("norm.weight") else 0.0))
    layer = mtp.layers[0]
    hf.model.layers[3].load_state_dict(layer.mtp_block.state_dict())
    hf.save_pretrained(tmp_path / "moved")
    moved = load_file(str(tmp_path / "moved" / "model.safetensors"))
    head = {k.replace("model.layers.3.", "model.layers.4."): t for k, t in moved.items() if ".layers.3." in k}
    parts = {"enorm": layer.enorm, "hnorm": layer.hnorm, "eh_proj": layer.eh_proj, "final_layernorm": layer.post_norm}
    head.update({f"model.layers.4.{k}.weight": m.weight.detach().clone() for k, m in parts.items()})
    path = tmp_path / "ckpt"
    shutil.copytree(tmp_path / "base", path)
    save_file({**load_file(str(path / "model.safetensors")), **head}, str(path / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip

    loaded = load_model(path)
    ours = load_mtp_head(loaded.path, loaded.model, loaded.config, torch.float32)
    ids = torch.randint(3, 500, (21,), generator=g).tolist()
    batch, caches = _one_row(ids[:-1], loaded.config)
    hidden = loaded.model(batch, caches)  # h_0..h_19
    batch, caches = _one_row(ids[1:], mtp_layer_config(loaded.config))  # row i: x_{i+1} at position i
    got = ours(loaded.model.embed(batch.input_ids), hidden, batch, caches)
    want = mtp.forward_layer(0, hidden[None], torch.arange(len(ids) - 1)[None], None, input_ids=torch.tensor([ids[1:]]))
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)
