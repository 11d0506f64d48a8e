"""Llama 3.x JSON calls: the output is `{"name": ..., "parameters": {...}}` (or "arguments"),
optionally after `<|python_tag|>`, several separated by `;`."""

from __future__ import annotations

import json

from router.tool_parsers.base import Call, TailStream, ToolParser, call_of

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder(strict=False)


def parse_json_calls(text: str) -> list[Call] | None:
    """The calls of `obj; obj; ...` (whitespace around each), None unless all of it parses."""
    calls: list[Call] = []
    pos, end = 0, len(text)
    while True:
        while pos < end and text[pos].isspace():
            pos += 1
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return None
        call = call_of(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        while pos < end and text[pos].isspace():
            pos += 1
        if pos == end:
            return calls
        if text[pos] != ";":
            return None
        pos += 1
        if not text[pos:].strip():
            return calls  # a trailing separator


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    @staticmethod
    def _parse_tail(tail: str, trigger: str) -> list[Call] | None:
        return parse_json_calls(tail if trigger == PYTHON_TAG else trigger + tail)

    def stream(self, tools: list[dict] | None = None) -> TailStream:
        return TailStream((PYTHON_TAG,), ("{",), self._parse_tail)
