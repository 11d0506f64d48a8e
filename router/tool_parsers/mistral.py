"""Mistral calls: `[TOOL_CALLS]` and a JSON list of {"name", "arguments"} (Mistral 7B v0.3,
Nemo, Small), or the newer `[TOOL_CALLS]name[ARGS]{...}` per call (Magistral, Devstral);
call ids are 9 letters or digits, as Mistral's templates require. An output that opens with
the bare JSON list is read as calls too: `[TOOL_CALLS]` is a special token in Mistral's
tokenizers, which the detokenizer leaves out of the text."""

from __future__ import annotations

from router.tool_parsers.base import TailStream, ToolParser, new_mistral_call_id
from router.tool_parsers.incremental import (
    _WS,
    Builder,
    JsonCallSequence,
    JsonObject,
    Op,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_KEYS = ("arguments", "parameters")


class MistralTail(Builder):
    """The calls after `[TOOL_CALLS]`: segments split by further `[TOOL_CALLS]`, each a JSON
    list of calls, one call object, or `name[ARGS]{...}`."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "segment"  # segment (its start) | list | name | args | between | error
        self.look = ""  # text at a segment's start that may be `[TOOL_CALLS]`
        self.sub: JsonCallSequence | None = None
        self.name = ""
        self.calls = 0

    def _dispatch(self, text: str) -> None:
        """A segment's first characters (not `[TOOL_CALLS]`): pick its form."""
        if text[0] in "[{":
            self.sub = JsonCallSequence(_KEYS, ",", list_form=text[0] == "[")
            self.phase = "list"
        else:
            self.phase, self.name = "name", ""
        for ch in text:
            self.step(ch)

    def step(self, ch: str) -> None:
        phase = self.phase
        if phase in ("segment", "between"):
            if not self.look and ch in _WS:
                return
            self.look += ch
            if self.look == TOOL_CALLS:
                self.look = ""
                # an empty first segment (`[TOOL_CALLS][TOOL_CALLS]`) is not calls
                self.phase = "error" if phase == "segment" and not self.calls else "segment"
            elif not TOOL_CALLS.startswith(self.look):
                text, self.look = self.look, ""
                if phase == "between":
                    self.phase = "error"
                else:
                    self._dispatch(text)
        elif phase == "list":
            sub = self.sub
            assert sub is not None
            sub.step(ch)
            self.ops += sub._take()
            if sub.phase == "error":
                self.phase = "error"
            elif sub.phase == "closed" or (not sub.list_form and sub.phase == "after"):
                self.calls += sub.count
                self.sub, self.phase = None, "between"
        elif phase == "name":
            self.name += ch
            if self.name.endswith(ARGS):
                name = self.name[: -len(ARGS)].strip()
                if not name or any(c in _WS for c in name):
                    self.phase = "error"
                    return
                self.name, self.phase = name, "args"
                self._obj, self._head_sent = JsonObject("args"), False
        elif phase == "args":
            obj = self._obj
            assert obj is not None
            if not obj.raw and ch in _WS:
                return
            obj.step(ch)
            if obj.failed:
                self.phase = "error"
                return
            if not self._head_sent:
                self.ops.append(("start", self.name))
                self._head_sent = True
            if obj.done:
                if not obj.valid(False):
                    self.phase = "error"
                    return
                self.ops.append(("args", obj.take_args()))
                self.calls += 1
                self._obj, self.phase = None, "between"

    def feed(self, text: str) -> list[Op]:
        for ch in text:
            if self.phase == "error":
                break
            self.step(ch)
        if self.phase == "list" and self.sub is not None:
            sub = self.sub
            if sub._obj is not None and not sub._obj.failed:
                sub._pump(sub._obj)
                self.ops += sub._take()
        elif self.phase == "args" and self._obj is not None and self._head_sent:
            text = self._obj.take_args()
            if text:
                self.ops.append(("args", text))
        return self._take()

    def close(self) -> tuple[list[Op], bool]:
        valid = self.phase in ("between", "segment") and self.calls > 0 and not self.look
        return self._take(), valid


def _builder(trigger: str) -> Builder:
    if trigger == TOOL_CALLS:
        return MistralTail()
    # a bare list at the start: [TOOL_CALLS] was a skipped special token
    return _BareList()


class _BareList(JsonCallSequence):
    def __init__(self) -> None:
        super().__init__(_KEYS, ",", list_form=True)


class MistralParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS, ARGS)

    def stream(self, tools: list[dict] | None = None) -> TailStream:
        return TailStream((TOOL_CALLS,), ("[{",), _builder, new_mistral_call_id)
