"""Mistral calls: `[TOOL_CALLS]` and a JSON list of {"name", "arguments"} (Mistral 7B v0.3,
Nemo, Small), or the newer `[TOOL_CALLS]name[ARGS]{...}` per call (Magistral, Devstral);
call ids are 9 letters or digits, as Mistral's templates require. An output that opens with
the bare JSON list is read as calls too: `[TOOL_CALLS]` is a special token in Mistral's
tokenizers, which the detokenizer leaves out of the text."""

from __future__ import annotations

import json

from router.tool_parsers.base import (
    Call,
    TailStream,
    ToolParser,
    arguments_json,
    call_of,
    new_mistral_call_id,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_DECODER = json.JSONDecoder(strict=False)


def _segment_calls(segment: str) -> list[Call] | None:
    text = segment.strip()
    if text.startswith("[") or text.startswith("{"):
        try:
            obj, pos = _DECODER.raw_decode(text)
        except ValueError:
            return None
        if text[pos:].strip():
            return None
        items = obj if isinstance(obj, list) else [obj]
        calls = [call_of(item, ("arguments", "parameters")) for item in items]
        return None if not calls or None in calls else calls  # type: ignore[return-value]
    name, sep, args = text.partition(ARGS)
    name = name.strip()
    if not sep or not name or any(c.isspace() for c in name):
        return None
    arguments = arguments_json(args.strip())
    return None if arguments is None else [(name, arguments)]


def parse_mistral_tail(tail: str, trigger: str = TOOL_CALLS) -> list[Call] | None:
    if trigger != TOOL_CALLS:  # a bare list at the start: [TOOL_CALLS] was a skipped special
        return _segment_calls(trigger + tail)
    calls: list[Call] = []
    for segment in tail.split(TOOL_CALLS):
        if not segment.strip() and calls:
            continue
        found = _segment_calls(segment)
        if found is None:
            return None
        calls += found
    return calls


class MistralParser(ToolParser):
    name = "mistral"

    def stream(self, tools: list[dict] | None = None) -> TailStream:
        return TailStream((TOOL_CALLS,), ("[{",), parse_mistral_tail, new_mistral_call_id)
