"""`stepserve serve --address` on a two-node cluster on this machine (a head with no CPUs, as
the chart's head, and one worker): Serve runs its HTTP proxy on the head only, even with a
replica on the worker, where Serve's default (EveryNode) would start one more; a later server
asking for every_node is told that the running Serve keeps its location."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from cluster import app as cluster_app  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from cluster.embedded import start  # noqa: E402
from tests.helpers import MultiNode, free_port, zero_cpu_head_cluster  # noqa: E402


@serve.deployment(ray_actor_options={"num_cpus": 1})  # the head has none: on the worker
class NodeOfReplica:
    """Stands in for the application (no model to load): answers with its node's id."""

    def __call__(self, request) -> str:
        return ray.get_runtime_context().get_node_id()


def test_address_mode_puts_the_http_proxy_on_the_head_only(monkeypatch, capsys):
    cluster = zero_cpu_head_cluster()
    worker = MultiNode(cluster, worker_cpus=1).add_worker()
    head_id = cluster.head_node.node_id
    port = free_port()
    config = ClusterConfig.model_validate(
        {"name": "proxy-placement", "http": {"host": "127.0.0.1", "port": port}}
    )
    assert config.http.proxy_location == "head"
    monkeypatch.setattr(cluster_app, "build_app", lambda config: NodeOfReplica.bind())
    try:
        url = start(config, cluster.address)  # as `stepserve serve --address` does
        assert url == f"http://127.0.0.1:{port}"
        # the replica is on the worker, and answers through the head's proxy
        answer = httpx.get(f"{url}/", timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.text.strip('"') == worker.node_id != head_id
        assert set(serve.status().proxies) == {head_id}
        from ray.serve.context import _get_global_client

        controller = _get_global_client()._controller
        assert ray.get(controller.get_proxy_location.remote()) == "HeadOnly"
        # a second server asking for every_node on this running Serve is told it keeps HeadOnly
        capsys.readouterr()
        http = config.http.model_copy(update={"proxy_location": "every_node"})
        start(config.model_copy(update={"http": http}), cluster.address)
        assert "proxy_location HeadOnly (not EveryNode)" in capsys.readouterr().err
        assert set(serve.status().proxies) == {head_id}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
