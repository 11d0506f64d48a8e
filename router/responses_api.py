"""POST /v1/responses (OpenAI's Responses API, stateless) on the chat path: the request runs as
a chat request (router/protocol/responses_api.py converts it) through the ingress's whole
pipeline, and its chat answer is re-shaped here: the whole answer from the ChatCompletionResponse
(`ResponsesDialect.response`), a stream from the chat stream's chunks (`ResponsesStream`:
Responses' typed SSE events, each with its sequence_number)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import RootModel, ValidationError

from replica.api import RequestRejected
from router.dialects import Dialect, StreamShape
from router.errors import HTTPError, bad_request, invalid_request
from router.protocol import (
    ChatCompletionResponse,
    ChatCompletionStreamChunk,
    UsageInfo,
    validation_error_body,
)
from router.protocol.responses_api import ResponsesRequest, responses_param


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBody(RootModel[dict[str, Any]]):
    """A Responses API object as the JSON dict it is sent as (Answers.answer dumps it)."""


# -- the endpoint: reading a Responses request as a chat request ------------------------------
class ResponsesEndpoint:
    """What IngressCore.serve_request takes for /v1/responses: how to read the body (as the
    chat request it runs as) and how to wrap the chat dialect that shapes its answer."""

    async def read(self, core, request) -> Any:
        data = await core.guard.read_json(request)
        try:
            req = ResponsesRequest.model_validate(data)
        except ValidationError as exc:
            raise invalid_request(exc.errors()) from None
        core.refuse_unknown(req.unknown_fields)
        if req.ignored_fields:
            core.warn_ignored(req.ignored_fields)
        try:
            chat = req.chat_request()
        except RequestRejected as exc:
            raise bad_request(str(exc), exc.param) from None
        except ValidationError as exc:  # the chat request's own checks
            detail = validation_error_body(exc.errors())["error"]
            raise bad_request(detail["message"], responses_param(detail["param"])) from None
        return chat

    def dialect(self, dialect: Dialect, req) -> Dialect:
        return ResponsesDialect(dialect, req.source)


def renamed(err: HTTPError) -> HTTPError:
    """An error of the chat path, naming the Responses field (max_output_tokens, not
    max_tokens)."""
    param = responses_param(err.param)
    if param != err.param and err.param:
        err.message = err.message.replace(err.param, param)
        err.param = param
    return err


async def serve_responses(core, request) -> Any:
    """POST /v1/responses: the chat pipeline (IngressCore.serve_request) with this endpoint."""
    try:
        return await core.serve_request(request, True, RESPONSES)
    except HTTPError as err:
        raise renamed(err) from None


async def retrieve_response(core, request, response_id: str) -> Any:
    """GET /v1/responses/{id}: nothing is stored, so every id is unknown."""
    core.guard.check_auth(request)
    raise HTTPError(
        404,
        f"No response with id {response_id!r}: this server stores no responses (/v1/responses "
        "is stateless; store is ignored)",
        "not_found_error",
        param="response_id",
    )


RESPONSES = ResponsesEndpoint()


# -- the answer's shapes ----------------------------------------------------------------------
def response_object(
    req: ResponsesRequest,
    response_id: str,
    created_at: int,
    model: str,
    status: str,
    output: list[dict],
    usage: dict | None,
    error: dict | None = None,
) -> dict[str, Any]:
    """The Response object, with the request's parameters echoed as OpenAI echoes them
    (defaults where the request left them out)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    text = dict(req.text) if req.text else {}
    text.setdefault("format", {"type": "text"})
    tools = [
        {
            "type": "function",
            "name": t["name"],
            "description": t.get("description"),
            "parameters": t.get("parameters"),
            "strict": t.get("strict"),
        }
        for t in req.tools or []
    ]
    reasoning = req.reasoning or {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": error,
        "incomplete_details": incomplete,
        "model": model,
        "output": output,
        "usage": usage,
        "instructions": req.instructions,
        "tools": tools,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "text": text,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "metadata": req.metadata or {},
        "user": req.user,
        "store": False,  # nothing is stored, whatever the request asked
        "background": False,
        "previous_response_id": None,
        "truncation": "disabled",
    }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    """A reasoning item: the thinking as reasoning_text (none yet when it opens), no summary."""
    opening = status == "in_progress" and not text
    content = [] if opening else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [output_text(text)]
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": content,
    }


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def usage_of(usage: UsageInfo, reasoning_tokens: int) -> dict:
    """Responses' usage from the chat's. cached_tokens: 0, the chat usage does not carry the
    prefix-cache hits; reasoning_tokens: the reasoning text's tokens, re-counted."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class ResponsesDialect(Dialect):
    """The chat dialect's answers re-shaped as Responses: the chat dialect does the work (tool
    calls, reasoning, logprobs), this wrapper only changes the shape."""

    def __init__(self, chat: Dialect, req: ResponsesRequest) -> None:
        super().__init__(chat.tokenizer, chat.model_name)
        self.chat = chat
        self.req = req

    def count_tokens(self, text: str) -> int:
        if not text or self.tokenizer is None:
            return 0
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def response(self, usage, choices, logprobs, token_ids=False, **options) -> ResponseBody:
        chat = self.chat.response(usage, choices, logprobs, token_ids, **options)
        return ResponseBody(self.from_chat(chat))

    def from_chat(self, chat: ChatCompletionResponse) -> dict[str, Any]:
        """The Response object of a whole chat answer (one choice): reasoning, then the
        message, then the function calls."""
        choice = chat.choices[0]
        message = choice.message
        status = status_of(choice.finish_reason)
        output = []
        if message.reasoning_content:
            output.append(reasoning_item(_id("rs"), message.reasoning_content))
        if message.content or not message.tool_calls:
            output.append(message_item(_id("msg"), message.content or "", status))
        for call in message.tool_calls:
            output.append(
                function_call_item(_id("fc"), call.id, call.function.name, call.function.arguments)
            )
        usage = usage_of(chat.usage, self.count_tokens(message.reasoning_content or ""))
        return response_object(
            self.req,
            _id("resp"),
            chat.created,
            self.model_name,
            status,
            output,
            usage,
        )

    def stream(self, token_ids: bool = False, **options) -> StreamShape:
        return ResponsesStream(self, self.chat.stream(token_ids, **options))


# Characters JSON leaves raw but str.splitlines-based SSE readers take as line ends.
_ESCAPES = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


class ResponsesStream(StreamShape):
    """A chat stream's chunks as Responses' SSE events. Each output item opens with
    output_item.added when its first delta arrives and closes (its .done events) when the
    next item starts or the answer ends; the stream ends with response.completed (or
    response.incomplete at max_output_tokens) carrying the whole response, or response.failed
    after an error event."""

    dialect: ResponsesDialect

    def __init__(self, dialect: ResponsesDialect, chat: StreamShape) -> None:
        super().__init__(dialect, _id("resp"))
        self.chat = chat
        self.sequence = 0
        self.output: list[dict] = []  # items in order, as they are when done
        self.open: dict | None = None  # the item receiving deltas (reasoning or message)
        self.calls: dict[int, int] = {}  # chat tool-call index -> output index
        self.finish: str | None = None
        self.reasoning_text = ""

    # -- events ---------------------------------------------------------------------------------
    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        data = json.dumps(body, ensure_ascii=False).translate(_ESCAPES)
        return f"event: {kind}\ndata: {data}\n\n"

    def snapshot(self, status: str, usage: dict | None = None, error: dict | None = None) -> dict:
        return response_object(
            self.dialect.req,
            self.id,
            self.created,
            self.dialect.model_name,
            status,
            [dict(item) for item in self.output],
            usage,
            error,
        )

    def preamble(self, indices: list[int]) -> str:
        return self.event("response.created", response=self.snapshot("in_progress")) + self.event(
            "response.in_progress", response=self.snapshot("in_progress")
        )

    def chunks(self, index, out, logprobs) -> list:
        return self.chat.chunks(index, out, logprobs)

    def usage(self, usage: UsageInfo):
        return self.chat.usage(usage)

    def render(self, chunks: list) -> str:
        return "".join(self.translate(chunk) for chunk in chunks)

    def translate(self, chunk: ChatCompletionStreamChunk) -> str:
        if not chunk.choices:  # the usage chunk: the end of the answer
            return self.close(chunk.usage) if chunk.usage is not None else ""
        events = []
        for choice in chunk.choices:
            delta = choice.delta
            if delta.reasoning_content:
                events.append(self.reasoning_delta(delta.reasoning_content))
            if delta.content:
                events.append(self.text_delta(delta.content))
            for call in delta.tool_calls or []:
                events.append(self.call_delta(call))
            if choice.finish_reason is not None:
                self.finish = choice.finish_reason
        return "".join(events)

    def add(self, item: dict) -> str:
        self.output.append(item)
        return self.event(
            "response.output_item.added", output_index=len(self.output) - 1, item=item
        )

    def reasoning_delta(self, text: str) -> str:
        events = ""
        if self.open is None or self.open["type"] != "reasoning":
            events += self.close_open()
            self.open = {"type": "reasoning", "id": _id("rs"), "text": ""}
            events += self.add(reasoning_item(self.open["id"], "", "in_progress"))
            events += self.event(
                "response.content_part.added",
                item_id=self.open["id"],
                output_index=len(self.output) - 1,
                content_index=0,
                part={"type": "reasoning_text", "text": ""},
            )
        self.open["text"] += text
        self.reasoning_text += text
        return events + self.event(
            "response.reasoning_text.delta",
            item_id=self.open["id"],
            output_index=len(self.output) - 1,
            content_index=0,
            delta=text,
        )

    def text_delta(self, text: str) -> str:
        events = ""
        if self.open is None or self.open["type"] != "message":
            events += self.close_open()
            events += self.open_message()
        self.open["text"] += text
        return events + self.event(
            "response.output_text.delta",
            item_id=self.open["id"],
            output_index=len(self.output) - 1,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def open_message(self) -> str:
        self.open = {"type": "message", "id": _id("msg"), "text": ""}
        events = self.add(message_item(self.open["id"], None, "in_progress"))
        return events + self.event(
            "response.content_part.added",
            item_id=self.open["id"],
            output_index=len(self.output) - 1,
            content_index=0,
            part=output_text(""),
        )

    def call_delta(self, call) -> str:
        events = ""
        position = self.calls.get(call.index)
        if position is None:
            events += self.close_open()
            item = function_call_item(
                _id("fc"), call.id or _id("call"), call.function.name or "", "", "in_progress"
            )
            events += self.add(item)
            position = self.calls[call.index] = len(self.output) - 1
        item = self.output[position]
        arguments = call.function.arguments or ""
        if not arguments:
            return events
        item["arguments"] += arguments
        return events + self.event(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=position,
            delta=arguments,
        )

    def close_open(self, status: str = "completed") -> str:
        """The .done events of the reasoning or message item receiving deltas, if any."""
        item, self.open = self.open, None
        if item is None:
            return ""
        position = len(self.output) - 1
        text = item["text"]
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], text, status)
            part = {"type": "reasoning_text", "text": text}
            events = self.event(
                "response.reasoning_text.done",
                item_id=item["id"],
                output_index=position,
                content_index=0,
                text=text,
            )
        else:
            done = message_item(item["id"], text, status)
            part = output_text(text)
            events = self.event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=position,
                content_index=0,
                text=text,
                logprobs=[],
            )
        events += self.event(
            "response.content_part.done",
            item_id=item["id"],
            output_index=position,
            content_index=0,
            part=part,
        )
        self.output[position] = done
        return events + self.event("response.output_item.done", output_index=position, item=done)

    def close_calls(self) -> str:
        events = ""
        for position in sorted(self.calls.values()):
            item = self.output[position]
            item["status"] = "completed"
            events += self.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=position,
                arguments=item["arguments"],
            )
            events += self.event("response.output_item.done", output_index=position, item=item)
        self.calls = {}
        return events

    def close(self, usage: UsageInfo) -> str:
        """The answer's end: open items done, then response.completed (or .incomplete)."""
        status = status_of(self.finish)
        events = ""
        if not self.calls and not any(item["type"] == "message" for item in self.output):
            if self.open is None or self.open["type"] != "message":
                events += self.close_open()
                events += self.open_message()  # an empty answer still has its message
        events += self.close_open(status) + self.close_calls()
        totals = usage_of(usage, self.dialect.count_tokens(self.reasoning_text))
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + self.event(kind, response=self.snapshot(status, totals))

    def failure(self, err) -> str:
        """A failure after the stream began: an error event, then response.failed."""
        events = self.event("error", code=str(err.status), message=err.message, param=None)
        error = {"code": "server_error", "message": err.message}
        return events + self.event("response.failed", response=self.snapshot("failed", None, error))

    def end(self) -> str:
        return ""  # Responses streams end with their last event, no [DONE]
