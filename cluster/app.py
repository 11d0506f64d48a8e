"""build_app(config) -> serve.Application: the ingress deployment bound to one LLM deployment
per served model ("LLMServer" for one model, as always; "LLMServer-<served name>" each when
there are several), each with its own replicas, autoscaling, engine and request router; with
pd, a second one ("LLMServer-prefill") takes the prompts (docs/pd.md). Also the import path `cluster.app:build_app` used by `serve run deploy/serve_config.yaml` and
by the RayService (Ray validates the YAML `args:` into ClusterConfig)."""

from __future__ import annotations

import re
from pathlib import Path

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.config import ClusterConfig, ModelDeployment
from replica.deployment import LLMServer
from replica.metrics import ON_HEAD_NODE
from router.ingress import make_ingress_deployment
from router.settings import PREFILL_HANDLE_SUFFIX, IngressSettings, ModelSettings

# On scale-down, redeploy or shutdown a replica takes no new requests and waits this long for
# its in-flight ones (Serve's graceful shutdown); after http.drain_migrate_after_s it hands the
# unfinished ones back and the ingress continues them on other replicas, so a drain is that
# short unless migration is off. The ingress waits longer, so that it can still relay what the
# replicas send until their last moment, an error event included.
REPLICA_DRAIN_TIMEOUT_S = 60.0
INGRESS_DRAIN_TIMEOUT_S = REPLICA_DRAIN_TIMEOUT_S + 15.0

ROUTERS = {
    "load_aware": "router.request_router:LoadAwareRouter",
    "round_robin": "router.request_router:LoadAwareRouter",
    # Ray Serve's own default, kept selectable as the baseline
    "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
}


def deployment_name(config: ClusterConfig, model: ModelDeployment) -> str:
    """The LLM deployment of `model`: "LLMServer" when it is the only one (every existing
    serve config, chart override and dashboard names it so), else "LLMServer-<served name>"
    (characters Serve or a metric label would trip on become "_")."""
    if len(config.deployments()) == 1:
        return "LLMServer"
    return "LLMServer-" + re.sub(r"[^A-Za-z0-9._-]", "_", model.served_name())


def replica_options(config: ClusterConfig, model: ModelDeployment | None = None) -> dict:
    """Ray Serve options of a model's LLM deployment (the first model's by default)."""
    model = model if model is not None else config.deployments()[0]
    engine = model.engine
    tp = engine.tensor_parallel_size
    options: dict = {
        "name": deployment_name(config, model),
        "max_ongoing_requests": model.max_ongoing_requests,
        "health_check_period_s": 5,
        "health_check_timeout_s": 30,
        "graceful_shutdown_timeout_s": REPLICA_DRAIN_TIMEOUT_S,
        "request_router_config": RequestRouterConfig(
            request_router_class=ROUTERS[config.routing.policy],
            request_router_kwargs=(
                {
                    "routing": config.routing.model_dump(),
                    "block_size": engine.block_size,
                    "lora_capacity": engine.lora_capacity,
                }
                if config.routing.policy != "pow2"
                else {}
            ),
            request_routing_stats_period_s=config.routing.stats_period_s,
            request_routing_stats_timeout_s=max(1.0, config.routing.stats_period_s * 5),
        ),
    }
    gpu = engine.device == "cuda"
    if tp > 1:
        # rank 0 lives in the replica actor; ranks 1..tp-1 are actors in the same placement group
        rank_bundle = {"GPU": 1} if gpu else {"CPU": 0.01}
        first = {"CPU": max(model.num_cpus_per_replica, 0.01), **({"GPU": 1} if gpu else {})}
        options["placement_group_bundles"] = [first] + [dict(rank_bundle) for _ in range(tp - 1)]
        options["placement_group_strategy"] = "STRICT_PACK"
        options["ray_actor_options"] = {
            "num_cpus": max(model.num_cpus_per_replica, 0.01),
            "num_gpus": 1 if gpu else 0,
        }
    else:
        options["ray_actor_options"] = {
            "num_cpus": model.num_cpus_per_replica,
            "num_gpus": 1 if gpu else 0,
        }
    scaling = model.autoscaling
    if scaling.enabled:
        options["autoscaling_config"] = {
            "min_replicas": scaling.min_replicas,
            "initial_replicas": max(scaling.min_replicas, 1),
            "max_replicas": scaling.max_replicas,
            "metrics_interval_s": scaling.metrics_interval_s,
            "upscale_delay_s": scaling.upscale_delay_s,
            "downscale_delay_s": scaling.downscale_delay_s,
            "look_back_period_s": scaling.look_back_period_s,
            "policy": {
                "policy_function": "cluster.autoscaling:QueueDepthPolicy",
                "policy_kwargs": {"config": scaling.model_dump()},
            },
        }
    else:
        options["num_replicas"] = model.replicas
    # The thread count travels in user_config, not in the constructor's arguments: Serve applies
    # a user_config change to running replicas in place (reconfigure), so a replica-count change
    # that moves the auto thread count does not replace every replica (and reload the model).
    options["user_config"] = thread_settings(config, model)
    return options


def thread_settings(config: ClusterConfig, model: ModelDeployment | None = None) -> dict:
    """A model's LLM deployment's user_config (the first model's by default): what a CPU
    replica needs to pick its torch thread count on its own machine
    (replica.deployment.resolve_cpu_threads): an explicit count, the CPUs Ray reserves per
    replica, and how many replicas share one machine's cores: the replicas of every model (all
    of them on one machine: `stepserve serve`, serve_config.yaml; the chart says per pod)."""
    model = model if model is not None else config.deployments()[0]
    return {
        "cpu_threads": model.cpu_threads_per_replica,
        "num_cpus_per_replica": model.num_cpus_per_replica,
        "replicas_per_machine": config.replicas_per_machine(),
    }


# http.proxy_location -> Ray Serve's ProxyLocation (the serve config's `proxy_location`)
SERVE_PROXY_LOCATIONS = {"head": "HeadOnly", "every_node": "EveryNode"}


def serve_start_options(config: ClusterConfig) -> dict:
    """serve.start's cluster-wide options for this config: where the HTTP proxies run and what
    they listen on (the serve config's `proxy_location` and `http_options`)."""
    return {
        "proxy_location": SERVE_PROXY_LOCATIONS[config.http.proxy_location],
        "http_options": {"host": config.http.host, "port": config.http.port},
    }


def ingress_actor_options(config: ClusterConfig) -> dict:
    """The ingress takes no CPU from the replicas' share and, by default, runs on the head
    node (a sliver of the resource Ray gives only the head), beside the HTTP proxy: a worker
    node lost takes its replicas' streams with it, never the streams of the others."""
    options: dict = {"num_cpus": 0}
    if config.http.ingress_placement == "head":
        options["resources"] = dict(ON_HEAD_NODE)
    return options


def model_settings(model: ModelDeployment) -> ModelSettings:
    engine = model.engine
    return ModelSettings(
        name=model.served_name(),
        model_dir=str(Path(engine.model)) if engine.model else None,
        engine=engine,
    )


def ingress_settings(config: ClusterConfig) -> IngressSettings:
    models = [model_settings(model) for model in config.deployments()]
    first = models[0]
    return IngressSettings(
        model_name=first.name,
        model_dir=first.model_dir,
        engine=first.engine,
        models=models,
        routing=config.routing,
        http=config.http,
        auth=config.auth,
        log_prompts=config.log_prompts,
        tracing=config.tracing,
    )


def drain_migrate_after_s(config: ClusterConfig) -> float | None:
    """How long a draining replica lets its requests run before handing the rest back to the
    ingress (a migration): http.drain_migrate_after_s, None (wait for them, up to
    REPLICA_DRAIN_TIMEOUT_S) when migration is off or the grace would outlast the drain."""
    after = config.http.drain_migrate_after_s
    if config.http.migration_limit == 0 or after is None or after >= REPLICA_DRAIN_TIMEOUT_S:
        return None
    return after


def llm_deployments(config: ClusterConfig) -> dict[str, tuple[ModelDeployment, dict]]:
    """The LLM deployments to bind, by the ingress's handle key: each model's (its served
    name) with its Serve options; with pd, the model's decode replicas under its name
    ("LLMServer") and its prefill replicas beside them ("LLMServer-prefill", under the name
    plus PREFILL_HANDLE_SUFFIX)."""
    out = {}
    for model in config.deployments():
        if config.pd is None:
            out[model.served_name()] = (model, replica_options(config, model))
            continue
        decode = model.model_copy(update={"replicas": config.pd.decode_replicas})
        prefill = model.model_copy(update={"replicas": config.pd.prefill_replicas})
        out[model.served_name()] = (decode, replica_options(config, decode))
        options = replica_options(config, prefill) | {"name": "LLMServer-prefill"}
        out[model.served_name() + PREFILL_HANDLE_SUFFIX] = (prefill, options)
    return out


def build_app(args: ClusterConfig) -> serve.Application:
    config = args if isinstance(args, ClusterConfig) else ClusterConfig.model_validate(args)
    llm_apps = {}
    for key, (model, options) in llm_deployments(config).items():
        llm = serve.deployment(LLMServer).options(**options)
        llm_apps[key] = llm.bind(
            model.engine.model_dump(),
            kv_events=config.routing.kv_events,
            drain_migrate_after_s=drain_migrate_after_s(config),
            tracing=config.tracing.model_dump() if config.tracing.enabled else None,
        )
    ingress = make_ingress_deployment().options(
        num_replicas=config.http.ingress_replicas,
        ray_actor_options=ingress_actor_options(config),
        max_ongoing_requests=config.http.max_pending_requests + 64,
        graceful_shutdown_timeout_s=INGRESS_DRAIN_TIMEOUT_S,
    )
    # one handle per model, by served name (Serve finds the bound deployments inside the dict)
    return ingress.bind(llm_apps, ingress_settings(config))
