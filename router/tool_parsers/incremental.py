"""Incremental call builders: each reads one family's call text as it arrives and says what a
stream may send so far, as ops: ("start", name) when a call's name is known (and its
arguments have begun), ("args", text) for each new fragment of its arguments JSON text. On
`close` (the block or the output ended) a builder says whether what it read is valid; a stream
then confirms the calls or voids them (router/tool_parsers/base.py).

JSON families forward the arguments object's text as generated (raw control characters inside
strings escaped, so the text is strict JSON); families whose arguments are not JSON (pythonic,
qwen3_coder) send the JSON rendering per completed parameter: `{"a": 1`, `, "b": "x"`, `}`."""

from __future__ import annotations

import json
from typing import Any

Op = tuple[str, str]
_WS = " \t\n\r"


def _escaped(ch: str) -> str:
    """A character inside a JSON string as strict JSON spells it."""
    return json.dumps(ch)[1:-1] if ch < " " else ch


def arguments_of_string(raw: str) -> str | None:
    """The arguments of a JSON string value holding an object's JSON text (normalized)."""
    try:
        inner = json.loads(raw, strict=False)
        obj = json.loads(inner, strict=False) if isinstance(inner, str) else None
    except ValueError:
        return None
    return json.dumps(obj, ensure_ascii=False) if isinstance(obj, dict) else None


class JsonObject:
    """One JSON object read a character at a time. mode "call": {"name": ..., <args key>: ...}
    (the name and the arguments value found among its top-level members); mode "args": the
    object is the arguments itself."""

    def __init__(self, mode: str = "call", args_keys: tuple[str, ...] = ()) -> None:
        self.mode, self.args_keys = mode, args_keys
        self.depth = 0
        self.in_str = self.esc = False
        self.phase = "start"  # start key colon value scalar comma | done | error
        self.raw: list[str] = []
        self.span_start = 0  # where the current key or top-level value began (in raw)
        self.key: str | None = None
        self.val_key: str | None = None
        self.name: str | None = None
        self.args_key: str | None = None
        self.args_kind = ""  # "{" (streamed as it comes), '"' (a string: sent at its end)
        self.args_ok = mode == "args"  # the arguments value is (so far) an object
        self.in_args = mode == "args"
        self.args: list[str] = []
        self.args_taken = 0

    @property
    def done(self) -> bool:
        return self.phase == "done"

    @property
    def failed(self) -> bool:
        return self.phase == "error"

    def head_ready(self, args_required: bool) -> bool:
        if self.name is None or not self.args_ok:
            return False
        if self.args_kind == "{" or (self.args_kind == '"' and self.args):
            return True
        return self.done and not self.args_key and not args_required

    def take_args(self) -> str:
        text = "".join(self.args[self.args_taken :])
        self.args_taken = len(self.args)
        return text

    def _end_value(self, upto: int) -> None:
        text = "".join(self.raw[self.span_start : upto]).strip()
        key = self.val_key
        if key == "name" and self.name is None:
            try:
                name = json.loads(text, strict=False)
            except ValueError:
                name = None
            if isinstance(name, str) and name:
                self.name = name
            else:
                self.phase = "error"
        elif key in self.args_keys and self.args_key == key:
            self.in_args = False
            if self.args_kind == '"':
                args = arguments_of_string(text)
                if args is None:
                    self.args_ok = False
                else:
                    self.args.append(args)

    def step(self, ch: str) -> None:
        if self.phase in ("done", "error"):
            if ch not in _WS:
                self.phase = "error"  # text after the object: the caller decides
            return
        self.raw.append(ch)
        at = len(self.raw) - 1
        if self.in_str:
            if self.in_args:
                self.args.append(_escaped(ch) if not self.esc else ch)
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if self.depth == 1 and self.mode == "call":
                    if self.phase == "key":
                        try:
                            self.key = json.loads("".join(self.raw[self.span_start :]))
                        except ValueError:
                            self.phase = "error"
                            return
                        self.phase = "colon"
                    else:  # a string value ended
                        self._end_value(at + 1)
                        self.phase = "comma"
            return
        if self.depth == 0:
            if ch in _WS:
                return
            if ch != "{":
                self.phase = "error"
                return
            self.depth = 1
            self.phase = "key"
            if self.in_args:
                self.args.append(ch)
            return
        if self.depth >= 2 or self.mode == "args":
            if self.in_args:
                self.args.append(ch)
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.phase = "done"
                elif self.depth == 1 and self.mode == "call":
                    self._end_value(at + 1)
                    self.phase = "comma" if self.phase != "error" else "error"
            return
        # depth 1 of a call object: its members
        phase = self.phase
        if phase == "scalar":
            if ch not in ",}":
                return
            self._end_value(at)
            if self.phase == "error":
                return
            phase = self.phase = "comma"
        if ch in _WS:
            return
        if phase == "key":
            if ch == '"':
                self.in_str, self.span_start = True, at
            elif ch == "}" and self.key is None:
                self.depth, self.phase = 0, "done"
            else:
                self.phase = "error"
        elif phase == "colon":
            self.phase = "value" if ch == ":" else "error"
        elif phase == "value":
            self.span_start, self.val_key = at, self.key
            if self.key in self.args_keys and self.args_key is None:
                self.args_key = self.key
                self.args_kind = ch if ch in '{"' else ""
                self.args_ok = ch in '{"'
                self.in_args = ch == "{"
                if self.in_args:
                    self.args.append(ch)
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth = 2
            else:
                self.phase = "scalar"
        elif phase == "comma":
            if ch == ",":
                self.phase = "key"
            elif ch == "}":
                self.depth, self.phase = 0, "done"
            else:
                self.phase = "error"

    def valid(self, args_required: bool) -> bool:
        """A finished object is a valid call: it parses, its name is a non-empty string and
        its arguments an object (absent: {} unless required)."""
        if not self.done:
            return False
        try:
            obj = json.loads("".join(self.raw), strict=False)
        except ValueError:
            return False
        if self.mode == "args":
            return isinstance(obj, dict)
        if not isinstance(obj, dict) or self.name is None or not self.args_ok:
            return False
        if self.args_key is None:
            if args_required:
                return False
            self.args.append("{}")
            return True
        if self.args_kind == "{":
            try:
                return isinstance(json.loads("".join(self.args), strict=False), dict)
            except ValueError:
                return False
        return bool(self.args)


class Builder:
    """What every builder shares: the call being read and its ops."""

    args_required = False

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.failed = False
        self._obj: JsonObject | None = None
        self._head_sent = False

    def _pump(self, obj: JsonObject) -> None:
        if not self._head_sent and obj.head_ready(self.args_required):
            self.ops.append(("start", obj.name or ""))
            self._head_sent = True
        if self._head_sent:
            text = obj.take_args()
            if text:
                self.ops.append(("args", text))

    def _take(self) -> list[Op]:
        ops, self.ops = self.ops, []
        return ops

    def feed(self, text: str) -> list[Op]:
        raise NotImplementedError

    def close(self) -> tuple[list[Op], bool]:
        raise NotImplementedError


class JsonCallBody(Builder):
    """A block's body: one JSON call object between whitespace (hermes)."""

    args_required = True

    def __init__(self, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        super().__init__()
        self._obj = JsonObject("call", args_keys)

    def feed(self, text: str) -> list[Op]:
        obj = self._obj
        assert obj is not None
        for ch in text:
            obj.step(ch)
        if not obj.failed:
            self._pump(obj)
        return self._take()

    def close(self) -> tuple[list[Op], bool]:
        obj = self._obj
        assert obj is not None
        if obj.failed or not obj.valid(self.args_required):
            return [], False
        self._pump(obj)
        return self._take(), True


class JsonCallSequence(Builder):
    """Calls as JSON objects one after another: `sep` between them (llama3_json: `;`, a
    trailing one allowed), or a JSON list of them (`list_form`, mistral)."""

    def __init__(self, args_keys: tuple[str, ...], sep: str = ";", list_form: bool = False) -> None:
        super().__init__()
        self.args_keys, self.sep, self.list_form = args_keys, sep, list_form
        self.phase = "open" if list_form else "object"  # open object after closed | error
        self.count = 0

    def step(self, ch: str) -> None:
        phase = self.phase
        if phase == "object":
            if self._obj is None:
                if ch in _WS:
                    return
                if ch == "]" and self.list_form and self.count == 0:
                    self.phase = "error"
                    return
                self._obj = JsonObject("call", self.args_keys)
                self._head_sent = False
            obj = self._obj
            obj.step(ch)
            if obj.failed:
                self.phase = "error"
            elif obj.done:
                if not obj.valid(self.args_required):
                    self.phase = "error"
                    return
                self._pump(obj)
                self._obj = None
                self.count += 1
                self.phase = "after"
            return
        if ch in _WS:
            return
        if phase == "open":
            self.phase = "object" if ch == "[" else "error"
        elif phase == "after":
            if ch == self.sep:
                self.phase = "sep"
            elif ch == "]" and self.list_form:
                self.phase = "closed"
            else:
                self.phase = "error"
        elif phase == "sep":
            if ch == "{":
                self.phase = "object"
                self.step(ch)
            else:
                self.phase = "error"
        else:  # closed: nothing may follow
            self.phase = "error"

    def feed(self, text: str) -> list[Op]:
        for ch in text:
            if self.phase == "error":
                break
            self.step(ch)
        if self.phase == "object" and self._obj is not None and not self._obj.failed:
            self._pump(self._obj)
        return self._take()

    @property
    def complete(self) -> bool:
        if self.list_form:
            return self.phase == "closed"
        return self.count > 0 and (self.phase in ("after", "sep")) and self._obj is None

    def close(self) -> tuple[list[Op], bool]:
        return self._take(), self.complete


def render_member(first: bool, key: str, value: Any) -> str:
    """One parameter of arguments rendered as JSON, as json.dumps writes a dict."""
    return (
        ("{" if first else ", ")
        + json.dumps(key, ensure_ascii=False)
        + ": "
        + (json.dumps(value, ensure_ascii=False))
    )
