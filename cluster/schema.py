"""The Helm chart's values.schema.json, generated: `python -m cluster.schema` (or `make schema`)
writes it, `python -m cluster.schema --check` fails when the committed file is stale.

The chart's values hold two kinds of keys (helm/stepserve/values.yaml):
  snake_case keys are ClusterConfig's fields; their schema is ClusterConfig.model_json_schema()
    with the nested models inlined (draft-07 ignores keywords beside a $ref), so every limit of
    a pydantic Field (ge/le/gt, Literal choices, patterns, extra="forbid") is the chart's too.
  camelCase keys are the chart's own Kubernetes settings, written by hand in CHART_VALUES below,
    together with the few places where the chart takes a ClusterConfig field differently
    (set by the chart itself, another default, keys that never reach ClusterConfig).
A field added to a config model thus reaches the chart by regenerating the schema, nothing else.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import sys
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig

REPO = Path(__file__).resolve().parents[1]
SCHEMA_PATH = REPO / "helm" / "stepserve" / "values.schema.json"
REGENERATE = "`make schema` (or `.venv/bin/python -m cluster.schema`)"

# Removes a key of ClusterConfig's schema in CHART_VALUES.
DROP = object()

# ---------------------------------------------------------------------------------------------
# The hand-written part: the chart's own keys and its deviations from ClusterConfig
# ---------------------------------------------------------------------------------------------

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_OBJECTS = {"type": "array", "items": {"type": "object"}}
_NAMED_OBJECTS = {"type": "array", "items": {"type": "object", "required": ["name"]}}
_PULL_POLICY = {"enum": ["Always", "IfNotPresent", "Never"]}
_DURATION = {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}


def _closed(properties: dict, **keywords: Any) -> dict:
    """An object with exactly these (optional) keys."""
    return {"type": "object", **keywords, "additionalProperties": False, "properties": properties}


_RESOURCES = _closed(
    {"requests": {"type": "object"}, "limits": {"type": "object"}, "claims": {"type": "array"}},
    description="Kubernetes container resources (requests/limits).",
)
_RAY_START_PARAMS = {
    "type": "object",
    "description": "Extra `ray start` parameters (values become strings).",
    "additionalProperties": {"type": ["string", "number", "boolean"]},
}
# What a worker group may set, and workerGroupDefaults with it (all but the name and pod counts).
_WORKER_GROUP_SETTINGS = {
    "replicasPerPod": {"type": "integer", "minimum": 1, "description": "Serve replicas per pod."},
    "idleTimeoutSeconds": {"type": ["integer", "null"], "minimum": 0},
    "resources": _RESOURCES,
    "sharedMemorySize": {"type": ["string", "null"]},
    "nodeSelector": _STRING_MAP,
    "tolerations": _OBJECTS,
    "affinity": {"type": "object"},
    "rayStartParams": _RAY_START_PARAMS,
}
_PROBES = _closed({"readinessProbe": {"type": "object"}, "livenessProbe": {"type": "object"}})
_MONITOR = _closed(
    {
        "enabled": {"type": "boolean"},
        "labels": _STRING_MAP,
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
    }
)

# Merged into the schema generated from ClusterConfig: a dict merges key by key, DROP removes
# the key, anything else replaces it.
CHART_VALUES: dict[str, Any] = {
    "title": "stepserve chart values",
    "properties": {
        "global": {"type": "object"},  # Helm's own, for subcharts
        "engine": {
            "description": "ClusterConfig.engine; engine.model is set by the chart from `model`.",
            "properties": {
                "model": DROP,
                "device": {
                    "default": "cuda",
                    "description": "cuda in the chart (ClusterConfig: auto): each replica then "
                    "reserves tensor_parallel_size GPUs.",
                },
            },
        },
        "http": {
            "description": "ClusterConfig.http; host and port are fixed by the chart (0.0.0.0:8000).",
            "properties": {"host": DROP, "port": DROP},
        },
        "auth": {
            "description": "ClusterConfig.auth.api_keys_env plus where the keys come from; key "
            "values never go into serveConfigV2.",
            "properties": {
                "api_keys": DROP,
                "apiKeys": {
                    "type": "array",
                    "items": {"type": "string", "pattern": "^[^,\\s]+$"},
                    "description": "Keys the chart stores in a Secret (no commas or spaces).",
                },
                "existingSecret": {"type": "string"},
                "existingSecretKey": {"type": "string", "minLength": 1},
            },
        },
        # ---- Kubernetes settings of the chart -----------------------------------------------
        "nameOverride": {"type": "string"},
        "fullnameOverride": {"type": "string"},
        "image": _closed(
            {
                "repository": {"type": "string", "minLength": 1},
                "tag": {"type": "string"},
                "pullPolicy": _PULL_POLICY,
            }
        ),
        "imagePullSecrets": _NAMED_OBJECTS,
        "rayVersion": {
            "type": "string",
            "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+",
            "description": "Ray version of the image (KubeRay uses it to configure the cluster).",
        },
        "model": _closed(
            {
                "source": {
                    "enum": ["default", "pvc", "init"],
                    "description": "default: the bundled model; pvc: a PersistentVolumeClaim; "
                    "init: an emptyDir filled by an init container.",
                },
                "mountPath": {"type": "string", "pattern": "^/"},
                "subPath": {"type": "string"},
                "mountOnHead": {"type": "boolean"},
                "pvc": _closed(
                    {
                        "existingClaim": {"type": "string"},
                        "create": {"type": "boolean"},
                        "size": {"type": "string", "minLength": 1},
                        "storageClassName": {"type": "string"},
                        "accessModes": {
                            "type": "array",
                            "minItems": 1,
                            "items": {
                                "enum": [
                                    "ReadWriteOnce",
                                    "ReadOnlyMany",
                                    "ReadWriteMany",
                                    "ReadWriteOncePod",
                                ]
                            },
                        },
                    }
                ),
                "init": _closed(
                    {
                        "image": {"type": "string"},
                        "imagePullPolicy": _PULL_POLICY,
                        "command": {"type": "array", "items": {"type": "string"}},
                        "args": {"type": "array", "items": {"type": "string"}},
                        "env": _NAMED_OBJECTS,
                        "envFrom": _OBJECTS,
                        "resources": _RESOURCES,
                        "sizeLimit": {"type": "string"},
                    }
                ),
            },
            # source: init needs a command that fills the volume
            allOf=[
                {
                    "if": {"properties": {"source": {"const": "init"}}},
                    "then": {"properties": {"init": {"properties": {"command": {"minItems": 1}}}}},
                }
            ],
        ),
        "env": _NAMED_OBJECTS,
        "podLabels": _STRING_MAP,
        "podAnnotations": _STRING_MAP,
        "serviceAccountName": {"type": "string"},
        "head": _closed(
            {
                "rayStartParams": _RAY_START_PARAMS,
                "resources": _RESOURCES,
                "nodeSelector": _STRING_MAP,
                "tolerations": _OBJECTS,
                "affinity": {"type": "object"},
            }
        ),
        "workerGroups": {
            "type": "array",
            "minItems": 1,
            "description": "GPU worker groups; each pod requests tensor_parallel_size x "
            "replicasPerPod GPUs.",
            "items": _closed(
                {
                    "name": {
                        "type": "string",
                        "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                        "maxLength": 20,
                    },
                    "minReplicas": {
                        "type": ["integer", "null"],
                        "minimum": 0,
                        "description": "Pods; null: derived from the replica counts.",
                    },
                    "maxReplicas": {
                        "type": ["integer", "null"],
                        "minimum": 1,
                        "description": "Pods; null: derived from the replica counts.",
                    },
                    **_WORKER_GROUP_SETTINGS,
                },
                required=["name"],
            ),
        },
        "workerGroupDefaults": _closed(
            _WORKER_GROUP_SETTINGS,
            description="Settings every worker group takes unless it sets them itself.",
        ),
        "probes": _closed({"head": _PROBES, "worker": _PROBES}),
        "rayAutoscaler": _closed(
            {
                "idleTimeoutSeconds": {"type": "integer", "minimum": 0},
                "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
                "resources": _RESOURCES,
            }
        ),
        "rayService": _closed({"upgradeStrategy": {"enum": ["NewCluster", "None"]}}),
        "service": _closed(
            {
                "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                "annotations": _STRING_MAP,
                "labels": _STRING_MAP,
            }
        ),
        "monitoring": _closed(
            {
                "appMetricsPort": {
                    "type": "integer",
                    "minimum": 1024,
                    "maximum": 65535,
                    "description": "Port of the vllm:* and stepserve:* metrics on worker pods "
                    "(STEPSERVE_METRICS_PORT, container port app-metrics).",
                },
                "podMonitor": _MONITOR,
                "serviceMonitor": _MONITOR,
            }
        ),
    },
}

# ---------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------


def cluster_config_schema() -> dict:
    """ClusterConfig's JSON schema as draft-07 that Helm validates well: nested models inlined,
    pydantic's titles dropped, `anyOf: [X, null]` folded into `type: [X, "null"]` (one clear
    error message instead of anyOf's)."""
    raw = ClusterConfig.model_json_schema()
    defs = raw.pop("$defs", {})
    return _tidy(raw, defs)


def _tidy(node: Any, defs: dict) -> Any:
    if isinstance(node, list):
        return [_tidy(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = node["$ref"].removeprefix("#/$defs/")
        node = {**defs[name], **{k: v for k, v in node.items() if k != "$ref"}}
    out: dict = {}
    for key, value in node.items():
        if key == "title":
            continue
        if key in ("properties", "$defs"):  # maps of names: their keys are not keywords
            out[key] = {name: _tidy(sub, defs) for name, sub in value.items()}
        elif key in ("default", "enum", "const", "examples"):  # values, not schemas
            out[key] = value
        else:
            out[key] = _tidy(value, defs)
    return _fold_nullable(out)


def _fold_nullable(node: dict) -> dict:
    alternatives = node.get("anyOf")
    if not alternatives or len(alternatives) != 2 or {"type": "null"} not in alternatives:
        return node
    (other,) = [alt for alt in alternatives if alt != {"type": "null"}]
    if not isinstance(other.get("type"), str) or other["type"] in ("object", "array"):
        return node
    folded = {k: v for k, v in node.items() if k != "anyOf"}
    folded = {**other, **folded, "type": [other["type"], "null"]}
    if "enum" in folded:
        folded["enum"] = [*folded["enum"], None]
    return folded


def _merge(base: Any, overlay: Any) -> Any:
    if not (isinstance(base, dict) and isinstance(overlay, dict)):
        return copy.deepcopy(overlay)
    out = dict(base)
    for key, value in overlay.items():
        if value is DROP:
            out.pop(key, None)
        else:
            out[key] = _merge(base[key], value) if key in base else _merge(None, value)
    return out


def _ordered(node: Any) -> Any:
    """Keywords in a readable order: type, description and default first."""
    if isinstance(node, list):
        return [_ordered(item) for item in node]
    if not isinstance(node, dict):
        return node
    first = [
        k for k in ("$schema", "$comment", "title", "type", "description", "default") if k in node
    ]
    rest = [k for k in node if k not in first]
    out = {}
    for key in first + rest:
        value = node[key]
        if key == "properties":
            out[key] = {name: _ordered(sub) for name, sub in value.items()}
        else:
            out[key] = _ordered(value)
    return out


def values_schema() -> dict:
    """The chart's values.schema.json, as a dict."""
    schema = _merge(cluster_config_schema(), CHART_VALUES)
    schema.pop("description", None)  # ClusterConfig has no docstring; the title says it
    header = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$comment": "Generated by `python -m cluster.schema` from ClusterConfig "
        "(cluster/config.py) and the chart keys in cluster/schema.py; do not edit by hand.",
    }
    properties = schema.pop("properties")
    # Helm's `global` first, then ClusterConfig's fields, then the chart's own keys
    ordered = {"global": properties.pop("global"), **properties}
    return _ordered({**header, **schema, "properties": ordered})


def render(schema: dict) -> str:
    """JSON, 2-space indented, with arrays of scalars on one line."""
    return _dump(schema, 0) + "\n"


def _dump(value: Any, level: int) -> str:
    pad, inner = "  " * level, "  " * (level + 1)
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k)}: {_dump(v, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, list) and value and any(isinstance(v, (dict, list)) for v in value):
        items = [inner + _dump(v, level + 1) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    if isinstance(value, list):
        return "[" + ", ".join(json.dumps(v, ensure_ascii=False) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def stale_diff(path: Path = SCHEMA_PATH) -> str:
    """Empty when the file at `path` is what the generator writes; else a unified diff."""
    wanted = render(values_schema())
    current = path.read_text() if path.exists() else ""
    if current == wanted:
        return ""
    return "".join(
        difflib.unified_diff(
            current.splitlines(keepends=True),
            wanted.splitlines(keepends=True),
            f"{path.name} (committed)",
            f"{path.name} (generated)",
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.schema", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the file is stale")
    parser.add_argument("--output", type=Path, default=SCHEMA_PATH)
    args = parser.parse_args(argv)
    if args.check:
        diff = stale_diff(args.output)
        if diff:
            sys.stderr.write(diff)
            print(f"{args.output} is stale: run {REGENERATE}", file=sys.stderr)
            return 1
        print(f"{args.output} is up to date")
        return 0
    args.output.write_text(render(values_schema()))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
