"""`stepserve profile`, `simulate`, `plan` and `steps` (registered by cluster/cli.py).

stepserve profile --model default --threads 1 --out sim/profiles/mine.json   # + serving calibration
stepserve profile --model default --threads 1 --no-serving                    # Engine.step only
stepserve simulate --profile SmolLM2-135M-Instruct-avx2-1t --replicas 8 --workload heterogeneous
stepserve simulate --config cluster.yaml --profile P --workload trace:sim/traces/azure_sample.csv
stepserve simulate --profile P --replicas 16 --workload random --rate 8 --loras 64 --max-cpu-loras 8
stepserve plan --profile P --workload heterogeneous --rate 20 --slo-ttft-ms 1000 --slo-tpot-ms 200
stepserve steps server-steps.jsonl@replay1.jsonl sim-steps.jsonl --profile P   # real vs sim steps
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path

WORKLOADS = ("random", "heterogeneous", "prefix", "long-tail", "multi-turn", "trace:FILE")


def add_commands(sub) -> None:
    from cluster.engine_args import add_engine_args

    prof = sub.add_parser(
        "profile", help="time real engine steps over a grid of shapes: a simulator profile"
    )
    add_engine_args(prof)
    prof.add_argument("--threads", type=int, help="torch threads (default: torch's own count)")
    prof.add_argument("--out", help="profile JSON to write (default: sim/profiles/<name>.json)")
    prof.add_argument("--name", help="the profile's name (default: model-isa-threads)")
    prof.add_argument("--quick", action="store_true", help="a coarse grid (tests, smoke runs)")
    prof.add_argument("--reps", type=int, default=7, help="steps timed per grid point")
    prof.add_argument(
        "--allow-busy-host", action="store_true",
        help="profile even when other processes keep the host busy (the profile is flagged)",
    )  # fmt: skip
    prof.add_argument(
        "--no-serving", action="store_true",
        help="skip the serving calibration (the profile prices Engine.step alone)",
    )  # fmt: skip
    prof.add_argument(
        "--calibrate-url",
        help="calibrate against the stepserve cluster already serving at this URL (its replicas "
        "running this model and engine settings) instead of starting one",
    )
    prof.add_argument(
        "--calibrate-step-trace", metavar="PATH",
        help="with --calibrate-url: the step trace that cluster's engine cores write "
        "(STEPSERVE_STEP_TRACE), to fit the step terms on its served steps",
    )  # fmt: skip
    prof.add_argument(
        "--calibrate-replicas", type=int, default=2,
        help="replicas of the calibration cluster (started with --threads torch threads each)",
    )  # fmt: skip
    prof.add_argument(
        "--calibrate-seconds", type=float, default=12.0,
        help="seconds per calibration level (each level runs twice)",
    )  # fmt: skip
    prof.add_argument(
        "--from", dest="from_profile", help="calibrate this existing profile instead of measuring"
    )
    prof.set_defaults(func=cmd_profile)

    simp = sub.add_parser("simulate", help="simulate a cluster on a workload (no Ray, no model)")
    _add_sim_args(simp)
    simp.add_argument("--out", help="directory for requests.jsonl, summary.json, timelines, plots")
    simp.add_argument("--plots", action="store_true", help="write PNG plots (needs matplotlib)")
    simp.add_argument(
        "--compare", nargs="+", metavar="REAL.jsonl",
        help="fidelity report: replay records of this trace on a real cluster (one per run, "
        "bench/trace_replay.py); prints real vs simulated per metric with the runs' spread and "
        "pass/fail (exit status 1 on fail)",
    )  # fmt: skip
    simp.add_argument("--compare-json", metavar="PATH", help="also write the report as JSON")
    simp.add_argument(
        "--sim-seeds", type=int, default=5,
        help="--compare: simulate the trace with this many seeds (--seed, --seed + 1, ...) and "
        "judge the median per metric (one seed is one draw of the routers' ties and the token "
        "ids; default 5)",
    )  # fmt: skip
    simp.add_argument(
        "--step-trace", metavar="PATH",
        help="write a line per simulated step, as an engine core does under STEPSERVE_STEP_TRACE "
        "(read by `stepserve steps`)",
    )  # fmt: skip
    simp.set_defaults(func=cmd_simulate)

    steps = sub.add_parser(
        "steps", help="summarise step traces (STEPSERVE_STEP_TRACE or simulate --step-trace), "
        "priced by a profile",
    )  # fmt: skip
    steps.add_argument(
        "traces", nargs="+", metavar="TRACE[@RECORD]",
        help="a step trace; @RECORD: only the steps of that replay record's run "
        "(bench/trace_replay.py), for a server's trace that spans several runs",
    )  # fmt: skip
    steps.add_argument("--profile", help="price each step with this profile (and its serving fit)")
    steps.add_argument(
        "--per-replica", action="store_true", help="a column per replica, not one per trace"
    )
    steps.add_argument(
        "--ttft", action="store_true",
        help="for each TRACE@RECORD (an engine core's trace), also split the replay's first "
        "tokens: path in, the wait for the core to read it, queue, prefill, path out",
    )  # fmt: skip
    steps.add_argument("--json", metavar="PATH", help="also write the summaries as JSON")
    steps.set_defaults(func=cmd_steps)

    plan = sub.add_parser(
        "plan", help="the fewest replicas that meet a TTFT/TPOT SLO at a rate (simulated)"
    )
    _add_sim_args(plan, replicas=False)
    plan.add_argument("--slo-ttft-ms", type=float, required=True)
    plan.add_argument("--slo-tpot-ms", type=float, required=True)
    plan.add_argument(
        "--attainment", type=float, default=0.99, help="share of requests that must meet both"
    )
    plan.add_argument("--max-replicas", type=int, default=4096)
    plan.set_defaults(func=cmd_plan)


def _add_sim_args(p: argparse.ArgumentParser, replicas: bool = True) -> None:
    p.add_argument("--config", help="ClusterConfig YAML (the same file the real cluster uses)")
    p.add_argument("--profile", required=True, help="profile JSON, or a shipped profile's name")
    if replicas:
        p.add_argument("--replicas", type=int, help="replica count (default: the config's)")
    p.add_argument("--router", choices=["load_aware", "pow2", "round_robin"])
    p.add_argument("--prefix-affinity", action="store_true")
    p.add_argument("--max-candidates", type=int, help="load_aware: replicas ranked per request")
    p.add_argument("--ingress-replicas", type=int)
    p.add_argument("--workload", default="heterogeneous", help=f"one of {', '.join(WORKLOADS)}")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--rate", type=float, default=4.0, help="requests (or conversations) per s")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--net-latency-ms",
        type=float,
        help="one way, client <-> replica (default: the profile's calibrated path latency, else 2)",
    )
    p.add_argument(
        "--no-serving-calibration",
        action="store_true",
        help="price steps by Engine.step alone even when the profile has a serving calibration",
    )
    p.add_argument("--stats-delivery-ms", type=float, default=0.0)
    p.add_argument(
        "--cold-start-s", type=float,
        help="a new replica's start until it serves (default: the profile's startup_s, else 10)",
    )  # fmt: skip
    p.add_argument(
        "--lose-replica-at", type=float, action="append", default=[], metavar="S",
        help="lose the running replica with the most requests at S seconds (repeatable): its "
        "requests are sent again (migrated if a token was out), Ray starts a replacement",
    )  # fmt: skip
    p.add_argument(
        "--add-replica-at", type=float, action="append", default=[], metavar="S",
        help="start one more replica at S seconds (repeatable); it serves after the cold start",
    )  # fmt: skip
    p.add_argument(
        "--net-jitter-ms", type=float, default=0.0,
        help="network variance: each one-way hop adds an exponential draw of this mean",
    )  # fmt: skip
    p.add_argument(
        "--host-spread", type=float, metavar="S",
        help="host variance: each host's steps cost exp(N(0, S)) times their price, drawn per "
        "host from the seed (S: the log standard deviation of a host's price level between "
        "runs; `stepserve steps --profile` measures it from replays); default: the profile's "
        "serving.host_spread, else 0; 0: off",
    )  # fmt: skip
    p.add_argument(
        "--host-level", type=float, default=1.0, metavar="F",
        help="every host's steps cost F times their price (default 1): the level a live "
        "cluster runs at, its served steps over their price (`stepserve steps --profile`)",
    )  # fmt: skip
    p.add_argument(
        "--host-level-from", action="append", default=[], metavar="TRACE[@RECORD]",
        help="--host-level measured: the served steps of these engine-core step traces "
        "(STEPSERVE_STEP_TRACE; @RECORD: one replay's window) over the profile's serving "
        "price, their geometric mean (repeatable)",
    )  # fmt: skip
    p.add_argument("--autoscaler", choices=["stepserve", "ray_default"], default="stepserve")
    p.add_argument("--ray-target-ongoing", type=float, default=2.0)
    p.add_argument("--time-scale", type=float, default=1.0, help="trace: divide arrival times")
    p.add_argument(
        "--loras", type=int, default=0, help="requests (conversations) run with one of this many "
        "LoRA adapters, Zipf-popular (turns engine.enable_lora on); 0: the base model only",
    )  # fmt: skip
    p.add_argument("--lora-skew", type=float, default=1.0, help="the adapters' Zipf exponent")
    p.add_argument("--max-loras", type=int, help="engine.max_loras: adapters per step")
    p.add_argument("--max-cpu-loras", type=int, help="engine.max_cpu_loras: adapters held (LRU)")
    p.add_argument(
        "--lora-load-ms", type=float,
        help="a replica's load of an adapter it does not hold (default: the profile's, else 20)",
    )  # fmt: skip
    p.add_argument(
        "--weight-lora-load", type=float, help="routing.weight_lora_load (0: ignore adapters)"
    )
    from cluster.engine_args import add_kv_transfer_args

    add_kv_transfer_args(p)
    p.add_argument(
        "--transfer-gbps", type=float,
        help="KV transfer rate in GB/s (default: routing.kv_transfer_bytes_per_s, 1 GB/s)",
    )  # fmt: skip
    p.add_argument(
        "--fetch-latency-ms", type=float,
        help="fixed cost of one KV fetch (default: routing.kv_fetch_latency_s, 5 ms)",
    )  # fmt: skip
    p.add_argument(
        "--kv-bytes-per-block", type=int,
        help="one KV block's bytes (default: routing.kv_bytes_per_block)",
    )  # fmt: skip


def profile_model_name(model: str) -> str:
    """A profile's model part of its name: the model directory's name, a GGUF metadata
    directory's without its content hash (`SmolLM2-135M-Instruct.Q4_1-184027d7ed76` ->
    `SmolLM2-135M-Instruct-Q4_1`)."""
    name = Path(model).name
    m = re.fullmatch(r"(.+)\.([A-Za-z0-9_]+)-[0-9a-f]{12}", name)
    return f"{m.group(1)}-{m.group(2)}" if m else name


def cmd_profile(args: argparse.Namespace) -> int:
    """Measure Engine.step over the grid (unless --from), then calibrate the serving path on a
    cluster started for it (or the one at --calibrate-url; --no-serving: neither)."""
    import torch

    from cluster.engine_args import engine_overrides
    from replica.config import EngineConfig
    from replica.tiny_models import resolve_model_dir
    from sim.host import check_quiet
    from sim.profile import PROFILES, Profile

    if args.from_profile and args.no_serving:
        raise ValueError("--from calibrates an existing profile: it cannot take --no-serving")
    if args.calibrate_step_trace and not args.calibrate_url:
        raise ValueError(
            "--calibrate-step-trace is the trace of the cluster at --calibrate-url: give both "
            "(the clusters `stepserve profile` starts write their own)"
        )
    if args.calibrate_replicas < 1:
        raise ValueError(f"--calibrate-replicas {args.calibrate_replicas}: at least 1")
    # the engine's step times need a quiet host (a calibration of an existing profile does not
    # check: the cluster it measures is running)
    quiet = check_quiet() if not args.from_profile else {"busy": False}
    if quiet["busy"]:
        msg = (
            f"the host is busy ({quiet['busy_reason']}; load average "
            f"{quiet['loadavg_start'][0]:.2f} on {quiet['cpus']} cores): step times would be "
            "those of a contended host"
        )
        if not args.allow_busy_host:
            print(f"stepserve profile: {msg}. Stop the other work, or pass --allow-busy-host "
                  "(the profile is then flagged as busy)", file=sys.stderr)  # fmt: skip
            return 2
        print(f"stepserve profile: warning: {msg}", file=sys.stderr)
    if args.from_profile:
        prof = Profile.load(args.from_profile)
        return _calibrate(prof, args, Path(args.out or args.from_profile))
    overrides = engine_overrides(args)
    # "default" is the default model as `stepserve serve` serves it (its Q4_1 GGUF), not the
    # de-quantized fp32 copy the benchmarks' peers read: a profile prices what is served
    model = overrides.get("model") or "default"
    overrides["model"] = str(resolve_model_dir("default-gguf" if model == "default" else model))
    overrides.setdefault("enable_prefix_caching", True)
    # step costs by the step's shape, one token per decode (the simulator proposes no drafts)
    overrides.setdefault("num_speculative_tokens", 0)
    config = EngineConfig.model_validate(overrides)
    if args.threads:
        torch.set_num_threads(args.threads)
    prof = _measure_engine(config, args)
    if quiet["busy"]:
        prof.meta["host"]["busy"] = True
        reason = prof.meta["host"]["busy_reason"]
        prof.meta["host"]["busy_reason"] = "; ".join(
            x for x in (f"before the run: {quiet['busy_reason']}", reason) if x
        )
    name = args.name or prof.meta["name"]
    prof.meta["name"] = name
    out = Path(args.out) if args.out else PROFILES / f"{name}.json"
    prof.save(out)  # the engine profile stands even if the calibration fails
    fit = prof.as_dict()
    print(f"stepserve profile: {len(prof.points)} points")
    print(f"  fit error (grid): {_fmt_err(fit['fit_error'])}")
    print(f"  held-out mixed steps: {_fmt_err(fit['held_out_error'])}")
    host = prof.meta["host"]
    print(
        f"  host: load average {host['loadavg_start'][0]:.2f} -> {host['loadavg_end'][0]:.2f} "
        f"(max {host['loadavg_max']:.2f}), other processes {host['other_cores']:.2f} cores, "
        f"steal {host['steal_share']:.1%}"
    )
    print(f"  wrote {out}")
    if args.no_serving:
        _print_warnings("profile", prof.warnings())
        return 0
    return _calibrate(prof, args, out, overrides)


def _measure_engine(config, args: argparse.Namespace):
    """The engine profile of `config` in this process (the engine shut down after)."""
    import torch

    from replica.engine import Engine
    from replica.layers import cpu_isa
    from sim.profile import measure

    t0 = time.perf_counter()
    engine = Engine(config)
    print(f"stepserve profile: engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        prof = measure(engine, quick=args.quick, reps=args.reps, progress=print)
    finally:
        engine.shutdown()
    prof.meta["name"] = (
        f"{profile_model_name(config.model)}-{cpu_isa.active_level()}-{torch.get_num_threads()}t"
    )
    print(f"stepserve profile: measured in {time.perf_counter() - t0:.0f} s", flush=True)
    return prof


def _calibrate(prof, args: argparse.Namespace, out: Path, overrides: dict | None = None) -> int:
    import tempfile

    from sim.calibrate import describe, measure_serving, measure_solo

    replicas = args.calibrate_replicas
    solo = []
    # the clusters it starts write step traces: the step terms are fitted on the served steps
    traces_dir = None if args.calibrate_url else Path(tempfile.mkdtemp(prefix="stepserve-cal-"))
    traces = [traces_dir / "solo.steps.jsonl", traces_dir / "steps.jsonl"] if traces_dir else []
    if replicas > 1 and not args.calibrate_url:  # steps with no other replica beside them
        url, server = _start_cluster(prof, args, overrides, 1, step_trace=traces[0])
        try:
            print(f"stepserve profile: serving calibration against {url} (1 replica, solo)")
            solo = measure_solo(url, prof, seconds=args.calibrate_seconds)
        finally:
            _stop_cluster(server)
    if args.calibrate_url:
        url, server = args.calibrate_url, None
        traces = [Path(args.calibrate_step_trace)] if args.calibrate_step_trace else []
    else:
        url, server = _start_cluster(prof, args, overrides, replicas, step_trace=traces[1])
    # the host's spread between hours is measured from replays, not here: a recalibration keeps it
    kept = {k: v for k, v in (prof.serving or {}).items() if k.startswith("host_spread")}
    try:
        print(f"stepserve profile: serving calibration against {url} ({replicas} replicas)")
        prof.serving = measure_serving(
            url, prof, replicas, seconds=args.calibrate_seconds, solo_rows=solo,
            step_traces=[t for t in traces if t.exists()],
        ) | kept  # fmt: skip
    finally:
        if server is not None:
            _stop_cluster(server)
    step_fit = prof.serving.get("step_fit")
    if step_fit:
        print(f"  step terms fitted on {step_fit['steps']} served steps ({step_fit['rejected']} "
              "rejected); the measurements fit the path")  # fmt: skip
        for group, e in step_fit["fit_error"].items():
            print(f"  {group:13s} {e['n']:5d} steps, median error {e['median_abs_rel_error']:.1%}, "
                  f"summed time {e['sum_error']:+.1%}")  # fmt: skip
        if traces_dir is not None:  # kept to look at (`stepserve steps DIR/steps.jsonl`), MBs
            print(f"  the clusters' step traces are in {traces_dir}")
    else:
        print("  no step trace: every term fitted on the measurements")
    print(f"  serving: {describe(prof.serving)}")
    for group, e in prof.serving["fit_error"].items():
        print(
            f"  {group:8s} {e['n']:4d} measurements, median error "
            f"{e['median_abs_rel_error']:.1%} (bias {e['bias']:+.1%}), {e['rejected']} rejected"
        )
    prof.save(out)
    print(f"  wrote {out}")
    _print_warnings("profile", prof.warnings())
    return 0


def _start_cluster(
    prof, args: argparse.Namespace, overrides: dict | None, replicas: int, step_trace=None
):
    """`stepserve serve` of the profile's model and engine settings in a child process, on a
    free loopback port (`step_trace`: the file its engine cores write their steps to); returns
    (its URL, the process) once /health answers."""
    import os
    import socket
    import subprocess
    import tempfile

    import httpx
    import yaml

    engine = dict(overrides or {})
    engine.setdefault("model", prof.meta["model"])
    engine.setdefault("num_speculative_tokens", 0)
    for key in ("block_size", "max_num_seqs", "max_num_batched_tokens", "dtype"):
        engine.setdefault(key, prof.engine.get(key))
    engine = {k: v for k, v in engine.items() if v is not None}
    with socket.socket() as sock:  # a free loopback port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    data = {"engine": engine, "replicas": replicas, "http": {"host": "127.0.0.1", "port": port}}
    threads = prof.meta.get("threads")
    if threads:
        data["cpu_threads_per_replica"] = threads
    cfg = Path(tempfile.mkdtemp(prefix="stepserve-profile-")) / "cluster.yaml"
    cfg.write_text(yaml.safe_dump(data))
    print(f"stepserve profile: starting a {replicas}-replica cluster on port {port}", flush=True)
    root = str(Path(__file__).resolve().parent.parent)  # this checkout's stepserve
    pythonpath = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, pythonpath)))}
    if step_trace is not None:
        env["STEPSERVE_STEP_TRACE"] = str(step_trace)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--config", str(cfg)], env=env
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"stepserve serve exited with {proc.returncode} before it served")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            _stop_cluster(proc)
            raise TimeoutError("the calibration cluster did not answer /health within 900 s")
        time.sleep(2.0)


def _stop_cluster(proc) -> None:
    import signal
    import subprocess

    proc.send_signal(signal.SIGINT)  # serve drains and shuts Ray down
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _print_warnings(command: str, warnings: list[str]) -> None:
    for w in warnings:
        print(f"stepserve {command}: warning: {w}", file=sys.stderr)


def profile_warnings(profile, args: argparse.Namespace | None = None) -> list[str]:
    """What `simulate` and `plan` warn about a profile: its own warnings, a CPU that differs
    from this host's, and no serving calibration to apply."""
    from sim.host import cpu_mismatch

    out = profile.warnings() + [
        f"{m}: its step times may not be this host's" for m in cpu_mismatch(profile.meta)
    ]
    if profile.serving is None and not getattr(args, "no_serving_calibration", False):
        out.append(
            "the profile has no serving calibration: steps are priced as Engine.step alone, "
            "without the serving path's cost (stepserve profile --from PROFILE calibrates it)"
        )
    return out


def _host_settings(args: argparse.Namespace, profile) -> None:
    """`--host-level-from` measured into `args.host_level`; the host level and spread in effect
    printed."""
    from sim.cluster import host_spread_for

    traces = getattr(args, "host_level_from", [])
    if traces:
        args.host_level = measured_host_level(traces, profile)
        print(f"  host level measured on {len(traces)} step trace(s): {args.host_level:.3f}")
    level = getattr(args, "host_level", 1.0)
    if level != 1.0:
        print(f"  host level {level:.3f}: every step costs {level:.3f} times its price")
    spread = host_spread_for(build_settings(args, profile), profile)
    if spread:
        print(
            f"  host spread {spread:.3f}: each host's steps cost exp(N(0, {spread:.3f})) times "
            "their price, drawn from the seed (--host-spread 0: none)"
        )


def _plan_for_a_slow_hour(args: argparse.Namespace, profile) -> None:
    """A plan provisions for a slow hour: with a host spread S in the profile and no host
    setting given, every host at exp(S) times its price (one deviation up), not a seeded draw
    per host (a small fleet's plan would move with the seed)."""
    from sim.cluster import host_spread_for

    if args.host_spread is not None or args.host_level != 1.0 or args.host_level_from:
        return
    spread = host_spread_for(build_settings(args, profile), profile)
    if spread:
        args.host_spread, args.host_level = 0.0, math.exp(spread)
        print(
            f"  planned for a slow hour: the profile's host spread {spread:.3f} one deviation up "
            "(--host-level F or --host-spread S to choose)"
        )


def measured_host_level(items: list[str], profile) -> float:
    """The geometric mean of `real_over_serving` over step traces (TRACE[@RECORD] each)."""
    from sim.steptrace import overall, price_level, summarise_file

    if not profile.serving:
        raise ValueError("--host-level-from needs a profile with a serving calibration")
    ratios = []
    for item in items:
        path, _, record = item.partition("@")
        ratios.append(overall(summarise_file(path, record or None, profile))["real_over_serving"])
    return ratios[0] if len(ratios) == 1 else price_level(ratios)["level"]


def _fmt_err(e: dict) -> str:
    if not e:
        return "n/a"
    return (
        f"median {e['median_abs_rel_error']:.1%}, p90 {e['p90_abs_rel_error']:.1%}, "
        f"max {e['max_abs_rel_error']:.1%} over {e['points']} points"
    )


def build_cluster_config(args: argparse.Namespace):
    from cluster.config import ClusterConfig

    data = {}
    if args.config:
        import yaml

        data = yaml.safe_load(Path(args.config).read_text()) or {}
        if "applications" in data:
            data = data["applications"][0].get("args", {})
    routing = data.setdefault("routing", {})
    if args.router:
        routing["policy"] = args.router
    if args.prefix_affinity:
        routing["prefix_affinity"] = True
    if args.max_candidates is not None:
        routing["max_candidates"] = args.max_candidates
    if getattr(args, "weight_lora_load", None) is not None:
        routing["weight_lora_load"] = args.weight_lora_load
    if getattr(args, "route_kv_transfer", None) is not None:
        routing["kv_transfer"] = args.route_kv_transfer
    if getattr(args, "pd", None):
        from cluster.config import PDConfig

        data["pd"] = PDConfig.parse(args.pd).model_dump()
    engine = data.setdefault("engine", {})
    if getattr(args, "loras", 0):
        engine["enable_lora"] = True
    for name in ("max_loras", "max_cpu_loras"):
        if getattr(args, name, None) is not None:
            engine[name] = getattr(args, name)
    if args.ingress_replicas:
        data.setdefault("http", {})["ingress_replicas"] = args.ingress_replicas
    if getattr(args, "replicas", None):
        data["replicas"] = args.replicas
    return ClusterConfig.model_validate(data)


def build_workload(args: argparse.Namespace, profile=None):
    """The workload named by --workload, sized by --num-requests and --rate, its requests (or
    conversations) given adapters with --loras."""
    from sim.workloads import assign_adapters

    workload = _base_workload(args)
    rng = random.Random(args.seed * 7919 + 1)  # apart from the workload's own draws
    loras = getattr(args, "loras", 0)
    skew = getattr(args, "lora_skew", 1.0)
    assign_adapters([spec for _, spec in workload.requests], loras, skew, rng)
    assign_adapters(workload.conversations, loras, skew, rng)
    return workload


def _base_workload(args: argparse.Namespace):
    from sim.cluster import Workload
    from sim.workloads import (
        arrival_offsets,
        heterogeneous_dataset,
        long_tail_dataset,
        multi_turn_conversations,
        prefix_repetition_dataset,
        random_dataset,
        read_trace,
    )

    rng = random.Random(args.seed)
    n = args.num_requests
    name = args.workload
    if name.startswith("trace:"):
        rows = read_trace(name.split(":", 1)[1], limit=n, seed=args.seed)
        scale = args.time_scale
        return Workload(requests=[(r.arrival_s / scale, r.spec) for r in rows])
    if name == "multi-turn":
        convs = multi_turn_conversations(
            n, args.rate, rng, system_len=4 * args.input_len, user_len=max(4, args.input_len // 4),
            output_len=args.output_len,
        )  # fmt: skip
        return Workload(conversations=convs)
    if name == "random":
        specs = random_dataset(n, args.input_len, args.output_len, 0.5, rng)
    elif name == "heterogeneous":
        specs = heterogeneous_dataset(
            n, 0.1, (args.input_len, args.output_len),
            (8 * args.input_len, 4 * args.output_len), rng,
        )  # fmt: skip
    elif name == "prefix":
        specs = prefix_repetition_dataset(
            n, 8, 4 * args.input_len, args.input_len // 2, args.output_len, rng
        )
    elif name == "long-tail":
        specs = long_tail_dataset(n, args.input_len, args.output_len, 8 * args.output_len, 1.0, rng)
    else:
        raise ValueError(f"--workload {name!r}: expected one of {', '.join(WORKLOADS)}")
    times = arrival_offsets(n, args.rate, 1.0, rng)
    return Workload(requests=list(zip(times, specs)))


def build_settings(args: argparse.Namespace, profile=None):
    from sim.cluster import SimSettings

    serving = profile.serving if profile is not None else None
    if args.net_latency_ms is not None:
        latency = args.net_latency_ms / 1000.0
    elif serving and not args.no_serving_calibration:
        latency = serving["path_latency_s"]
    else:
        latency = 0.002
    return SimSettings(
        serving={} if args.no_serving_calibration else None,
        net_latency_s=latency,
        stats_delivery_s=args.stats_delivery_ms / 1000.0,
        cold_start_s=args.cold_start_s,
        lose_replica_at_s=tuple(args.lose_replica_at),
        add_replica_at_s=tuple(args.add_replica_at),
        net_jitter_s=args.net_jitter_ms / 1000.0,
        host_spread=getattr(args, "host_spread", None),
        host_level=getattr(args, "host_level", 1.0),
        autoscaler=args.autoscaler,
        ray_target_ongoing_requests=args.ray_target_ongoing,
        seed=args.seed,
        lora_load_s=None if args.lora_load_ms is None else args.lora_load_ms / 1000.0,
        kv_transfer_bytes_per_s=None if args.transfer_gbps is None else args.transfer_gbps * 1e9,
        kv_fetch_latency_s=None if args.fetch_latency_ms is None else args.fetch_latency_ms / 1e3,
        kv_bytes_per_block=args.kv_bytes_per_block,
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    from sim.cluster import simulate
    from sim.profile import Profile

    if args.compare:
        return cmd_compare(args)
    profile = Profile.load(args.profile)
    _print_warnings("simulate", profile_warnings(profile, args))
    _host_settings(args, profile)
    config = build_cluster_config(args)
    workload = build_workload(args, profile)
    t0 = time.perf_counter()
    trace = [] if args.step_trace else None
    result = simulate(config, profile, workload, build_settings(args, profile), step_trace=trace)
    wall = time.perf_counter() - t0
    if trace is not None:
        _write_step_trace(args.step_trace, trace)
        print(f"  wrote {len(trace)} steps to {args.step_trace}")
    summary = result.summary()
    summary["wall_s"] = wall
    print_summary(summary)
    if args.out:
        out = Path(args.out)
        write_result(out, result, summary)
        if args.plots:
            from sim.plots import plot_result

            for p in plot_result(result, out):
                print(f"  wrote {p}")
        print(f"  wrote {out}/summary.json, requests.jsonl, replicas.json, timelines.json")
    return 0


def _write_step_trace(path: str, lines: list[dict]) -> None:
    """The simulator's step lines (`simulate --step-trace`), one JSON line each."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)


def cmd_compare(args: argparse.Namespace) -> int:
    """`simulate --compare`: the trace simulated (--sim-seeds times), against its real replays."""
    report = fidelity_report(args)
    print(f"fidelity: {args.workload} ({len(args.compare)} real runs) vs simulated")
    for i, path in enumerate(args.compare, 1):
        print(f"  run{i}: {path}")
    from sim.fidelity import format_report

    print(format_report(report))
    if args.compare_json:
        Path(args.compare_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.compare_json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"  wrote {args.compare_json}")
    return 0 if report["ok"] else 1


def fidelity_report(args: argparse.Namespace) -> dict:
    """The fidelity report (sim/fidelity.py `compare`) of `args.compare`'s replay records
    against this trace simulated with `args`' cluster, profile and settings."""
    from sim.cluster import simulate
    from sim.fidelity import (
        check_matches,
        compare,
        median_metrics,
        read_run,
        real_metrics,
        sim_metrics,
    )
    from sim.profile import Profile

    if not args.workload.startswith("trace:"):
        raise ValueError(
            f"--compare needs --workload trace:FILE (the trace the real runs replayed), "
            f"not {args.workload!r}"
        )
    if args.loras:
        raise ValueError("--compare: --loras is not supported (a replay sends the base model)")
    runs = [read_run(p) for p in args.compare]
    profile = Profile.load(args.profile)
    _host_settings(args, profile)  # every caller's --host-level-from measured, once
    workload = build_workload(args, profile)
    lengths = [spec.num_prompt_tokens for _, spec in workload.requests]
    for run in runs:
        check_matches(run, lengths)
        scale = run.meta.get("time_scale", 1.0)
        if abs(scale - args.time_scale) > 1e-9:
            raise ValueError(
                f"{run.path}: replayed with time scale {scale}, --time-scale is {args.time_scale}"
            )
    seeds = getattr(args, "sim_seeds", 1)
    if seeds < 1:
        raise ValueError(f"--sim-seeds {seeds}: at least 1")
    sims = []
    for k in range(seeds):
        draw = argparse.Namespace(**{**vars(args), "seed": args.seed + k})
        wl = workload if k == 0 else build_workload(draw, profile)
        trace = [] if k == 0 and getattr(args, "step_trace", None) else None
        result = simulate(
            build_cluster_config(draw), profile, wl, build_settings(draw, profile), step_trace=trace
        )
        if trace is not None:  # the first seed's steps
            _write_step_trace(args.step_trace, trace)
        sims.append(sim_metrics(result.requests, result.replicas))
    report = compare([real_metrics(r) for r in runs], median_metrics(sims), sims)
    report["sim_seeds"] = [args.seed + k for k in range(seeds)]
    report["trace"] = args.workload.split(":", 1)[1]
    report["real_runs"] = [{"path": r.path, **r.meta} for r in runs]
    report["profile"] = profile.meta.get("name", args.profile)
    return report


def cmd_steps(args: argparse.Namespace) -> int:
    """`stepserve steps`: step traces side by side (sim/steptrace.py)."""
    from sim.profile import Profile
    from sim.steptrace import (
        format_table,
        format_ttft,
        overall,
        price_level,
        summarise_file,
        ttft_parts,
    )

    profile = Profile.load(args.profile) if args.profile else None
    columns, summaries, splits = {}, {}, []
    for item in args.traces:
        path, _, record = item.partition("@")
        summary = summarise_file(path, record or None, profile)
        label = Path(record or path).stem
        summaries[item] = summary
        if args.per_replica:
            columns.update({f"{label}:{r}"[-24:]: d for r, d in summary.items() if r != "all"})
        else:
            columns[label] = overall(summary)
        if args.ttft and record:
            parts = ttft_parts(path, record)
            summary["ttft_parts"] = parts
            splits.append(format_ttft(label, parts))
    if profile is not None:
        print(f"priced by {profile.meta.get('name', args.profile)}")
    print(format_table(columns))
    level = price_level([overall(s).get("real_over_serving") for s in summaries.values()])
    if level is not None:
        print(
            f"served price level over {level['traces']} traces: median {level['median']:.3f}, "
            f"log-sd {level['log_sd']:.3f} (over replays of one trace at different hours: the "
            "host's spread, simulate --host-spread)"
        )
    for text in splits:
        print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1) + "\n")
        print(f"  wrote {args.json}")
    return 0


def write_result(out: Path, result, summary: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    with open(out / "requests.jsonl", "w") as f:
        for r in result.requests:
            f.write(json.dumps(r) + "\n")
    (out / "replicas.json").write_text(
        json.dumps({"replicas": result.replicas, "replica_count": result.replica_count}) + "\n"
    )
    (out / "timelines.json").write_text(json.dumps(result.timelines) + "\n")


def print_summary(s: dict) -> None:
    print(
        f"requests {s['requests']}: {s['completed']} completed, {s['rejected']} rejected, "
        f"{s['unfinished']} unfinished; simulated {s['duration_s']:.1f} s"
        + (f" in {s['wall_s']:.1f} s wall" if "wall_s" in s else "")
    )
    if "ttft_s" not in s:
        return
    for key in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
        v = s[key]
        if v:
            print(
                f"  {key[:-2]:5s} ms: p50 {v['p50'] * 1e3:9.1f}  p90 {v['p90'] * 1e3:9.1f}  "
                f"p99 {v['p99'] * 1e3:9.1f}"
            )
    print(
        f"  throughput {s['output_tokens_per_s']:.1f} output tok/s, {s['requests_per_s']:.2f} "
        f"req/s; prefix hits {s['hit_rate']:.1%} ({s['hit_tokens']} of {s['prompt_tokens']} "
        f"prompt tokens); preemptions {s['preemptions']}; replica-hours "
        f"{s['replica_seconds'] / 3600:.3f}"
    )
    if s.get("fetches"):
        print(
            f"  KV: {s['prefilled_tokens']} prompt tokens prefilled, {s['fetches']} fetches "
            f"brought {s['fetched_tokens']} (mean wait {s['fetch_s_mean'] * 1e3:.1f} ms)"
        )
    if s.get("lost_replicas"):
        print(f"  lost replicas {s['lost_replicas']}: {s['migrations']} requests sent again")
    if "lora_loads" in s:
        print(
            f"  LoRA: {s['lora_requests']} adapter requests, {s['lora_loads']} adapter loads "
            f"({s['lora_loads_per_request']:.3f} per request), {s['lora_waited']:.1%} waited "
            "for a load"
        )


def meets(summary: dict, attainment: float) -> bool:
    return summary.get("slo_attainment", 0.0) >= attainment


def cmd_plan(args: argparse.Namespace) -> int:
    """Smallest replica count whose simulated SLO attainment reaches --attainment: doubling,
    then bisection (attainment grows with replicas for a fixed workload, up to noise)."""
    from sim.cluster import simulate
    from sim.profile import Profile

    profile = Profile.load(args.profile)
    _print_warnings("plan", profile_warnings(profile, args))
    _plan_for_a_slow_hour(args, profile)
    _host_settings(args, profile)
    slo = (args.slo_ttft_ms / 1000.0, args.slo_tpot_ms / 1000.0)
    cache: dict[int, dict] = {}

    def attainment(n: int) -> dict:
        if n not in cache:
            args.replicas = n
            config = build_cluster_config(args)
            result = simulate(config, profile, build_workload(args), build_settings(args, profile))
            cache[n] = result.summary(*slo)
            s = cache[n]
            p99 = s.get("ttft_s", {}).get("p99", math.nan)
            print(
                f"  {n:5d} replicas: SLO attainment {s.get('slo_attainment', 0):.3f}, "
                f"TTFT p99 {p99 * 1e3:.0f} ms",
                flush=True,
            )
        return cache[n]

    lo, hi = 0, 1
    while not meets(attainment(hi), args.attainment):
        lo, hi = hi, hi * 2
        if hi > args.max_replicas:
            print(f"stepserve plan: not met with {args.max_replicas} replicas", file=sys.stderr)
            return 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(attainment(mid), args.attainment):
            hi = mid
        else:
            lo = mid
    s = cache[hi]
    print(
        f"stepserve plan: {hi} replicas meet TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= "
        f"{args.slo_tpot_ms:g} ms for {s['slo_attainment']:.1%} of requests at {args.rate:g} req/s"
    )
    return 0
