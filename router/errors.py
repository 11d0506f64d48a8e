"""HTTP errors of the ingress, in OpenAI's error shape, and the mapping from what a replica (or
Ray) raised to the status a client should see."""

from __future__ import annotations

import asyncio
import logging
import re

from fastapi.responses import JSONResponse, Response

from replica.api import EngineDeadError, EngineOverloaded, ReplicaDraining, RequestRejected
from router.protocol import error_body, validation_error_body

logger = logging.getLogger("ray.serve")


class HTTPError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        headers=None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers or {}
        self.code = code  # OpenAI's error code ("model_not_found"); None: the HTTP status

    def response(self) -> JSONResponse:
        body = error_body(self.message, self.type, self.status, self.param, self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> HTTPError:
    return HTTPError(400, message, "invalid_request_error", param)


def invalid_request(errors) -> HTTPError:
    """The 400 of a body that failed validation (pydantic's errors): validation_error_body's
    message and param."""
    detail = validation_error_body(errors)["error"]
    return HTTPError(400, detail["message"], detail["type"], detail["param"])


def root_cause(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)  # RayTaskError keeps the replica's exception here
    return cause if isinstance(cause, BaseException) else exc


# what Ray raises for a call whose replica actor died or cannot be reached (a node lost, the
# process killed), and a call whose direct feed broke (router/feed.py): the call never finished
# there, and another replica can take it
REPLICA_LOST = frozenset(
    {
        "ActorDiedError",
        "RayActorError",
        "ActorUnavailableError",
        "ReplicaCallCancelled",
        "FeedBroken",
    }
)


class ReplicaCallCancelled(RuntimeError):
    """A call to a replica ended in a cancellation its caller did not ask for: Ray Serve's
    handle re-raises a cancelled future of the call as asyncio.CancelledError (its replica or
    the replica's node went away). As a CancelledError it would end the caller's own work
    silently (a stream cut without an error event or [DONE]); as this, a lost replica."""


def cancelled_from_inside() -> bool:
    """Whether a CancelledError just caught came from an awaited call rather than from a
    cancellation of the current task itself (a client that left)."""
    task = asyncio.current_task()
    return task is not None and not task.cancelling()


def replica_full(exc: BaseException) -> bool:
    """Whether a replica refused a call because its queue was full or it was draining
    (EngineOverloaded): momentary, and another replica, or the same one a step later, may
    take it."""
    return isinstance(root_cause(exc), EngineOverloaded)


def replica_lost(exc: BaseException) -> bool:
    """Whether a replica call failed because its replica actor is gone (not because of the
    request): retried on another replica while nothing of it reached the client."""
    return type(root_cause(exc)).__name__ in REPLICA_LOST


def replica_handed_back(exc: BaseException) -> bool:
    """Whether a draining replica gave a call back unfinished (ReplicaDraining): it goes on
    on another replica, a migration that is no failure."""
    return isinstance(root_cause(exc), ReplicaDraining)


class MigrationLimitReached(RuntimeError):
    """A stream lost its replica once more after http.migration_limit migrations: it ends with
    this error (503) rather than move again."""


# a Serve replica actor's name: SERVE_REPLICA::<app>#<deployment>#<replica id>
_REPLICA_ACTOR = re.compile(r"SERVE_REPLICA::[^#\s]+#[^#\s]+#(\w+)")


def lost_replica(exc: BaseException) -> str:
    """The replica a call lost, as far as its error tells (for the log): a draining replica
    names itself, Ray's errors name the replica's actor."""
    cause = root_cause(exc)
    if isinstance(cause, ReplicaDraining) and cause.replica_id:
        return cause.replica_id
    found = _REPLICA_ACTOR.search(str(cause))
    if found:
        return found.group(1)
    actor_id = getattr(cause, "actor_id", None)
    return f"actor {actor_id}" if actor_id else "unknown"


def classify_error(exc: BaseException) -> HTTPError:
    """Map what a replica (or Ray) raised to the HTTP error a client should see."""
    exc = root_cause(exc)
    name = type(exc).__name__
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, RequestRejected):
        return bad_request(str(exc))
    if isinstance(exc, EngineOverloaded) or name == "BackPressureError":
        return HTTPError(
            429, f"server overloaded: {exc}", "rate_limit_error", headers={"Retry-After": "1"}
        )
    if isinstance(exc, MigrationLimitReached):
        return HTTPError(503, f"replica failed: {exc}", "service_unavailable")
    if isinstance(exc, ReplicaDraining):
        return HTTPError(503, f"replica draining: {exc}", "service_unavailable")
    if isinstance(exc, EngineDeadError) or name in REPLICA_LOST | {"ActorUnschedulableError"}:
        return HTTPError(503, f"replica failed: {exc}", "service_unavailable")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    return HTTPError(500, f"internal error: {name}: {exc}", "server_error")


async def guarded(coro_fn, *args) -> Response:
    """Run a handler; every failure becomes an OpenAI-style JSON error."""
    try:
        return await coro_fn(*args)
    except HTTPError as err:
        return err.response()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        err = classify_error(exc)
        if err.status >= 500:
            logger.exception("request failed")
        return err.response()
