"""The `stepserve` command: `serve` (embedded or existing Ray cluster + HTTP endpoint) and
`generate` (one offline completion)."""

# The docstring is the command's --help description. Also here: the simulator's commands
# (sim/cli.py); the engine flags are in cluster/engine_args.py, the embedded cluster in
# cluster/embedded.py.

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from cluster.config import ClusterConfig, PDConfig
from cluster.embedded import (
    BUSY_HOST_RAY_ENV,  # noqa: F401  (kept importable here: tests/helpers.py)
    StartupError,
    close_prestarted_core,
    environ_during,  # noqa: F401  (kept importable here: tests/helpers.py)
    init_embedded_ray,  # noqa: F401  (kept importable here: bench/_cluster.py)
    start,
    startup_report,
)
from cluster.engine_args import (
    GENERATE_OWN_FLAGS,
    SERVE_OWN_FLAGS,
    add_engine_args,
    add_kv_transfer_args,
    engine_overrides,
)
from cluster.processes import (
    PortTakenError,
    free_port,  # noqa: F401  (kept importable here: tests/helpers.py, bench/)
)


def parse_lora_module(text: str) -> dict:
    """One --lora-modules value, in either of vLLM's forms: `name=path`, or JSON
    {"name", "path", "base_model_name"?}; the result's `base_model_name` is None when not
    given (the adapter then goes on the first model)."""
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules {text!r} is not valid JSON: {exc}") from None
        unknown = set(data) - {"name", "path", "base_model_name"}
        if not isinstance(data.get("name"), str) or not isinstance(data.get("path"), str):
            raise ValueError(
                f'--lora-modules {text!r}: the JSON form needs string fields "name" and '
                '"path" (and optionally "base_model_name")'
            )
        if unknown:
            raise ValueError(f"--lora-modules {text!r}: unknown fields {sorted(unknown)}")
        base = data.get("base_model_name")
        return {"name": data["name"], "path": data["path"], "base_model_name": base}
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(
            f"--lora-modules {text!r} must be name=path or JSON "
            '{"name": ..., "path": ..., "base_model_name": ...}'
        )
    return {"name": name, "path": path, "base_model_name": None}


def _command_line_models(args: argparse.Namespace) -> list[dict] | None:
    """The `models:` entries of --model given more than once (None: once or never), each named
    by the --served-model-name at its position."""
    models = args.models or []
    names = args.served_model_names or []
    if len(names) > max(len(models), 1):
        raise ValueError(
            f"--served-model-name given {len(names)} times for {len(models)} --model: give at "
            "most one name per model, in the same order"
        )
    if len(models) < 2:
        return None
    entries = []
    for i, model in enumerate(models):
        engine = {"model": model}
        if i < len(names):
            engine["served_model_name"] = names[i]
        entries.append({"engine": engine})
    return entries


def _add_lora_modules(data: dict, modules: list[dict]) -> None:
    """Put each --lora-modules adapter on its base model (base_model_name, else the first)."""
    config = ClusterConfig.model_validate(data)
    served = [m.served_name() for m in config.deployments()]
    for module in modules:
        base = module["base_model_name"] or served[0]
        if base not in served:
            raise ValueError(
                f"--lora-modules {module['name']!r}: base_model_name {base!r} is not a served "
                f"model; the models are {served}"
            )
        entry = {"name": module["name"], "path": module["path"]}
        if data.get("models"):
            engine = data["models"][served.index(base)].setdefault("engine", {})
        else:
            engine = data.setdefault("engine", {})
        engine["lora_modules"] = [*engine.get("lora_modules", []), entry]


def build_config(args: argparse.Namespace) -> ClusterConfig:
    """Config file first, then command-line flags on top; validated once into ClusterConfig.
    Several --model: one `models:` entry each; engine flags (and --replicas, --cpu-threads,
    --num-cpus-per-replica, the autoscaling flags) apply to every model, also to those of the
    config file's `models:`."""
    data: dict = {}
    if args.config:
        import yaml

        data = yaml.safe_load(Path(args.config).read_text()) or {}
        if "applications" in data:  # a Serve config file: take our application's args
            data = data["applications"][0].get("args", {})
    overrides = engine_overrides(args)
    entries = _command_line_models(args)
    if (entries or args.models) and data.get("models"):
        raise ValueError(
            "--model and the config file's `models:` both name the models: use one of them"
        )
    if entries:  # they name the models: the file's one model gives way
        data["models"] = entries
        for key in ("model", "served_model_name"):
            data.get("engine", {}).pop(key, None)
    elif args.models:
        overrides["model"] = args.models[0]
    if args.served_model_names and not entries:
        overrides["served_model_name"] = args.served_model_names[0]
    engine = {**data.get("engine", {}), **overrides}
    data["engine"] = engine
    http = data.setdefault("http", {})
    if args.host is not None:
        http["host"] = args.host
    if args.port is not None:
        http["port"] = args.port
    if getattr(args, "direct_stream", None) is not None:
        http["direct_stream"] = args.direct_stream
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
    if args.otlp_traces_endpoint is not None:
        data.setdefault("tracing", {})["otlp_traces_endpoint"] = args.otlp_traces_endpoint
    if args.route_kv_transfer is not None:
        data.setdefault("routing", {})["kv_transfer"] = args.route_kv_transfer
    if args.pd is not None:
        data["pd"] = PDConfig.parse(args.pd).model_dump()
    if data.get("models"):
        _flags_to_every_model(data, args, overrides)
    if args.lora_modules:
        _add_lora_modules(data, [parse_lora_module(text) for text in args.lora_modules])
    return ClusterConfig.model_validate(data)


def _flags_to_every_model(data: dict, args: argparse.Namespace, overrides: dict) -> None:
    """The flags given, over each `models:` entry's own settings (the top-level ones, which
    the flags set, are only the defaults of an entry)."""
    flags = {
        "replicas": args.replicas,
        "cpu_threads_per_replica": args.cpu_threads,
        "num_cpus_per_replica": args.num_cpus_per_replica,
    }
    keys = ("min_replicas", "max_replicas", "target_queue_depth")
    given = [key for key in keys if getattr(args, key) is not None]
    if args.min_replicas is not None or args.max_replicas is not None:
        given.append("enabled")
    scaling = {key: data["autoscaling"][key] for key in given}
    for entry in data["models"]:
        entry["engine"] = {**entry.get("engine", {}), **overrides}
        entry.update({key: value for key, value in flags.items() if value is not None})
        if "autoscaling" in entry and scaling:
            entry["autoscaling"] = {**entry["autoscaling"], **scaling}


def _resolve_model(config: ClusterConfig) -> tuple[ClusterConfig, list[Path]]:
    """Resolve each model here once, before anything starts: a path that is no model fails now,
    and a GGUF file's metadata directory (or the default model's) is made before the replicas
    on this machine look for it (each process still resolves the path on its own machine:
    EngineConfig.model_dir). The config keeps the paths the user gave (models and adapters),
    made absolute; each model's served name is fixed."""
    from replica.default_model import resolve_model

    resolved, model_dirs = [], []
    for deployment in config.deployments():
        engine = deployment.engine
        model = engine.model
        label = "the default model" if model is None else f"--model {model!r}"
        try:
            model_dir = resolve_model(model)
        except (ValueError, OSError) as exc:
            raise SystemExit(f"error: {label}: {exc}") from None
        if not model_dir.is_dir():  # a file is a GGUF (resolved) or an error (raised)
            raise SystemExit(f"error: {label} does not exist")
        update: dict = {"served_model_name": deployment.served_name()}
        if model is not None:
            update["model"] = _absolute(model)
        update["lora_modules"] = [
            m.model_copy(update={"path": _absolute(m.path)}) for m in engine.lora_modules
        ]
        resolved.append(deployment.model_copy(update={"engine": engine.model_copy(update=update)}))
        model_dirs.append(model_dir)
    if config.models:
        return config.model_copy(update={"models": resolved}), model_dirs
    return config.model_copy(update={"engine": resolved[0].engine}), model_dirs


def _absolute(path: str) -> str:
    return os.path.abspath(Path(path).expanduser())


def cmd_serve(args: argparse.Namespace) -> int:
    from cluster.app import deployment_name

    config, model_dirs = _resolve_model(build_config(args))
    for deployment, model_dir in zip(config.deployments(), model_dirs):
        source = deployment.engine.model or "the default model"
        where = source if str(model_dir) == source else f"{source}, metadata in {model_dir}"
        adapters = deployment.adapter_names()
        with_adapters = f", LoRA adapters {adapters}" if adapters else ""
        print(f"stepserve: serving {deployment.served_name()} ({where}){with_adapters}", flush=True)
    timings: dict[str, float] = {}
    url = start(config, args.address, timings)
    print(f"stepserve: ready at {url}/v1  (OpenAI-compatible; Ctrl-C to stop)", flush=True)
    first = deployment_name(config, config.deployments()[0])
    print(f"stepserve: {startup_report(config.name, timings, first)}", flush=True)
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
    from router.lora_registry import kill_registry

    kill_hub(config.name)  # the application's hub (metrics, KV events; detached) goes with it
    kill_registry(config.name)  # and its run-time LoRA adapters
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

    serve_p = sub.add_parser(
        "serve", help="serve one or more models over an OpenAI-compatible HTTP API"
    )
    add_engine_args(serve_p, without=SERVE_OWN_FLAGS)
    models = serve_p.add_argument_group("models and LoRA adapters")
    models.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="MODEL",
        help="local HF model directory or GGUF file (default: the bundled model); repeat it "
        "to serve several models behind one endpoint, each on replicas of its own (the engine "
        "flags apply to every model; per-model settings: the config file's `models:`)",
    )
    models.add_argument(
        "--served-model-name",
        action="append",
        dest="served_model_names",
        metavar="NAME",
        help="the name clients put in `model`, one per --model in the same order (default: "
        "the model's directory name)",
    )
    models.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        metavar="ADAPTER",
        help="LoRA adapters served from the start, as name=path (on the first model) or "
        'JSON {"name": ..., "path": ..., "base_model_name": ...} (on the model of that '
        "served name); the path must be readable on every replica's node",
    )
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
    serve_p.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="send OpenTelemetry traces of each request to this OTLP/HTTP endpoint, e.g. "
        "http://otel-collector:4318 (tracing.otlp_traces_endpoint; off without it)",
    )
    serve_p.add_argument(
        "--direct-stream",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="streamed tokens go from replica to ingress over a direct TCP feed, one frame per "
        "step (http.direct_stream, default off); --no-direct-stream: one Ray Serve stream item "
        "per token",
    )
    add_kv_transfer_args(serve_p, "--kv-fetch")
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
