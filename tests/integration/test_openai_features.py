"""What OpenAI clients expect, end to end over real Ray Serve and HTTP: structured outputs,
tool calls (streamed and not), sampling controls, echo, /tokenize; through the official `openai`
client and through LangChain, on the tiny test checkpoint (whose chat template renders tools)
and on the default model (whose template has no tools: the system-message fallback)."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from ray import serve  # noqa: E402

from cluster.app import build_app  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402

APP = "stepserve-openai-features"
MODEL = "tiny"

# bounded values: a random model's constrained output always ends
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIMER = {
    "type": "function",
    "function": {
        "name": "set_timer",
        "parameters": {
            "type": "object",
            "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 60}},
            "required": ["minutes"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        "flag": {"type": "boolean"},
    },
    "required": ["answer", "confidence", "flag"],
    "additionalProperties": False,
}


class Verdict(BaseModel):
    """A verdict with a confidence."""

    answer: Literal["yes", "no", "maybe"]
    confidence: int = Field(ge=0, le=100)


def serve_model(model_dir, name: str, port: int, route_prefix: str = "/"):
    config = ClusterConfig.model_validate(
        {
            "name": name,
            "engine": {
                "model": str(model_dir),
                "served_model_name": MODEL,
                "max_model_len": 1024,
                "max_num_seqs": 8,
                "max_num_batched_tokens": 256,
                "num_kv_blocks": 256,
                "block_size": 16,
            },
            "replicas": 1,
            "num_cpus_per_replica": 0.5,
            "http": {"host": "127.0.0.1", "port": port},
        }
    )
    serve.run(build_app(config), name=name, route_prefix=route_prefix)


@pytest.fixture(scope="module")
def url(tiny_tools_dir, shared_serve):
    port = shared_serve.port
    base = shared_serve.url
    serve_model(tiny_tools_dir, APP, port)
    yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, **kwargs):
    kwargs.setdefault("model", MODEL)
    kwargs.setdefault("messages", [{"role": "user", "content": "Is the cache warm?"}])
    return client.chat.completions.create(**kwargs)


# -- structured outputs -------------------------------------------------------------------------
def test_json_schema_response_format_validates_streamed_and_not(client):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True},
    }
    for seed in range(3):
        r = chat(client, response_format=response_format, max_tokens=80, temperature=1, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = chat(client, response_format=response_format, max_tokens=80, stream=True, seed=7)
    text, reasons = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_vllm_constraints_on_both_endpoints(client):
    r = chat(client, response_format={"type": "json_object"}, max_tokens=60, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = chat(client, extra_body={"structured_outputs": {"choice": ["up", "down"]}}, max_tokens=8)
    assert r.choices[0].message.content in ("up", "down")
    r = chat(client, extra_body={"guided_regex": r"\d{3}-[a-z]{2}"}, max_tokens=12)
    assert r.choices[0].finish_reason == "stop"
    import re

    assert re.fullmatch(r"\d{3}-[a-z]{2}", r.choices[0].message.content)
    c = client.completions.create(
        model=MODEL,
        prompt="Answer:",
        max_tokens=80,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
    )
    assert c.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMA)
    c = client.completions.create(
        model=MODEL, prompt="Say:", max_tokens=10, extra_body={"guided_grammar": 'root ::= "ok"'}
    )
    assert c.choices[0].text == "ok"


def test_constraints_that_cannot_compile_are_400s_naming_the_problem(client):
    """A replica compiles the constraint and rejects it; the ingress answers 400 naming the
    request's field, streamed or not, remembers the spec (its next request is refused before
    routing) and never imports the grammar engine itself."""
    ingress = serve.get_deployment_handle("Ingress", app_name=APP)
    remembered = ingress.stats.remote().result(timeout_s=30)["rejected_specs"]
    bad = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "nope"}},
                }
            },
            "nope",
            "response_format",
        ),
        ({"extra_body": {"guided_regex": "a(b"}}, "parenthesis", "guided_regex"),
        (
            {"extra_body": {"structured_outputs": {"grammar": "root ::= x"}}},
            "x",
            "structured_outputs",
        ),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}},
            "one output constraint",
            None,
        ),
    ]
    for i, (kwargs, needle, param) in enumerate(bad):
        # the first call reaches a replica (streamed for every other case); the second is
        # refused from the ingress's memory
        for stream in (True, False) if i % 2 == 0 else (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                chat(client, max_tokens=5, stream=stream, **kwargs)
            error = info.value.body
            assert needle in error["message"], error
            if param:
                assert error["param"] == param
    stats = ingress.stats.remote().result(timeout_s=30)
    assert stats["rejected_specs"] == remembered + 3  # the three that reached a replica
    assert not stats["grammar_engine_loaded"]


# -- tools --------------------------------------------------------------------------------------
def test_named_and_required_tool_choice_always_parse(client):
    for choice, parallel in [
        ({"type": "function", "function": {"name": "set_timer"}}, False),
        ("required", True),
        ("required", False),
    ]:
        for seed in range(2):
            r = chat(
                client,
                tools=[WEATHER, TIMER],
                tool_choice=choice,
                parallel_tool_calls=parallel,
                max_tokens=150,
                temperature=1,
                seed=seed,
            )
            c = r.choices[0]
            named = isinstance(choice, dict)
            calls = c.message.tool_calls
            if not (parallel and c.finish_reason == "length"):  # may go on calling till the end
                assert c.finish_reason == ("stop" if named else "tool_calls")
            assert calls and (parallel or len(calls) == 1)
            for call in calls:
                assert call.id.startswith("call_") and call.type == "function"
                tool = {"get_weather": WEATHER, "set_timer": TIMER}[call.function.name]
                if named:
                    assert call.function.name == "set_timer"
                args = json.loads(call.function.arguments)
                jsonschema.validate(args, tool["function"]["parameters"])


def test_streamed_tool_calls_in_openai_shape(client, url):
    stream = chat(
        client,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        stream=True,
        stream_options={"include_usage": True},
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.id:
                    call["id"] = delta.id
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert calls and all(c["name"] == "get_weather" for c in calls.values())
    for call in calls.values():
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])


def test_tool_results_in_the_history(client):
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Oslo", "unit": "C"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": -3}'},
    ]
    r = chat(client, messages=messages, tools=[WEATHER], max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # tool_choice none: the tools are not offered and nothing is parsed as a call
    r = chat(client, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert not r.choices[0].message.tool_calls


def test_tool_choice_errors(client):
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        chat(client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice requires tools"):
        chat(client, tool_choice="required")


# -- sampling controls, echo, unknown fields ----------------------------------------------------
def test_sampling_controls_over_http(client, url):
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": " fox"}, timeout=30).json()["tokens"]
    forced = tokens[-1]
    c = client.completions.create(
        model=MODEL, prompt="The", max_tokens=4, temperature=1, logit_bias={str(forced): 100}
    )
    ids = httpx.post(
        f"{url}/tokenize",
        json={"prompt": c.choices[0].text, "add_special_tokens": False},
        timeout=30,
    ).json()["tokens"]
    assert set(ids) == {forced}
    base = dict(model=MODEL, prompt="The cache blocks", max_tokens=24, temperature=0)
    plain = client.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    penalized = (
        client.completions.create(
            **base, extra_body={"ignore_eos": True, "repetition_penalty": 1.3}
        )
        .choices[0]
        .text
    )
    assert penalized != plain  # greedy output changes under the penalty
    for field, value in [("presence_penalty", 1.5), ("frequency_penalty", 1.0)]:
        client.completions.create(**base, **{field: value})  # accepted
    client.completions.create(**base, extra_body={"min_p": 0.2, "min_tokens": 3})


def test_echo_with_prompt_logprobs_and_max_tokens_zero(client):
    prompt = "The quick brown fox"
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice = c.choices[0]
    assert choice.text == prompt
    lps = choice.logprobs
    assert lps.token_logprobs[0] is None and all(v <= 0 for v in lps.token_logprobs[1:])
    assert "".join(lps.tokens) == prompt and c.usage.completion_tokens == 0
    c2 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=2)
    assert c2.choices[0].text.startswith(prompt)
    assert (
        c2.choices[0].logprobs.token_logprobs[: len(lps.tokens)]
        == pytest.approx(lps.token_logprobs[:1] + lps.token_logprobs[1:], abs=1e-4)
        or c2.choices[0].logprobs.token_logprobs[0] is None
    )
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, echo=True, stream=True
    )
    assert "".join(ch.choices[0].text for ch in stream if ch.choices).startswith(prompt)


def test_unknown_fields_are_refused_and_harmless_ones_accepted(url):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    r = httpx.post(f"{url}/v1/completions", json={**body, "frobnicate": 1}, timeout=30)
    assert r.status_code == 400
    assert (
        "frobnicate" in r.json()["error"]["message"] and r.json()["error"]["param"] == "frobnicate"
    )
    r = httpx.post(
        f"{url}/v1/completions", json={**body, "store": False, "metadata": {}}, timeout=30
    )
    assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/v1/completions", json={**body, "best_of": 3}, timeout=30)
    assert r.status_code == 400 and "best_of" in r.text


def test_tokenize_and_detokenize(url):
    r = httpx.post(f"{url}/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) == len(body["token_strs"])
    back = httpx.post(f"{url}/detokenize", json={"tokens": body["tokens"]}).json()
    assert back["prompt"] == "hello world"
    chat_ids = httpx.post(
        f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    assert chat_ids["count"] > 2
    r = httpx.post(f"{url}/detokenize", json={"tokens": [10**7]})
    assert r.status_code == 400 and "outside the vocabulary" in r.text


# -- LangChain ----------------------------------------------------------------------------------
def langchain_model(url):
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(
        base_url=f"{url}/v1",
        api_key="unused",
        model=MODEL,
        max_retries=0,
        timeout=120,
        temperature=0,
        max_tokens=150,
    )


def test_langchain_structured_output_both_methods(url):
    model = langchain_model(url)
    for method in ("json_schema", "function_calling"):
        result = model.with_structured_output(Verdict, method=method).invoke("Is it warm?")
        assert isinstance(result, Verdict), (method, result)


def test_langchain_bind_tools_streamed_and_not(url):
    model = langchain_model(url)
    bound = model.bind_tools([WEATHER, TIMER], tool_choice="get_weather")
    message = bound.invoke("Weather in Lima?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER["function"]["parameters"])
    required = model.bind_tools([WEATHER, TIMER], tool_choice="any")
    merged = None
    for chunk in required.stream("Set a timer"):
        merged = chunk if merged is None else merged + chunk
    assert merged.tool_calls and all(
        c["name"] in ("get_weather", "set_timer") for c in merged.tool_calls
    )


# -- the default model: tools through the system-message fallback --------------------------------
@pytest.fixture(scope="module")
def default_url(url):
    """The default model as a second application on the same Serve instance, under /default."""
    from replica.default_model import default_model_dir

    name = APP + "-default"
    port = int(url.rsplit(":", 1)[1])
    serve_model(default_model_dir(), name, port, route_prefix="/default")
    yield f"{url}/default"
    serve.delete(name)


def test_default_model_tools_and_structured_output(default_url):
    client = openai.OpenAI(
        base_url=f"{default_url}/v1", api_key="unused", max_retries=0, timeout=300
    )
    r = chat(
        client,
        messages=[{"role": "user", "content": "What is the weather in Paris, in C?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    c = r.choices[0]
    assert (
        c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_weather"
    )
    jsonschema.validate(
        json.loads(c.message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"]
    )
    model = langchain_model(default_url)
    verdict = model.with_structured_output(Verdict, method="json_schema").invoke(
        "Is the sky blue? Answer with a verdict and a confidence."
    )
    assert isinstance(verdict, Verdict)
