"""Qwen3-Coder XML calls:
`<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...</function>\n</tool_call>`.
Values are text; each is converted by its parameter's JSON-schema type in the request's tool
(string kept, integer/number/boolean/null read, object/array read as JSON or a Python
literal); a parameter the schema does not know stays a string."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from router.tool_parsers.base import BlockStream, Call, ToolParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.DOTALL)
_SPACE = (" ", "\n", "\r", "\t")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return ["string"]
    return []


def convert(value: str, schema: Any) -> Any:
    """A parameter's text as the value its schema's type asks for (the text when it does not
    read as that type)."""
    for kind in _types(schema) or ["string"]:
        if kind == "string":
            return value
        text = value.strip()
        if kind == "null" and text.lower() in ("null", "none"):
            return None
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind == "integer" and re.fullmatch(r"[-+]?\d+", text):
            return int(text)
        if kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            return int(number) if re.fullmatch(r"[-+]?\d+", text) else number
        if kind in ("object", "array"):
            for reader in (json.loads, ast.literal_eval):
                try:
                    parsed = reader(text)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    continue
                if isinstance(parsed, dict if kind == "object" else list):
                    return parsed
    return value


def _trim(value: str) -> str:
    """The parameter text without the one whitespace character the format puts on each side
    (a newline in the model's format; the grammar allows any one)."""
    if value[:1] in _SPACE:
        value = value[1:]
    if value[-1:] in _SPACE:
        value = value[:-1]
    return value


def parse_function_block(body: str, tools: list[dict] | None) -> Call | None:
    match = _FUNCTION.match(body)
    if match is None:
        return None
    name, inner = match.group(1).strip(), match.group(2)
    properties: dict = {}
    for tool in tools or []:
        if tool.get("name") == name:
            properties = (tool.get("parameters") or {}).get("properties") or {}
    args: dict[str, Any] = {}
    for param, value in _PARAMETER.findall(inner):
        key = param.strip()
        args[key] = convert(_trim(value), properties.get(key))
    if _PARAMETER.sub("", inner).strip():
        return None  # text that is not a parameter
    return name, json.dumps(args, ensure_ascii=False)


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"

    def stream(self, tools: list[dict] | None = None) -> BlockStream:
        return BlockStream(OPEN, CLOSE, lambda body: parse_function_block(body, tools))
