"""Reasoning and tool-call parsers end to end over real Ray Serve and HTTP through the official
`openai` client: one app serving two tiny models, each with its own parsers. "thinker"
(deepseek_r1 reasoning, mistral tool calls; its template opens <think>) returns
reasoning_content and holds a JSON schema or a required tool call only after </think>;
"coder" (qwen3_coder calls picked by auto from its template; qwen3 reasoning turned off by
chat_template_kwargs) answers a named tool choice with XML calls parsed into tool_calls,
streamed and not."""

from __future__ import annotations

import json

import jsonschema
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from ray import serve  # noqa: E402

from cluster.app import build_app  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from router.lora_registry import kill_registry  # noqa: E402
from tests.parser_models import build_family_models  # noqa: E402

APP = "stepserve-parsers"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "maximum": 9}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def engine(model_dir, name: str, **parsers) -> dict:
    return {
        "model": str(model_dir),
        "served_model_name": name,
        "max_model_len": 1024,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "num_kv_blocks": 160,
        "block_size": 16,
        "engine_core": "thread",
        **parsers,
    }


@pytest.fixture(scope="module")
def dirs(tiny_tokenizer_dir, tmp_path_factory):
    return build_family_models(tiny_tokenizer_dir, tmp_path_factory.mktemp("parser-models"))


@pytest.fixture(scope="module")
def think_end(dirs) -> int:
    from transformers import AutoTokenizer

    (end,) = AutoTokenizer.from_pretrained(str(dirs["deepseek_r1"])).encode(
        "</think>", add_special_tokens=False
    )
    return end


@pytest.fixture(scope="module")
def client(dirs, shared_serve):
    port = shared_serve.port
    thinker = engine(
        dirs["deepseek_r1"], "thinker", reasoning_parser="deepseek_r1", tool_call_parser="mistral"
    )
    coder = engine(dirs["qwen3_coder"], "coder", reasoning_parser="qwen3")
    config = ClusterConfig.model_validate(
        {
            "name": APP,
            "models": [{"engine": thinker}, {"engine": coder}],
            "replicas": 1,
            "num_cpus_per_replica": 0.25,
            "http": {"host": "127.0.0.1", "port": port},
        }
    )
    base = shared_serve.url
    serve.run(build_app(config), name=APP, route_prefix="/")
    try:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=180)
    finally:
        kill_registry(APP)


def test_reasoning_then_schema(client, think_end):
    """The thinking comes back as reasoning_content, free; the content after it holds the
    schema (a logit bias on </think> makes the random model close its thinking)."""
    answer = client.chat.completions.create(
        model="thinker",
        messages=ASK,
        n=4,
        seed=5,
        temperature=1.0,
        max_tokens=120,
        logit_bias={str(think_end): 4},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
    )
    closed = [c for c in answer.choices if c.message.content]
    assert closed, [c.message for c in answer.choices]
    for choice in closed:
        thought = choice.message.model_extra.get("reasoning_content")
        assert thought is not None and "</think>" not in thought
        jsonschema.validate(json.loads(choice.message.content), ANSWER)
    assert any(c.message.model_extra.get("reasoning_content") for c in answer.choices)


def test_streamed_reasoning_then_required_mistral_call(client, think_end):
    stream = client.chat.completions.create(
        model="thinker",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        n=3,
        seed=11,
        temperature=1.0,
        max_tokens=150,
        logit_bias={str(think_end): 4},
        stream=True,
    )
    thoughts: dict[int, str] = {}
    calls: dict[int, dict] = {}
    finish = {}
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            thought = (delta.model_extra or {}).get("reasoning_content")
            if thought:
                assert choice.index not in calls  # thinking comes before the calls
                thoughts[choice.index] = thoughts.get(choice.index, "") + thought
            for call in delta.tool_calls or []:
                got = calls.setdefault(choice.index, {})
                if call.id:
                    got[call.index] = {"id": call.id, "name": call.function.name, "args": ""}
                else:
                    got[call.index]["args"] += call.function.arguments
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert thoughts and calls, (thoughts, finish)
    assert any(finish[index] == "tool_calls" for index in calls), finish
    for index, made in calls.items():
        if finish[index] == "length":
            continue  # cut mid-call: its start and first fragments went out as generated
        assert finish[index] == "tool_calls"
        for call in made.values():
            assert len(call["id"]) == 9 and call["id"].isalnum()  # Mistral's ids
            assert call["name"] == "get_weather"
            jsonschema.validate(json.loads(call["args"]), WEATHER["function"]["parameters"])
        assert "</think>" not in thoughts.get(index, "")


@pytest.mark.parametrize("stream", [False, True])
def test_named_qwen3_coder_call(client, stream):
    """auto picks qwen3_coder from the template; enable_thinking false closes the thinking in
    the prompt, so the grammar holds from the first token and nothing is reasoning."""
    args = dict(
        model="coder",
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        seed=3,
        max_tokens=120,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    if stream:
        name, arguments, content = None, "", ""
        for chunk in client.chat.completions.create(stream=True, **args):
            delta = chunk.choices[0].delta
            assert not (delta.model_extra or {}).get("reasoning_content")
            content += delta.content or ""
            for call in delta.tool_calls or []:
                name = call.function.name or name
                arguments += call.function.arguments or ""
        assert content == ""
    else:
        message = client.chat.completions.create(**args).choices[0].message
        assert message.content is None and message.model_extra.get("reasoning_content") is None
        (call,) = message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
