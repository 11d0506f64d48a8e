"""The requests we accept: POST /v1/completions, /v1/chat/completions, /tokenize and
/detokenize. Known but unimplemented values (best_of > n, suffix) are refused by their
validators."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from replica.api import RequestRejected, SamplingParams, StructuredOutput
from router.protocol.messages import ChatMessage, NamedToolChoice, ToolDefinition
from router.protocol.sampling import SamplingRequest, bounded
from router.reasoning import Reasoning

# SamplingParams' fields under chat's own names (max_tokens: see request_field)
_CHAT_FIELDS = {"logprobs": "top_logprobs", "prompt": "messages"}

Prompt = str | list[str] | list[int] | list[list[int]]

_PROMPT_TYPE_MESSAGE = (
    "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
)


class CompletionRequest(SamplingRequest):
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
        return bounded("max_tokens", value)

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        return bounded(str(info.field_name), value)

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
        passes max_model_len - prompt_len). Raises RequestRejected naming the request field at
        fault (a default < 1: max_tokens)."""
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


class ChatCompletionRequest(SamplingRequest):
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
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="extension (vLLM's): extra variables for the chat template, e.g. "
        '{"enable_thinking": false} for Qwen3',
    )
    # set by the ingress from the served model and the rendered prompt (use_model_format):
    # the tool-call family the grammar writes, and the tokens that end the thinking when the
    # answer starts in (or may open) a thinking block; () when it does not think
    _tool_format: str = PrivateAttr(default="hermes")
    _thinking_end: tuple[int, ...] = PrivateAttr(default=())
    _reasoning: Reasoning | None = PrivateAttr(default=None)
    _keeps_markers: bool = PrivateAttr(default=False)

    def use_model_format(
        self,
        tool_format: str,
        reasoning: Reasoning | None = None,
        thinking_end: tuple[int, ...] = (),
        special_markers: tuple[bool, bool] = (False, False),
    ) -> None:
        """The served model's tool-call family, this answer's thinking (None: it does not
        think: router/reasoning.py) and the tokens that end it: the grammar of a structured
        or tool-constrained answer starts after them."""
        self._tool_format = tool_format
        self._reasoning = reasoning
        self._thinking_end = tuple(thinking_end) if reasoning is not None else ()
        # (the tool-call family's markers, the thinking tags) are special tokens of the
        # model's tokenizer: the text must keep them when tools are offered / it thinks
        tools_special, thinking_special = special_markers
        self._keeps_markers = (tools_special and self.tool_mode != "none") or (
            thinking_special and reasoning is not None
        )

    @property
    def keeps_markers(self) -> bool:
        return self._keeps_markers

    @property
    def reasoning(self) -> Reasoning | None:
        return self._reasoning

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = {"messages", "tools", "add_generation_prompt", "tokenize"} & set(value or {})
        if reserved:
            raise ValueError(
                f"chat_template_kwargs must not set {sorted(reserved)}: the request's own fields do"
            )
        return value

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
        plan = {
            "tools": tools,
            "mode": mode,
            "parallel": self.parallel_tool_calls,
            "format": self._tool_format,
        }
        return StructuredOutput("tool_calls", json.dumps(plan), self._thinking_end)

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must not be empty")
        return value

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        return bounded(str(info.field_name), value, "max_tokens")

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if bounded("top_logprobs", value, "logprobs") is not None:
            if value > 0 and not info.data.get("logprobs", False):
                raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, else the older max_tokens; None when neither was sent."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def request_field(self, param: str | None) -> str | None:
        """As SamplingRequest's, with chat's names: max_completion_tokens (or the older
        max_tokens, as sent), top_logprobs, tools for a tool-call grammar, messages."""
        if param == "max_tokens":
            return "max_completion_tokens" if self.max_completion_tokens is not None else param
        if param == "structured" and self.tool_constraint() is not None:
            return "tools"
        return _CHAT_FIELDS.get(param or "", super().request_field(param))

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as plain dicts in OpenAI's shape (tool calls and tool results included)."""
        return [m.as_template_dict() for m in self.messages]

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """SamplingParams for one choice; no max tokens sent means `default_max_tokens` (the
        caller passes max_model_len - prompt_len). Raises RequestRejected naming the request field at
        fault (a default < 1: max_tokens)."""
        requested = self.requested_max_tokens
        max_tokens = requested if requested is not None else default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        structured = self.structured_output()
        tool_constraint = self.tool_constraint()
        if tool_constraint is not None:
            if structured is not None:
                raise RequestRejected(
                    f"tool_choice {self.tool_mode!r} constrains the output; it cannot be "
                    "combined with response_format or structured_outputs"
                )
            structured = tool_constraint
        elif structured is not None and self._thinking_end:
            structured = dataclasses.replace(structured, after=self._thinking_end)
        return self._sampling_params(max_tokens, logprobs, structured)

    @property
    def tool_definitions(self) -> list[dict[str, Any]]:
        """The tools as {"name", "parameters"} (the parsers read parameter types)."""
        return [
            {"name": t.function.name, "parameters": t.function.parameters or {}}
            for t in self.tools or []
        ]


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
    chat_template_kwargs: dict[str, Any] | None = None
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


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's): serve the PEFT adapter at `lora_path` as
    `lora_name`, on the served model `model` (default: the first model)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256, pattern=r"^[^\s]+$")
    lora_path: str = Field(min_length=1)
    model: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's): stop serving the adapter `lora_name`."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; adapters are known here by name only
