"""What the ingress checks before it spends anything on a request: the API key, the admission
limits (requests in flight at this ingress, and each API key's fair share of them when keys
compete), the body's size and that it is a JSON object. (Admission by expected wait, which
needs the parsed request, is router/admission.py's.)"""

from __future__ import annotations

import hmac
import json

from fastapi import Request

from router.errors import HTTPError, bad_request
from router.settings import AuthConfig, HttpConfig

ANONYMOUS = "anonymous"
# keys compete for in-flight slots (fair shares apply) once this fraction of the limit is taken
FAIR_SHARE_FROM = 0.5


class Slot:
    """One admitted request's in-flight slot; released once, however the request ends."""

    __slots__ = ("guard", "key", "released")

    def __init__(self, guard: RequestGuard, key: str) -> None:
        self.guard, self.key, self.released = guard, key, False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.guard._release(self.key)


class RequestGuard:
    """Auth, admission and body limits of one ingress replica. `inflight` is the count of
    requests this ingress holds (admitted and not yet ended), `inflight_by_key` per API key."""

    def __init__(self, http: HttpConfig, auth: AuthConfig) -> None:
        self.http = http
        self.api_keys = auth.resolved_keys()
        self.inflight = 0
        self.inflight_by_key: dict[str, int] = {}

    def client_key(self, request: Request) -> str:
        """Whose request this is, for fair shares: its API key (anonymous without auth)."""
        if not self.api_keys:
            return ANONYMOUS
        _, _, token = request.headers.get("authorization", "").partition(" ")
        return token.strip() or ANONYMOUS

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

    def admit(self, key: str = ANONYMOUS) -> Slot:
        """Take an in-flight slot, or refuse with 429: when the ingress holds its limit, or,
        once half of it is taken and several API keys compete, when this key already holds
        its fair share (limit / keys in flight), so one client's burst cannot starve others."""
        limit = self.http.max_pending_requests
        if self.inflight >= limit:
            raise HTTPError(
                429,
                f"server overloaded: {self.inflight} requests in flight (limit {limit})",
                "rate_limit_error",
                headers={"Retry-After": "1"},
            )
        held = self.inflight_by_key.get(key, 0)
        keys = len(self.inflight_by_key) + (0 if held else 1)
        if keys > 1 and self.inflight >= limit * FAIR_SHARE_FROM:
            share = limit / keys
            if held >= share:
                raise HTTPError(
                    429,
                    f"server busy: this API key holds {held} of the {self.inflight} requests "
                    f"in flight, its fair share among {keys} keys is {share:.0f}",
                    "rate_limit_error",
                    headers={"Retry-After": "1"},
                )
        self.inflight += 1
        self.inflight_by_key[key] = held + 1
        return Slot(self, key)

    def _release(self, key: str) -> None:
        self.inflight -= 1
        left = self.inflight_by_key.get(key, 0) - 1
        if left > 0:
            self.inflight_by_key[key] = left
        else:
            self.inflight_by_key.pop(key, None)

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
