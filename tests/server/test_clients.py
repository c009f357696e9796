"""Real clients against a live server: LangChain's ChatOpenAI.with_structured_output (json_schema and
function calling) and bind_tools (invoked and streamed), lm-eval's local-completions on a tiny local
multiple-choice task (loglikelihood, which reads echo + prompt logprobs) and guidellm's streaming
benchmark with its default backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel

from tests.server.conftest import MODEL_NAME


class Verdict(BaseModel):
    """A yes/no verdict."""

    answer: Literal["yes", "no"]
    confidence: Literal["low", "high"]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server: object, method: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL_NAME, base_url=f"{server.url}/v1", api_key="unused",  # type: ignore[attr-defined]
                     temperature=1.0, max_tokens=60, max_retries=0, seed=2)
    # strict: the schema gets additionalProperties false, so a random model cannot invent keys forever
    structured = llm.with_structured_output(Verdict, method=method, strict=True)
    out = structured.invoke("Is the pump running?")
    assert isinstance(out, Verdict)


def test_langchain_bind_tools_invoke_and_stream(server: object) -> None:
    """bind_tools with a forced choice: the calls LangChain reads from one answer, and the same calls
    accumulated from the streamed tool-call chunks (same seed)."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Oslo"], unit: Literal["C", "F"]) -> str:
        """Weather in a city."""
        return f"18 {unit} in {city}"

    llm = ChatOpenAI(model=MODEL_NAME, base_url=f"{server.url}/v1", api_key="unused",  # type: ignore[attr-defined]
                     temperature=1.0, max_tokens=60, max_retries=0, seed=4)
    bound = llm.bind_tools([get_weather], tool_choice="any", strict=True)  # "any": OpenAI's required
    whole = bound.invoke("Weather in Oslo?")
    assert [c["name"] for c in whole.tool_calls] and all(c["name"] == "get_weather" for c in whole.tool_calls)
    assert all(c["args"]["city"] in ("Paris", "Oslo") for c in whole.tool_calls)
    streamed = None
    for chunk in bound.stream("Weather in Oslo?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(c["name"], c["args"]) for c in whole.tool_calls]


def test_lm_eval_local_completions_multiple_choice(server: object, tiny_model: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the task's data is a local file
    rows = [{"question": f"Q{i}: which valve is open?", "choices": ["the left one", "the right one", "neither"],
             "label": i % 3} for i in range(6)]
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n")
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(f"model={MODEL_NAME},base_url={server.url}/v1/completions,"  # type: ignore[attr-defined]
                    f"tokenizer={tiny_model},tokenizer_backend=huggingface,tokenized_requests=True,max_retries=1"),
        tasks=["tiny_mc"], task_manager=TaskManager(include_path=str(tasks), include_defaults=False), limit=6,
        log_samples=True,
    )
    assert results is not None
    acc = results["results"]["tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    samples = results["samples"]["tiny_mc"]
    assert len(samples) == 6
    for sample in samples:
        logliks = [float(r[0]) for r in sample["filtered_resps"]]
        assert len(logliks) == 3 and all(v < 0 for v in logliks)  # one real loglikelihood per choice
        assert len(set(logliks)) > 1


def test_guidellm_streaming_benchmark(server: object, tiny_model: Path, tmp_path: Path) -> None:
    """guidellm's own CLI with its default backend (streaming chat completions with stream_options
    include_usage + continuous_usage_stats, ignore_eos, max_completion_tokens): every request succeeds
    and streams its tokens. guidellm 0.8 has no default profile or data; synchronous and small here."""
    out = tmp_path / "guidellm.json"
    cmd = [sys.executable, "-m", "guidellm", "run", "--backend", f"kind=openai_http,target={server.url}",  # type: ignore[attr-defined]
           "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=4",
           "--data", "kind=synthetic_text,prompt_tokens=48,output_tokens=24",
           "--tokenizer", f"kind=huggingface_auto,model={tiny_model}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (bench,) = json.loads(out.read_text())["benchmarks"]
    assert bench["metrics"]["request_totals"] == {"successful": 4, "errored": 0, "incomplete": 0, "total": 4}
    for req in bench["requests"]["successful"]:
        body = json.loads(req["request_args"])["body"]
        assert body["stream"] is True and body["stream_options"]["continuous_usage_stats"] is True
        assert req["info"]["status"] == "completed" and req["output_tokens"] == 24
        assert req["output_tokens_per_iteration"] < 2  # streamed token by token, not in one final chunk
