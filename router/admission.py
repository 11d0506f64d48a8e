"""Admission by expected wait: an ingress admits a request when the time its first token is
expected to take fits within the request's deadline, and refuses it at once (429, Retry-After
drawn from the same estimate) when it does not.

The estimate is the ingress's own queue over its own service rate: the requests it admitted
that are still waiting for their first token (streams) or their answer (unary), counting only
those of equal or higher priority (lower value) since the replicas serve those first, divided
by the rate at which its started requests have ended over the last window. In a saturated
replica a queued request starts when a running one ends, so the queue drains at the departure
rate (the rate of first tokens would overstate it: a batch's worth starts at once when a burst
arrives, then none until they end). So the lowest priority is refused first, and each ingress
of several judges by its own share. Before any started request has ended there is no rate:
requests are admitted (the hard count limit, http.max_pending_requests, still holds), and a
deadline ends those that wait too long.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    admit: bool
    expected_wait_s: float | None  # None: no service rate measured yet
    retry_after_s: int = 0  # when refused: seconds until the wait would fit the deadline


class Admission:
    """One ingress's queue of admitted requests not yet started, and its service rate."""

    def __init__(
        self, window_s: float = 10.0, min_samples: int = 3, min_span_s: float = 5.0
    ) -> None:
        self.window_s = window_s
        self.min_samples = min_samples
        # continuous batching starts requests in waves (a batch's worth at once, then none
        # while it decodes): a rate over less than this would take one wave for the pace
        self.min_span_s = min_span_s
        self._queued: dict[str, int] = {}  # request key -> priority
        self._rng = random.Random()
        self._running: set[str] = set()  # started, not ended
        self._started: deque[float] = deque()  # times started requests ended, last window
        self._last_rate = 0.0

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def service_rate(self, now: float | None = None) -> float | None:
        """Requests per second leaving the queue over the window (the last such rate when the
        window holds too few to measure but the queue is not empty), or None when unknown."""
        now = time.monotonic() if now is None else now
        started = self._started
        while started and now - started[0] > self.window_s:
            started.popleft()
        if len(started) >= self.min_samples:
            rate = len(started) / max(now - started[0], self.min_span_s)
            self._last_rate = rate
            return rate
        return self._last_rate or None

    def expected_wait(self, priority: int = 0, now: float | None = None) -> float | None:
        """Seconds a newcomer of this priority is expected to wait for its first token."""
        ahead = sum(1 for p in self._queued.values() if p <= priority)
        if ahead == 0:
            return 0.0
        rate = self.service_rate(now)
        if rate is None or rate <= 0:
            return None
        return (ahead + 1) / rate

    def judge(self, deadline_s: float, priority: int = 0, now: float | None = None) -> Verdict:
        now = time.monotonic() if now is None else now
        wait = self.expected_wait(priority, now)
        if wait is None or wait <= deadline_s:
            return Verdict(True, wait)
        # the queue ahead shrinks at the service rate: after (wait - deadline) it would fit.
        # A burst's refusals all see the same queue: up to half as much again at random, so
        # they do not all come back in the same second
        base = wait - deadline_s
        retry_after = max(1, math.ceil(base * (1.0 + 0.5 * self._rng.random())))
        return Verdict(False, wait, retry_after)

    def enter(self, key: str, priority: int = 0) -> None:
        self._queued[key] = priority

    def started(self, key: str) -> None:
        """The request left the queue: its first token (or its answer) arrived."""
        if self._queued.pop(key, None) is not None:
            self._running.add(key)

    def leave(self, key: str, now: float | None = None) -> None:
        """The request ended. One that had started counts as a departure (the service rate);
        one that never started (refused by a replica, cancelled, timed out) does not."""
        self._queued.pop(key, None)
        if key in self._running:
            self._running.discard(key)
            self._started.append(time.monotonic() if now is None else now)
