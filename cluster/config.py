"""ClusterConfig: the single source of truth for a deployment. The CLI, deploy/serve_config.yaml
(`args:` of the Serve application) and the Helm chart's values all produce this object. The
chart's values.schema.json is generated from it (`make schema`, cluster/schema.py), and the
CLI's engine flags from EngineConfig's fields (cluster/engine_args.py): a Field's type, limits and
description are the only place to state them.

Several models behind one endpoint: `models:` lists one ModelDeployment per model (its engine,
replicas, autoscaling and CPU share); an entry's fields left out take the top-level ones, and its
`engine` is layered over the top-level `engine` (settings shared by every model are written
once). No `models:`: the top-level fields are the one model, as before. `deployments()` returns
the list either way."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from replica.config import EngineConfig
from replica.tracing import TracingConfig
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


# The fields a ModelDeployment shares with ClusterConfig: an entry of `models` that leaves one
# out takes the top-level value.
PER_MODEL_FIELDS = (
    "engine",
    "replicas",
    "autoscaling",
    "num_cpus_per_replica",
    "cpu_threads_per_replica",
    "max_ongoing_requests",
)


# A model deployment's size, stated once: the top level's (the one model, or every entry's
# default) and each `models` entry's.
Replicas = Annotated[int, Field(ge=1, description="fixed replica count (no autoscaling)")]
CpusPerReplica = Annotated[
    float, Field(ge=0, description="CPUs Ray reserves for each engine replica")
]
ThreadsPerReplica = Annotated[
    int | None,
    Field(
        ge=1,
        description="torch threads of a CPU replica; null: num_cpus_per_replica when >= 1, "
        "else the usable cores divided among all the replicas of every model",
    ),
]
MaxOngoingRequests = Annotated[
    int, Field(ge=1, description="Ray Serve's cap of requests in flight per replica")
]


class PDConfig(_Strict):
    """Prefill/decode disaggregation: prefill replicas run prompts to their first token, decode
    replicas continue them from there with the prompt's KV fetched from the prefill replica."""

    prefill_replicas: int = Field(ge=1, description="replicas that run prompts")
    decode_replicas: int = Field(ge=1, description="replicas that continue them (decode)")

    @classmethod
    def parse(cls, text: str) -> PDConfig:
        """`--pd PREFILL:DECODE` (e.g. "1:3"): the two roles' replica counts."""
        parts = text.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(
                f"--pd {text!r}: expected PREFILL:DECODE replica counts, e.g. --pd 1:3"
            )
        return cls(prefill_replicas=int(parts[0]), decode_replicas=int(parts[1]))


class ModelDeployment(_Strict):
    """One served model: its engine and its LLMServer deployment's size (cluster/app.py)."""

    engine: EngineConfig = Field(default_factory=EngineConfig)
    replicas: Replicas = 1
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    num_cpus_per_replica: CpusPerReplica = 0.5
    cpu_threads_per_replica: ThreadsPerReplica = None
    max_ongoing_requests: MaxOngoingRequests = 256

    def served_name(self) -> str:
        return self.engine.served_name()

    def adapter_names(self) -> list[str]:
        return [m.name for m in self.engine.lora_modules]

    def max_replicas(self) -> int:
        """The most replicas this model may run (its share of a machine's cores)."""
        return self.autoscaling.max_replicas if self.autoscaling.enabled else self.replicas


def _as_dict(value: Any) -> dict:
    """A section as given: a dict, or a model's fields that were set (a ClusterConfig built in
    Python)."""
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_unset=True)
    return dict(value or {})


class ClusterConfig(_Strict):
    name: str = Field(
        default="stepserve", pattern=r"^[a-z0-9][a-z0-9-]*$", description="Serve application name"
    )
    engine: EngineConfig = Field(default_factory=EngineConfig)
    models: list[ModelDeployment] = Field(
        default_factory=list,
        description="several models behind one endpoint, one entry each (its engine, replicas, "
        "autoscaling, CPU share); fields an entry leaves out take the top-level ones, its "
        "engine is layered over the top-level engine. Empty: the top-level fields are the one "
        "model",
    )
    replicas: Replicas = 1
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    num_cpus_per_replica: CpusPerReplica = 0.5
    cpu_threads_per_replica: ThreadsPerReplica = None
    max_ongoing_requests: MaxOngoingRequests = 256
    log_prompts: bool = Field(
        default=False, description="log the prompt token counts of each request"
    )
    tracing: TracingConfig = Field(
        default_factory=TracingConfig,
        description="OpenTelemetry traces of each request (ingress and engine spans) to an "
        "OTLP/HTTP endpoint; off without otlp_traces_endpoint",
    )
    pd: PDConfig | None = Field(
        default=None,
        description="prefill/decode disaggregation (docs/pd.md); null: colocated, every "
        "replica runs prompts and decodes",
    )

    @model_validator(mode="before")
    @classmethod
    def _layer_models(cls, data: Any) -> Any:
        """Each `models` entry over the top-level fields (its engine over the top-level
        engine), so that an entry states only what differs."""
        if not isinstance(data, dict) or not data.get("models"):
            return data
        top_engine = _as_dict(data.get("engine"))
        for key in ("model", "served_model_name", "lora_modules"):
            if top_engine.get(key):
                raise ValueError(
                    f"engine.{key} ({top_engine[key]!r}) is per model when `models` is given: "
                    f"set it in models[i].engine.{key}"
                )
        layered = []
        for entry in data["models"]:
            entry = _as_dict(entry)
            merged = {key: data[key] for key in PER_MODEL_FIELDS[1:] if key in data}
            merged.update({k: v for k, v in entry.items() if k != "engine"})
            merged["engine"] = {**top_engine, **_as_dict(entry.get("engine"))}
            layered.append(merged)
        return {**data, "models": layered}

    @model_validator(mode="after")
    def _unique_names(self) -> ClusterConfig:
        """Clients pick a model or an adapter by name: every name is served once."""
        seen: dict[str, str] = {}
        for model in self.deployments():
            base = model.served_name()
            adapters = [(name, f"adapter of {base!r}") for name in model.adapter_names()]
            for name, what in [(base, "model"), *adapters]:
                if name in seen:
                    raise ValueError(
                        f"served name {name!r} is used twice: by the {seen[name]} and by the "
                        f"{what}; give each model a distinct served_model_name and each "
                        "adapter (lora_modules) a name no model or other adapter has"
                    )
                seen[name] = what
        return self

    @model_validator(mode="after")
    def _pd_fixed_size(self) -> ClusterConfig:
        """PD splits one model's fixed replica count between two roles."""
        if self.pd is None:
            return self
        if self.models:
            raise ValueError("pd (prefill/decode disaggregation) serves one model: drop `models`")
        if self.autoscaling.enabled:
            raise ValueError(
                "pd sets its replica counts (pd.prefill_replicas, pd.decode_replicas): turn "
                "autoscaling.enabled off"
            )
        if self.routing.policy == "pow2":
            raise ValueError(
                "pd needs stepserve's router (routing.policy load_aware or round_robin): it "
                "hands each prompt's KV from the replica the router chose; got pow2"
            )
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        return cls.model_validate(data)

    def deployments(self) -> list[ModelDeployment]:
        """The served models, in order (the first is the default when a request names none):
        `models`, or the one model the top-level fields describe."""
        if self.models:
            return list(self.models)
        return [ModelDeployment(**{key: getattr(self, key) for key in PER_MODEL_FIELDS})]

    def model_name(self) -> str:
        """The default model's served name (the first model's)."""
        return self.deployments()[0].served_name()

    def replicas_per_machine(self) -> int:
        """The most LLM replicas of every model that may share one machine's cores."""
        if self.pd is not None:
            return self.pd.prefill_replicas + self.pd.decode_replicas
        return sum(model.max_replicas() for model in self.deployments())
