"""POST /v1/responses end to end over real Ray Serve and HTTP, through the official `openai`
client: whole and streamed answers (its raw events and its `responses.stream` helper, which
checks their order), structured output by text.format, a required tool call answered in a
second turn with function_call and function_call_output items, and the refusals of a server
that stores nothing."""

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

from tests.integration.test_openai_features import SCHEMA, serve_model  # noqa: E402

APP = "stepserve-responses"
MODEL = "tiny"
# Responses' flat function tool; bounded values: a random model's constrained output ends
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}


class Verdict(BaseModel):
    answer: Literal["yes", "no", "maybe"]
    confidence: int = Field(ge=0, le=100)


@pytest.fixture(scope="module")
def url(tiny_tools_dir, shared_serve):
    port = shared_serve.port
    base = shared_serve.url
    serve_model(tiny_tools_dir, APP, port)
    yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_whole_and_streamed_answers(client):
    r = client.responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input="Is the cache warm?",
        max_output_tokens=12,
        temperature=0,
        metadata={"run": "1"},
    )
    assert r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output[-1].type == "message" and isinstance(r.output_text, str)
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 5
    assert r.metadata == {"run": "1"} and r.instructions == "Answer briefly."
    if r.status == "incomplete":
        assert r.usage.output_tokens == 12
        assert r.incomplete_details.reason == "max_output_tokens"
    # the same request streamed: the raw events, then the client's stream helper
    events = list(
        client.responses.create(
            model=MODEL,
            instructions="Answer briefly.",
            input="Is the cache warm?",
            max_output_tokens=12,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{r.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == r.output_text  # greedy: the same
    with client.responses.stream(
        model=MODEL,
        instructions="Answer briefly.",
        input="Is the cache warm?",
        max_output_tokens=12,
        temperature=0,
    ) as stream:  # the helper accumulates the events, checking their order
        helper = list(stream)

    def skeleton(kinds):  # how many deltas a text arrives in varies with the engine's steps
        return [k for k in kinds if not k.endswith(".delta")]

    assert skeleton([e.type for e in helper]) == skeleton(kinds)
    if r.status == "completed":
        assert stream.get_final_response().output_text == r.output_text
    else:
        assert helper[-1].response.output_text == r.output_text


def test_text_format_json_schema_and_parse(client):
    fmt = {"type": "json_schema", "name": "verdict", "schema": SCHEMA, "strict": True}
    r = client.responses.create(
        model=MODEL,
        input="Is it warm?",
        text={"format": fmt},
        max_output_tokens=80,
        extra_body={"seed": 1},
    )
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"
    parsed = client.responses.parse(
        model=MODEL, input="Is it warm?", text_format=Verdict, max_output_tokens=80
    )
    assert isinstance(parsed.output_parsed, Verdict)
    with client.responses.stream(
        model=MODEL, input="Is it warm?", text_format=Verdict, max_output_tokens=80
    ) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == streamed and isinstance(final.output_parsed, Verdict)


def test_a_required_tool_call_then_its_result_in_a_second_turn(client):
    question = {"role": "user", "content": "Weather in Oslo?"}
    r = client.responses.create(
        model=MODEL,
        input=[question],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=120,
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and r.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # the second turn: the first answer's items as they came, then the tool's result
    history = [question, *(item.model_dump(exclude_none=True) for item in r.output)]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "-3 C"})
    r2 = client.responses.create(
        model=MODEL, input=history, tools=[WEATHER], max_output_tokens=8, temperature=0
    )
    assert r2.status in ("completed", "incomplete") and r2.output
    # streamed through the helper, the call arrives as a function_call item
    with client.responses.stream(
        model=MODEL,
        input=[question],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=120,
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    jsonschema.validate(json.loads(streamed.arguments), WEATHER["parameters"])


def test_what_a_stateless_server_refuses(client, url):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert info.value.body["param"] == "previous_response_id"
    assert "stores no responses" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="web_search"):
        client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.NotFoundError, match="stores no responses"):
        client.responses.retrieve("resp_123")
    r = httpx.post(
        f"{url}/v1/responses",
        json={"model": MODEL, "input": "hi", "frobnicate": 1},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
    r = httpx.post(
        f"{url}/v1/responses",
        json={"model": MODEL, "input": "hi", "max_output_tokens": 10**6},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens", r.text
