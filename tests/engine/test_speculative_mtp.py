"""Speculative method "mtp" (runner/mtp_drafter.py): the checkpoint's MTP head (`mtp.*`, added by hand to tiny
Qwen3.5 checkpoints: transformers drops them) proposes the drafts. The loader reads the head only when asked; the
drafter's paged, batched, chained drafts equal a plain one-row reference; greedy output equals the unspeculated run
token for token (prefix caching on, chunked prefill); a head built from the target's own layer is accepted."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from recap import LLM, SamplingParams
from recap.model.layers.mtp import reference_drafts
from recap.model.loader import load_model
from recap.model.mtp_load import MTPWeightsMissingError, load_mtp_head
from recap.runner.mtp_drafter import MTPDrafter
from tests.engine.conftest import tiny_model_dir
from tests.engine.test_speculative_draft import make, tokens
from tests.engine.workloads import rnd

K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def with_mtp(src: Path, dst: Path, seed: int = 0, layer: int = 1, copy: bool = False) -> Path:
    """A copy of `src` with an MTP head under the checkpoint's names: fc [D, 2D], the two pre-fc norms, a decoder
    layer shaped as the target's full-attention layer `layer`, and the final norm. Random (N(0, 0.1), norms near
    0: they are zero-centred), or with copy: the head reads only the embedding (fc = [I, 0]) through a copy of
    layer `layer`, so it predicts the target's next token as the target would without its first token."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    d = weights["model.embed_tokens.weight"].shape[1]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g) * 0.1

    prefix = f"model.layers.{layer}."
    layer_keys = {k.removeprefix(prefix): t for k, t in weights.items() if k.startswith(prefix)}
    mtp = {f"mtp.layers.0.{k}": (t.clone() if copy else rand(*t.shape)) for k, t in layer_keys.items()}
    fc = torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1) if copy else rand(d, 2 * d)
    mtp.update({"mtp.fc.weight": fc, "mtp.norm.weight": weights["model.norm.weight"].clone() if copy else rand(d)})
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        mtp[f"mtp.{name}.weight"] = torch.zeros(d) if copy else rand(d)
    save_file({**weights, **mtp}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def unit_rms_embedding(path: Path, key: str = "model.embed_tokens.weight",
                       scaled: dict[str, float] | None = None) -> Path:  # fmt: skip
    """Every embedding row (`key`) scaled to RMS 1: the head's pre-fc norm (weight 0, so 1 + 0) then leaves it
    unchanged; each tensor of `scaled` multiplied by its factor."""
    weights = load_file(str(path / "model.safetensors"))
    for name, factor in (scaled or {}).items():
        weights[name] *= factor
    e = weights[key]
    weights[key] = e / e.pow(2).mean(-1, keepdim=True).sqrt()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec_mtp")
    plain = tiny_model_dir(root, "qwen3_5")
    attn = unit_rms_embedding(tiny_model_dir(root / "attn", "qwen3_5", num_hidden_layers=1,
                                             layer_types=["full_attention"]))  # fmt: skip
    nxt = tiny_model_dir(root, "qwen3_next")  # layer 3: full attention with a MoE
    return {"plain": plain, "mtp": with_mtp(plain, root / "mtp"), "next": nxt,
            "next-mtp": with_mtp(nxt, root / "next-mtp", layer=3),
            "copy": with_mtp(attn, root / "copy", layer=0, copy=True)}


def spec(k: int = K, backoff: int = 0) -> dict[str, object]:
    return {"method": "mtp", "num_speculative_tokens": k, "max_draft_backoff": backoff}


def _prompts() -> list[list[int]]:
    shared = rnd(9, 40)
    return [rnd(1, 7) * 5, shared + rnd(2, 9), rnd(3, 11) * 3 + rnd(4, 5), shared + rnd(5, 20), rnd(6, 3)]


def test_loader_reads_the_head_only_when_asked(models: dict[str, Path]) -> None:
    loaded = load_model(models["mtp"])
    assert loaded.ignored_weights.get("mtp.", 0) > 5  # the target's load still skips them
    head = load_mtp_head(loaded.path, loaded.model, loaded.config, torch.float32)
    stored = load_file(str(models["mtp"] / "model.safetensors"))
    for key, t in head.state_dict().items():
        torch.testing.assert_close(t, stored["mtp." + key])
    plain = load_model(models["plain"])
    with pytest.raises(MTPWeightsMissingError, match="no MTP head"):
        load_mtp_head(plain.path, plain.model, plain.config, torch.float32)
    with pytest.raises(MTPWeightsMissingError, match="no MTP head"):
        make(models["plain"], spec())


@pytest.mark.parametrize("name", ["mtp", "next-mtp"])
def test_drafts_equal_the_one_row_reference(models: dict[str, Path], name: str) -> None:
    """Every step's drafts (folded chunks across steps and requests, paged K/V, chained rows) equal the reference's
    from scratch over the request's committed tokens; caching off (a hit leaves the head's rows unfilled). Qwen3.5
    (dense) and Qwen3-Next (the head's layer a MoE)."""
    assert_drafts_equal_the_reference(make(models[name], spec(), caching=False, max_num_batched_tokens=24), _prompts())


def assert_drafts_equal_the_reference(llm: LLM, prompts: list[list[int]]) -> None:
    """Run `prompts`, recording every step's drafts; each equals the head's one-row reference from scratch over
    the request's committed tokens."""
    drafter = llm.engine.runner.drafter
    assert isinstance(drafter, MTPDrafter)
    seen: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose

    def recording(out):  # type: ignore[no-untyped-def]
        step, drafts = propose(out)
        for s in out.scheduled:
            if s.request_id in drafts:
                n = s.num_computed_tokens + len(s.token_ids)
                seen.append(([*s.prompt_token_ids, *s.output_token_ids][:n], drafts[s.request_id]))
        return step, drafts

    drafter.propose = recording  # type: ignore[method-assign]
    tokens(llm, prompts)
    assert len(seen) > 10
    for committed, drafts in seen:
        assert drafts == reference_drafts(drafter.head, drafter.config, drafter.target, committed, len(drafts))


@pytest.mark.parametrize(("name", "chunk"), [("mtp", 24), ("mtp", 512), ("next-mtp", 24)])
def test_mtp_equals_plain_greedy(models: dict[str, Path], name: str, chunk: int) -> None:
    """Prefix caching on (prompts sharing a 40-token prefix, run twice: the second pass hits), chunked prefill
    (a 24-token budget), a batch of five; the drafter's pool is whole again once the requests leave."""
    prompts = _prompts()
    want = tokens(make(models[{"mtp": "plain", "next-mtp": "next"}[name]], None, caching=False), prompts)
    llm = make(models[name], spec(), max_num_batched_tokens=chunk)
    drafter = llm.engine.runner.drafter
    assert isinstance(drafter, MTPDrafter)
    free = drafter.num_free_blocks
    assert llm.engine.runner.memory_plan().draft_bytes == drafter.total_bytes > 0  # the head and its pool
    assert tokens(llm, prompts) == want
    assert tokens(llm, prompts) == want  # cache hits now
    llm.engine.step()  # the runner hears of the last finished requests
    assert drafter.num_free_blocks == free and not drafter._seqs
    s = llm.engine.scheduler.stats.spec
    assert s.num_drafts > 10 and s.num_draft_tokens >= s.num_drafts


def test_metrics_count_drafts_and_acceptance(models: dict[str, Path]) -> None:
    """A head built from the target's own (only) layer drafts the target's continuation: most drafts are accepted,
    output unchanged; the counters add up."""
    prompts = [rnd(11, 30), rnd(12, 50) * 2]
    want = tokens(make(models["copy"], None, caching=False), prompts)
    llm = make(models["copy"], spec(k=4))
    assert tokens(llm, prompts) == want
    s = llm.engine.scheduler.stats.spec
    assert s.num_drafts > 0 and s.num_draft_tokens >= s.num_drafts
    assert sum(s.accepted_per_position) == s.num_accepted_tokens
    assert s.num_accepted_tokens > 0.5 * s.num_draft_tokens, s
    assert s.mean_acceptance_length > 2.0
    snap = llm.engine.metrics_snapshot().spec
    assert (snap.num_drafts, snap.num_draft_tokens, snap.num_accepted_tokens) == (
        s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)


def test_preemption_under_mtp(models: dict[str, Path]) -> None:
    """A KV pool of 12 blocks for five requests: preempted ones recompute (their head rows too), output unchanged."""
    path = models["copy"]
    block_bytes = make(path, None, caching=False).engine.runner.kv_bytes_per_token * 16
    prompts = [rnd(60 + i, 50 + 7 * i) for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = tokens(make(path, None, caching=False), prompts, params)
    llm = make(path, spec(), kv_cache_bytes=12 * block_bytes, max_model_len=160, max_num_batched_tokens=64)
    assert tokens(llm, prompts, params) == want
    stats = llm.engine.scheduler.stats
    assert stats.preemptions > 0 and stats.spec.num_accepted_tokens > 0


def test_a_request_the_heads_pool_cannot_hold_decodes_plainly(models: dict[str, Path]) -> None:
    """Four free blocks in the head's pool: the first request holds them (64 rows), the others are refused (no
    drafts until they leave); the output is unchanged and the blocks all come back."""
    prompts = [rnd(80, 30), rnd(81, 20), rnd(82, 25)]
    want = tokens(make(models["copy"], None, caching=False), prompts)
    llm = make(models["copy"], spec())
    drafter = llm.engine.runner.drafter
    assert isinstance(drafter, MTPDrafter)
    drafter._free_blocks = drafter._free_blocks[-4:]
    refused: set[str] = set()
    forget = drafter.forget

    def recording(rid: str) -> None:
        if rid in drafter._refused:
            refused.add(rid)
        forget(rid)

    drafter.forget = recording  # type: ignore[method-assign]
    assert tokens(llm, prompts) == want
    llm.engine.step()
    assert refused and drafter.num_free_blocks == 4 and llm.engine.scheduler.stats.spec.num_accepted_tokens > 0


def test_sampled_requests_with_mtp(models: dict[str, Path]) -> None:
    """A seeded sampled request: verification of the (deterministic) drafts draws as the plain sampler does (a low
    temperature: the tiny model's distributions are flat, and the head drafts its argmax)."""
    params = SamplingParams(temperature=0.1, max_tokens=20, seed=3, ignore_eos=True)
    prompts = [rnd(11, 30), rnd(12, 50) * 2]
    want = [tokens(make(models["copy"], None, caching=False), [p], params)[0] for p in prompts]
    llm = make(models["copy"], spec())
    assert tokens(llm, prompts, params) == want
    assert llm.engine.scheduler.stats.spec.num_accepted_tokens > 0
