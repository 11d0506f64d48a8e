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
from router.tool_parsers.incremental import Builder, Op, render_member

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.DOTALL)
_SPACE = (" ", "\n", "\r", "\t")
_OPEN_FN = "<function="
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


class FunctionBlock(Builder):
    """A block's body read as it comes: the call starts once `<function=NAME>` is complete,
    each parameter goes out as JSON (converted by its schema) at its `</parameter>`; the
    whole body is checked by `parse_function_block` at the block's end."""

    def __init__(self, tools: list[dict] | None) -> None:
        super().__init__()
        self.tools = tools
        self.body = ""
        self.pos = -1  # where the next parameter is looked for; -1: before the function tag
        self.properties: dict = {}
        self.args: list[str] = []
        self.name = ""

    def feed(self, text: str) -> list[Op]:
        self.body += text
        if self.failed:
            return []
        if self.pos < 0:
            head = self.body.lstrip()
            if not head.startswith(_OPEN_FN):
                self.failed = not _OPEN_FN.startswith(head)
                return []
            end = head.find(">")
            if end < 0:
                self.failed = "\n" in head
                return []
            name = head[len(_OPEN_FN) : end].strip()
            if not name or "\n" in head[:end]:
                self.failed = True
                return []
            self.name = name
            self.pos = len(self.body) - len(head) + end + 1
            for tool in self.tools or []:
                if tool.get("name") == name:
                    self.properties = (tool.get("parameters") or {}).get("properties") or {}
            self.ops.append(("start", name))
        while True:
            m = _PARAMETER.search(self.body, self.pos)
            stop = self.body.find("</function>", self.pos)
            if m is None or (0 <= stop < m.start()):
                return self._take()
            key = m.group(1).strip()
            value = convert(_trim(m.group(2)), self.properties.get(key))
            piece = render_member(not self.args, key, value)
            self.args.append(piece)
            self.ops.append(("args", piece))
            self.pos = m.end()

    def close(self) -> tuple[list[Op], bool]:
        if self.failed or self.pos < 0:
            return [], False
        end = "}" if self.args else "{}"
        call = parse_function_block(self.body, self.tools)
        valid = call == (self.name, "".join(self.args) + end)
        return ([("args", end)] if valid else []), valid


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    markers = (OPEN, CLOSE)

    def stream(self, tools: list[dict] | None = None) -> BlockStream:
        return BlockStream(OPEN, CLOSE, lambda: FunctionBlock(tools))
