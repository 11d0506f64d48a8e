"""The ingress's calls to the LLM replicas: one `GenerateRequest` per choice through the
deployment handle (routed by LoadAwareRouter), streamed or unary, several choices (n > 1, several
prompts) at once; each request's first token and end are reported to the routers' tallies
(router/inflight.py). Leaving early cancels the calls, which aborts each in its replica.

A call that failed before anything of it reached the client is sent again when the failure was
the replica's, not the request's: its replica was lost (actor died, node gone: Serve's router
drops a replica whose call raised ActorDiedError, LoadAwareRouter avoids one found
unreachable), up to MAX_SENDS sends (a unary call, which reaches its client only whole, also
at most 1 + http.migration_limit); or its replica was momentarily full or draining (the
ingress had admitted it by its own expected wait), with growing pauses for up to FULL_RETRY_S
(a stream's headers wait for that: router/streaming.py's STREAM_HOLD_S).

A stream whose replica is lost after some of it reached the client migrates: it is sent to
another replica as the same choice with `resume` (the tokens and text the client has), and that
replica's deltas continue the same stream, up to http.migration_limit times per choice
(router/migration.py keeps what was delivered; then the stream ends with
MigrationLimitReached). A draining replica that hands a call back (ReplicaDraining) is
migrated the same way, without counting against the limit: the replica asked for it. That
replica is alive and holds the stream's KV: with routing.kv_transfer the continuation carries a
`kv_fetch` hint naming it (the router weighs it with its cost model, router/kv_transfer.py); a
lost replica's KV is gone with it, and its continuation fetches nothing from it.

PD (config.pd, `prefill` handle given): a choice runs first on a prefill replica with
max_tokens 1, which computes its prompt and its first token; unless that finished it, the same
choice goes on on a decode replica as a continuation (`resume` with the first token) that
fetches the prompt's KV from the prefill replica (`kv_fetch`): the client's stream is one, its
first delta from the prefill replica, the rest from the decode replica (docs/pd.md).

Direct feed (http.direct_stream, router/feed.py): a streamed call carries the address of this
ingress's feed server, and its replica writes the call's outputs there, one frame per step for
all of this ingress's streams, instead of one Ray Serve stream item per output; the Ray call
stays the control channel and ends with Fed(count). The items reach this module as the Ray call
alone would have brought them, so retries, migrations and PD above are the same; a broken feed
is a lost replica (FeedBroken)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

import msgspec

from replica.api import Accepted, EngineRequest, GenerateRequest, KVFetch, RequestOutput, Resume
from router.errors import (
    MigrationLimitReached,
    ReplicaCallCancelled,
    cancelled_from_inside,
    lost_replica,
    replica_full,
    replica_handed_back,
    replica_lost,
    root_cause,
)
from router.feed import FeedServer, shared_server
from router.inflight import note_finished, note_first_token, replica_of
from router.kv_routing import note_cached, note_gone
from router.migration import Delivered, Migrations
from router.policy import Policy

# (choice index, the choice's request as the ingress built it: every field but its id)
Job = tuple[int, EngineRequest]

logger = logging.getLogger("ray.serve")

# sends of one call when its replica is lost before its first output: the first and two more
# (a node that dies takes one replica; the retry goes elsewhere unless a second dies meanwhile)
MAX_SENDS = 3
RETRY_PAUSE_S = 0.05
# a call refused by a full replica is sent again for this long (pauses 0.05 s doubling to
# 0.4 s): a replica's queue empties within steps (the request's own deadline still applies)
FULL_RETRY_S = 3.0
FULL_PAUSE_MAX_S = 0.4


class ReplicaCalls:
    def __init__(
        self,
        handle,
        policy: Policy,
        block_size: int,
        migrations: Migrations | None = None,
        prefill=None,
        direct_stream: bool = False,
    ) -> None:
        """`prefill`: PD's prefill deployment's handle (None: colocated; `handle` takes all).
        `direct_stream`: streamed calls take their outputs over this process's feed server
        (router/feed.py), started at the first."""
        self.handle = handle
        self.stream_handle = handle.options(stream=True)
        self.prefill_stream = prefill.options(stream=True) if prefill is not None else None
        self.policy = policy
        self.block_size = block_size
        self.retries = 0  # calls sent again after their replica was lost or full (metrics)
        # the migration limit and tallies (shared by an ingress's models)
        self.migrations = migrations if migrations is not None else Migrations()
        self.direct_stream = direct_stream
        self.feed: FeedServer | None = None  # the feed server, once started (or given: tests)

    async def _feed(self) -> FeedServer | None:
        """The feed server streamed calls use, or None (off, or it could not start)."""
        if self.feed is None and self.direct_stream:
            self.feed = await shared_server()
            if self.feed is None:
                self.direct_stream = False  # logged once by shared_server
        return self.feed

    async def _again(
        self, exc: BaseException, send: int, first_sent: float, request_id: str, max_sends: int
    ) -> None:
        """Raise `exc` unless the call may be sent again (see the module's docstring); else
        note the retry and pause (the router learns of a loss, a full queue drains)."""
        if replica_lost(exc) and send + 1 < max_sends:
            pause, why = RETRY_PAUSE_S, "its replica was lost"
        elif replica_handed_back(exc) and send + 1 < max_sends:
            pause, why = RETRY_PAUSE_S, "its replica handed it back (draining)"
        elif replica_full(exc) and time.monotonic() - first_sent < FULL_RETRY_S:
            pause, why = min(RETRY_PAUSE_S * 2**send, FULL_PAUSE_MAX_S), "its replica was full"
        else:
            raise exc
        self.retries += 1
        own_serve_request_id()  # the next send is a call of its own to Serve's router
        logger.info(
            "request %s: %s before its first output (%s); sending it again (send %d)",
            request_id, why, type(exc).__name__, send + 2,
        )  # fmt: skip
        await asyncio.sleep(pause)

    async def _migrate(
        self, exc: BaseException, delivered: Delivered, moves: int, lost_moves: int, origin: str
    ) -> bool:
        """Raise unless a stream that reached its client in part may move on (see the module's
        docstring); else note the migration, log it and pause as a retry does. Returns whether
        it counts against the limit (its replica was lost, not drained)."""
        handed_back = replica_handed_back(exc)
        if not handed_back:
            if not replica_lost(exc):
                raise exc
            limit = self.migrations.limit
            if limit == 0:
                raise exc  # migration is off: the stream ends with its replica's failure
            if lost_moves >= limit:
                raise MigrationLimitReached(
                    f"request {origin} lost its replica ({type(exc).__name__}) after "
                    f"{lost_moves} migration(s), the limit (http.migration_limit = {limit})"
                ) from exc
        delivered.lost()
        self.migrations.note("drained" if handed_back else "lost")
        own_serve_request_id()  # the next send is a call of its own to Serve's router
        logger.info(
            "request %s: replica %s %s after %d tokens reached the client; continuing it on "
            "another replica (migration %d)",
            origin, lost_replica(exc),
            "handed it back (draining)" if handed_back else f"was lost ({type(exc).__name__})",
            len(delivered.token_ids), moves + 1,
        )  # fmt: skip
        await asyncio.sleep(RETRY_PAUSE_S)
        return not handed_back

    def handed_back_kv(
        self, exc: BaseException, choice: EngineRequest, delivered: Delivered
    ) -> KVFetch | None:
        """The fetch hint for a stream's continuation (routing.kv_transfer): the blocks of its
        prompt and delivered tokens on the draining replica that handed it back (alive, its
        cache intact); None after a loss (that KV is gone) or when transfer is off."""
        cause = root_cause(exc)
        source = getattr(cause, "replica_id", "") if replica_handed_back(exc) else ""
        if not source or not self.policy.cfg.kv_transfer or self.block_size <= 0:
            return None
        had = len(choice.resume.output_token_ids) if choice.resume is not None else 0
        tokens = len(choice.prompt_token_ids) + had + len(delivered.token_ids)
        num_blocks = (tokens - 1) // self.block_size  # one token is always computed
        return KVFetch(source, num_blocks) if num_blocks > 0 else None

    def request(self, choice: EngineRequest, feed: FeedServer | None = None) -> GenerateRequest:
        """One send of a choice: the request whole, a fresh id and the routing hints (and
        where a stream's outputs go, with a feed)."""
        return GenerateRequest.of(
            choice,
            request_id=uuid.uuid4().hex,
            prefix_key=self.policy.prefix_key(choice.prompt_token_ids, self.block_size),
            # this ingress tells the router the request's first token and its end
            reports_progress=True,
            feed=feed.address if feed is not None else None,
        )

    def one_stream(self, choice: EngineRequest) -> AsyncIterator[RequestOutput | Accepted]:
        """The deltas of one choice, with the replica's Accepted (if it sent one) passed on;
        a call its replica lost or refused before any output is sent again, one lost after
        that migrates."""
        return self._call(choice, streamed=True)

    def _call(self, choice: EngineRequest, streamed: bool) -> AsyncIterator:
        if self.prefill_stream is not None and choice.resume is None:
            return self._pd_call(choice, streamed)
        return self._send(choice, streamed, self.stream_handle)

    async def _pd_call(
        self, choice: EngineRequest, streamed: bool
    ) -> AsyncIterator[RequestOutput | Accepted]:
        """PD: the choice's prompt and first token on a prefill replica, the rest on a decode
        replica that fetches the prompt's KV from it (the module's docstring). Unary: the two
        phases' outputs as one."""
        sampling = choice.sampling
        first_only = dataclasses.replace(
            sampling, max_tokens=1, min_tokens=min(sampling.min_tokens, 1)
        )
        where: list[str] = []
        outs: list[RequestOutput] = []
        prefill = dataclasses.replace(choice, sampling=first_only)
        async for out in self._send(prefill, True, self.prefill_stream, where):
            if isinstance(out, Accepted):
                if streamed:
                    yield out
                continue
            outs.append(out)
        if not outs:
            return
        first = outs[0]
        for out in outs[1:]:
            first = first.merge(out)
        if first.finish_reason != "length" or sampling.max_tokens <= 1:
            yield first  # its first token ended it (a stop, EOS, max_tokens 1)
            return
        first = msgspec.structs.replace(first, finish_reason=None, stop_reason=None)
        if streamed:
            yield first
        tokens = len(choice.prompt_token_ids) + len(first.new_token_ids)
        source = where[-1] if where else None
        num_blocks = (tokens - 1) // self.block_size if self.block_size > 0 else 0
        fetch = KVFetch(source, num_blocks) if source and num_blocks > 0 else None
        rest = dataclasses.replace(
            choice, resume=Resume(list(first.new_token_ids), first.new_text, 0), kv_fetch=fetch
        )
        async for out in self._send(rest, streamed, self.stream_handle):
            if isinstance(out, Accepted):
                continue  # the stream started with the first token
            if not streamed:  # one whole answer: the first token's delta and the rest
                out = msgspec.structs.replace(first, request_id=out.request_id).merge(out)
            yield out

    async def _send(
        self, choice: EngineRequest, streamed: bool, stream_handle, where: list | None = None
    ) -> AsyncIterator[RequestOutput | Accepted]:
        """One choice's call, streamed (its deltas) or unary (its whole output, one item),
        with the replica's Accepted passed on. The one retry loop: a call its replica lost or
        refused before any output reached the caller is sent again (`_again`); a stream lost
        after that continues on another replica from what was delivered (`_migrate`), after
        what a continued choice (`choice.resume`) already had. `where`: each send's replica
        (as its router noted it) is appended at its first output."""
        first_sent = time.monotonic()
        delivered = Delivered()
        origin = ""  # the first send's request id: the one the log names
        sends = moves = lost_moves = 0  # sends before any output; migrations (all, lost)
        max_sends = MAX_SENDS if streamed else min(MAX_SENDS, 1 + self.migrations.limit)
        fetch: KVFetch | None = None  # the continuation's hint: its KV on a draining replica
        feed = await self._feed() if streamed else None
        while True:
            sent = choice
            if delivered.started:
                resume = delivered.resume(moves)
                if choice.resume is not None:  # the output it had before this call's
                    had = choice.resume
                    resume = Resume(had.output_token_ids + resume.output_token_ids,
                                    had.output_text + resume.output_text, moves)  # fmt: skip
                sent = dataclasses.replace(choice, resume=resume, kv_fetch=fetch)
            request = self.request(sent, feed)
            origin = origin or request.request_id
            first = True
            outputs = None
            try:
                if streamed:
                    outputs = stream_handle.generate.remote(request)
                    if feed is not None:  # the outputs over the feed, the rest over Ray
                        outputs = feed.call(request.request_id, outputs)
                else:
                    outputs = _one(self.handle.generate_all.remote(request))
                async for out in outputs:
                    if isinstance(out, Accepted):  # queued there: the response may start
                        yield out
                        continue
                    if first:  # prefill is over: tell the router (it weighs prefill still ahead)
                        first = False
                        if where is not None:
                            where.append(replica_of(request.request_id))
                        if streamed:
                            note_first_token(request.request_id)
                        note_cached(request.request_id, out.num_cached_tokens)
                    gap = delivered.add(out)
                    if gap is not None:
                        self.migrations.observe_gap(gap)
                    yield out
                return
            except asyncio.CancelledError:
                if not cancelled_from_inside():
                    raise  # this call was cancelled (its client left)
                lost: BaseException = ReplicaCallCancelled(
                    f"the call of request {request.request_id} was cancelled"
                )
            except Exception as exc:
                lost = exc
            finally:
                note_finished(request.request_id)
                note_gone(request.request_id)
                if feed is not None and outputs is not None:
                    await outputs.aclose()  # at once: its Ray call is cancelled if still going
            if delivered.finished:
                return  # lost after its last delta: the caller has it all
            if not delivered.started:
                await self._again(lost, sends, first_sent, request.request_id, max_sends)
                sends += 1
                continue
            lost_moves += await self._migrate(lost, delivered, moves, lost_moves, origin)
            moves += 1
            fetch = self.handed_back_kv(lost, choice, delivered)

    async def complete_all(self, jobs: list[Job]) -> list[tuple[int, RequestOutput]]:
        """Every job run to completion concurrently, one unary call each (a non-streaming
        answer needs no per-token messages). Leaving early (client gone) cancels the calls,
        and so aborts each in its replica."""

        async def one(index: int, choice: EngineRequest):
            if len(jobs) > 1:
                own_serve_request_id()  # this task's context only
            # run to its end, so the call's tallies are settled when this returns
            outputs = [out async for out in self._call(choice, streamed=False)]
            return index, outputs[-1]

        if len(jobs) == 1:
            return [await one(*jobs[0])]
        tasks = [asyncio.ensure_future(one(*job)) for job in jobs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def fan_out(self, jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput | Accepted]]:
        """Run every job concurrently; yield (choice index, delta or Accepted) as they come.
        Leaving early cancels every choice (and so aborts it in its replica)."""
        if len(jobs) == 1:
            index, choice = jobs[0]
            async for out in self.one_stream(choice):
                yield index, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int, choice: EngineRequest) -> None:
            own_serve_request_id()  # this task's context only
            try:
                async for out in self.one_stream(choice):
                    queue.put_nowait((index, out))
            except BaseException as exc:  # forwarded to the consumer, which raises it
                queue.put_nowait((index, exc))
                return
            queue.put_nowait((index, done))

        tasks = [asyncio.ensure_future(pump(*job)) for job in jobs]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()


async def _one(response) -> AsyncIterator:
    """A unary call's answer as a one-item stream."""
    yield await response


def own_serve_request_id() -> None:
    """Give the handle calls of the current task a Serve request id of their own. A call made
    while serving a request inherits that request's internal id, and Ray Serve's router indexes
    the calls waiting for a replica by it: two concurrent calls of one request (n > 1, several
    prompts) collide and one of them is never routed, a hang. Cancelling the task still
    cancels its call, so a client that leaves still aborts every choice."""
    from ray.serve import context

    current = context._get_serve_request_context()
    fresh = dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex)
    context._serve_request_context.set(fresh)
