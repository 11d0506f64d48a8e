"""The replica's side of a drain that migrates (replica/deployment.py): once Serve begins its
shutdown and drain_migrate_after_s has passed, a replica ends its unfinished streams with
ReplicaDraining, which crosses processes whole and which the ingress continues elsewhere; a
stream still waiting for its first output is handed back too. A fake engine; the real
drain is tests/integration/test_migration.py's scale-down."""

from __future__ import annotations

import asyncio
import pickle
import threading
import time

import pytest

pytest.importorskip("ray")

from cluster.app import REPLICA_DRAIN_TIMEOUT_S, drain_migrate_after_s  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from replica import deployment  # noqa: E402
from replica.api import GenerateRequest, ReplicaDraining, RequestOutput  # noqa: E402
from replica.deployment import LLMServer  # noqa: E402
from replica.request import SamplingParams  # noqa: E402
from router.errors import classify_error, lost_replica, replica_handed_back  # noqa: E402


class Engine:
    """Streams one token per `step_s` (after `first_s`), up to `n`."""

    def __init__(self, n: int = 1000, step_s: float = 0.01, first_s: float = 0.0) -> None:
        self.n, self.step_s, self.first_s = n, step_s, first_s
        self.closed: list[str] = []

    async def generate(self, request):
        try:
            await asyncio.sleep(self.first_s)
            for i in range(self.n):
                await asyncio.sleep(self.step_s)
                yield RequestOutput(request.request_id, [i], f"{i} ", 1, i + 1)
        finally:
            self.closed.append(request.request_id)


def server(engine: Engine, monkeypatch, shutting_down: threading.Event) -> LLMServer:
    llm = object.__new__(LLMServer)
    llm.engine, llm.replica_id = engine, "replica-a"
    llm._metrics_stop = threading.Event()
    llm._hands_back = True  # as __init__ sets it when it starts the watcher
    monkeypatch.setattr(deployment, "SHUTDOWN_POLL_S", 0.01)
    monkeypatch.setattr(deployment, "serve_shutting_down", shutting_down.is_set)
    monkeypatch.setattr(deployment, "successor_running", lambda: True)
    return llm


def request(rid: str) -> GenerateRequest:
    return GenerateRequest([1], SamplingParams(temperature=0.0, max_tokens=1000), rid)


async def read(llm: LLMServer, rid: str, got: list) -> BaseException | None:
    try:
        async for out in llm.generate(request(rid)):
            got.append(out)
    except ReplicaDraining as exc:
        return exc
    return None


def test_a_draining_replica_hands_its_unfinished_streams_back_after_the_grace(monkeypatch):
    shutting_down = threading.Event()
    llm = server(Engine(), monkeypatch, shutting_down)
    threading.Thread(target=llm._watch_shutdown, args=(0.2,), daemon=True).start()
    running: list = []

    async def scenario():
        task = asyncio.ensure_future(read(llm, "running", running))
        while len(running) < 5:
            await asyncio.sleep(0.01)
        shutting_down.set()  # Serve begins the drain: streams go on for the grace first
        await asyncio.sleep(0.1)
        assert not task.done()
        return await asyncio.wait_for(task, timeout=30)

    exc = asyncio.run(scenario())
    try:
        assert isinstance(exc, ReplicaDraining), exc
        assert 5 < len(running) < 1000  # it ran on during the grace, then was handed back
        assert llm.engine.closed == ["running"]  # its engine request was aborted, blocks freed
        assert replica_handed_back(exc) and lost_replica(exc) == "replica-a"
        # it crosses Ray pickled, the replica's id with it
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is ReplicaDraining and again.replica_id == "replica-a"
        assert str(again) == str(exc)
        # should it reach a client (nothing to continue from), it is a 503, not a 500
        assert classify_error(again).status == 503
    finally:
        llm._metrics_stop.set()


def test_a_stream_before_its_first_output_is_handed_back_at_once(monkeypatch):
    shutting_down = threading.Event()
    llm = server(Engine(first_s=3600), monkeypatch, shutting_down)
    threading.Thread(target=llm._watch_shutdown, args=(0.0,), daemon=True).start()
    waiting: list = []

    async def scenario():
        task = asyncio.ensure_future(read(llm, "queued", waiting))
        await asyncio.sleep(0.05)
        shutting_down.set()
        return await asyncio.wait_for(task, timeout=30)

    try:
        exc = asyncio.run(scenario())
        assert isinstance(exc, ReplicaDraining), exc
        assert not any(isinstance(o, RequestOutput) for o in waiting)  # an Accepted at most
        assert llm.engine.closed == ["queued"]
    finally:
        llm._metrics_stop.set()


def test_with_no_replica_to_take_them_the_streams_are_not_handed_back(monkeypatch):
    """The whole application deleted (SIGTERM): no other replica runs, so a hand-back would
    cut the streams; the drain waits for them until one runs."""
    shutting_down, successor = threading.Event(), threading.Event()
    llm = server(Engine(n=60, step_s=0.02), monkeypatch, shutting_down)
    monkeypatch.setattr(deployment, "SUCCESSOR_POLL_S", 0.01)
    monkeypatch.setattr(deployment, "successor_running", successor.is_set)
    threading.Thread(target=llm._watch_shutdown, args=(0.0,), daemon=True).start()
    got: list = []

    async def scenario():
        task = asyncio.ensure_future(read(llm, "last", got))
        while not got:
            await asyncio.sleep(0.01)
        shutting_down.set()
        return await asyncio.wait_for(task, timeout=30)

    try:
        assert asyncio.run(scenario()) is None  # it ran to its end
        assert len(got) == 60 and not llm._handing_back
        successor.set()  # a replica runs again: what is left is handed back
        deadline = time.monotonic() + 30
        while not llm._handing_back:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        llm._metrics_stop.set()


def test_no_hand_back_without_migration():
    def config(**http) -> ClusterConfig:
        return ClusterConfig.model_validate({"http": http})

    assert drain_migrate_after_s(config()) == 5.0
    assert drain_migrate_after_s(config(drain_migrate_after_s=1.5)) == 1.5
    assert drain_migrate_after_s(config(migration_limit=0)) is None
    assert drain_migrate_after_s(config(drain_migrate_after_s=None)) is None
    assert drain_migrate_after_s(config(drain_migrate_after_s=REPLICA_DRAIN_TIMEOUT_S)) is None
