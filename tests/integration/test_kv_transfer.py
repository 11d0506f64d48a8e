"""KV transfer on real Ray Serve, across nodes: the multi-node test cluster (tests/helpers.py
`multinode_serve`: a head with no CPUs, two workers of one CPU, so each worker holds one
replica) runs two LLMServer replicas; a request sent to one with kv_fetch naming the other imports its prompt's cached prefix through Ray (counted in the importer's
metrics) and yields the same greedy tokens as the source computed; a fetch from a replica that
does not exist just recomputes (counted by reason); both replicas report their measured costs
in their routing stats; and the app still serves the official OpenAI client over HTTP."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from cluster.app import build_app  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from replica.contracts import GenerateRequest  # noqa: E402
from replica.kv_transfer import call_replica  # noqa: E402
from replica.request import EngineRequest, KVFetch, SamplingParams  # noqa: E402
from tests.helpers import free_port, multinode_serve, replica_actor_names  # noqa: E402

APP = "kv-transfer-test"
BLOCK = 16


def _config(model_dir, port: int) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "name": APP,
            "engine": {
                "model": str(model_dir),
                "dtype": "float32",
                "block_size": BLOCK,
                "max_model_len": 256,
                "max_num_seqs": 4,
                "num_kv_blocks": 32,
                "kv_offload_bytes": 1 << 22,
            },
            "replicas": 2,
            "num_cpus_per_replica": 1.0,  # a worker node holds one replica
            "http": {"host": "127.0.0.1", "port": port},
        }
    )


def _metric(text: bytes, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _call(replica_id: str, method: str, *args, timeout: float = 120):
    return ray.get(call_replica(APP, "LLMServer", replica_id, method, *args), timeout=timeout)


def _generate(replica_id: str, prompt, rid: str, fetch: KVFetch | None = None) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    request = GenerateRequest.of(EngineRequest(prompt, params, rid), kv_fetch=fetch)
    return list(_call(replica_id, "generate_all", request).new_token_ids)


def test_kv_fetch_between_replicas(tiny_llama_dir):
    port = free_port()
    prompt = [(7 * i) % 400 + 20 for i in range(100)]  # 6 full blocks of 16
    url = f"http://127.0.0.1:{port}"
    with multinode_serve(port, workers=2, worker_cpus=1.0):
        serve.run(build_app(_config(tiny_llama_dir, port)), name=APP, route_prefix="/")
        ids = sorted(replica_actor_names(APP))
        assert len(ids) == 2
        source, target = ids
        nodes = set()
        for rid in ids:
            stats = _call(rid, "stats")
            nodes.add(stats["node_id"])
            assert stats["prefill_tokens_per_s"] > 0 and stats["kv_transfer_bytes_per_s"] > 0
            assert stats["kv_bytes_per_block"] > 0
        assert len(nodes) == 2, "the replicas share a node: the fetch would not cross one"
        want = _generate(source, prompt, "src")
        got = _generate(target, prompt, "dst", KVFetch(source, 6))
        assert got == want
        metrics = _call(target, "metrics_text")
        assert _metric(metrics, "stepserve:kv_blocks_imported_total") == 6
        assert _metric(metrics, "stepserve:kv_tier_hit_tokens_total") == 6 * BLOCK
        assert _metric(_call(source, "metrics_text"), "stepserve:kv_blocks_exported_total") == 6
        # a source that is gone: recomputed, the same tokens, counted
        other = [(11 * i) % 400 + 20 for i in range(60)]
        want = _generate(source, other, "src2")
        assert _generate(target, other, "dst2", KVFetch("no-such-replica", 3)) == want
        metrics = _call(target, "metrics_text")
        assert _metric(metrics, "stepserve:kv_fetch_failures_total", reason="source_gone") == 1
        # the app serves as ever (official client, real HTTP)
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt="hello", max_tokens=4)
        assert out.choices[0].text is not None
