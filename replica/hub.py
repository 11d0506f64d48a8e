"""One application's hub: the named, detached Ray actor where its replicas publish and its
ingresses and routers read. It keeps two things: the KV-cache events of every replica
(KVEventHub, replica/kv_events.py: routers mirror each replica's prefix cache from it) and
every replica's latest metrics exposition (any ingress serves the merge at /metrics, so one URL
shows the whole application).

One actor for both: each Ray actor is a worker process of its own (a Python start and Ray's
import, ~1.5 CPU-seconds on a 2-vCPU host), and the first replica creates the hub at the top of
its constructor, so that its process boots while the engine builds rather than beside the first
requests. It lives on the head node (replica/metrics.py ON_HEAD_NODE): losing a worker node
loses no hub; `stepserve serve` ends it with the application (`kill_hub`)."""

from __future__ import annotations

import time

from replica.kv_events import KVEventHub
from replica.startup import freeze_heap

HUB_NAMESPACE = "stepserve"


class ApplicationHub(KVEventHub):
    """KVEventHub's publish / poll / forget / replicas, and the metrics side: `push` (a
    replica's exposition, about once a second) and `expositions` (the fresh ones)."""

    def __init__(self, keep_batches: int = 1024, forget_after_s: float = 60.0) -> None:
        super().__init__(keep_batches=keep_batches, forget_after_s=forget_after_s)
        self._expositions: dict[str, tuple[float, bytes]] = {}
        freeze_heap()  # its polls and pushes are not stalled by collections over Ray's import

    def push(self, replica_id: str, text: bytes) -> bool:
        """Keep a replica's exposition; the answer: whether a router reads its KV events
        (`is_read`), so that a replica learns it from the push it makes anyway."""
        now = time.time()
        self._expositions[replica_id] = (now, text)
        return self.is_read(replica_id, now)

    def expositions(
        self, max_age_s: float = 30.0, replica_ids: list[str] | None = None
    ) -> list[bytes]:
        """The fresh expositions (a dead replica's age out after `max_age_s`); only those of
        `replica_ids` when given (an ingress asks for the replicas its routers know alive, so a
        replica that died leaves /metrics at once, not when its last push ages out)."""
        now = time.time()
        self._expositions = {k: v for k, v in self._expositions.items() if now - v[0] <= max_age_s}
        wanted = self._expositions.keys() if replica_ids is None else set(replica_ids)
        return [text for rid, (_, text) in self._expositions.items() if rid in wanted]


def hub_name(app_name: str) -> str:
    return f"stepserve-hub-{app_name}"


def get_hub(app_name: str):
    """The application's hub, created by whoever asks first (non-blocking: the handle returns
    at once, calls wait for the actor to start)."""
    import ray

    from replica.metrics import HUB_ACTOR_OPTIONS

    return (
        ray.remote(ApplicationHub)
        .options(name=hub_name(app_name), namespace=HUB_NAMESPACE, **HUB_ACTOR_OPTIONS)
        .remote()
    )


def find_hub(app_name: str):
    """The application's hub if it exists (None before a replica created it): for readers,
    which must not create one of their own."""
    import ray

    try:
        return ray.get_actor(hub_name(app_name), namespace=HUB_NAMESPACE)
    except ValueError:
        return None


def kill_hub(app_name: str) -> bool:
    """End the application's hub, if there is one (when the application is deleted)."""
    import ray

    hub = find_hub(app_name)
    if hub is None:
        return False
    ray.kill(hub)
    return True
