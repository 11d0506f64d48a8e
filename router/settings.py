"""What the HTTP ingress is configured with. HttpConfig and AuthConfig are ClusterConfig's
`http` and `auth` sections (cluster/config.py imports them from here: router/ does not import
cluster/); IngressSettings is what the ingress deployment is built with."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from replica.api import TracingConfig
from replica.config import EngineConfig
from router.policy import RoutingConfig

# migrations of one stream after its replica was lost mid-stream (router/migration.py)
DEFAULT_MIGRATION_LIMIT = 3


class HttpConfig(BaseModel):
    """The HTTP edge: where the ingress listens and what it admits."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    max_body_bytes: int = Field(default=4 << 20, ge=1024)
    max_tokens_cap: int = Field(default=4096, ge=1, description="largest max_tokens accepted")
    max_pending_requests: int = Field(
        default=4096,
        ge=1,
        description="requests in flight at the ingress before 429 (a memory bound: admission "
        "is by expected wait, request_timeout_s)",
    )
    request_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="seconds a request may take; a request expected to wait longer for its "
        "first token is refused at once (429, Retry-After), one past it ends with a timeout "
        "error. A client may ask for less with the header X-Request-Timeout (seconds)",
    )
    keepalive_s: float = Field(
        default=2.0,
        gt=0,
        le=60,
        description="an admitted stream gets an SSE comment after this many seconds without "
        "an event (queued, or a long step), so clients and proxies see it is alive",
    )
    migration_limit: int = Field(
        default=DEFAULT_MIGRATION_LIMIT,
        ge=0,
        description="times one stream may move to another replica after its replica was lost "
        "mid-stream (actor died, node gone): it continues from the tokens its client has, in "
        "the same response; past the limit it ends with an error event. Also bounds how often "
        "a lost non-streaming call is sent again. 0: no migration (a stream under way ends "
        "with an error event when its replica is lost)",
    )
    drain_migrate_after_s: float | None = Field(
        default=5.0,
        ge=0,
        description="a draining replica (scale-down, redeploy, shutdown) lets its running "
        "requests finish for this many seconds, then hands the rest back: they continue on "
        "another replica (a migration), so a drain ends in bounded time without cutting a "
        "stream. None: it waits for them (up to the graceful shutdown timeout). Ignored when "
        "migration_limit is 0",
    )
    direct_stream: bool = Field(
        default=False,
        description="streamed tokens go from replica to ingress over a direct TCP feed, one "
        "frame per engine step for all of an ingress's streams (the ingress listens on its "
        "node's IP, a port the OS picks; a replica that cannot reach it streams over Ray); "
        "false: one Ray Serve stream item per token. Off by default: it cuts the front's and "
        "the ingress's CPU per token, but one quiet-host A/B served 2-3 req/s with a slower "
        "first token (docs/perf-serving-path.md, 'The direct feed')",
    )
    ingress_replicas: int = Field(
        default=1,
        ge=1,
        description="HTTP ingress replicas (validation, tokenization, SSE); each applies "
        "max_pending_requests on its own",
    )
    ingress_placement: Literal["head", "any"] = Field(
        default="head",
        description="where the ingress replicas run: 'head' (the Ray head node, where the "
        "HTTP proxy is: losing a worker node never cuts the streams the ingress relays from "
        "other nodes) or 'any' node Ray chooses (an ingress that lives on a worker dies "
        "with it)",
    )
    proxy_location: Literal["head", "every_node"] = Field(
        default="head",
        description="where Ray Serve runs its HTTP proxies: 'head' (one, on the Ray head node: "
        "clients reach every replica through it, and losing a worker node never cuts the "
        "streams of the others) or 'every_node' (one on each node with a replica, for a load "
        "balancer of your own in front of them all: a worker lost also cuts the streams "
        "relayed through its proxy, whichever node their replica is on). Serve's "
        "proxy_location HeadOnly or EveryNode; a Serve already running on a joined cluster "
        "keeps its own",
    )


class AuthConfig(BaseModel):
    """Bearer API keys on /v1/*. Keys come from `api_keys` or the env var `api_keys_env`
    (comma-separated; a Kubernetes Secret is mounted that way)."""

    model_config = ConfigDict(extra="forbid")

    api_keys: list[SecretStr] = Field(
        default_factory=list, description="bearer keys (prefer the environment variable)"
    )
    api_keys_env: str = Field(
        default="STEPSERVE_API_KEYS",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="environment variable the comma-separated keys are read from",
    )

    def resolved_keys(self) -> set[str]:
        """Keys given in the config plus those in the env var, read in this process (so a
        Kubernetes Secret mounted as env on the pod works and keys never travel in configs)."""
        env = os.environ.get(self.api_keys_env, "")
        given = {k.get_secret_value() for k in self.api_keys}
        return given | {k.strip() for k in env.split(",") if k.strip()}


class ModelSettings(BaseModel):
    """One served base model as the ingress sees it."""

    model_config = ConfigDict(extra="forbid")

    name: str  # the name clients put in `model`
    model_dir: str | None  # the model the tokenizer is read from (EngineConfig.model)
    engine: EngineConfig


# PD (config.pd): the ingress's handles hold a model's prefill deployment under its served name
# plus this suffix
PREFILL_HANDLE_SUFFIX = "#prefill"


class IngressSettings(BaseModel):
    """The ingress deployment's arguments: the cluster config's sections it reads. `models`
    are the served models in order (the first answers requests that name none); model_name,
    model_dir and engine are the first one's (all there is when `models` is left out)."""

    model_config = ConfigDict(extra="forbid")

    model_name: str  # the name clients put in `model`
    model_dir: str | None  # the model the tokenizer is read from (EngineConfig.model)
    engine: EngineConfig
    models: list[ModelSettings] = Field(default_factory=list)
    routing: RoutingConfig
    http: HttpConfig = Field(default_factory=HttpConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)  # SecretStr: a repr shows no key
    log_prompts: bool = False
    tracing: TracingConfig = Field(default_factory=TracingConfig)  # OpenTelemetry (off: default)

    @model_validator(mode="after")
    def _first_model(self) -> IngressSettings:
        first = ModelSettings(name=self.model_name, model_dir=self.model_dir, engine=self.engine)
        if not self.models:
            self.models = [first]
        elif self.models[0].name != self.model_name:
            raise ValueError(
                f"model_name ({self.model_name!r}) must be the first of models "
                f"({[m.name for m in self.models]})"
            )
        return self
