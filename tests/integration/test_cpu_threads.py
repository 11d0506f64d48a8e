"""Torch threads of CPU replicas: how many (explicit, Ray's CPUs per replica, or the usable
cores shared among replicas, cgroup limits included), that the engine thread itself applies a
new count, and that a replica-count change reaches running replicas in place (Serve's
user_config) instead of replacing them."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.app import build_app, replica_options, thread_settings
from cluster.config import ClusterConfig
from replica import deployment
from replica.config import EngineConfig
from replica.deployment import _cgroup_cpu_quota, resolve_cpu_threads, usable_cpus
from replica.engine import AsyncEngine, Engine
from replica.request import SamplingParams
from tests.helpers import engine_request


def test_thread_count_explicit_then_ray_cpus_then_shared_usable_cores(monkeypatch):
    monkeypatch.setattr(deployment, "usable_cpus", lambda: 8)
    settings = {"cpu_threads": None, "num_cpus_per_replica": 0.5, "replicas_per_machine": 3}
    assert resolve_cpu_threads(settings) == 2  # 8 cores among 3 replicas
    assert resolve_cpu_threads({**settings, "replicas_per_machine": 1}) == 8
    assert resolve_cpu_threads({**settings, "replicas_per_machine": 16}) == 1  # at least one
    assert resolve_cpu_threads({**settings, "num_cpus_per_replica": 4.5}) == 4  # owns 4 cores
    assert resolve_cpu_threads({**settings, "cpu_threads": 5}) == 5


def test_build_app_sends_threads_in_user_config_not_in_init_args():
    one = ClusterConfig(replicas=1)
    three = ClusterConfig(replicas=3, cpu_threads_per_replica=2)
    assert replica_options(one)["user_config"] == {
        "cpu_threads": None,
        "num_cpus_per_replica": 0.5,
        "replicas_per_machine": 1,
    }
    assert replica_options(three)["user_config"]["cpu_threads"] == 2
    auto = ClusterConfig(autoscaling={"enabled": True, "max_replicas": 6})
    assert thread_settings(auto)["replicas_per_machine"] == 6  # the most that may share
    # the LLM deployment's constructor gets the engine config only: nothing that a
    # replica-count change moves
    for config in (one, three):
        # the ingress is bound to the LLM deployment of each model, by served name
        (llm_app,) = build_app(config)._bound_deployment.init_args[0].values()
        assert llm_app._bound_deployment.init_args == (config.engine.model_dump(),)


@pytest.mark.parametrize(
    "files, expected",
    [
        ({"cpu.max": "200000 100000\n"}, 2),
        ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: rounded up
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_cgroup_cpu_limit_v2_and_v1(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert _cgroup_cpu_quota(tmp_path) == expected


def test_usable_cpus_is_capped_by_the_cgroup_limit(monkeypatch):
    monkeypatch.setattr(deployment.os, "sched_getaffinity", lambda _pid: set(range(64)))
    monkeypatch.setattr(deployment, "_cgroup_cpu_quota", lambda: 8)
    assert usable_cpus() == 8
    monkeypatch.setattr(deployment, "_cgroup_cpu_quota", lambda: None)
    assert usable_cpus() == 64


def test_the_engine_thread_applies_a_new_thread_count_before_its_next_step(tiny_llama_dir):
    import torch

    engine = Engine(
        EngineConfig(model=str(tiny_llama_dir), device="cpu", block_size=4, num_kv_blocks=64)
    )
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    caller_threads = torch.get_num_threads()

    async def main() -> list[int]:
        async_engine = AsyncEngine(engine)
        seen = []
        try:
            with pytest.raises(ValueError, match="num_threads must be >= 1, got 0"):
                async_engine.set_num_threads(0)
            for threads in (1, 3, 2):
                async_engine.set_num_threads(threads)
                async for _ in async_engine.generate(engine_request([5, 6, 7], params)):
                    pass
                seen.append(async_engine.num_threads)
        finally:
            async_engine.shutdown()
        return seen

    assert asyncio.run(asyncio.wait_for(main(), timeout=120)) == [1, 3, 2]
    torch.set_num_threads(caller_threads)


# -- on loopback: Serve's in-place update ----------------------------------------------------


@pytest.mark.ray
def test_a_replica_count_change_reaches_running_replicas_in_place(tiny_llama_dir, shared_serve):
    """The path of `helm upgrade --set replicas=2` (the chart's deployment override) or of
    `serve deploy` with a new num_replicas: the running replica stays (no model reload) and
    takes the new auto thread count; the new replica starts with it."""
    pytest.importorskip("ray")
    cores = usable_cpus()
    if cores < 2:
        pytest.skip("with one usable core the auto thread count is 1 for any replica count")
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from tests.helpers import replica_stats

    app, port = "threads-in-place", shared_serve.port
    args = {
        "name": app,
        "engine": {"model": str(tiny_llama_dir), "max_model_len": 256, "num_kv_blocks": 64},
        "num_cpus_per_replica": 0.5,
        "http": {"host": "127.0.0.1", "port": port},
    }

    def deploy(replicas: int) -> None:
        user_config = {**thread_settings(ClusterConfig(**args)), "replicas_per_machine": replicas}
        config = {
            "applications": [
                {
                    "name": app,
                    "route_prefix": "/",
                    "import_path": "cluster.app:build_app",
                    "args": args,
                    "deployments": [
                        {"name": "LLMServer", "num_replicas": replicas, "user_config": user_config}
                    ],
                }
            ]
        }
        _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))
        deadline = time.time() + 180
        while time.time() < deadline:
            status = serve.status().applications.get(app)
            llm = status.deployments.get("LLMServer") if status else None
            if (
                status is not None
                and status.status == "RUNNING"
                and llm is not None
                and dict(llm.replica_states) == {"RUNNING": replicas}
            ):
                return
            time.sleep(0.5)
        raise AssertionError(f"{app} not running {replicas} replicas: {serve.status()}")

    def threads_by_replica(replicas: int, want: int) -> dict[str, int]:
        deadline = time.time() + 30  # the engine thread applies a new count within a second
        while True:
            seen = {rid: s["cpu_threads"] for rid, s in replica_stats(app, replicas).items()}
            if len(seen) == replicas and set(seen.values()) == {want}:
                return seen
            if time.time() > deadline:
                return seen
            time.sleep(0.5)

    deploy(1)
    first = threads_by_replica(1, cores)
    assert list(first.values()) == [cores], first
    deploy(2)
    both = threads_by_replica(2, max(1, cores // 2))
    assert set(first) < set(both), f"replica {set(first)} was replaced: now {set(both)}"
    assert set(both.values()) == {max(1, cores // 2)}, both
