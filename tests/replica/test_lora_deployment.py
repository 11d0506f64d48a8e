"""The Serve replica's LoRA methods (LLMServer.load_lora / unload_lora / list_loras, the
`lora` entry of model_info, RoutingStats.loras) over both engine transports: the engine on a
thread of the replica and the engine core in a process of its own. The replica object is
built without Ray Serve around it (as tests/replica/test_stream_start.py does)."""

from __future__ import annotations

import asyncio
import time

import pytest

from replica.config import EngineConfig
from replica.contracts import PreemptionRate
from replica.deployment import LLMServer
from replica.engine import AsyncEngine, Engine
from replica.engine.core_client import ProcessEngine
from replica.errors import LoRAError
from tests.replica.lora_helpers import make_adapters
from tests.replica.test_lora_parity import LORA_FIELDS


def replica(config: EngineConfig, core_process: bool) -> LLMServer:
    server = object.__new__(LLMServer)
    server.config = config
    server.core_process = core_process
    server.engine = ProcessEngine(config) if core_process else AsyncEngine(Engine(config))
    server.replica_id, server.startup_s = "test-replica", {}
    server._preemptions = PreemptionRate(5.0)
    return server


@pytest.mark.parametrize("core_process", [False, True], ids=["thread", "process"])
def test_replica_loads_lists_and_unloads_adapters(core_process, tiny_llama_dir, tmp_path_factory):
    adapters = make_adapters(tiny_llama_dir, tmp_path_factory.mktemp("deployment-adapters"))
    a = adapters["attn4"]
    config = EngineConfig(
        model=str(tiny_llama_dir), **LORA_FIELDS | {"max_cpu_loras": 6}, max_model_len=256
    )
    server = replica(config, core_process)

    async def body():
        info = await server.load_lora(a.name, a.path)
        assert info["name"] == "attn4" and info["rank"] == 4 and info["load_s"] > 0
        assert await server.list_loras() == ["attn4"]
        with pytest.raises(LoRAError, match="does not exist"):
            await server.load_lora("nope", "/nowhere")
        deadline = time.monotonic() + 10
        while server.routing_stats().loras != ("attn4",):  # as of the engine's last report
            assert time.monotonic() < deadline, server.routing_stats()
            await asyncio.sleep(0.05)
        assert await server.unload_lora("attn4") is True
        assert await server.unload_lora("attn4") is False
        assert await server.list_loras() == []

    try:
        asyncio.run(asyncio.wait_for(body(), 120))
        assert server.model_info()["lora"] == {
            "enabled": True,
            "max_loras": 4,
            "max_lora_rank": 8,
            "max_cpu_loras": 6,
        }
    finally:
        server.engine.shutdown()
