"""What a running stepserve server costs an engine step on the same cores while it has no request.

On 2 cores the engine's forward runs on both (torch's OpenMP threads, which wait for each other
at every parallel region), so any other process that wakes takes a core from a step and the
whole step waits. An idle stepserve server is a dozen processes (Ray's GCS, raylet and agents;
Serve's controller and proxy; HAProxy's manager; the ingress, the replica and the hub), each of
which wakes many times a second. This measures that cost directly:

- a variant (`--variant NAME=VAR=VALUE,...`) starts `stepserve serve` with those environment
  settings (the default model), waits until it answers, then lets it settle (`--settle`, past
  the ingress's late xgrammar import);
- this process runs its own engine (`LLM()`: the same default model and threads) over
  `--requests` prompts of `--prompt-len` random tokens, one at a time with `--gap` seconds
  between them (each arrives at an idle engine), and times each prefill step;
- every other request runs with the server's processes stopped (SIGSTOP, then SIGCONT after
  it): the same memory, no wake-ups. The cost of the server's wake-ups is the median of the
  paired differences (each request with the server running minus the next one with it
  stopped), which the host's drift over minutes (often larger than the effect) cancels out of;
- a variant's `STEPSERVE_PROBE_DEMOTE=REGEX:POLICY` (not passed to the server) moves every
  thread of the matching server processes to SCHED_IDLE (`idle`), SCHED_BATCH at nice 19
  (`batch`) or nice 19 (`nice`) once it has settled;
- `--freeze-group NAME=REGEX` measures one group of the server's processes the same way
  (only those stopped), to see which of them costs what;
- meanwhile the server's CPU (percent of one core) and context switches per second.

Variants run in rotation for `--rounds`. Writes bench/results/idle_noise.json.

Run: flock /tmp/stepserve-ray.lock .venv/bin/python bench/probes/idle_noise.py \
        --variant default= --variant loop05=RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5 \
        --freeze-group controller=ServeController --freeze-group gcs=gcs_server
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.serving_vs_peer import stop, wait_healthy  # noqa: E402
from cluster.cli import free_port  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
ROOT = Path(__file__).resolve().parents[2]
SERVER_PROCESSES = ("ray::", "gcs_server", "raylet", "dashboard", "stepserve", "ray/_private",
                    "autoscaler", "haproxy", "engine_core")  # fmt: skip


def process_table(cmd_chars: int | None = 80) -> dict[int, tuple[int, int, str]]:
    """pid -> (CPU ticks, context switches of all its threads, command line: its first
    `cmd_chars` characters, or all of it with None)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            switches = 0
            for task in os.listdir(f"/proc/{entry}/task"):
                for line in Path(f"/proc/{entry}/task/{task}/status").read_text().splitlines():
                    if "ctxt_switches" in line:
                        switches += int(line.split()[1])
            table[int(entry)] = (
                int(fields[11]) + int(fields[12]),
                switches,
                cmd.strip()[:cmd_chars],
            )
        except (OSError, ValueError, IndexError):
            continue
    return table


def server_pids(exclude: int) -> list[int]:
    return [
        pid
        for pid, (_, _, cmd) in process_table().items()
        if pid != exclude and any(name in cmd for name in SERVER_PROCESSES)
    ]


def background(before: dict, after: dict, seconds: float, pids: set[int]) -> dict:
    tick = os.sysconf("SC_CLK_TCK")
    rows = [
        ((after[p][0] - before[p][0]) / tick / seconds * 100,
         (after[p][1] - before[p][1]) / seconds, after[p][2])
        for p in pids if p in before and p in after
    ]  # fmt: skip
    rows.sort(reverse=True)
    return {
        "cpu_pct_of_one_core": round(sum(r[0] for r in rows), 1),
        "switches_per_s": round(sum(r[1] for r in rows)),
        "top": [
            {"cpu_pct": round(c, 1), "switches_per_s": round(s), "cmd": cmd}
            for c, s, cmd in rows[:8]
        ],  # fmt: skip
    }


class EngineProbe:
    """This process's own engine: prefill steps of fresh prompts arriving at an idle engine."""

    def __init__(self, prompt_len: int, seed: int = 0) -> None:
        from replica.engine import LLM

        self.llm = LLM()
        self.prompt_len = prompt_len
        self.rng = random.Random(seed)
        self.times: list[float] = []
        engine = self.llm.engine
        step = engine.step

        def timed():
            started = time.perf_counter()
            out = step()
            self.times.append(1000 * (time.perf_counter() - started))
            return out

        engine.step = timed

    def run(self, n: int, gap: float) -> list[float]:
        from replica.request import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        firsts = []
        for _ in range(n):
            time.sleep(gap)
            ids = [self.rng.randrange(1000, 40000) for _ in range(self.prompt_len)]
            self.times.clear()
            self.llm.generate([ids], params)
            firsts.append(round(self.times[0], 2))
        return firsts


def start_server(env_overrides: dict[str, str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ) | env_overrides
    proc = subprocess.Popen(
        [str(ROOT / ".venv/bin/stepserve"), "serve", "--port", str(port)],
        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 180, log)
    return proc, url


def stop_server(proc: subprocess.Popen) -> None:
    """The server's process group stopped (serving_vs_peer's `stop`), then any Ray left."""
    stop(proc)
    subprocess.run([str(ROOT / ".venv/bin/ray"), "stop", "--force"], capture_output=True)
    time.sleep(2)


DEMOTE_KEY = "STEPSERVE_PROBE_DEMOTE"  # a variant's REGEX:POLICY, applied here, not the server's


def demote(pids: list[int], spec: str) -> int:
    """Every thread of the server processes whose command line matches REGEX to POLICY
    (idle: SCHED_IDLE; batch: SCHED_BATCH at nice 19; nice: nice 19), as a server could do to
    its background processes; returns how many threads. Scheduling settings are per thread on
    Linux (renice or chrt without -a change only the main one)."""
    pattern, sep, policy = spec.rpartition(":")
    if not (sep and pattern) or policy not in ("idle", "batch", "nice"):
        raise SystemExit(f"{DEMOTE_KEY}={spec!r}: REGEX:POLICY, POLICY one of idle|batch|nice")
    table, done = process_table(cmd_chars=None), 0
    for pid in pids:
        if pid not in table or not re.search(pattern, table[pid][2]):
            continue
        try:
            tids = list(map(int, os.listdir(f"/proc/{pid}/task")))
        except FileNotFoundError:
            continue  # gone since the table was read
        for tid in tids:
            try:
                if policy == "idle":
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                elif policy == "batch":
                    os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
                    os.setpriority(os.PRIO_PROCESS, tid, 19)
                else:
                    os.setpriority(os.PRIO_PROCESS, tid, 19)
                done += 1
            except ProcessLookupError:
                continue
    return done


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.partition("=")
    env = dict(item.split("=", 1) for item in rest.split(",") if item)
    return name, env


def paired(probe: EngineProbe, args, pids: list[int]) -> dict:
    """Requests alternate: the server running, then its `pids` stopped during the next."""
    running, stopped = [], []
    for i in range(2 * (args.requests // 2)):
        stop = i % 2 == 1
        if stop:
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
        try:
            (stopped if stop else running).extend(probe.run(1, args.gap))
        finally:
            if stop:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
    return {
        "step_ms_median_running": round(statistics.median(running), 1),
        "step_ms_median_stopped": round(statistics.median(stopped), 1),
        "step_ms_p90_running": round(sorted(running)[int(0.9 * len(running))], 1),
        "step_ms_p90_stopped": round(sorted(stopped)[int(0.9 * len(stopped))], 1),
        "paired_cost_ms_median": round(
            statistics.median(r - s for r, s in zip(running, stopped)), 1
        ),
        "running_ms": running,
        "stopped_ms": stopped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=VAR=VALUE,VAR=VALUE (NAME= for the defaults)")  # fmt: skip
    parser.add_argument(
        "--freeze-group",
        action="append",
        default=[],
        help="NAME=REGEX: also the cost of the server processes matching it",
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--gap", type=float, default=0.5)
    parser.add_argument("--prompt-len", type=int, default=75)
    parser.add_argument("--settle", type=float, default=30.0)
    parser.add_argument("--out", default=str(RESULTS / "idle_noise.json"))
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant] or [("default", {})]
    groups = [("all", ".")] + [tuple(g.split("=", 1)) for g in args.freeze_group]

    probe = EngineProbe(args.prompt_len)
    probe.run(5, 0.0)  # warm-up
    rows = []
    for round_ in range(args.rounds):
        for name, env in variants:
            server_env = {k: v for k, v in env.items() if k != DEMOTE_KEY}
            proc, _ = start_server(server_env, Path(f"/tmp/idle_noise_{name}.log"))
            try:
                time.sleep(args.settle)
                pids = server_pids(os.getpid())
                demoted = 0
                if DEMOTE_KEY in env:
                    demoted = demote(pids, env[DEMOTE_KEY])
                    print(f"{name}: {demoted} threads demoted", flush=True)
                before, started = process_table(), time.monotonic()
                time.sleep(5.0)
                load = background(before, process_table(), time.monotonic() - started, set(pids))
                for group, pattern in groups:
                    table = process_table()
                    chosen = [p for p in pids if p in table and re.search(pattern, table[p][2])]
                    row = {"variant": name, "round": round_, "env": env, "group": group,
                           "num_processes": len(chosen), "demoted_threads": demoted,
                           "idle_load": load,
                           **paired(probe, args, chosen)}  # fmt: skip
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items()
                                      if not k.endswith("_ms") and k != "idle_load"}),
                          flush=True)  # fmt: skip
            finally:
                stop_server(proc)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    for row in rows:
        print(f"{row['variant']:>10} round {row['round']} {row['group']:>12}: "
              f"step {row['step_ms_median_running']} ms running, "
              f"{row['step_ms_median_stopped']} ms stopped; paired cost "
              f"{row['paired_cost_ms_median']} ms; idle server "
              f"{row['idle_load']['cpu_pct_of_one_core']}% of a core, "
              f"{row['idle_load']['switches_per_s']} switches/s")  # fmt: skip


if __name__ == "__main__":
    main()
