"""Whole serving stacks side by side: `stepserve serve` and vLLM's OpenAI server (CPU build, its
own virtual environment) on the same model, dtype and cores, each started in turn on
127.0.0.1, warmed up, swept over request rates with bench/serving.py (the same requests at the
same arrival times for every system; each rate its own prompts, none of them the warm-up's)
and stopped before the next one starts. With `--rounds N` the order rotates each round and
every figure is the median over rounds.

What a user choosing a stack sees: HTTP in, SSE out, tokenization, scheduling and the model,
measured by one client. Writes bench/results/<out>.json and <out>_latency_vs_rate.png.

Run (it starts Ray for stepserve): flock /tmp/stepserve-ray.lock .venv/bin/python \
        bench/serving_vs_peer.py --systems stepserve,vllm,vllm-2cores --request-rate 1,2,3,4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._models import model_dir as resolve_model  # noqa: E402
from bench.serving import machine_info  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
# The warm-up's prompts come from a seed no sweep rate uses (bench/serving.py's sweep_seed: rate
# i's from seed + i * SWEEP_SEED_STRIDE, seed 0 by default), so the prefix cache holds none of the
# measured ones.
WARMUP_SEED = 999_983


def tree_of(system: str, args) -> str | None:
    """The checkout a `SYSTEM@TREE` system runs from (the server runs there, so its own
    modules come first on every path); None for this one."""
    system, _, tree = system.partition("@")
    if not tree:
        return None
    trees = dict(t.split("=", 1) for t in args.tree)
    if tree not in trees or not system.startswith("stepserve"):
        raise SystemExit(f"{system}@{tree}: a stepserve system and a --tree {tree}=PATH")
    return str(Path(trees[tree]).resolve())


def own_env(system: str, args) -> dict[str, str]:
    """The `--env SYSTEM:KEY=VALUE` settings of `system` (its full name, `@TREE` included)."""
    env = {}
    for spec in getattr(args, "env", None) or []:
        name, _, setting = spec.partition(":")
        key, sep, value = setting.partition("=")
        if not (name and key and sep):
            raise SystemExit(f"--env {spec!r}: SYSTEM:KEY=VALUE")
        if name == system:
            env[key] = value
    return env


def own_args(system: str, args) -> list[str]:
    """The `--args SYSTEM:FLAGS` server flags of `system` (its full name, `@TREE` included)."""
    flags: list[str] = []
    for spec in getattr(args, "args", None) or []:
        name, sep, more = spec.partition(":")
        if not (name and sep):
            raise SystemExit(f"--args {spec!r}: SYSTEM:FLAGS")
        if name == system:
            flags += more.split()
    return flags


def server_command(system: str, args, model: Path, port: int) -> tuple[list[str], dict]:
    """argv and environment that start `system` on 127.0.0.1:port. A stepserve system named
    `SYSTEM@TREE` runs from the checkout `--tree TREE=PATH` (this interpreter, the checkout
    first on PYTHONPATH, which Ray's processes inherit): a before/after pair in one run."""
    env = dict(os.environ) | own_env(system, args)
    extra = own_args(system, args)
    tree = tree_of(system, args)
    system = system.partition("@")[0]
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    # Ray Serve modes: (throughput-optimized, direct ingress, HAProxy) per suffix; no suffix is
    # Ray Serve's defaults. +haproxy is what `stepserve serve` runs (cluster/cli.py).
    modes = {"+haproxy": "111", "+tput": "110", "+grpc": "100"}
    suffix = next((m for m in modes if system.endswith(m)), None)
    if system.startswith("stepserve"):
        flags = modes[suffix] if suffix else "000"
        names = (
            "RAY_SERVE_THROUGHPUT_OPTIMIZED",
            "RAY_SERVE_ENABLE_DIRECT_INGRESS",
            "RAY_SERVE_ENABLE_HA_PROXY",
        )
        env |= dict(zip(names, flags, strict=True))
        system = system.removesuffix(suffix or "")
    if system in ("stepserve", "stepserve-nospec") or system.startswith("stepserve-t"):
        argv = [str(ROOT / ".venv" / "bin" / "stepserve"), "serve", "--model", str(model)]
        if tree:
            argv[:1] = [sys.executable, "-m", "cluster.cli"]
        argv += ["--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port)]
        if system == "stepserve-thread":  # the engine in a thread of the replica's actor
            argv += ["--engine-core", "thread"]
        elif system == "stepserve-nospec":  # prompt-lookup speculative decoding off
            argv += ["--num-speculative-tokens", "0"]
        elif system != "stepserve":  # stepserve-tN: N torch threads per replica
            argv += ["--cpu-threads", system.removeprefix("stepserve-t")]
        argv += args.stepserve_args.split() + extra
        return argv, env
    if system in ("vllm", "vllm-2cores"):
        argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server"]
        argv += ["--model", str(model), "--served-model-name", "model"]
        argv += ["--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port)]
        argv += args.vllm_args.split() + extra
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.vllm_kv_gib))
        env["HF_HUB_OFFLINE"] = "1"
        if system == "vllm-2cores":
            # every core to vLLM's compute threads, as stepserve's replica gets them
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
        else:
            env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # vLLM's own choice
        return argv, env
    raise SystemExit(
        f"unknown system {system!r}: stepserve, stepserve-thread, stepserve-nospec, "
        "stepserve-tN, vllm or vllm-2cores"
    )


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode}; log:\n{log.read_text()[-4000:]}"
            )
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(
        f"server not healthy within {timeout_s:.0f} s; log:\n{log.read_text()[-4000:]}"
    )


def stop(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group (stepserve shuts Serve and Ray down on it), then
    SIGKILL whatever is left after a minute."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def wait_port_free(port: int, timeout_s: float = 120.0) -> None:
    """Until nothing listens on 127.0.0.1:port (a stopped server's children, vLLM's engine
    process among them, can hold it for a while after the server itself has exited)."""
    import socket

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        with socket.socket() as sock:
            listening = sock.connect_ex(("127.0.0.1", port)) == 0
        if not listening:
            # and bindable, as the next server will bind it (a socket still closing refuses
            # a bind after it has stopped answering connections)
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(("127.0.0.1", port))
                    return
                except OSError:
                    pass
        time.sleep(1)
    raise RuntimeError(f"port {port} still in use {timeout_s:.0f} s after the server stopped")


def run_serving(base_url: str, label: str, bench_args: list[str], result: Path | None) -> dict:
    argv = [sys.executable, str(ROOT / "bench" / "serving.py"), "--base-url", base_url]
    argv += ["--label", label, *bench_args]
    if result is not None:
        argv += ["--result-file", str(result)]
    subprocess.run(argv, check=True)
    return json.loads(result.read_text()) if result is not None else {}


@contextlib.contextmanager
def started_server(system: str, argv: list[str], env: dict, args, log: Path, procs=None):
    """Start a server (`server_command`'s argv and env; output to `log`; in a session of its
    own, which every process it starts shares; appended to the list `procs` when given), wait
    until it is healthy, warm it up on prompts no measured run sends and let it settle
    `args.settle_s`; yields the seconds it took to become healthy; stops it and waits for its
    port after."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            argv, env=env, stdout=fh, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=tree_of(system, args),
        )  # fmt: skip
    if procs is not None:
        procs.append(proc)
    base = f"http://127.0.0.1:{args.port}"
    try:
        started = time.time()
        wait_healthy(base, proc, args.startup_timeout_s, log)
        startup_s = time.time() - started
        warm = ["--dataset", args.dataset, "--num-prompts", str(args.warmup_prompts)]
        warm += ["--seed", str(WARMUP_SEED)]  # prompts the sweep never sends
        run_serving(base, f"{system} warm-up", [*warm, "--request-rate", "inf"], None)
        time.sleep(args.settle_s)
        yield startup_s
    finally:
        stop(proc)
        wait_port_free(args.port)


def median_runs(rounds: list[list[dict]]) -> list[dict]:
    """Per request rate, the median over rounds of every number (nested dicts alike)."""

    def merge(items: list):
        first = items[0]
        if isinstance(first, dict):
            return {
                k: merge([it[k] for it in items]) for k in first if all(k in it for it in items)
            }
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            return round(statistics.median(items), 3)
        return first

    by_rate: dict[float, list[dict]] = {}
    for runs in rounds:
        for run in runs:
            by_rate.setdefault(run["request_rate"], []).append(run)
    return [merge(runs) | {"rounds": len(runs)} for _, runs in sorted(by_rate.items())]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--systems",
        default="stepserve,vllm,vllm-2cores",
        help="stepserve (auto threads), stepserve-tN (N torch threads), vllm (its own CPU "
        "binding), vllm-2cores (compute threads on every core); a stepserve system runs with "
        "Ray Serve's defaults, with the suffix +tput in its throughput-optimized mode "
        "(RAY_SERVE_THROUGHPUT_OPTIMIZED=1, direct ingress, Ray's Python proxy on the port), "
        "+grpc in that mode without direct ingress, +haproxy with direct ingress behind "
        "HAProxy (what stepserve serve runs)",
    )
    p.add_argument("--model", default="default", help="tiny, default, or a local HF model dir")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--request-rate", default="1,2,3,4")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--dataset", default="long-tail")
    p.add_argument("--goodput", default="ttft:1000 tpot:100")
    p.add_argument("--bench-args", default="", help="more bench/serving.py flags")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument(
        "--tree",
        action="append",
        default=[],
        help="NAME=PATH of a checkout, for systems named SYSTEM@NAME (e.g. "
        "--tree before=/tmp/before --systems stepserve+haproxy,stepserve+haproxy@before)",
    )
    p.add_argument("--warmup-prompts", type=int, default=16)
    p.add_argument(
        "--settle-s",
        type=float,
        default=3.0,
        help="idle seconds after the warm-up: a server's one-time deferred work (stepserve's "
        "core loads its grammar engine once it has idled 1 s) happens before the sweep",
    )
    p.add_argument("--stepserve-args", default="", help="more `stepserve serve` flags")
    p.add_argument("--vllm-args", default="", help="more vLLM api_server flags")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        help="SYSTEM:KEY=VALUE, an environment variable for that system's server only; with "
        "--tree, one tree twice under two names is an A/B of a setting (e.g. --tree lean=. "
        "--systems stepserve+haproxy,stepserve+haproxy@lean "
        "--env stepserve+haproxy@lean:RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000)",
    )
    p.add_argument(
        "--args",
        action="append",
        default=[],
        help="SYSTEM:FLAGS, more server flags for that system only (an A/B of an engine "
        "setting from one tree: --tree off=. --args 'stepserve+haproxy@off:--cpu-kv-prefault-mib "
        "0')",
    )
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--port", type=int, default=8031)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--out", default="serving_vs_peer")
    args = p.parse_args()

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if any(s.startswith("vllm") for s in systems) and not Path(args.vllm_python).exists():
        raise SystemExit(f"--vllm-python {args.vllm_python} does not exist (see bench/README.md)")
    model = resolve_model(args.model)
    base = f"http://127.0.0.1:{args.port}"
    bench_args = ["--dataset", args.dataset, "--num-prompts", str(args.num_prompts)]
    bench_args += ["--goodput", args.goodput, *args.bench_args.split()]
    rounds: dict[str, list[list[dict]]] = {s: [] for s in systems}
    settings: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = systems[r % len(systems) :] + systems[: r % len(systems)]
            for system in order:
                argv, env = server_command(system, args, model, args.port)
                log = Path(tmp) / f"{system}-{r}.log"
                print(f"== round {r + 1}/{args.rounds}: {system}: {' '.join(argv)}", flush=True)
                with started_server(system, argv, env, args, log) as startup_s:
                    result = Path(tmp) / f"{system}-{r}.json"
                    data = run_serving(
                        base, system, [*bench_args, "--request-rate", args.request_rate], result
                    )
                rounds[system].append(data["runs"])
                settings.setdefault(system, {"argv": argv, "startup_s": []})
                settings[system]["startup_s"].append(round(startup_s, 1))
                for key in ("RAY_SERVE_THROUGHPUT_OPTIMIZED", "RAY_SERVE_ENABLE_DIRECT_INGRESS"):
                    if key in env:
                        settings[system][key] = env[key]
                if own := own_env(system, args):
                    settings[system]["env"] = own
                if system.startswith("vllm"):
                    settings[system]["VLLM_CPU_OMP_THREADS_BIND"] = env.get(
                        "VLLM_CPU_OMP_THREADS_BIND", "auto"
                    )
                    settings[system]["VLLM_CPU_KVCACHE_SPACE"] = env["VLLM_CPU_KVCACHE_SPACE"]
                time.sleep(3)  # let the stopped server's processes leave the cores

    merged = {s: median_runs(runs) for s, runs in rounds.items()}
    out = {
        "benchmark": "serving_vs_peer",
        "title": (
            f"Serving stacks side by side: {model.name}, {args.dtype}, {args.dataset} dataset, "
            f"{args.num_prompts} requests per rate, median of {args.rounds} round(s)"
        ),
        "model": str(model.name),
        "dtype": args.dtype,
        "bench_args": bench_args,
        "rounds": args.rounds,
        "systems": settings,
        "host": machine_info(),
        "sweep": {"systems": merged},
        "per_round": rounds,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.out}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    print_table(merged)
    from bench.plots import plot_latency_vs_rate

    out["sweep"]["title"] = out["title"]
    print(
        f"wrote {plot_latency_vs_rate(out['sweep'], RESULTS / f'{args.out}_latency_vs_rate.png')}"
    )


def print_table(merged: dict[str, list[dict]]) -> None:
    print(
        f"{'system':<14} {'req/s':>6} {'done/s':>7} {'out tok/s':>9} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'e2e p50':>8} {'e2e p99':>8} {'good/s':>7}"
    )
    for system, runs in merged.items():
        for run in runs:
            good = run.get("goodput", {}).get("request_goodput", float("nan"))
            print(
                f"{system:<14} {run['request_rate']:>6g} {run['request_throughput']:>7.2f} "
                f"{run['output_throughput']:>9.1f} {run['ttft_ms']['median']:>9.1f} "
                f"{run['ttft_ms']['p99']:>9.1f} {run['tpot_ms']['median']:>9.1f} "
                f"{run['tpot_ms']['p99']:>9.1f} {run['e2el_ms']['median']:>8.0f} "
                f"{run['e2el_ms']['p99']:>8.0f} {good:>7.2f}"
            )


if __name__ == "__main__":
    main()
