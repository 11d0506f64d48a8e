"""Simulator fidelity on held-out traces (sim/heldout.py: Azure and Mooncake layouts; light,
~60% and ~90% of capacity; three prompt/output mixes). Per trace: start `stepserve serve
--replicas 2 --num-speculative-tokens 0` (default model), measure the mix's capacity (48
requests, 16 in flight), write the trace at its load's share of it, replay it twice
(bench/trace_replay.py; each replay its own token ids, so the second does not hit the
first's prefix cache), stop the server; then `stepserve simulate --compare` the two replay
records with the trace simulated (sim/fidelity.py: real vs simulated per metric, the runs'
spread, pass/fail against p50 10% / p99 20% or the spread). Writes bench/results/sim_fidelity_heldout.json, .txt (the tables) and
the traces and replay records under bench/results/sim_fidelity_heldout/.

It holds /tmp/stepserve-ray.lock for the whole study (taking it itself unless started under
`flock /tmp/stepserve-ray.lock`). About 20-25 min on 2 cores; --quick: the tiny model, short
traces (~3 min).

Run: .venv/bin/python bench/sim_fidelity.py --profile PROFILE [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serving import machine_info  # noqa: E402
from bench.trace_replay import replay  # noqa: E402
from cluster.processes import free_port  # noqa: E402
from sim.fidelity import BAR, format_report  # noqa: E402
from sim.heldout import HELDOUT, QUICK, HeldOutTrace  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LOCK = "/tmp/stepserve-ray.lock"


# -- the lock: one Ray cluster on the host at a time ------------------------------------------
def _ancestor_holds_lock() -> bool:
    """A parent process is `flock LOCK ...` (it holds the lock for us: taking it again would
    wait forever)."""
    pid = os.getppid()
    while pid > 1:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        if cmd and Path(cmd[0].decode()).name == "flock" and LOCK.encode() in cmd:
            return True
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


@contextlib.contextmanager
def ray_lock():
    if _ancestor_holds_lock():
        yield
        return
    with open(LOCK, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for {LOCK} (another Ray run)", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# -- the server -------------------------------------------------------------------------------
def start_server(
    port: int,
    model: str | None,
    log: Path,
    timeout_s: float = 600.0,
    step_trace: Path | None = None,
) -> subprocess.Popen:
    stepserve = str(Path(sys.executable).parent / "stepserve")
    cmd = [stepserve, "serve", "--host", "127.0.0.1", "--port", str(port), "--replicas", "2",
           "--num-speculative-tokens", "0"]  # fmt: skip
    if model is not None:
        cmd += ["--model", model]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if step_trace is not None:  # every engine core appends its steps (README, "Metrics")
        step_trace.unlink(missing_ok=True)
        env["STEPSERVE_STEP_TRACE"] = str(step_trace)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            resp = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            if resp.status_code == 200 and resp.json().get("ready_replicas", 0) >= 2:
                return proc
        if proc.poll() is not None:
            raise RuntimeError(f"stepserve serve exited ({proc.returncode}); see {log}")
        time.sleep(2)
    stop_server(proc)
    raise RuntimeError(f"stepserve serve not ready with 2 replicas in {timeout_s:.0f} s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def served_model(profile: str, fallback: str) -> str | None:
    """The `--model` that serves what the profile measured (None: the default model, served
    from its GGUF); a profile whose model is not on this host serves `fallback` ("default":
    the default model; else a bench model name)."""
    from replica.default_model import default_model_dir
    from sim.profile import Profile

    measured = Path(Profile.load(profile).meta.get("model", ""))
    if measured.is_dir():
        return None if measured == default_model_dir() else str(measured)
    if fallback == "default":
        return None
    from bench._models import model_dir

    return str(model_dir(fallback))


# -- one trace --------------------------------------------------------------------------------
# the capacity probe: a closed loop of this many streams (8 per replica), 3x as many requests
PROBE_CONCURRENCY = 16


def capacity(base: str, trace: HeldOutTrace, n: int, work: Path) -> float:
    """Requests/s the cluster completes of this mix when loaded: `n` requests, at most
    PROBE_CONCURRENCY in flight, completions counted between the first and the last quarter of
    them (the start, when the streams begin together, and the tail, when the last few run
    alone, left out)."""
    probe = trace.write(work / f"{trace.name}.probe{trace.suffix}", 1e6, seed=10_001, n=n)
    out = work / f"{trace.name}.probe.jsonl"
    run = replay(base, probe, out, seed=99, max_concurrency=PROBE_CONCURRENCY)
    done = [r["start_s"] + r["e2e_s"] for r in run.rows if r["success"]]
    if len(done) < 8:
        raise RuntimeError(f"capacity probe: only {len(done)} of {n} requests succeeded")
    return saturated_rate(done)


def saturated_rate(finish_times: list[float]) -> float:
    """Completions per second between the first and the last quarter of the finishes."""
    done = sorted(finish_times)
    lo, hi = len(done) // 4, 3 * len(done) // 4
    return (hi - lo) / (done[hi] - done[lo])


def run_trace(trace: HeldOutTrace, args, work: Path, rate: float | None) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    steps = work / f"{trace.name}.steps.jsonl" if args.step_trace else None
    proc = start_server(port, args.model, work / f"{trace.name}.server.log", step_trace=steps)
    try:
        print(f"[{trace.name}] server ready in {time.time() - t0:.0f} s", flush=True)
        cap = None
        if rate is None:
            cap = capacity(base, trace, args.probe_requests, work)
            rate = trace.load * cap
            print(f"[{trace.name}] capacity {cap:.2f} req/s -> rate {rate:.2f}", flush=True)
        path = trace.write(work / f"{trace.name}{trace.suffix}", rate, seed=args.seed)
        records = []
        for k in range(1, args.replays + 1):
            time.sleep(3.0)
            out = work / f"{trace.name}.real{k}.jsonl"
            run = replay(base, path, out, seed=k)
            ok = sum(r["success"] for r in run.rows)
            print(
                f"[{trace.name}] replay {k}: {ok}/{len(run.rows)} ok in "
                f"{run.meta['wall_s']:.0f} s (load average {run.meta['load_average_1m']}, CPU "
                f"stolen {run.meta['host_cpu']['steal_share']:.1%})",
                flush=True,
            )
            records.append(str(out))
    finally:
        stop_server(proc)
    argv = ["simulate", "--profile", args.profile, "--replicas", "2",
            "--workload", f"trace:{path}", "--num-requests", str(trace.num_requests),
            "--seed", "1", "--compare", *records,
            "--compare-json", str(work / f"{trace.name}.report.json")]  # fmt: skip
    if steps is not None:
        argv += ["--step-trace", str(work / f"{trace.name}.sim-steps.jsonl")]
    from cluster.cli import make_parser
    from sim.cli import fidelity_report

    report = fidelity_report(make_parser().parse_args(argv))
    table = format_report(report, [f"real{k}" for k in range(1, args.replays + 1)])
    print(f"\n[{trace.name}] {trace.about}; {rate:.2f} req/s\n{table}\n", flush=True)
    step_table = None
    if steps is not None:  # the real replicas' steps, run by run, beside the simulated ones
        sim_steps = work / f"{trace.name}.sim-steps.jsonl"
        step_table = step_summary(steps, records, sim_steps, args)
        print(f"[{trace.name}] steps, real runs and the simulation (seed 1)\n{step_table}\n")
        # kept gzipped (`stepserve steps` reads .gz); the simulated ones are made again by
        # `stepserve simulate ... --step-trace`
        with open(steps, "rb") as f:
            Path(f"{steps}.gz").write_bytes(gzip.compress(f.read(), 9))
        steps.unlink()
        sim_steps.unlink()
    return {
        "about": trace.about,
        "layout": trace.layout,
        "load": trace.load,
        "capacity_rps": cap,
        "rate": rate,
        "requests": trace.num_requests,
        "trace_file": str(path),
        "command": "stepserve " + " ".join(argv),
        "report": report,
        "table": table,
        "step_table": step_table,
    }


def step_summary(steps: Path, records: list[str], sim_steps: Path, args) -> str:
    """`stepserve steps` of the server's trace per replay and of the simulated one."""
    from sim.profile import Profile
    from sim.steptrace import format_table, overall, summarise_file

    profile = Profile.load(args.profile)
    columns = {}
    for k, record in enumerate(records, 1):
        columns[f"real{k}"] = overall(summarise_file(steps, record, profile))
    columns["sim"] = overall(summarise_file(sim_steps, profile=profile))
    return format_table(columns)


def summary_table(results: dict) -> str:
    keys = list(BAR)
    lines = [f"{'trace':20s} {'rate':>6s} " + " ".join(f"{k:>11s}" for k in keys) + "  verdict"]
    for name, t in results["traces"].items():
        cells = []
        for k in keys:
            m = t["report"]["metrics"].get(k)
            if m is None:
                cells.append(f"{'n/a':>11s}")
                continue
            mark = "" if m["ok"] else "!"
            cells.append(f"{m['error']:+9.1%}{mark:1s} ")
        verdict = "PASS" if t["report"]["ok"] else "FAIL"
        lines.append(f"{name:20s} {t['rate']:6.2f} " + " ".join(cells) + f"  {verdict}")
    lines.append("sim / real median - 1; '!': outside the bar (p50 10%, p99 20%) and the spread")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--profile", help="the simulator profile (default: the model's shipped one)")
    p.add_argument("--quick", action="store_true", help="the tiny model, short traces")
    p.add_argument("--traces", help="comma list of held-out trace names (default: all three)")
    p.add_argument(
        "--rates", help="name=req/s,...: fixed rates instead of the load's share of a measured "
        "capacity (to replay the same traces again)",
    )  # fmt: skip
    p.add_argument("--replays", type=int, default=2)
    p.add_argument("--probe-requests", type=int, default=48, help="capacity probe's requests")
    p.add_argument("--seed", type=int, default=0, help="the traces' draws")
    p.add_argument("--out", help="results name (default sim_fidelity_heldout[_quick])")
    p.add_argument(
        "--step-trace", action="store_true",
        help="the servers write step traces (STEPSERVE_STEP_TRACE) and the report adds real vs "
        "simulated steps (`stepserve steps`)",
    )  # fmt: skip
    args = p.parse_args()
    traces = QUICK if args.quick else HELDOUT
    args.model = "tiny" if args.quick else "default"
    args.profile = args.profile or (
        "bench-tiny-llama-v1-avx2-1t" if args.quick else "SmolLM2-135M-Instruct-avx2-1t"
    )
    args.model = served_model(args.profile, args.model)
    if args.traces:
        wanted = args.traces.split(",")
        unknown = set(wanted) - {t.name for t in traces}
        if unknown:
            raise SystemExit(f"unknown traces {sorted(unknown)}; known: {[t.name for t in traces]}")
        traces = tuple(t for t in traces if t.name in wanted)
    rates = {}
    for item in (args.rates or "").split(","):
        if item:
            name, _, value = item.partition("=")
            rates[name] = float(value)
    name = args.out or ("sim_fidelity_heldout_quick" if args.quick else "sim_fidelity_heldout")
    work = RESULTS / name
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "host": machine_info(),
        "model": args.model,
        "profile": args.profile,
        "replays": args.replays,
        "bar": BAR,
        "traces": {},
    }
    with ray_lock():  # one Ray cluster on the host at a time: held over the whole study
        t0 = time.time()
        for trace in traces:
            results["traces"][trace.name] = run_trace(trace, args, work, rates.get(trace.name))
    results["wall_s"] = time.time() - t0
    results["ok"] = all(t["report"]["ok"] for t in results["traces"].values())
    table = summary_table(results)
    print(table)
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    tables = [f"[{n}] {t['about']}; {t['rate']:.2f} req/s\n{t['table']}\n"
              + (f"steps:\n{t['step_table']}\n" if t["step_table"] else "")
              for n, t in results["traces"].items()]  # fmt: skip
    (RESULTS / f"{name}.txt").write_text("\n".join([*tables, table]) + "\n")
    print(f"wrote {out} and {name}.txt ({results['wall_s'] / 60:.1f} min)")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
