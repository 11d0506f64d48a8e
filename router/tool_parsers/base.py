"""What every tool-call family shares: the parsed call, the stream events (content, a call's
start, its argument fragments, calls voided), the content emitter that holds whitespace around
calls, and the two stream shapes a family is built from: calls in delimited blocks
(`BlockStream`: hermes, qwen3_coder) and calls that run from a trigger to the end of the output
(`TailStream`: llama3_json, mistral, pythonic). Each reads a call's text with the family's
builder (router/tool_parsers/incremental.py) as it arrives; a finished text's parse is the
stream's events collected (`collect`), so streamed and whole answers agree."""

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
class ToolCallStart:
    """A call's head, sent once its name is known (and its arguments have begun); `index`
    counts the calls of the choice from 0."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    """A fragment of a call's arguments JSON text; a call's fragments, joined, are its
    `arguments`."""

    index: int
    text: str


@dataclass(frozen=True)
class ToolCallsVoid:
    """Calls whose heads went out but that turned out malformed: a finished parse puts
    `text` (their source) back as content in their place; a stream keeps what it sent."""

    indices: tuple[int, ...]
    text: str


StreamEvent = ContentDelta | ToolCallStart | ToolCallArgs | ToolCallsVoid


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
    call was seen); a call goes out as a `ToolCallStart` once its name is known, then its
    arguments as `ToolCallArgs` fragments as they are generated; calls that turn out
    malformed after their start went out are voided (`ToolCallsVoid`)."""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._pending_ws = ""
        self._emitted = False
        self._calls = 0
        self._new_id = new_id
        self._group: list[int] = []  # indices started by the current block or tail

    @property
    def saw_tool_calls(self) -> bool:
        """A call's start went out (a voided one too: a stream keeps what it sent)."""
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

    def _ops(self, ops: list[tuple[str, str]], events: list[StreamEvent]) -> None:
        for op, value in ops:
            if op == "start":
                self._group.append(self._calls)
                events.append(ToolCallStart(self._calls, self._new_id(), value))
                self._calls += 1
            else:
                events.append(ToolCallArgs(self._group[-1], value))

    def _settle(self, valid: bool, source: str, events: list[StreamEvent]) -> None:
        """The current block or tail ended: its calls stand, or it is content (voiding the
        calls already started)."""
        if not valid:
            if self._group:
                events.append(ToolCallsVoid(tuple(self._group), source))
            else:
                self._content(source, events)
        self._group = []

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
    """Calls between an open and a close tag, anywhere in the text; the body goes to a
    builder (router/tool_parsers/incremental.py) as it comes, but for a possible close tag
    at its end. A block the builder refuses, or that never closes, is content."""

    def __init__(
        self,
        open_tag: str,
        close_tag: str,
        builder: Callable[[], Any],
        new_id: Callable[[], str] = new_call_id,
    ) -> None:
        super().__init__(new_id)
        self.open_tag, self.close_tag, self.builder = open_tag, close_tag, builder
        self._outside = ""  # text outside blocks not yet examined (a possible tag prefix)
        self._block: str | None = None  # the body of an open block, None outside
        self._fed = 0  # chars of the body given to the builder
        self._build: Any = None

    def _feed_body(self, upto: int, events: list[StreamEvent]) -> None:
        assert self._block is not None
        if upto > self._fed:
            self._ops(self._build.feed(self._block[self._fed : upto]), events)
            self._fed = upto

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
                self._outside, self._fed, self._build = "", 0, self.builder()
            end = self._block.find(self.close_tag)
            if end < 0:
                self._feed_body(
                    len(self._block) - held_prefix_len(self._block, self.close_tag), events
                )
                return events
            self._feed_body(end, events)
            body, rest = self._block[:end], self._block[end + len(self.close_tag) :]
            self._block = None
            self._outside = rest
            ops, valid = self._build.close()
            if valid:
                self._ops(ops, events)
            self._settle(valid, self.open_tag + body + self.close_tag, events)

    def finish(self) -> list[StreamEvent]:
        """Flush what is held: a tag prefix goes out as content, an unterminated block is
        settled as invalid."""
        events: list[StreamEvent] = []
        if self._block is None:
            if self._outside:
                self._content(self._outside, events)
        else:
            self._settle(False, self.open_tag + self._block, events)
        self._outside, self._block = "", None
        return self._end(events)


class TailStream(ToolStream):
    """Calls from a trigger to the end of the output: a trigger in `anywhere` may follow
    content, one in `at_start` only opens the output (after whitespace). Content before the
    trigger streams; the rest goes to the builder `builder(trigger)` makes (fed the trigger
    itself first when it is an at_start one: `{` and `[` belong to the calls); a tail it
    refuses at the end is content."""

    def __init__(
        self,
        anywhere: tuple[str, ...],
        at_start: tuple[str, ...],
        builder: Callable[[str], Any],
        new_id: Callable[[], str] = new_call_id,
    ) -> None:
        super().__init__(new_id)
        self.anywhere, self.at_start, self.builder = anywhere, at_start, builder
        self._held = ""  # text not yet examined
        self._started = False  # non-whitespace seen (at_start triggers no longer apply)
        self._trigger: str | None = None  # the trigger that opened the tail
        self._tail = ""
        self._build: Any = None

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
        self._tail = ""
        self._held = ""
        self._build = self.builder(trigger)
        if trigger not in self.anywhere:
            self._ops(self._build.feed(trigger), events)
        self._grow(rest, events)

    def _grow(self, delta: str, events: list[StreamEvent]) -> None:
        self._tail += delta
        if delta:
            self._ops(self._build.feed(delta), events)

    def feed(self, delta: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if self._trigger is not None:
            self._grow(delta, events)
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
        ops, valid = self._build.close()
        if valid:
            self._ops(ops, events)
        self._settle(valid, self._trigger + self._tail, events)
        self._trigger, self._tail = None, ""
        return self._end(events)


def collect(events: list[StreamEvent]) -> ParsedOutput:
    """The finished answer of a stream's events: content joined (a voided call's source in
    its place; None when empty and calls came), calls in order with their fragments joined."""
    content: list[str] = []
    calls: dict[int, list] = {}
    for e in events:
        if isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ToolCallStart):
            calls[e.index] = [e.id, e.name, []]
        elif isinstance(e, ToolCallArgs):
            calls[e.index][2].append(e.text)
        else:
            for index in e.indices:
                calls.pop(index, None)
            content.append(e.text)
    text = "".join(content)
    found = [ToolCall(i, name, "".join(args)) for i, name, args in calls.values()]
    if found:
        return ParsedOutput(text.strip() or None, found)
    return ParsedOutput(text, found)


class ToolParser:
    """One family's tool-call syntax: `stream(tools)` parses a choice incrementally, `parse`
    a finished text (the same parse, so streamed and whole answers agree). `tools`: the
    request's function definitions ({"name", "parameters"}), for families whose values need
    the schema's types."""

    name = ""
    # the family's marker texts: when the tokenizer makes one a special token, a request
    # offering tools keeps special tokens in its text (the parser strips the markers)
    markers: tuple[str, ...] = ()

    def stream(self, tools: list[dict] | None = None) -> ToolStream:
        raise NotImplementedError

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedOutput:
        stream = self.stream(tools)
        return collect(stream.feed(text) + stream.finish())
