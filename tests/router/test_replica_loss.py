"""A lost or full replica, from the ingress's side: a call whose replica actor died before its
first output is sent again (router/fanout.py), a stream already under way is not when migration
is off (tests/router/test_migration.py: when it is on); one refused
by a full replica is sent again for a while; the router skips a replica its calls found dead or
unreachable (router/request_router.py). Fake handles and replicas: the real thing is
tests/integration/test_multinode.py's node loss and tests/integration/test_reliability.py's burst."""

from __future__ import annotations

import asyncio
import types

import pytest

pytest.importorskip("ray")

from replica.request import EngineOverloaded, EngineRequest, SamplingParams  # noqa: E402
from router import fanout  # noqa: E402
from router.fanout import MAX_SENDS, ReplicaCalls  # noqa: E402
from router.migration import Migrations  # noqa: E402
from router.policy import Policy, RoutingConfig  # noqa: E402
from router.request_router import LoadAwareRouter  # noqa: E402
from tests.helpers import cancel_after_first  # noqa: E402


class ActorDiedError(Exception):  # what Ray raises, matched by name (router/errors.py)
    pass


class Out:
    def __init__(self, token: int) -> None:
        self.token, self.num_cached_tokens = token, 0
        self.new_token_ids, self.new_text, self.finished = [token], f"t{token}", False
        self.prompt_logprobs = None


class FakeHandle:
    """A deployment handle whose calls fail as the script says: per send, the number of
    outputs before the failure (None: no failure) and the exception."""

    def __init__(self, script: list[tuple[int | None, type[BaseException]]]) -> None:
        self.script, self.sends = list(script), []
        self.generate = types.SimpleNamespace(remote=self._stream)
        self.generate_all = types.SimpleNamespace(remote=self._unary)

    def options(self, stream: bool = False) -> FakeHandle:
        return self

    def _next(self, request) -> tuple[int | None, type[BaseException]]:
        self.sends.append(request.request_id)
        return self.script.pop(0) if self.script else (None, Exception)

    async def _stream(self, request):
        fail_after, exc = self._next(request)
        for i in range(3):
            if fail_after is not None and i == fail_after:
                raise exc("replica gone")
            yield Out(i)

    async def _unary(self, request):
        fail_after, exc = self._next(request)
        if fail_after is not None:
            raise exc("replica gone")
        return Out(7)


@pytest.fixture(autouse=True)
def no_pause(monkeypatch):
    monkeypatch.setattr(fanout, "RETRY_PAUSE_S", 0.0)


def calls(script, migration_limit: int = 3) -> tuple[ReplicaCalls, FakeHandle]:
    handle = FakeHandle(script)
    migrations = Migrations(migration_limit)
    return ReplicaCalls(handle, Policy(RoutingConfig()), 16, migrations), handle


def choice(prompt: list[int]) -> EngineRequest:
    return EngineRequest(prompt, params(), "")


def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=3)


def collect(calls_: ReplicaCalls) -> list[int]:
    async def run() -> list[int]:
        return [out.token async for out in calls_.one_stream(choice([1, 2, 3]))]

    return asyncio.run(run())


def test_a_stream_whose_replica_died_before_its_first_output_is_sent_again():
    c, handle = calls([(0, ActorDiedError)])
    assert collect(c) == [0, 1, 2]
    assert len(handle.sends) == 2 and handle.sends[0] != handle.sends[1]  # a new request id
    assert c.retries == 1


def test_a_stream_under_way_is_not_sent_again_when_migration_is_off():
    """http.migration_limit = 0; with migration on, tests/router/test_migration.py."""
    c, handle = calls([(1, ActorDiedError)], migration_limit=0)
    with pytest.raises(ActorDiedError):
        collect(c)
    assert len(handle.sends) == 1 and c.retries == 0


def test_an_error_of_the_request_is_not_retried():
    c, handle = calls([(0, ValueError)])
    with pytest.raises(ValueError):
        collect(c)
    assert len(handle.sends) == 1


def test_sends_are_bounded():
    c, handle = calls([(0, ActorDiedError)] * (MAX_SENDS + 2))
    with pytest.raises(ActorDiedError):
        collect(c)
    assert len(handle.sends) == MAX_SENDS and c.retries == MAX_SENDS - 1


def test_a_call_refused_by_a_full_replica_is_sent_again_for_a_while(monkeypatch):
    c, handle = calls([(0, EngineOverloaded)] * 4)
    assert collect(c) == [0, 1, 2]  # the fifth send was taken
    assert len(handle.sends) == 5 and c.retries == 4
    monkeypatch.setattr(fanout, "FULL_RETRY_S", 0.0)  # no time left: the refusal stands
    c, handle = calls([(0, EngineOverloaded)])
    with pytest.raises(EngineOverloaded):
        collect(c)
    assert len(handle.sends) == 1


def test_unary_calls_are_sent_again_each_on_its_own():
    c, handle = calls([(0, ActorDiedError), (None, Exception), (0, ActorDiedError)])
    jobs = [(0, choice([1, 2])), (1, choice([3, 4]))]
    results = asyncio.run(c.complete_all(jobs))
    assert sorted(i for i, _ in results) == [0, 1]
    assert all(out.token == 7 for _, out in results)
    assert len(handle.sends) == 4 and c.retries == 2


def replica(uid: str, ts: float | None):
    stats = None if ts is None else {"replica_id": uid, "ts": ts}
    return types.SimpleNamespace(
        replica_id=types.SimpleNamespace(unique_id=uid), routing_stats=stats or {}
    )


def test_the_router_skips_lost_replicas_until_they_answer_again():
    a, b = replica("a", 10.0), replica("b", 10.0)
    router = types.SimpleNamespace(_lost={})
    reachable = LoadAwareRouter._reachable.__get__(router)
    assert reachable([a, b]) == [a, b]
    # a call found "a" unreachable: skipped while its stats are those it had then
    router._lost["a"] = 10.0
    assert reachable([a, b]) == [b]
    a.routing_stats = {"replica_id": "a", "ts": 11.0}  # the controller reached it since
    assert reachable([a, b]) == [a, b] and "a" not in router._lost
    # a dead one is skipped for good, unless every replica is lost (then wait, not fail)
    router._lost["b"] = -1.0
    b.routing_stats = {"replica_id": "b", "ts": 99.0}
    assert reachable([a, b]) == [a]
    router._lost["a"] = -1.0
    assert reachable([a, b]) == [a, b]


def test_a_call_cancelled_by_ray_counts_as_a_lost_replica_not_as_the_streams_own_end():
    """Ray Serve's handle re-raises a cancelled future of a call whose replica (or node) went
    away as asyncio.CancelledError. Before the first output it is sent again; after it the
    stream ends with an error (503 "replica failed"), never silently: a CancelledError would
    end the ingress's stream without an error event or [DONE]."""
    from router.errors import ReplicaCallCancelled, classify_error

    before, handle = calls([(0, asyncio.CancelledError)])
    assert collect(before) == [0, 1, 2] and len(handle.sends) == 2
    unary, handle = calls([(0, asyncio.CancelledError)])
    assert asyncio.run(unary.complete_all([(0, choice([1, 2]))]))[0][1].token == 7
    assert len(handle.sends) == 2
    after, handle = calls([(1, asyncio.CancelledError)], migration_limit=0)
    with pytest.raises(ReplicaCallCancelled) as info:
        collect(after)
    assert len(handle.sends) == 1
    err = classify_error(info.value)
    assert err.status == 503 and "replica failed" in err.message


def test_a_stream_cancelled_by_its_client_is_not_sent_again():
    """A real cancellation (the client left: the task reading the stream is cancelled) ends
    the call at once, without a retry."""

    class Stuck(FakeHandle):
        async def _stream(self, request):
            self.sends.append(request.request_id)
            yield Out(0)
            await asyncio.sleep(3600)
            yield Out(1)

    handle = Stuck([])
    calls_ = ReplicaCalls(handle, Policy(RoutingConfig()), block_size=16)

    async def run() -> None:
        got = await cancel_after_first(calls_.one_stream(choice([1, 2, 3])))
        assert [out.token for out in got] == [0]

    asyncio.run(run())
    assert len(handle.sends) == 1
