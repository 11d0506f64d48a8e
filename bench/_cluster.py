"""A local stepserve cluster for benchmarks: one embedded Ray (loopback only) on which several
applications (one per configuration under test) are deployed side by side under their own
route prefixes, and per-replica counters read from the metrics hub. Wrap every command that
uses it in `flock /tmp/stepserve-ray.lock ...`."""

from __future__ import annotations

import time

import httpx

from bench import _models  # noqa: F401  (puts the repo root on sys.path)
from cluster.config import ClusterConfig
from tests.helpers import free_port

COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
)


class LocalCluster:
    """Starts Ray + Serve on 127.0.0.1 once; `deploy` adds an application under a prefix."""

    def __init__(self, num_cpus: int = 2, port: int | None = None) -> None:
        from ray import serve

        from cluster.cli import init_embedded_ray

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.apps: list[str] = []  # deployed, in order
        # the Ray Serve mode `stepserve serve` runs in, unless the environment says otherwise
        init_embedded_ray(num_cpus=num_cpus, logging_level="ERROR", log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})

    def config_http(self, config: ClusterConfig) -> ClusterConfig:
        """`config` with this cluster's HTTP port (the ingress checks nothing else of it)."""
        return config.model_copy(
            update={"http": config.http.model_copy(update={"port": self.port})}
        )

    def deploy(self, config: ClusterConfig, app: str, timeout_s: float = 600.0) -> str:
        """Deploy `config` as application `app` under route prefix /app; returns its base URL."""
        from ray import serve

        from cluster.app import build_app

        config = self.config_http(config).model_copy(update={"name": app})
        serve.run(build_app(config), name=app, route_prefix=f"/{app}", blocking=False)
        self.apps.append(app)
        base = f"{self.url}/{app}"
        deadline = time.time() + timeout_s
        while True:
            status = serve.status().applications.get(app)
            if status is not None and status.status == "RUNNING":
                break
            if status is not None and status.status == "DEPLOY_FAILED":
                raise RuntimeError(f"application {app} failed to deploy: {status.message}")
            if time.time() > deadline:
                raise TimeoutError(f"application {app} not running after {timeout_s} s")
            time.sleep(1.0)
        while httpx.get(f"{base}/health", timeout=60).status_code != 200:
            if time.time() > deadline:
                raise TimeoutError(f"{base}/health never answered 200")
            time.sleep(1.0)
        return base

    def replica_ids(self, app: str, expected: int, max_calls: int = 400) -> list[str]:
        """The LLM replicas of `app`, discovered through its handle (the router spreads the
        calls; ties are broken at random)."""
        from ray import serve

        handle = serve.get_deployment_handle("LLMServer", app_name=app)
        seen: set[str] = set()
        for _ in range(max_calls // 8):
            calls = [handle.stats.remote() for _ in range(8)]
            seen |= {call.result(timeout_s=60)["replica_id"] for call in calls}
            if len(seen) >= expected:
                break
        if len(seen) != expected:
            raise RuntimeError(f"found {len(seen)} replicas of {app}, expected {expected}")
        return sorted(seen)

    def replica_counters(self) -> dict[str, dict[str, float]]:
        """{replica id: {counter: value}} of every replica (of every application deployed
        here) that pushed metrics recently."""
        import ray
        from prometheus_client.parser import text_string_to_metric_families

        from replica.hub import find_hub

        hubs = [hub for hub in map(find_hub, self.apps) if hub is not None]
        texts = [text for hub in hubs for text in ray.get(hub.expositions.remote(30.0))]
        out: dict[str, dict[str, float]] = {}
        for text in texts:
            text = text.decode() if isinstance(text, bytes) else text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in COUNTERS:
                        per = out.setdefault(sample.labels["replica"], dict.fromkeys(COUNTERS, 0.0))
                        per[sample.name] += sample.value
        return out

    def settled_counters(self, wait_s: float = 2.5) -> dict[str, dict[str, float]]:
        """Counters after the replicas' next metrics push (they push every second)."""
        time.sleep(wait_s)
        return self.replica_counters()

    def shutdown(self) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def counter_deltas(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], replicas: list[str]
) -> dict[str, dict[str, float]]:
    """Per replica in `replicas`: after - before of every counter (0 for a silent replica)."""
    zero = dict.fromkeys(COUNTERS, 0.0)
    return {
        rid: {k: after.get(rid, zero)[k] - before.get(rid, zero)[k] for k in COUNTERS}
        for rid in replicas
    }
