"""The answer of an admitted request, aggregated or streamed as SSE: its calls fanned out to
the replicas (router/fanout.py), paced with keep-alives while a replica holds it without
output, and cut at the request's deadline."""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from replica.api import Accepted, RequestOutput
from router.admission import Admission
from router.dialects import Choice, Dialect, Echo, token_logprobs, without_generated
from router.errors import HTTPError, classify_error
from router.fanout import FULL_RETRY_S, Job, ReplicaCalls
from router.protocol import ChatCompletionRequest, UsageInfo

logger = logging.getLogger("ray.serve")


class Answers:
    """Answers admitted requests over the ingress's replica calls; each request's admission
    entry and in-flight slot are let go when its answer ends."""

    def __init__(self, calls: ReplicaCalls, admission: Admission, keepalive_s: float) -> None:
        self.calls = calls
        self.admission = admission
        self.keepalive_s = keepalive_s

    # -- answers --------------------------------------------------------------------------------
    @staticmethod
    def _prompt_tokens(jobs: list[Job], n: int) -> int:
        """Prompt tokens of the request for usage: each prompt once, whatever n is."""
        per_prompt = {}
        for index, choice in jobs:
            per_prompt.setdefault(index // n, choice.num_prompt_tokens)
        return sum(per_prompt.values())

    @staticmethod
    def answer_options(req, echo: dict[int, Echo] | None) -> dict:
        """The dialect's options for this request (tool parsing, echoed prompts)."""
        if isinstance(req, ChatCompletionRequest):
            return {"tool_mode": req.tool_mode, "chat": req}
        return {"echo": echo}

    async def aggregate(
        self, jobs: list[Job], dialect: Dialect, req, ticket: "Ticket", echo=None
    ) -> BaseModel:
        """The whole answer, within the request's deadline (408 past it: the calls are
        cancelled, which aborts them in their replicas and frees their blocks)."""
        choices = {index: Choice(index) for index, _ in jobs}
        echo_only = getattr(req, "echo_only", False)
        try:
            results = await asyncio.wait_for(self.calls.complete_all(jobs), ticket.remaining_s())
        except asyncio.TimeoutError:
            raise ticket.timeout_error() from None
        # and ends (serve_request's finally); its first token was not seen
        self.admission.started(ticket.key, streamed=False)
        for index, out in results:
            choices[index].add(without_generated(out) if echo_only else out)
        usage = UsageInfo.of(
            self._prompt_tokens(jobs, req.n), sum(len(c.token_ids) for c in choices.values())
        )
        ordered = [choices[i] for i in sorted(choices)]
        return dialect.response(
            usage,
            ordered,
            logprobs=jobs[0][1].sampling.logprobs is not None,
            token_ids=getattr(req, "return_token_ids", False),
            **self.answer_options(req, echo),
        )

    async def stream(
        self, jobs: list[Job], dialect: Dialect, req, ticket: "Ticket", echo=None
    ) -> AsyncIterator[str]:
        """SSE events of an admitted request, which owns its in-flight slot until it ends.
        The first item is the first event, or a keep-alive comment once a replica has accepted
        the request without output yet (Accepted, about half a second after it took it), or
        after STREAM_HOLD_S without either (the request waits in Serve's router for a replica
        with room). A failure before that, such as every replica refusing while the fan-out
        retries, raises to the caller and becomes a plain HTTP error. After that a comment
        follows every http.keepalive_s without an event, a failure is sent as an error event,
        and past the deadline the request ends with a timeout error event (its calls
        cancelled, so its replicas free its blocks)."""
        token_ids = getattr(req, "return_token_ids", False)
        shape = dialect.stream(token_ids, **self.answer_options(req, echo))
        echo_only = getattr(req, "echo_only", False)
        completion_tokens = 0
        wants_logprobs = jobs[0][1].sampling.logprobs is not None
        pending = shape.preamble([index for index, _ in jobs])  # held until the first text
        started = False
        first_token = False
        keepalive = self.keepalive_s
        batches = _batches(self.calls.fan_out(jobs), keepalive, STREAM_HOLD_S, ticket)
        try:
            async for items in batches:
                if items is _KEEPALIVE:
                    started = True
                    yield KEEPALIVE_COMMENT
                    continue
                parts = []  # everything that arrived since the last write, as one write
                for index, out in _merged(items):
                    if isinstance(out, Accepted):
                        parts.append(KEEPALIVE_COMMENT)
                        continue
                    if not first_token:
                        first_token = True
                        self.admission.started(ticket.key)
                    if echo_only:
                        out = without_generated(out)
                    completion_tokens += len(out.new_token_ids)
                    if not out.new_text and not out.finished and not token_ids and not echo:
                        continue
                    lps = token_logprobs(out) if wants_logprobs else None
                    events = shape.render(shape.chunks(index, out, lps))
                    if not events:
                        continue  # a tool call still being buffered
                    parts.append(pending + events)
                    pending = ""
                if parts:
                    started = True
                    yield "".join(parts)
            if req.include_usage:
                usage = UsageInfo.of(self._prompt_tokens(jobs, req.n), completion_tokens)
                pending += shape.render([shape.usage(usage)])
            if pending:
                started = True
                yield pending
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not started:
                raise
            err = classify_error(exc)
            logger.warning("stream %s failed: %s", shape.id, err.message)
            yield shape.failure(err)
        finally:
            await batches.aclose()  # at once: its reader stops and the calls are cancelled
            self.admission.leave(ticket.key)
            ticket.slot.release()
        end = shape.end()
        if end:
            yield end

    async def answer(self, jobs, dialect, req, ticket, echo, expected_wait) -> Response:
        """The SSE stream or the aggregated answer of an admitted request. A stream owns the
        request's slot from its start, however it ends."""
        if req.stream:
            events = self.stream(jobs, dialect, req, ticket, echo)
            # The first item comes once a replica has the request (an event, or a keep-alive
            # while queued there) or after STREAM_HOLD_S, so a replica's refusal while the
            # fan-out retries is still a real 429 (or 503, or 400). Once started, the stream's cleanup runs even if
            # the response is never iterated (the event loop finalizes started async
            # generators).
            first = await anext(events)
            headers = {"Cache-Control": "no-cache"}
            if expected_wait is not None:  # what admission expected for the first token
                headers[EXPECTED_WAIT_HEADER] = f"{expected_wait:.2f}"
            return StreamingResponse(
                _prepend(first, events), media_type="text/event-stream", headers=headers
            )
        result = await self.aggregate(jobs, dialect, req, ticket, echo)
        return JSONResponse(result.model_dump(exclude_none=False))


class Ticket:
    """An admitted request: its slot, its key in the admission queue, its deadline."""

    __slots__ = ("slot", "key", "deadline_s", "deadline_at")

    def __init__(self, slot, deadline_s: float) -> None:
        self.slot = slot
        self.key = uuid.uuid4().hex
        self.deadline_s = deadline_s
        self.deadline_at = time.monotonic() + deadline_s

    def remaining_s(self) -> float:
        return max(0.0, self.deadline_at - time.monotonic())

    def timeout_error(self) -> HTTPError:
        return HTTPError(
            408,
            f"request timed out: no answer within its deadline of {self.deadline_s:g} s "
            f"(http.request_timeout_s, or the {TIMEOUT_HEADER} header); it was cancelled",
            "timeout_error",
        )


# A stream's headers wait this long for its first event or a replica's Accepted: past the
# fan-out's retries of full replicas (FULL_RETRY_S and its last pause), so their refusal is still
# a 429 status; then keep-alives start (a request waiting in Serve's router for a replica).
STREAM_HOLD_S = FULL_RETRY_S + 2.0
KEEPALIVE_COMMENT = ": keep-alive\n\n"
TIMEOUT_HEADER = "X-Request-Timeout"
EXPECTED_WAIT_HEADER = "X-Expected-Wait-S"
_KEEPALIVE = object()


async def _batches(
    events: AsyncIterator, every_s: float, first_wait_s: float, ticket: Ticket
) -> AsyncIterator:
    """The items of `events` as lists of every item that arrived since the last list (a
    stream that fell behind its replicas writes them as one), with _KEEPALIVE whenever none
    came for `every_s` (`first_wait_s` before the first: a replica's Accepted, as an item,
    usually says sooner when the response may start); past the ticket's deadline, a timeout
    error. One task reads `events` ahead into a buffer, so a delta costs a wake-up, not a
    task and two timers. Closing this closes `events`."""
    loop = asyncio.get_running_loop()
    buffer: list = []
    ended: list[BaseException | None] = []  # [None] at the end of `events`, or its error
    waiter: list[asyncio.Future | None] = [None]

    def wake(_=None) -> None:
        if waiter[0] is not None and not waiter[0].done():
            waiter[0].set_result(None)

    async def pump() -> None:
        try:
            async for item in events:
                buffer.append(item)
                wake()
            ended.append(None)
        except BaseException as exc:  # raised to the consumer after what came before it
            ended.append(exc)
            wake()
            if isinstance(exc, asyncio.CancelledError):
                raise
        wake()

    reader = asyncio.ensure_future(pump())
    wait_until = loop.time() + first_wait_s
    try:
        while True:
            if ticket.remaining_s() <= 0:
                raise ticket.timeout_error()
            if buffer:
                items = buffer[:]
                buffer.clear()
                yield items
                wait_until = loop.time() + every_s
                continue
            if ended:
                if ended[0] is not None:
                    raise ended[0]
                return
            now = loop.time()
            if now >= wait_until:
                yield _KEEPALIVE
                wait_until = loop.time() + every_s
                continue
            waiter[0] = loop.create_future()
            delay = min(wait_until - now, ticket.remaining_s())
            timer = loop.call_later(delay, wake)
            try:
                await waiter[0]
            finally:
                timer.cancel()
                waiter[0] = None
    finally:
        if not reader.done():
            reader.cancel()
            try:
                await reader
            except BaseException:
                pass
        await events.aclose()


def _merged(items: list) -> list:
    """(index, item) pairs with each run of one call's deltas to one choice merged into one
    delta (one SSE chunk where the replica's deltas queued up here)."""
    merged: list = []
    for index, out in items:
        if merged and isinstance(out, RequestOutput):
            last_index, last = merged[-1]
            if (
                last_index == index
                and isinstance(last, RequestOutput)
                and last.request_id == out.request_id
                and not last.finished
            ):
                merged[-1] = (index, last.merge(out))
                continue
        merged.append((index, out))
    return merged


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()
