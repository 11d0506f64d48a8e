"""Simulator fidelity: the same trace (arrival times, prompt and output lengths, token ids)
through a real 2-replica stepserve cluster (embedded Ray, HTTP, streaming) and through the
simulator with a profile measured on this machine (`stepserve profile --threads 1`: each of the
two replicas gets one of the two cores). Per (model, load): p50/p90/p99 of TTFT, TPOT and e2e
latency, and output throughput, real vs simulated, with the relative error of each. Plus one
autoscaling run (1 -> 3 -> 1 replicas under a load ramp) with the replica-count timelines of both.

What the profile cannot know is measured first on the same cluster, with requests that are not
the trace's (sim/calibrate.py): the serving overhead per step and per streamed token (closed-loop
streams at four concurrencies) and the one-way path latency (idle single requests). The
simulator runs twice per load: with that calibration, and with Engine.step alone (the profile
as measured), so the calibration's share of the fidelity is visible. Nothing is fitted to the
trace.

Run: flock /tmp/stepserve-ray.lock .venv/bin/python bench/sim_fidelity_calibrated.py [--models tiny,default]
(The held-out fidelity report, trace files replayed on `stepserve serve`: bench/sim_fidelity.py.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._cluster import LocalCluster  # noqa: E402
from bench._models import model_dir as resolve_model  # noqa: E402
from bench.serving import LoadConfig, RequestSpec, run_load  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from sim.calibrate import measure_serving  # noqa: E402
from sim.cluster import SimSettings, Workload, percentiles, simulate  # noqa: E402
from sim.profile import Profile  # noqa: E402
from sim.workloads import arrival_offsets, chat_like_dataset  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
METRICS = ("ttft", "tpot", "e2e")

# Per model: the trace's lengths (median prompt, median output, caps) and the two loads
# (requests per second): light, and near saturation of two replicas on two cores.
SHAPES = {
    "tiny": dict(
        in_median=200,
        out_median=60,
        in_max=1500,
        out_max=300,
        rates=(4.0, 12.0),
        n=300,
        calib_s=12.0,
    ),
    "default": dict(
        in_median=120,
        out_median=32,
        in_max=600,
        out_max=128,
        rates=(0.3, 1.0),
        n=100,
        calib_s=30.0,
    ),
}


def engine_fields(model: Path, args) -> dict:
    return dict(
        model=str(model),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=2048,
    )


def cluster_config(model: Path, args, **extra) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {"engine": engine_fields(model, args), "replicas": 2, **extra}
    )


def trace(name: str, rate: float, n: int, seed: int) -> list[tuple[float, RequestSpec]]:
    shape = SHAPES[name]
    rng = random.Random(seed)
    specs = chat_like_dataset(
        n, shape["in_median"], shape["out_median"], shape["in_max"], shape["out_max"], rng
    )
    return list(zip(arrival_offsets(n, rate, 1.0, rng), specs))


def real_metrics(results, offsets) -> dict:
    ok = [(r, t) for r, t in zip(results, offsets) if r.success]
    rows = [
        {
            "ttft": r.ttft,
            "tpot": r.tpot if r.tpot is not None else math.nan,
            "e2e": r.e2e,
            "out": r.output_len,
            "start": t,
            "end": t + r.e2e,
        }
        for r, t in ok
    ]
    return metrics(rows, failed=len(results) - len(ok))


def sim_metrics(result) -> dict:
    rows = [
        {
            "ttft": r["ttft_s"],
            "tpot": r["tpot_s"],
            "e2e": r["e2e_s"],
            "out": r["output_tokens"],
            "start": r["arrival_s"],
            "end": r["arrival_s"] + r["e2e_s"],
        }
        for r in result.requests
        if r["status"] == "ok"
    ]
    return metrics(rows, failed=sum(r["status"] != "ok" for r in result.requests))


def metrics(rows: list[dict], failed: int) -> dict:
    out: dict = {"completed": len(rows), "failed": failed}
    for m in METRICS:
        vals = sorted(r[m] for r in rows if r[m] == r[m])
        out[m] = {k: v for k, v in percentiles(vals).items() if k != "mean"}
    span = max(r["end"] for r in rows) - min(r["start"] for r in rows)
    out["throughput"] = sum(r["out"] for r in rows) / span
    return out


def errors(real: dict, sim: dict) -> dict:
    out = {}
    for m in METRICS:
        for q in ("p50", "p90", "p99"):
            out[f"{m}_{q}"] = sim[m][q] / real[m][q] - 1.0
    out["throughput"] = sim["throughput"] / real["throughput"] - 1.0
    return out


def warm(base: str, model: str | None) -> None:
    specs = [
        RequestSpec([random.Random(i).randrange(10, 500) for _ in range(64)], 8) for i in range(8)
    ]
    asyncio.run(run_load(LoadConfig(base_url=base, model=model, request_rate=4.0), specs))


def run_model(cluster: LocalCluster, name: str, args) -> dict:
    model = resolve_model(name)
    profile = Profile.load(args.profile_tiny if name == "tiny" else args.profile_default)
    config = cluster_config(model, args)
    app = f"fid-{name}"
    base = cluster.deploy(config, app)
    warm(base, None)
    calibration = measure_serving(base, profile, 2, seconds=SHAPES[name]["calib_s"])
    latency = calibration["path_latency_s"]
    extra = ", ".join(
        f"{b}: {x * 1e3:.1f}"
        for b, x in zip(calibration["batches"], calibration["extra_s"], strict=True)
    )
    print(
        f"[{name}] serving overhead per step (ms) by tokens streamed: {extra}; path latency "
        f"(one way) {latency * 1e3:.2f} ms",
        flush=True,
    )
    out = {"profile": profile.meta, "calibration": calibration, "loads": {}}
    for label, rate in zip(("light", "near_saturation"), SHAPES[name]["rates"]):
        items = trace(name, rate, args.num_requests or SHAPES[name]["n"], args.seed)
        offsets = [t for t, _ in items]
        specs = [s for _, s in items]
        results, _ = asyncio.run(run_load(LoadConfig(base_url=base), specs, offsets))
        real = real_metrics(results, offsets)
        runs = {}
        for kind, serving in (("calibrated", calibration), ("engine_step_only", {})):
            settings = SimSettings(net_latency_s=latency, seed=args.seed, serving=serving)
            sim = sim_metrics(simulate(config, profile, Workload(requests=items), settings))
            runs[kind] = {"sim": sim, "error": errors(real, sim)}
            print_load(name, f"{label}, {kind}", rate, real, sim, runs[kind]["error"])
        out["loads"][label] = {"rate": rate, "real": real, **runs}
        time.sleep(3.0)
    from ray import serve

    serve.delete(app)
    return out


def print_load(name, label, rate, real, sim, err) -> None:
    print(
        f"\n[{name}] {label} ({rate} req/s): real {real['completed']} ok / {real['failed']} failed"
    )
    print(f"  {'metric':12s} {'real ms':>10s} {'sim ms':>10s} {'error':>8s}")
    for m in METRICS:
        for q in ("p50", "p90", "p99"):
            print(
                f"  {m + ' ' + q:12s} {real[m][q] * 1e3:10.1f} {sim[m][q] * 1e3:10.1f} "
                f"{err[f'{m}_{q}']:+8.1%}"
            )
    print(
        f"  {'throughput':12s} {real['throughput']:10.1f} {sim['throughput']:10.1f} "
        f"{err['throughput']:+8.1%}  (output tok/s)",
        flush=True,
    )


# -- autoscaling: 1 -> 3 -> 1 -------------------------------------------------------------------
def ramp(rate_low: float, rate_high: float, seconds: tuple[float, float, float], seed: int):
    """Arrival times: low for seconds[0], high for seconds[1], low for seconds[2]."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for rate, length in zip((rate_low, rate_high, rate_low), seconds):
        end = t + length
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                t = end
                break
            out.append(t)
    return out


def run_autoscaling(cluster: LocalCluster, args, calibration: dict | None) -> dict:
    from ray import serve

    name = "tiny"
    model = resolve_model(name)
    profile = Profile.load(args.profile_tiny)
    scaling = dict(
        enabled=True, min_replicas=1, max_replicas=3, target_queue_depth=4.0,
        upscale_delay_s=3.0, downscale_delay_s=15.0, metrics_interval_s=1.0,
        look_back_period_s=5.0,
    )  # fmt: skip
    config = ClusterConfig.model_validate(
        {"engine": engine_fields(model, args), "autoscaling": scaling}
    )
    app = "fid-autoscale"
    t0 = time.perf_counter()
    base = cluster.deploy(config, app)
    cold_start = time.perf_counter() - t0
    warm(base, None)
    times = ramp(2.0, 12.0, (20.0, 40.0, 60.0), args.seed)
    rng = random.Random(args.seed + 1)
    shape = SHAPES[name]
    specs = chat_like_dataset(
        len(times), shape["in_median"], shape["out_median"], shape["in_max"], shape["out_max"], rng
    )
    counts: list[tuple[float, int]] = []
    stop = threading.Event()

    def poll() -> None:
        start = time.perf_counter()
        while not stop.is_set():
            status = serve.status().applications[app].deployments["LLMServer"]
            running = status.replica_states.get("RUNNING", 0)
            counts.append((round(time.perf_counter() - start, 2), running))
            time.sleep(1.0)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    results, _ = asyncio.run(run_load(LoadConfig(base_url=base), specs, times))
    time.sleep(30.0)  # the scale-down
    stop.set()
    poller.join()
    serve.delete(app)
    settings = SimSettings(
        net_latency_s=calibration["path_latency_s"] if calibration else 0.002,
        cold_start_s=cold_start,
        seed=args.seed,
        timeline_period_s=1.0,
        serving=calibration or {},
    )
    items = list(zip(times, specs))
    result = simulate(config, profile, Workload(requests=items), settings)
    sim_counts = [(t, running) for t, running, _ in result.replica_count]
    real = real_metrics(results, times)
    sim = sim_metrics(result)
    out = {
        "cold_start_s": cold_start,
        "real_replicas": counts,
        "sim_replicas": sim_counts,
        "real": real,
        "sim": sim,
        "error": errors(real, sim),
        "real_peak": max(c for _, c in counts),
        "sim_peak": max(c for _, c in sim_counts),
        "real_first_3_s": next((t for t, c in counts if c >= 3), None),
        "sim_first_3_s": next((t for t, c in sim_counts if c >= 3), None),
    }
    print(
        f"\n[autoscaling] peak replicas real {out['real_peak']} sim {out['sim_peak']}; "
        f"3 replicas first at real {out['real_first_3_s']} s, sim {out['sim_first_3_s']} s",
        flush=True,
    )
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = [(m, lbl, d) for m, r in results["models"].items() for lbl, d in r["loads"].items()]
    fig, axes = plt.subplots(
        1, len(loads) + ("autoscaling" in results), figsize=(5 * (len(loads) + 1), 4)
    )
    axes = list(axes) if hasattr(axes, "__len__") else [axes]
    for ax, (m, lbl, d) in zip(axes, loads):
        keys = [f"{x}_{q}" for x in METRICS for q in ("p50", "p90", "p99")] + ["throughput"]
        ax.bar(range(len(keys)), [d["calibrated"]["error"][k] * 100 for k in keys])
        ax.axhline(15, color="r", ls="--", lw=0.8)
        ax.axhline(-15, color="r", ls="--", lw=0.8)
        ax.set_xticks(range(len(keys)), keys, rotation=70, fontsize=7)
        ax.set_ylabel("sim / real - 1 (%)")
        ax.set_title(f"{m}, {lbl}")
    if "autoscaling" in results:
        a = results["autoscaling"]
        ax = axes[-1]
        ax.step(*zip(*a["real_replicas"]), where="post", label="real")
        ax.step(*zip(*a["sim_replicas"]), where="post", label="simulated")
        ax.set_xlabel("s")
        ax.set_ylabel("running replicas")
        ax.set_title("autoscaling 1 -> 3 -> 1")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="tiny,default")
    p.add_argument("--profile-tiny", default="bench-tiny-llama-v1-avx2-1t")
    p.add_argument("--profile-default", default="SmolLM2-135M-Instruct-avx2-1t")
    p.add_argument("--num-requests", type=int, help="per load (default: per model)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-autoscaling", action="store_true")
    p.add_argument("--out", default="sim_fidelity")
    args = p.parse_args()
    cluster = LocalCluster(num_cpus=2)
    results: dict = {"models": {}}
    try:
        for name in args.models.split(","):
            results["models"][name] = run_model(cluster, name, args)
        if not args.no_autoscaling:
            tiny = results["models"].get("tiny", {}).get("calibration")
            results["autoscaling"] = run_autoscaling(cluster, args, tiny)
    finally:
        cluster.shutdown()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{args.out}.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, RESULTS / f"{args.out}.png")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
