"""OpenAI-compatible HTTP protocol: pydantic models of the requests we accept and the responses,
stream chunks and errors we send, in the shapes the official `openai` client parses.

Unknown request fields are accepted and ignored (as vLLM does), so clients that send newer
OpenAI fields keep working; `ignored_fields` lists them for a warning log. Fields we know but
do not implement (penalties, logit_bias, echo, best_of > n, suffix) are rejected with a 400
naming the field instead of being silently dropped, because they would change the output.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from replica.request import SamplingParams

MAX_N = 8
MAX_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# JSON has no -inf; a token outside top-p/top-k has logprob -inf, so we send vLLM's stand-in.
MIN_LOGPROB = -9999.0

SSE_DONE = "data: [DONE]\n\n"

FinishReason = Literal["stop", "length"]


def _check_range(
    name: str, value: float, lo: float, hi: float | None = None, *, lo_open: bool = False
) -> None:
    """Raise ValueError naming the field, the limit and the bad value (NaN always fails)."""
    above_lo = value > lo if lo_open else value >= lo
    below_hi = hi is None or value <= hi
    if above_lo and below_hi:
        return
    if hi is None:
        limit = f"> {lo}" if lo_open else f">= {lo}"
        raise ValueError(f"{name} must be {limit}, got {value!r}")
    bracket = "(" if lo_open else "["
    raise ValueError(f"{name} must be in {bracket}{lo}, {hi}], got {value!r}")


def _finite_logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # also maps NaN and -inf


Logprob = Annotated[float, AfterValidator(_finite_logprob)]


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # extra="allow" keeps unknown fields in `model_extra` so the ingress can log them.
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(default=None, description="None: the served model")
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(default=0, description="extension; 0 or -1 disables")
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list, description="extension")
    n: int = Field(default=1, description="served as n independent requests by the ingress")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(default=False, description="extension")
    include_stop_str_in_output: bool = Field(default=False, description="extension")
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """Clients send `"temperature": null` to mean "default"; drop such nulls so the field's
        default applies instead of failing type validation."""
        if isinstance(data, Mapping):
            return {
                key: value
                for key, value in data.items()
                if not (value is None and key in cls.model_fields and not _nullable(cls, key))
            }
        return data

    @property
    def ignored_fields(self) -> list[str]:
        """Request fields we do not know and therefore ignored."""
        return sorted(self.model_extra or {})

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        _check_range("temperature", value, 0, 2)
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float) -> float:
        _check_range("top_p", value, 0, 1, lo_open=True)
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {value}")
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int | None) -> int | None:
        if value is not None:
            _check_range("seed", value, SEED_MIN, SEED_MAX)
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [] if value is None else [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(
                f"stop must have at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}"
            )
        if not all(stops):
            raise ValueError("stop sequences must not be empty strings")
        return stops

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, value: list[int]) -> list[int]:
        negative = [t for t in value if t < 0]
        if negative:
            raise ValueError(f"stop_token_ids must be >= 0, got {negative[0]}")
        return value

    @field_validator("n")
    @classmethod
    def _n(cls, value: int) -> int:
        _check_range("n", value, 1, MAX_N)
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value: StreamOptions | None, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _unsupported_penalty(cls, value: float, info: ValidationInfo) -> float:
        if value != 0:
            raise ValueError(f"{info.field_name} is not supported; it must be 0, got {value!r}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _unsupported_logit_bias(cls, value: dict[str, float] | None) -> None:
        if value:
            raise ValueError("logit_bias is not supported; omit it or send {}")
        return None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a chunk carrying usage (stream_options.include_usage)."""
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


def _nullable(model: type[BaseModel], name: str) -> bool:
    """Whether the field's type admits None (then null is a meaningful value, not "default")."""
    annotation = model.model_fields[name].annotation
    return annotation is None or type(None) in get_args(annotation)


def _check_max_tokens(name: str, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


Prompt = str | list[str] | list[int] | list[list[int]]

_PROMPT_TYPE_MESSAGE = (
    "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
)


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: Prompt
    max_tokens: int | None = Field(default=16, description="None: up to max_model_len")
    logprobs: int | None = Field(default=None, description="top logprobs per token, 0..20")
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    return_token_ids: bool = Field(
        default=False,
        description="extension (vLLM's name): each choice carries the ids of the tokens it "
        "generated (streamed: each chunk its new ones)",
    )

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value: Any, handler: Any) -> Prompt:
        try:
            prompt = handler(value)
        except ValidationError:
            raise ValueError(_PROMPT_TYPE_MESSAGE) from None
        for item in _split_prompt(prompt):
            if len(item) == 0:
                raise ValueError("prompt must not be empty")
            if not isinstance(item, str):
                negative = [t for t in item if t < 0]
                if negative:
                    raise ValueError(f"prompt token ids must be >= 0, got {negative[0]}")
        return prompt

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None) -> int | None:
        return _check_max_tokens("max_tokens", value)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            _check_range("logprobs", value, 0, MAX_LOGPROBS)
        return value

    @field_validator("echo")
    @classmethod
    def _echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo=true is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise ValueError(
                f"best_of is not supported beyond n: best_of must equal n ({n}), got {value}"
            )
        return value

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each item is one text or one list of token ids. A batch of
        k prompts with n choices yields choices indexed prompt_index * n + sample_index."""
        return _split_prompt(self.prompt)

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """SamplingParams for one choice; max_tokens None means `default_max_tokens` (the caller
        passes max_model_len - prompt_len). Raises ValueError if that default is < 1."""
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        return self._sampling_params(max_tokens, self.logprobs)


def _split_prompt(prompt: Prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        return [prompt]  # type: ignore[list-item]  # an empty list: reported as empty
    if isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message. Content is a string or a list of text parts (no images, no tools)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant"]
    content: str | list[TextContentPart]
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind != "text":
                    raise ValueError(
                        f"only content parts of type 'text' are supported, got {kind!r}"
                    )
        return value

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = Field(default=None, description="deprecated alias")
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = Field(default=True, description="extension")

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must not be empty")
        return value

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        return _check_max_tokens(str(info.field_name), value)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None:
            _check_range("top_logprobs", value, 0, MAX_LOGPROBS)
            if value > 0 and not info.data.get("logprobs", False):
                raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, else the older max_tokens; None when neither was sent."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as plain {role, content} dicts for a tokenizer's chat template."""
        return [{"role": m.role, "content": m.text} for m in self.messages]

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """SamplingParams for one choice; no max tokens sent means `default_max_tokens` (the
        caller passes max_model_len - prompt_len). Raises ValueError if that default is < 1."""
        requested = self.requested_max_tokens
        max_tokens = requested if requested is not None else default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Logprob | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, Logprob] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=completion_id)
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamChunk(BaseModel):
    """One SSE event of a streamed completion; all chunks of a stream share id and created.
    The usage-only final chunk (stream_options.include_usage) has choices=[]."""

    id: str = Field(default_factory=completion_id)
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice] = Field(default_factory=list)
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: Logprob
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: Logprob
    bytes: list[int] | None = None
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    finish_reason: FinishReason | None = None
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=chat_completion_id)
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """The first chunk of each choice carries role="assistant"; later ones only content."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage = Field(default_factory=DeltaMessage)
    finish_reason: FinishReason | None = None
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionStreamChunk(BaseModel):
    """One SSE event of a streamed chat completion; usage only on the final, choice-less chunk
    when stream_options.include_usage is set."""

    id: str = Field(default_factory=chat_completion_id)
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice] = Field(default_factory=list)
    usage: UsageInfo | None = None


# Characters JSON leaves raw inside strings but that line splitters built on str.splitlines
# (Python's httpx aiter_lines, for one) take as line ends, which would cut an event in two.
_LINE_BREAKS_TO_ESCAPE = str.maketrans(
    {"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"}
)


def sse_event(chunk: BaseModel) -> str:
    """One server-sent event carrying `chunk` as JSON; end a stream with SSE_DONE. Unicode line
    separators in the text are sent escaped (the same JSON value), so every client sees one
    line per event."""
    return f"data: {chunk.model_dump_json().translate(_LINE_BREAKS_TO_ESCAPE)}\n\n"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "stepserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_body(
    message: str, type: str, status_code: int, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}; like vLLM we put
    the HTTP status in `code`. Types in use: invalid_request_error (400), not_found_error (404),
    authentication_error (401), server_error (500), service_unavailable (503)."""
    detail = ErrorDetail(message=message, type=type, param=param, code=status_code)
    return ErrorResponse(error=detail).model_dump()


def validation_error_body(errors: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A 400 error body for pydantic's `ValidationError.errors()` (or FastAPI's
    `RequestValidationError.errors()`, whose locations start with "body"): the first error's
    message, with `param` naming the offending field."""
    if not errors:
        return error_body("invalid request", "invalid_request_error", 400)
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        message = f"request body is not valid JSON: {first.get('msg', '')}"
        return error_body(message, "invalid_request_error", 400)
    loc = [str(part) for part in first.get("loc", ())]
    if loc and loc[0] == "body":
        loc = loc[1:]
    param = ".".join(loc) or None
    if kind == "value_error":
        # our validators' messages already name the field, the limit and the bad value
        message = str(first.get("ctx", {}).get("error", first.get("msg", "")))
    else:
        message = f"{param or 'request'}: {first.get('msg', 'invalid value')}"
        if kind != "missing" and "input" in first:
            message += f", got {first['input']!r}"
    return error_body(message, "invalid_request_error", 400, param=param)
