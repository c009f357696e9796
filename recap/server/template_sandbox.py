"""Client-supplied chat templates (`chat_template`, or `chat_template_kwargs: {"chat_template": ...}`).

A Jinja template is a program: a 184-byte one can loop for minutes, a 46-byte one can build gigabytes
(issue 36, N2). So a request may carry one only when the server was started with vLLM's
`--trust-request-chat-template` (else a 400), and even then it never runs in the server process: each
render is a fresh process (recap/server/template_worker.py: Jinja's immutable sandbox, an address-space
and CPU-time limit, an output size limit) that is killed when it runs past `timeout_s`. Every limit hit
is a 400 naming `chat_template`; the server keeps serving. The callers run this off the event loop.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recap.engine.chat import Renderer, RenderLimitExceeded
from recap.http.errors import APIError

WORKER = Path(__file__).with_name("template_worker.py")
# The one variable an interpreter may need to start (a Python built against shared libraries off the default path).
_LOADER_ENV = {k: v for k, v in os.environ.items() if k == "LD_LIBRARY_PATH"}
FLAG = "--trust-request-chat-template"
# apply_chat_template's own arguments: passed to the template they would change how it is called, not what it sees.
RESERVED_KWARGS = frozenset({"tokenize", "add_generation_prompt", "continue_final_message", "return_dict",
                             "return_tensors", "return_assistant_tokens_mask", "padding", "truncation", "max_length",
                             "tokenizer_kwargs", "conversation", "messages"})


@dataclass(frozen=True)
class TemplateLimits:
    timeout_s: float = 5.0  # wall clock per render, process start included (~0.1 s)
    max_output_chars: int = 4 * 2**20
    memory_bytes: int = 2**30  # the worker's address space

    def __post_init__(self) -> None:
        if not (self.timeout_s > 0 and self.max_output_chars > 0 and self.memory_bytes >= 2**26):
            raise ValueError(f"template limits must be positive (memory at least 64 MiB), got {self}")


def request_template(template: str | None, kwargs: dict[str, Any] | None) -> tuple[str | None, dict[str, Any]]:
    """The request's own template (the field or `chat_template_kwargs.chat_template`; both must agree) and the
    remaining template variables. Raises APIError for a non-string template or an apply_chat_template argument."""
    kw = dict(kwargs or {})
    in_kwargs = kw.pop("chat_template", None)
    if in_kwargs is not None and not isinstance(in_kwargs, str):
        raise APIError("chat_template_kwargs.chat_template: must be a string (a Jinja template)",
                       param="chat_template_kwargs")
    if template is not None and in_kwargs is not None and template != in_kwargs:
        raise APIError("chat_template and chat_template_kwargs.chat_template disagree; send one of them",
                       param="chat_template")
    reserved = sorted(RESERVED_KWARGS & kw.keys())
    if reserved:
        raise APIError(f"chat_template_kwargs: {', '.join(reserved)} is not a template variable",
                       param="chat_template_kwargs")
    return template if template is not None else in_kwargs, kw


def refuse_untrusted() -> APIError:
    return APIError(f"chat_template: request-level chat templates are not allowed on this server (start recap serve "
                    f"with {FLAG} to allow them; they then render in a sandboxed process with time and size limits)",
                    param="chat_template", code="chat_template_not_allowed")


class TemplateSandbox:
    def __init__(self, limits: TemplateLimits | None = None) -> None:
        self.limits = limits or TemplateLimits()

    def renderer(self, template: str, tokenizer: Any) -> Renderer:
        """A Renderer (recap.engine.chat) of `template`, seeing the tokenizer's special tokens as
        apply_chat_template shows them (bos_token, eos_token, ...)."""
        special = {k: v for k, v in getattr(tokenizer, "special_tokens_map", {}).items() if isinstance(v, (str, list))}

        def render(messages: list[dict[str, Any]], add_generation_prompt: bool, variables: dict[str, Any]) -> str:
            return self.render(template, messages, add_generation_prompt, {**special, **variables})

        return render

    def render(self, template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
               variables: dict[str, Any]) -> str:
        """Raises RenderLimitExceeded (a limit was hit) or ValueError (the template failed)."""
        lim = self.limits
        job = {"template": template, "messages": messages, "add_generation_prompt": add_generation_prompt,
               "variables": variables, "max_output_chars": lim.max_output_chars, "memory_bytes": lim.memory_bytes,
               "cpu_seconds": math.ceil(lim.timeout_s) + 1}
        try:
            # -I: no PYTHON* variables, user site or script directory; env: nothing of the server's (its keys)
            done = subprocess.run([sys.executable, "-I", str(WORKER)], input=json.dumps(job).encode(),
                                  capture_output=True, timeout=lim.timeout_s, env=_LOADER_ENV, check=False)
        except subprocess.TimeoutExpired:
            raise RenderLimitExceeded(f"chat_template: rendering took longer than {lim.timeout_s:g}s") from None
        try:
            out = json.loads(done.stdout)
        except json.JSONDecodeError:
            why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
            raise RenderLimitExceeded(f"chat_template: the rendering process failed ({why[0][:200]})") from None
        if "text" in out:
            return str(out["text"])
        if "limit" in out:
            raise RenderLimitExceeded(f"chat_template: {out['error']}")
        raise ValueError(out["error"])
