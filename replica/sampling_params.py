"""How a request samples (SamplingParams) and the output constraint it may carry
(StructuredOutput). SamplingParams owns its bounds, written once in SAMPLING_BOUNDS: its own
check uses them, and so does the HTTP layer's request validation (router/protocol/), which
words the error with the request's field name."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from replica.errors import RequestRejected

STRUCTURED_KINDS = (
    "json",
    "json_object",
    "regex",
    "choice",
    "grammar",
    "structural_tag",
    "tool_calls",
)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output, compiled into a token grammar by the replica
    (replica/structured.py). `spec` by kind: json: a JSON schema (JSON text); json_object: "";
    regex: a regular expression; choice: a JSON list of strings; grammar: an EBNF grammar;
    tool_calls: JSON {"tools": [{"name", "parameters"}], "mode": "required" | "named" | "auto",
    "parallel": bool, "format": a tool-call family (hermes when absent)}.

    `after`: the token ids that end a reasoning model's thinking (`</think>`); when set, the
    grammar lets every token through until the output has sampled that sequence, and
    constrains what follows (empty: constrained from the first token)."""

    kind: str
    spec: str = ""
    after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(
                f"structured output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}"
            )
        if not isinstance(self.after, tuple):  # a list off a wire: keep it hashable
            object.__setattr__(self, "after", tuple(self.after))


@dataclass(frozen=True)
class Bound:
    """A numeric field's range: >= lo (> lo when lo_open), and <= hi unless hi is None.
    `wording` replaces the range in the message (e.g. top_k's disabled values)."""

    lo: int
    hi: int | None = None
    lo_open: bool = False
    wording: str | None = None

    def holds(self, value: float) -> bool:
        """Whether `value` is in range (NaN never is)."""
        above = value > self.lo if self.lo_open else value >= self.lo
        return above and (self.hi is None or value <= self.hi)

    def describe(self) -> str:
        """The range as the error message words it: "in [0, 2]", "in (0, 1]", ">= 1"."""
        if self.wording is not None:
            return self.wording
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo}"
        return f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}]"

    def check(self, name: str, value: float, param: str | None = None) -> None:
        """Raise RequestRejected naming `name`, the range and the value when out of range;
        its `param` is `param`, else `name`."""
        if not self.holds(value):
            raise RequestRejected(f"{name} must be {self.describe()}, got {value}", param or name)


MAX_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

# SamplingParams' numeric fields and their ranges (None values are not checked)
SAMPLING_BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(1),
    "temperature": Bound(0, 2),
    "top_p": Bound(0, 1, lo_open=True),
    "top_k": Bound(-1, wording="-1, 0 (disabled) or >= 1"),
    "min_p": Bound(0, 1),
    "seed": Bound(SEED_MIN, SEED_MAX),
    "min_tokens": Bound(0),
    "logprobs": Bound(0, MAX_LOGPROBS),
    "prompt_logprobs": Bound(0, MAX_LOGPROBS),
    "presence_penalty": Bound(-2, 2),
    "frequency_penalty": Bound(-2, 2),
    "repetition_penalty": Bound(0, 2, lo_open=True),
}
LOGIT_BIAS_BOUND = Bound(-100, 100)


def check_logit_bias(logit_bias: Mapping[int, float]) -> None:
    """Raise RequestRejected (param "logit_bias") for a negative token id or a bias out of
    LOGIT_BIAS_BOUND."""
    for token, bias in logit_bias.items():
        if token < 0:
            raise RequestRejected(f"logit_bias token ids must be >= 0, got {token}", "logit_bias")
        LOGIT_BIAS_BOUND.check(f"logit_bias[{token}]", bias, "logit_bias")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Defaults match vLLM's. An invalid value raises
    RequestRejected (a ValueError) whose `param` names the field.

    The logits processors run in this order on the rows that use them (replica/layers/
    sampler.py): the grammar mask (`structured`), logit_bias, min_tokens, repetition_penalty,
    frequency/presence penalties; then temperature, min_p, top_k, top_p and the draw."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0  # 0: disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    logprobs: int | None = None  # number of top logprobs to return besides the sampled one
    # number of top logprobs per prompt token (the first has none); the prompt is then
    # computed in full, without prefix-cache hits
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    # > 1 discourages every token of the prompt or the output: logit / p if > 0, else * p
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    structured: StructuredOutput | None = None
    # special tokens (EOS, chat markers) left out of the text; False keeps them, all but a
    # special token that ends the output (the stop token: never text)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, bound in SAMPLING_BOUNDS.items():
            value = getattr(self, name)
            if value is not None:
                bound.check(name, value)
        if self.min_tokens > self.max_tokens:
            raise RequestRejected(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
                "min_tokens",
            )
        if not all(self.stop):
            raise RequestRejected("stop strings must be non-empty", "stop")
        if self.structured is not None and self.ignore_eos:
            raise RequestRejected(
                "ignore_eos cannot be combined with a structured output (the grammar ends "
                "the output with EOS)",
                "ignore_eos",
            )
        if self.structured is not None and self.min_tokens > 0:
            raise RequestRejected(
                "min_tokens cannot be combined with a structured output (the grammar decides "
                "where the output ends)",
                "min_tokens",
            )
        if self.logit_bias:
            check_logit_bias(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Any of the penalties that read the request's tokens."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
