"""When a stream's HTTP response may start: a replica sends Accepted for a request it holds
without output yet (replica/deployment.py), the ingress's fan-out passes it on and the stream
sends its headers and a keep-alive then, or after STREAM_HOLD_S without either, not after a
fixed second (router/streaming.py), so a replica's refusal while the fan-out retries it is a real
429, not an error event inside a 200 stream. A fake engine and a fake handle; the real burst is
test_reliability's."""

from __future__ import annotations

import asyncio
import types

import pytest

pytest.importorskip("ray")

from replica import deployment  # noqa: E402
from replica.contracts import Accepted, GenerateRequest  # noqa: E402
from replica.deployment import LLMServer  # noqa: E402
from replica.request import (  # noqa: E402
    EngineOverloaded,
    EngineRequest,
    RequestOutput,
    SamplingParams,
    StructuredOutput,
)
from router import fanout  # noqa: E402
from router.fanout import ReplicaCalls  # noqa: E402
from router.policy import Policy, RoutingConfig  # noqa: E402
from tests.helpers import cancel_after_first  # noqa: E402

NOTICE_S = 0.05


@pytest.fixture(autouse=True)
def short_notice(monkeypatch):
    monkeypatch.setattr(deployment, "ACCEPTED_NOTICE_S", NOTICE_S)
    monkeypatch.setattr(fanout, "RETRY_PAUSE_S", 0.0)


class FakeEngine:
    """An engine whose stream waits `first_s` before its first of three outputs, or refuses."""

    def __init__(self, first_s: float = 0.0, refuse: bool = False) -> None:
        self.first_s, self.refuse = first_s, refuse
        self.closed = []  # request ids whose stream ended (finished or aborted)

    async def generate(self, request):
        request_id, prompt_ids = request.request_id, request.prompt_token_ids
        if self.refuse:
            raise EngineOverloaded("replica queue is full (8 waiting >= max_queue_len=8)")
        try:
            await asyncio.sleep(self.first_s)
            for token in range(3):
                yield RequestOutput(
                    request_id, [token], str(token), len(prompt_ids), token + 1,
                    finish_reason="length" if token == 2 else None,
                )  # fmt: skip
        finally:
            self.closed.append(request_id)


def server(engine: FakeEngine) -> LLMServer:
    llm = object.__new__(LLMServer)
    llm.engine = engine
    return llm


def request(rid: str = "r1") -> GenerateRequest:
    return GenerateRequest([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3), rid)


def items(llm: LLMServer) -> list:
    async def run():
        return [out async for out in llm.generate(request())]

    return asyncio.run(run())


def test_a_quick_first_output_comes_without_accepted():
    got = items(server(FakeEngine(first_s=0.0)))
    assert [o.new_token_ids for o in got] == [[0], [1], [2]]


def test_a_request_held_past_the_notice_is_accepted_first():
    engine = FakeEngine(first_s=NOTICE_S * 4)
    got = items(server(engine))
    assert got[0] == Accepted("r1")
    assert [o.new_token_ids for o in got[1:]] == [[0], [1], [2]]
    assert engine.closed == ["r1"]


def test_a_constrained_request_gets_twice_the_notice(monkeypatch):
    """Its grammar compiles first, and one that cannot compile is a 400 status, not an error
    event: so 1.5 notices without output send no Accepted, 4 do."""
    notice_s = 0.2
    monkeypatch.setattr(deployment, "ACCEPTED_NOTICE_S", notice_s)
    structured = StructuredOutput(kind="json_object", spec="")
    params = SamplingParams(temperature=0.0, max_tokens=3, structured=structured)

    def run(first_s):
        llm = server(FakeEngine(first_s=first_s))

        async def go():
            return [out async for out in llm.generate(GenerateRequest([1, 2, 3], params, "c"))]

        return asyncio.run(go())

    assert not any(isinstance(o, Accepted) for o in run(notice_s * 1.5))
    assert run(notice_s * 4)[0] == Accepted("c")


def test_a_refusal_raises_before_anything_is_sent():
    llm = server(FakeEngine(refuse=True))
    with pytest.raises(EngineOverloaded, match="max_queue_len=8"):
        items(llm)


def test_a_caller_that_leaves_while_queued_aborts_the_engine_stream():
    engine = FakeEngine(first_s=30.0)
    llm = server(engine)

    assert asyncio.run(cancel_after_first(llm.generate(request("gone")))) == [Accepted("gone")]
    assert engine.closed == ["gone"]


def test_non_streaming_calls_get_no_accepted():
    llm = server(FakeEngine(first_s=NOTICE_S * 4))
    merged = asyncio.run(llm.generate_all(request()))
    assert merged.new_token_ids == [0, 1, 2] and merged.finish_reason == "length"


class Handle:
    """A deployment handle: the first send is accepted and then lost with its replica, the
    second runs (Accepted is not output: the call may still be sent again)."""

    def __init__(self) -> None:
        self.sends = []
        self.generate = types.SimpleNamespace(remote=self._stream)

    def options(self, stream: bool = False) -> Handle:
        return self

    async def _stream(self, req):
        self.sends.append(req.request_id)
        yield Accepted(req.request_id)
        if len(self.sends) == 1:
            raise type("ActorDiedError", (Exception,), {})("replica gone")
        for token in range(3):
            yield RequestOutput(req.request_id, [token], str(token), 3, token + 1)


def test_fan_out_passes_accepted_on_and_resends_a_call_lost_after_it():
    handle = Handle()
    calls = ReplicaCalls(handle, Policy(RoutingConfig()), block_size=16)
    job = (0, EngineRequest([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3), ""))

    async def run():
        return [out async for _, out in calls.fan_out([job])]

    got = asyncio.run(run())
    assert len(handle.sends) == 2 and calls.retries == 1
    assert isinstance(got[0], Accepted) and isinstance(got[1], Accepted)
    assert [o.new_token_ids[0] for o in got[2:]] == [0, 1, 2]
