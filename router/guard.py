"""What the ingress checks before it spends anything on a request: the API key, the admission
limit (requests in flight at this ingress), the body's size and that it is a JSON object."""

from __future__ import annotations

import hmac
import json

from fastapi import Request

from router.errors import HTTPError, bad_request
from router.settings import AuthConfig, HttpConfig


class RequestGuard:
    """Auth, admission and body limits of one ingress replica. `inflight` is the count of
    requests this ingress holds (admitted and not yet ended)."""

    def __init__(self, http: HttpConfig, auth: AuthConfig) -> None:
        self.http = http
        self.api_keys = auth.resolved_keys()
        self.inflight = 0

    def check_auth(self, request: Request) -> None:
        if not self.api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip().encode()
        # compare_digest against every key: the time taken does not tell how close a guess was
        known = [hmac.compare_digest(token, key.encode()) for key in self.api_keys]
        if scheme.lower() != "bearer" or not any(known):
            raise HTTPError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                "authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def admit(self) -> None:
        """Take an in-flight slot, or refuse with 429 when the ingress holds its limit."""
        limit = self.http.max_pending_requests
        if self.inflight >= limit:
            raise HTTPError(
                429,
                f"server overloaded: {self.inflight} requests in flight (limit {limit})",
                "rate_limit_error",
                headers={"Retry-After": "1"},
            )
        self.inflight += 1

    def release(self) -> None:
        self.inflight -= 1

    async def read_json(self, request: Request) -> dict:
        limit = self.http.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise HTTPError(
                413,
                f"request body is {declared} bytes; the limit is {limit}",
                "invalid_request_error",
            )
        body = bytearray()
        async for chunk in request.stream():  # a chunked upload has no content-length: count
            body += chunk
            if len(body) > limit:
                raise HTTPError(
                    413,
                    f"request body exceeds the limit of {limit} bytes",
                    "invalid_request_error",
                )
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise bad_request(f"request body must be a JSON object, got {type(data).__name__}")
        return data
