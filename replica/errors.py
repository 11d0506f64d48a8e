"""The errors a replica raises to its callers: they cross Ray and the engine core's process
socket (pickled), and the router maps each onto an HTTP status (router/errors.py)."""

from __future__ import annotations


class RequestRejected(ValueError):
    """The request can never be served with this configuration (a user error: HTTP 400).
    `param` names the field at fault (a SamplingParams field, or "prompt"), or None."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):
        # the default pickling passes only `args`: `param` would be lost crossing processes
        return (type(self), (str(self), self.param))


class GrammarRejected(RequestRejected):
    """A structured-output constraint that cannot become a grammar (HTTP 400 naming the
    request's constraint field). Replicas compile grammars; the ingress does not import the
    grammar engine, and learns a spec's error from the replica that rejected it."""

    def __init__(self, message: str, param: str | None = "structured") -> None:
        super().__init__(message, param)


class EngineOverloaded(RuntimeError):
    """The replica's queue is full or it is draining; retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; the replica must be replaced (HTTP 503)."""


class LoRAError(RequestRejected):
    """A LoRA adapter that cannot be served: its directory is missing or not PEFT's format,
    its rank exceeds max_lora_rank, it targets modules the model does not have, or LoRA is
    off on this replica (HTTP 400, naming the adapter and the limit; `param` is "model")."""

    def __init__(self, message: str, param: str | None = "model") -> None:
        super().__init__(message, param)


class ReplicaDraining(RuntimeError):
    """The replica is shutting down (scale-down, redeploy) and hands an unfinished request back
    rather than keep its drain waiting: the ingress continues it on another replica from what
    its client already has (a migration, not a failure; router/fanout.py). `replica_id` names
    the replica that let it go."""

    def __init__(self, message: str, replica_id: str = "") -> None:
        super().__init__(message)
        self.replica_id = replica_id

    def __reduce__(self):
        # as RequestRejected: `replica_id` must survive crossing Ray
        return (type(self), (str(self), self.replica_id))


class FeedBroken(RuntimeError):
    """A stream's direct feed to its ingress broke (its connection closed, or the outputs a
    replica counted did not arrive): the ingress treats the call's replica as lost, and the
    stream continues on another replica from what its client has (router/fanout.py)."""
