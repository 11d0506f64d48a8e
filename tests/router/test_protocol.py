"""The OpenAI protocol models: request validation and its messages, the mapping to
SamplingParams, and response shapes as the official `openai` client parses them."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from replica.request import SamplingParams
from router.protocol import (
    SSE_DONE,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamChunk,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChunk,
    DeltaMessage,
    ModelCard,
    ModelList,
    ResponseFormat,
    UsageInfo,
    error_body,
    sse_event,
    validation_error_body,
)

USER = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hello", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


def rejection(model: type, body: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_error_body(info.value.errors())["error"]


# --- requests -> SamplingParams ---------------------------------------------------------------


def test_completion_defaults_follow_openai() -> None:
    params = completion().to_sampling_params(default_max_tokens=1000)
    assert params == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0)


def test_completion_maps_every_sampling_field() -> None:
    request = completion(
        max_tokens=7,
        temperature=0.0,
        top_p=0.5,
        top_k=40,
        seed=3,
        stop="\n",
        stop_token_ids=[2, 5],
        ignore_eos=True,
        logprobs=5,
    )
    assert request.to_sampling_params(default_max_tokens=1000) == SamplingParams(
        max_tokens=7,
        temperature=0.0,
        top_p=0.5,
        top_k=40,
        seed=3,
        stop=["\n"],
        stop_token_ids=[2, 5],
        ignore_eos=True,
        logprobs=5,
    )


def test_null_max_tokens_takes_the_callers_default() -> None:
    assert completion(max_tokens=None).to_sampling_params(300).max_tokens == 300
    assert chat().to_sampling_params(300).max_tokens == 300


def test_chat_prefers_max_completion_tokens_over_max_tokens() -> None:
    assert chat(max_tokens=10, max_completion_tokens=20).to_sampling_params(300).max_tokens == 20
    assert chat(max_tokens=10).to_sampling_params(300).max_tokens == 10


def test_chat_logprobs_flag_and_top_logprobs_map_to_sampling_logprobs() -> None:
    assert chat().to_sampling_params(8).logprobs is None
    assert chat(logprobs=True).to_sampling_params(8).logprobs == 0
    assert chat(logprobs=True, top_logprobs=3).to_sampling_params(8).logprobs == 3


def test_null_means_default_for_non_nullable_fields() -> None:
    request = completion(temperature=None, top_p=None, n=None, stream=None)
    assert (request.temperature, request.top_p, request.n, request.stream) == (1.0, 1.0, 1, False)


def test_unknown_fields_are_refused_and_harmless_ones_accepted() -> None:
    request = completion(service_tier="auto", metadata={"a": 1}, frobnicate=True)
    assert request.ignored_fields == ["metadata", "service_tier"]
    assert request.unknown_fields == ["frobnicate"]
    assert completion().ignored_fields == [] and completion().unknown_fields == []


def test_sampling_controls_reach_sampling_params() -> None:
    params = completion(
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        min_p=0.1,
        min_tokens=2,
        logit_bias={"7": -100, "9": 2.5},
    ).to_sampling_params(16)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert (params.repetition_penalty, params.min_p, params.min_tokens) == (1.2, 0.1, 2)
    assert params.logit_bias == {7: -100, 9: 2.5}


def test_echo_asks_for_prompt_logprobs_and_max_tokens_zero_only_with_echo() -> None:
    params = completion(echo=True, logprobs=2, max_tokens=0).to_sampling_params(16)
    assert (params.max_tokens, params.prompt_logprobs, params.logprobs) == (1, 2, 2)
    assert completion(echo=True).to_sampling_params(16).prompt_logprobs is None
    error = rejection(CompletionRequest, {"prompt": "hi", "max_tokens": 0})
    assert "max_tokens must be >= 1, got 0" in error["message"] and error["param"] == "max_tokens"


def test_output_constraints_map_to_one_structured_output() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    spec = chat(response_format=fmt).to_sampling_params(8).structured
    assert spec.kind == "json" and json.loads(spec.spec) == schema
    assert chat(response_format={"type": "text"}).to_sampling_params(8).structured is None
    kinds = {
        "json_object": chat(response_format={"type": "json_object"}),
        "regex": chat(structured_outputs={"regex": "a+"}),
        "choice": chat(guided_choice=["a", "b"]),
        "grammar": completion(guided_grammar='root ::= "a"'),
    }
    for kind, request in kinds.items():
        assert request.to_sampling_params(8).structured.kind == kind
    with pytest.raises(ValueError, match="one output constraint at a time"):
        chat(response_format={"type": "json_object"}, guided_regex="a").to_sampling_params(8)


def test_tool_choice_modes_and_their_grammars() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    other = {"type": "function", "function": {"name": "g"}}
    assert chat().tool_mode == "none"
    assert chat(tools=[tool]).tool_mode == "auto"
    assert chat(tools=[tool]).to_sampling_params(8).structured is None  # auto: free text
    strict = {"type": "function", "function": {"name": "f", "strict": True}}
    assert chat(tools=[strict]).to_sampling_params(8).structured.kind == "tool_calls"
    named = chat(tools=[tool, other], tool_choice={"type": "function", "function": {"name": "g"}})
    plan = json.loads(named.to_sampling_params(8).structured.spec)
    assert named.tool_mode == "named" and [t["name"] for t in plan["tools"]] == ["g"]
    required = chat(tools=[tool, other], tool_choice="required", parallel_tool_calls=False)
    plan = json.loads(required.to_sampling_params(8).structured.spec)
    assert plan["mode"] == "required" and plan["parallel"] is False and len(plan["tools"]) == 2
    assert chat(tools=[tool], tool_choice="none").tool_mode == "none"
    with pytest.raises(ValueError, match="cannot be combined"):
        required.model_copy(
            update={"response_format": ResponseFormat(type="json_object")}
        ).to_sampling_params(8)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("abc", ["abc"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_prompt_forms_split_into_one_item_per_prompt(prompt: Any, expected: list[Any]) -> None:
    assert completion(prompt=prompt).prompts == expected


def test_chat_text_parts_join_for_the_template() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = chat(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]
    )
    assert request.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
    ]
    assert request.add_generation_prompt is True


def test_include_usage_only_with_stream_options() -> None:
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage
    assert not completion(stream=True).include_usage


# --- request validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"temperature": 3.5}, "temperature", "temperature must be in [0, 2], got 3.5"),
        ({"temperature": -0.1}, "temperature", "temperature must be in [0, 2], got -0.1"),
        ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k", "top_k must be -1, 0 (disabled) or >= 1, got -2"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
        ({"n": 0}, "n", "n must be in [1, 8], got 0"),
        ({"n": 9}, "n", "n must be in [1, 8], got 9"),
        ({"logprobs": 21}, "logprobs", "logprobs must be in [0, 20], got 21"),
        ({"prompt": ""}, "prompt", "prompt must not be empty"),
        ({"prompt": []}, "prompt", "prompt must not be empty"),
        ({"prompt": ["a", ""]}, "prompt", "prompt must not be empty"),
        ({"prompt": [[1], []]}, "prompt", "prompt must not be empty"),
        ({"prompt": [3, -1]}, "prompt", "prompt token ids must be >= 0, got -1"),
        ({"prompt": 5}, "prompt", "prompt must be a string, a list of strings"),
        ({"stop": ["a", ""]}, "stop", "stop sequences must not be empty strings"),
        ({"stop": [str(i) for i in range(17)]}, "stop", "at most 16 sequences, got 17"),
        ({"stop_token_ids": [-3]}, "stop_token_ids", "stop_token_ids must be >= 0, got -3"),
        ({"best_of": 3}, "best_of", "best_of must equal n (1), got 3"),
        ({"suffix": "x"}, "suffix", "suffix is not supported"),
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be in (0, 2]"),
        ({"min_p": 1.5}, "min_p", "min_p must be in [0, 1], got 1.5"),
        ({"min_tokens": -1}, "min_tokens", "min_tokens must be >= 0, got -1"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias", "keys must be token ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "logit_bias[5] must be in [-100, 100]"),
        ({"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs must be in [0, 20]"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format",
            "needs a json_schema object",
        ),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "Extra inputs"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
        ({"seed": 2**64}, "seed", "seed must be in [-9223372036854775808, 9223372036854775807]"),
    ],
)
def test_completion_rejections_name_field_limit_and_value(
    fields: dict[str, Any], param: str, message: str
) -> None:
    error = rejection(CompletionRequest, {"model": "m", "prompt": "hi", **fields})
    assert message in error["message"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error" and error["code"] == 400


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"messages": []}, "messages", "messages must not be empty"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0", "needs the tool_call_id"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'robot'"),
        ({"messages": [{"role": "user"}]}, "messages.0", "a user message needs content"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools.0.function.name",
            "function names are 1-64",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
            "only content parts of type 'text' are supported, got 'image_url'",
        ),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "must be >= 1, got 0"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "[0, 20], got 21"),
        ({"top_logprobs": 2}, "top_logprobs", "top_logprobs requires logprobs to be true"),
        ({"temperature": 2.5}, "temperature", "temperature must be in [0, 2], got 2.5"),
    ],
)
def test_chat_rejections_name_the_field(fields: dict[str, Any], param: str, message: str) -> None:
    error = rejection(ChatCompletionRequest, {"model": "m", "messages": USER, **fields})
    assert message in error["message"]
    assert error["param"] == param


def test_missing_messages_is_reported_as_a_missing_field() -> None:
    error = rejection(ChatCompletionRequest, {"model": "m"})
    assert error == {
        "message": "messages: Field required",
        "type": "invalid_request_error",
        "param": "messages",
        "code": 400,
    }


def test_fastapi_body_location_is_stripped_from_param() -> None:
    errors = [{"type": "float_parsing", "loc": ("body", "top_p"), "msg": "bad", "input": "x"}]
    assert validation_error_body(errors)["error"]["param"] == "top_p"
    assert validation_error_body(errors)["error"]["message"] == "top_p: bad, got 'x'"


@given(
    temperature=st.floats(-1, 3, allow_nan=False),
    top_p=st.floats(-0.5, 1.5, allow_nan=False),
    top_k=st.integers(-3, 100),
)
def test_protocol_accepts_exactly_what_sampling_params_accepts(
    temperature: float, top_p: float, top_k: int
) -> None:
    try:
        SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        engine_accepts = True
    except ValueError:
        engine_accepts = False
    try:
        request = completion(temperature=temperature, top_p=top_p, top_k=top_k)
        request.to_sampling_params(16)
        protocol_accepts = True
    except ValidationError:
        protocol_accepts = False
    assert protocol_accepts == engine_accepts


# --- responses as the openai client sees them ------------------------------------------------


def _completion_response() -> CompletionResponse:
    logprobs = CompletionLogprobs(
        tokens=[" a", " b"],
        token_logprobs=[-0.5, -math.inf],
        top_logprobs=[{" a": -0.5}, {" b": -math.inf}],
        text_offset=[0, 2],
    )
    return CompletionResponse(
        model="m",
        choices=[CompletionChoice(index=0, text=" a b", finish_reason="length", logprobs=logprobs)],
        usage=UsageInfo.of(3, 2),
    )


def _chat_response() -> ChatCompletionResponse:
    top = [ChatTopLogprob(token="hi", logprob=-0.1, bytes=[104, 105])]
    logprobs = ChatChoiceLogprobs(
        content=[ChatTokenLogprob(token="hi", logprob=-0.1, bytes=[104, 105], top_logprobs=top)]
    )
    return ChatCompletionResponse(
        model="m",
        choices=[
            ChatCompletionChoice(
                index=0,
                message=ChatResponseMessage(content="hi"),
                finish_reason="stop",
                logprobs=logprobs,
            )
        ],
        usage=UsageInfo.of(5, 1),
    )


def test_completion_response_parses_as_openai_completion() -> None:
    parsed = Completion.model_validate(json.loads(_completion_response().model_dump_json()))
    assert parsed.id.startswith("cmpl-") and parsed.object == "text_completion"
    assert parsed.choices[0].text == " a b" and parsed.choices[0].finish_reason == "length"
    assert parsed.choices[0].logprobs.token_logprobs == [-0.5, -9999.0]  # -inf is not JSON
    assert parsed.usage.total_tokens == 5


def test_chat_response_parses_as_openai_chat_completion() -> None:
    parsed = ChatCompletion.model_validate(json.loads(_chat_response().model_dump_json()))
    assert parsed.id.startswith("chatcmpl-") and parsed.object == "chat.completion"
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].message.content == "hi"
    assert parsed.choices[0].logprobs.content[0].top_logprobs[0].bytes == [104, 105]


def test_chat_stream_chunks_parse_as_openai_chunks() -> None:
    first = ChatCompletionStreamChunk(
        model="m",
        choices=[
            ChatCompletionStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))
        ],
    )
    last = ChatCompletionStreamChunk(
        id=first.id,
        model="m",
        choices=[
            ChatCompletionStreamChoice(
                index=0, delta=DeltaMessage(content="!"), finish_reason="stop"
            )
        ],
    )
    usage = ChatCompletionStreamChunk(id=first.id, model="m", usage=UsageInfo.of(2, 2))
    parsed = [ChatCompletionChunk.model_validate(c.model_dump()) for c in (first, last, usage)]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert parsed[1].choices[0].finish_reason == "stop"
    assert parsed[2].choices == [] and parsed[2].usage.completion_tokens == 2
    assert {p.object for p in parsed} == {"chat.completion.chunk"}


def test_model_card_parses_as_openai_model() -> None:
    card = ModelCard(id="smollm2", max_model_len=2048)
    parsed = Model.model_validate(ModelList(data=[card]).model_dump()["data"][0])
    assert (parsed.id, parsed.object, parsed.owned_by) == ("smollm2", "model", "stepserve")


def test_error_body_has_openai_shape() -> None:
    assert error_body("no such model 'x'", "not_found_error", 404, param="model") == {
        "error": {
            "message": "no such model 'x'",
            "type": "not_found_error",
            "param": "model",
            "code": 404,
        }
    }


def _client(handler: Any) -> openai.OpenAI:
    transport = httpx.MockTransport(handler)
    return openai.OpenAI(
        api_key="k",
        base_url="http://test/v1",
        http_client=httpx.Client(transport=transport),
        max_retries=0,
    )


def test_openai_client_reads_our_json_and_errors_end_to_end() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path.endswith("/completions") and "messages" not in body:
            try:
                CompletionRequest.model_validate(body)
            except ValidationError as exc:
                return httpx.Response(400, json=validation_error_body(exc.errors()))
            return httpx.Response(200, json=_completion_response().model_dump())
        return httpx.Response(200, json=_chat_response().model_dump())

    client = _client(handler)
    result = client.completions.create(model="m", prompt="hello", max_tokens=2)
    assert result.choices[0].text == " a b" and result.usage.prompt_tokens == 3
    reply = client.chat.completions.create(model="m", messages=USER)
    assert reply.choices[0].message.content == "hi"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="hello", temperature=3.5)
    assert info.value.status_code == 400
    assert info.value.message.endswith("temperature must be in [0, 2], got 3.5")
    assert info.value.body["message"] == "temperature must be in [0, 2], got 3.5"
    assert info.value.param == "temperature"


def test_openai_client_reads_our_sse_streams() -> None:
    chat_id = "chatcmpl-1"
    chat_events = [
        ChatCompletionStreamChunk(
            id=chat_id,
            model="m",
            choices=[
                ChatCompletionStreamChoice(
                    index=0, delta=DeltaMessage(role="assistant", content="")
                )
            ],
        ),
        ChatCompletionStreamChunk(
            id=chat_id,
            model="m",
            choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content="Hel"))],
        ),
        ChatCompletionStreamChunk(
            id=chat_id,
            model="m",
            choices=[
                ChatCompletionStreamChoice(
                    index=0, delta=DeltaMessage(content="lo"), finish_reason="length"
                )
            ],
        ),
        ChatCompletionStreamChunk(id=chat_id, model="m", usage=UsageInfo.of(4, 2)),
    ]
    text_events = [
        CompletionStreamChunk(
            id="cmpl-1", model="m", choices=[CompletionChoice(index=0, text="Hel")]
        ),
        CompletionStreamChunk(
            id="cmpl-1",
            model="m",
            choices=[CompletionChoice(index=0, text="lo", finish_reason="stop")],
        ),
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        events = chat_events if "messages" in json.loads(request.content) else text_events
        body = "".join(sse_event(e) for e in events) + SSE_DONE
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    client = _client(handler)
    chunks = list(
        client.chat.completions.create(
            model="m", messages=USER, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    assert chunks[2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.total_tokens == 6
    pieces = list(client.completions.create(model="m", prompt="x", stream=True))
    assert [p.choices[0].text for p in pieces] == ["Hel", "lo"]
    assert pieces[-1].choices[0].finish_reason == "stop"


def test_sse_events_escape_unicode_line_separators_so_line_splitters_keep_them_whole() -> None:
    text = "a\u2028b\x85c\u2029d\ne"
    chunk = CompletionStreamChunk(
        id="cmpl-1", created=1, model="m", choices=[CompletionChoice(index=0, text=text)]
    )
    event = sse_event(chunk)
    lines = event.splitlines()  # what httpx's aiter_lines (str.splitlines) would see
    assert lines[0].startswith("data: ") and lines[1:] == [""]
    assert json.loads(lines[0][len("data: ") :])["choices"][0]["text"] == text


def test_return_token_ids_puts_the_generated_ids_in_each_choice_and_chunk() -> None:
    from replica.request import RequestOutput
    from router.dialects import Choice, CompletionDialect
    from router.protocol import CompletionRequest, UsageInfo

    req = CompletionRequest.model_validate({"prompt": [1, 2], "return_token_ids": True})
    assert req.return_token_ids and not req.ignored_fields
    dialect = CompletionDialect(tokenizer=None, model_name="m")
    outs = [
        RequestOutput("r", [5, 6], "ab", 2, 2),
        RequestOutput("r", [7], "", 2, 3, finish_reason="length"),
    ]
    choice = Choice(0)
    for out in outs:
        choice.add(out)
    body = dialect.response(UsageInfo.of(2, 3), [choice], logprobs=False, token_ids=True)
    assert body.choices[0].token_ids == [5, 6, 7]
    assert Completion.model_validate(body.model_dump()).choices[0].text == "ab"
    plain = dialect.response(UsageInfo.of(2, 3), [choice], logprobs=False)
    assert plain.choices[0].token_ids is None
    stream = dialect.stream(token_ids=True)
    assert [stream.chunk(0, o, None).choices[0].token_ids for o in outs] == [[5, 6], [7]]
