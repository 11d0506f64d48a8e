"""OpenAI-compatible HTTP protocol: pydantic models of the requests we accept and the responses,
stream chunks and errors we send, in the shapes the official `openai` client parses.

Every request field is either implemented, or refused with a 400 that names it: unknown
fields are refused (`unknown_fields`), as OpenAI's API does, except the few in
`ACCEPTED_IGNORED_FIELDS`, which cannot change an answer and are accepted and ignored (the
README lists them with the reason). Known but unimplemented values (best_of > n, suffix) are
refused by their validators.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from replica.request import SamplingParams, StructuredOutput

MAX_N = 8
MAX_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# JSON has no -inf; a token outside top-p/top-k has logprob -inf, so we send vLLM's stand-in.
MIN_LOGPROB = -9999.0

SSE_DONE = "data: [DONE]\n\n"

FinishReason = Literal["stop", "length", "tool_calls"]

# Fields a client may send that cannot change an answer here: accepted and ignored (README).
ACCEPTED_IGNORED_FIELDS = {
    "metadata": "stored-completion metadata; completions are not stored",
    "store": "completions are not stored",
    "service_tier": "one tier: every request is served alike",
    "prompt_cache_key": "prefix-cache placement follows the prompt's own tokens (KV routing)",
    "safety_identifier": "no abuse monitoring here",
}


def _check_range(
    name: str, value: float, lo: float, hi: float | None = None, *, lo_open: bool = False
) -> None:
    """Raise ValueError naming the field, the limit and the bad value (NaN always fails)."""
    above_lo = value > lo if lo_open else value >= lo
    below_hi = hi is None or value <= hi
    if above_lo and below_hi:
        return
    if hi is None:
        limit = f"> {lo}" if lo_open else f">= {lo}"
        raise ValueError(f"{name} must be {limit}, got {value!r}")
    bracket = "(" if lo_open else "["
    raise ValueError(f"{name} must be in {bracket}{lo}, {hi}], got {value!r}")


def _finite_logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # also maps NaN and -inf


Logprob = Annotated[float, AfterValidator(_finite_logprob)]


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


def _structured(kind: str, value: Any) -> StructuredOutput:
    """One constraint in vLLM's vocabulary (json, regex, choice, grammar, json_object,
    structural_tag) as the replica's StructuredOutput."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        return StructuredOutput("json", json.dumps(value))
    if kind == "choice":
        if not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        return StructuredOutput("choice", json.dumps(list(value)))
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "structural_tag":
        return StructuredOutput(
            "structural_tag", value if isinstance(value, str) else json.dumps(value)
        )
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind} must be a non-empty string")
    return StructuredOutput(kind, value)


class JsonSchemaSpec(BaseModel):
    """response_format.json_schema: the schema is always enforced, strict or not."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object or json_schema; also vLLM's structural_tag
    (its other fields are the xgrammar structural tag: {"type": "structural_tag", "format"})."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _shape(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format of type "json_schema" needs a json_schema object')
        if self.type != "structural_tag" and self.model_extra:
            raise ValueError(
                f"response_format has unknown fields {sorted(self.model_extra)} for type "
                f"{self.type!r}"
            )
        return self

    def to_structured(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.type == "structural_tag":
            return _structured("structural_tag", self.model_dump(exclude={"json_schema"}))
        schema = self.json_schema.schema_ if self.json_schema else None
        if schema is None:  # no schema: any JSON object
            return StructuredOutput("json_object")
        return StructuredOutput("json", json.dumps(schema))


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` request field: one of json, regex, choice, grammar,
    json_object, structural_tag."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None

    def to_structured(self) -> list[StructuredOutput]:
        specs = []
        for kind, value in (
            ("json", self.json_),
            ("regex", self.regex),
            ("choice", self.choice),
            ("grammar", self.grammar),
            ("structural_tag", self.structural_tag),
        ):
            if value is not None:
                specs.append(_structured(kind, value))
        if self.json_object:
            specs.append(StructuredOutput("json_object"))
        return specs


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # extra="allow" keeps unknown fields in `model_extra` so the ingress can log them.
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(default=None, description="None: the served model")
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(default=0, description="extension; 0 or -1 disables")
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list, description="extension")
    n: int = Field(default=1, description="served as n independent requests by the ingress")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(default=False, description="extension")
    include_stop_str_in_output: bool = Field(default=False, description="extension")
    user: str | None = Field(default=None, description="accepted; not used")
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = Field(default=1.0, description="extension (vLLM)")
    logit_bias: dict[str, float] | None = None
    min_p: float = Field(default=0.0, description="extension (vLLM)")
    min_tokens: int = Field(default=0, description="extension (vLLM)")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = Field(
        default=None, description="extension (vLLM): json, regex, choice, grammar, ..."
    )
    guided_json: dict[str, Any] | str | None = Field(default=None, description="vLLM (legacy)")
    guided_regex: str | None = Field(default=None, description="vLLM (legacy)")
    guided_choice: list[str] | None = Field(default=None, description="vLLM (legacy)")
    guided_grammar: str | None = Field(default=None, description="vLLM (legacy)")
    priority: int = Field(
        default=0,
        ge=-(2**31),
        le=2**31 - 1,
        description="extension (vLLM): lower is served first; a waiting request preempts "
        "running ones of lower priority",
    )

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """Clients send `"temperature": null` to mean "default"; drop such nulls so the field's
        default applies instead of failing type validation."""
        if isinstance(data, Mapping):
            return {
                key: value
                for key, value in data.items()
                if not (value is None and key in cls.model_fields and not _nullable(cls, key))
            }
        return data

    @property
    def ignored_fields(self) -> list[str]:
        """Fields sent that we accept and ignore (ACCEPTED_IGNORED_FIELDS)."""
        return sorted(k for k in self.model_extra or {} if k in ACCEPTED_IGNORED_FIELDS)

    @property
    def unknown_fields(self) -> list[str]:
        """Fields sent that this server does not implement (refused with a 400)."""
        return sorted(k for k in self.model_extra or {} if k not in ACCEPTED_IGNORED_FIELDS)

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        _check_range("temperature", value, 0, 2)
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float) -> float:
        _check_range("top_p", value, 0, 1, lo_open=True)
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {value}")
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int | None) -> int | None:
        if value is not None:
            _check_range("seed", value, SEED_MIN, SEED_MAX)
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [] if value is None else [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(
                f"stop must have at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}"
            )
        if not all(stops):
            raise ValueError("stop sequences must not be empty strings")
        return stops

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, value: list[int]) -> list[int]:
        negative = [t for t in value if t < 0]
        if negative:
            raise ValueError(f"stop_token_ids must be >= 0, got {negative[0]}")
        return value

    @field_validator("n")
    @classmethod
    def _n(cls, value: int) -> int:
        _check_range("n", value, 1, MAX_N)
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value: StreamOptions | None, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, value: float, info: ValidationInfo) -> float:
        _check_range(str(info.field_name), value, -2, 2)
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, value: float) -> float:
        _check_range("repetition_penalty", value, 0, 2, lo_open=True)
        return value

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, value: float) -> float:
        _check_range("min_p", value, 0, 1)
        return value

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, value: int) -> int:
        _check_range("min_tokens", value, 0)
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise ValueError(
                    f"logit_bias keys must be token ids (integers as strings), got {key!r}"
                ) from None
            if token < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
            _check_range(f"logit_bias[{key}]", bias, -100, 100)
        return value

    @field_validator("guided_choice")
    @classmethod
    def _guided_choice(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or not all(value)):
            raise ValueError("guided_choice must be a non-empty list of non-empty strings")
        return value

    @field_validator("guided_regex", "guided_grammar")
    @classmethod
    def _guided_text(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and not value:
            raise ValueError(f"{info.field_name} must be a non-empty string")
        return value

    def structured_output(self) -> StructuredOutput | None:
        """The output constraint asked for by response_format, structured_outputs or vLLM's
        legacy guided_* fields (at most one of them), or None."""
        found: list[tuple[str, StructuredOutput]] = []
        if self.response_format is not None:
            spec = self.response_format.to_structured()
            if spec is not None:
                found.append(("response_format", spec))
        if self.structured_outputs is not None:
            found.extend(
                ("structured_outputs", spec) for spec in self.structured_outputs.to_structured()
            )
        legacy = {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
        }
        for name, value in legacy.items():
            if value is not None:
                found.append((name, _structured(name.removeprefix("guided_"), value)))
        if len(found) > 1:
            names = sorted({name for name, _ in found})
            raise ValueError(
                f"ask for one output constraint at a time, got {len(found)} ({', '.join(names)})"
            )
        return found[0][1] if found else None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a chunk carrying usage (stream_options.include_usage)."""
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        structured: StructuredOutput | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            structured=structured,
        )


def _nullable(model: type[BaseModel], name: str) -> bool:
    """Whether the field's type admits None (then null is a meaningful value, not "default")."""
    annotation = model.model_fields[name].annotation
    return annotation is None or type(None) in get_args(annotation)


def _check_max_tokens(name: str, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


Prompt = str | list[str] | list[int] | list[list[int]]

_PROMPT_TYPE_MESSAGE = (
    "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
)


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: Prompt
    echo: bool = Field(
        default=False,
        description="prepend the prompt to each choice (with logprobs: the prompt's too); "
        "with max_tokens 0, only the prompt",
    )
    max_tokens: int | None = Field(default=16, description="None: up to max_model_len")
    logprobs: int | None = Field(default=None, description="top logprobs per token, 0..20")
    prompt_logprobs: int | None = Field(
        default=None, description="extension (vLLM): top logprobs per prompt token, 0..20"
    )
    best_of: int | None = None
    suffix: str | None = None
    return_token_ids: bool = Field(
        default=False,
        description="extension (vLLM's name): each choice carries the ids of the tokens it "
        "generated (streamed: each chunk its new ones)",
    )

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value: Any, handler: Any) -> Prompt:
        try:
            prompt = handler(value)
        except ValidationError:
            raise ValueError(_PROMPT_TYPE_MESSAGE) from None
        for item in _split_prompt(prompt):
            if len(item) == 0:
                raise ValueError("prompt must not be empty")
            if not isinstance(item, str):
                negative = [t for t in item if t < 0]
                if negative:
                    raise ValueError(f"prompt token ids must be >= 0, got {negative[0]}")
        return prompt

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value == 0 and info.data.get("echo"):
            return value  # echo with max_tokens 0: the prompt alone
        return _check_max_tokens("max_tokens", value)

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None:
            _check_range(str(info.field_name), value, 0, MAX_LOGPROBS)
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise ValueError(
                f"best_of is not supported beyond n: best_of must equal n ({n}), got {value}"
            )
        return value

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each item is one text or one list of token ids. A batch of
        k prompts with n choices yields choices indexed prompt_index * n + sample_index."""
        return _split_prompt(self.prompt)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt alone (one token is still
        generated, to run the prompt, and not returned)."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """SamplingParams for one choice; max_tokens None means `default_max_tokens` (the caller
        passes max_model_len - prompt_len). Raises ValueError if that default is < 1."""
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        if self.echo_only:
            max_tokens = 1
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return self._sampling_params(
            max_tokens, self.logprobs, self.structured_output(), prompt_logprobs
        )


def _split_prompt(prompt: Prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        return [prompt]  # type: ignore[list-item]  # an empty list: reported as empty
    if isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON text")


class ToolCall(BaseModel):
    """A tool call: in an assistant message of the history, and in our answers."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One chat message. Content is a string or a list of text parts (no images). An assistant
    message may carry tool_calls (content may then be null); a tool message answers one by
    tool_call_id. `developer` is OpenAI's newer name for system."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind != "text":
                    raise ValueError(
                        f"only content parts of type 'text' are supported, got {kind!r}"
                    )
        return value

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role}")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def as_template_dict(self) -> dict[str, Any]:
        """The message as a plain dict in OpenAI's shape (router/tool_calls.py renders it)."""
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text}
        if self.tool_calls:
            message["content"] = self.text or None
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _FUNCTION_NAME.match(value):
            raise ValueError(
                f"function names are 1-64 letters, digits, '_', '.' or '-', got {value!r}"
            )
        return value


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = Field(default=None, description="deprecated alias")
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = Field(default=True, description="extension")
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description='"auto" when tools are given, else "none"'
    )
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        choice = self.tool_choice
        if choice in ("required",) or isinstance(choice, NamedToolChoice):
            if not names:
                raise ValueError("tool_choice requires tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice names function {choice.function.name!r}, which is not among the "
                f"tools {names}"
            )
        return self

    @property
    def tool_mode(self) -> str:
        """none | auto | required | named: how the answer may call tools."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def tool_constraint(self) -> StructuredOutput | None:
        """The grammar that makes the answer's tool calls parse: the named tool's call,
        one or more calls when required, and with tools marked strict, free text whose calls
        must be valid; None when the output is free."""
        mode = self.tool_mode
        if mode == "none":
            return None
        tools = [
            {"name": t.function.name, "parameters": t.function.parameters or {"type": "object"}}
            for t in self.tools or []
        ]
        if mode == "named":
            wanted = self.tool_choice.function.name  # type: ignore[union-attr]
            tools = [t for t in tools if t["name"] == wanted]
        elif mode == "auto" and not any(t.function.strict for t in self.tools or []):
            return None
        plan = {"tools": tools, "mode": mode, "parallel": self.parallel_tool_calls}
        return StructuredOutput("tool_calls", json.dumps(plan))

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must not be empty")
        return value

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        return _check_max_tokens(str(info.field_name), value)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None:
            _check_range("top_logprobs", value, 0, MAX_LOGPROBS)
            if value > 0 and not info.data.get("logprobs", False):
                raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, else the older max_tokens; None when neither was sent."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as plain dicts in OpenAI's shape (tool calls and tool results included)."""
        return [m.as_template_dict() for m in self.messages]

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """SamplingParams for one choice; no max tokens sent means `default_max_tokens` (the
        caller passes max_model_len - prompt_len). Raises ValueError if that default is < 1."""
        requested = self.requested_max_tokens
        max_tokens = requested if requested is not None else default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        structured = self.structured_output()
        tool_constraint = self.tool_constraint()
        if tool_constraint is not None:
            if structured is not None:
                raise ValueError(
                    f"tool_choice {self.tool_mode!r} constrains the output; it cannot be "
                    "combined with response_format or structured_outputs"
                )
            structured = tool_constraint
        return self._sampling_params(max_tokens, logprobs, structured)


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(
        default=None, description="default: true for a prompt, false for messages"
    )
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        if self.add_special_tokens is None:
            self.add_special_tokens = self.prompt is not None
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Logprob | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, Logprob] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=completion_id)
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamChunk(BaseModel):
    """One SSE event of a streamed completion; all chunks of a stream share id and created.
    The usage-only final chunk (stream_options.include_usage) has choices=[]."""

    id: str = Field(default_factory=completion_id)
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice] = Field(default_factory=list)
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: Logprob
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: Logprob
    bytes: list[int] | None = None
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    finish_reason: FinishReason | None = None
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=chat_completion_id)
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed tool call: its first delta carries id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    """The first chunk of each choice carries role="assistant"; later ones only content."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage = Field(default_factory=DeltaMessage)
    finish_reason: FinishReason | None = None
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionStreamChunk(BaseModel):
    """One SSE event of a streamed chat completion; usage only on the final, choice-less chunk
    when stream_options.include_usage is set."""

    id: str = Field(default_factory=chat_completion_id)
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice] = Field(default_factory=list)
    usage: UsageInfo | None = None


# Characters JSON leaves raw inside strings but that line splitters built on str.splitlines
# (Python's httpx aiter_lines, for one) take as line ends, which would cut an event in two.
_LINE_BREAKS_TO_ESCAPE = str.maketrans(
    {"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"}
)


def sse_event(chunk: BaseModel) -> str:
    """One server-sent event carrying `chunk` as JSON; end a stream with SSE_DONE. Unicode line
    separators in the text are sent escaped (the same JSON value), so every client sees one
    line per event."""
    return f"data: {chunk.model_dump_json().translate(_LINE_BREAKS_TO_ESCAPE)}\n\n"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "stepserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_body(
    message: str, type: str, status_code: int, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}; like vLLM we put
    the HTTP status in `code`. Types in use: invalid_request_error (400), not_found_error (404),
    authentication_error (401), server_error (500), service_unavailable (503)."""
    detail = ErrorDetail(message=message, type=type, param=param, code=status_code)
    return ErrorResponse(error=detail).model_dump()


def validation_error_body(errors: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A 400 error body for pydantic's `ValidationError.errors()` (or FastAPI's
    `RequestValidationError.errors()`, whose locations start with "body"): the first error's
    message, with `param` naming the offending field."""
    if not errors:
        return error_body("invalid request", "invalid_request_error", 400)
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        message = f"request body is not valid JSON: {first.get('msg', '')}"
        return error_body(message, "invalid_request_error", 400)
    loc = [str(part) for part in first.get("loc", ())]
    if loc and loc[0] == "body":
        loc = loc[1:]
    param = ".".join(loc) or None
    if kind == "value_error":
        # our validators' messages already name the field, the limit and the bad value
        message = str(first.get("ctx", {}).get("error", first.get("msg", "")))
    else:
        message = f"{param or 'request'}: {first.get('msg', 'invalid value')}"
        if kind != "missing" and "input" in first:
            message += f", got {first['input']!r}"
    return error_body(message, "invalid_request_error", 400, param=param)
