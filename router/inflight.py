"""A router's own tally of its requests in flight on each replica (`InflightLoad`), and the
registry through which the ingress reaches the tallies of the routers in its process: Ray builds
each router inside the ingress replica and gives user code no reference to it, so the ingress
reports a request's first token and its end here (`note_first_token`, `note_finished`) and every
registered router's tally hears it. The registry lives in this module, which Ray imports by
reference (router/request_router.py is pickled by value: its globals would be per router)."""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence

from replica.api import RoutingStats
from router.policy import ReplicaStats


class InflightLoad:
    """A router's own, always-current tally per replica: how many of its requests are in flight
    there and their KV footprint (prompt + max_tokens), when its requests there finished (to
    discount them from the replica's last stats report), and which are still in prefill.

    Two kinds of request. One whose sender reports its progress (the ingress; `routed` with a
    `key`, the payload's own request id) leaves the tally at the sender's `finished(key)`, which
    comes after `routed` (Ray hands the sender its response only once routed), and
    its prefill ends at `first_token(key)`; Ray's completion hook is ignored for it, because Ray
    2.60 fires `on_request_completed` for a streaming call as soon as the replica accepts it,
    before `on_request_routed` even (tests/integration/test_routing.py shows it). Any other request leaves
    at Ray's `completed(request_id)`; one that Ray completes before `routed` (it finished at
    once) is remembered, a bounded number, so the late `routed` leaves no phantom behind. A
    completion on another replica (a request the replica rejected, then sent elsewhere) does
    not cancel the `routed` that follows.

    Choices not yet routed: Ray routes a burst of requests one after another in one pass of its
    event loop, and hands each to its replica (`routed`) only after the replica has accepted
    it, a round trip later. Counted from `routed` alone, every request of a burst would see the
    same tally and go to the same replica. So the router also notes its choice at once
    (`chosen`): the request counts on the replica it was chosen for until `routed` (or Ray's
    completion hook) says where it went, or for `choice_ttl_s` at most (a request cancelled
    while waiting for a replica).

    Prefill: a request routed with `prompt_tokens` and a `key` counts as prefilling until its
    first token; the prompt tokens per second from routing to first token over recent requests
    (`prefill_rate`: moving averages of prompt tokens and of seconds, divided) discount what it
    has done since. The ingress reports from its own
    thread, the router's hooks run on the router's: every method takes the lock.

    Adapters: the LoRA adapters this router sent requests for to each replica, the latest
    `lora_slots` per replica with when (`adapter_sent`): a replica loads an adapter for the
    request that needs it, so the next request for it should find it held there before the
    replica's next report says so (and when reports are stale). `lora_slots` is the
    replicas' max_cpu_loras (the deployment's request_router_kwargs give it).
    """

    def __init__(
        self,
        completion_window_s: float = 60.0,
        max_early: int = 10_000,
        rate_alpha: float = 0.2,
        choice_ttl_s: float = 5.0,
        lora_slots: int = 4,
    ) -> None:
        self.completion_window_s = completion_window_s
        self.choice_ttl_s = choice_ttl_s
        self._lock = threading.Lock()
        # entry id (the key, else Ray's request id) -> (replica id, tokens, Ray's request id)
        self._requests: dict[str, tuple[str, int, str]] = {}
        self._tokens: dict[str, int] = {}
        self._counts: dict[str, int] = {}
        self._completions: dict[str, deque[float]] = {}
        self._finished_early: OrderedDict[str, str] = OrderedDict()  # Ray's id -> replica id
        self._max_early = max_early
        self._reported: set[str] = set()  # Ray's ids of in-flight requests with a key
        # key -> (replica, prompt, t), and the same per replica (a decision reads a few replicas)
        self._prefilling: dict[str, tuple[str, int, float]] = {}
        self._prefilling_at: dict[str, dict[str, tuple[int, float]]] = {}
        self._rate_alpha = rate_alpha
        self._rate_tokens = self._rate_seconds = 0.0  # moving averages per request
        self.prefill_rate = 0.0  # prompt tokens/s, routed -> first token; 0: none seen yet
        # Ray's request id -> (replica id, tokens, time) of a choice not yet routed
        self._chosen: OrderedDict[str, tuple[str, int, float]] = OrderedDict()
        self._chosen_counts: dict[str, int] = {}
        self._chosen_tokens: dict[str, int] = {}
        self.lora_slots = lora_slots
        self._adapters: dict[str, OrderedDict[str, float]] = {}  # replica -> adapter -> sent at

    def adapter_sent(self, replica_id: str, name: str, now: float) -> None:
        """A request for adapter `name` goes to `replica_id`, which loads it if it must."""
        with self._lock:
            sent = self._adapters.setdefault(replica_id, OrderedDict())
            sent[name] = now
            sent.move_to_end(name)
            while len(sent) > self.lora_slots:
                sent.popitem(last=False)

    def adapter_sent_at(self, replica_id: str, name: str) -> float | None:
        """When this router last sent a request for adapter `name` to `replica_id` (None: not
        among the latest `lora_slots` adapters it sent there)."""
        sent = self._adapters.get(replica_id)
        return None if sent is None else sent.get(name)

    def chosen(self, request_id: str, replica_id: str, tokens: int, now: float) -> None:
        """The router chose `replica_id` for Ray's request `request_id`: count it there until
        it is routed (a new choice for the same request replaces this one)."""
        with self._lock:
            self._drop_choice(request_id)
            self._expire_choices(now)
            self._chosen[request_id] = (replica_id, tokens, now)
            self._chosen_counts[replica_id] = self._chosen_counts.get(replica_id, 0) + 1
            self._chosen_tokens[replica_id] = self._chosen_tokens.get(replica_id, 0) + tokens

    def _drop_choice(self, request_id: str) -> None:
        entry = self._chosen.pop(request_id, None)
        if entry is None:
            return
        replica_id, tokens, _ = entry
        self._chosen_counts[replica_id] -= 1
        self._chosen_tokens[replica_id] -= tokens
        if not self._chosen_counts[replica_id]:
            del self._chosen_counts[replica_id], self._chosen_tokens[replica_id]

    def _expire_choices(self, now: float) -> None:
        while self._chosen:  # oldest first
            request_id, (_, _, at) = next(iter(self._chosen.items()))
            if now - at <= self.choice_ttl_s:
                break
            self._drop_choice(request_id)

    def routed(
        self,
        request_id: str,
        replica_id: str,
        tokens: int,
        prompt_tokens: int = 0,
        key: str | None = None,
        now: float = 0.0,
    ) -> None:
        with self._lock:
            self._drop_choice(request_id)
            if key is None:
                if self._finished_early.get(request_id) == replica_id:  # it has finished
                    del self._finished_early[request_id]
                    return
                if request_id not in self._requests:
                    self._add(request_id, replica_id, tokens, request_id)
                return
            self._finished_early.pop(request_id, None)  # Ray's early completion: not the end
            if key in self._requests:
                return
            self._add(key, replica_id, tokens, request_id)
            self._reported.add(request_id)
            if prompt_tokens > 0:
                self._prefilling[key] = (replica_id, prompt_tokens, now)
                self._prefilling_at.setdefault(replica_id, {})[key] = (prompt_tokens, now)

    def _add(self, entry: str, replica_id: str, tokens: int, request_id: str) -> None:
        self._requests[entry] = (replica_id, tokens, request_id)
        self._tokens[replica_id] = self._tokens.get(replica_id, 0) + tokens
        self._counts[replica_id] = self._counts.get(replica_id, 0) + 1

    def _remove(self, entry: str, now: float) -> None:
        replica_id, tokens, request_id = self._requests.pop(entry)
        self._reported.discard(request_id)
        self._end_prefill(entry)
        self._tokens[replica_id] -= tokens
        self._counts[replica_id] -= 1
        times = self._completions.setdefault(replica_id, deque())
        times.append(now)
        while times and now - times[0] > self.completion_window_s:
            times.popleft()

    def _end_prefill(self, key: str) -> tuple[str, int, float] | None:
        entry = self._prefilling.pop(key, None)
        if entry is not None:
            per = self._prefilling_at.get(entry[0])
            if per is not None:
                per.pop(key, None)
                if not per:
                    del self._prefilling_at[entry[0]]
        return entry

    def replica_of(self, key: str) -> str | None:
        """Where request `key` went (None: not in flight here)."""
        with self._lock:
            entry = self._requests.get(key)
        return entry[0] if entry is not None else None

    def first_token(self, key: str, now: float) -> None:
        """The sender's request `key` has its first token: its prefill is done."""
        with self._lock:
            entry = self._end_prefill(key)
            if entry is None:
                return
            _, prompt, routed_at = entry
            if now > routed_at:  # tokens and seconds averaged apart: long prompts weigh more
                a = 1.0 if self._rate_seconds <= 0 else self._rate_alpha
                self._rate_tokens = a * prompt + (1 - a) * self._rate_tokens
                self._rate_seconds = a * (now - routed_at) + (1 - a) * self._rate_seconds
                self.prefill_rate = self._rate_tokens / self._rate_seconds

    def finished(self, key: str, now: float) -> None:
        """The sender's request `key` is over (answered, failed or cancelled)."""
        with self._lock:
            if key in self._requests:  # (a key of another router's request is not here)
                self._remove(key, now)

    def completed(self, request_id: str, replica_id: str, now: float) -> None:
        """Ray's completion hook (ignored for requests whose sender reports their end)."""
        with self._lock:
            self._drop_choice(request_id)  # a rejection ends a choice too: it is chosen again
            if request_id in self._reported:
                return
            entry = self._requests.get(request_id)
            if entry is None or entry[0] != replica_id:
                self._finished_early[request_id] = replica_id
                while len(self._finished_early) > self._max_early:
                    self._finished_early.popitem(last=False)
                return
            self._remove(request_id, now)

    def prefill_by_replica(
        self, now: float, replica_ids: Sequence[str] | None = None
    ) -> dict[str, float]:
        """Per replica (of `replica_ids`, default all), prompt tokens of this router's requests
        there still to prefill: whole prompts until their first token, less `prefill_rate` times
        the time since routing."""
        totals: dict[str, float] = {}
        rate = self.prefill_rate
        with self._lock:
            ids = self._prefilling_at if replica_ids is None else replica_ids
            for rid in ids:
                per = self._prefilling_at.get(rid)
                if not per:
                    continue
                total = 0.0
                for prompt, routed_at in per.values():
                    total += max(prompt - rate * max(now - routed_at, 0.0), 0.0)
                totals[rid] = total
        return totals

    def snapshot(self, now: float) -> dict:
        """This tally as plain data (for the ingress's stats): per replica, requests in flight
        (choices not yet routed included), their tokens and the prefill estimate; the learned
        prefill rate."""
        with self._lock:
            ids = set(self._counts) | set(self._chosen_counts)
            replicas = {rid: n for rid in ids if (n := self.requests(rid))}
        prefill = self.prefill_by_replica(now)
        return {
            "prefill_rate": self.prefill_rate,
            "replicas": {
                rid: {
                    "requests": n,
                    "tokens": self.tokens(rid),
                    "prefill_tokens": prefill.get(rid, 0.0),
                }
                for rid, n in replicas.items()
            },
        }

    def requests(self, replica_id: str) -> int:
        """This router's requests on `replica_id`: routed there, or chosen for it and not yet
        routed."""
        return self._counts.get(replica_id, 0) + self._chosen_counts.get(replica_id, 0)

    def tokens(self, replica_id: str) -> int:
        return self._tokens.get(replica_id, 0) + self._chosen_tokens.get(replica_id, 0)

    def choices(self) -> int:
        """Choices not yet routed (nor expired)."""
        return len(self._chosen)

    def completed_since(self, replica_id: str, since: float) -> int:
        """This router's requests on `replica_id` that finished after time `since`."""
        with self._lock:
            count = 0
            for t in reversed(self._completions.get(replica_id, ())):  # newest first
                if t <= since:
                    break
                count += 1
            return count

    def forget_missing(self, replica_ids: Sequence[str]) -> None:
        """Drop the tallies of replicas that are gone (their requests will never complete)."""
        alive = set(replica_ids)
        with self._lock:
            for rid in [r for r in self._counts if r not in alive]:
                self._counts.pop(rid, None)
                self._tokens.pop(rid, None)
                self._completions.pop(rid, None)
            for rid in [r for r in self._adapters if r not in alive]:
                del self._adapters[rid]
            for entry in [e for e, (r, _, _) in self._requests.items() if r not in alive]:
                _, _, request_id = self._requests.pop(entry)
                self._reported.discard(request_id)
                self._end_prefill(entry)
            for request_id in [q for q, (r, _, _) in self._chosen.items() if r not in alive]:
                self._drop_choice(request_id)


def replica_stats(
    replica_id: str,
    ongoing: int,
    recorded: RoutingStats | None,
    inflight: InflightLoad,
    prefill_tokens: float,
    now: float,
    cached_tokens: int = 0,
    lora: str | None = None,
) -> ReplicaStats:
    """What a router knows of one replica when it routes: Ray's in-flight count (`ongoing`),
    the replica's last report (`recorded`, None before its first), and the router's own tally;
    for a request with LoRA adapter `lora`, whether the replica holds it (the report's
    adapters, or this router sent it there since). The Ray router and the simulator (sim/)
    both build it here."""
    sent_at = None if lora is None else inflight.adapter_sent_at(replica_id, lora)
    mine = dict(
        inflight_requests=inflight.requests(replica_id),
        inflight_tokens=inflight.tokens(replica_id),
        prefill_tokens=prefill_tokens,
        cached_tokens=cached_tokens,
        lora_sent=sent_at is not None,
    )
    if lora is not None:
        reported = recorded is not None and lora in recorded.loras
        since = recorded.ts if recorded is not None else -math.inf
        mine["lora_loaded"] = reported or (sent_at is not None and sent_at >= since)
    if recorded is None:  # no report yet: Ray's count and our own tally
        return ReplicaStats(replica_id=replica_id, ongoing=ongoing, **mine)
    return ReplicaStats(
        replica_id=replica_id,
        ongoing=ongoing,
        waiting=recorded.waiting,
        running=recorded.running,
        kv_usage=recorded.kv_usage,
        preemptions_per_s=recorded.preemptions_per_s,
        max_num_seqs=recorded.max_num_seqs,
        stats_age_s=recorded.age_s(now),
        completed_since_stats=inflight.completed_since(replica_id, recorded.ts),
        max_num_batched_tokens=recorded.max_num_batched_tokens,
        **mine,
    )


# This process's routers' tallies: the ingress reports first tokens here (the routers are Ray's
# objects, out of its reach). Kept in this module, which Ray imports by reference.
_INFLIGHT_LOADS: weakref.WeakSet[InflightLoad] = weakref.WeakSet()


def register_inflight(load: InflightLoad) -> None:
    """Let `note_first_token` reach `load` (a router's tally, dropped with the router)."""
    _INFLIGHT_LOADS.add(load)


def note_first_token(request_id: str) -> None:
    """The ingress got the first token of its request `request_id` (the payload's id): the
    router that sent it stops counting its prompt as prefill still ahead on that replica."""
    now = time.time()
    for load in list(_INFLIGHT_LOADS):
        load.first_token(request_id, now)


def note_finished(request_id: str) -> None:
    """The ingress's request `request_id` (the payload's id) is over: the router that sent it
    takes it off its replica's tally."""
    now = time.time()
    for load in list(_INFLIGHT_LOADS):
        load.finished(request_id, now)


def replica_of(request_id: str) -> str | None:
    """The replica a router of this process sent the ingress's request `request_id` to (while
    it is in flight; None: unknown). PD hands a prompt's KV from there to a decode replica."""
    for load in list(_INFLIGHT_LOADS):
        replica = load.replica_of(request_id)
        if replica is not None:
            return replica
    return None


def inflight_state() -> list[dict]:
    """What each of this process's routers knows of its requests in flight (`snapshot`), for
    the ingress's stats."""
    now = time.time()
    return [load.snapshot(now) for load in list(_INFLIGHT_LOADS)]


# This process's request routers (LoadAwareRouter). Kept here, not in router/request_router.py:
# Ray may ship a request-router class by value, with a private copy of its module's globals.
_ROUTERS: weakref.WeakSet = weakref.WeakSet()


def register_router(router) -> None:
    """Let `replica_readiness` see `router`'s replicas (dropped with the router)."""
    _ROUTERS.add(router)


def replica_readiness() -> list[dict]:
    """Every replica this process's routers know, with what its last recorded stats say:
    ready (healthy and reporting), or why not (the ingress's GET /health)."""
    seen: dict[str, dict] = {}
    now = time.time()
    for router in list(_ROUTERS):
        for replica in list(getattr(router, "curr_replicas", {}).values()):
            rid = replica.replica_id.unique_id
            stats = RoutingStats.from_dict(replica.routing_stats)
            if stats is None:  # Serve routes only to replicas that started and passed a check
                entry = {"replica_id": rid, "ready": True, "reason": "no stats reported yet"}
            elif not stats.healthy:
                entry = {
                    "replica_id": rid,
                    "ready": False,
                    "reason": f"engine stalled for {stats.stalled_s:.1f} s",
                }
            else:
                entry = {
                    "replica_id": rid,
                    "ready": True,
                    "stats_age_s": round(stats.age_s(now), 2),
                    "waiting": stats.waiting,
                    "running": stats.running,
                }
            seen[rid] = entry
    return sorted(seen.values(), key=lambda e: e["replica_id"])
