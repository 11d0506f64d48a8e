"""The request fields /v1/completions and /v1/chat/completions share: sampling controls and
output constraints (SamplingRequest), validated as they parse.

A sampling field is checked against SamplingParams' own bound (replica/sampling_params.py:
SAMPLING_BOUNDS), written once there; the error names the request's field. Checks of the HTTP
shape alone (types, n, stop's count, stream_options, unknown fields) are this layer's.
Unknown fields are refused (`unknown_fields`), as OpenAI's API does, except the few in
`ACCEPTED_IGNORED_FIELDS`, which cannot change an answer and are accepted and ignored (the
README lists them with the reason)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from replica.api import (
    SAMPLING_BOUNDS,
    Bound,
    EngineRequest,
    RequestRejected,
    SamplingParams,
    StructuredOutput,
    check_logit_bias,
)

MAX_N = 8
N_BOUND = Bound(1, MAX_N)
MAX_STOP_SEQUENCES = 16

# Request fields checked against the SamplingParams bound of the same name as they parse.
BOUNDED_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
)

# Fields a client may send that cannot change an answer here: accepted and ignored (README).
ACCEPTED_IGNORED_FIELDS = {
    "metadata": "stored-completion metadata; completions are not stored",
    "store": "completions are not stored",
    "service_tier": "one tier: every request is served alike",
    "prompt_cache_key": "prefix-cache placement follows the prompt's own tokens (KV routing)",
    "safety_identifier": "no abuse monitoring here",
}


def bounded(field: str, value: Any, bound: str | None = None) -> Any:
    """`value` when it meets SamplingParams' bound `bound` (default: the field's own name);
    else a RequestRejected (a ValueError, so a validation error) naming the request's field."""
    if value is not None:
        SAMPLING_BOUNDS[bound or field].check(field, value)
    return value


def _token_keys(logit_bias: Mapping[str, float]) -> dict[int, float]:
    """logit_bias with its keys (token ids as JSON strings) as ints."""
    biases = {}
    for key, bias in logit_bias.items():
        try:
            biases[int(key)] = bias
        except ValueError:
            raise ValueError(
                f"logit_bias keys must be token ids (integers as strings), got {key!r}"
            ) from None
    return biases


@contextlib.contextmanager
def _rejected_as(param: str) -> Iterator[None]:
    """A ValueError raised inside, as a RequestRejected naming the request field `param`."""
    try:
        yield
    except ValueError as exc:
        raise RequestRejected(str(exc), param) from None


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


class SamplingRequest(BaseModel):
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
    skip_special_tokens: bool = Field(
        default=True,
        description="extension (vLLM): leave special tokens out of the text; a chat request "
        "whose tool-call or reasoning markers are special tokens keeps them (the parsers "
        "strip them)",
    )
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

    @field_validator(*BOUNDED_FIELDS)
    @classmethod
    def _in_bounds(cls, value: Any, info: ValidationInfo) -> Any:
        return bounded(str(info.field_name), value)

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
        N_BOUND.check("n", value)
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value: StreamOptions | None, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            check_logit_bias(_token_keys(value))
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
        legacy guided_* fields (at most one of them), or None. A constraint that is not valid
        raises RequestRejected naming its field."""
        found: list[tuple[str, StructuredOutput]] = []
        if self.response_format is not None:
            spec = self.response_format.to_structured()
            if spec is not None:
                found.append(("response_format", spec))
        if self.structured_outputs is not None:
            with _rejected_as("structured_outputs"):
                specs = self.structured_outputs.to_structured()
            found.extend(("structured_outputs", spec) for spec in specs)
        legacy = {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
        }
        for name, value in legacy.items():
            if value is not None:
                with _rejected_as(name):
                    found.append((name, _structured(name.removeprefix("guided_"), value)))
        if len(found) > 1:
            names = sorted({name for name, _ in found})
            raise RequestRejected(
                f"ask for one output constraint at a time, got {len(found)} ({', '.join(names)})"
            )
        return found[0][1] if found else None

    def constraint_field(self) -> str:
        """The request field that carried the output constraint."""
        for name in ("response_format", "structured_outputs", "guided_json", "guided_regex"):
            if getattr(self, name) is not None:
                return name
        return "guided_choice" if self.guided_choice else "guided_grammar"

    def request_field(self, param: str | None) -> str | None:
        """The request field behind an error's `param` (a SamplingParams field, or one of
        EngineLimits' "prompt", "max_tokens", ...): the name the client sent."""
        return self.constraint_field() if param == "structured" else param

    def engine_request(self, prompt_token_ids: list[int], params: SamplingParams) -> EngineRequest:
        """One choice as the engine takes it: every per-request field this API carries to
        the engine is set here (the fan-out gives each send its id)."""
        return EngineRequest(list(prompt_token_ids), params, request_id="", priority=self.priority)

    @property
    def keeps_markers(self) -> bool:
        """Whether the answer's parsers need special tokens in the text (chat: set by the
        ingress from the served model)."""
        return False

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
        """SamplingParams of this request; SamplingParams checks them, and its error's `param`
        becomes the request field at fault."""
        try:
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
                skip_special_tokens=self.skip_special_tokens and not self.keeps_markers,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                logit_bias=_token_keys(self.logit_bias) if self.logit_bias else None,
                structured=structured,
            )
        except RequestRejected as exc:
            raise RequestRejected(str(exc), self.request_field(exc.param)) from None


def _nullable(model: type[BaseModel], name: str) -> bool:
    """Whether the field's type admits None (then null is a meaningful value, not "default")."""
    annotation = model.model_fields[name].annotation
    return annotation is None or type(None) in get_args(annotation)
