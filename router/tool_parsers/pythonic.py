"""Pythonic calls (Llama 3.2 and Llama 4 style): the output is a Python list of calls with
keyword arguments, `[f(a=1, b="x"), g()]`, read with Python's ast (never evaluated); Llama 4
may wrap it in `<|python_start|>` ... `<|python_end|>`."""

from __future__ import annotations

import ast
import json
from typing import Any

from router.tool_parsers.base import Call, TailStream, ToolParser
from router.tool_parsers.incremental import _WS, Builder, Op, render_member

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


class PythonicList(Builder):
    """`[f(a=1, b="x"), g()]` read as it comes: a call starts at its `(`, each keyword
    argument goes out as JSON once its value is complete (a `,` or `)` outside brackets and
    strings). The whole list is checked by `parse_pythonic` at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""
        self.phase = "open"  # open name kw eq value after end | error
        self.word = ""
        self.value = ""
        self.depth = 0
        self.quote = ""
        self.esc = False
        self.first = True
        self.streamed: list[tuple[str, list[str]]] = []

    def _arg(self, text: str) -> None:
        try:
            value = literal(ast.parse(text.strip(), mode="eval").body)
        except (SyntaxError, ValueError, _NotLiteral):
            self.phase = "error"
            return
        self._args(render_member(self.first, self.word, value))
        self.first = False

    def _args(self, text: str) -> None:
        self.ops.append(("args", text))
        self.streamed[-1][1].append(text)

    def _end_call(self) -> None:
        self._args("{}" if self.first else "}")
        self.phase = "after"

    def step(self, ch: str) -> None:
        phase = self.phase
        if phase == "value":
            if self.quote:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == self.quote:
                    self.quote = ""
            elif ch in "'\"":
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}" and self.depth:
                self.depth -= 1
            elif ch in ",)" and not self.depth:
                self._arg(self.value)
                if self.phase == "error":
                    return
                if ch == ")":
                    self._end_call()
                else:
                    self.phase, self.word = "kw", ""
                return
            self.value += ch
            return
        if phase == "end":
            return  # checked whole at the end
        if ch in _WS and not (phase in ("name", "kw") and self.word):
            return
        if phase == "open":
            self.phase = "name" if ch == "[" else "error"
        elif phase in ("name", "kw"):
            if ch.isidentifier() or (self.word and (ch.isalnum() or ch == "_")):
                if self.word and self.word[-1] in _WS:
                    self.phase = "error"
                else:
                    self.word += ch
            elif phase == "name" and ch == "(" and self.word.strip():
                name = self.word.strip()
                self.ops.append(("start", name))
                self.streamed.append((name, []))
                self.phase, self.word, self.first = "kw", "", True
            elif phase == "name" and ch == "]" and not self.word and self.streamed:
                self.phase = "end"  # a trailing comma
            elif phase == "kw" and ch == ")" and not self.word:
                self._end_call()
            elif phase == "kw" and ch == "=" and self.word.strip():
                self.word = self.word.strip()
                self.phase, self.value, self.depth, self.quote = "value", "", 0, ""
            elif ch in _WS:
                self.word += ch
            else:
                self.phase = "error"
        elif phase == "after":
            if ch == ",":
                self.phase, self.word = "name", ""
            elif ch == "]":
                self.phase = "end"
            else:
                self.phase = "error"

    def feed(self, text: str) -> list[Op]:
        self.text += text
        for ch in text:
            if self.phase == "error":
                break
            self.step(ch)
        return self._take()

    def close(self) -> tuple[list[Op], bool]:
        calls = parse_pythonic(self.text)
        streamed = [(name, "".join(args)) for name, args in self.streamed]
        return self._take(), self.phase == "end" and calls == streamed


class PythonicParser(ToolParser):
    name = "pythonic"
    markers = (PYTHON_START, PYTHON_END)

    @staticmethod
    def _builder(trigger: str) -> PythonicList:
        return PythonicList()

    def stream(self, tools: list[dict] | None = None) -> TailStream:
        return TailStream((PYTHON_START,), ("[",), self._builder)
