"""Hermes tool calling: template detection, prompt rendering, output parsing and streaming."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from types import SimpleNamespace

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.tool_calls import (
    TOOL_SYSTEM_PROMPT,
    ContentDelta,
    ToolCallArgs,
    ToolCallStart,
    ToolCallStreamParser,
    format_tool_call,
    parse_tool_calls,
    render_messages,
    template_supports_tools,
)

SMOLLM2_DIR = Path.home() / ".cache" / "stepserve" / "SmolLM2-135M-Instruct"

# A small ChatML template in the Hermes style, written for these tests: tools in the system
# turn, calls rendered from `arguments | tojson`, tool results in a user turn.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "TOOLS:{% for tool in tools %}{{ '\\n' }}{{ tool.function | tojson }}{% endfor %}"
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{% for call in message.tool_calls %}{% if not loop.first or message.content %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", '
    '"arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PLAIN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": None}}
TOOLS = [WEATHER, CLOCK]

HISTORY = [
    {"role": "user", "content": "Weather in Paris and Köln?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Köln"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "15 C"},
    {"role": "assistant", "content": "Paris 18 C, Köln 15 C."},
    {"role": "user", "content": "Thanks"},
]


def render_jinja(template: str, messages, tools) -> str:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # as HF
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
    return env.from_string(template).render(
        messages=messages, tools=tools, add_generation_prompt=True
    )


def tok(template):
    return SimpleNamespace(chat_template=template)


# -- template detection ------------------------------------------------------------------------
def test_template_detection():
    assert template_supports_tools(tok(HERMES_TEMPLATE))
    assert not template_supports_tools(tok(PLAIN_TEMPLATE))
    assert not template_supports_tools(tok(None))
    assert not template_supports_tools(SimpleNamespace())
    # plain text, string literals and attributes named tools are not the variable
    assert not template_supports_tools(tok("use tools {{ 'tools' }} {{ message.tools }}"))
    assert template_supports_tools(tok("{% if tools is defined %}x{% endif %}"))
    # a custom tag jinja2 cannot parse falls back to scanning the tags
    custom = "{% generation %}{{ x }}{% endgeneration %}{% for t in tools %}{{ t }}{% endfor %}"
    assert template_supports_tools(tok(custom))
    assert not template_supports_tools(tok("{% generation %}tools{% endgeneration %}"))


def test_template_detection_named_templates():
    assert template_supports_tools(tok({"default": PLAIN_TEMPLATE, "tool_use": HERMES_TEMPLATE}))
    assert template_supports_tools(tok({"default": HERMES_TEMPLATE}))
    assert not template_supports_tools(tok({"default": PLAIN_TEMPLATE}))
    assert not template_supports_tools(tok({"rag": HERMES_TEMPLATE}))
    listed = [{"name": "default", "template": PLAIN_TEMPLATE}]
    assert not template_supports_tools(tok(listed))
    listed.append({"name": "tool_use", "template": HERMES_TEMPLATE})
    assert template_supports_tools(tok(listed))


# -- rendering ---------------------------------------------------------------------------------
def test_format_tool_call():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": "ü"}}\n</tool_call>'
    assert format_tool_call("f", {"a": 1, "b": "ü"}) == text
    assert format_tool_call("f", '{"a":1,"b":"ü"}') == text
    assert format_tool_call("f", "") == '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


def test_render_native():
    messages, tools = render_messages(HISTORY, TOOLS, template_tools=True)
    assert tools == [WEATHER, {"type": "function", "function": {"name": "get_time"}}]
    assert all(isinstance(m["content"], str) for m in messages)
    assert [m["role"] for m in messages] == [m["role"] for m in HISTORY]
    calls = messages[1]["tool_calls"]
    assert messages[1]["content"] == ""
    assert [c["function"]["arguments"] for c in calls] == [{"city": "Paris"}, {"city": "Köln"}]
    assert calls[0]["id"] == "call_1"
    assert messages[2] == {
        "role": "tool",
        "tool_call_id": "call_1",
        "name": "get_weather",
        "content": "18 C",
    }
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # copied

    prompt = render_jinja(HERMES_TEMPLATE, messages, tools)
    assert prompt.startswith("<|im_start|>system\nTOOLS:\n" + json.dumps(WEATHER["function"]))
    assert '"name": "get_time"}<|im_end|>\n' in prompt
    assert (
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call><|im_end|>\n'
    ) in prompt
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")


def test_render_native_keeps_invalid_arguments_and_no_tools():
    history = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": "let me see",
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "not json"}}],
        },
    ]
    messages, tools = render_messages(history, None, template_tools=True)
    assert tools is None
    assert messages[1]["content"] == "let me see"
    assert messages[1]["tool_calls"][0]["type"] == "function"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == "not json"
    assert render_messages(history, [], template_tools=True)[1] is None


def expected_inline_tail() -> list[dict]:
    return [
        {"role": "user", "content": "Weather in Paris and Köln?"},
        {
            "role": "assistant",
            "content": format_tool_call("get_weather", {"city": "Paris"})
            + "\n"
            + format_tool_call("get_weather", {"city": "Köln"}),
        },
        {
            "role": "user",
            "content": "<tool_response>\n18 C\n</tool_response>\n"
            "<tool_response>\n15 C\n</tool_response>",
        },
        {"role": "assistant", "content": "Paris 18 C, Köln 15 C."},
        {"role": "user", "content": "Thanks"},
    ]


def test_render_inline_inserts_system():
    messages, tools = render_messages(HISTORY, TOOLS, template_tools=False)
    assert tools is None
    assert all(set(m) == {"role", "content"} for m in messages)
    assert all(isinstance(m["content"], str) for m in messages)
    system = messages[0]
    assert system["role"] == "system"
    assert messages[1:] == expected_inline_tail()
    lines = system["content"].split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(line) for line in lines] == [WEATHER["function"], {"name": "get_time"}]
    convention = '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n'
    assert convention + "</tool_call>" in system["content"]
    assert system["content"] == TOOL_SYSTEM_PROMPT.replace("{tools}", "\n".join(lines))


def test_render_inline_appends_to_system():
    history = [{"role": "system", "content": "Be brief."}, *HISTORY]
    messages, _ = render_messages(history, TOOLS, template_tools=False)
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert "<tools>\n" in messages[0]["content"]
    assert messages[1:] == expected_inline_tail()
    assert history[0]["content"] == "Be brief."  # not mutated


def test_render_inline_without_tools_still_converts_history():
    messages, tools = render_messages(HISTORY, None, template_tools=False)
    assert tools is None
    assert messages == expected_inline_tail()
    mixed = [
        {"role": "assistant", "content": "Checking.", "tool_calls": HISTORY[1]["tool_calls"][:1]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "user", "content": None},
    ]
    messages, _ = render_messages(mixed, [], template_tools=False)
    assert messages == [
        {
            "role": "assistant",
            "content": "Checking.\n" + format_tool_call("get_weather", '{"city": "Paris"}'),
        },
        {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"},
        {"role": "user", "content": ""},
    ]


@pytest.fixture(scope="module")
def smollm2():
    if not (SMOLLM2_DIR / "tokenizer.json").exists():
        pytest.skip("SmolLM2-135M-Instruct is not in the cache")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOLLM2_DIR)


def test_smollm2_inline_prompt(smollm2):
    assert not template_supports_tools(smollm2)
    messages, tools = render_messages(HISTORY, TOOLS, template_tools=False)
    prompt = smollm2.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert "You are a helpful AI assistant named SmolLM" not in prompt
    assert json.dumps(WEATHER["function"]) + "\n" in prompt
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
    ) in prompt
    assert (
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n"
        "<tool_response>\n15 C\n</tool_response><|im_end|>\n"
    ) in prompt
    assert prompt.endswith("<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")


def test_hf_native_prompt(smollm2):
    """The native path through HF's own renderer with a tool-aware template."""
    messages, tools = render_messages(HISTORY, TOOLS, template_tools=True)
    prompt = smollm2.apply_chat_template(
        messages,
        tools=tools,
        chat_template=HERMES_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt.startswith("<|im_start|>system\nTOOLS:\n")
    assert '{"name": "get_weather", "arguments": {"city": "Köln"}}' in prompt
    assert "<tool_response>\n15 C\n</tool_response>" in prompt


# -- parsing -----------------------------------------------------------------------------------
def call(name, args) -> str:
    return format_tool_call(name, args)


def test_parse_single():
    out = parse_tool_calls(call("get_weather", {"city": "Paris"}))
    assert out.content is None
    [c] = out.tool_calls
    assert (c.name, c.arguments) == ("get_weather", '{"city": "Paris"}')
    assert re.fullmatch(r"call_[0-9a-f]{24}", c.id)
    assert c.to_openai() == {
        "id": c.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }


def test_parse_parallel_and_content():
    text = (
        "Let me check.\n"
        + call("get_weather", {"city": "Paris"})
        + "\n"
        + call("get_weather", {"city": "Köln"})
        + "\n"
    )
    out = parse_tool_calls(text)
    assert out.content == "Let me check."
    assert [json.loads(c.arguments) for c in out.tool_calls] == [
        {"city": "Paris"},
        {"city": "Köln"},
    ]
    assert out.tool_calls[1].arguments == '{"city": "Köln"}'  # not ascii-escaped
    assert out.tool_calls[0].id != out.tool_calls[1].id


def test_parse_without_calls_is_identity():
    for text in ["", "  hello\n", "a <tool_call> b", "<tool_call>\n{bad}\n</tool_call>\n"]:
        out = parse_tool_calls(text)
        assert (out.content, out.tool_calls) == (text, [])


def test_parse_invalid_blocks_stay_in_content():
    bad = [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>["get_weather"]</tool_call>',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>',
        '<tool_call>{"name": "f"}</tool_call>',
    ]
    for block in bad:
        text = "x " + block + " " + call("g", {}) + " y"
        out = parse_tool_calls(text)
        assert out.content == "x " + block + "  y"
        assert [(c.name, c.arguments) for c in out.tool_calls] == [("g", "{}")]


def test_parse_unterminated_block_stays():
    cut = '<tool_call>\n{"name": "get_weather", "argum'
    out = parse_tool_calls(call("f", {"a": 1}) + "\n" + cut)
    assert out.content == cut
    assert [c.name for c in out.tool_calls] == ["f"]
    assert parse_tool_calls(cut).content == cut


def test_parse_aliases():
    out = parse_tool_calls('<tool_call>{"name": "f", "parameters": {"a": [1, 2]}}</tool_call>')
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("f", '{"a": [1, 2]}')]
    out = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("f", '{"a": 1}')]
    # a literal newline inside a JSON string is tolerated
    out = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"s": "a\nb"}}</tool_call>')
    assert json.loads(out.tool_calls[0].arguments) == {"s": "a\nb"}


# -- streaming ---------------------------------------------------------------------------------
def stream(pieces: list[str]) -> tuple[list, ToolCallStreamParser]:
    parser = ToolCallStreamParser()
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return events, parser


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def streamed_calls(events) -> list[tuple[int, str, str, str]]:
    """(index, id, name, joined argument fragments) per started call."""
    calls: dict[int, list] = {}
    for e in events:
        if isinstance(e, ToolCallStart):
            calls[e.index] = [e.index, e.id, e.name, ""]
        elif isinstance(e, ToolCallArgs):
            calls[e.index][3] += e.text
    return [tuple(c) for c in calls.values()]


def check_equivalent(text: str, pieces: list[str]) -> None:
    assert "".join(pieces) == text
    events, parser = stream(pieces)
    parsed = parse_tool_calls(text)
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = streamed_calls(events)
    assert [(c[2], c[3]) for c in calls] == [(c.name, c.arguments) for c in parsed.tool_calls]
    assert [c[0] for c in calls] == list(range(len(calls)))
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c[1]) for c in calls)
    assert parser.saw_tool_calls == bool(calls)
    assert all(e.text for e in events if isinstance(e, ContentDelta | ToolCallArgs))
    if not calls:
        assert content == text
    else:
        # leading whitespace may have gone out before the first call was known
        assert content.lstrip() == (parsed.content or "")
        seen = False
        for e in events:
            seen = seen or isinstance(e, ToolCallStart)
            if seen and isinstance(e, ContentDelta):
                assert e.text.strip()


OUTPUTS = [
    call("get_weather", {"city": "Paris"}),
    "Sure, checking.\n"
    + call("get_weather", {"city": "Paris"})
    + "\n"
    + call("get_time", {})
    + "\n",
    "\n\n" + call("f", {"s": "</tool_call"}) + "\n  \n" + call("g", {"x": [1, {"y": None}]}),
    "plain answer with <tools> and a < b and <tool_cal",
    "before <tool_call>{bad json}</tool_call> middle " + call("f", {"a": 1}) + " after\n",
    "text " + call("f", {"a": 1}) + '\n<tool_call>\n{"name": "g", "argu',
    "<tool_call><tool_call>" + call("f", {}) + "</tool_call>",
    '<tool_call>{"name": "f", "parameters": {"k": "v"}}</tool_call>\nDone.\n',
    "   leading space then text\n" + call("f", {"u": "ünï"}) + "\n",
    "",
    "   \n",
]

FRAGMENTS = [
    call("f", {"a": 1}),
    call("get_weather", {"city": "Köln"}),
    '<tool_call>{"name": "p", "parameters": {}}</tool_call>',
    "<tool_call>{bad}</tool_call>",
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "<",
    "\n",
    "  ",
    "Hello",
    " world.",
    "<tools>",
    "{}",
]


@pytest.mark.parametrize("text", OUTPUTS)
def test_stream_matches_parse_on_random_splits(text):
    rng = random.Random(len(text))
    check_equivalent(text, [text])
    check_equivalent(text, list(text))
    for _ in range(200):
        cuts = [rng.randrange(len(text) + 1) for _ in range(rng.randrange(1, 8))]
        check_equivalent(text, split(text, cuts))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(FRAGMENTS), max_size=10),
    st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
)
def test_stream_matches_parse_property(fragments, cuts):
    text = "".join(fragments)
    check_equivalent(text, split(text, cuts))


def test_stream_emits_plain_text_at_once():
    parser = ToolCallStreamParser()
    assert parser.feed("Hello") == [ContentDelta("Hello")]
    assert parser.feed(" there <tool") == [ContentDelta(" there")]
    assert parser.feed("s> ok") == [ContentDelta(" <tools> ok")]
    assert parser.feed("\n") == []
    assert parser.finish() == [ContentDelta("\n")]
    assert not parser.saw_tool_calls


def test_stream_tool_call_and_whitespace():
    parser = ToolCallStreamParser()
    assert parser.feed("\n\n") == []
    assert parser.feed("<tool_call>\n") == []
    assert parser.feed('{"name": "f", "arguments": ') == []  # the arguments have not begun
    [head, args] = parser.feed('{"a": 1')
    assert isinstance(head, ToolCallStart) and (head.index, head.name) == (0, "f")
    assert args == ToolCallArgs(0, '{"a": 1')
    assert parser.feed("}") == [ToolCallArgs(0, "}")]
    assert parser.feed("}\n</tool_") == []  # the wrapper's `}` never goes out
    assert parser.feed("call>\n") == []
    assert parser.saw_tool_calls
    assert parser.feed("  \n") == []
    events = parser.feed(call("g", {}))
    assert [(type(e), e.index) for e in events] == [(ToolCallStart, 1), (ToolCallArgs, 1)]
    assert events[1].text == "{}"
    assert parser.feed("\n") == []
    assert parser.finish() == []


def test_stream_content_after_call_and_unterminated_block():
    parser = ToolCallStreamParser()
    events = parser.feed(call("f", {}) + "\nNote: ")
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgs, ContentDelta]
    assert events[2] == ContentDelta("\nNote:")
    assert parser.feed('<tool_call>{"name": "g"') == []
    assert parser.finish() == [ContentDelta(' <tool_call>{"name": "g"')]


def test_stream_invalid_block_is_content():
    parser = ToolCallStreamParser()
    assert parser.feed("<tool_call>{nope}") == []
    assert parser.feed("</tool_call>") == [ContentDelta("<tool_call>{nope}</tool_call>")]
    assert parser.finish() == []
    assert not parser.saw_tool_calls
