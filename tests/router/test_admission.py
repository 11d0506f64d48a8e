"""Admission by expected wait, fair shares between API keys, and the stream's pacing
(keep-alives, deadlines), without Ray."""

from __future__ import annotations

import asyncio
import math

import pytest

from router.admission import Admission
from router.errors import HTTPError
from router.guard import RequestGuard
from router.ingress import _KEEPALIVE, Ticket, _batches
from router.settings import AuthConfig, HttpConfig


def test_no_rate_measured_admits_and_an_empty_queue_waits_nothing():
    admission = Admission()
    assert admission.judge(1.0).admit and admission.expected_wait() == 0.0
    admission.enter("a")
    verdict = admission.judge(0.001)
    assert verdict.admit and verdict.expected_wait_s is None  # unknown rate: admitted


def fill(admission: Admission, started: int, queued: dict[str, int], t0: float = 100.0) -> float:
    """`queued` (key -> priority) wait from t0 - 10 on, while `started` requests end over the
    10 s before t0 (a saturated server)."""
    for key, priority in queued.items():
        admission.enter(key, priority, now=t0 - 10)
    for i in range(started):  # unary requests (no seat times): the departures give the rate
        admission._running[f"s{i}"] = None
        admission.leave(f"s{i}", now=t0 - 10 + 10 * (i + 1) / started)
    return t0


def test_expected_wait_is_the_queue_ahead_over_the_service_rate():
    admission = Admission(window_s=10.0)
    now = fill(admission, started=20, queued={f"q{i}": 0 for i in range(9)})  # 2 per second
    rate = admission.service_rate(now)
    assert rate == pytest.approx(2.0, rel=0.06)
    assert admission.expected_wait(0, now) == pytest.approx(10 / rate)  # 9 ahead + itself
    fits = admission.judge(6.0, 0, now)
    assert fits.admit
    refused = admission.judge(2.0, 0, now)
    assert not refused.admit
    # the queue drains at the rate: after about (wait - deadline) the newcomer would fit
    assert refused.retry_after_s == math.ceil(10 / rate - 2.0)


def test_a_bursts_refusals_are_told_to_come_back_at_the_service_rate():
    """Refusals that all see the same queue are not all told the same second (they would come
    back together and be refused again): each takes the next return slot, slots spaced at the
    service rate; slots that lapse unused are not held against later refusals."""
    admission = Admission(window_s=10.0)
    now = fill(admission, started=20, queued={f"q{i}": 0 for i in range(9)})  # 2 per second
    rate = admission.service_rate(now)
    first = 10 / rate - 2.0  # when the first refusal would fit
    retries = [admission.judge(2.0, 0, now).retry_after_s for _ in range(40)]
    assert retries == sorted(retries) and retries[0] == math.ceil(first)
    assert retries[-1] == math.ceil(first + 39 / rate)  # 40 refusals: 20 s at 2 per second
    assert max(retries.count(r) for r in retries) <= math.ceil(rate) + 1
    later = now + 60  # the slots promised have passed
    assert admission.judge(2.0, 0, later).retry_after_s == retries[0]


def test_the_lowest_priority_is_refused_first():
    admission = Admission()
    queued = {f"low{i}": 5 for i in range(16)} | {f"high{i}": 0 for i in range(2)}
    now = fill(admission, started=20, queued=queued)
    assert admission.judge(3.0, priority=0, now=now).admit  # 2 ahead: 1.5 s
    assert not admission.judge(3.0, priority=5, now=now).admit  # 18 ahead: 9.5 s


def test_only_started_requests_that_end_behind_a_queue_count_as_served():
    admission = Admission(min_samples=1)
    admission.enter("x", now=0.0)
    admission.leave("x", now=0.5)  # never started: refused by a replica, cancelled
    admission.enter("y", now=1.0)
    admission.started("y", now=1.5, streamed=False)  # running: not a departure yet
    assert admission.service_rate(2.0) is None and admission.num_queued == 0
    admission.leave("y", now=2.0)  # nothing was queued behind it: load, not capacity
    assert admission.service_rate(2.0) is None
    admission.enter("z", now=3.0)
    admission.started("z", now=3.1, streamed=False)
    admission.enter("w", now=3.2)  # queued behind z
    admission.leave("z", now=4.0)
    assert admission.service_rate(4.0) == pytest.approx(1 / 5.0)  # min_span_s of 5 s


def test_the_rate_counts_only_the_time_requests_were_queued():
    """A server that measured 2 departures/s under a backlog and then idled keeps that rate:
    idle seconds do not dilute it (they did, and a burst's retries met a server that thought
    itself slower than it was)."""
    admission = Admission(window_s=30.0, min_span_s=1.0)
    for i in range(8):  # i0..i7 wait at t=0; r0..r7 run and end at 2 per second
        admission.enter(f"q{i}", now=0.0)
        admission._running[f"r{i}"] = None
    for i in range(8):
        admission.leave(f"r{i}", now=0.5 * (i + 1))
        admission.started(f"q{i}", now=0.5 * (i + 1), streamed=False)  # queue empty at t=4
    for i in range(8):
        admission.leave(f"q{i}", now=20.0 + i)  # ended while nothing was queued
    admission.enter("late", now=25.0)
    assert admission.service_rate(25.0) == pytest.approx(2.0)


def test_streams_give_the_rate_by_littles_law_from_the_first_that_ends():
    """64 streams in their seats, the one that ended held its seat 16 s: 4 per second, known
    from one departure (departures alone would need a window of waves, and just after a burst
    read far too low)."""
    admission = Admission()
    for i in range(65):
        admission.enter(f"s{i}", now=0.0)
        admission.started(f"s{i}", now=1.0)
    for i in range(10):
        admission.enter(f"q{i}", now=2.0)
    admission.leave("s0", now=17.0)
    assert admission.service_rate(17.0) == pytest.approx(65 / 16.0)
    assert admission.expected_wait(0, 17.0) == pytest.approx(11 / (65 / 16.0))


def test_the_seats_are_the_most_streams_seen_at_once_not_those_with_a_token_now():
    """Just after a burst most admitted streams are still in prefill: the few with a first
    token are not the capacity (reading them so told refusals to come back far too late)."""
    admission = Admission()
    for i in range(64):  # a first wave fills 64 seats, each holds its seat 10 s
        admission.enter(f"w{i}", now=0.0)
        admission.started(f"w{i}", now=1.0)
    for i in range(64):
        admission.leave(f"w{i}", now=11.0)
    for i in range(100):  # a burst: 100 admitted, 2 have a first token so far
        admission.enter(f"b{i}", now=12.0)
    admission.started("b0", now=13.0)
    admission.started("b1", now=13.0)
    assert admission.service_rate(13.0) == pytest.approx(64 / 10.0)


def test_a_seats_time_counts_against_the_deadline_behind_a_queue():
    """Streams hold a seat 16 s: a newcomer 3 s from a seat would end after 19 s; with a 10 s
    deadline it is refused (admitted, its deadline would cut it off mid-stream). With nothing
    ahead it is admitted, whatever its deadline."""
    admission = Admission()
    for i in range(9):
        admission.enter(f"s{i}", now=0.0)
        admission.started(f"s{i}", now=1.0)
    admission.enter("q", now=2.0)
    admission.leave("s0", now=17.0)  # 9 seats, 16 s each: 0.5625 per second
    verdict = admission.judge(10.0, 0, now=17.0)
    assert not verdict.admit and verdict.expected_wait_s == pytest.approx(2 / 0.5625)
    assert verdict.retry_after_s == math.ceil(2 / 0.5625 + 16 - 10)
    assert admission.judge(20.0, 0, now=17.0).admit
    admission.started("q", now=17.0)
    assert admission.judge(1.0, 0, now=17.0).admit  # nothing ahead


def test_a_steady_pace_of_departures_caps_the_seats_estimate():
    """64 seats held 10 s each read as 6.4 per second; 40 departures behind a queue over the
    last 10 s say the server's pace is 4: the rate is 4 (a seat's turnover is not in the seat
    time). With fewer departures than `steady_samples`, Little's law stands."""
    admission = Admission(steady_samples=20)
    for i in range(64):
        admission.enter(f"w{i}", now=0.0)
        admission.started(f"w{i}", now=1.0)
    for i in range(64):
        admission.leave(f"w{i}", now=11.0)  # nothing queued: no departure counted
    assert admission.service_rate(11.0) == pytest.approx(6.4)
    admission.enter("q", now=11.0)
    for i in range(40):
        admission._running[f"d{i}"] = None
        admission.leave(f"d{i}", now=11.0 + 10 * (i + 1) / 40)
    assert admission.service_rate(21.0) == pytest.approx(4.0)


def guard(limit: int, keys: list[str]) -> RequestGuard:
    return RequestGuard(
        HttpConfig(max_pending_requests=limit), AuthConfig(api_keys=keys, api_keys_env="NOPE_X")
    )


def test_one_key_cannot_take_more_than_its_fair_share_once_keys_compete():
    g = guard(10, ["a", "b"])
    slots = [g.admit("a") for _ in range(5)]  # alone, a may go past half the limit
    slots.append(g.admit("b"))  # 6 in flight, 2 keys: a's share is 5, it holds 5
    with pytest.raises(HTTPError) as refused:
        g.admit("a")
    assert refused.value.status == 429 and "fair share" in refused.value.message
    slots += [g.admit("b") for _ in range(4)]  # b may still grow to the limit
    with pytest.raises(HTTPError, match="10 requests in flight"):
        g.admit("b")
    for slot in slots:
        slot.release()
        slot.release()  # idempotent
    assert g.inflight == 0 and g.inflight_by_key == {}


async def _slow_events(delays: list[float]):
    for i, delay in enumerate(delays):
        await asyncio.sleep(delay)
        yield i


def test_paced_events_send_keepalives_while_waiting_and_deadlines_end_them():
    async def collect(delays, deadline_s, first_wait_s=0.1):
        ticket = Ticket(slot=None, deadline_s=deadline_s)
        out = []
        try:
            async for items in _batches(_slow_events(delays), 0.1, first_wait_s, ticket):
                out.extend(["ka"] if items is _KEEPALIVE else items)
        except HTTPError as err:
            out.append(err.status)
        return out

    got = asyncio.run(collect([0.0, 0.35, 0.0], deadline_s=5))
    assert got[0] == 0 and got[-2:] == [1, 2] and 2 <= got.count("ka") <= 4
    got = asyncio.run(collect([0.0, 5.0], deadline_s=0.3))
    assert got[0] == 0 and got[-1] == 408 and "ka" in got
    # the first item is waited for longer (the HTTP headers wait for a replica's output,
    # Accepted or refusal, past the fan-out's retries), then keep-alives start; the deadline
    # still ends the wait
    got = asyncio.run(collect([0.35, 0.0], deadline_s=5, first_wait_s=1.0))
    assert got == [0, 1]
    got = asyncio.run(collect([0.55, 0.0], deadline_s=5, first_wait_s=0.3))
    assert got[0] == "ka" and got[-2:] == [0, 1] and 2 <= got.count("ka") <= 4
    got = asyncio.run(collect([5.0], deadline_s=0.3, first_wait_s=1.0))
    assert got == [408]


def test_deltas_that_queued_up_go_out_as_one_write_of_one_chunk_per_choice_and_call():
    """A stream behind its replicas writes what arrived since its last write at once, each
    run of one call's deltas to one choice merged (one JSON chunk); a delta of another
    choice, or of another call of the same choice (a migration's), stays apart."""
    import json
    import types

    from replica.api import RequestOutput
    from router.dialects import CompletionDialect
    from router.protocol import CompletionRequest
    from router.streaming import Answers

    def delta(rid: str, token: int, finish: str | None = None) -> RequestOutput:
        return RequestOutput(rid, [token], f"t{token} ", 3, token, finish_reason=finish)

    burst = [(0, delta("a", 1)), (0, delta("a", 2)), (1, delta("b", 1)), (0, delta("a2", 3)),
             (0, delta("a2", 4, "length")), (1, delta("b", 2, "length"))]  # fmt: skip

    class Calls:
        async def fan_out(self, jobs):
            for item in burst:
                yield item  # no await between them: all queued before the stream reads

    class Tokenizer:
        def decode(self, ids):
            return "".join(f"<{i}>" for i in ids)

    req = CompletionRequest.model_validate({"prompt": "x", "n": 2, "stream": True})
    answers = Answers(Calls(), Admission(), keepalive_s=30)
    ticket = Ticket(types.SimpleNamespace(release=lambda: None), deadline_s=60)
    answers.admission.enter(ticket.key)
    jobs = [(0, None), (1, None)]
    jobs = [(i, types.SimpleNamespace(sampling=types.SimpleNamespace(logprobs=None),
                                      num_prompt_tokens=3)) for i, _ in jobs]  # fmt: skip

    async def run():
        return [
            w async for w in answers.stream(jobs, CompletionDialect(Tokenizer(), "m"), req, ticket)
        ]

    writes = asyncio.run(run())
    assert len(writes) == 2 and writes[-1] == "data: [DONE]\n\n"  # the burst, then the end
    chunks = [json.loads(line[6:]) for line in writes[0].split("\n") if line.startswith("data: ")]
    texts = [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks]
    assert texts == [(0, "t1 t2 "), (1, "t1 "), (0, "t3 t4 "), (1, "t2 ")]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length", "length"]
