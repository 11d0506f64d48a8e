"""A router's KV-event routing state (routing.kv_events): its KVIndex (router/kv_index.py), kept
current by a thread that polls the application's KVEventHub (replica/kv_events.py) every
`poll_s` for the replicas the router can route to (while there are two or more); the prediction it made for each request it
routed, checked against the hit the replica reports (`note_cached`, from the ingress); and the
counters the ingress exports as Prometheus metrics (`exposition`).

Ray builds routers inside the ingress process and gives user code no reference to them, so, as
with the in-flight tallies (router/inflight.py), each registers here and the ingress's notes
reach every registered one. This module is imported by reference (not pickled by value)."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from replica.api import LoRARequest, call_hub, get_hub
from router.kv_index import KVIndex

logger = logging.getLogger(__name__)

REASONS = ("load", "cache", "spill", "lora", "fetch")  # Decision.reason's answers
IDLE_POLL_S = 0.5


class KVRouting:
    def __init__(
        self,
        app_name: str,
        block_size: int,
        poll_s: float = 0.05,
        max_predictions: int = 100_000,
        start: bool = True,
        hub=None,
    ) -> None:
        self.app_name = app_name
        self.index = KVIndex(block_size)
        self.poll_s = poll_s
        self._live: set[str] = set()
        self._lock = threading.Lock()
        self._predictions: OrderedDict[str, int] = OrderedDict()  # request key -> predicted
        self._max_predictions = max_predictions
        self._hub = hub  # the application's hub (found on first use), or a KVEventHub (tests)
        self.decisions = dict.fromkeys(REASONS, 0)
        self.predicted_tokens = 0
        self.actual_tokens = 0
        self.compared = 0
        self.exact = 0
        self.polls = 0
        self.poll_seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    def start(self) -> None:
        """Start polling the hub (once; later calls do nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kv-index", daemon=True)
            self._thread.start()

    # -- replicas and events -----------------------------------------------------------------
    def set_live(self, replica_ids: Iterable[str]) -> None:
        """The replicas the router can route to; every other replica leaves the index."""
        live = set(replica_ids)
        with self._lock:
            self._live = live
        self.index.retain(live)

    def _hub_handle(self):
        if self._hub is None:
            self._hub = get_hub(self.app_name)
        return self._hub

    def apply_poll(self, reply: dict) -> None:
        """Apply the hub's answer to a poll (batches, snapshots, replicas gone)."""
        with self._lock:
            live = set(self._live)
        for rid, (kind, data) in reply.items():
            if rid not in live:
                continue
            if kind == "batches":
                for batch in data:
                    if not self.index.apply(rid, batch):
                        break  # stale: the next poll asks for a snapshot
            elif kind == "snapshot":
                self.index.load_snapshot(rid, data)
            else:
                self.index.remove_replica(rid)

    def cursors(self) -> dict[str, int]:
        with self._lock:
            live = list(self._live)
        out = {}
        for rid in live:
            seq = self.index.seq(rid)
            out[rid] = -1 if seq is None else seq
        return out

    def poll_once(self) -> bool:
        """One poll of the hub; True when it brought news. A router with one replica has
        nothing to choose and does not poll: its replica, read by no router, stops publishing
        (replica/kv_publisher.py); polling resumes when a second replica joins."""
        cursors = self.cursors()
        if len(cursors) < 2:
            return False
        t0 = time.perf_counter()
        reply = call_hub(self._hub_handle(), "poll", cursors)
        self.apply_poll(reply)
        self.polls += 1
        self.poll_seconds += time.perf_counter() - t0
        return bool(reply)

    def _run(self) -> None:
        wait = self.poll_s
        while not self._stop.wait(wait):
            try:
                news = self.poll_once()
            except Exception as exc:
                logger.warning("KV index poll failed (%s); retrying", exc)
                self._hub = None
                self._stop.wait(1.0)
                continue
            # an idle application is polled less often (up to IDLE_POLL_S), a busy one at poll_s
            wait = self.poll_s if news else min(IDLE_POLL_S, wait * 2)

    def stop(self) -> None:
        self._stop.set()

    # -- requests ---------------------------------------------------------------------------
    def hit_tokens(
        self,
        prompt_ids: Sequence[int],
        replica_ids: Iterable[str],
        lora: LoRARequest | None = None,
    ) -> dict[str, int]:
        """Per replica, the prompt tokens it holds cached under adapter `lora` (None: base)."""
        return self.index.hit_tokens(self.index.prompt_hashes(prompt_ids, lora), replica_ids)

    def routed(self, key: str, predicted: int, reason: str) -> None:
        with self._lock:
            self.decisions[reason] = self.decisions.get(reason, 0) + 1
            self._predictions[key] = predicted
            while len(self._predictions) > self._max_predictions:
                self._predictions.popitem(last=False)

    def cached(self, key: str, actual: int) -> None:
        """The replica reports `actual` prompt tokens found cached for request `key`."""
        with self._lock:
            predicted = self._predictions.pop(key, None)
            if predicted is None:
                return
            self.compared += 1
            self.exact += predicted == actual
            self.predicted_tokens += predicted
            self.actual_tokens += actual

    def forget(self, key: str) -> None:
        with self._lock:
            self._predictions.pop(key, None)

    def snapshot(self) -> dict:
        return {
            "index": self.index.stats(),
            "decisions": dict(self.decisions),
            "predicted_tokens": self.predicted_tokens,
            "actual_tokens": self.actual_tokens,
            "compared": self.compared,
            "exact": self.exact,
            "polls": self.polls,
            "poll_seconds": self.poll_seconds,
        }


_KV_ROUTINGS: weakref.WeakSet[KVRouting] = weakref.WeakSet()


def register_kv_routing(state: KVRouting) -> None:
    _KV_ROUTINGS.add(state)


def note_cached(request_id: str, cached_tokens: int) -> None:
    """The ingress's request `request_id` found `cached_tokens` of its prompt cached."""
    for state in list(_KV_ROUTINGS):
        state.cached(request_id, cached_tokens)


def note_gone(request_id: str) -> None:
    for state in list(_KV_ROUTINGS):
        state.forget(request_id)


def kv_routing_state() -> list[dict]:
    return [state.snapshot() for state in list(_KV_ROUTINGS)]


def kv_index_contents() -> list[dict[str, dict]]:
    """Per router of this process: per replica in its index, the last batch applied and the
    block hashes held (tests compare them with the replicas' own tables)."""
    out = []
    for state in list(_KV_ROUTINGS):
        index = state.index
        out.append(
            {rid: {"seq": index.seq(rid), "hashes": sorted(index.blocks_of(rid))}
             for rid in index.replicas()}
        )  # fmt: skip
    return out


def exposition(ingress_id: str) -> bytes:
    """This process's routers' KV-routing counters in the Prometheus text format."""
    states = kv_routing_state()
    if not states:
        return b""
    label = f'ingress="{ingress_id}"'

    def total(key: str, sub: str | None = None) -> float:
        return sum((s[key][sub] if sub else s[key]) for s in states)

    lines = [
        "# HELP stepserve:router_kv_index_blocks Distinct cached blocks the routers' KV index holds.",
        "# TYPE stepserve:router_kv_index_blocks gauge",
        f"stepserve:router_kv_index_blocks{{{label}}} {total('index', 'entries')}",
        "# HELP stepserve:router_kv_events_total KV events the routers applied.",
        "# TYPE stepserve:router_kv_events_total counter",
        f"stepserve:router_kv_events_total{{{label}}} {total('index', 'events_applied')}",
        "# HELP stepserve:router_kv_resyncs_total Replica views rebuilt from a snapshot.",
        "# TYPE stepserve:router_kv_resyncs_total counter",
        f"stepserve:router_kv_resyncs_total{{{label}}} {total('index', 'snapshots')}",
        "# HELP stepserve:router_predicted_hit_tokens_total Prompt tokens the router predicted "
        "cached on the replica it chose (requests whose actual hit came back).",
        "# TYPE stepserve:router_predicted_hit_tokens_total counter",
        f"stepserve:router_predicted_hit_tokens_total{{{label}}} {total('predicted_tokens')}",
        "# HELP stepserve:router_actual_hit_tokens_total Prompt tokens those replicas found cached.",
        "# TYPE stepserve:router_actual_hit_tokens_total counter",
        f"stepserve:router_actual_hit_tokens_total{{{label}}} {total('actual_tokens')}",
        "# HELP stepserve:router_hit_predictions_total Requests whose predicted hit was checked, "
        "by outcome.",
        "# TYPE stepserve:router_hit_predictions_total counter",
        f'stepserve:router_hit_predictions_total{{{label},outcome="exact"}} {total("exact")}',
        f'stepserve:router_hit_predictions_total{{{label},outcome="different"}} '
        f"{total('compared') - total('exact')}",
        "# HELP stepserve:router_decisions_total Routing decisions by reason.",
        "# TYPE stepserve:router_decisions_total counter",
    ]
    for reason in REASONS:
        lines.append(
            f'stepserve:router_decisions_total{{{label},reason="{reason}"}} '
            f"{total('decisions', reason)}"
        )
    return ("\n".join(lines) + "\n").encode()
