"""POST /v1/responses without Ray: a Responses request's conversion to the chat request it runs
as (every input item kind, the refusals naming their field), and the chat answer re-shaped as
Responses (whole and streamed), each shape checked by parsing it with the official `openai`
client's own types (and its stream accumulator, which checks the events' order)."""

from __future__ import annotations

import json
import types

import pytest

openai = pytest.importorskip("openai")
from openai.lib.streaming.responses._responses import ResponseStreamState  # noqa: E402
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from replica.api import RequestOutput, RequestRejected  # noqa: E402
from router.dialects import ChatDialect  # noqa: E402
from router.errors import HTTPError  # noqa: E402
from router.protocol import (  # noqa: E402
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamChunk,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    UsageInfo,
)
from router.protocol.responses_api import ResponsesRequest, responses_param  # noqa: E402
from router.responses_api import ResponsesDialect, renamed  # noqa: E402

EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


class CharTokenizer:
    """One token per character: enough for usage's reasoning_tokens."""

    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def request(**body) -> ResponsesRequest:
    body.setdefault("input", "hi")
    return ResponsesRequest.model_validate(body)


def refused(body: dict) -> RequestRejected:
    req = request(**body)
    with pytest.raises(RequestRejected) as info:
        req.chat_request()
    return info.value


# -- the request ------------------------------------------------------------------------------
def test_a_string_input_with_instructions_is_a_system_then_a_user_message():
    chat = request(input="Hello", instructions="Be brief", model="tiny").chat_request()
    assert chat.template_messages() == [
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": "Hello"},
    ]
    assert chat.model == "tiny" and chat.n == 1 and not chat.stream


def test_every_input_item_kind_converts_to_chat_messages():
    items = [
        {"role": "developer", "content": "Rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": []},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "call_2",
            "output": [{"type": "input_text", "text": "rain"}],
        },
        {"role": "user", "content": "Thanks"},
    ]
    chat = request(input=items, tools=[WEATHER]).chat_request()
    messages = chat.template_messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "user"]
    assistant = messages[2]
    assert assistant["content"] == "Let me look."  # the reasoning item is dropped
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_1", "call_2"]
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{}"}
    assert messages[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert messages[4]["content"] == "rain"
    # a function call with no assistant message before it is an assistant message of its own
    alone = request(
        input=[
            {"role": "user", "content": "x"},
            {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": ""},
            {"type": "function_call_output", "call_id": "c", "output": "ok"},
        ],
        tools=[WEATHER],
    ).chat_request()
    assert alone.template_messages()[1]["content"] is None


def test_tools_tool_choice_text_format_and_sampling_map_to_the_chat_fields():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = request(
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=33,
        temperature=0.5,
        top_p=0.9,
        stream=True,
        user="u",
        seed=7,
        priority=-1,
        top_k=5,
    ).chat_request()
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.strict
    assert chat.tool_mode == "named" and chat.parallel_tool_calls is False
    assert chat.max_completion_tokens == 33 and chat.temperature == 0.5 and chat.top_p == 0.9
    assert chat.stream and chat.include_usage  # the final event carries usage
    assert (chat.seed, chat.priority, chat.top_k, chat.user) == (7, -1, 5, "u")
    fmt = {"type": "json_schema", "name": "v", "schema": schema, "strict": True}
    chat = request(text={"format": fmt}).chat_request()
    assert chat.response_format.json_schema.schema_ == schema
    assert chat.structured_output().kind == "json"
    assert request(
        text={"format": {"type": "json_object"}}
    ).chat_request().response_format.type == ("json_object")
    assert request(text={"format": {"type": "text"}}).chat_request().response_format is None
    assert request(tool_choice="required", tools=[WEATHER]).chat_request().tool_mode == "required"


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
        ({"conversation": "conv_1"}, "conversation", "stores no conversations"),
        ({"background": True}, "background", "background"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "reasoning.encrypted_content"),
        ({"truncation": "auto"}, "truncation", "disabled"),
        ({"top_logprobs": 3}, "top_logprobs", "top_logprobs"),
        ({"reasoning": {"effort": "low", "bogus": 1}}, "reasoning.bogus", "bogus"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "'web_search'"),
        ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type", "file_"),
        ({"tools": [{"type": "function"}]}, "tools[0].name", "non-empty string"),
        ({"tools": [dict(WEATHER, extra=1)]}, "tools[0].extra", "unknown field 'extra'"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web_search_preview"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type", "'grammar'"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", ""),
        ({"text": {"verbosity": "low"}}, "text.verbosity", "verbosity"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "'tool'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
            "'input_image'",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "stores no"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type", "'web_search_call'"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id", "call_id"),
        ({"input": "x", "instructions": "only"} | {"input": []}, "input", ""),
    ],
)
def test_what_cannot_be_served_is_refused_naming_the_field(body, param, needle):
    err = refused(body)
    assert err.param == param and needle in str(err), str(err)


def test_unknown_and_ignored_fields():
    req = request(frobnicate=1, service_tier="auto", seed=3)
    assert req.unknown_fields == ["frobnicate"] and req.ignored_fields == ["service_tier"]
    assert (
        request(store=True, metadata={"k": "v"}, reasoning={"effort": "high"}).unknown_fields == []
    )


def test_chat_side_errors_name_the_responses_fields():
    assert responses_param("max_tokens") == "max_output_tokens"
    assert responses_param("messages.2.content") == "input"
    assert responses_param("tools.0.function.name") == "tools[0].name"
    assert responses_param("response_format") == "text.format"
    err = renamed(HTTPError(400, "max_tokens=9 exceeds this server's cap", "x", "max_tokens"))
    assert err.param == "max_output_tokens" and err.message.startswith("max_output_tokens=9")
    chat = request(text={"format": {"type": "json_object"}}).chat_request()
    assert chat.request_field("structured") == "text.format"
    assert chat.request_field("max_tokens") == "max_output_tokens"
    tools = request(tools=[WEATHER], tool_choice="required").chat_request()
    assert tools.request_field("structured") == "tools"
    with pytest.raises(Exception, match="tool_choice names function"):
        request(tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}).chat_request()


# -- the whole answer -------------------------------------------------------------------------
def dialect(**body) -> ResponsesDialect:
    return ResponsesDialect(ChatDialect(CharTokenizer(), "tiny"), request(**body))


def chat_answer(message: ChatResponseMessage, finish="stop") -> ChatCompletionResponse:
    return ChatCompletionResponse(
        model="tiny",
        usage=UsageInfo.of(10, 7),
        choices=[ChatCompletionChoice(index=0, message=message, finish_reason=finish)],
    )


def test_reasoning_text_and_calls_become_output_items_in_order():
    message = ChatResponseMessage(
        reasoning_content="think",
        content="Calling.",
        tool_calls=[
            ToolCall(id="call_a", function=FunctionCall(name="get_weather", arguments='{"c":1}'))
        ],
    )
    body = dialect(tools=[WEATHER], metadata={"k": "v"}).from_chat(chat_answer(message))
    r = Response.model_validate(body)
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == "think" and r.output[0].summary == []
    assert r.output_text == "Calling."
    call = r.output[2]
    assert (call.call_id, call.name, call.arguments) == ("call_a", "get_weather", '{"c":1}')
    assert r.id.startswith("resp_") and r.status == "completed" and r.object == "response"
    assert r.usage.input_tokens == 10 and r.usage.output_tokens == 7
    assert r.usage.total_tokens == 17 and r.usage.output_tokens_details.reasoning_tokens == 5
    assert r.metadata == {"k": "v"} and r.tools[0].name == "get_weather" and not r.store
    assert r.text.format.type == "text" and r.tool_choice == "auto"


def test_only_calls_no_message_and_length_is_incomplete():
    calls = [ToolCall(id="c", function=FunctionCall(name="f", arguments="{}"))]
    r = Response.model_validate(
        dialect().from_chat(chat_answer(ChatResponseMessage(content=None, tool_calls=calls)))
    )
    assert [item.type for item in r.output] == ["function_call"]
    r = Response.model_validate(
        dialect().from_chat(chat_answer(ChatResponseMessage(content="cut"), finish="length"))
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"
    r = Response.model_validate(dialect().from_chat(chat_answer(ChatResponseMessage(content=""))))
    assert [item.type for item in r.output] == ["message"] and r.output_text == ""


def test_the_chat_dialect_runs_under_the_wrapper():
    from router.dialects import Choice

    choice = Choice(0)
    choice.add(
        RequestOutput(
            "r",
            [1, 2],
            'x<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
            4,
            2,
            finish_reason="stop",
        )
    )
    body = dialect(tools=[WEATHER]).response(
        UsageInfo.of(4, 2), [choice], logprobs=False, tool_mode="auto"
    )
    r = Response.model_validate(body.model_dump())
    assert [item.type for item in r.output] == ["message", "function_call"]
    assert r.output[1].name == "get_weather" and r.output[1].call_id.startswith("call_")


# -- the stream -------------------------------------------------------------------------------
def parse_sse(text: str) -> list[dict]:
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        events.append(data)
    return events


def check_stream(text: str, tools=()) -> tuple[list, object]:
    """The events, validated one by one by the client's types and through the stream helper's
    accumulator (which raises on events out of order); the final response."""
    events = [EVENTS.validate_python(e) for e in parse_sse(text)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    state = ResponseStreamState(input_tools=list(tools), text_format=openai.omit)
    for event in events:
        state.handle_event(event)
    return events, events[-1].response


def chunk(delta: DeltaMessage | None = None, finish=None, usage=None):
    choices = (
        []
        if delta is None
        else [ChatCompletionStreamChoice(index=0, delta=delta, finish_reason=finish)]
    )
    return ChatCompletionStreamChunk(model="tiny", choices=choices, usage=usage)


def test_reasoning_text_and_calls_stream_as_typed_events_in_order():
    d = dialect(tools=[WEATHER])
    stream = d.stream(tool_mode="auto")
    call = DeltaToolCall(
        index=0, id="call_a", type="function", function=DeltaFunctionCall(name="get_weather")
    )
    text = stream.preamble([0]) + stream.render(
        [
            chunk(DeltaMessage(reasoning_content="thi")),
            chunk(DeltaMessage(reasoning_content="nk")),
            chunk(DeltaMessage(content="Hel")),
            chunk(DeltaMessage(content="lo")),
            chunk(DeltaMessage(tool_calls=[call])),
            chunk(
                DeltaMessage(
                    tool_calls=[
                        DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"city": '))
                    ]
                )
            ),
            chunk(
                DeltaMessage(
                    tool_calls=[
                        DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='"Oslo"}'))
                    ]
                ),
                finish="tool_calls",
            ),
            chunk(usage=UsageInfo.of(3, 9)),
        ]
    )
    assert stream.end() == ""
    events, final = check_stream(text, [WEATHER])
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert final.status == "completed" and final.output_text == "Hello"
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "think"
    assert final.output[2].arguments == '{"city": "Oslo"}' and final.output[2].call_id == "call_a"
    assert final.usage.output_tokens_details.reasoning_tokens == 5
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1


def test_a_stream_cut_at_max_output_tokens_ends_incomplete():
    stream = dialect(max_output_tokens=2).stream()
    text = stream.preamble([0]) + stream.render(
        [chunk(DeltaMessage(content="ab"), finish="length"), chunk(usage=UsageInfo.of(3, 2))]
    )
    events, final = check_stream(text)
    assert events[-1].type == "response.incomplete" and final.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete" and final.max_output_tokens == 2


def test_an_empty_answer_still_streams_its_message():
    stream = dialect().stream()
    text = stream.preamble([0]) + stream.render(
        [chunk(DeltaMessage(content=""), finish="stop"), chunk(usage=UsageInfo.of(3, 1))]
    )
    events, final = check_stream(text)
    assert final.output_text == "" and [i.type for i in final.output] == ["message"]


def test_chat_stream_chunks_from_engine_deltas_translate_end_to_end():
    """The chat stream's own chunks (its tool-call parser included) through the wrapper."""
    stream = dialect(tools=[WEATHER]).stream(tool_mode="required")
    outs = [
        RequestOutput("r", [1], "<tool_call>\n", 4, 1),
        RequestOutput("r", [2], '{"name": "get_weather", "arguments": {"city": "Lima"}}', 4, 2),
        RequestOutput("r", [3], "\n</tool_call>", 4, 3, finish_reason="stop"),
    ]
    text = stream.preamble([0])
    for out in outs:
        text += stream.render(stream.chunks(0, out, None))
    text += stream.render([stream.usage(UsageInfo.of(4, 3))])
    events, final = check_stream(text, [WEATHER])
    assert [i.type for i in final.output] == ["function_call"]
    assert json.loads(final.output[0].arguments) == {"city": "Lima"}


def test_streamed_call_arguments_arrive_as_several_delta_events():
    """The chat stream sends a call's arguments as they are generated: the Responses stream
    carries them as several function_call_arguments.delta events that add up to the
    arguments."""
    stream = dialect(tools=[WEATHER]).stream(tool_mode="auto")
    body = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "days": 3}}\n</tool_call>'
    pieces = [body[i : i + 6] for i in range(0, len(body), 6)]
    text = stream.preamble([0])
    for n, piece in enumerate(pieces, 1):
        finish = "stop" if n == len(pieces) else None
        out = RequestOutput("r", [n], piece, 4, n, finish_reason=finish)
        text += stream.render(stream.chunks(0, out, None))
    text += stream.render([stream.usage(UsageInfo.of(4, len(pieces)))])
    events, final = check_stream(text, [WEATHER])
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 3
    assert "".join(deltas) == '{"city": "Lima", "days": 3}' == final.output[0].arguments
    assert [i.type for i in final.output] == ["function_call"]


def test_a_failure_mid_stream_is_an_error_event_then_response_failed():
    stream = dialect().stream()
    text = stream.preamble([0]) + stream.render([chunk(DeltaMessage(content="a"))])
    err = types.SimpleNamespace(status=503, message="replica lost", type="service_unavailable")
    text += stream.failure(err)
    events = [EVENTS.validate_python(e) for e in parse_sse(text)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-2].type == "error" and events[-2].message == "replica lost"
    assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
    assert events[-1].response.error.message == "replica lost"


# -- through the ingress's stream (router/streaming.py's Answers) --------------------------------
class FakeCalls:
    """Replica calls that send `outs` for choice 0, then fail when `fail` is set."""

    def __init__(self, outs, fail: bool = False) -> None:
        self.outs, self.fail = outs, fail

    async def fan_out(self, jobs):
        for out in self.outs:
            yield 0, out
        if self.fail:
            raise RuntimeError("the replica broke")


def answer_stream(calls, **body) -> str:
    import asyncio

    from replica.api import EngineRequest, SamplingParams
    from router.admission import Admission
    from router.streaming import Answers, Ticket

    body.setdefault("stream", True)
    req = request(**body).chat_request()
    answers = Answers(calls, Admission(), keepalive_s=30)
    ticket = Ticket(types.SimpleNamespace(release=lambda: None), deadline_s=60)
    answers.admission.enter(ticket.key)
    jobs = [(0, EngineRequest([1, 2, 3], SamplingParams(max_tokens=8), request_id=""))]
    wrapped = ResponsesDialect(ChatDialect(CharTokenizer(), "tiny"), req.source)

    async def run() -> str:
        return "".join([e async for e in answers.stream(jobs, wrapped, req, ticket)])

    return asyncio.run(run())


def test_the_ingress_stream_sends_responses_events_and_no_done():
    outs = [
        RequestOutput("r", [1], "Hel", 3, 1),
        RequestOutput("r", [2, 3], "lo", 3, 3, finish_reason="stop"),
    ]
    text = answer_stream(FakeCalls(outs))
    assert "[DONE]" not in text
    events, final = check_stream(text)
    assert final.output_text == "Hello" and final.status == "completed"
    assert final.usage.input_tokens == 3 and final.usage.output_tokens == 3


def test_a_replica_failure_mid_stream_ends_with_response_failed():
    text = answer_stream(FakeCalls([RequestOutput("r", [1], "Hel", 3, 1)], fail=True))
    events = [EVENTS.validate_python(e) for e in parse_sse(text)]
    assert [e.type for e in events][-3:] == ["response.output_text.delta", "error",
                                             "response.failed"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "[DONE]" not in text and events[-1].response.error.message
