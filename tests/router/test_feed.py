"""The direct feed (router/feed.py, replica/feed.py): a replica writes a stream's outputs to its
ingress over TCP, one frame per loop turn for all of that ingress's streams, while the Ray call
carries Accepted, errors and Fed(count). Real sockets on 127.0.0.1, a fake engine and fake
handles; no Ray cluster (the real thing is tests/integration/test_direct_feed.py)."""

from __future__ import annotations

import asyncio
import socket
import types

import pytest

pytest.importorskip("ray")

from replica import feed as front_feed  # noqa: E402
from replica.contracts import Accepted, Fed, FeedAddress, GenerateRequest  # noqa: E402
from replica.deployment import LLMServer  # noqa: E402
from replica.errors import FeedBroken  # noqa: E402
from replica.feed import FeedClients, encode_frame, token_frame  # noqa: E402
from replica.request import EngineRequest, RequestOutput, SamplingParams  # noqa: E402
from router import fanout  # noqa: E402
from router import feed as ingress_feed  # noqa: E402
from router.errors import classify_error, replica_lost  # noqa: E402
from router.fanout import ReplicaCalls  # noqa: E402
from router.feed import FeedServer, _FeedProtocol  # noqa: E402
from router.migration import Migrations  # noqa: E402
from router.policy import Policy, RoutingConfig  # noqa: E402
from tests.helpers import cancel_after_first  # noqa: E402


@pytest.fixture(autouse=True)
def no_pause(monkeypatch):
    monkeypatch.setattr(fanout, "RETRY_PAUSE_S", 0.0)


def out(rid: str, token: int, last: bool = False, **extra) -> RequestOutput:
    return RequestOutput(
        rid, [token], f"<{token}>", 3, token + 1, finish_reason="length" if last else None, **extra
    )


async def started() -> FeedServer:
    return await FeedServer("127.0.0.1").start()


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once closed


# -- framing and the token --------------------------------------------------------------------
class FakeTransport:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name):
        return ("127.0.0.1", 1)


def test_frames_cut_anywhere_arrive_whole_and_equal():
    async def run():
        server = FeedServer("127.0.0.1", token="t" * 32)
        inbox = server.open("a")
        sent = [
            [out("a", 0, new_logprobs=[(-0.5, {0: -0.5, 7: -1.25})], num_cached_tokens=16)],
            [out("a", 1), out("a", 2, last=True, stop_reason=9)],
        ]
        wire = token_frame(server.token) + b"".join(bytes(encode_frame(f)) for f in sent)
        for step in (1, 3, 7, len(wire)):
            protocol = _FeedProtocol(server)
            protocol.connection_made(FakeTransport())
            for start in range(0, len(wire), step):
                protocol.data_received(wire[start : start + step])
            protocol.connection_lost(None)
            assert list(inbox.items) == [o for frame in sent for o in frame], step
            assert not protocol.transport.closed
            inbox.items.clear()
        assert server.frames == 8 and server.outputs == 12

    asyncio.run(run())


def test_a_wrong_token_closes_the_connection_and_delivers_nothing():
    async def run():
        server = await started()
        inbox = server.open("a")
        try:
            for token in ("x" * len(server.token), "short"):
                reader, writer = await asyncio.open_connection("127.0.0.1", server.address.port)
                writer.write(token_frame(token) + bytes(encode_frame([out("a", 0)])))
                await writer.drain()
                try:
                    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed on us
                except ConnectionResetError:
                    pass  # closed on us with bytes unread: a reset
                writer.close()
            assert not inbox.items and server.outputs == 0 and server.refused == 2
        finally:
            await server.stop()

    asyncio.run(run())


def test_a_silent_or_oversized_connection_is_closed(monkeypatch):
    monkeypatch.setattr(ingress_feed, "TOKEN_WAIT_S", 0.05)

    async def run():
        server = await started()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.address.port)
            assert await asyncio.wait_for(reader.read(), 5) == b""  # no token in time
            writer.close()
            protocol = _FeedProtocol(server)
            protocol.connection_made(FakeTransport())
            huge = (ingress_feed.MAX_FRAME_BYTES + 1).to_bytes(4, "big")
            protocol.data_received(token_frame(server.token) + huge + b"x")
            assert protocol.transport.closed and server.refused == 2
        finally:
            await server.stop()

    asyncio.run(run())


# -- demultiplexing and the front's coalescing ------------------------------------------------
def test_one_frame_carries_every_stream_of_a_loop_turn_each_to_its_call():
    async def run():
        server = await started()
        clients = FeedClients()
        try:
            conn = clients.get(server.address)
            assert await conn.ready()
            a, b = server.open("a"), server.open("b")
            for rid, token in (("a", 0), ("b", 0), ("gone", 0), ("a", 1), ("b", 1)):
                conn.send(out(rid, token))  # one loop turn: one flush
            await until(lambda: server.outputs == 5)
            assert server.frames == 1 and conn.frames == 1
            assert [o.new_token_ids for o in a.items] == [[0], [1]]
            assert [o.request_id for o in b.items] == ["b", "b"]
            assert server.dropped == 1  # a call no longer open (cancelled, migrated)
            conn.send(out("a", 2))  # a later turn: a frame of its own
            await until(lambda: server.frames == 2)
            assert len(a.items) == 3
        finally:
            clients.close()
            await server.stop()

    asyncio.run(run())


def test_an_unreachable_feed_is_not_tried_again_for_a_while(monkeypatch):
    async def run():
        clients = FeedClients()
        address = FeedAddress("127.0.0.1", closed_port(), "t")
        conn = clients.get(address)
        assert not await conn.ready() and conn.failed_at is not None
        assert clients.get(address) is conn  # remembered: no new connect
        monkeypatch.setattr(front_feed, "RETRY_AFTER_S", 0.0)
        again = clients.get(address)
        assert again is not conn and not await again.ready()
        with pytest.raises(FeedBroken):
            conn.send(out("a", 0))

    asyncio.run(run())


# -- one call: the feed's outputs and the Ray call's items --------------------------------------
async def ray_call(items, then_s: float = 0.0, log: list | None = None, before_s: float = 0.0):
    """A fake Ray call: after `before_s`, `items` (an exception is raised), then its end after
    `then_s`; a cancellation is noted in `log`."""
    try:
        await asyncio.sleep(before_s)
        for item in items:
            if isinstance(item, BaseException):
                raise item
            yield item
        await asyncio.sleep(then_s)
    except asyncio.CancelledError:
        if log is not None:
            log.append("cancelled")
        raise


def test_a_fed_call_ends_once_the_counted_outputs_arrived():
    async def run():
        server = FeedServer("127.0.0.1")
        loop = asyncio.get_running_loop()
        # Fed comes over Ray before the feed's frames
        loop.call_later(0.05, server.deliver, [out("a", 0)])
        loop.call_later(0.1, server.deliver, [out("a", 1, last=True)])
        got = [item async for item in server.call("a", ray_call([Accepted("a"), Fed("a", 2)]))]
        assert got == [Accepted("a"), out("a", 0), out("a", 1, last=True)]
        assert not server._inboxes

    asyncio.run(run())


def test_fed_outputs_missing_past_the_grace_are_a_lost_replica(monkeypatch):
    monkeypatch.setattr(ingress_feed, "FED_GRACE_S", 0.05)

    async def run():
        server = FeedServer("127.0.0.1")
        asyncio.get_running_loop().call_later(0.01, server.deliver, [out("a", 0)])
        got = []
        with pytest.raises(FeedBroken, match="1 of the 2 outputs") as caught:
            async for item in server.call("a", ray_call([Fed("a", 2)])):
                got.append(item)
        return got, caught.value

    got, exc = asyncio.run(run())
    assert got == [out("a", 0)]
    assert replica_lost(exc)  # so the stream migrates from what its client has
    assert classify_error(exc).status == 503


def test_accepted_after_an_output_is_dropped_and_ray_outputs_pass_through():
    async def run():
        server = FeedServer("127.0.0.1")
        # the output arrives on the feed before the Ray call's Accepted: Accepted is no news
        asyncio.get_running_loop().call_later(0.01, server.deliver, [out("a", 0, last=True)])
        fed = [
            item
            async for item in server.call("a", ray_call([Accepted("a"), Fed("a", 1)], before_s=0.1))
        ]
        # a replica that could not reach the feed: everything over Ray, no Fed
        items = [Accepted("b"), out("b", 0), out("b", 1, last=True)]
        over_ray = [item async for item in server.call("b", ray_call(items))]
        return fed, over_ray, items

    fed, over_ray, items = asyncio.run(run())
    assert fed == [out("a", 0, last=True)]
    assert over_ray == items


def test_the_ray_calls_error_is_raised_and_leaving_cancels_the_ray_call():
    async def run():
        server = FeedServer("127.0.0.1")
        with pytest.raises(ValueError, match="bad"):
            async for _ in server.call("a", ray_call([Accepted("a"), ValueError("bad")])):
                pass
        log: list = []
        got = await cancel_after_first(server.call("b", ray_call([Accepted("b")], 30.0, log)))
        return got, log, dict(server._inboxes)

    got, log, inboxes = asyncio.run(run())
    assert got == [Accepted("b")] and log == ["cancelled"] and inboxes == {}


# -- the front and the fan-out together (fake engine, fake handle) -----------------------------
class FakeEngine:
    """Three outputs per request, `gap_s` apart (a resumed request continues after the tokens
    it had); `closed` lists the streams that ended (finished or aborted)."""

    def __init__(self, gap_s: float = 0.0) -> None:
        self.gap_s = gap_s
        self.closed: list[str] = []
        self.requests: list[GenerateRequest] = []

    async def generate(self, request):
        self.requests.append(request)
        had = len(request.resume.output_token_ids) if request.resume is not None else 0
        try:
            for token in range(had, 3):
                await asyncio.sleep(self.gap_s)
                yield out(request.request_id, token, last=token == 2)
        finally:
            self.closed.append(request.request_id)


class Handle:
    """A deployment handle whose streamed calls run the real front's generate in-process."""

    def __init__(self, llm: LLMServer) -> None:
        self.llm = llm
        self.generate = types.SimpleNamespace(remote=llm.generate)

    def options(self, stream: bool = False) -> Handle:
        return self


def front(engine: FakeEngine) -> LLMServer:
    llm = object.__new__(LLMServer)
    llm.engine = engine
    return llm


async def fanned(engine: FakeEngine, feed: bool, leave_after: int | None = None):
    llm = front(engine)
    calls = ReplicaCalls(Handle(llm), Policy(RoutingConfig()), 16, Migrations(3))
    server = await started() if feed else None
    calls.feed = server
    choice = EngineRequest([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3), "")
    try:
        if leave_after is not None:
            return await cancel_after_first(calls.one_stream(choice)), server, llm, calls
        return [o async for o in calls.one_stream(choice)], server, llm, calls
    finally:
        if llm._feeds is not None:
            llm._feeds.close()
        if server is not None:
            await server.stop()


def test_a_stream_over_the_feed_is_the_stream_over_ray():
    over_ray, _, _, _ = asyncio.run(fanned(FakeEngine(), feed=False))
    engine = FakeEngine()
    fed, server, llm, _ = asyncio.run(fanned(engine, feed=True))
    strip = [(o.new_token_ids, o.new_text, o.finish_reason) for o in over_ray]
    assert [(o.new_token_ids, o.new_text, o.finish_reason) for o in fed] == strip
    assert len(strip) == 3 and not any(isinstance(o, Fed) for o in fed)
    assert server.outputs == 3 and server.connections == 1 and llm._feeds.fallbacks == 0
    assert engine.requests[0].feed == server.address
    assert engine.closed == [engine.requests[0].request_id]


class Held(FakeEngine):
    """Its first output at once, the next never (the client leaves meanwhile)."""

    async def generate(self, request):
        self.requests.append(request)
        try:
            yield out(request.request_id, 0)
            await asyncio.sleep(30)
            yield out(request.request_id, 1, last=True)
        finally:
            self.closed.append(request.request_id)


def test_leaving_a_fed_stream_aborts_it_in_its_replica():
    engine = Held()
    got, server, _, _ = asyncio.run(fanned(engine, feed=True, leave_after=1))
    assert [o.new_token_ids for o in got] == [[0]]
    assert engine.closed == [engine.requests[0].request_id]  # its engine stream closed early
    assert not server._inboxes


def test_a_feed_that_breaks_mid_stream_migrates_the_stream():
    engine = FakeEngine(gap_s=0.05)

    async def run():
        llm = front(engine)
        calls = ReplicaCalls(Handle(llm), Policy(RoutingConfig()), 16, Migrations(3))
        calls.feed = server = await started()
        choice = EngineRequest([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3), "")
        got = []
        try:
            async for item in calls.one_stream(choice):
                got.append(item)
                if len(got) == 1:  # the connection drops under the stream
                    for conn in list(llm._feeds._conns.values()):
                        conn.transport.close()
        finally:
            llm._feeds.close()
            await server.stop()
        return got, calls, server

    got, calls, server = asyncio.run(run())
    assert [o.new_token_ids for o in got] == [[0], [1], [2]]  # continued, nothing repeated
    assert calls.migrations.counts["lost"] == 1
    assert len(engine.requests) == 2 and engine.requests[1].resume.output_token_ids in ([0], [0, 1])
    assert server.connections == 2  # the continuation opened the feed again


class Fronts:
    """A handle whose first send goes to `first`, the others to `then` (a router that moved a
    handed-back stream to the other replica)."""

    def __init__(self, first: LLMServer, then: LLMServer) -> None:
        self.fronts, self.sends = (first, then), 0
        self.generate = types.SimpleNamespace(remote=self._send)

    def _send(self, request):
        self.sends += 1
        return self.fronts[min(self.sends - 1, 1)].generate(request)

    def options(self, stream: bool = False) -> Fronts:
        return self


def test_a_draining_replica_hands_a_fed_stream_back_over_its_ray_call():
    draining, survivor = front(FakeEngine(gap_s=0.05)), front(FakeEngine(gap_s=0.0))
    draining.replica_id = "replica-a"

    async def run():
        calls = ReplicaCalls(Fronts(draining, survivor), Policy(RoutingConfig()), 16, Migrations(3))
        calls.feed = server = await started()
        choice = EngineRequest([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3), "")
        got = []
        try:
            async for item in calls.one_stream(choice):
                got.append(item)
                draining._handing_back = True  # Serve's drain began: the next delta hands it back
        finally:
            for llm in (draining, survivor):
                llm._feeds.close()
            await server.stop()
        return got, calls

    got, calls = asyncio.run(run())
    assert [o.new_token_ids for o in got] == [[0], [1], [2]]
    assert calls.migrations.counts == {"lost": 0, "drained": 1}
    assert survivor.engine.requests[0].resume.output_token_ids in ([0], [0, 1])  # what it had
    assert draining.engine.closed == [draining.engine.requests[0].request_id]  # aborted there


def test_a_front_that_cannot_reach_the_feed_streams_over_ray():
    async def run():
        engine = FakeEngine()
        llm = front(engine)
        calls = ReplicaCalls(Handle(llm), Policy(RoutingConfig()), 16, Migrations(3))
        calls.feed = FeedServer("127.0.0.1")
        calls.feed.address = FeedAddress("127.0.0.1", closed_port(), "t")  # nobody listens
        choice = EngineRequest([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3), "")
        got = [o async for o in calls.one_stream(choice)]
        llm._feeds.close()
        return got, llm

    got, llm = asyncio.run(run())
    assert [o.new_token_ids for o in got] == [[0], [1], [2]]
    assert llm._feeds.fallbacks == 1


def test_generate_with_a_feed_yields_only_control_items():
    """The front alone: with a reachable feed the Ray call carries Fed(count) and nothing per
    token; the outputs arrive on the feed."""

    async def run():
        server = await started()
        inbox = server.open("r")
        llm = front(FakeEngine())
        request = GenerateRequest(
            [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3), "r", feed=server.address
        )
        items = [item async for item in llm.generate(request)]
        await until(lambda: len(inbox.items) == 3)
        llm._feeds.close()
        await server.stop()
        return items, list(inbox.items)

    items, fed = asyncio.run(run())
    assert items == [Fed("r", 3)]
    assert [o.new_token_ids for o in fed] == [[0], [1], [2]] and fed[-1].finished


def test_a_fed_request_crosses_the_engine_core_wire_without_its_feed():
    """The feed's address is the front's business: the engine core takes the request as it
    took it before (the wire decodes an EngineRequest)."""
    from replica.engine import wire

    request = GenerateRequest(
        [1, 2], SamplingParams(max_tokens=2), "r", feed=FeedAddress("10.0.0.1", 4242, "t" * 32)
    )
    back = wire.core_codec().decode(wire.front_codec().encode(wire.Add(request))).request
    assert back == EngineRequest([1, 2], request.sampling, "r")
