"""The chat answer shapes with a reasoning model and a tool-call family (router/dialects.py):
the whole message carries reasoning_content, content and tool_calls; the stream's deltas carry
the same, reasoning first, a call's id/type/name before its arguments, tags never leaking."""

from __future__ import annotations

import json

import pytest

from replica.api import RequestOutput
from router.dialects import ChatDialect, Choice
from router.protocol import ChatCompletionRequest, UsageInfo
from router.reasoning import Reasoning
from router.tool_parsers import get_tool_parser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}},
        },
    }
]


class _Tokenizer:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def chat(reasoning: Reasoning | None, family: str = "hermes") -> ChatCompletionRequest:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    req.use_model_format(family, reasoning, (7,))
    return req


def deltas_of(text: str, step: int) -> list[RequestOutput]:
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    return [
        RequestOutput("r", [], p, 3, i + 1, "stop" if i == len(pieces) - 1 else None)
        for i, p in enumerate(pieces)
    ]


CASES = [
    (
        "qwen3_coder",
        Reasoning("qwen3"),
        "<think>Need weather.</think>\n\nLet me check.\n<tool_call>\n<function=get_weather>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        ("Need weather.", "Let me check.", [("get_weather", {"days": 3})]),
    ),
    (
        "mistral",
        Reasoning("deepseek_r1", opened=True),
        'plan</think>[TOOL_CALLS][{"name": "get_weather", "arguments": {"days": 1}}]',
        ("plan", None, [("get_weather", {"days": 1})]),
    ),
    (
        "hermes",
        Reasoning("deepseek_r1", opened=True),
        "thinking about <tool_call> without closing",
        ("thinking about <tool_call> without closing", None, []),
    ),
    ("pythonic", None, "[get_weather(days=2)]", (None, None, [("get_weather", {"days": 2})])),
]


@pytest.mark.parametrize("family,reasoning,text,expected", CASES)
def test_whole_message(family, reasoning, text, expected):
    dialect = ChatDialect(_Tokenizer(), "m", get_tool_parser(family))
    choice = Choice(0)
    for out in deltas_of(text, len(text)):
        choice.add(out)
    req = chat(reasoning, family)
    answer = dialect.response(UsageInfo.of(3, 5), [choice], False, tool_mode="auto", chat=req)
    message = answer.choices[0].message
    thought, content, calls = expected
    assert message.reasoning_content == thought
    assert message.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == (
        calls
    )
    assert answer.choices[0].finish_reason == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize("family,reasoning,text,expected", CASES)
def test_stream_deltas(family, reasoning, text, expected, step):
    dialect = ChatDialect(_Tokenizer(), "m", get_tool_parser(family))
    stream = dialect.stream(tool_mode="auto", chat=chat(reasoning, family))
    thought, content, calls = "", "", {}
    order = []  # reasoning before content and calls
    finish = None
    for out in deltas_of(text, step):
        for chunk in stream.chunks(0, out, None):
            delta = chunk.choices[0].delta
            finish = chunk.choices[0].finish_reason or finish
            if delta.reasoning_content:
                thought += delta.reasoning_content
                order.append("r")
            if delta.content:
                content += delta.content
                order.append("c")
            for call in delta.tool_calls or []:
                if call.id is not None:  # the head: id, type and name, no arguments yet
                    assert call.type == "function" and call.function.name
                    assert call.index not in calls
                    calls[call.index] = [call.function.name, ""]
                else:
                    calls[call.index][1] += call.function.arguments
                order.append("t")
    want_thought, want_content, want_calls = expected
    assert thought == (want_thought or "")
    assert content == (want_content or "")
    assert [(n, json.loads(a)) for n, a in calls.values()] == want_calls
    assert order == sorted(order, key="rct".index)
    for part in (thought, content):
        assert "<think>" not in part and "</think>" not in part
    assert finish == ("tool_calls" if want_calls else "stop")


def test_thinking_off_sends_no_gate_and_no_reasoning():
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_object"},
        chat_template_kwargs={"enable_thinking": False},
    )
    req.use_model_format("hermes", None, (7,))
    assert req.to_sampling_params(16).structured.after == ()
    req.use_model_format("hermes", Reasoning("qwen3"), (7,))
    assert req.to_sampling_params(16).structured.after == (7,)


def test_tool_constraint_carries_the_family():
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice="required"
    )
    req.use_model_format("pythonic", Reasoning("qwen3"), (9, 10))
    spec = req.to_sampling_params(16).structured
    assert json.loads(spec.spec)["format"] == "pythonic" and spec.after == (9, 10)


def test_chat_template_kwargs_cannot_override_request_fields():
    with pytest.raises(ValueError, match="chat_template_kwargs must not set \\['tools'\\]"):
        ChatCompletionRequest(
            messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={"tools": []}
        )


def test_skip_special_tokens_is_carried_and_kept_markers_override_it():
    """vLLM's field reaches SamplingParams; a request whose markers are special tokens keeps
    them whatever it says (the parsers need them)."""
    from router.protocol import CompletionRequest

    assert CompletionRequest(prompt="x").to_sampling_params(8).skip_special_tokens is True
    req = CompletionRequest(prompt="x", skip_special_tokens=False)
    assert req.to_sampling_params(8).skip_special_tokens is False
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    req.use_model_format("mistral", None, (), (True, False))
    assert req.keeps_markers and req.to_sampling_params(8).skip_special_tokens is False
    req.use_model_format("mistral", None, (), (False, True))  # special <think>, not thinking
    assert req.to_sampling_params(8).skip_special_tokens is True
    req.use_model_format("mistral", Reasoning("qwen3"), (), (False, True))
    assert req.to_sampling_params(8).skip_special_tokens is False
