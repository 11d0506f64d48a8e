"""Admission by expected wait, fair shares between API keys, and the stream's pacing
(keep-alives, deadlines), without Ray."""

from __future__ import annotations

import asyncio
import math

import pytest

from router.admission import Admission
from router.errors import HTTPError
from router.guard import RequestGuard
from router.ingress import _KEEPALIVE, Ticket, _paced, _until
from router.settings import AuthConfig, HttpConfig


def test_no_rate_measured_admits_and_an_empty_queue_waits_nothing():
    admission = Admission()
    assert admission.judge(1.0).admit and admission.expected_wait() == 0.0
    admission.enter("a")
    verdict = admission.judge(0.001)
    assert verdict.admit and verdict.expected_wait_s is None  # unknown rate: admitted


def fill(admission: Admission, started: int, queued: dict[str, int], t0: float = 100.0) -> float:
    """`started` requests started and ended over 10 s before t0; `queued` wait (key ->
    priority)."""
    for i in range(started):
        admission.enter(f"s{i}")
        admission.started(f"s{i}")
        admission.leave(f"s{i}", now=t0 - 10 + 10 * i / started)
    for key, priority in queued.items():
        admission.enter(key, priority)
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
    # the queue drains at the rate: after about (wait - deadline) the newcomer would fit;
    # refusals are spread over up to half as much again, so a burst does not return at once
    base = 10 / rate - 2.0
    retries = [admission.judge(2.0, 0, now).retry_after_s for _ in range(40)]
    assert all(math.ceil(base) <= r <= math.ceil(1.5 * base) for r in retries)
    assert len(set(retries)) > 1


def test_the_lowest_priority_is_refused_first():
    admission = Admission()
    queued = {f"low{i}": 5 for i in range(16)} | {f"high{i}": 0 for i in range(2)}
    now = fill(admission, started=20, queued=queued)
    assert admission.judge(3.0, priority=0, now=now).admit  # 2 ahead: 1.5 s
    assert not admission.judge(3.0, priority=5, now=now).admit  # 18 ahead: 9.5 s


def test_only_started_requests_that_end_count_as_served():
    admission = Admission(min_samples=1)
    admission.enter("x")
    admission.leave("x")  # never started: refused by a replica, cancelled
    admission.enter("y")
    admission.started("y")  # running: not a departure yet
    assert admission.service_rate() is None and admission.num_queued == 0
    admission.leave("y")
    assert admission.service_rate() is not None


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
    async def collect(delays, deadline_s):
        ticket = Ticket(slot=None, deadline_s=deadline_s)
        out = []
        try:
            async for item in _until(_paced(_slow_events(delays), 0.05, 0.1), ticket):
                out.append("ka" if item is _KEEPALIVE else item)
        except HTTPError as err:
            out.append(err.status)
        return out

    got = asyncio.run(collect([0.0, 0.35, 0.0], deadline_s=5))
    assert got[0] == 0 and got[-2:] == [1, 2] and 2 <= got.count("ka") <= 4
    got = asyncio.run(collect([0.0, 5.0], deadline_s=0.3))
    assert got[0] == 0 and got[-1] == 408 and "ka" in got
