"""A tp=2 replica inside Ray Serve on loopback: rank 0 in the replica actor, rank 1 a Ray actor in
the replica's two-bundle placement group; it answers HTTP like the offline tp=1 engine, and when
its worker rank dies the in-flight request ends with an error and the replica turns unhealthy."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from cluster.app import build_app  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from tests.helpers import free_port, loopback_serve  # noqa: E402

APP = "stepserve-tp-test"
WORKER_CLASS = "RayRankWorker"


def engine_fields(model_dir) -> dict:
    return {
        "model": str(model_dir),
        "max_model_len": 512,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 32,  # prompts arrive in chunks: chunked prefill across ranks
        "num_kv_blocks": 128,
        "block_size": 8,
    }


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    port = free_port()
    config = ClusterConfig.model_validate(
        {
            "name": APP,
            "engine": {**engine_fields(tiny_llama_dir), "tensor_parallel_size": 2},
            "replicas": 1,
            "num_cpus_per_replica": 0.5,
            "http": {"host": "127.0.0.1", "port": port},
            "routing": {"stats_period_s": 0.5},
        }
    )
    with loopback_serve(port) as url:
        serve.run(build_app(config), name=APP, route_prefix="/")
        yield url


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    from replica.engine import LLM

    llm = LLM(**engine_fields(tiny_llama_dir), device="cpu")
    yield llm
    llm.shutdown()


def worker_actors(state: str = "ALIVE") -> list[dict]:
    from ray._private.state import actors

    return [
        a for a in actors().values() if a["ActorClassName"] == WORKER_CLASS and a["State"] == state
    ]


def test_tp2_replica_answers_http_like_the_offline_engine(cluster, offline):
    from replica.request import SamplingParams

    prompts = [
        "The quick brown fox",
        "A block table maps each request's positions to the blocks it holds, so memory is "
        "never fragmented and the key and value vectors",
        "Numbers such as 12",
    ]

    async def complete_all() -> list[dict]:
        async with httpx.AsyncClient(timeout=120) as client:
            responses = await asyncio.gather(
                *(
                    client.post(
                        f"{cluster}/v1/completions",
                        json={"prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True},
                    )
                    for p in prompts
                )
            )
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        return [r.json() for r in responses]

    bodies = asyncio.run(complete_all())
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = [o.text for o in offline.generate(prompts, params)]
    assert [b["choices"][0]["text"] for b in bodies] == expected


def test_the_replica_holds_a_two_bundle_placement_group_with_its_worker_rank(cluster):
    groups = [
        g
        for g in ray.util.placement_group_table().values()
        if g["state"] == "CREATED" and len(g["bundles"]) == 2
    ]
    assert len(groups) == 1, ray.util.placement_group_table()
    assert groups[0]["strategy"] == "STRICT_PACK"
    assert len(worker_actors()) == 1


def test_killing_the_worker_rank_errors_the_request_and_fails_the_health_check(cluster):
    (worker,) = worker_actors()
    events: list[dict] = []
    with httpx.stream(
        "POST",
        f"{cluster}/v1/completions",
        json={
            "prompt": "The key and value",
            "max_tokens": 480,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        },
        timeout=60,
    ) as response:
        assert response.status_code == 200
        started = None
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: ") :]))
            if started is None:  # generation is under way: take rank 1 down
                os.kill(worker["Pid"], signal.SIGKILL)
                started = time.monotonic()
    assert time.monotonic() - started < 30
    assert "error" in events[-1], events[-1]
    assert not any(c.get("finish_reason") == "length" for e in events for c in e.get("choices", []))

    handle = serve.get_deployment_handle("LLMServer", app_name=APP)
    with pytest.raises(Exception, match="rank 1"):
        handle.check_health.remote().result(timeout_s=30)
