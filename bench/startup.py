"""`stepserve serve` from a warm cache to a served answer, with where the seconds went.

Each run starts `stepserve serve` (the default model, an embedded Ray), waits for its ready
line, sends one completion, and reads the start-up report the server prints (Ray, Serve, the
application; an LLM replica's process boot and imports and its engine phases); then stops it.
Several trees (e.g. a checkout of an earlier commit) are measured in alternation, so a busy
moment of the host does not favour one:

    python bench/startup.py --runs 3 --tree new=. --tree old=/tmp/before
    python bench/startup.py --engine-only --runs 5 --tree new=. --tree old=/tmp/before
    python bench/startup.py --runs 4 --tree prestart=. --tree noprestart=. \
        --env prestart:STEPSERVE_PRESTART_CORE=1

`--decode N` then sends N requests one at a time (64 random token ids, 48 tokens, greedy,
ignore_eos, streamed) and records each one's median gap between streamed tokens: the served
decode step at batch 1 of each tree, measured in the same alternation (pass
`--serve-args="--num-speculative-tokens 0"` for plain steps: drafts deliver tokens in bursts):

    python bench/startup.py --runs 4 --decode 8 --serve-args="--num-speculative-tokens 0" \
        --tree spawned=. --tree prestart=. --env prestart:STEPSERVE_PRESTART_CORE=1

`--tree-args NAME:FLAGS` gives one tree's server more `stepserve serve` flags (e.g. an A/B of
an engine option from one checkout: `--tree pin=. --tree nopin=. --tree-args
"nopin:--no-cpu-pin-threads"`).

`--engine-only` times the engine's construction alone, `Engine(EngineConfig(model=default))` in
a fresh process that has imported torch and the replica's deployment module (what a replica
has loaded when its constructor runs): the engine's own start, its imports included.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.serving_vs_peer import own_args  # noqa: E402
from cluster.cli import free_port  # noqa: E402


def decode_gaps(url: str, n: int, seed: int = 0) -> list[float]:
    """`n` streamed requests one at a time; each one's median gap between tokens (ms)."""
    import random

    rng = random.Random(seed)
    medians = []
    for _ in range(n):
        body = {
            "prompt": [rng.randrange(100, 40000) for _ in range(64)],
            "max_tokens": 48,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        stamps = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.perf_counter())
        gaps = [1000 * (b - a) for a, b in zip(stamps[1:], stamps[2:])]  # after the first token
        medians.append(round(statistics.median(gaps), 2))
    return medians


def one_run(
    tree: Path,
    python: str,
    log: Path,
    extra_env: dict[str, str],
    decode: int = 0,
    serve_args: list[str] = (),
) -> dict:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    env["PYTHONPATH"] = str(tree)
    env.update(extra_env)
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [python, "-m", "cluster.cli", "serve", "--port", str(port), *serve_args],
            cwd=tree, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        while "ready at" not in log.read_text():
            if proc.poll() is not None or time.monotonic() - started > 300:
                raise RuntimeError(f"no ready line: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        ready = time.monotonic() - started
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        r.raise_for_status()
        answered = time.monotonic() - started
        time.sleep(1.5)  # the report line follows the ready line
        text = log.read_text()
        gaps = decode_gaps(f"http://127.0.0.1:{port}", decode) if decode else []
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    result = {"ready_s": round(ready, 2), "answer_s": round(answered, 2)}
    if gaps:
        result["decode_gap_ms"] = statistics.median(gaps)
        result["decode_gaps_ms"] = gaps
    phases = re.search(r"ready [\d.]+ s after start \(([^)]*)\)", text)
    if phases:
        for part in phases.group(1).split(", "):
            name, seconds, _ = part.split(" ")
            result[name] = float(seconds)
    replica = re.search(r"process boot and imports ([\d.]+) s, engine ([\d.]+) s \(([^)]*)\)", text)
    if replica:
        result["replica_process"] = float(replica.group(1))
        result["replica_engine"] = float(replica.group(2))
        for part in replica.group(3).split(", "):
            name, seconds = part.rsplit(" ", 1)
            result[f"engine.{name}"] = float(seconds)
    return result


ENGINE_ONLY = """
import json, time
import torch  # noqa: F401
import replica.deployment  # noqa: F401
from replica.config import EngineConfig
from replica.default_model import default_model_dir
from replica.engine import Engine
started = time.perf_counter()
engine = Engine(EngineConfig(model=str(default_model_dir())))
print(json.dumps({"engine_s": round(time.perf_counter() - started, 2)}))
"""


def engine_run(tree: Path, python: str) -> dict:
    env = os.environ | {"PYTHONPATH": str(tree)}
    out = subprocess.run(
        [python, "-c", ENGINE_ONLY], cwd=tree, env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH of a checkout")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        help="NAME:KEY=VALUE, an environment variable for the tree NAME's server "
        "(e.g. --tree new=. --tree prestart=. --env prestart:STEPSERVE_PRESTART_CORE=1)",
    )
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--out", default=None, help="JSON file for the results")
    p.add_argument("--engine-only", action="store_true", help="time Engine() alone")
    p.add_argument(
        "--decode", type=int, default=0, help="then N one-at-a-time streams: the token gap"
    )
    p.add_argument("--serve-args", default="", help="more `stepserve serve` arguments")
    p.add_argument(
        "--tree-args",
        dest="args",  # serving_vs_peer's --args format: own_args reads it
        action="append",
        default=[],
        help="NAME:FLAGS, more `stepserve serve` arguments for the tree NAME's server only "
        '(e.g. --tree nopin=. --tree-args "nopin:--no-cpu-pin-threads")',
    )
    args = p.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    for item in args.args + args.env:
        if item.partition(":")[0] not in trees:
            raise SystemExit(f"{item!r}: no --tree {item.partition(':')[0]}=PATH")
    tree_flags = {name: own_args(name, args) for name in trees}
    envs: dict[str, dict[str, str]] = {name: {} for name in trees}
    for item in args.env:
        name, assignment = item.split(":", 1)
        key, value = assignment.split("=", 1)
        envs[name][key] = value
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for i in range(args.runs):
        for name, path in trees.items():
            tree = Path(path).resolve()
            if args.engine_only:
                result = engine_run(tree, args.python)
            else:
                log = Path(f"/tmp/startup-{name}.log")
                serve_args = args.serve_args.split() + tree_flags[name]
                result = one_run(tree, args.python, log, envs[name], args.decode, serve_args)
            runs[name].append(result)
            print(name, i, json.dumps(result), flush=True)
    summary = {
        name: {
            key: statistics.median(r.get(key, float("nan")) for r in rs)
            for key in rs[0]
            if key != "decode_gaps_ms"
        }
        for name, rs in runs.items()
    }
    for name in summary:
        summary[name]["env"] = envs[name]
        summary[name]["args"] = tree_flags[name]
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "median": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
