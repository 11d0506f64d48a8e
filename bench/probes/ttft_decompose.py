"""Where a served first token's time goes, request by request, beside vLLM's server on the same
requests: `stepserve serve` runs with its engine core's step trace (STEPSERVE_STEP_TRACE: one
JSON line per request added and per step, on the host's monotonic clock) and bench/serving.py
records when it sent each request on the same clock, so each request's TTFT splits into

  in      client sent -> the replica's front handed it to the engine core (HTTP, HAProxy, the
          ingress, Serve's routing, the Ray hop to the replica)
  wait    -> the first step that runs it starts (the step under way when it came, and queueing)
  prefill -> the end of the step that finished its prompt (the core's first token)
  extra   -> the core's step that produced the client's first text (a byte-level token that
          is part of a character shows no text: the first text can need the second token);
          taken as the last of the request's steps that ended before the client read it, so an
          `out` longer than a decode step counts here
  out     -> the client read that text (the front, the Ray stream, the ingress, SSE, HAProxy)

Also, for every system, its own histograms' means over each rate (time to first token, queue
time, prefill time, as the server measures them: vLLM from its API server's arrival, stepserve
from its replica front's), the CPU seconds each of its processes used during each rate (from
/proc: what the serving stack around the engine costs on these cores), and the client's TTFT
and TPOT. Systems run in turn (never two at once), each warmed up and let settle, as
bench/serving_vs_peer.py does, whose server commands this reuses; with --rounds the order
rotates. `--freeze SYSTEM:REGEX` stops (SIGSTOP) that system's server processes whose command
line matches while each rate is measured (only processes of the server's own session; sweeps
of at most FREEZE_MAX_S), e.g. Ray's and Serve's background ones, to see what they cost the
served steps. Writes bench/results/<out>.json.

Run: flock /tmp/stepserve-ray.lock .venv/bin/python bench/probes/ttft_decompose.py \
        --systems stepserve+haproxy,vllm-2cores --request-rate 1,3 --num-prompts 40
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench._models import model_dir as resolve_model  # noqa: E402
from bench.probes.idle_noise import process_table  # noqa: E402
from bench.serving import machine_info, sweep_seed  # noqa: E402
from bench.serving_vs_peer import (  # noqa: E402
    DEFAULT_VLLM_PYTHON,
    run_serving,
    server_command,
    started_server,
)
from replica.engine.core_process import STEP_TRACE_ENV  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# process groups by command line, first match wins
GROUPS = [
    ("engine core", r"replica\.engine\.(core_process|prestart)"),
    ("front (LLMServer actor)", r"ServeReplica:[^ ]*:LLMServer"),
    ("ingress", r"ServeReplica:[^ ]*:Ingress"),
    ("haproxy", r"haproxy|HAProxyManager|ProxyActor"),
    ("serve controller", r"ServeController"),
    ("kv-event hub", r"ApplicationHub"),
    (
        "ray system",
        r"gcs_server|raylet|dashboard|DashboardAgent|RuntimeEnvAgent|log_monitor|monitor\.py",
    ),
    ("vllm worker", r"VLLM::Worker"),
    ("vllm engine core", r"VLLM::EngineCore"),
    ("vllm api server", r"vllm\.entrypoints"),
]


def cpu_split(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds per process group between two `process_table(cmd_chars=None)` snapshots."""
    groups: dict[str, float] = {}
    for pid, (ticks, _, cmd) in after.items():
        used = (ticks - before.get(pid, (0, 0, cmd))[0]) / CLOCK_TICKS
        if used <= 0:
            continue
        name = next((g for g, pattern in GROUPS if re.search(pattern, cmd)), "other")
        groups[name] = groups.get(name, 0.0) + used
    return {k: round(v, 2) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}


SERVER_HISTOGRAMS = (
    "time_to_first_token_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
)


def scrape_histograms(base: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the server's own first-token histograms (vLLM's `vllm:` names, which
    stepserve exports too; `stepserve:` read as well, its names before it took vLLM's prefix),
    summed over label sets."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        m = re.match(r"^(?:vllm|stepserve):(\w+?)_(sum|count)(?:\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) in SERVER_HISTOGRAMS:
            entry = out.setdefault(m.group(1), [0.0, 0.0])
            entry[0 if m.group(2) == "sum" else 1] += float(m.group(3))
    return {k: (v[0], v[1]) for k, v in out.items()}


def histogram_means(before: dict, after: dict) -> dict[str, float]:
    """Mean (ms) of each histogram over the observations between two scrapes."""
    means = {}
    for name, (total, count) in after.items():
        total0, count0 = before.get(name, (0.0, 0.0))
        if count > count0:
            means[name.removesuffix("_seconds")] = round(
                1000 * (total - total0) / (count - count0), 1
            )
    return means


def read_trace(path: Path, skip: int) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh.readlines()[skip:]]


def decompose(trace: list[dict], requests: dict) -> list[dict]:
    """Per request of a serving.py run (its per-request columns), its TTFT's parts (ms), from
    the engine core's trace lines of that run. Requests are matched to the core's adds in
    order of arrival with equal prompt lengths (two requests sent within a millisecond can
    swap)."""
    arrival, first_start, token_ends, prompt_len = {}, {}, {}, {}
    adds = []
    for line in trace:
        if line["ev"] == "add":
            adds.append(line["rid"])
            arrival[line["rid"]] = line["arrival"]
            continue
        start = line["t"] - line["dur"]
        for rid, pos, num, drafts, prompt in line["reqs"]:
            if rid not in arrival:
                continue
            first_start.setdefault(rid, start)
            prompt_len[rid] = prompt
            if pos + num - drafts >= prompt:  # this step sampled the request's next token(s)
                token_ends.setdefault(rid, []).append(line["t"])
    order = sorted(range(len(requests["sent_at"])), key=lambda i: requests["sent_at"][i])
    used: set[int] = set()
    rows = []
    for rid in adds:
        if rid not in token_ends:
            continue
        i = next(
            (j for j in order if j not in used and requests["prompt_len"][j] == prompt_len[rid]),
            None,
        )
        if i is None:
            continue
        used.add(i)  # a failed request too: the next add of its length is another request
        if not requests["success"][i]:
            continue
        sent = requests["sent_at"][i]
        received = sent + requests["ttft_s"][i]
        ends = token_ends[rid]
        # the core step whose token the client's first text came with: the last one before it
        text_step = max((t for t in ends if t <= received), default=ends[0])
        rows.append(
            {
                "ttft": received - sent,
                "in": arrival[rid] - sent,
                "wait": first_start[rid] - arrival[rid],
                "prefill": ends[0] - first_start[rid],
                "extra": text_step - ends[0],
                "out": received - text_step,
                "text_token": 1 + sum(1 for t in ends if t < text_step),
                "prompt_len": prompt_len[rid],
            }
        )
    return [
        {k: round(v * 1000, 2) if isinstance(v, float) else v for k, v in r.items()} for r in rows
    ]


def summarize(rows: list[dict]) -> dict:
    out = {"requests": len(rows)}
    if not rows:
        return out
    for key in ("ttft", "in", "wait", "prefill", "extra", "out"):
        values = sorted(r[key] for r in rows)
        out[key] = {
            "p50": round(statistics.median(values), 1),
            "p90": round(values[int(0.9 * (len(values) - 1))], 1),
            "mean": round(statistics.fmean(values), 1),
        }
    out["first_text_at_token"] = {
        str(k): sum(1 for r in rows if r["text_token"] == k)
        for k in sorted({r["text_token"] for r in rows})
    }
    return out


# a frozen window longer than this risks Ray's own timeouts (a raylet gives a silent GCS a
# minute or so before it exits): --freeze refuses a rate whose sweep would take longer
FREEZE_MAX_S = 40.0


def own_freeze(system: str, args) -> str | None:
    """The `--freeze SYSTEM:REGEX` pattern of `system` (its full name), if any."""
    for spec in args.freeze:
        name, sep, pattern = spec.partition(":")
        if not (name and sep and pattern):
            raise SystemExit(f"--freeze {spec!r}: SYSTEM:REGEX")
        if name == system:
            return pattern
    return None


def check_freeze(args, rates: list[str]) -> None:
    """Before any server starts: --freeze's specs well formed, and every rate's sweep short
    enough to run with part of the server stopped."""
    for system in {s.partition(":")[0] for s in args.freeze}:
        own_freeze(system, args)
    if args.freeze:
        longest = max(args.num_prompts / float(rate) for rate in rates if rate != "inf")
        if longest > FREEZE_MAX_S:
            raise SystemExit(
                f"--freeze: a sweep of {args.num_prompts} prompts at the lowest rate takes "
                f"~{longest:.0f} s, over the {FREEZE_MAX_S:.0f} s Ray tolerates a stopped "
                "GCS; send fewer prompts"
            )


@contextlib.contextmanager
def frozen(pattern: str | None, table: dict, session: int):
    """The processes of the server's session (`session`: the server was started in a session
    of its own, and every process it starts shares it) whose command line matches `pattern`,
    stopped (SIGSTOP) for the block and resumed after, every one that was stopped even when
    stopping another failed: what the rest of the stack costs the served steps without them.
    Keep the block under a minute (FREEZE_MAX_S)."""
    stopped: list[int] = []
    try:
        for pid, (_, _, cmd) in table.items():
            if not pattern or pid == os.getpid() or not re.search(pattern, cmd):
                continue
            try:
                if os.getsid(pid) != session:
                    continue
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                continue  # gone since the snapshot
            stopped.append(pid)
        yield stopped
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="stepserve+haproxy,vllm-2cores")
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--request-rate", default="1,3")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--dataset", default="long-tail")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--warmup-prompts", type=int, default=16)
    p.add_argument("--settle-s", type=float, default=3.0)
    p.add_argument("--stepserve-args", default="")
    p.add_argument("--vllm-args", default="")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--vllm-kv-gib", type=int, default=2)
    p.add_argument("--port", type=int, default=8032)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH, as serving_vs_peer's")
    p.add_argument(
        "--env", action="append", default=[], help="SYSTEM:KEY=VALUE, as serving_vs_peer's"
    )
    p.add_argument(
        "--freeze",
        action="append",
        default=[],
        help="SYSTEM:REGEX: that system's server processes whose command line matches are "
        "stopped (SIGSTOP) while each rate is measured (e.g. Ray's and Serve's background ones)",
    )
    p.add_argument("--out", default="ttft_decompose")
    args = p.parse_args()
    model = resolve_model(args.model)
    base = f"http://127.0.0.1:{args.port}"
    rates = [r.strip() for r in args.request_rate.split(",") if r.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    check_freeze(args, rates)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for system in systems[r % len(systems) :] + systems[: r % len(systems)]:
                argv, env = server_command(system, args, model, args.port)
                trace = Path(tmp) / f"trace-{system}-{r}.jsonl"
                if system.startswith("stepserve"):
                    env[STEP_TRACE_ENV] = str(trace)
                log = Path(tmp) / f"{system}-{r}.log"
                print(f"== round {r + 1}/{args.rounds}: {system}", flush=True)
                procs: list = []
                pattern = own_freeze(system, args)
                with started_server(system, argv, env, args, log, procs):
                    for i, rate in enumerate(rates):
                        skip = len(trace.read_text().splitlines()) if trace.exists() else 0
                        result = Path(tmp) / f"{system}-{r}-{rate}.json"
                        bench = ["--dataset", args.dataset, "--num-prompts", str(args.num_prompts)]
                        bench += ["--seed", str(sweep_seed(0, i)), "--request-rate", rate]
                        bench += ["--save-detailed"]
                        histograms = scrape_histograms(base)
                        before = process_table(cmd_chars=None)
                        with frozen(pattern, before, procs[0].pid):
                            data = run_serving(base, system, bench, result)
                        split = cpu_split(before, process_table(cmd_chars=None))
                        time.sleep(2)  # stepserve's replicas push their metrics about once a second
                        server_means = histogram_means(histograms, scrape_histograms(base))
                        run = data["runs"][0]
                        entry = {
                            "system": system,
                            "round": r,
                            "request_rate": float(rate),
                            "duration_s": run["duration_s"],
                            "completed": run["completed"],
                            "output_tokens": run["total_output_tokens"],
                            "ttft_ms": run["ttft_ms"],
                            "tpot_ms": run["tpot_ms"],
                            "cpu_s": split,
                            "server_means_ms": server_means,
                        }
                        if trace.exists():
                            rows = decompose(read_trace(trace, skip), run["requests"])
                            entry["decomposition"] = summarize(rows)
                            entry["per_request"] = rows
                        runs.append(entry)
                        report(entry)
                time.sleep(3)
    out = {
        "benchmark": "ttft_decompose",
        "model": model.name,
        "dtype": args.dtype,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "rounds": args.rounds,
        "trees": args.tree,
        "env": args.env,
        "freeze": args.freeze,
        "host": machine_info(),
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.out}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


def report(entry: dict) -> None:
    ttft, tpot = entry["ttft_ms"], entry["tpot_ms"]
    print(
        f"-- {entry['system']} @ {entry['request_rate']:g} req/s: TTFT p50 {ttft['median']:.1f} "
        f"p90 {ttft['p90']:.1f}, TPOT p50 {tpot['median']:.1f} ms"
    )
    total = sum(entry["cpu_s"].values()) or 1.0
    print(
        "   CPU s: "
        + ", ".join(f"{k} {v:.1f} ({100 * v / total:.0f}%)" for k, v in entry["cpu_s"].items())
    )
    print(f"   the server's own means (ms): {entry['server_means_ms']}")
    d = entry.get("decomposition")
    if d:
        parts = ", ".join(
            f"{k} {d[k]['p50']:.1f}/{d[k]['p90']:.1f}"
            for k in ("in", "wait", "prefill", "extra", "out")
        )
        print(f"   TTFT parts p50/p90 ms ({d['requests']} requests): {parts}")
        print(f"   first text at token: {d['first_text_at_token']}")


if __name__ == "__main__":
    main()
