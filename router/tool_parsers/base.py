"""What every tool-call family shares: the parsed call, the stream events, the content
emitter that holds whitespace around calls, and the two stream shapes a family is built from:
calls in delimited blocks (`BlockStream`: hermes, qwen3_coder) and calls that run from a
trigger to the end of the output (`TailStream`: llama3_json, mistral, pythonic)."""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# (name, arguments JSON text) of one call
Call = tuple[str, str]


def new_call_id() -> str:
    """`call_` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


_ALNUM = string.ascii_letters + string.digits


def new_mistral_call_id() -> str:
    """Mistral's tool call ids: 9 letters or digits (its templates refuse others)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(frozen=True)
class ToolCall:
    """A parsed call; `arguments` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedOutput:
    """A finished text split into content (None when only calls) and calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ContentDelta:
    """Content text of a stream."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One whole call of a stream; `index` counts the calls of the choice from 0."""

    index: int
    id: str
    name: str
    arguments: str


StreamEvent = ContentDelta | ToolCallDelta


def arguments_json(args: Any) -> str | None:
    """The JSON text of an arguments object (a JSON string holding one is parsed); None when
    it is not an object."""
    if isinstance(args, str):
        try:
            args = json.loads(args, strict=False)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def call_of(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> Call | None:
    """(name, arguments JSON) of a decoded {"name", "arguments"|"parameters"} object, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    arguments = arguments_json(args)
    return None if arguments is None else (obj["name"], arguments)


def held_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolStream:
    """Incremental parse of one choice's text: `feed` deltas, then `finish`. Content goes
    out as it comes (whitespace held until non-whitespace follows; whitespace before the
    first content dropped once a call comes, trailing whitespace dropped at the end once a
    call was seen); calls go out whole, as `ToolCallDelta`s."""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._pending_ws = ""
        self._emitted = False
        self._calls = 0
        self._new_id = new_id

    @property
    def saw_tool_calls(self) -> bool:
        return self._calls > 0

    def _content(self, text: str, events: list[StreamEvent]) -> None:
        stripped = text.rstrip()
        if not stripped:
            self._pending_ws += text
            return
        lead = self._pending_ws if (self._emitted or not self.saw_tool_calls) else ""
        self._pending_ws = text[len(stripped) :]
        self._emitted = True
        events.append(ContentDelta(lead + stripped))

    def _tool_call(self, name: str, arguments: str, events: list[StreamEvent]) -> None:
        events.append(ToolCallDelta(self._calls, self._new_id(), name, arguments))
        self._calls += 1

    def _end(self, events: list[StreamEvent]) -> list[StreamEvent]:
        if self._pending_ws and not self.saw_tool_calls:
            events.append(ContentDelta(self._pending_ws))
        self._pending_ws = ""
        return events

    def feed(self, delta: str) -> list[StreamEvent]:
        raise NotImplementedError

    def finish(self) -> list[StreamEvent]:
        raise NotImplementedError


class BlockStream(ToolStream):
    """Calls between an open and a close tag, anywhere in the text; a block whose body
    `parse_body` refuses, or that never closes, stays content."""

    def __init__(
        self,
        open_tag: str,
        close_tag: str,
        parse_body: Callable[[str], Call | None],
        new_id: Callable[[], str] = new_call_id,
    ) -> None:
        super().__init__(new_id)
        self.open_tag, self.close_tag, self.parse_body = open_tag, close_tag, parse_body
        self._outside = ""  # text outside blocks not yet examined (a possible tag prefix)
        self._block: str | None = None  # the body of an open block, None outside

    def feed(self, delta: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if self._block is None:
            self._outside += delta
        else:
            self._block += delta
        while True:
            if self._block is None:
                start = self._outside.find(self.open_tag)
                if start < 0:
                    keep = held_prefix_len(self._outside, self.open_tag)
                    cut = len(self._outside) - keep
                    if cut:
                        self._content(self._outside[:cut], events)
                    self._outside = self._outside[cut:]
                    return events
                if start:
                    self._content(self._outside[:start], events)
                self._block = self._outside[start + len(self.open_tag) :]
                self._outside = ""
            end = self._block.find(self.close_tag)
            if end < 0:
                return events
            body, rest = self._block[:end], self._block[end + len(self.close_tag) :]
            self._block = None
            self._outside = rest
            parsed = self.parse_body(body)
            if parsed is None:
                self._content(self.open_tag + body + self.close_tag, events)
            else:
                self._tool_call(*parsed, events)

    def finish(self) -> list[StreamEvent]:
        """Flush what is held: a tag prefix or an unterminated block goes out as content."""
        events: list[StreamEvent] = []
        held = self._outside if self._block is None else self.open_tag + self._block
        self._outside, self._block = "", None
        if held:
            self._content(held, events)
        return self._end(events)


class TailStream(ToolStream):
    """Calls from a trigger to the end of the output: a trigger in `anywhere` may follow
    content, one in `at_start` only opens the output (after whitespace). Content before the
    trigger streams; the rest is held and parsed at the end by `parse_tail` (the text after
    the trigger, and the trigger), whose None puts it all back as content."""

    def __init__(
        self,
        anywhere: tuple[str, ...],
        at_start: tuple[str, ...],
        parse_tail: Callable[[str, str], list[Call] | None],
        new_id: Callable[[], str] = new_call_id,
        keep_at_start_trigger: bool = True,
    ) -> None:
        super().__init__(new_id)
        self.anywhere, self.at_start, self.parse_tail = anywhere, at_start, parse_tail
        self.keep_at_start_trigger = keep_at_start_trigger  # `{` and `[` belong to the calls
        self._held = ""  # text not yet examined
        self._started = False  # non-whitespace seen (at_start triggers no longer apply)
        self._trigger: str | None = None  # the trigger that opened the tail
        self._tail = ""

    def _scan(self, events: list[StreamEvent]) -> None:
        text = self._held
        if not self._started:
            lead = len(text) - len(text.lstrip())
            body = text[lead:]
            if not body:
                return
            for trig in self.anywhere + self.at_start:
                if body.startswith(trig):
                    self._open(trig, body[len(trig) :], text[:lead], events)
                    return
            if any(t.startswith(body) for t in self.anywhere + self.at_start):
                return  # could still become a trigger
            self._started = True
        starts = [(text.find(t), t) for t in self.anywhere if t in text]
        if starts:
            pos, trig = min(starts)
            self._open(trig, text[pos + len(trig) :], text[:pos], events)
            return
        keep = max((held_prefix_len(text, t) for t in self.anywhere), default=0)
        cut = len(text) - keep
        if cut:
            self._content(text[:cut], events)
        self._held = text[cut:]

    def _open(self, trigger: str, rest: str, before: str, events: list[StreamEvent]) -> None:
        if before:
            self._content(before, events)
        self._started = True
        self._trigger = trigger
        self._tail = rest
        self._held = ""

    def feed(self, delta: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if self._trigger is not None:
            self._tail += delta
            return events
        self._held += delta
        self._scan(events)
        return events

    def finish(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if self._trigger is None:
            if self._held:
                self._content(self._held, events)
            self._held = ""
            return self._end(events)
        trigger, tail = self._trigger, self._tail
        self._trigger, self._tail = None, ""
        calls = self.parse_tail(tail, trigger)
        if not calls:
            self._content(trigger + tail, events)
        else:
            for name, arguments in calls:
                self._tool_call(name, arguments, events)
        return self._end(events)


def collect(events: list[StreamEvent]) -> ParsedOutput:
    """The finished answer of a stream's events: content joined (None when empty and calls
    came), calls in order."""
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [ToolCall(e.id, e.name, e.arguments) for e in events if isinstance(e, ToolCallDelta)]
    if calls:
        return ParsedOutput(content.strip() or None, calls)
    return ParsedOutput(content, calls)


class ToolParser:
    """One family's tool-call syntax: `stream(tools)` parses a choice incrementally, `parse`
    a finished text (the same parse, so streamed and whole answers agree). `tools`: the
    request's function definitions ({"name", "parameters"}), for families whose values need
    the schema's types."""

    name = ""

    def stream(self, tools: list[dict] | None = None) -> ToolStream:
        raise NotImplementedError

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedOutput:
        stream = self.stream(tools)
        return collect(stream.feed(text) + stream.finish())
