"""Hermes calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks (Qwen2.5,
Qwen3, Hermes, most ChatML tool templates); router/tool_calls.py renders tool prompts in this
format for templates that cannot."""

from __future__ import annotations

import json
import re

from replica.api import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from router.tool_parsers.base import (
    BlockStream,
    ParsedOutput,
    ToolCall,
    ToolParser,
    new_call_id,
)

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + "(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def _parse_block(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a block body, or None when it is not a valid call."""
    try:
        obj = json.loads(body, strict=False)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if isinstance(args, str):
        try:
            args = json.loads(args, strict=False)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def parse_tool_calls(text: str) -> ParsedOutput:
    """Split a generated text into content and the valid `<tool_call>` blocks. Invalid and
    unterminated blocks stay in the content; with calls the content is stripped (None when
    empty), without them it is `text` unchanged."""
    calls: list[ToolCall] = []
    pieces: list[str] = []
    pos = 0
    for match in _BLOCK.finditer(text):
        parsed = _parse_block(match.group(1))
        if parsed is None:
            continue
        pieces.append(text[pos : match.start()])
        pos = match.end()
        calls.append(ToolCall(new_call_id(), *parsed))
    if not calls:
        return ParsedOutput(text, [])
    pieces.append(text[pos:])
    content = "".join(pieces).strip()
    return ParsedOutput(content or None, calls)


class ToolCallStreamParser(BlockStream):
    """Incremental `parse_tool_calls` (router/tool_parsers/base.py BlockStream): content goes
    out as soon as it cannot be the start of `<tool_call>`; a block is held until
    `</tool_call>` and then goes out as one `ToolCallDelta` (or as content when invalid)."""

    def __init__(self) -> None:
        super().__init__(TOOL_CALL_OPEN, TOOL_CALL_CLOSE, _parse_block)


class HermesParser(ToolParser):
    name = "hermes"

    def stream(self, tools: list[dict] | None = None) -> BlockStream:
        return ToolCallStreamParser()

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedOutput:
        return parse_tool_calls(text)
