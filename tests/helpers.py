"""Shared by the tests that start Ray: a free loopback port and a Ray + Serve instance sized for
a 2-core machine that is always shut down afterwards.

Ray + Serve for a test module, two ways:

- `shared_serve` (the module-scoped fixture in tests/conftest.py): the module deploys its
  applications on the one Ray + Serve that the modules using it share (started on first use,
  ~10-15 s saved per module; the cluster `loopback_serve(port)` starts, on a free port). Use
  it unless the module needs a cluster of its own::

      @pytest.fixture(scope="module")
      def url(shared_serve):
          config = ClusterConfig.model_validate({..., "http": {"host": "127.0.0.1",
                                                               "port": shared_serve.port}})
          serve.run(build_app(config), name=APP, route_prefix="/")
          return shared_serve.url   # every application is deleted after the module

  After the module every application is deleted with what `stepserve serve` ends beside it
  (its hub and LoRA registry actors), then the cluster must be as it started (no application,
  named actor, placement group or resource in use left): a module that leaves more errs at
  its teardown and the shared cluster is replaced, so the next module starts clean. Do not
  call serve.shutdown / ray.shutdown in such a module; a module with tests that need no Ray
  may use it in some tests only (the cluster starts at the first that asks).
- `loopback_serve` / `multinode_serve` / `zero_cpu_head_cluster`: a cluster of the module's own,
  for a module that needs its own Ray config (several nodes, env vars at Ray start, other
  ray.init arguments). The shared cluster is stopped first (never two at once); conftest runs
  the modules that share after the others of their directory."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster.cli import free_port  # noqa: F401  (re-exported for the tests)

if TYPE_CHECKING:
    import httpx

RAY_OBJECT_STORE_BYTES = 128 * 1024 * 1024


@contextlib.contextmanager
def loopback_serve(
    port: int, env: dict[str, str] | None = None, **ray_init_kwargs
) -> Iterator[str]:
    """Ray on 2 CPUs with a bounded object store and Serve's proxy on 127.0.0.1:`port`; yields
    the base URL, then shuts Serve and Ray down. `env` is set only while Ray starts, so the
    processes Ray launches inherit it (as a Kubernetes Secret mounted as env would be) and the
    test process does not keep it."""
    stop_shared_serve()
    _start_ray_serve(port, env, **ray_init_kwargs)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop_ray_serve()


def _start_ray_serve(port: int, env: dict[str, str] | None = None, **ray_init_kwargs) -> None:
    import ray
    from ray import serve

    from cluster.cli import BUSY_HOST_RAY_ENV, environ_during

    # worker niceness and Serve's start-up timeouts as the embedded cluster sets them (a busy host)
    env = {k: v for k, v in BUSY_HOST_RAY_ENV.items() if k not in os.environ} | (env or {})
    with environ_during(env):
        ray.init(
            **{
                "num_cpus": 2,
                "object_store_memory": RAY_OBJECT_STORE_BYTES,
                "include_dashboard": False,
                **ray_init_kwargs,
            }
        )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
    except BaseException:
        ray.shutdown()
        raise


def _stop_ray_serve() -> None:
    import ray
    from ray import serve

    try:
        if ray.is_initialized():
            serve.shutdown()
    finally:
        ray.shutdown()


@dataclass(frozen=True)
class SharedServe:
    """The shared Ray + Serve as a module sees it: Serve's proxy at `url` (127.0.0.1:`port`)."""

    url: str
    port: int


# The running shared cluster: its SharedServe and what it held when it started.
_shared: dict = {}


def _cluster_state() -> dict:
    """What a module must leave as it found it: applications, named actors, live placement
    groups, and every resource not in use (memory and the object store aside)."""
    import ray
    from ray import serve

    total, free = ray.cluster_resources(), ray.available_resources()
    busy = {
        key: round(total[key] - free.get(key, 0.0), 6)
        for key in total
        if key not in ("memory", "object_store_memory")
        and round(total[key] - free.get(key, 0.0), 6) != 0
    }
    groups = [
        pg_id
        for pg_id, pg in ray.util.placement_group_table().items()
        if pg.get("state") not in ("REMOVED",)
    ]
    return {
        "applications": sorted(serve.status().applications),
        "named_actors": sorted(
            (a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)
        ),
        "placement_groups": sorted(groups),
        "resources_in_use": busy,
    }


def start_shared_serve() -> SharedServe:
    """The shared Ray + Serve (started now unless running and healthy)."""
    import ray

    if _shared and not (ray.is_initialized() and _proxy_healthy(_shared["serve"].url)):
        stop_shared_serve()  # something ended or broke it: a fresh one
    if not _shared:
        if ray.is_initialized():
            raise RuntimeError("Ray is already running in this process (a module's own cluster)")
        import time

        port = free_port()
        _start_ray_serve(port)
        shared = SharedServe(f"http://127.0.0.1:{port}", port)
        deadline = time.monotonic() + 120
        while not _proxy_healthy(shared.url):  # the proxy is up (its actor among the baseline's)
            if time.monotonic() > deadline:
                _stop_ray_serve()
                raise RuntimeError("the shared Serve's proxy did not come up in 120 s")
            time.sleep(0.2)
        _shared.update(serve=shared, baseline=_cluster_state())
    return _shared["serve"]


def stop_shared_serve() -> None:
    """Shut the shared Ray + Serve down, if it runs."""
    if _shared:
        _shared.clear()
        _stop_ray_serve()


def _proxy_healthy(url: str) -> bool:
    """Serve's proxy answers and is not draining (with no application it answers /-/healthz
    with a 503 saying that its route table is empty)."""
    import httpx

    try:
        r = httpx.get(f"{url}/-/healthz", timeout=30)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 or (r.status_code == 503 and "drain" not in r.text.lower())


def _end_application_actors() -> None:
    """What `stepserve serve` ends after deleting its application (cluster/cli.py): the
    detached actors its applications made (each one's hub, replica/hub.py, and LoRA registry,
    router/lora_registry.py), of those deleted during the module too."""
    import ray

    from replica.hub import HUB_NAMESPACE, hub_name
    from router.lora_registry import REGISTRY_NAMESPACE, registry_name

    owned = {(HUB_NAMESPACE, hub_name("")), (REGISTRY_NAMESPACE, registry_name(""))}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if any(actor["namespace"] == ns and actor["name"].startswith(p) for ns, p in owned):
            try:
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
            except ValueError:
                pass  # gone meanwhile


def clean_shared_serve(timeout_s: float = 180) -> str | None:
    """After a module: delete every application, then wait until the cluster is as it started.
    None when it is; else what was left (the shared cluster is then stopped, so the next
    module gets a fresh one)."""
    import time

    import ray
    from ray import serve

    if not _shared:
        return None
    problem = None
    try:
        if not ray.is_initialized():
            raise RuntimeError("Ray was shut down during the module")
        for app in serve.status().applications:
            serve.delete(app, _blocking=False)
        deadline = time.monotonic() + timeout_s
        while serve.status().applications and time.monotonic() < deadline:
            time.sleep(0.5)
        _end_application_actors()
        while (state := _cluster_state()) != _shared["baseline"]:
            if time.monotonic() > deadline:
                problem = f"left behind: {state}, at start: {_shared['baseline']}"
                break
            time.sleep(0.5)
        if problem is None and not _proxy_healthy(_shared["serve"].url):
            problem = "Serve's proxy no longer answers /-/healthz"
    except Exception as exc:  # noqa: BLE001  (any failure: the cluster is replaced)
        problem = f"cleaning up failed: {exc!r}"
    if problem is not None:
        stop_shared_serve()
    return problem


# A dead node is declared after 3 missed health checks a second apart (Ray's default is
# 5 x 3 s): the multi-node tests kill nodes and should not wait 15 s for the verdict.
FAST_NODE_DEATH = {
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


class MultiNode:
    """A Ray cluster of several raylets on this machine (ray.cluster_utils.Cluster, as Ray's own
    fault-tolerance tests run one): a head with no CPUs for replicas (as the chart's head)
    and workers with `worker_cpus` each; nodes can be killed and added while it runs."""

    def __init__(self, cluster, worker_cpus: float) -> None:
        self.cluster = cluster
        self.worker_cpus = worker_cpus
        self.head_id = cluster.head_node.node_id

    @property
    def workers(self) -> list:
        return list(self.cluster.worker_nodes)

    def add_worker(self):
        """A new worker node (from any thread: a worker node registers no exit handler, which
        only the main thread may; `multinode_serve` ends its processes, and a raylet whose
        cluster is gone exits on its own)."""
        from cluster.cli import BUSY_HOST_RAY_ENV, environ_during

        self.cluster._shutdown_at_exit = False
        try:
            with environ_during(
                {k: v for k, v in BUSY_HOST_RAY_ENV.items() if k not in os.environ}
            ):
                return self.cluster.add_node(
                    num_cpus=self.worker_cpus, object_store_memory=RAY_OBJECT_STORE_BYTES
                )
        finally:
            self.cluster._shutdown_at_exit = True

    def kill(self, node_id: str) -> None:
        """SIGKILL every process of that worker node (a machine lost), as Ray's tests do."""
        (node,) = [n for n in self.cluster.worker_nodes if n.node_id == node_id]
        self.cluster.remove_node(node, allow_graceful=False)


def zero_cpu_head_cluster(system_config: dict | None = None):
    """A Ray cluster on this machine (ray.cluster_utils.Cluster) whose head has no CPUs, so
    replicas land on the worker nodes the caller adds; started with the busy-host settings
    `stepserve serve` uses."""
    from ray.cluster_utils import Cluster

    from cluster.cli import BUSY_HOST_RAY_ENV, environ_during

    stop_shared_serve()
    head = {
        "num_cpus": 0,
        "object_store_memory": RAY_OBJECT_STORE_BYTES,
        "include_dashboard": False,
    }
    if system_config is not None:
        head["_system_config"] = system_config
    env = {k: v for k, v in BUSY_HOST_RAY_ENV.items() if k not in os.environ}
    with environ_during(env):
        return Cluster(initialize_head=True, head_node_args=head)


@contextlib.contextmanager
def multinode_serve(port: int, workers: int = 2, worker_cpus: float = 1.0) -> Iterator[MultiNode]:
    """A head (0 CPUs) and `workers` worker nodes, Serve's proxy on the head only at
    127.0.0.1:`port` (every node of this cluster shares one machine, hence one port space).
    Shut down afterwards."""
    import ray
    from ray import serve

    cluster = zero_cpu_head_cluster(FAST_NODE_DEATH)
    nodes = MultiNode(cluster, worker_cpus)
    try:
        for _ in range(workers):
            nodes.add_worker()
        ray.init(address=cluster.address)
        serve.start(http_options={"host": "127.0.0.1", "port": port, "location": "HeadOnly"})
        yield nodes
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()


def replica_stats(app: str, n_replicas: int, max_calls: int = 40) -> dict[str, dict]:
    """stats() of each LLMServer replica of `app`, by replica id. The handle routes every call
    to some replica, so call until `n_replicas` were seen or `max_calls` calls were made."""
    from ray import serve

    handle, seen = serve.get_deployment_handle("LLMServer", app_name=app), {}
    for _ in range(max_calls):
        stats = handle.stats.remote().result(timeout_s=30)
        seen[stats["replica_id"]] = stats
        if len(seen) >= n_replicas:
            break
    return seen


def llm_replica_states(app: str) -> dict[str, int]:
    """Serve's count of `app`'s LLMServer replicas by state ({} before it is deployed)."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None or "LLMServer" not in status.deployments:
        return {}
    return dict(status.deployments["LLMServer"].replica_states)


def wait_llm_replicas_running(app: str, n: int, timeout_s: float = 120) -> None:
    """Until `app` has exactly `n` LLMServer replicas, all RUNNING."""
    import time

    deadline = time.monotonic() + timeout_s
    while llm_replica_states(app) != {"RUNNING": n}:
        assert time.monotonic() < deadline, f"replicas: {llm_replica_states(app)}, want {n} RUNNING"
        time.sleep(0.5)


def replica_actor_names(app: str) -> dict[str, str]:
    """LLMServer replica unique id -> its actor's name in the "serve" namespace."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#LLMServer#"
    return {
        actor["name"].rsplit("#", 1)[1]: actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == "serve" and actor["name"].startswith(prefix)
    }


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The data fields of an SSE stream, split at "\n" only: httpx's aiter_lines also splits
    at U+2028 and the other breaks of str.splitlines, which a server's JSON may hold raw
    (stepserve escapes them; a test should not depend on it)."""
    buffer = b""
    async for chunk in response.aiter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"data: "):
                yield line[len(b"data: ") :].decode()


async def cancel_after_first(stream: AsyncIterator) -> list:
    """Read `stream` in a task of its own until its first item, then cancel that task (a client
    that leaves); returns what was read. The stream's own cleanup has run when this returns."""
    import asyncio

    import pytest

    got: list = []

    async def read() -> None:
        async for item in stream:
            got.append(item)

    task = asyncio.ensure_future(read())
    while not got:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return got


def engine_request(prompt, params, request_id: str | None = None, priority: int = 0, arrival=None):
    """An EngineRequest from its parts (a fresh id unless one is given)."""
    import uuid

    from replica.request import EngineRequest

    rid = request_id if request_id is not None else uuid.uuid4().hex
    return EngineRequest(list(prompt), params, rid, priority, arrival)


def scheduler_request(
    request_id: str, prompt, params, eos=frozenset(), priority: int = 0, arrival=None
):
    """A scheduler Request from its parts (scheduler and runner tests)."""
    from replica.request import Request

    return Request(engine_request(prompt, params, request_id, priority, arrival), eos)


def wait_apps_running(apps: list[str], timeout_s: float) -> None:
    """Wait until every Serve application in `apps` is RUNNING; fail at once on one that
    FAILED (its message), or when `timeout_s` passes (the states then)."""
    import time

    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        statuses = {app: serve.status().applications.get(app) for app in apps}
        states = {app: st.status if st else None for app, st in statuses.items()}
        if all(state == "RUNNING" for state in states.values()):
            return
        failed = {app: st.message for app, st in statuses.items() if st and "FAILED" in st.status}
        assert not failed, failed
        assert time.monotonic() < deadline, states
        time.sleep(0.5)
