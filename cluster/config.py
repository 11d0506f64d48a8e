"""ClusterConfig: the single source of truth for a deployment. The CLI, deploy/serve_config.yaml
(`args:` of the Serve application) and the Helm chart's values all produce this object."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from replica.config import EngineConfig
from router.policy import RoutingConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AutoscalingConfig(_Strict):
    """Queue-depth autoscaling (cluster/autoscaling.py). Off: a fixed `replicas` count."""

    enabled: bool = False
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=4, ge=1)
    target_queue_depth: float = Field(
        default=8.0, gt=0, description="waiting + running requests per replica to aim for"
    )
    kv_pressure_threshold: float = Field(
        default=0.9, gt=0, le=1, description="KV usage above which a replica counts as saturated"
    )
    upscale_delay_s: float = Field(default=5.0, ge=0)
    downscale_delay_s: float = Field(default=60.0, ge=0)
    metrics_interval_s: float = Field(default=1.0, gt=0)
    look_back_period_s: float = Field(
        default=10.0, gt=0, description="window over which replica stats are averaged"
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling.min_replicas ({self.min_replicas}) must be <= "
                f"max_replicas ({self.max_replicas})"
            )
        return self


class HttpConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    max_body_bytes: int = Field(default=4 << 20, ge=1024)
    max_tokens_cap: int = Field(default=4096, ge=1, description="largest max_tokens accepted")
    max_pending_requests: int = Field(
        default=1024, ge=1, description="requests in flight at the ingress before 429"
    )
    request_timeout_s: float = Field(default=600.0, gt=0)
    ingress_replicas: int = Field(
        default=1,
        ge=1,
        description="HTTP ingress replicas (validation, tokenization, SSE); each applies "
        "max_pending_requests on its own",
    )


class AuthConfig(_Strict):
    """Bearer API keys on /v1/*. Keys come from `api_keys` or the env var `api_keys_env`
    (comma-separated; a Kubernetes Secret is mounted that way)."""

    api_keys: list[SecretStr] = Field(default_factory=list)
    api_keys_env: str = "STEPSERVE_API_KEYS"


class ClusterConfig(_Strict):
    name: str = Field(default="stepserve", pattern=r"^[a-z0-9][a-z0-9-]*$")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    replicas: int = Field(default=1, ge=1, description="fixed replica count (no autoscaling)")
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    num_cpus_per_replica: float = Field(default=0.5, ge=0)
    cpu_threads_per_replica: int | None = Field(
        default=None,
        ge=1,
        description="torch threads of a CPU replica; null: num_cpus_per_replica when >= 1, "
        "else the usable cores divided among the replicas",
    )
    max_ongoing_requests: int = Field(
        default=256, ge=1, description="Ray Serve's cap of requests in flight per replica"
    )
    log_prompts: bool = False

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        return cls.model_validate(data)

    def model_name(self) -> str:
        if self.engine.served_model_name:
            return self.engine.served_model_name
        if self.engine.model:
            return Path(self.engine.model).name
        return "SmolLM2-135M-Instruct"
