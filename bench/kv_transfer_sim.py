"""KV transfer in the cluster simulator (sim/): when load sends a request away from the replica
holding its prompt's prefix (a spill), the router's cost model (router/kv_transfer.py) may have
the new replica fetch those blocks instead of recomputing them. Compares, on the same workloads
and seeds:

  recompute   load_aware + KV-event routing, transfer off (the default before issue 49)
  transfer    the same with routing.kv_transfer on
  pd          prefill/decode disaggregation (config.pd, `--pd-share` of the replicas prefill),
              transfer on

on two workloads with spills: multi-turn chats (bench/sim_studies.py's, at `--load` times its
rate, where 8 replicas run at about 70%: spills once the chats' holders fill) and long prompts (few long shared documents, each request one of them plus a question:
the documents' holders get busy and requests spill), at 64 and 1000 replicas (1000: sampled
candidates, `--max-candidates`). Records TTFT p50/p99, TPOT p50, prefilled tokens, fetches and
fetched tokens, each the mean over seeds with its 95% confidence interval (t distribution).

The transfer model (SimSettings): a fetch of n blocks takes `--fetch-latency-ms` plus
n * kv_bytes_per_block / `--transfer-gbps`, one fetch at a time out of each holder (its egress
link is shared, first come first served); the replicas report the profile's prefill rate.

Run: .venv/bin/python bench/kv_transfer_sim.py [--quick]   (no Ray: the simulator only)
Writes bench/results/sim_kv_transfer.json (--quick: a smoke run that writes nothing).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.sim_studies import RESULTS, ci, config, summarize_runs, workload  # noqa: E402
from sim.cluster import SimSettings, Workload, simulate  # noqa: E402
from sim.profile import Profile  # noqa: E402
from sim.workloads import arrival_offsets, prefix_repetition_dataset  # noqa: E402

ENGINE = {"max_num_seqs": 32, "max_num_batched_tokens": 1024}
MODES = ("recompute", "transfer", "pd")
# long prompts: requests per replica per second (at --load-long 1)
LONG_PROMPT_RATE = 0.12


def long_prompts(replicas: int, seconds: float, seed: int, load: float) -> Workload:
    """Long shared documents (2048 tokens, one per 16 replicas: each is asked more than its
    holder can answer, so requests spill), each request one of them plus a 64-token question,
    32 tokens out."""
    rate = LONG_PROMPT_RATE * load * replicas
    rng = random.Random(seed)
    n = max(4, round(rate * seconds))
    specs = prefix_repetition_dataset(
        n, max(2, replicas // 16), 2048, 64, 32, rng, prefix_rng=random.Random(7)
    )
    return Workload(requests=list(zip(arrival_offsets(n, rate, 1.0, rng), specs)))


def the_workload(name: str, replicas: int, seconds: float, seed: int, load: float) -> Workload:
    if name == "long-prompt":
        return long_prompts(replicas, seconds, seed, load)
    from bench import sim_studies

    saved = dict(sim_studies.PER_REPLICA_RATE)
    sim_studies.PER_REPLICA_RATE[name] = saved[name] * load
    try:
        return workload(name, replicas, seconds, seed)
    finally:
        sim_studies.PER_REPLICA_RATE.update(saved)


def cluster(mode: str, replicas: int, candidates: int, pd_share: float):
    routing = {"kv_events": True, "kv_transfer": mode != "recompute"}
    if candidates:
        routing["max_candidates"] = candidates
    extra = {}
    if mode == "pd":
        prefill = max(1, round(replicas * pd_share))
        extra["pd"] = {"prefill_replicas": prefill, "decode_replicas": replicas - prefill}
    return config(replicas, routing, ENGINE, **extra)


def run_one(args, profile: Profile, mode: str, wl: str, replicas: int, seed: int) -> dict:
    seconds = args.seconds if replicas < 1000 else args.seconds_1000
    candidates = args.max_candidates if replicas >= 1000 else 0
    cfg = cluster(mode, replicas, candidates, args.pd_share)
    settings = SimSettings(
        seed=seed,
        kv_transfer_bytes_per_s=args.transfer_gbps * 1e9,
        kv_fetch_latency_s=args.fetch_latency_ms / 1e3,
    )
    t0 = time.perf_counter()
    load = args.load_long if wl == "long-prompt" else args.load
    s = simulate(cfg, profile, the_workload(wl, replicas, seconds, seed, load), settings)
    s = s.summary()
    s["wall_s"] = time.perf_counter() - t0
    return s


def line(label: str, agg: dict) -> str:
    def f(key, scale=1.0, digits=0):
        v = agg[key]
        if v["mean"] is None:
            return "-"
        half = f" ±{v['ci95'] * scale:.{digits}f}" if v["ci95"] is not None else ""
        return f"{v['mean'] * scale:.{digits}f}{half}"

    return (
        f"| {label} | {f('ttft_p50_s', 1e3)} | {f('ttft_p99_s', 1e3)} | {f('tpot_p50_s', 1e3, 1)} "
        f"| {f('prefilled_tokens', 1e-3, 0)} | {f('fetches')} | {f('fetched_tokens', 1e-3, 0)} |"
    )


def tables(data: dict) -> str:
    """The results of a run (its JSON) as markdown tables, one per workload and size."""
    out, last = [], None
    header = (
        "| mode | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | prefilled (k tokens) | "
        "fetches | fetched (k tokens) |\n|---|---|---|---|---|---|---|"
    )
    for key, agg in data["results"].items():
        wl, replicas, mode = key.split("/")
        if (wl, replicas) != last:
            out.append(f"\n{wl}, {replicas} replicas ({agg['requests']} requests)\n\n{header}")
            last = (wl, replicas)
        out.append(line(mode, agg))
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--profile", default="SmolLM2-135M-Instruct-avx2-1t")
    p.add_argument("--sizes", default="64,1000")
    p.add_argument("--workloads", default="multi-turn,long-prompt")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=90.0, help="arrival window (< 1000 replicas)")
    p.add_argument("--seconds-1000", type=float, default=20.0, help="arrival window at 1000")
    p.add_argument("--max-candidates", type=int, default=16, help="at 1000 replicas")
    p.add_argument(
        "--load", type=float, default=2.0, help="multi-turn: times sim_studies' per-replica rate"
    )
    p.add_argument("--load-long", type=float, default=1.0, help="long-prompt: times 0.12/s")
    p.add_argument("--transfer-gbps", type=float, default=1.0)
    p.add_argument("--fetch-latency-ms", type=float, default=5.0)
    p.add_argument("--pd-share", type=float, default=0.25, help="pd: share of prefill replicas")
    p.add_argument("--quick", action="store_true", help="2 seeds, short windows, 16 replicas")
    p.add_argument("--out", default="sim_kv_transfer")
    p.add_argument("--tables", metavar="JSON", help="print a results file's tables; run nothing")
    args = p.parse_args()
    if args.tables:
        print(tables(json.loads(Path(args.tables).read_text())))
        return
    if args.quick:
        args.seeds, args.seconds, args.sizes = 2, 30.0, "16"
    profile = Profile.load(args.profile)
    t0 = time.perf_counter()
    results: dict = {}
    header = (
        "| mode | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | prefilled (k tokens) | "
        "fetches | fetched (k tokens) |\n|---|---|---|---|---|---|---|"
    )
    for replicas in [int(x) for x in args.sizes.split(",")]:
        for wl in args.workloads.split(","):
            print(f"\n{wl}, {replicas} replicas\n{header}", flush=True)
            for mode in args.modes.split(","):
                runs = [run_one(args, profile, mode, wl, replicas, s) for s in range(args.seeds)]
                agg = summarize_runs(runs)
                agg["fetches"] = ci([s.get("fetches", 0) for s in runs])
                agg["fetched_tokens"] = ci([s.get("fetched_tokens", 0) for s in runs])
                agg["requests"] = runs[0]["requests"]
                agg["completed"] = ci([s["completed"] for s in runs])
                agg["decisions_by_reason"] = runs[0].get("decisions_by_reason")
                results[f"{wl}/{replicas}/{mode}"] = agg
                print(line(mode, agg), flush=True)
    data = {
        "args": vars(args),
        "engine": ENGINE,
        "results": results,
        "profile": profile.meta,
        "wall_s": time.perf_counter() - t0,
        "argv": sys.argv[1:],
    }
    if args.quick:
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote bench/results/{args.out}.json ({data['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
