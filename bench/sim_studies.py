"""Fleet-scale studies in the cluster simulator (sim/), each over several seeds with 95%
confidence intervals (t distribution), written to bench/results/sim_<study>.json and .png:

  routers      round_robin, pow2, load_aware, load_aware+prefix, load_aware+kv at 8, 64 and 1000
               replicas on the heterogeneous, prefix-repetition and multi-turn workloads:
               p50/p99 TTFT, throughput, prefix-cache hit rate (and hits against the oracle)
  autoscaling  a bursty day-shaped trace: SLO attainment against replica-hours for stepserve's
               queue-depth policy and Ray's default ongoing-requests policy, two targets each
  capacity     `stepserve plan` over request rates: the replicas a TTFT/TPOT SLO needs
  scale        1000 replicas and 100k requests: wall time and peak memory

The per-replica load of each workload is set so that 8 load_aware replicas run at about 70% of
what they can serve. All runs use one profile (default: the default model on one core).

Run: .venv/bin/python bench/sim_studies.py routers [--quick]   (no Ray: the simulator only)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.config import ClusterConfig  # noqa: E402
from sim.cluster import SimSettings, Workload, simulate  # noqa: E402
from sim.profile import Profile  # noqa: E402
from sim.workloads import (  # noqa: E402
    arrival_offsets,
    arrivals_from_rates,
    day_shaped_rates,
    heterogeneous_dataset,
    lazy_chat_like,
    multi_turn_conversations,
    prefix_repetition_dataset,
)

RESULTS = Path(__file__).resolve().parent / "results"
ROUTERS = ("round_robin", "pow2", "load_aware", "load_aware+prefix", "load_aware+kv")
T95 = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 8: 2.36, 10: 2.26}


def routing_of(router: str, max_candidates: int = 0) -> dict:
    policy, _, extra = router.partition("+")
    out = {"policy": policy, "prefix_affinity": extra == "prefix", "kv_events": extra == "kv"}
    if max_candidates and policy == "load_aware":
        out["max_candidates"] = max_candidates
    return out


def config(replicas: int, routing: dict, engine: dict, **extra) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {"replicas": replicas, "routing": routing, "engine": engine, **extra}
    )


def ci(values: list[float]) -> dict:
    """Mean and the half-width of its 95% confidence interval."""
    vals = [v for v in values if v == v]
    if not vals:
        return {"mean": None, "ci95": None, "n": 0}
    mean = statistics.fmean(vals)
    if len(vals) < 2:
        return {"mean": mean, "ci95": None, "n": len(vals)}
    half = T95.get(len(vals), 1.96) * statistics.stdev(vals) / math.sqrt(len(vals))
    return {"mean": mean, "ci95": half, "n": len(vals)}


# -- workloads ------------------------------------------------------------------------------------
# Per-replica rates (requests, or chats started, per second) putting 8 load_aware replicas of the
# default model on one core each at roughly 70% of their capacity (found with `stepserve plan`
# style sweeps in this simulator; see bench/README.md), on the fp32 AVX2 profile; `--rate-scale`
# multiplies them for a faster profile (the Q4_1 AVX-512 one: 2.5 for the same busy share,
# docs/simulator-studies.md).
PER_REPLICA_RATE = {"heterogeneous": 0.35, "prefix": 0.45, "multi-turn": 0.06}


def workload(name: str, replicas: int, seconds: float, seed: int, scale: float = 1.0) -> Workload:
    rate = PER_REPLICA_RATE[name] * replicas * scale
    rng = random.Random(seed)
    if name == "multi-turn":
        n = max(4, round(rate * seconds))
        convs = multi_turn_conversations(
            n, rate, rng, num_system_prompts=8, system_len=512, user_len=48, output_len=48,
            turns=(3, 8), think_s=5.0, system_rng=random.Random(7),
        )  # fmt: skip
        return Workload(conversations=convs)
    n = max(4, round(rate * seconds))
    if name == "heterogeneous":
        specs = heterogeneous_dataset(n, 0.1, (128, 32), (1024, 128), rng)
    else:
        specs = prefix_repetition_dataset(
            n, 4 * max(1, replicas // 4), 512, 64, 32, rng, prefix_rng=random.Random(7)
        )
    return Workload(requests=list(zip(arrival_offsets(n, rate, 1.0, rng), specs)))


def summarize_runs(summaries: list[dict]) -> dict:
    def pick(key, q=None):
        return [((s.get(key) or {}).get(q) if q else s.get(key)) or math.nan for s in summaries]

    out = {
        "ttft_p50_s": ci(pick("ttft_s", "p50")),
        "ttft_p99_s": ci(pick("ttft_s", "p99")),
        "tpot_p50_s": ci(pick("tpot_s", "p50")),
        "throughput_tok_s": ci(pick("output_tokens_per_s")),
        "hit_rate": ci(pick("hit_rate")),
        "prefilled_tokens": ci(pick("prefilled_tokens")),
        "preemptions": ci(pick("preemptions")),
        "wall_s": ci(pick("wall_s")),
    }
    if all("oracle_hit_tokens" in s for s in summaries):
        out["hits_vs_oracle"] = ci([s["hit_tokens"] / s["oracle_hit_tokens"] for s in summaries])
    return out


# -- study 1: routers -------------------------------------------------------------------------------
def study_routers(args, profile: Profile) -> dict:
    engine = {"max_num_seqs": 32, "max_num_batched_tokens": 1024}
    sizes = [int(x) for x in args.sizes.split(",")]
    out: dict = {"sizes": sizes, "seeds": args.seeds, "engine": engine, "results": {}}
    for n in sizes:
        seconds = args.seconds if n < 1000 else args.seconds_1000
        for wl in args.workloads.split(","):
            for router in args.routers.split(","):
                cand = args.max_candidates if n >= args.candidates_from else 0
                runs = []
                for seed in range(args.seeds):
                    cfg = config(n, routing_of(router, cand), engine)
                    t0 = time.perf_counter()
                    result = simulate(
                        cfg, profile, workload(wl, n, seconds, seed, args.rate_scale),
                        SimSettings(seed=seed),
                        oracle=wl == "multi-turn",
                    )  # fmt: skip
                    s = result.summary()
                    s["wall_s"] = time.perf_counter() - t0
                    runs.append(s)
                agg = summarize_runs(runs)
                agg["max_candidates"] = cand
                agg["requests"] = runs[0]["requests"]
                out["results"].setdefault(str(n), {}).setdefault(wl, {})[router] = agg
                print(line(n, wl, router, agg), flush=True)
    return out


def line(n, wl, router, agg) -> str:
    def f(key, scale=1.0, fmt="{:8.1f}"):
        v = agg[key]
        if v["mean"] is None:
            return " " * 8
        s = fmt.format(v["mean"] * scale)
        return s + (f" +-{v['ci95'] * scale:.1f}" if v["ci95"] is not None else "")

    oracle = agg.get("hits_vs_oracle")
    extra = f" hits/oracle {oracle['mean']:.3f}" if oracle else ""
    return (
        f"{n:5d} {wl:13s} {router:18s} TTFT p50 {f('ttft_p50_s', 1e3)} ms  p99 "
        f"{f('ttft_p99_s', 1e3)} ms  tput {f('throughput_tok_s')} tok/s  hit "
        f"{agg['hit_rate']['mean'] or 0:.3f}{extra}  ({agg['requests']} req, "
        f"{agg['wall_s']['mean']:.1f} s wall)"
    )


# -- study 2: autoscaling ---------------------------------------------------------------------------
def study_autoscaling(args, profile: Profile) -> dict:
    engine = {"max_num_seqs": 32, "max_num_batched_tokens": 1024}
    slo = (args.slo_ttft_s, args.slo_tpot_s)
    policies = [
        ("stepserve target_queue_depth=4", "stepserve", {"target_queue_depth": 4}),
        ("stepserve target_queue_depth=8", "stepserve", {"target_queue_depth": 8}),
        ("ray_default target_ongoing=2", "ray_default", {}),
        ("ray_default target_ongoing=4", "ray_default", {}),
    ]
    out: dict = {"seeds": args.seeds, "slo": {"ttft_s": slo[0], "tpot_s": slo[1]}, "results": {}}
    for label, kind, fields in policies:
        runs, timelines = [], []
        for seed in range(args.seeds):
            rng = random.Random(seed)
            rates = day_shaped_rates(args.day_s, args.peak_rate, rng=rng)
            times = arrivals_from_rates(rates, rng)
            specs = lazy_chat_like(len(times), 128, 32, 1024, 256, seed)
            scaling = {
                "enabled": True, "min_replicas": 1, "max_replicas": args.max_replicas,
                "upscale_delay_s": 10, "downscale_delay_s": 120, "look_back_period_s": 10,
                **fields,
            }  # fmt: skip
            cfg = config(1, routing_of("load_aware"), engine, autoscaling=scaling)
            target = 4.0 if "=4" in label else 2.0
            settings = SimSettings(
                seed=seed, cold_start_s=args.cold_start_s, autoscaler=kind,
                ray_target_ongoing_requests=target, timeline_period_s=10.0,
            )  # fmt: skip
            t0 = time.perf_counter()
            result = simulate(cfg, profile, Workload(requests=list(zip(times, specs))), settings)
            s = result.summary(*slo)
            s["wall_s"] = time.perf_counter() - t0
            runs.append(s)
            timelines.append(result.replica_count)
        agg = {
            "slo_attainment": ci([s["slo_attainment"] for s in runs]),
            "replica_hours": ci([s["replica_seconds"] / 3600 for s in runs]),
            "ttft_p99_s": ci([s["ttft_s"]["p99"] for s in runs]),
            "requests": runs[0]["requests"],
            "replica_count_seed0": timelines[0],
        }
        out["results"][label] = agg
        print(
            f"{label:32s} SLO attainment {agg['slo_attainment']['mean']:.3f} "
            f"+-{agg['slo_attainment']['ci95'] or 0:.3f}, replica-hours "
            f"{agg['replica_hours']['mean']:.2f} +-{agg['replica_hours']['ci95'] or 0:.2f}, "
            f"TTFT p99 {agg['ttft_p99_s']['mean']:.2f} s",
            flush=True,
        )
    return out


# -- study 3: capacity ------------------------------------------------------------------------------
def study_capacity(args, profile_name: str) -> dict:
    out: dict = {"slo": {"ttft_ms": 2000, "tpot_ms": 300}, "results": {}}
    for rate in [float(x) for x in args.plan_rates.split(",")]:
        cmd = [
            sys.executable, "-m", "cluster.cli", "plan", "--profile", profile_name,
            "--workload", "random", "--rate", str(rate), "--num-requests",
            str(int(rate * 120)), "--input-len", "128", "--output-len", "32",
            "--slo-ttft-ms", "2000", "--slo-tpot-ms", "300", "--max-replicas", "1024",
        ]  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent.parent)
        wall = time.perf_counter() - t0
        last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr
        replicas = int(last.split()[2]) if "replicas meet" in last else None
        out["results"][str(rate)] = {
            "replicas": replicas,
            "wall_s": wall,
            "command": " ".join(cmd[2:]),
        }
        print(f"rate {rate:6.1f} req/s -> {replicas} replicas ({wall:.0f} s): {last}", flush=True)
    return out


# -- study 4: scale ---------------------------------------------------------------------------------
def study_scale(args, profile: Profile) -> dict:
    n_rep, n_req = args.scale_replicas, args.scale_requests
    engine = {"max_num_seqs": 32, "max_num_batched_tokens": 1024}
    out: dict = {"replicas": n_rep, "requests": n_req, "results": {}}
    for router, cand in (("pow2", 0), ("load_aware", args.max_candidates)):
        rate = 0.3 * n_rep
        rng = random.Random(0)
        times = arrival_offsets(n_req, rate, 1.0, rng)
        specs = lazy_chat_like(n_req, 128, 32, 1024, 256, 0)
        cfg = config(n_rep, routing_of(router, cand), engine)
        t0 = time.perf_counter()
        result = simulate(cfg, profile, Workload(requests=list(zip(times, specs))))
        wall = time.perf_counter() - t0
        s = result.summary()
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out["results"][router] = {
            "max_candidates": cand, "wall_s": wall, "peak_rss_mb": rss_mb,
            "completed": s["completed"], "simulated_s": s["duration_s"],
            "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"],
            "steps": sum(r["steps"] for r in result.replicas),
        }  # fmt: skip
        print(
            f"{router} (max_candidates {cand}): {n_rep} replicas, {s['completed']}/{n_req} "
            f"requests, {s['duration_s']:.0f} simulated s in {wall:.0f} s wall, peak RSS "
            f"{rss_mb:.0f} MB, {out['results'][router]['steps']} replica steps",
            flush=True,
        )
    return out


# -- plots ------------------------------------------------------------------------------------------
def plot(study: str, data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if study == "routers":
        sizes = list(data["results"])
        wls = list(next(iter(data["results"].values())))
        fig, axes = plt.subplots(len(wls), 2, figsize=(12, 3.2 * len(wls)), squeeze=False)
        for i, wl in enumerate(wls):
            for j, key in enumerate(("ttft_p50_s", "ttft_p99_s")):
                ax = axes[i][j]
                routers = list(data["results"][sizes[0]][wl])
                width = 0.8 / len(routers)
                for k, router in enumerate(routers):
                    means = [data["results"][n][wl][router][key]["mean"] or 0 for n in sizes]
                    errs = [data["results"][n][wl][router][key]["ci95"] or 0 for n in sizes]
                    xs = [x + k * width for x in range(len(sizes))]
                    ax.bar(xs, means, width, yerr=errs, label=router, capsize=2)
                ax.set_xticks([x + 0.4 - width / 2 for x in range(len(sizes))], sizes)
                ax.set_xlabel("replicas")
                ax.set_ylabel(f"{key[:-2].replace('_', ' ')} (s)")
                ax.set_yscale("log")
                ax.set_title(wl)
        axes[0][0].legend(fontsize=7)
    elif study == "autoscaling":
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        for label, r in data["results"].items():
            axes[0].errorbar(
                r["replica_hours"]["mean"], r["slo_attainment"]["mean"],
                xerr=r["replica_hours"]["ci95"], yerr=r["slo_attainment"]["ci95"],
                fmt="o", label=label, capsize=3,
            )  # fmt: skip
            t = [x[0] / 60 for x in r["replica_count_seed0"]]
            axes[1].step(t, [x[1] for x in r["replica_count_seed0"]], where="post", label=label)
        axes[0].set_xlabel("replica-hours")
        axes[0].set_ylabel("SLO attainment")
        axes[0].legend(fontsize=7)
        axes[1].set_xlabel("minutes")
        axes[1].set_ylabel("serving replicas (seed 0)")
    else:
        return
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("study", choices=["routers", "autoscaling", "capacity", "scale"])
    p.add_argument("--profile", default="SmolLM2-135M-Instruct-avx2-1t")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--sizes", default="8,64,1000")
    p.add_argument("--workloads", default="heterogeneous,prefix,multi-turn")
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--seconds", type=float, default=300.0, help="arrival window (< 1000 replicas)")
    p.add_argument("--seconds-1000", type=float, default=60.0, help="arrival window at 1000")
    p.add_argument(
        "--rate-scale", type=float, default=1.0,
        help="routers: multiply the workloads' per-replica rates (a faster profile's load)",
    )  # fmt: skip
    p.add_argument("--max-candidates", type=int, default=16)
    p.add_argument("--candidates-from", type=int, default=1000, help="replicas from which "
                   "load_aware ranks --max-candidates sampled replicas instead of all")  # fmt: skip
    p.add_argument("--day-s", type=float, default=7200.0)
    p.add_argument("--peak-rate", type=float, default=12.0)
    p.add_argument("--max-replicas", type=int, default=64)
    p.add_argument("--cold-start-s", type=float, default=30.0)
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--slo-tpot-s", type=float, default=0.3)
    p.add_argument("--plan-rates", default="2,8,32,128")
    p.add_argument("--scale-replicas", type=int, default=1000)
    p.add_argument("--scale-requests", type=int, default=100_000)
    p.add_argument("--quick", action="store_true", help="2 seeds, short windows (smoke run)")
    p.add_argument("--out", help="result name (default sim_<study>)")
    args = p.parse_args()
    if args.quick:
        args.seeds, args.seconds, args.seconds_1000, args.day_s = 2, 60.0, 10.0, 1200.0
        args.scale_requests = min(args.scale_requests, 5000)
    profile = Profile.load(args.profile)
    t0 = time.perf_counter()
    if args.study == "routers":
        data = study_routers(args, profile)
    elif args.study == "autoscaling":
        data = study_autoscaling(args, profile)
    elif args.study == "capacity":
        data = study_capacity(args, args.profile)
    else:
        data = study_scale(args, profile)
    data["profile"] = profile.meta
    data["wall_s"] = time.perf_counter() - t0
    data["argv"] = sys.argv[1:]
    RESULTS.mkdir(exist_ok=True)
    name = args.out or f"sim_{args.study}"
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    plot(args.study, data, RESULTS / f"{name}.png")
    print(f"wrote bench/results/{name}.json ({data['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
