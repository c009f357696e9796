"""OpenAI-compatible request models (pydantic); the responses are recap/server/responses.py's.

Requests forbid unknown fields (STYLE habit 12: nothing is ignored silently). Documented OpenAI
fields that recap does not implement (best_of, suffix) are accepted only at their no-op value, so
clients that always send defaults work, and anything else is a 400 naming the field.
Extensions, named as vLLM names them: top_k, min_p, min_tokens, repetition_penalty, stop_token_ids,
ignore_eos, prompt_logprobs, include_stop_str_in_output, skip_special_tokens, cache_salt; recap's own:
`checkpoints` (completions: token offsets to checkpoint the recurrent state at) and Anthropic-style
`cache_control` markers on chat messages and parts.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from recap.http.limits import MAX_PROMPTS, MAX_STOP
from recap.sampling_params import SamplingParams
from recap.server.logit_bias import logit_bias_by_id
from recap.server.structured import ResponseFormat, StructuredOutputsField, structured_output
from recap.server.tools import AssistantToolCall, NamedToolChoice, ToolSpec, tool_constraint

MAX_CHECKPOINTS = 256  # explicit checkpoint offsets per request
MAX_CACHE_SALT_CHARS = 1024

PromptInput = str | list[int] | list[str] | list[list[int]]


def _is_token_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage so far on every chunk


class CacheControl(_Strict):
    """Anthropic-style breakpoint: the prefix up to here is worth caching (a segment boundary)."""

    type: Literal["ephemeral"]


class TextPart(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    cache_control: CacheControl | None = None
    tool_calls: list[AssistantToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this result answers
    # An answer's think block sent back (vLLM's `reasoning`, or its earlier `reasoning_content`): the template
    # decides whether it renders (Qwen3's keep only the current turn's)
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"only text content parts are supported, got type {kind!r}")
        return v

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages carry them, not {self.role}")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id: only tool messages carry it, not {self.role}")
        if (self.reasoning is not None or self.reasoning_content is not None) and self.role != "assistant":
            raise ValueError(f"reasoning: only assistant messages carry it, not {self.role}")
        return self

    def parts(self) -> list[str]:
        if self.content is None:
            return [""]
        return [self.content] if isinstance(self.content, str) else [p.text for p in self.content]

    def text(self) -> str:
        """Text parts are joined with newlines (as vLLM does)."""
        return "\n".join(self.parts())

    def template_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [c.template_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        thought = self.reasoning if self.reasoning is not None else self.reasoning_content
        if thought is not None:  # under both names: templates read reasoning_content (Qwen3) or reasoning
            d["reasoning_content"] = d["reasoning"] = thought
        return d


class GenerationFields(_Strict):
    """What every generation endpoint takes (chat, completions, responses): the model, sampling and vLLM's
    extensions; each maps onto SamplingParams."""

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    user: str | None = None  # harmless metadata: logged with the request
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's shape) -> bias
    # extensions (vLLM names)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsField | None = None  # recap/server/structured.py
    cache_salt: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI fields are nullable: null is the default (max_tokens: null means up to the model length)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or k == "max_tokens" or fields[k].default is None}

    @model_validator(mode="after")
    def _generation_checks(self) -> GenerationFields:
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise ValueError(f"stop takes at most {MAX_STOP} strings")
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS:
            raise ValueError(f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters")
        return self


class _SamplingFields(GenerationFields):
    """Fields shared by completions and chat; each maps onto SamplingParams or is checked below."""

    n: int = 1
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = None
    spaces_between_special_tokens: bool = True  # the tokenizer's own rendering; only true is accepted
    use_beam_search: bool = False  # vLLM's beam search: recap has none, only false is accepted
    length_penalty: float = 1.0  # beam search's: only 1.0 (no effect) is accepted
    # output constraints (recap/server/structured.py): at most one, structured_outputs included
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Disaggregated prefill/decode (vLLM's name; recap.disagg.api checks it against the server's role).
    kv_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _common_checks(self) -> _SamplingFields:
        if not self.spaces_between_special_tokens:
            raise ValueError("spaces_between_special_tokens is not supported (only true)")
        if self.use_beam_search:
            raise ValueError("use_beam_search is not supported (only false)")
        if self.length_penalty != 1.0:
            raise ValueError("length_penalty is not supported (only 1.0; it weighs beam search, which recap has not)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def max_tokens_unset(self) -> bool:
        """The client sent neither max_tokens nor max_completion_tokens: the length is a default (the model's
        generation_config or the API's), which a long prompt caps rather than refuses (vLLM's get_max_tokens)."""
        return not ({"max_tokens", "max_completion_tokens"} & self.model_fields_set)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def output_constraint(self) -> Any:
        """The StructuredOutput the fields ask for, or None (raises ValueError naming the field)."""
        guided = {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                  "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar}
        return structured_output(self.response_format, self.structured_outputs, guided)

    def _sampling(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any] | None, **extra: Any
    ) -> SamplingParams:
        """Raises ValueError naming the field (mapped to a 400). `defaults` (the model's generation_config)
        fill the fields this request left unset."""
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        kw: dict[str, Any] = dict(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=stop,
            stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos, logprobs=logprobs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=logit_bias_by_id(self.logit_bias),
            prompt_logprobs=self.prompt_logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )
        if "structured_outputs" not in extra:
            kw["structured_outputs"] = self.output_constraint()
        kw.update(extra)
        for name, value in (defaults or {}).items():
            unset = self.max_tokens_unset if name == "max_tokens" else name not in self.model_fields_set
            if unset and name in kw:
                kw[name] = value
        return SamplingParams(**kw)


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16  # OpenAI's default for completions; null: up to the model length
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    checkpoints: list[int] | None = None  # recap: token offsets where the state is checkpointed

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        ok = isinstance(v, str) or (isinstance(v, list) and v and (
            _is_token_list(v) or all(isinstance(p, str) for p in v) or all(_is_token_list(p) for p in v)))
        if not ok:
            if isinstance(v, list) and not v:
                raise ValueError("prompt must not be empty")
            raise ValueError("prompt must be a string, a list of token ids, or a list of strings or of token-id lists")
        if isinstance(v, list) and not _is_token_list(v) and len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(v)}")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.max_tokens is not None and self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo)")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only equal to n)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.checkpoints is not None and len(self.checkpoints) > MAX_CHECKPOINTS:
            raise ValueError(f"checkpoints takes at most {MAX_CHECKPOINTS} offsets")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt of the batch (a single prompt is a batch of one)."""
        p = self.prompt
        if isinstance(p, str) or _is_token_list(p):
            return [p]
        return list(p)  # type: ignore[arg-type]

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) alone; one token is run and dropped."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """echo with logprobs returns the prompt's logprobs too (at least `logprobs` alternatives each)."""
        prompt_lp = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_lp = max(self.logprobs, prompt_lp or 0)
        if self.prompt_only:
            defaults = {k: v for k, v in (defaults or {}).items() if k != "max_tokens"}
        return self._sampling(1 if self.prompt_only else self.max_tokens, self.logprobs, defaults,
                              prompt_logprobs=prompt_lp)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # false: a forced call is one call (maxItems 1)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: a template variable (and enable_thinking false for "none", unless chat_template_kwargs sets it)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: bool = True  # vLLM's: false leaves the think block out of the answer
    chat_template: str | None = None  # vLLM's: the request's own template (only with --trust-request-chat-template)
    # vLLM's (apply_chat_template's) rendering flags: continue_final_message leaves the final message open for
    # the model to continue (a prefilled assistant turn), instead of a generation prompt after it
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # vLLM's: each choice's content starts with the last message's, when it is an assistant's
    # OpenAI's fields for its own platform, accepted at the values that ask for nothing recap lacks (clients and
    # SDKs send them set explicitly): nothing is stored, there is one service tier, the output is text
    store: bool = False  # only false: recap keeps no completions
    metadata: dict[str, str] | None = None  # tags for stored completions (none are stored)
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = None
    prompt_cache_key: str | None = None  # OpenAI's cache-routing hint; recap's cache matches prefixes whatever it is
    safety_identifier: str | None = None  # OpenAI's successor of `user`: logged as `user` is

    @field_validator("messages", mode="before")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("messages must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.store:
            raise ValueError("store is not supported (only false: recap keeps no completions)")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true "
                             "(send add_generation_prompt: false to continue the final message)")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice: needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools and self.tool_choice.function.name not in {
                t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice: no tool named {self.tool_choice.function.name!r} in tools")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
        return self

    @property
    def echoed(self) -> str:
        """What echo puts before each choice's content, as vLLM does: the last message's text when its role is the
        answer's (the assistant's after a generation prompt; without one the answer continues the last message),
        else nothing."""
        last = self.messages[-1]
        same_role = last.role == "assistant" or not self.add_generation_prompt
        return last.text() if self.echo and same_role else ""

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        extra: dict[str, Any] = {}
        forced = tool_constraint(self.tools or [], self.effective_tool_choice, self.parallel_tool_calls)
        if forced is not None:
            if self.output_constraint() is not None:
                raise ValueError("tool_choice: a forced tool call cannot be combined with response_format")
            extra["structured_outputs"] = forced
        return self._sampling(limit, (self.top_logprobs or 0) if self.logprobs else None, defaults, **extra)
