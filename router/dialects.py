"""The shapes of the two OpenAI endpoints' answers: /v1/completions and /v1/chat/completions
differ in their ids, their choice and chunk types, their logprobs and the role event a chat
stream opens with; the rest of the ingress is the same for both. A `Dialect` builds one
endpoint's whole answer (`response`) and, through a per-stream `StreamShape`, its SSE chunks."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from pydantic import BaseModel

from replica.api import RequestOutput
from router.protocol import (
    SSE_DONE,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamChunk,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamChunk,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    UsageInfo,
    chat_completion_id,
    completion_id,
    error_body,
    sse_event,
)
from router.reasoning import ReasoningStream
from router.tool_parsers import (
    ContentDelta,
    ToolCallArgs,
    ToolCallStart,
    ToolParser,
    ToolStream,
    get_tool_parser,
)

# (token id, (its logprob, {top token id: logprob})) per token; an echoed prompt's first token
# has (None, {})
TokenLogprobs = list[tuple[int, tuple[float | None, dict[int, float]]]]


@dataclass(frozen=True)
class Echo:
    """A completion choice's echoed prompt (`echo`): its text, token ids and, when logprobs
    were asked for, the logprobs of its tokens after the first (RequestOutput.prompt_logprobs).
    `only`: max_tokens was 0, so the generated token is not returned."""

    text: str
    token_ids: list[int]
    only: bool = False

    def logprobs(self, prompt_logprobs: list | None) -> TokenLogprobs:
        if not self.token_ids:
            return []
        entries = [(None, {})] + list(prompt_logprobs or [])
        return list(zip(self.token_ids, entries, strict=False))


def token_logprobs(out: RequestOutput) -> TokenLogprobs:
    if not out.new_logprobs:
        return []
    return list(zip(out.new_token_ids, out.new_logprobs, strict=False))


def finish_reason(reason: str | None) -> str | None:
    # "abort" never reaches a client that is still listening; report it as a stop.
    return "stop" if reason == "abort" else reason


def without_generated(out: RequestOutput) -> RequestOutput:
    """The delta with its generated tokens removed (echo with max_tokens 0 returns the prompt
    alone): what stays is its finish and its prompt logprobs."""
    return RequestOutput(
        request_id=out.request_id,
        new_token_ids=[],
        new_text="",
        num_prompt_tokens=out.num_prompt_tokens,
        num_output_tokens=0,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        new_logprobs=[] if out.new_logprobs is not None else None,
        num_cached_tokens=out.num_cached_tokens,
        num_preemptions=out.num_preemptions,
        prompt_logprobs=out.prompt_logprobs,
    )


class Choice:
    """One choice's deltas, accumulated for a non-streaming answer."""

    __slots__ = ("index", "text", "token_ids", "finish_reason", "logprobs", "prompt_logprobs")

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.logprobs: TokenLogprobs = []
        self.prompt_logprobs: list | None = None

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(token_logprobs(out))
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason = finish_reason(out.finish_reason)


class Dialect:
    """One endpoint's answer shapes, for a model name and the tokenizer that spells tokens."""

    def __init__(self, tokenizer, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def response(
        self,
        usage: UsageInfo,
        choices: list[Choice],
        logprobs: bool,
        token_ids: bool = False,
        **options,
    ) -> BaseModel:
        """The whole answer. Options: completions take `echo` ({choice index: Echo});
        chat takes `tool_mode` (none, auto, required, named: whether to parse tool calls)."""
        raise NotImplementedError

    def stream(self, token_ids: bool = False, **options) -> StreamShape:
        raise NotImplementedError


class StreamShape:
    """The SSE chunks of one stream: its id and creation time, and whatever a chunk needs from
    the ones before it."""

    def __init__(self, dialect: Dialect, stream_id: str, token_ids: bool = False) -> None:
        self.dialect = dialect
        self.id = stream_id
        self.created = int(time.time())
        self.token_ids = token_ids  # chunks carry their new token ids (return_token_ids)

    def preamble(self, indices: list[int]) -> str:
        """SSE events sent ahead of the first delta (none by default)."""
        return ""

    def chunk(self, index: int, out: RequestOutput, logprobs: TokenLogprobs | None) -> BaseModel:
        raise NotImplementedError

    def chunks(
        self, index: int, out: RequestOutput, logprobs: TokenLogprobs | None
    ) -> list[BaseModel]:
        """The SSE chunks of one delta (one by default; none while a tool call is still
        being buffered)."""
        return [self.chunk(index, out, logprobs)]

    def usage(self, usage: UsageInfo) -> BaseModel:
        raise NotImplementedError

    # how chunks go on the wire (the Responses API sends its own events: router/responses_api.py)
    def render(self, chunks: list[BaseModel]) -> str:
        return "".join(sse_event(c) for c in chunks)

    def failure(self, err) -> str:
        """The event of a failure after the stream began (an HTTPError's message and type)."""
        return f"data: {json.dumps(error_body(err.message, err.type, err.status))}\n\n"

    def end(self) -> str:
        return SSE_DONE


# -- /v1/completions --------------------------------------------------------------------------
class CompletionDialect(Dialect):
    def logprobs(self, lps: TokenLogprobs, text_offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        offset = text_offset
        for token_id, (lp, top) in lps:
            s = self.token_str(token_id)
            out.tokens.append(s)
            out.token_logprobs.append(lp)
            out.top_logprobs.append({self.token_str(t): v for t, v in top.items()} or None)
            out.text_offset.append(offset)
            offset += len(s)
        return out

    def response(
        self,
        usage: UsageInfo,
        choices: list[Choice],
        logprobs: bool,
        token_ids: bool = False,
        echo: dict[int, Echo] | None = None,
        **options,
    ) -> BaseModel:
        answers = []
        for c in choices:
            text, lps = c.text, c.logprobs
            prompt = (echo or {}).get(c.index)
            if prompt is not None:
                text = prompt.text + text
                lps = prompt.logprobs(c.prompt_logprobs) + lps if logprobs else lps
            answers.append(
                CompletionChoice(
                    index=c.index,
                    text=text,
                    finish_reason=c.finish_reason,
                    logprobs=self.logprobs(lps, 0) if logprobs else None,
                    token_ids=list(c.token_ids) if token_ids else None,
                )
            )
        return CompletionResponse(model=self.model_name, usage=usage, choices=answers)

    def stream(
        self, token_ids: bool = False, echo: dict[int, Echo] | None = None, **options
    ) -> StreamShape:
        return CompletionStream(self, completion_id(), token_ids, echo)


class CompletionStream(StreamShape):
    dialect: CompletionDialect

    def __init__(
        self,
        dialect: CompletionDialect,
        stream_id: str,
        token_ids: bool = False,
        echo: dict[int, Echo] | None = None,
    ) -> None:
        super().__init__(dialect, stream_id, token_ids)
        self.offsets: dict[int, int] = {}  # per choice: text sent so far (logprobs' offsets)
        self.echo = dict(echo or {})  # prompts not yet echoed, by choice

    def chunk(self, index: int, out: RequestOutput, logprobs: TokenLogprobs | None) -> BaseModel:
        text = out.new_text
        prompt = self.echo.pop(index, None)  # the prompt goes ahead of the first delta
        if prompt is not None:
            text = prompt.text + text
            if logprobs is not None:
                logprobs = prompt.logprobs(out.prompt_logprobs) + logprobs
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(text)
        return CompletionStreamChunk(
            id=self.id,
            created=self.created,
            model=self.dialect.model_name,
            choices=[
                CompletionChoice(
                    index=index,
                    text=text,
                    finish_reason=finish_reason(out.finish_reason) if out.finished else None,
                    logprobs=self.dialect.logprobs(logprobs, offset)
                    if logprobs is not None
                    else None,
                    token_ids=list(out.new_token_ids) if self.token_ids else None,
                )
            ],
        )

    def usage(self, usage: UsageInfo) -> BaseModel:
        return CompletionStreamChunk(
            id=self.id, created=self.created, model=self.dialect.model_name, usage=usage
        )


# -- /v1/chat/completions ---------------------------------------------------------------------
class ChatDialect(Dialect):
    """Chat answers: a reasoning model's thinking split into reasoning_content (the request's
    `reasoning`: router/reasoning.py), and tool calls parsed from the content after it by the
    model's tool-call family (`tool_parser`)."""

    def __init__(self, tokenizer, model_name: str, tool_parser: ToolParser | None = None) -> None:
        super().__init__(tokenizer, model_name)
        self.tool_parser = tool_parser or get_tool_parser("hermes")

    def logprobs(self, lps: TokenLogprobs) -> ChatChoiceLogprobs:
        content = []
        for token_id, (lp, top) in lps:
            s = self.token_str(token_id)
            content.append(
                ChatTokenLogprob(
                    token=s,
                    logprob=lp,
                    bytes=list(s.encode()),
                    top_logprobs=[
                        ChatTopLogprob(
                            token=self.token_str(t),
                            logprob=v,
                            bytes=list(self.token_str(t).encode()),
                        )
                        for t, v in top.items()
                    ],
                )
            )
        return ChatChoiceLogprobs(content=content)

    def message(self, text: str, tool_mode: str, chat=None) -> tuple[ChatResponseMessage, bool]:
        """The message of a finished choice, and whether it called tools. `chat`: the
        ChatCompletionRequest (its reasoning and tools)."""
        reasoning_text = None
        content: str | None = text
        thinking = getattr(chat, "reasoning", None)
        if thinking is not None:
            reasoning_text, content = thinking.split(text)
        calls = []
        if tool_mode != "none" and content:
            tools = chat.tool_definitions if chat is not None else None
            parsed = self.tool_parser.parse(content, tools)
            content = parsed.content
            calls = [
                ToolCall(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments))
                for t in parsed.tool_calls
            ]
        if reasoning_text is not None and not content:
            content = None
        message = ChatResponseMessage(
            content=content, reasoning_content=reasoning_text, tool_calls=calls
        )
        return message, bool(calls)

    def response(
        self,
        usage: UsageInfo,
        choices: list[Choice],
        logprobs: bool,
        token_ids: bool = False,
        tool_mode: str = "none",
        chat=None,
        **options,
    ) -> BaseModel:
        answers = []
        for c in choices:
            message, called = self.message(c.text, tool_mode, chat)
            reason = c.finish_reason
            if tool_mode != "none":
                reason = tool_finish_reason(reason, called, tool_mode)
            answers.append(
                ChatCompletionChoice(
                    index=c.index,
                    message=message,
                    finish_reason=reason,
                    logprobs=self.logprobs(c.logprobs) if logprobs else None,
                )
            )
        return ChatCompletionResponse(model=self.model_name, usage=usage, choices=answers)

    def stream(
        self, token_ids: bool = False, tool_mode: str = "none", chat=None, **options
    ) -> StreamShape:
        return ChatStream(self, chat_completion_id(), tool_mode=tool_mode, chat=chat)


def tool_finish_reason(reason: str | None, called: bool, tool_mode: str) -> str | None:
    """OpenAI's finish_reason for an answer that called tools: "tool_calls" when it stopped
    after calling them, except for a named tool_choice, which ends with "stop" as OpenAI's
    does."""
    if called and reason == "stop" and tool_mode != "named":
        return "tool_calls"
    return reason


class ChatStream(StreamShape):
    dialect: ChatDialect

    def __init__(
        self, dialect: ChatDialect, stream_id: str, tool_mode: str = "none", chat=None
    ) -> None:
        super().__init__(dialect, stream_id)
        self.tool_mode = tool_mode
        self.reasoning = getattr(chat, "reasoning", None)
        self.tools = chat.tool_definitions if chat is not None else None
        self.parsers: dict[int, ToolStream] = {}  # per choice, when parsing tools
        self.thinking: dict[int, ReasoningStream] = {}  # per choice, when the model thinks

    def _chunk(self, choice: ChatCompletionStreamChoice) -> ChatCompletionStreamChunk:
        return ChatCompletionStreamChunk(
            id=self.id, created=self.created, model=self.dialect.model_name, choices=[choice]
        )

    def preamble(self, indices: list[int]) -> str:
        """The role comes first, as OpenAI sends it: one event per choice."""
        return "".join(
            sse_event(
                self._chunk(
                    ChatCompletionStreamChoice(
                        index=index, delta=DeltaMessage(role="assistant", content="")
                    )
                )
            )
            for index in indices
        )

    def chunk(self, index: int, out: RequestOutput, logprobs: TokenLogprobs | None) -> BaseModel:
        return self._chunk(
            ChatCompletionStreamChoice(
                index=index,
                delta=DeltaMessage(content=out.new_text),
                finish_reason=finish_reason(out.finish_reason) if out.finished else None,
                logprobs=self.dialect.logprobs(logprobs) if logprobs is not None else None,
            )
        )

    def _content_deltas(self, index: int, text: str, finished: bool) -> list[DeltaMessage]:
        """The deltas of content text (tool calls parsed out of it when tools are on)."""
        if self.tool_mode == "none":
            return [DeltaMessage(content=text)] if text else []
        parser = self.parsers.get(index)
        if parser is None:
            parser = self.parsers[index] = self.dialect.tool_parser.stream(self.tools)
        events = parser.feed(text) if text else []
        if finished:
            events += parser.finish()
        deltas = []
        for event in events:
            if isinstance(event, ContentDelta):
                deltas.append(DeltaMessage(content=event.text))
            elif isinstance(event, ToolCallStart):  # the call's id, type and name first
                head = DeltaToolCall(
                    index=event.index,
                    id=event.id,
                    type="function",
                    function=DeltaFunctionCall(name=event.name, arguments=""),
                )
                deltas.append(DeltaMessage(tool_calls=[head]))
            elif isinstance(event, ToolCallArgs):  # then its arguments, as generated
                args = DeltaToolCall(
                    index=event.index, function=DeltaFunctionCall(arguments=event.text)
                )
                deltas.append(DeltaMessage(tool_calls=[args]))
            # ToolCallsVoid: calls that turned out malformed after their start went out stay
            # as sent (a client cannot take a delta back); their text is not sent as content
        return deltas

    def chunks(
        self, index: int, out: RequestOutput, logprobs: TokenLogprobs | None
    ) -> list[BaseModel]:
        if self.tool_mode == "none" and self.reasoning is None:
            return [self.chunk(index, out, logprobs)]
        finished = out.finished
        deltas: list[DeltaMessage] = []
        if self.reasoning is None:
            deltas = self._content_deltas(index, out.new_text, finished)
        else:
            thinking = self.thinking.get(index)
            if thinking is None:
                thinking = self.thinking[index] = self.reasoning.stream()
            parts = thinking.feed(out.new_text)
            if finished:
                parts += thinking.finish()
            content = ""
            for kind, text in parts:
                if kind == "reasoning":
                    deltas.append(DeltaMessage(reasoning_content=text))
                else:
                    content += text
            deltas += self._content_deltas(index, content, finished)
        reason = None
        if finished:
            parser = self.parsers.get(index)
            called = parser is not None and parser.saw_tool_calls
            reason = finish_reason(out.finish_reason)
            if self.tool_mode != "none":
                reason = tool_finish_reason(reason, called, self.tool_mode)
        if not deltas and (reason is not None or logprobs):
            deltas.append(DeltaMessage())
        lps = self.dialect.logprobs(logprobs) if logprobs is not None else None
        return [
            self._chunk(
                ChatCompletionStreamChoice(
                    index=index,
                    delta=delta,
                    finish_reason=reason if i == len(deltas) - 1 else None,
                    logprobs=lps if i == 0 else None,
                )
            )
            for i, delta in enumerate(deltas)
        ]

    def usage(self, usage: UsageInfo) -> BaseModel:
        return ChatCompletionStreamChunk(
            id=self.id, created=self.created, model=self.dialect.model_name, usage=usage
        )
