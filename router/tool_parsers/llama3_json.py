"""Llama 3.x JSON calls: the output is `{"name": ..., "parameters": {...}}` (or "arguments"),
optionally after `<|python_tag|>`, several separated by `;`."""

from __future__ import annotations

from router.tool_parsers.base import TailStream, ToolParser
from router.tool_parsers.incremental import JsonCallSequence

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def stream(self, tools: list[dict] | None = None) -> TailStream:
        return TailStream(
            (PYTHON_TAG,), ("{",), lambda trigger: JsonCallSequence(("parameters", "arguments"))
        )
