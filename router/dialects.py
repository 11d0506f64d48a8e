"""The shapes of the two OpenAI endpoints' answers: /v1/completions and /v1/chat/completions
differ in their ids, their choice and chunk types, their logprobs and the role event a chat
stream opens with; the rest of the ingress is the same for both. A `Dialect` builds one
endpoint's whole answer (`response`) and, through a per-stream `StreamShape`, its SSE chunks."""

from __future__ import annotations

import time

from pydantic import BaseModel

from replica.request import RequestOutput
from router.protocol import (
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
    DeltaMessage,
    UsageInfo,
    chat_completion_id,
    completion_id,
    sse_event,
)

# (token id, (its logprob, {top token id: logprob})) per generated token
TokenLogprobs = list[tuple[int, tuple[float, dict[int, float]]]]


def token_logprobs(out: RequestOutput) -> TokenLogprobs:
    if not out.new_logprobs:
        return []
    return list(zip(out.new_token_ids, out.new_logprobs, strict=False))


def finish_reason(reason: str | None) -> str | None:
    # "abort" never reaches a client that is still listening; report it as a stop.
    return "stop" if reason == "abort" else reason


class Choice:
    """One choice's deltas, accumulated for a non-streaming answer."""

    __slots__ = ("index", "text", "token_ids", "finish_reason", "logprobs")

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.logprobs: TokenLogprobs = []

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(token_logprobs(out))
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
        self, usage: UsageInfo, choices: list[Choice], logprobs: bool, token_ids: bool = False
    ) -> BaseModel:
        raise NotImplementedError

    def stream(self, token_ids: bool = False) -> StreamShape:
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

    def usage(self, usage: UsageInfo) -> BaseModel:
        raise NotImplementedError


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
        self, usage: UsageInfo, choices: list[Choice], logprobs: bool, token_ids: bool = False
    ) -> BaseModel:
        return CompletionResponse(
            model=self.model_name,
            usage=usage,
            choices=[
                CompletionChoice(
                    index=c.index,
                    text=c.text,
                    finish_reason=c.finish_reason,
                    logprobs=self.logprobs(c.logprobs, 0) if logprobs else None,
                    token_ids=list(c.token_ids) if token_ids else None,
                )
                for c in choices
            ],
        )

    def stream(self, token_ids: bool = False) -> StreamShape:
        return CompletionStream(self, completion_id(), token_ids)


class CompletionStream(StreamShape):
    dialect: CompletionDialect

    def __init__(self, dialect: CompletionDialect, stream_id: str, token_ids: bool = False) -> None:
        super().__init__(dialect, stream_id, token_ids)
        self.offsets: dict[int, int] = {}  # per choice: text sent so far (logprobs' offsets)

    def chunk(self, index: int, out: RequestOutput, logprobs: TokenLogprobs | None) -> BaseModel:
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(out.new_text)
        return CompletionStreamChunk(
            id=self.id,
            created=self.created,
            model=self.dialect.model_name,
            choices=[
                CompletionChoice(
                    index=index,
                    text=out.new_text,
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

    def response(
        self, usage: UsageInfo, choices: list[Choice], logprobs: bool, token_ids: bool = False
    ) -> BaseModel:
        return ChatCompletionResponse(
            model=self.model_name,
            usage=usage,
            choices=[
                ChatCompletionChoice(
                    index=c.index,
                    message=ChatResponseMessage(content=c.text),
                    finish_reason=c.finish_reason,
                    logprobs=self.logprobs(c.logprobs) if logprobs else None,
                )
                for c in choices
            ],
        )

    def stream(self, token_ids: bool = False) -> StreamShape:
        return ChatStream(self, chat_completion_id())


class ChatStream(StreamShape):
    dialect: ChatDialect

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

    def usage(self, usage: UsageInfo) -> BaseModel:
        return ChatCompletionStreamChunk(
            id=self.id, created=self.created, model=self.dialect.model_name, usage=usage
        )
