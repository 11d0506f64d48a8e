"""Hermes calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks (Qwen2.5,
Qwen3, Hermes, most ChatML tool templates); router/tool_calls.py renders tool prompts in this
format for templates that cannot."""

from __future__ import annotations

from replica.api import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from router.tool_parsers.base import BlockStream, ParsedOutput, ToolParser
from router.tool_parsers.incremental import JsonCallBody


def parse_tool_calls(text: str) -> ParsedOutput:
    """Split a generated text into content and the valid `<tool_call>` blocks. Invalid and
    unterminated blocks stay in the content; with calls the content is stripped (None when
    empty), without them it is `text` unchanged."""
    return HermesParser().parse(text)


class ToolCallStreamParser(BlockStream):
    """Incremental `parse_tool_calls` (router/tool_parsers/base.py BlockStream): content goes
    out as soon as it cannot be the start of `<tool_call>`; a block's call starts once its
    name is known and its arguments object has begun, and its arguments stream as generated
    (up to the object's end, never the `}` of the wrapper or `</tool_call>`)."""

    def __init__(self) -> None:
        super().__init__(TOOL_CALL_OPEN, TOOL_CALL_CLOSE, JsonCallBody)


class HermesParser(ToolParser):
    name = "hermes"
    markers = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)

    def stream(self, tools: list[dict] | None = None) -> BlockStream:
        return ToolCallStreamParser()
