"""CPU per streamed token of the serving path: everything a `stepserve serve` process tree runs
besides the engine core (HAProxy, the ingress, the LLMServer front, the controller, Ray's own
processes), by process role, and the engine core apart, from /proc CPU times before and after a
fixed closed-loop streaming load. Trees given with `--tree NAME=PATH` run in turn in one
invocation (a before/after pair on one host, alternating with `--rounds`).

Run (it starts Ray): flock /tmp/stepserve-ray.lock .venv/bin/python bench/serving_path_cpu.py \
        --tree before=/tmp/before --model tiny
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._models import model_dir as resolve_model  # noqa: E402
from bench.serving import machine_info  # noqa: E402
from bench.serving_vs_peer import run_serving, server_command, started_server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# process roles by command line, first match wins
ROLES = [
    ("engine core", r"replica\.engine\.(core_process|prestart)"),
    ("front (LLMServer)", r"ServeReplica:[^ ]*:LLMServer"),
    ("ingress", r"ServeReplica:[^ ]*:Ingress"),
    ("proxy/haproxy", r"haproxy|HAProxyManager|ProxyActor"),
    ("controller", r"ServeController"),
    ("gcs/raylet", r"^\S*(gcs_server|raylet)(\s|$)"),  # the executables, not flags naming them
    ("kv-event hub", r"ApplicationHub"),
    ("dashboard/agents", r"dashboard|DashboardAgent|RuntimeEnvAgent|log_monitor|monitor\.py"),
    ("cli (stepserve serve)", r"cluster\.cli|bin/stepserve"),
]


def session_counters(session: int, switches: bool = False) -> dict[int, tuple[int, int, str]]:
    """pid -> (CPU ticks: utime + stime of all its threads; context switches of all its threads,
    counted only with `switches`, else 0; command line) of every process in `session` (the server
    was started in a session of its own, which every process it starts, Ray's workers included,
    shares)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) != session:
                continue
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            count = 0
            for tid in os.listdir(f"/proc/{entry}/task") if switches else ():
                for line in Path(f"/proc/{entry}/task/{tid}/status").read_text().splitlines():
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        count += int(line.split()[1])
            table[int(entry)] = (int(fields[11]) + int(fields[12]), count, cmd.strip())
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile (a thread that ended loses its switches: few, idle)
    return table


def session_cpu(session: int) -> dict[int, tuple[int, str]]:
    """pid -> (CPU ticks, command line) of every process in `session`."""
    return {pid: (ticks, cmd) for pid, (ticks, _, cmd) in session_counters(session).items()}


def role_of(cmd: str) -> str:
    return next((name for name, pattern in ROLES if re.search(pattern, cmd)), "other")


def cpu_by_role(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds per role between two `session_cpu` snapshots (a process that started in
    between counts from zero; one that ended is lost: none should during a load)."""
    roles: dict[str, float] = {}
    for pid, (ticks, cmd) in after.items():
        used = (ticks - before.get(pid, (0, cmd))[0]) / CLOCK_TICKS
        if used > 0:
            roles[role_of(cmd)] = roles.get(role_of(cmd), 0.0) + used
    return roles


def profilers(session: int, args, label: str) -> list[subprocess.Popen]:
    """py-spy (`--py-spy`) recording the ingress and the front of `session` in collapsed-stack
    form (`--profile-dir`/LABEL-ROLE-PID.txt), without pausing them; stopped by `stop_profilers`."""
    if not args.py_spy:
        return []
    out = Path(args.profile_dir)
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for pid, (_, cmd) in session_cpu(session).items():
        role = role_of(cmd)
        if role in ("ingress", "front (LLMServer)"):
            name = f"{label.replace(' ', '_')}-{role.split()[0]}-{pid}.txt"
            argv = [args.py_spy, "record", "--nonblocking", "-r", "200", "-f", "raw"]
            argv += ["-p", str(pid), "-o", str(out / name)]
            procs.append(
                subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
    time.sleep(1.0)  # attached
    return procs


def stop_profilers(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    for proc in procs:
        proc.wait(timeout=60)


def measure(session: int, base: str, args, label: str, seed: int) -> dict:
    """Idle CPU for args.idle_s, then the closed-loop load; CPU ms per streamed token by role,
    raw and less the idle rate over the load's duration."""
    t0, idle0 = time.monotonic(), session_cpu(session)
    time.sleep(args.idle_s)
    idle = cpu_by_role(idle0, session_cpu(session))
    idle_s = time.monotonic() - t0
    load = ["--dataset", "random", "--random-input-len", str(args.input_len)]
    load += ["--random-output-len", str(args.output_len), "--random-range-ratio", "0"]
    load += ["--num-prompts", str(args.num_prompts), "--request-rate", "inf"]
    load += ["--max-concurrency", str(args.concurrency), "--seed", str(seed)]
    spies = profilers(session, args, label) if seed == 0 else []
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        t1, before = time.monotonic(), session_cpu(session)
        data = run_serving(base, label, load, Path(result.name))
        after, load_s = session_cpu(session), time.monotonic() - t1
    stop_profilers(spies)
    run = data["runs"][0] if "runs" in data else data
    tokens = run["total_output_tokens"]
    if run["failed"] or not tokens:
        raise RuntimeError(f"{label}: {run['failed']} requests failed, {tokens} tokens")
    used = cpu_by_role(before, after)
    core = used.pop("engine core", 0.0)
    idle_rate = {k: v / idle_s for k, v in idle.items()}
    net = {k: v - idle_rate.get(k, 0.0) * load_s for k, v in used.items()}
    core_net = core - idle_rate.get("engine core", 0.0) * load_s

    def per_token(seconds: float) -> float:
        return round(1000 * seconds / tokens, 3)

    return {
        "tokens": tokens,
        "load_s": round(load_s, 2),
        "output_tok_s": run["output_throughput"],
        "path_ms_per_token": per_token(sum(used.values())),
        "path_ms_per_token_less_idle": per_token(sum(net.values())),
        "core_ms_per_token": per_token(core),
        "core_ms_per_token_less_idle": per_token(core_net),
        "by_role_ms_per_token": {k: per_token(v) for k, v in sorted(used.items())},
        "by_role_ms_per_token_less_idle": {k: per_token(v) for k, v in sorted(net.items())},
        "idle_ms_per_s": {k: round(1000 * v, 1) for k, v in sorted(idle_rate.items())},
    }


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per tree, the median over its loads of every figure."""
    keys = ("path_ms_per_token", "path_ms_per_token_less_idle", "core_ms_per_token")
    per_role = ("by_role_ms_per_token", "by_role_ms_per_token_less_idle", "idle_ms_per_s")

    def median_of(rs: list[dict], key: str) -> dict[str, float]:
        roles = sorted({k for run in rs for k in run[key]})
        return {r: round(statistics.median(run[key].get(r, 0.0) for run in rs), 3) for r in roles}

    summary = {
        name: {k: round(statistics.median(run[k] for run in rs), 3) for k in keys}
        | {k: median_of(rs, k) for k in per_role}
        for name, rs in runs.items()
    }
    for s in summary.values():  # the stack's own background, besides the engine core's
        s["path_idle_ms_per_s"] = round(
            sum(v for k, v in s["idle_ms_per_s"].items() if k != "engine core"), 1
        )
    return summary


def print_table(summary: dict[str, dict]) -> None:
    print(
        "CPU ms per streamed token (medians): path = every process but the engine core; "
        "'less idle' takes off each process's idle rate over the load's duration"
    )
    print(
        f"{'tree':<10} {'path':>7} {'less idle':>9} {'core':>7} {'idle ms/s':>9}  by role, less idle"
    )
    for name, s in summary.items():
        roles = ", ".join(f"{k} {v:.3f}" for k, v in s["by_role_ms_per_token_less_idle"].items())
        print(
            f"{name:<10} {s['path_ms_per_token']:>7.3f} {s['path_ms_per_token_less_idle']:>9.3f}"
            f" {s['core_ms_per_token']:>7.3f} {s['path_idle_ms_per_s']:>9.1f}  {roles}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tree",
        action="append",
        default=[],
        help="NAME=PATH of a checkout to measure (repeatable; default: this one, as 'this'), "
        "e.g. --tree before=/tmp/before --tree after=.",
    )
    p.add_argument("--model", default="default", help="tiny, default, or a local HF model dir")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency", type=int, default=8, help="streams in flight (closed loop)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64, help="max_tokens (ignore_eos)")
    p.add_argument("--repeats", type=int, default=2, help="loads per server start")
    p.add_argument("--rounds", type=int, default=1, help="starts per tree, alternating")
    p.add_argument("--idle-s", type=float, default=5.0, help="idle window before each load")
    p.add_argument(
        "--py-spy",
        help="a py-spy binary: record the ingress and the front during each server's first load "
        "(collapsed stacks under --profile-dir; it perturbs that load's figures a little)",
    )
    p.add_argument("--profile-dir", default="/tmp/serving_path_cpu_profiles")
    p.add_argument("--stepserve-args", default="", help="more `stepserve serve` flags")
    p.add_argument(
        "--tree-args",
        action="append",
        default=[],
        help="NAME=FLAGS: more `stepserve serve` flags for one tree (an A/B of one checkout: "
        "--tree fed=. --tree ray=. --tree-args ray=--no-direct-stream)",
    )
    p.add_argument("--warmup-prompts", type=int, default=16)
    p.add_argument("--settle-s", type=float, default=3.0)
    p.add_argument("--port", type=int, default=8031)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--out", default="serving_path_cpu")
    args = p.parse_args()
    args.tree = args.tree or [f"this={ROOT}"]
    args.dataset = "random"  # the warm-up's (started_server)
    names = [t.split("=", 1)[0] for t in args.tree]
    tree_args = dict(t.split("=", 1) for t in args.tree_args)
    unknown = set(tree_args) - set(names)
    if unknown:
        raise SystemExit(f"--tree-args names {sorted(unknown)}: no such --tree")
    model = resolve_model(args.model)
    base = f"http://127.0.0.1:{args.port}"
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                system = f"stepserve+haproxy@{name}"
                argv, env = server_command(system, args, model, args.port)
                argv += shlex.split(tree_args.get(name, ""))
                print(f"== round {r + 1}/{args.rounds}: {name}: {' '.join(argv)}", flush=True)
                procs: list = []
                log = Path(tmp) / f"{name}-{r}.log"
                with started_server(system, argv, env, args, log, procs):
                    session = os.getsid(procs[0].pid)
                    for i in range(args.repeats):
                        run = measure(session, base, args, f"{name} #{i}", seed=i)
                        print(f"   {name}: {json.dumps(run)}", flush=True)
                        runs[name].append(run)
                time.sleep(3)

    summary = summarize(runs)
    out = {
        "benchmark": "serving_path_cpu",
        "title": (
            f"CPU ms per streamed token, {model.name}, {args.concurrency} streams x "
            f"{args.num_prompts} requests, {args.input_len} in / {args.output_len} out"
        ),
        "trees": dict(t.split("=", 1) for t in args.tree),
        "args": {k: v for k, v in vars(args).items() if k != "tree"},
        "host": machine_info(),
        "summary": summary,
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.out}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    print_table(summary)


if __name__ == "__main__":
    main()
