"""Tool-call parsers, one per model family, by the names of EngineConfig.tool_call_parser
(vLLM's): each splits a finished text into content and calls and streams the same parse,
incrementally (a call's name once known, then its arguments as fragments).
`auto` picks a family from the chat template's source, once per served model."""

from __future__ import annotations

from typing import Any

from router.tool_parsers.base import (
    ContentDelta,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallArgs,
    ToolCallStart,
    ToolCallsVoid,
    ToolParser,
    ToolStream,
)
from router.tool_parsers.hermes import HermesParser
from router.tool_parsers.llama3_json import Llama3JsonParser
from router.tool_parsers.mistral import MistralParser
from router.tool_parsers.pythonic import PythonicParser
from router.tool_parsers.qwen3_coder import Qwen3CoderParser

TOOL_PARSERS: dict[str, ToolParser] = {
    p.name: p
    for p in (
        HermesParser(),
        Llama3JsonParser(),
        MistralParser(),
        Qwen3CoderParser(),
        PythonicParser(),
    )
}

# (marker in the template's source, family): the first that matches wins
_TEMPLATE_MARKERS = (
    ("<function=", "qwen3_coder"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_start|>", "pythonic"),
    ("<|python_tag|>", "llama3_json"),
    ('"parameters": dictionary of argument name and its value', "llama3_json"),
    ("<tool_call>", "hermes"),
)


def detect_tool_parser(template_source: str | None) -> str:
    """The family a chat template's source writes calls in (hermes when it says nothing)."""
    for marker, name in _TEMPLATE_MARKERS:
        if template_source and marker in template_source:
            return name
    return "hermes"


def get_tool_parser(name: str, chat_template: Any = None) -> ToolParser:
    """The parser named `name`; `auto`: detected from `chat_template` (a tokenizer's
    chat_template attribute)."""
    if name == "auto":
        from router.tool_calls import _template_source

        name = detect_tool_parser(_template_source(chat_template))
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; known: auto, {', '.join(TOOL_PARSERS)}"
        ) from None


__all__ = [
    "TOOL_PARSERS",
    "ContentDelta",
    "ParsedOutput",
    "StreamEvent",
    "ToolCall",
    "ToolCallArgs",
    "ToolCallStart",
    "ToolCallsVoid",
    "ToolParser",
    "ToolStream",
    "detect_tool_parser",
    "get_tool_parser",
]
