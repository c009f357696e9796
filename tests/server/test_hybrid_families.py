"""Nemotron-H, Granite 4.0-H, Falcon-H1, Zamba2, Zamba, MiniMax, RecurrentGemma, Ling 3.0, Qwen4-Exp, RWKV-4,
Inkling and Inkling-2 folders served through the OpenAI API with their own template.

Each folder holds a tiny random checkpoint, the default tokenizer and a chat template of that family's
shape (not recap's default one): the prompt the server builds must be that template's rendering.
`recap serve <folder>` itself is run as a user would on the Nemotron-H and RWKV folders.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from recap.engine.async_engine import AsyncEngine
from recap.engine.llm_engine import LLMEngine
from recap.server.app import build_app
from tests.server.conftest import ServerThread, engine_config
from tests.server.serve_process import recap_serve
from tests.tiny_tokenizer import save_tiny_tokenizer

# Chat templates in the style of each family's hub tokenizer_config (role markers differ from recap's default).
TEMPLATES = {
    "nemotron_h": "{% for m in messages %}<extra_id_1>{{ m['role'] | capitalize }}\n{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<extra_id_1>Assistant\n{% endif %}",
    "granite_hybrid": "{% for m in messages %}<|start_of_role|>{{ m['role'] }}<|end_of_role|>{{ m['content'] }}"
                      "<|end_of_text|>\n{% endfor %}{% if add_generation_prompt %}<|start_of_role|>assistant"
                      "<|end_of_role|>{% endif %}",
    "falcon_h1": "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    "zamba2": "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    "zamba": "{% for m in messages %}### {{ m['role'] | capitalize }}:\n{{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}### Assistant:\n{% endif %}",
    "minimax": "{% for m in messages %}<beginning_of_sentence>{{ m['role'] }} name={{ m['role'] }}\n{{ m['content'] }}"
               "<end_of_sentence>\n{% endfor %}{% if add_generation_prompt %}<beginning_of_sentence>ai name=assistant\n"
               "{% endif %}",
    "recurrent_gemma": "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
                       "else 'user' }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}"
                       "<start_of_turn>model\n{% endif %}",
    # Qwen4-Exp: ChatML turns, the reply opening a thinking block (recap's default is plain ChatML)
    "qwen4_exp": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}",
    # Ling 3.0 (bailing_hybrid): <role>HUMAN</role> ... <|role_end|> turns
    "bailing_hybrid": "{% for m in messages %}<role>{{ {'system': 'SYSTEM', 'user': 'HUMAN', 'assistant': 'ASSISTANT'}"
                      "[m['role']] }}</role>{{ m['content'] }}<|role_end|>{% endfor %}"
                      "{% if add_generation_prompt %}<role>ASSISTANT</role>{% endif %}",
    # RWKV-4 Raven's instruction format: "Bob: ...\n\nAlice:" turns
    "rwkv": "{% for m in messages %}{{ {'system': 'System', 'user': 'Bob', 'assistant': 'Alice'}[m['role']] }}: "
            "{{ m['content'] }}\n\n{% endfor %}{% if add_generation_prompt %}Alice:{% endif %}",
    # Inkling publishes no Jinja template (vLLM renders it natively); this is its wire format as the renderers and
    # Inkling-2's chat_template.jinja describe it: <|message_ROLE|><|content_KIND|>payload<|end_message|>
    "inkling": "{% for m in messages %}<|message_{{ m['role'] }}|><|content_text|>{{ m['content'] }}<|end_message|>"
               "{% endfor %}{% if add_generation_prompt %}<|message_assistant|>{% endif %}",
    # Inkling-2's chat_template.jinja shape: the same blocks, an assistant turn closed by end-of-sampling
    "inkling2": "{% for m in messages %}<|message_{{ m['role'] }}|><|content_text|>{{ m['content'] }}"
                "{% if m['role'] == 'assistant' %}<|content_model_end_sampling|>{% endif %}<|end_message|>"
                "{% endfor %}{% if add_generation_prompt %}<|message_assistant|>{% endif %}",
    # Zaya: transformers maps it to GemmaTokenizer and its eos (106) is Gemma's <end_of_turn>: Gemma's turns, the
    # system message opening the first user turn
    "zaya": "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}<start_of_turn>user\n"
            "{{ m['content'] }}\n\n{% else %}{% if not loop.first and messages[loop.index0 - 1]['role'] == 'system' %}"
            "{{ m['content'] }}<end_of_turn>\n{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
            "'user' }}\n{{ m['content'] }}<end_of_turn>\n{% endif %}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
}  # fmt: skip
MESSAGES = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a valve."}]


def family_dir(root: Path, arch: str) -> Path:
    from recap.model import default_model
    from recap.model.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(arch, root / arch, vocab_size=default_model.VOCAB_SIZE)
    save_tiny_tokenizer(path, default_model.SEED)
    (path / "chat_template.jinja").write_text(TEMPLATES[arch])
    return path


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {arch: family_dir(root, arch) for arch in TEMPLATES}


def _expected_prompt_tokens(path: Path) -> int:
    """Tokens of the folder template's rendering of MESSAGES (which differs from recap's default template's)."""
    from transformers import AutoTokenizer

    from recap.model.default_model import CHAT_TEMPLATE

    tok = AutoTokenizer.from_pretrained(str(path))
    own = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    default = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, chat_template=CHAT_TEMPLATE)
    assert own != default
    n_own, n_default = (len(tok.encode(t, add_special_tokens=False)) for t in (own, default))
    assert n_own != n_default
    return n_own


@pytest.mark.parametrize("arch", sorted(TEMPLATES))
def test_family_serves_chat_with_its_template(family_dirs: dict[str, Path], arch: str) -> None:
    path = family_dirs[arch]
    srv = ServerThread(build_app(AsyncEngine(LLMEngine(engine_config(path)))))
    srv.start()
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        (model,) = client.models.list().data
        first = client.chat.completions.create(model=model.id, messages=MESSAGES, max_tokens=5, temperature=0.0)
        assert first.usage.prompt_tokens == _expected_prompt_tokens(path)
        assert first.usage.completion_tokens >= 1 and first.choices[0].message.role == "assistant"
        again = client.chat.completions.create(model=model.id, messages=MESSAGES, max_tokens=5, temperature=0.0)
        assert again.choices[0].message.content == first.choices[0].message.content  # greedy, with a cache hit
        details = again.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens > 0
        text = client.completions.create(model=model.id, prompt="The valve", max_tokens=4, temperature=0.0)
        assert text.usage.completion_tokens >= 1
    finally:
        srv.stop()


@pytest.mark.parametrize("arch", ["nemotron_h", "rwkv"])  # a hybrid, and an attention-free model (no KV pool)
def test_recap_serve_folder(family_dirs: dict[str, Path], tmp_path: Path, arch: str) -> None:
    path = family_dirs[arch]
    with recap_serve([str(path)], tmp_path) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        (model,) = client.models.list().data
        reply = client.chat.completions.create(model=model.id, messages=MESSAGES, max_tokens=4, temperature=0.0)
        assert reply.usage.prompt_tokens == _expected_prompt_tokens(path)
        assert reply.usage.completion_tokens >= 1
