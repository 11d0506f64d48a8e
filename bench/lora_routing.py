"""Routing with LoRA adapters, in the cluster simulator (sim/): a fleet whose requests each run
with one of many adapters, Zipf-popular, more adapters than a replica holds (max_cpu_loras), so
that where a request lands decides whether its replica must load its adapter first. Compares
the adapter-aware load_aware score (routing.weight_lora_load, over a sweep of weights) with the
same router without the term (weight 0) and with pow2 and round_robin: adapter loads per
request, the share of requests that waited for a load, TTFT p50/p99 and throughput, each the
mean over seeds with its 95% confidence interval (t distribution), as bench/sim_studies.py.

The requests are bench/sim_studies.py's heterogeneous workload at the same per-replica rate
(8 load_aware replicas at about 70% of what they can serve), each given an adapter.

Run: .venv/bin/python bench/lora_routing.py [--quick]   (no Ray: the simulator only)
Writes bench/results/sim_lora_routing.json (--quick: a smoke run that writes nothing).
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
from sim.cluster import SimSettings, simulate  # noqa: E402
from sim.profile import Profile  # noqa: E402
from sim.workloads import assign_adapters  # noqa: E402

ENGINE = {"max_num_seqs": 32, "max_num_batched_tokens": 1024, "enable_lora": True}


def routers(weights: list[float]) -> list[tuple[str, dict]]:
    """(label, RoutingConfig fields): the baselines, then load_aware per adapter weight."""
    out = [
        ("round_robin", {"policy": "round_robin"}),
        ("pow2", {"policy": "pow2"}),
        ("load_aware (no adapter term)", {"policy": "load_aware", "weight_lora_load": 0.0}),
    ]
    for w in weights:
        out.append((f"load_aware weight_lora_load={w:g}", {"weight_lora_load": w}))
    return out


def run_one(args, profile: Profile, routing: dict, seed: int) -> dict:
    engine = ENGINE | {"max_loras": args.max_loras, "max_cpu_loras": args.max_cpu_loras}
    cfg = config(args.replicas, {"kv_events": False} | routing, engine)
    wl = workload("heterogeneous", args.replicas, args.seconds, seed)
    specs = [spec for _, spec in wl.requests]
    assign_adapters(specs, args.adapters, args.skew, random.Random(seed * 7919 + 1))
    settings = SimSettings(seed=seed, lora_load_s=args.lora_load_ms / 1000.0)
    t0 = time.perf_counter()
    s = simulate(cfg, profile, wl, settings).summary()
    s["wall_s"] = time.perf_counter() - t0
    return s


def line(label: str, agg: dict) -> str:
    def f(key, scale=1.0, digits=1):
        v = agg[key]
        half = f" ±{v['ci95'] * scale:.{digits}f}" if v["ci95"] is not None else ""
        return f"{v['mean'] * scale:.{digits}f}{half}"

    return (
        f"| {label} | {f('lora_loads_per_request', 1, 3)} | {f('lora_waited', 100, 1)} | "
        f"{f('ttft_p50_s', 1e3)} | {f('ttft_p99_s', 1e3)} | {f('throughput_tok_s')} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--profile", default="SmolLM2-135M-Instruct-avx2-1t")
    p.add_argument("--replicas", type=int, default=64)
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--skew", type=float, default=1.0, help="the adapters' Zipf exponent")
    p.add_argument("--max-cpu-loras", type=int, default=8)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--lora-load-ms", type=float, default=20.0)
    p.add_argument("--weights", default="0.5,1,2,4,8", help="weight_lora_load values")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=60.0, help="arrival window")
    p.add_argument("--quick", action="store_true", help="2 seeds, 20 s (smoke run)")
    p.add_argument("--out", default="sim_lora_routing")
    args = p.parse_args()
    if args.quick:
        args.seeds, args.seconds = 2, 20.0
    profile = Profile.load(args.profile)
    weights = [float(w) for w in args.weights.split(",") if w]
    t0 = time.perf_counter()
    results = {}
    print(
        "| router | adapter loads / request | waited for a load (%) | TTFT p50 (ms) | "
        "TTFT p99 (ms) | throughput (tok/s) |\n|---|---|---|---|---|---|",
        flush=True,
    )
    for label, routing in routers(weights):
        runs = [run_one(args, profile, routing, seed) for seed in range(args.seeds)]
        agg = summarize_runs(runs)
        agg["lora_loads_per_request"] = ci([s["lora_loads_per_request"] for s in runs])
        agg["lora_waited"] = ci([s["lora_waited"] for s in runs])
        agg["requests"] = runs[0]["requests"]
        agg["routing"] = routing
        results[label] = agg
        print(line(label, agg), flush=True)
    data = {
        "replicas": args.replicas,
        "adapters": args.adapters,
        "skew": args.skew,
        "max_cpu_loras": args.max_cpu_loras,
        "max_loras": args.max_loras,
        "lora_load_ms": args.lora_load_ms,
        "seeds": args.seeds,
        "seconds": args.seconds,
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
