"""ClusterConfig: the single source of truth for a deployment. The CLI, deploy/serve_config.yaml
(`args:` of the Serve application) and the Helm chart's values all produce this object. The
chart's values.schema.json is generated from it (`make schema`, cluster/schema.py), and the
CLI's engine flags from EngineConfig's fields (cluster/engine_args.py): a Field's type, limits and
description are the only place to state them."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from replica.config import EngineConfig
from router.policy import RoutingConfig
from router.settings import AuthConfig, HttpConfig


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


class ClusterConfig(_Strict):
    name: str = Field(
        default="stepserve", pattern=r"^[a-z0-9][a-z0-9-]*$", description="Serve application name"
    )
    engine: EngineConfig = Field(default_factory=EngineConfig)
    replicas: int = Field(default=1, ge=1, description="fixed replica count (no autoscaling)")
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    num_cpus_per_replica: float = Field(
        default=0.5, ge=0, description="CPUs Ray reserves for each engine replica"
    )
    cpu_threads_per_replica: int | None = Field(
        default=None,
        ge=1,
        description="torch threads of a CPU replica; null: num_cpus_per_replica when >= 1, "
        "else the usable cores divided among the replicas",
    )
    max_ongoing_requests: int = Field(
        default=256, ge=1, description="Ray Serve's cap of requests in flight per replica"
    )
    log_prompts: bool = Field(
        default=False, description="log the prompt token counts of each request"
    )

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        return cls.model_validate(data)

    def model_name(self) -> str:
        return self.engine.served_name()
