"""The ingress's side of the direct feed (the replica's is replica/feed.py): a TCP server on the
ingress's event loop, started at its first streamed request, where replicas write the outputs of
its streamed requests, one frame per engine step for all of them, instead of one Ray Serve
stream item per output. The Ray call stays the control channel (routing, Accepted, errors, the
hand-back of a draining replica, cancellation, a replica's death) and ends with Fed(count).

A connection's first frame must be the server's token (else it is closed); then each frame
(a 4-byte big-endian length, then msgpack) is a list of RequestOutput, handed to the inbox of
each one's call; outputs of a call no longer open (cancelled, migrated) are dropped."""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
import sys
from collections import deque
from collections.abc import AsyncIterator

import msgspec

from replica.api import Accepted, Fed, FeedAddress, FeedBroken, RequestOutput

logger = logging.getLogger("ray.serve")

HEADER_BYTES = 4
# a frame longer than this closes its connection (a replica's step of outputs is far smaller:
# prompt logprobs of a long prompt are a few MB)
MAX_FRAME_BYTES = 1 << 28
# a connection that has not presented the token by then is closed
TOKEN_WAIT_S = 10.0
# after a call's Fed(n), how long its outputs may take to arrive on the feed: past it the feed
# counts as broken and the stream migrates from what its client has
FED_GRACE_S = 10.0

_decoder = msgspec.msgpack.Decoder(list[RequestOutput])
_END = object()  # the Ray call ended


class Inbox:
    """One call's items in arrival order: outputs from the feed, and what its Ray call brought
    (Accepted, Fed, outputs of a replica that streamed over Ray, its end, its error)."""

    __slots__ = ("items", "_waiter")

    def __init__(self) -> None:
        self.items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        self.items.append(item)
        if self._waiter is not None:
            _wake(self._waiter)

    async def wait(self, timeout: float | None = None) -> bool:
        """Until an item is there (True) or `timeout` seconds passed (False)."""
        if self.items:
            return True
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(timeout, _wake, waiter) if timeout is not None else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        return bool(self.items)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class FeedServer:
    """The ingress's feed: `address` (once started) travels in its streamed requests; `open`
    and `close` bracket a call; `call` runs one call's items through its inbox."""

    def __init__(self, host: str, token: str | None = None) -> None:
        self.host = host
        self.token = token or secrets.token_hex(16)
        self._token_bytes = self.token.encode()
        self.address: FeedAddress | None = None
        self._server: asyncio.Server | None = None
        self._sock: socket.socket | None = None
        self._inboxes: dict[str, Inbox] = {}
        # counters (Ingress.stats): connections taken, frames and outputs received, outputs of
        # calls no longer open, connections refused (bad token, bad frame)
        self.connections = self.frames = self.outputs = self.dropped = self.refused = 0

    async def start(self) -> FeedServer:
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((self.host, 0))
            sock.listen(128)
            sock.setblocking(False)
            self._server = await loop.create_server(lambda: _FeedProtocol(self), sock=sock)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.address = FeedAddress(self.host, sock.getsockname()[1], self.token)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def release(self) -> None:
        """Close the listening socket of a server whose loop is gone."""
        if self._sock is not None:
            self._sock.close()

    def stats(self) -> dict:
        return {
            "address": f"{self.host}:{self.address.port}" if self.address else None,
            "connections": self.connections,
            "frames": self.frames,
            "outputs": self.outputs,
            "dropped": self.dropped,
            "refused": self.refused,
            "open_calls": len(self._inboxes),
        }

    def open(self, request_id: str) -> Inbox:
        inbox = self._inboxes[request_id] = Inbox()
        return inbox

    def close(self, request_id: str) -> None:
        self._inboxes.pop(request_id, None)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """One frame's outputs, each to its call's inbox."""
        self.frames += 1
        self.outputs += len(outputs)
        inboxes = self._inboxes
        for out in outputs:
            inbox = inboxes.get(out.request_id)
            if inbox is None:
                self.dropped += 1
            else:
                inbox.put(out)

    async def call(
        self, request_id: str, outputs: AsyncIterator
    ) -> AsyncIterator[RequestOutput | Accepted]:
        """The items of a call sent with this feed's address, `outputs` being its Ray call:
        Accepted (unless an output came first) and the outputs, wherever each came from, as
        the Ray call alone would have brought them; the call's error raised where it arrives.
        Ends once the Ray call has ended and, after Fed(n), n outputs arrived (FeedBroken when
        they do not within FED_GRACE_S). Leaving cancels the Ray call (so its replica aborts
        the request) and closes the inbox."""
        inbox = self.open(request_id)
        reader = asyncio.ensure_future(_forward(outputs, inbox))
        got = 0  # outputs yielded
        expected: int | None = None  # Fed's count
        deadline = 0.0  # for the outputs still missing after Fed
        ended = False  # the Ray call ended
        loop = asyncio.get_running_loop()
        items = inbox.items
        try:
            while True:
                while items:
                    item = items.popleft()
                    if isinstance(item, RequestOutput):
                        got += 1
                        yield item
                    elif item is _END:
                        ended = True
                    elif isinstance(item, Accepted):
                        if not got:  # else the output beat it over the feed: no news
                            yield item
                    elif isinstance(item, Fed):
                        expected = item.count
                        deadline = loop.time() + FED_GRACE_S
                    elif isinstance(item, BaseException):
                        raise item
                if ended and (expected is None or got >= expected):
                    return
                if expected is None or got >= expected:
                    await inbox.wait()
                elif not await inbox.wait(deadline - loop.time()):
                    raise FeedBroken(
                        f"request {request_id}: {got} of the {expected} outputs its replica "
                        f"fed arrived within {FED_GRACE_S:g} s"
                    )
        finally:
            self.close(request_id)
            if not reader.done():
                reader.cancel()  # cancels the Ray call: its replica aborts the request
                await asyncio.wait({reader})


async def _forward(outputs: AsyncIterator, inbox: Inbox) -> None:
    """The Ray call's items into the inbox, then _END or its error (a cancellation from inside,
    Serve's for a replica gone, is passed on as an error; this task's own is not)."""
    try:
        async for item in outputs:
            inbox.put(item)
        inbox.put(_END)
    except BaseException as exc:
        if isinstance(exc, asyncio.CancelledError) and asyncio.current_task().cancelling():
            raise
        inbox.put(exc)


class _FeedProtocol(asyncio.Protocol):
    """One replica's connection: its token first, then frames of outputs."""

    def __init__(self, server: FeedServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.authed = False
        self.partial = bytearray()  # the start of a frame that has not all arrived
        self.need = 0  # the bytes `partial` must reach for its frame to be complete
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections += 1
        self.timer = asyncio.get_running_loop().call_later(TOKEN_WAIT_S, self._refuse, "no token")

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def _refuse(self, why: str) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.server.refused += 1
            peer = self.transport.get_extra_info("peername")
            logger.warning("direct feed: closed the connection from %s (%s)", peer, why)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.partial:
            self.partial += data
            if len(self.partial) < self.need:
                return
            data, self.partial = bytes(self.partial), bytearray()
        view = memoryview(data)
        pos, size = 0, len(data)
        while size - pos >= HEADER_BYTES:
            length = int.from_bytes(view[pos : pos + HEADER_BYTES], "big")
            if not self.authed and length != len(self.server._token_bytes):
                self._refuse("bad token")
                return
            if length > MAX_FRAME_BYTES:
                self._refuse(f"a frame of {length} bytes, over {MAX_FRAME_BYTES}")
                return
            end = pos + HEADER_BYTES + length
            if end > size:
                break
            if not self._frame(view[pos + HEADER_BYTES : end]):
                return
            pos = end
        if pos < size:
            self.partial = bytearray(view[pos:])
            self.need = HEADER_BYTES
            if size - pos >= HEADER_BYTES:
                self.need += int.from_bytes(view[pos : pos + HEADER_BYTES], "big")

    def _frame(self, body: memoryview) -> bool:
        if not self.authed:
            if not hmac.compare_digest(bytes(body), self.server._token_bytes):
                self._refuse("bad token")
                return False
            self.authed = True
            if self.timer is not None:
                self.timer.cancel()
            return True
        try:
            outputs = _decoder.decode(body)
        except msgspec.DecodeError as exc:
            self._refuse(f"a frame that is not a list of outputs: {exc}")
            return False
        self.server.deliver(outputs)
        return True


def node_ip() -> str:
    """The address replicas reach this process at: its Ray node's IP, 127.0.0.1 outside Ray."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return "127.0.0.1"
    try:
        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"


_servers: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}


async def shared_server() -> FeedServer | None:
    """This process's feed server on the running loop, started at the first call; None when it
    cannot start (streams then go over Ray: logged once)."""
    loop = asyncio.get_running_loop()
    task = _servers.get(loop)
    if task is None:
        for gone in [other for other in _servers if other.is_closed()]:  # tests' loops
            server = _result(_servers.pop(gone))
            if server is not None:
                server.release()
        task = _servers[loop] = loop.create_task(_start())
    return await asyncio.shield(task)


def _result(task: asyncio.Task) -> FeedServer | None:
    if task.done() and not task.cancelled() and task.exception() is None:
        return task.result()
    return None


async def _start() -> FeedServer | None:
    host = node_ip()
    try:
        server = await FeedServer(host).start()
    except Exception as exc:
        logger.warning("direct feed: cannot listen on %s (%r); streams go over Ray", host, exc)
        return None
    logger.info("direct feed: listening on %s:%d", host, server.address.port)
    return server


def current_server() -> FeedServer | None:
    """The feed server this process started, if any (stats; any thread)."""
    for task in list(_servers.values()):
        server = _result(task)
        if server is not None:
            return server
    return None
