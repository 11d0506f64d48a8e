"""The responses, stream chunks and model listing we send, in the shapes the official `openai`
client parses."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field

from router.protocol.messages import ToolCall

SSE_DONE = "data: [DONE]\n\n"
# JSON has no -inf; a token outside top-p/top-k has logprob -inf, so we send vLLM's stand-in.
MIN_LOGPROB = -9999.0

FinishReason = Literal["stop", "length", "tool_calls"]


def _finite_logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # also maps NaN and -inf


Logprob = Annotated[float, AfterValidator(_finite_logprob)]


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
    # the thinking of a reasoning model (EngineConfig.reasoning_parser), vLLM's field
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


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


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed tool call: its first delta carries id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    """The first chunk of each choice carries role="assistant"; later ones only content."""

    role: Literal["assistant"] | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking, as it streams
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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
    root: str | None = None  # as vLLM: the model's own name; an adapter's path
    parent: str | None = None  # an adapter's base model (vLLM's `parent`); None for a model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
