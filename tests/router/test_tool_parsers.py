"""The tool-call parsers per family (router/tool_parsers/): hand-written model outputs parsed
whole and streamed in pieces split at every position and at random; malformed calls stay
content; `auto` picks the family from the chat template."""

from __future__ import annotations

import json
import random

import pytest

from router.tool_parsers import (
    ContentDelta,
    ToolCallArgs,
    ToolCallStart,
    ToolCallsVoid,
    detect_tool_parser,
    get_tool_parser,
)
from router.tool_parsers.base import collect

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
            "scale": {"type": "number"},
            "tags": {"type": "array"},
            "opts": {"type": "object"},
        },
        "required": ["city"],
    },
}
TOOLS = [WEATHER, {"name": "noop", "parameters": {"type": "object", "properties": {}}}]

# (family, output, expected content, expected [(name, arguments as an object)])
CASES = [
    (
        "hermes",
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
        "Let me look.",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Köln", "days": 2}}',
        None,
        [("get_weather", {"city": "Köln", "days": 2})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "noop", "parameters": {}}',
        None,
        [("get_weather", {"city": "Paris"}), ("noop", {})],
    ),
    (
        "llama3_json",
        'Checking. <|python_tag|>{"name": "noop", "arguments": {}}',
        "Checking.",
        [("noop", {})],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "noop", "arguments": {}}]',
        "Sure.",
        [("get_weather", {"city": "Paris"}), ("noop", {})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]noop[ARGS]{}',
        None,
        [("get_weather", {"city": "Oslo"}), ("noop", {})],
    ),
    (  # [TOOL_CALLS] dropped from the text as a special token: the bare list at the start
        "mistral",
        '[{"name": "noop", "arguments": {}}]',
        None,
        [("noop", {})],
    ),
    (
        "qwen3_coder",
        "I will call it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nfalse\n</parameter>"
        '\n<parameter=scale>\n1.5\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>'
        "\n<parameter=opts>\n{'x': 1}\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=noop>\n</function>\n</tool_call>",
        "I will call it.",
        [
            (
                "get_weather",
                {
                    "city": "New York",
                    "days": 3,
                    "metric": False,
                    "scale": 1.5,
                    "tags": ["a", "b"],
                    "opts": {"x": 1},
                },
            ),
            ("noop", {}),
        ],
    ),
    (
        "pythonic",
        '[get_weather(city="Paris", days=2, metric=True, tags=["a"], opts={"k": None}), noop()]',
        None,
        [
            (
                "get_weather",
                {"city": "Paris", "days": 2, "metric": True, "tags": ["a"], "opts": {"k": None}},
            ),
            ("noop", {}),
        ],
    ),
    (
        "pythonic",
        '<|python_start|>[get_weather(city="Rome", scale=-2.5)]<|python_end|>',
        None,
        [("get_weather", {"city": "Rome", "scale": -2.5})],
    ),
]

# outputs each family must leave as plain content (malformed or not calls)
MALFORMED = [
    ("hermes", "<tool_call>\n{not json}\n</tool_call> and text"),
    ("hermes", 'cut short <tool_call>\n{"name": "noop", "argu'),
    ("llama3_json", 'The JSON {"name": "noop", "parameters": {}} in a sentence.'),
    ("llama3_json", '{"name": "noop", "parameters": {}} trailing words'),
    ("llama3_json", '{"city": "Paris"}'),
    ("mistral", '[TOOL_CALLS][{"name": "noop", "arguments": {}'),
    ("mistral", "[TOOL_CALLS]no args here"),
    ("mistral", '[{"a": 1}] is a list'),
    ("mistral", 'Text then [{"name": "noop", "arguments": {}}]'),
    ("qwen3_coder", "<tool_call>\n<function=noop>\nstray text\n</function>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis"),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[get_weather(__import__('os').system('x'))]"),
    ("pythonic", '[get_weather(city="Paris")'),
    ("pythonic", "Some text [noop()]"),
]


def _calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def _streamed(family: str, pieces: list[str]):
    stream = get_tool_parser(family).stream(TOOLS)
    events = []
    for piece in pieces:
        events += stream.feed(piece)
    events += stream.finish()
    return events


def _split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_parse_finished_text(family, text, content, calls):
    parsed = get_tool_parser(family).parse(text, TOOLS)
    assert parsed.content == content
    assert _calls(parsed) == calls


def _call_fragments(events) -> dict[int, tuple[str, str, list[str]]]:
    """Per started call: (id, name, its argument fragments)."""
    calls: dict[int, tuple[str, str, list[str]]] = {}
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.index not in calls
            calls[e.index] = (e.id, e.name, [])
        elif isinstance(e, ToolCallArgs):
            assert e.index in calls and e.text  # fragments follow their call's start
            calls[e.index][2].append(e.text)
    return calls


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_stream_split_anywhere_matches_parse(family, text, content, calls):
    """Every single split point and 30 random multi-way splits give the whole parse: the
    same content, names, and each call's argument fragments joined are its arguments (the
    same string)."""
    whole = get_tool_parser(family).parse(text, TOOLS)
    rng = random.Random(7)
    splits = [[i] for i in range(1, len(text))]
    splits += [rng.sample(range(1, len(text)), k=rng.randint(2, 12)) for _ in range(30)]
    for cuts in splits:
        events = _streamed(family, _split_at(text, cuts))
        got = collect(events)
        assert got.content == content, cuts
        assert _calls(got) == calls, cuts
        streamed = _call_fragments(events)
        assert list(streamed) == list(range(len(calls)))
        assert [(name, "".join(frags)) for _, name, frags in streamed.values()] == [
            (c.name, c.arguments) for c in whole.tool_calls
        ], cuts
        assert [c.id for c in got.tool_calls] == [i for i, _, _ in streamed.values()]
        assert not any(isinstance(e, ToolCallsVoid) for e in events)


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_stream_is_incremental(family, text, content, calls):
    """Fed a character at a time, a call starts before its text ends and its arguments come
    in several fragments (one per parameter for qwen3_coder and pythonic, as generated for
    the JSON families)."""
    stream = get_tool_parser(family).stream(TOOLS)
    events, at = [], []
    for pos, ch in enumerate(text):
        new = stream.feed(ch)
        events += new
        at += [pos] * len(new)
    events += stream.finish()
    streamed = _call_fragments(events)
    big = [i for i, (name, _) in enumerate(calls) if name == "get_weather"]
    for index in big:
        _, _, frags = streamed[index]
        assert len(frags) >= 2, frags
    starts = [p for p, e in zip(at, events) if isinstance(e, ToolCallStart)]
    assert starts and starts[0] < len(text) - 2  # the first call starts well before the end


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
def test_json_arguments_stream_as_generated(family):
    """JSON families forward the arguments object's own text, never text after it."""
    text = {
        "hermes": '<tool_call>\n{"name": "f", "arguments": {"q":"a}b", "n": [1,{"x":2}]}}\n'
        "</tool_call>",
        "llama3_json": '<|python_tag|>{"name": "f", "parameters": {"q":"a}b", "n": [1,{"x":2}]}}',
        "mistral": '[TOOL_CALLS]f[ARGS]{"q":"a}b", "n": [1,{"x":2}]}',
    }[family]
    stream = get_tool_parser(family).stream()
    frags = []
    for ch in text:
        frags += [e.text for e in stream.feed(ch) if isinstance(e, ToolCallArgs)]
    frags += [e.text for e in stream.finish() if isinstance(e, ToolCallArgs)]
    assert "".join(frags) == '{"q":"a}b", "n": [1,{"x":2}]}'
    if family != "llama3_json":  # a tail's last call is confirmed at the end
        assert len(frags) == len('{"q":"a}b", "n": [1,{"x":2}]}')


def test_raw_newlines_in_argument_strings_are_escaped():
    text = '<tool_call>{"name": "f", "arguments": {"s": "a\nb\tc"}}</tool_call>'
    parsed = get_tool_parser("hermes").parse(text)
    assert parsed.tool_calls[0].arguments == '{"s": "a\\nb\\tc"}'
    assert json.loads(parsed.tool_calls[0].arguments) == {"s": "a\nb\tc"}


@pytest.mark.parametrize("family,text", MALFORMED)
def test_malformed_calls_stay_content(family, text):
    """A finished parse leaves them as content. Streamed, text never turns out lost: it goes
    out as content, or, when a call had started before the text proved malformed, the call
    stays as sent and a ToolCallsVoid carries the text (what a finished parse shows)."""
    parsed = get_tool_parser(family).parse(text, TOOLS)
    assert parsed.tool_calls == []
    assert parsed.content == text
    for cut in range(1, len(text)):
        events = _streamed(family, [text[:cut], text[cut:]])
        assert collect(events).content == text
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        voids = [e for e in events if isinstance(e, ToolCallsVoid)]
        started = [e.index for e in events if isinstance(e, ToolCallStart)]
        if started:
            assert [list(v.indices) for v in voids] == [started]
            assert content + voids[0].text == text
        else:
            assert content == text and not voids


def test_started_call_that_turns_out_malformed_is_kept_as_sent():
    stream = get_tool_parser("llama3_json").stream()
    events = stream.feed('{"name": "noop", "parameters": {"a": 1}}')
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgs]
    assert events[1].text == '{"a": 1}'
    assert stream.feed(" trailing words") == []
    (void,) = stream.finish()
    assert void == ToolCallsVoid((0,), '{"name": "noop", "parameters": {"a": 1}} trailing words')
    assert stream.saw_tool_calls  # the stream's finish_reason still says tool_calls


def test_content_streams_before_the_call_ends():
    """Text ahead of a call goes out before the call is complete."""
    stream = get_tool_parser("mistral").stream()
    assert stream.feed("Sure, checking") == [ContentDelta("Sure, checking")]
    assert stream.feed(" [TOOL_CA") == []  # a possible trigger is held
    events = stream.feed('LLS][{"name": "noop", "arguments": {}}]')
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgs]
    assert stream.finish() == []


def test_mistral_call_ids_are_nine_alphanumerics():
    parsed = get_tool_parser("mistral").parse('[TOOL_CALLS][{"name": "noop", "arguments": {}}]')
    (call,) = parsed.tool_calls
    assert len(call.id) == 9 and call.id.isalnum()
    other = get_tool_parser("hermes").parse(CASES[0][1]).tool_calls[0]
    assert other.id.startswith("call_")


def test_qwen3_coder_without_schema_keeps_strings():
    text = "<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n</function>\n</tool_call>"
    (call,) = get_tool_parser("qwen3_coder").parse(text).tool_calls
    assert json.loads(call.arguments) == {"n": "42"}
    typed = [{"name": "f", "parameters": {"properties": {"n": {"type": ["integer", "null"]}}}}]
    (call,) = get_tool_parser("qwen3_coder").parse(text, typed).tool_calls
    assert json.loads(call.arguments) == {"n": 42}


def test_pythonic_never_evaluates():
    """Only literals are read: a call or a name in an argument refuses the whole list."""
    for text in ("[f(a=g())]", "[f(a=x)]", "[f(1)]", "[f(**k)]", "[os.system(a=1)]"):
        assert get_tool_parser("pythonic").parse(text).tool_calls == [], text


@pytest.mark.parametrize(
    "source,family",
    [
        ("{% for t in tools %}<function={{ t.name }}>{% endfor %}", "qwen3_coder"),
        ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]", "mistral"),
        ("{{ '<|python_tag|>' + tool_call | tojson }}", "llama3_json"),
        ('"parameters": dictionary of argument name and its value', "llama3_json"),
        ("<|python_start|>{{ calls }}", "pythonic"),
        ("<tool_call>\n{{ call | tojson }}\n</tool_call>", "hermes"),
        ("{{ messages }}", "hermes"),
        (None, "hermes"),
    ],
)
def test_auto_detects_family_from_template(source, family):
    assert detect_tool_parser(source) == family
    assert get_tool_parser("auto", source).name == family


def test_unknown_parser_name_is_refused():
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        get_tool_parser("nope")


# -- generated outputs: every family, random arguments, random splits ------------------------
def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["str", "int", "float", "bool", "none"] + (["list", "dict"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return "".join(rng.choice("ab \"}]{[,:\\\\/é😀<>=()'") for _ in range(rng.randint(0, 8)))
    if kind == "int":
        return rng.randint(-999, 999)
    if kind == "float":
        return rng.choice([0.5, -2.25, 1e-3])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def _render(family: str, calls: list[tuple[str, dict]], rng: random.Random) -> tuple[str, list]:
    """An output writing `calls` in the family's syntax, and the arguments text each call's
    parse must give (JSON families: the object's own text; the others: json.dumps)."""
    seps = rng.choice([(", ", ": "), (",", ":")])
    raw = [json.dumps(a, ensure_ascii=False, separators=seps) for _, a in calls]
    dumped = [json.dumps(a, ensure_ascii=False) for _, a in calls]
    if family == "hermes":
        blocks = [
            f'<tool_call>\n{{"name": "{n}", "arguments": {r}}}\n</tool_call>'
            for (n, _), r in zip(calls, raw)
        ]
        return "Some text.\n" + "\n".join(blocks), raw
    if family == "llama3_json":
        objs = [f'{{"name": "{n}", "parameters": {r}}}' for (n, _), r in zip(calls, raw)]
        return "<|python_tag|>" + "; ".join(objs), raw
    if family == "mistral":
        if rng.random() < 0.5:
            objs = [f'{{"name": "{n}", "arguments": {r}}}' for (n, _), r in zip(calls, raw)]
            return "Ok. [TOOL_CALLS][" + ", ".join(objs) + "]", raw
        return "".join(f"[TOOL_CALLS]{n}[ARGS]{r}" for (n, _), r in zip(calls, raw)), raw
    if family == "pythonic":
        text = ", ".join(
            n + "(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in calls
        )
        return "[" + text + "]", dumped
    # qwen3_coder without a schema: every value is a string
    calls = [(n, {k: str(v) for k, v in a.items()}) for n, a in calls]
    blocks = [
        f"<tool_call>\n<function={n}>\n"
        + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>"
        for n, a in calls
    ]
    return "Hm.\n" + "\n".join(blocks), [json.dumps(a, ensure_ascii=False) for _, a in calls]


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic"])
def test_generated_calls_stream_as_they_parse(family):
    rng = random.Random(family)
    for _ in range(25):
        calls = [
            (f"fn_{j}", {f"p{i}": _random_value(rng) for i in range(rng.randint(0, 4))})
            for j in range(rng.randint(1, 3))
        ]
        if family == "qwen3_coder":  # values are text: no `<` inside
            calls = [
                (n, {k: v for k, v in a.items() if "<" not in str(v) and str(v).strip()})
                for n, a in calls
            ]
        text, expected = _render(family, calls, rng)
        whole = get_tool_parser(family).parse(text)
        assert [(c.name, c.arguments) for c in whole.tool_calls] == [
            (n, e) for (n, _), e in zip(calls, expected)
        ], text
        for _ in range(4):
            cuts = rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 20)))
            events = _streamed(family, _split_at(text, cuts))
            got = collect(events)
            assert got.content == whole.content
            streamed = _call_fragments(events)
            assert [(n, "".join(f)) for _, n, f in streamed.values()] == [
                (c.name, c.arguments) for c in whole.tool_calls
            ], (text, cuts)
