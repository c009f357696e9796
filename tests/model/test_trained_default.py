"""The shipped trained default models (recap/model/weights/): they load as NemotronH, their logits equal
transformers', greedy generation is deterministic English, and recap's perplexity equals transformers'."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from recap import LLM, SamplingParams
from recap.bench.perplexity import (
    engine_perplexity,
    llama_cpp_score_from,
    llama_cpp_windows,
    transformers_perplexity,
    windows_of,
)
from recap.engine.model_defaults import generation_defaults
from recap.kernels.metadata import SeqSpec
from recap.model.cache import ModelCaches
from recap.model.config import load_config
from recap.model.default_model import DEFAULT_MAX_NEW_TOKENS, SPECIAL_TOKENS
from recap.model.loader import load_model, load_tokenizer
from recap.model.testing import forward_step
from recap.model.trained_default import default_model_path, draft_model_path

# Not from the training documents: a sentence in the style of both (an address and a sea story).
TEXT = ("Fellow citizens, the state of the Union is strong, and the Congress has met this year to consider the "
        "welfare of the people. The ship sailed on through the night, and the whale was seen far away upon the "
        "sea. I have the honor to inform you that the Treaty with Spain has been ratified by the Senate.")  # fmt: skip
PROMPTS = ["The Congress of the United States", "Call me Ishmael. The sea was", "It is my duty to"]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


@pytest.fixture(scope="module")
def corpus_words() -> frozenset[str]:
    return frozenset((default_model_path() / "corpus_words.txt").read_text().split())


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_threads=1)  # no model: the trained default


def test_shipped_models_are_small_nemotron_h_hybrids_with_one_tokenizer() -> None:
    main, draft = default_model_path(), draft_model_path()
    for folder in (main, draft):
        cfg = load_config(folder)
        assert cfg.architecture == "NemotronHForCausalLM"
        assert cfg.attention_layers and cfg.ssm_layers  # a hybrid: Mamba2 and attention
        assert (folder / "model.safetensors").stat().st_size <= 30 * 2**20
        assert generation_defaults(folder) == {"max_tokens": DEFAULT_MAX_NEW_TOKENS}
    assert (main / "tokenizer.json").read_bytes() == (draft / "tokenizer.json").read_bytes()
    assert load_config(draft).hidden_size < load_config(main).hidden_size
    tok = load_tokenizer(main)
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    chat = tok.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                   tokenize=False)  # fmt: skip
    assert chat == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("which", ["main", "draft"])
def test_logits_equal_transformers_fp32(which: str) -> None:
    from transformers import AutoModelForCausalLM

    folder = default_model_path() if which == "main" else draft_model_path()
    ids = load_tokenizer(folder)(TEXT)["input_ids"]
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0].float()
    lm = load_model(folder, dtype=torch.float32)
    caches = ModelCaches.allocate(lm.config, 16, 16, 2, torch.float32)
    blocks = list(range(1, (len(ids) + 15) // 16 + 1))
    hidden, _ = forward_step(lm.model, caches, [SeqSpec(ids, 0, blocks, state_slot=1)])
    logits = lm.model.compute_logits(hidden)
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max() <= 1e-4 * max(1.0, float(ref.abs().max()))


def test_greedy_generation_is_deterministic_english(llm: LLM, corpus_words: frozenset[str]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    first = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    again = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    assert first == again
    words = [w for text in first for w in _words(text)]
    assert len(words) >= 3 * len(PROMPTS), first
    known = sum(w in corpus_words for w in words) / len(words)
    assert known >= 0.7, (known, first)


def test_perplexity_through_prompt_logprobs_equals_transformers(llm: LLM, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    windows = windows_of(llm.get_tokenizer(), TEXT, window=24)
    assert len(windows) >= 2 and windows[0][0] == 0  # several windows, each after <|endoftext|>
    got = engine_perplexity(llm, windows)
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_path()), dtype=torch.float32).eval()
    ref = transformers_perplexity(hf, windows)
    assert got.scored_tokens == ref.scored_tokens == sum(len(w) - 1 for w in windows)
    assert abs(got.perplexity / ref.perplexity - 1) <= 0.005, (got.perplexity, ref.perplexity)
    assert 1.0 < ref.perplexity < 8192  # better than uniform over the vocabulary


def test_eval_perplexity_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from recap import cli

    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    assert cli.main(["eval", "perplexity", "--data", str(data), "--window", "32", "--num-threads", "1",
                     "--transformers"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    (recap_ppl,) = re.findall(r"recap float32: perplexity ([\d.]+)", out)
    (hf_ppl,) = re.findall(r"transformers float32: perplexity ([\d.]+)", out)
    assert abs(float(recap_ppl) / float(hf_ppl) - 1) <= 0.005, out


def test_llama_cpp_protocol_through_prompt_logprobs_equals_transformers(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    ids = llm.get_tokenizer()(TEXT, add_special_tokens=False)["input_ids"]
    chunks, first = llama_cpp_windows(ids, 16, None), llama_cpp_score_from(16)
    assert len(chunks) >= 2
    got = engine_perplexity(llm, chunks, first)
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_path()), dtype=torch.float32).eval()
    ref = transformers_perplexity(hf, chunks, first)
    assert got.scored_tokens == ref.scored_tokens == len(chunks) * 7
    assert abs(got.perplexity / ref.perplexity - 1) <= 0.005, (got.perplexity, ref.perplexity)


def test_eval_perplexity_command_llama_cpp_protocol(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from recap import cli

    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    assert cli.main(["eval", "perplexity", "--data", str(data), "--window", "16", "--protocol", "llama-cpp",
                     "--num-threads", "1", "--transformers"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    (recap_ppl, scored) = re.findall(r"recap float32: perplexity ([\d.]+) over (\d+) tokens", out)[0]
    (hf_ppl,) = re.findall(r"transformers float32: perplexity ([\d.]+)", out)
    assert int(scored) % 7 == 0  # 16-token chunks, tokens 9..15 of each scored
    assert abs(float(recap_ppl) / float(hf_ppl) - 1) <= 0.005, out
