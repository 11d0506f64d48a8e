"""POST /v1/embeddings in OpenAI's shape: the request (input as text or token ids, one or a
batch; encoding_format; dimensions; vLLM's `normalize` and `add_special_tokens`) and the
response (a list of embeddings, as floats or base64 of little-endian float32)."""

from __future__ import annotations

import base64
import struct
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

EmbeddingInput = str | list[str] | list[int] | list[list[int]]

# inputs of one request (OpenAI's limit): each runs as an engine request of its own
MAX_EMBEDDING_INPUTS = 2048

_INPUT_TYPE_MESSAGE = (
    "input must be a string, a list of strings, a list of token ids or a list of token-id lists"
)


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings. Unknown fields are refused (`unknown_fields`), as on the other
    endpoints; `user` is accepted and not used."""

    model_config = ConfigDict(extra="allow")

    input: EmbeddingInput
    model: str | None = Field(default=None, description="None: the served model")
    encoding_format: Literal["float", "base64"] = Field(
        default="float", description="base64: little-endian float32 (the openai client's default)"
    )
    dimensions: int | None = Field(
        default=None,
        description="cut each embedding to its first `dimensions` values (Matryoshka models only)",
    )
    user: str | None = Field(default=None, description="accepted; not used")
    normalize: bool = Field(default=True, description="extension (vLLM): L2-normalize")
    add_special_tokens: bool = Field(
        default=True, description="extension (vLLM): the tokenizer's special tokens (BOS)"
    )

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """`"encoding_format": null` and the like mean the default."""
        if isinstance(data, Mapping):
            return {k: v for k, v in data.items() if not (v is None and k in _DEFAULTED)}
        return data

    @field_validator("input", mode="wrap")
    @classmethod
    def _input(cls, value: Any, handler: Any) -> EmbeddingInput:
        try:
            given = handler(value)
        except ValidationError:
            raise ValueError(_INPUT_TYPE_MESSAGE) from None
        items = split_input(given)
        if not items:
            raise ValueError("input must not be empty")
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise ValueError(
                f"input has {len(items)} items, more than the limit of {MAX_EMBEDDING_INPUTS} "
                "per request"
            )
        for index, item in enumerate(items):
            if len(item) == 0:
                raise ValueError(f"input[{index}] is empty")
            if not isinstance(item, str):
                negative = next((t for t in item if t < 0), None)
                if negative is not None:
                    raise ValueError(f"input[{index}] has token id {negative}: ids must be >= 0")
        return given

    @field_validator("dimensions")
    @classmethod
    def _dimensions(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"dimensions must be >= 1, got {value}")
        return value

    @property
    def inputs(self) -> list[str | list[int]]:
        """Each input: one text or one list of token ids, in the order of `data`."""
        return split_input(self.input)

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    @property
    def priority(self) -> int:
        """Admission's priority (router/admission.py): embeddings have no field for it."""
        return 0


_DEFAULTED = ("encoding_format", "normalize", "add_special_tokens")


def split_input(value: EmbeddingInput) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if not value:
        return []
    if isinstance(value[0], int):
        return [value]  # type: ignore[list-item]
    return list(value)  # type: ignore[arg-type]


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as the request asked: floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector
