"""The replica's side of the direct feed (the ingress's is router/feed.py): one TCP connection
per ingress that asked for it (GenerateRequest.feed), over which the front writes the outputs
of its streamed requests instead of yielding each as a Ray Serve stream item. Every output sent
in one turn of the event loop (a step wakes each request's stream in the same turn) goes out as
ONE frame per ingress: a 4-byte big-endian length, then a msgspec msgpack list of RequestOutput.
The connection's first frame is the ingress's token."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from replica.contracts import FeedAddress
from replica.errors import FeedBroken
from replica.request import RequestOutput

logger = logging.getLogger("ray.serve")

# a connect that takes longer fails: the request (and those after it, for RETRY_AFTER_S) streams
# over Ray as before
CONNECT_TIMEOUT_S = 1.0
RETRY_AFTER_S = 30.0
HEADER_BYTES = 4

_encoder = msgspec.msgpack.Encoder()


def encode_frame(value) -> bytearray:
    """`value` msgpack-encoded behind its 4-byte big-endian length (one write, no copy)."""
    frame = bytearray(HEADER_BYTES)
    _encoder.encode_into(value, frame, HEADER_BYTES)
    frame[:HEADER_BYTES] = (len(frame) - HEADER_BYTES).to_bytes(HEADER_BYTES, "big")
    return frame


def token_frame(token: str) -> bytes:
    data = token.encode()
    return len(data).to_bytes(HEADER_BYTES, "big") + data


class FeedConnection(asyncio.Protocol):
    """One connection to an ingress's FeedServer. `send` queues an output and schedules one
    flush for the loop's next turn; a connection that closed (the ingress gone, or it refused
    a frame) raises FeedBroken from `send`."""

    def __init__(self, address: FeedAddress, loop: asyncio.AbstractEventLoop) -> None:
        self.address = address
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.opened: asyncio.Future[bool] = loop.create_future()  # True: connected
        self.broken = False  # set once the connection failed or closed
        self.failed_at: float | None = None  # when the connect failed (None: it did not)
        self.frames = 0
        self._pending: list[RequestOutput] = []

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(token_frame(self.address.token))

    def data_received(self, data: bytes) -> None:
        pass  # the ingress sends nothing

    def eof_received(self) -> bool:
        return False  # the ingress closed its end: close ours (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self.broken = True
        self._pending.clear()
        if not self.opened.done():
            self.opened.set_result(False)

    # -- the streams' side -----------------------------------------------------------------------
    async def ready(self) -> bool:
        """Whether the connection is open (waits for a connect under way)."""
        return await asyncio.shield(self.opened) and not self.broken

    def send(self, out: RequestOutput) -> None:
        if self.broken:
            raise FeedBroken(
                f"the direct feed to the ingress at {self.address.host}:{self.address.port} "
                f"closed before request {out.request_id} ended"
            )
        pending = self._pending
        pending.append(out)
        if len(pending) == 1:
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self.broken and self.transport is not None:
            self.transport.write(encode_frame(pending))
            self.frames += 1

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class FeedClients:
    """A front's connections, one per ingress address, opened on the first request that names
    the address; a connect that failed is not tried again for RETRY_AFTER_S (those requests
    stream over Ray), a connection that closed is opened again by the next request."""

    def __init__(self) -> None:
        self._conns: dict[FeedAddress, FeedConnection] = {}
        self._connecting: set[asyncio.Task] = set()  # referenced until done
        self.fallbacks = 0  # requests that asked for a feed that could not be reached

    def get(self, address: FeedAddress) -> FeedConnection:
        """The connection to `address` (maybe still connecting: FeedConnection.ready)."""
        conn = self._conns.get(address)
        if conn is not None:
            if not conn.broken:
                return conn
            if conn.failed_at is not None and time.monotonic() - conn.failed_at < RETRY_AFTER_S:
                return conn
        loop = asyncio.get_running_loop()
        conn = FeedConnection(address, loop)
        self._conns[address] = conn
        task = loop.create_task(self._connect(conn))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)
        return conn

    async def _connect(self, conn: FeedConnection) -> None:
        address = conn.address
        try:
            await asyncio.wait_for(
                conn.loop.create_connection(lambda: conn, address.host, address.port),
                CONNECT_TIMEOUT_S,
            )
        except (OSError, asyncio.TimeoutError) as exc:
            conn.broken = True
            conn.failed_at = time.monotonic()
            if not conn.opened.done():
                conn.opened.set_result(False)
            logger.warning(
                "direct feed to the ingress at %s:%d unreachable (%r): its streams go over Ray "
                "for %.0f s",
                address.host, address.port, exc, RETRY_AFTER_S,
            )  # fmt: skip
            return
        if not conn.opened.done():
            conn.opened.set_result(not conn.broken)

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
