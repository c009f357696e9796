"""Renders one client-supplied chat template, in its own short-lived process (recap.server.template_sandbox).

Run as a script (`python -I template_worker.py`), not imported: it needs only the standard library and
jinja2, so it starts in tens of milliseconds and sees nothing of the server. It reads one JSON job from
stdin, caps its own address space and CPU time first (a template that builds a huge string fails with
MemoryError here, not in the server), renders the template in Jinja's immutable sandbox with what
transformers' apply_chat_template provides (trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
`tojson`, `strftime_now`, `{% generation %}`), and writes one JSON result to stdout: {"text": ...} or
{"error": ...}. A render that runs past the time limit is killed by the parent.
"""

from __future__ import annotations

import json
import resource
import sys
from datetime import datetime
from typing import Any


def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """transformers' `{% generation %}` marks assistant text; rendering keeps the body as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def render(job: dict[str, Any]) -> dict[str, Any]:
    """{"text": the rendering} or {"error": why} for one job (template, messages, variables, limits)."""
    try:
        template = _environment().from_string(job["template"])
        text = template.render(messages=job["messages"], add_generation_prompt=job["add_generation_prompt"],
                               **job["variables"])
    except MemoryError:
        return {"error": "the chat template used more memory than allowed", "limit": "memory"}
    except RecursionError:
        return {"error": "the chat template recursed too deeply", "limit": "recursion"}
    except Exception as e:  # noqa: BLE001 - the template's own error (syntax, raise_exception, sandbox): reported
        return {"error": f"{type(e).__name__}: {e}"}
    if len(text) > job["max_output_chars"]:
        return {"error": f"the chat template rendered {len(text)} characters, more than the {job['max_output_chars']} "
                         "allowed", "limit": "output"}
    return {"text": text}


def main() -> None:
    job = json.loads(sys.stdin.buffer.read())
    resource.setrlimit(resource.RLIMIT_AS, (job["memory_bytes"], job["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_CPU, (job["cpu_seconds"], job["cpu_seconds"]))
    out = render(job)
    sys.stdout.write(json.dumps(out, ensure_ascii=False))


if __name__ == "__main__":
    main()
