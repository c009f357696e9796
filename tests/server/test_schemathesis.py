"""Schemathesis against a live `recap serve` subprocess (issue 36): no 5xx, no process death, /health answers
throughout, and afterwards the accounting holds (metrics add up, integrity clean, nothing left in use).

The server parses request bodies itself (recap.http.json_body, for the hostile-input bounds), so its routes
declare no bodies and it serves no /openapi.json: the schema is the app's own `app.openapi()` with each POST
route's request model (recap.server.protocol, recap.server.responses_api_request, recap.server.tokenize_api)
added as its JSON body."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, TEST_LIMITS, engine_config
from tests.server.serve_process import recap_serve
from tests.server.test_disconnect import _assert_all_returned
from tests.server.test_hostile import counts

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES = 600  # per operation and generation mode
CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "max_output_tokens": 8, "min_tokens": 8, "n": 2,
        "best_of": 2}  # bound engine time


def request_models() -> dict[str, type]:
    from recap.server.protocol import ChatCompletionRequest, CompletionRequest
    from recap.server.responses_api_request import ResponsesRequest
    from recap.server.tokenize_api import DetokenizeRequest, TokenizeRequest

    return {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
            "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def openapi_schema(model: Path) -> dict[str, Any]:
    """The server's routes (app.openapi() of the app `recap serve` builds) with their request bodies."""
    from recap.engine.async_engine import AsyncEngine
    from recap.engine.llm_engine import LLMEngine
    from recap.server.app import build_app

    schema = build_app(AsyncEngine(LLMEngine(engine_config(model))), limits=TEST_LIMITS).openapi()
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, cls in request_models().items():
        body = cls.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[cls.__name__] = body
        ref = {"$ref": f"#/components/schemas/{cls.__name__}"}
        schema["paths"][path]["post"]["requestBody"] = {"required": True,
                                                        "content": {"application/json": {"schema": ref}}}
    # what the server enforces past the model's types (a 400 otherwise): most positive chats reach the engine
    components["ChatCompletionRequest"]["properties"]["messages"]["minItems"] = 1
    components["ResponsesRequest"]["properties"]["input"]["minItems"] = 1
    components["InputItem"] = {"oneOf": list(_item_shapes().values())}  # its schema merges the three shapes
    return schema


def _item_shapes() -> dict[str, dict[str, Any]]:
    """The shapes recap.server.responses_api_request.InputItem takes, one per item type."""
    text: dict[str, Any] = {"type": "string"}
    fields = {"message": {"role": {"enum": ["user", "system", "developer", "assistant"]},
                          "content": {"anyOf": [text, {"type": "array", "items": {"$ref": "#/components/schemas/"
                                                                                             "ContentPart"}}]}},
              "function_call": {"call_id": text, "name": text, "arguments": text},
              "function_call_output": {"call_id": text, "output": text}}
    return {kind: {"type": "object", "additionalProperties": False, "required": ["type", *own],
                   "properties": {"type": {"const": kind}, "id": text, **own}} for kind, own in fields.items()}


class HealthProbe(threading.Thread):
    """GET /health every 50 ms while the fuzz runs; records each latency (ms) and any probe that failed."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.ms, self.failures = url, threading.Event(), [], []  # type: ignore[var-annotated]

    def run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self.stop.wait(0.05):
                t0 = time.perf_counter()
                try:
                    status = c.get(f"{self.url}/health").status_code
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))
                    continue
                self.ms.append((time.perf_counter() - t0) * 1e3)
                if status != 200:
                    self.failures.append(f"status {status}")


def capped(body: Any) -> Any:
    if isinstance(body, dict):
        return {k: min(v, CAPS[k]) if k in CAPS and isinstance(v, int) and not isinstance(v, bool) else v
                for k, v in body.items()}
    return body


@dataclass
class Tally:
    seen: Counter = field(default_factory=Counter)  # (operation, status) -> responses
    samples: dict[str, str] = field(default_factory=dict)  # the first response body of each (operation, status)
    server_errors: list[str] = field(default_factory=list)


def fuzz_operation(op: Any, mode: Any, url: str, tally: Tally) -> None:
    """EXAMPLES derandomized cases of one operation in one generation mode, each response's status counted."""
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(case=op.as_strategy(generation_mode=mode))
    def send(case: Any) -> None:
        case.body = capped(case.body)
        if mode == GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL_NAME  # past the model check, into the engine
        r = case.call(base_url=url, timeout=120)
        tally.seen[(op.label, r.status_code)] += 1
        tally.samples.setdefault(f"{op.label} {r.status_code}", r.text[:160])
        if r.status_code >= 500:
            tally.server_errors.append(f"{op.label} {r.status_code}: {case.as_curl_command()} -> {r.text[:300]}")

    send()


def fuzz(schema: Any, url: str, tally: Tally) -> None:
    """Every operation, positive and negative."""
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                fuzz_operation(op, mode, url, tally)
            except Unsatisfiable:  # nothing to negate: the operation takes no parameters and no body
                assert mode == GenerationMode.NEGATIVE, op.label


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_schemathesis_finds_no_server_error_and_the_accounting_holds(tiny_model: Path, tmp_path: Path) -> None:
    schema = schemathesis.openapi.from_dict(openapi_schema(tiny_model))
    tally = Tally()
    args = [str(tiny_model), "--served-model-name", MODEL_NAME, "--max-model-len", "512", "--enable-debug-endpoints"]
    with recap_serve(args, tmp_path) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        probe = HealthProbe(url)
        probe.start()
        t0 = time.monotonic()
        try:
            fuzz(schema, url, tally)
        finally:
            probe.stop.set()
            probe.join()
        elapsed = time.monotonic() - t0
        assert http.get("/health").status_code == 200
        _assert_all_returned(http)
        after = counts(url)
        assert after["recap:api_requests_in_progress"] == 0, after
        assert after["recap:api_requests_received_total"] == sum(
            after[f"recap:api_requests_total:{o}"] for o in ("success", "aborted", "rejected")), after
    seen = tally.seen
    report = {"requests": sum(seen.values()), "seconds": round(elapsed, 1),
              "statuses": dict(sorted(Counter(s for _, s in seen.elements()).items())),
              "by_operation": {f"{op} {s}": n for (op, s), n in sorted(seen.items())},
              "health_probes": len(probe.ms), "health_max_ms": round(max(probe.ms), 1),
              "health_median_ms": round(statistics.median(probe.ms), 1),
              "health_p99_ms": round(statistics.quantiles(probe.ms, n=100)[98], 1),
              "health_over_100ms": sum(ms > 100 for ms in probe.ms), "server_errors": tally.server_errors,
              "samples": tally.samples}
    (tmp_path / "schemathesis_report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    assert not tally.server_errors, tally.server_errors
    assert not probe.failures, probe.failures[:10]
