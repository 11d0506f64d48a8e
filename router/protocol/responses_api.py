"""POST /v1/responses, OpenAI's Responses API (stateless): the request, and its conversion to
the chat request the ingress serves (router/responses_api.py re-shapes the chat answer).
Every field is mapped, accepted and documented as ignored, or refused with a message naming it
(docs/api.md lists which); nothing is stored, so fields that refer to stored responses are
refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from replica.api import RequestRejected
from router.protocol.requests import ChatCompletionRequest
from router.protocol.sampling import ACCEPTED_IGNORED_FIELDS

# stepserve's own chat fields a Responses request may carry too, passed on as they are
CHAT_EXTRAS = (
    "seed",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
    "priority",
)
# accepted and ignored: they cannot change an answer here (the chat endpoint's list, but
# metadata and store are Responses fields of their own: echoed, see ResponsesRequest)
IGNORED_FIELDS = {
    k: v for k, v in ACCEPTED_IGNORED_FIELDS.items() if k not in ("metadata", "store")
}
# what an input message's text parts may be; any other part (images, files, audio) is refused
_TEXT_PARTS = ("input_text", "output_text")


def rejected(message: str, param: str) -> RequestRejected:
    return RequestRejected(message, param)


class ResponsesRequest(BaseModel):
    """The body of POST /v1/responses. `input` and `tools` are checked item by item in
    `chat_request` (their errors name the item, `input[2].content[0].type`)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, description="echoed; not stored")
    user: str | None = None
    store: bool | None = Field(default=None, description="accepted; nothing is stored")
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None

    @property
    def unknown_fields(self) -> list[str]:
        extra = self.model_extra or {}
        return sorted(k for k in extra if k not in IGNORED_FIELDS and k not in CHAT_EXTRAS)

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(k for k in self.model_extra or {} if k in IGNORED_FIELDS)

    # -- what this server refuses ---------------------------------------------------------------
    def check_supported(self) -> None:
        """RequestRejected naming the first field asking for what a stateless server cannot do."""
        if self.previous_response_id is not None:
            raise rejected(
                "previous_response_id is not supported: this server stores no responses; send "
                "the conversation's items in `input` instead",
                "previous_response_id",
            )
        if self.conversation is not None:
            raise rejected(
                "conversation is not supported: this server stores no conversations; send the "
                "conversation's items in `input` instead",
                "conversation",
            )
        if self.background:
            raise rejected(
                "background responses are not supported: this server stores no responses to "
                "poll; send stream=true for a long answer",
                "background",
            )
        if self.include:
            raise rejected(
                f"include {self.include[0]!r} is not supported: this server adds nothing to a "
                "response on request (include must be empty)",
                "include",
            )
        if self.truncation == "auto":
            raise rejected(
                'truncation "auto" is not supported: an input past the model\'s context is '
                'refused, never cut (truncation must be "disabled")',
                "truncation",
            )
        if self.top_logprobs:
            raise rejected(
                f"top_logprobs is not supported by /v1/responses (got {self.top_logprobs}); "
                "use /v1/chat/completions for logprobs",
                "top_logprobs",
            )
        if self.reasoning is not None:
            unknown = sorted(set(self.reasoning) - {"effort", "summary", "generate_summary"})
            if unknown:
                raise rejected(
                    f"reasoning has unknown field {unknown[0]!r} (known: effort, summary)",
                    f"reasoning.{unknown[0]}",
                )

    # -- conversion -----------------------------------------------------------------------------
    def chat_messages(self) -> list[dict[str, Any]]:
        """`instructions` and `input` as chat messages: instructions first as a system
        message; function_call items as assistant tool calls (merged into the assistant
        message before them); function_call_output items as tool messages; reasoning items
        dropped (chat templates drop earlier turns' thinking too)."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            return messages
        if not self.input:
            raise rejected("input must not be empty", "input")
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            if not isinstance(item, Mapping):
                raise rejected(f"{where} must be an object (an input item)", where)
            kind = item.get("type", "message")
            if kind == "message":
                messages.append(_message(item, where))
            elif kind == "function_call":
                call = {
                    "id": _string(item, "call_id", where),
                    "type": "function",
                    "function": {
                        "name": _string(item, "name", where),
                        "arguments": _string(item, "arguments", where, empty_ok=True),
                    },
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                text = _text(output, f"{where}.output") if not isinstance(output, str) else output
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": _string(item, "call_id", where),
                        "content": text,
                    }
                )
            elif kind == "reasoning":
                continue
            elif kind == "item_reference":
                raise rejected(
                    "item_reference is not supported: this server stores no items; send the "
                    "item itself",
                    f"{where}.type",
                )
            else:
                raise rejected(
                    f"input item type {kind!r} is not supported (supported: message, "
                    "function_call, function_call_output, reasoning)",
                    f"{where}.type",
                )
        if not any(m["role"] != "system" for m in messages):
            raise rejected("input has no user, assistant or tool item", "input")
        return messages

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """Responses' flat function tools as chat tools; any other tool type is refused."""
        if self.tools is None:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            where = f"tools[{i}]"
            if not isinstance(tool, Mapping):
                raise rejected(f"{where} must be an object", where)
            kind = tool.get("type")
            if kind != "function":
                raise rejected(
                    f"tool type {kind!r} is not supported: this server runs no built-in tools; "
                    'only {"type": "function"} tools',
                    f"{where}.type",
                )
            unknown = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
            if unknown:
                raise rejected(
                    f"{where} has unknown field {unknown[0]!r} (known: name, description, "
                    "parameters, strict)",
                    f"{where}.{unknown[0]}",
                )
            function = {"name": _string(tool, "name", where)}
            for key in ("description", "parameters", "strict"):
                if tool.get(key) is not None:
                    function[key] = tool[key]
            tools.append({"type": "function", "function": function})
        return tools

    def chat_tool_choice(self) -> Any:
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none", "required"):
            return choice
        if isinstance(choice, Mapping) and choice.get("type") == "function":
            if not isinstance(choice.get("name"), str):
                raise rejected("tool_choice of type function needs a name", "tool_choice.name")
            return {"type": "function", "function": {"name": choice["name"]}}
        kind = choice.get("type") if isinstance(choice, Mapping) else choice
        raise rejected(
            f'tool_choice {kind!r} is not supported (supported: "auto", "none", "required", '
            '{"type": "function", "name": ...})',
            "tool_choice",
        )

    def response_format(self) -> dict[str, Any] | None:
        """text.format as the chat's response_format."""
        if self.text is None:
            return None
        unknown = sorted(set(self.text) - {"format", "verbosity"})
        if unknown:
            raise rejected(f"text has unknown field {unknown[0]!r}", f"text.{unknown[0]}")
        if self.text.get("verbosity") is not None:
            raise rejected(
                "text.verbosity is not supported: the model's answer length is its own "
                "(bound it with max_output_tokens)",
                "text.verbosity",
            )
        fmt = self.text.get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, Mapping) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), Mapping):
                raise rejected(
                    'text.format of type "json_schema" needs a schema object', "text.format.schema"
                )
            spec = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
            for key in ("description", "strict"):
                if fmt.get(key) is not None:
                    spec[key] = fmt[key]
            return {"type": "json_schema", "json_schema": spec}
        raise rejected(
            f"text.format type {kind!r} is not supported (supported: text, json_schema, "
            "json_object)",
            "text.format.type",
        )

    def chat_request(self) -> ResponsesChatRequest:
        """The chat request this one runs as; RequestRejected naming the Responses field at
        fault (a chat-side validation error is mapped back by responses_param)."""
        self.check_supported()
        body: dict[str, Any] = {"messages": self.chat_messages(), "n": 1}
        if self.model is not None:
            body["model"] = self.model
        tools = self.chat_tools()
        if tools:
            body["tools"] = tools
        choice = self.chat_tool_choice()
        if choice is not None:
            body["tool_choice"] = choice
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        fmt = self.response_format()
        if fmt is not None:
            body["response_format"] = fmt
        for src, dst in (
            ("max_output_tokens", "max_completion_tokens"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("user", "user"),
        ):
            value = getattr(self, src)
            if value is not None:
                body[dst] = value
        if self.stream:
            # the final response.completed carries usage
            body.update(stream=True, stream_options={"include_usage": True})
        for key in CHAT_EXTRAS:
            if key in (self.model_extra or {}):
                body[key] = self.model_extra[key]
        chat = ResponsesChatRequest.model_validate(body)
        chat._source = self
        return chat


def _string(item: Mapping, key: str, where: str, empty_ok: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and not empty_ok):
        raise rejected(f"{where}.{key} must be a non-empty string", f"{where}.{key}")
    return value


def _text(content: Any, where: str) -> str:
    """A content list's text parts (input_text, output_text; an assistant's refusal), joined."""
    if not isinstance(content, list):
        raise rejected(f"{where} must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise rejected(
                f"content part type {kind!r} is not supported: only text parts (input_text, "
                "output_text)",
                f"{where}[{j}].type",
            )
    return "\n".join(texts)


def _message(item: Mapping, where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise rejected(
            f"{where}.role must be user, system, developer or assistant, got {role!r}",
            f"{where}.role",
        )
    content = item.get("content")
    text = content if isinstance(content, str) else _text(content, f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": text}


class ResponsesChatRequest(ChatCompletionRequest):
    """The chat request a Responses request runs as; its errors name Responses' fields.
    `source`: the Responses request (its answer echoes its parameters)."""

    _source: ResponsesRequest | None = PrivateAttr(default=None)

    @property
    def source(self) -> ResponsesRequest:
        return self._source

    def request_field(self, param: str | None) -> str | None:
        if param == "structured" and self.tool_constraint() is None:
            return "text.format"
        return responses_param(super().request_field(param))


# chat field -> the Responses field it came from
_PARAMS = {
    "messages": "input",
    "prompt": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def responses_param(param: str | None) -> str | None:
    """A chat request's field (an error's `param`) under the Responses name it came from."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head in _PARAMS:
        return _PARAMS[head]
    if head == "tools" and rest:  # tools.0.function.name -> tools[0].name
        index, _, tail = rest.partition(".")
        return f"tools[{index}]" + ("." + tail.removeprefix("function.") if tail else "")
    if head == "tool_choice":
        return "tool_choice"
    return param
