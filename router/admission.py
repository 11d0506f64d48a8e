"""Admission by expected wait: an ingress admits a request when the time it is expected to take
(the wait for a seat, then a seat's time) fits within the request's deadline, and refuses it at
once (429, Retry-After drawn from the same estimate) when it does not.

The wait is the ingress's own queue over its service rate: the requests it admitted that are
still waiting for their first token (streams) or their answer (unary), counting only those of
equal or higher priority (lower value) since the replicas serve those first, divided by the
rate at which the queue drains. So the lowest priority is refused first, and each ingress of
several judges by its own share. Behind a queue a seat's time (the mean of the last streams',
first token to end) is added: the deadline covers the whole request (admitted by the first
token alone, retries were cut off mid-stream; docs/overload-and-soak.md).

The rate, measured three ways because each fails somewhere (docs/overload-and-soak.md):
- Little's law over streams: the most streams seen in their seats at once lately (the seats
  the replicas give this ingress) over their mean seat time. It needs one stream to have ended,
  where counting departures needs a window of waves and reads low just after a burst (a batch's
  worth runs, none has ended). Not the streams in a seat now: just after a burst most admitted
  streams are still in prefill. It reads high, though: a seat counts from its first token, not
  from the next request's prefill in it (it promised 5.5 per second for a server serving ~4).
- The pace of departures while requests were queued, over the time they were queued: once at
  least `steady_samples` of them are in the window it caps Little's estimate. Only departures
  behind a queue count: a lightly loaded server's departures measure its load, not its
  capacity (counting them, an idle server looked slow and refused the retries too).
- Departures alone where no stream has ended (unary requests only: their first token is not
  seen).
Before any rate there is none: requests are admitted (the hard count limit,
http.max_pending_requests, still holds), and a deadline ends those that wait too long.

A burst's refusals all see the same queue; told the same Retry-After they came back together and
were refused again (most of a burst's retries). Each refusal takes the next return slot instead, the
slots spaced at the service rate from when the request would fit; slots nobody took lapse.
"""

from __future__ import annotations

import math
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
        self,
        window_s: float = 10.0,
        min_samples: int = 3,
        min_span_s: float = 5.0,
        seat_window_s: float = 120.0,
        steady_samples: int = 20,
    ) -> None:
        self.window_s = window_s
        self.min_samples = min_samples
        # continuous batching starts requests in waves (a batch's worth at once, then none
        # while it decodes): a rate over less than this would take one wave for the pace
        self.min_span_s = min_span_s
        self._queued: dict[str, int] = {}  # request key -> priority
        self._next_return = 0.0  # when the next refused request is told to come back
        # started, not ended -> when its first token came (None: unary, not seen)
        self._running: dict[str, float | None] = {}
        self.seat_window_s = seat_window_s
        self.steady_samples = steady_samples
        self._seat_times: deque[tuple[float, float]] = deque(maxlen=256)  # (ended, seconds)
        self._in_seats = 0  # streams with a first token, not ended
        self._peak_seats, self._peak_at = 0, 0.0  # the most at once lately, and when
        self._departures: deque[float] = deque()  # ends of started requests while queued
        self._backlog_since: float | None = None  # the queue is not empty since then
        self._backlogs: deque[tuple[float, float]] = deque()  # closed periods, last window
        self._last_rate = 0.0

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def _backlogged_s(self, now: float) -> float:
        """Seconds of the last window during which the queue was not empty."""
        since = now - self.window_s
        backlogs = self._backlogs
        while backlogs and backlogs[0][1] <= since:
            backlogs.popleft()
        total = sum(end - max(start, since) for start, end in backlogs)
        if self._backlog_since is not None:
            total += now - max(self._backlog_since, since)
        return total

    def service_rate(self, now: float | None = None) -> float | None:
        """Requests per second the queue drains at: the departures while requests were queued
        over the window when there are enough of them to be the server's pace (at least
        `steady_samples`), and no more than the streams' seats over their mean seat time;
        the fewer of the two that can be measured otherwise (the last rate when neither can
        now), or None when unknown."""
        now = time.monotonic() if now is None else now
        seats = self._seat_times
        while seats and now - seats[0][0] > self.seat_window_s:
            seats.popleft()
        little = None
        if seats and self._peak_seats:
            if now - self._peak_at > self.seat_window_s:  # the peak is old: start again
                self._peak_seats, self._peak_at = self._in_seats, now
            little = max(self._peak_seats, 1) / max(self.mean_seat_s(now), 1e-3)
        departures = self._departures
        while departures and now - departures[0] > self.window_s:
            departures.popleft()
        paced = None
        if len(departures) >= self.min_samples:
            paced = len(departures) / max(self._backlogged_s(now), self.min_span_s)
        if little is not None and paced is not None:
            # Little's law counts a seat from its first token, so a seat's turnover (prefill
            # of the next request in it) is missing and it reads high; a steady stream of
            # departures is the pace itself
            rate = min(little, paced) if len(departures) >= self.steady_samples else little
        else:
            rate = little if little is not None else paced
        if rate is None:
            return self._last_rate or None
        self._last_rate = rate
        return rate

    def mean_seat_s(self, now: float) -> float:
        """The mean time the last streams held a seat (first token to end); 0 before any."""
        seats = [s for t, s in self._seat_times if now - t <= self.seat_window_s]
        return sum(seats) / len(seats) if seats else 0.0

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
        # the deadline covers the whole request: behind a queue, a seat's time follows the
        # wait (admitted by the first token alone, a request could be cut off mid-stream by its
        # deadline). With nothing ahead the request is admitted whatever its deadline: a 429
        # would not help it
        total = None if wait is None else wait + (self.mean_seat_s(now) if wait > 0 else 0.0)
        if total is None or total <= deadline_s:
            return Verdict(True, wait)
        # The queue ahead shrinks at the service rate: after (total - deadline) it would fit.
        # But a burst's refusals all see the same queue, and told that they would all come
        # back together and be refused again: each refusal takes the next return slot, the
        # slots spaced at the service rate (slots nobody took lapse as time passes)
        rate = self._last_rate
        back_at = max(now + total - deadline_s, self._next_return)
        self._next_return = back_at + 1.0 / rate
        return Verdict(False, wait, max(1, math.ceil(back_at - now)))

    def enter(self, key: str, priority: int = 0, now: float | None = None) -> None:
        if not self._queued:
            self._backlog_since = time.monotonic() if now is None else now
        self._queued[key] = priority

    def _dequeue(self, key: str, now: float | None) -> bool:
        if self._queued.pop(key, None) is None:
            return False
        if not self._queued and self._backlog_since is not None:
            end = time.monotonic() if now is None else now
            self._backlogs.append((self._backlog_since, end))
            self._backlog_since = None
        return True

    def started(self, key: str, now: float | None = None, streamed: bool = True) -> None:
        """The request left the queue: its first token (`streamed`), or its answer, arrived."""
        if self._dequeue(key, now):
            now = time.monotonic() if now is None else now
            self._running[key] = now if streamed else None
            if streamed:
                self._in_seats += 1
                if self._in_seats >= self._peak_seats:
                    self._peak_seats, self._peak_at = self._in_seats, now

    def leave(self, key: str, now: float | None = None) -> None:
        """The request ended. One that had started counts as a departure (the service rate)
        when requests were queued behind it; one that never started (refused by a replica,
        cancelled, timed out) does not."""
        self._dequeue(key, now)
        if key in self._running:
            now = time.monotonic() if now is None else now
            start = self._running.pop(key)
            if start is not None:
                self._in_seats -= 1
                self._seat_times.append((now, now - start))
            if self._queued:
                self._departures.append(now)
