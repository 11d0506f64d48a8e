"""The `stepserve` command: `serve` (embedded or existing Ray cluster + HTTP endpoint) and
`generate` (one offline completion)."""

# The docstring is the command's --help description. Also here: the simulator's commands
# (sim/cli.py); the engine flags are in cluster/engine_args.py, the embedded cluster in
# cluster/embedded.py.

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from cluster.config import ClusterConfig
from cluster.embedded import (
    BUSY_HOST_RAY_ENV,  # noqa: F401  (kept importable here: tests/helpers.py)
    StartupError,
    close_prestarted_core,
    environ_during,  # noqa: F401  (kept importable here: tests/helpers.py)
    init_embedded_ray,  # noqa: F401  (kept importable here: bench/_cluster.py)
    start,
    startup_report,
)
from cluster.engine_args import GENERATE_OWN_FLAGS, add_engine_args, engine_overrides
from cluster.processes import (
    PortTakenError,
    free_port,  # noqa: F401  (kept importable here: tests/helpers.py, bench/)
)


def build_config(args: argparse.Namespace) -> ClusterConfig:
    """Config file first, then command-line flags on top; validated once into ClusterConfig."""
    data: dict = {}
    if args.config:
        import yaml

        data = yaml.safe_load(Path(args.config).read_text()) or {}
        if "applications" in data:  # a Serve config file: take our application's args
            data = data["applications"][0].get("args", {})
    engine = {**data.get("engine", {}), **engine_overrides(args)}
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


def _resolve_model(config: ClusterConfig) -> tuple[ClusterConfig, Path]:
    """Resolve --model here once, before anything starts: a path that is no model fails now, and
    a GGUF file's metadata directory (or the default model's) is made before the replicas on
    this machine look for it (each process still resolves the path on its own machine:
    EngineConfig.model_dir). The config keeps the path the user gave, made absolute."""
    from replica.default_model import resolve_model

    model = config.engine.model
    label = "the default model" if model is None else f"--model {model!r}"
    try:
        model_dir = resolve_model(model)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: {label}: {exc}") from None
    if not model_dir.is_dir():  # a file is a GGUF (resolved) or an error (raised)
        raise SystemExit(f"error: {label} does not exist")
    update = {"served_model_name": config.model_name()}
    if model is not None:
        update["model"] = os.path.abspath(Path(model).expanduser())
    engine = config.engine.model_copy(update=update)
    return config.model_copy(update={"engine": engine}), model_dir


def cmd_serve(args: argparse.Namespace) -> int:
    config, model_dir = _resolve_model(build_config(args))
    source = config.engine.model or "the default model"
    where = source if str(model_dir) == source else f"{source}, metadata in {model_dir}"
    print(f"stepserve: serving {config.model_name()} ({where})", flush=True)
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

    llm = LLM(**engine_overrides(args))
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
    add_engine_args(serve_p)
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
    add_engine_args(gen_p, without=GENERATE_OWN_FLAGS)
    gen_p.add_argument("--prompt", required=True)
    gen_p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen_p.add_argument("--max-tokens", type=int, default=64)
    gen_p.add_argument("--temperature", type=float, default=0.0)
    gen_p.add_argument("--seed", type=int)
    gen_p.set_defaults(func=cmd_generate)

    from sim.cli import add_commands

    add_commands(sub)
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
