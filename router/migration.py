"""Streams that outlive their replica: what of one choice has reached the client (`Delivered`,
from which a migration's `Resume` is made), and the ingress's tally of migrations and of the gap
each left in its client's stream (`Migrations`, exposed on the ingress's /metrics)."""

from __future__ import annotations

import bisect
import time

from replica.api import RequestOutput, Resume
from router.settings import DEFAULT_MIGRATION_LIMIT

# upper bounds (seconds) of the gap histogram's buckets: a migration re-runs the prompt and
# the tokens already sent as one prefill on the new replica
GAP_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# why a stream moved: its replica was lost (actor died, node gone) or handed it back (draining)
REASONS = ("lost", "drained")


class Delivered:
    """What of one choice reached the caller over all its sends: the tokens and text (a
    migration resumes from them), whether its last delta finished it, and when the last delta
    went out (a migration's gap is measured from it)."""

    __slots__ = ("token_ids", "text", "finished", "last_at", "gap_from")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.finished = False
        self.last_at: float | None = None  # None: nothing reached the caller yet
        self.gap_from: float | None = None  # set while a migration's gap is open

    @property
    def started(self) -> bool:
        return self.last_at is not None

    def add(self, out: RequestOutput, now: float | None = None) -> float | None:
        """Note a delta handed to the caller; returns the gap it closes (seconds since the
        last delta before a migration), or None."""
        now = time.monotonic() if now is None else now
        self.token_ids.extend(out.new_token_ids)
        self.text += out.new_text
        self.finished = out.finished
        self.last_at = now
        gap, self.gap_from = self.gap_from, None
        return None if gap is None else now - gap

    def lost(self) -> None:
        """The choice's replica is gone: the gap in its stream opens at its last delta."""
        if self.gap_from is None:
            self.gap_from = self.last_at

    def resume(self, num_migrations: int) -> Resume:
        return Resume(list(self.token_ids), self.text, num_migrations)


class Migrations:
    """An ingress's migration limit and its tallies: migrations by reason, and a histogram of
    the gaps they left in their clients' streams (time from the last delta before the loss to
    the first after it)."""

    def __init__(self, limit: int = DEFAULT_MIGRATION_LIMIT) -> None:
        self.limit = limit
        self.counts = dict.fromkeys(REASONS, 0)
        self.gap_buckets = [0] * len(GAP_BUCKETS_S)  # per bucket, not cumulative
        self.gap_count = 0
        self.gap_sum_s = 0.0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def note(self, reason: str) -> None:
        self.counts[reason] += 1

    def observe_gap(self, seconds: float) -> None:
        index = bisect.bisect_left(GAP_BUCKETS_S, seconds)
        if index < len(self.gap_buckets):
            self.gap_buckets[index] += 1
        self.gap_count += 1
        self.gap_sum_s += seconds

    def gap_summary(self) -> dict:
        """The gaps' count and mean (seconds; None before the first)."""
        mean = self.gap_sum_s / self.gap_count if self.gap_count else None
        return {"count": self.gap_count, "mean_s": None if mean is None else round(mean, 4)}

    def exposition(self, ingress_id: str) -> bytes:
        """The tallies in Prometheus's text format, labelled with the ingress replica."""
        label = f'ingress="{ingress_id}"'
        lines = [
            "# HELP stepserve:ingress_migrations_total Streams continued on another replica "
            "after theirs was lost (actor died, node gone) or handed them back (draining).",
            "# TYPE stepserve:ingress_migrations_total counter",
        ]
        for reason, count in self.counts.items():
            lines.append(f'stepserve:ingress_migrations_total{{{label},reason="{reason}"}} {count}')
        name = "stepserve:ingress_migration_gap_seconds"
        lines += [
            f"# HELP {name} The gap a migration left in its client's stream: from the last "
            "delta before the loss to the first after it.",
            f"# TYPE {name} histogram",
        ]
        cumulative = 0
        for bound, count in zip(GAP_BUCKETS_S, self.gap_buckets, strict=True):
            cumulative += count
            lines.append(f'{name}_bucket{{{label},le="{bound:g}"}} {cumulative}')
        lines += [
            f'{name}_bucket{{{label},le="+Inf"}} {self.gap_count}',
            f"{name}_sum{{{label}}} {self.gap_sum_s:.6f}",
            f"{name}_count{{{label}}} {self.gap_count}",
        ]
        return ("\n".join(lines) + "\n").encode()
