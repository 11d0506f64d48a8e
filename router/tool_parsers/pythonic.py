"""Pythonic calls (Llama 3.2 and Llama 4 style): the output is a Python list of calls with
keyword arguments, `[f(a=1, b="x"), g()]`, read with Python's ast (never evaluated); Llama 4
may wrap it in `<|python_start|>` ... `<|python_end|>`."""

from __future__ import annotations

import ast
import json
from typing import Any

from router.tool_parsers.base import Call, TailStream, ToolParser

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


class _NotLiteral(ValueError):
    pass


def literal(node: ast.AST) -> Any:
    """The value of a literal node: constants, lists, tuples, dicts with string keys, signed
    numbers, and the names True/False/None (or JSON's true/false/null)."""
    if isinstance(node, ast.Constant) and not isinstance(node.value, bytes | complex):
        return node.value
    if isinstance(node, ast.List | ast.Tuple):
        return [literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values, strict=True):
            key = literal(k) if k is not None else None
            if not isinstance(key, str):
                raise _NotLiteral("dict keys must be strings")
            out[key] = literal(v)
        return out
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = literal(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise _NotLiteral(type(node).__name__)


def parse_pythonic(text: str) -> list[Call] | None:
    text = text.strip()
    if text.endswith(PYTHON_END):
        text = text[: -len(PYTHON_END)].strip()
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls: list[Call] = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
            return None
        try:
            args = {kw.arg: literal(kw.value) for kw in node.keywords if kw.arg is not None}
        except _NotLiteral:
            return None
        if len(args) != len(node.keywords):
            return None  # **kwargs
        calls.append((node.func.id, json.dumps(args, ensure_ascii=False)))
    return calls


class PythonicParser(ToolParser):
    name = "pythonic"

    @staticmethod
    def _parse_tail(tail: str, trigger: str) -> list[Call] | None:
        return parse_pythonic(tail if trigger == PYTHON_START else trigger + tail)

    def stream(self, tools: list[dict] | None = None) -> TailStream:
        return TailStream((PYTHON_START,), ("[",), self._parse_tail)
