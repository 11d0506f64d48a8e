"""OpenAI's error body, and the 400 of a request that failed validation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_body(
    message: str, type: str, status_code: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}; like vLLM we put
    the HTTP status in `code` unless OpenAI has a code of its own for the error
    ("model_not_found"). Types in use: invalid_request_error (400), not_found_error (404),
    authentication_error (401), server_error (500), service_unavailable (503)."""
    detail = ErrorDetail(message=message, type=type, param=param, code=code or status_code)
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
