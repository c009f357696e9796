"""The offline API as vLLM users call it: prompt shapes, vLLM's LLM keywords, generation_config defaults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from recap import LLM, SamplingParams
from recap.engine.errors import InvalidRequestError
from recap.engine.vllm_compat import checkpoint_policy_for, resolve_dtype
from tests.engine.workloads import rnd

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]) -> LLM:
    return LLM(str(tiny_models["bamba"]), max_model_len=256, tensor_parallel_size=1, gpu_memory_utilization=0.9,
               enforce_eager=True, trust_remote_code=True, dtype="auto", seed=0)


def test_prompt_shapes_agree(llm: LLM) -> None:
    ids = rnd(4, 12)
    text = llm.get_tokenizer().decode(ids)
    as_ids = llm.generate(ids, GREEDY)[0]
    as_dict = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]
    assert as_ids.outputs[0].token_ids == as_dict.outputs[0].token_ids and as_dict.prompt_token_ids == ids
    by_text = llm.generate({"prompt": text}, GREEDY)[0]
    assert by_text.prompt == text and by_text.prompt_token_ids == llm.generate(text, GREEDY)[0].prompt_token_ids
    batch = llm.generate([text, {"prompt": text}, {"prompt_token_ids": ids}, ids], GREEDY)
    assert [b.outputs[0].token_ids for b in batch[2:]] == [as_ids.outputs[0].token_ids] * 2
    assert batch[0].outputs[0].token_ids == batch[1].outputs[0].token_ids


@pytest.mark.parametrize(("prompt", "match"), [
    ({"promt": "x"}, "unsupported prompt key"),
    ({"prompt": "x", "prompt_token_ids": [1]}, "exactly one of"),
    ({"prompt": 5}, "'prompt' must be a string"),
    ({"prompt_token_ids": []}, "non-empty list of integers"),
    ([], "non-empty list of prompts"),
    ([{"prompt": "ok"}, 3.5], "prompt 1: a prompt is a string"),
])
def test_bad_prompts_are_clear_errors(llm: LLM, prompt: object, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(prompt, GREEDY)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kw", "error", "match"), [
    ({"top_k": 2.5}, TypeError, "top_k must be an integer, got float"),
    ({"n": 2.0}, TypeError, "n must be an integer, got float"),
    ({"max_tokens": 3.5}, TypeError, "max_tokens must be an integer"),
    ({"seed": 1.5}, TypeError, "seed must be an integer"),
    ({"logprobs": "2"}, TypeError, "logprobs must be an integer, got str"),
    ({"temperature": "0.5"}, TypeError, "temperature must be a number, got str"),
    ({"temperature": float("nan")}, ValueError, "temperature must be a number, got nan"),
    ({"stop": [1]}, TypeError, "stop must be a string or a list of strings, got int"),
    ({"stop_token_ids": [1.0]}, TypeError, "stop_token_ids must be an integer"),
    ({"logit_bias": {1: "x"}}, TypeError, r"logit_bias\[1\] must be a number"),
    ({"seed": 2**64}, ValueError, "seed must be a signed 64-bit integer"),
])
def test_sampling_params_refuse_wrong_types(kw: dict, error: type[Exception], match: str) -> None:
    """A wrong type or NaN fails where the params are made, naming the field: before, a float top_k failed inside
    the engine's batched step (and wedged the LLM), a float max_tokens counted past itself and a NaN temperature
    generated nothing."""
    with pytest.raises(error, match=match):
        SamplingParams(**kw)


def test_sampling_params_take_vllm_spellings() -> None:
    """None for stop / stop_token_ids, numpy numbers, string logit_bias keys and bools (ints) still pass."""
    import numpy as np

    sp = SamplingParams(stop=None, stop_token_ids=None, top_k=np.int64(3), temperature=np.float32(0.5),
                        logit_bias={"5": 1}, logprobs=True, seed=-(2**63))
    assert (sp.stop, sp.stop_token_ids, sp.top_k, sp.temperature, sp.logit_bias, sp.logprobs) == (
        (), (), 3, 0.5, {5: 1.0}, 1)
    assert type(sp.top_k) is int and type(sp.temperature) is float


@pytest.mark.parametrize(("kw", "match"), [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size must be 1"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size must be 1"),
    ({"quantization": "awq"}, "quantization is not supported"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
    ({"dtype": "int8"}, "dtype must be 'auto' or one of"),
    ({"mamba_cache_mode": "sometimes"}, "mamba_cache_mode must be one of"),
    ({"mamba_cache_mode": "all", "checkpoint_policy": "none"}, "disagree"),
])
def test_vllm_keywords_refuse_what_recap_cannot_do(tiny_models: dict[str, Path], kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_models["mamba2"]), max_model_len=128, **kw)


def test_vllm_names_map_to_recap_settings() -> None:
    assert resolve_dtype("auto") == "float32" and resolve_dtype("half") == "float16"
    assert checkpoint_policy_for(None, "align") == "align" and checkpoint_policy_for(None, None) == "recap"


def test_max_model_len_and_sampling_defaults_from_the_folder(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny_models["bamba"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["max_position_embeddings"] = 320
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    llm = LLM(str(folder), mamba_cache_mode="all")
    assert llm.engine.config.scheduler.max_model_len == 320
    assert llm.engine.config.cache.checkpoint_policy == "all"
    defaults = llm.get_default_sampling_params()
    assert defaults.temperature == 0.0 and defaults.max_tokens == 3
    out = llm.generate(rnd(2, 10))[0].outputs[0]  # no params: the folder's defaults
    assert len(out.token_ids) <= 3
    plain = LLM(str(folder), generation_config="vllm").get_default_sampling_params()
    assert plain == SamplingParams()


def test_chat_takes_a_template_and_tools(llm: LLM) -> None:
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "Weather?"}]
    out = llm.chat(msgs, GREEDY, chat_template=template, tools=tools)[0]
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == "[get_weather]<user>Weather?<assistant>"
    plain = llm.chat(msgs, GREEDY, chat_template=template, tools=[])[0]
    assert llm.get_tokenizer().decode(plain.prompt_token_ids) == "<user>Weather?<assistant>"


def test_chat_continues_a_prefilled_final_message(llm: LLM) -> None:
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    msgs = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "It is "}]
    out = llm.chat(msgs, GREEDY, chat_template=template, add_generation_prompt=False, continue_final_message=True)[0]
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == "<user>Weather?</user><assistant>It is "
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(msgs, GREEDY, chat_template=template, continue_final_message=True)
