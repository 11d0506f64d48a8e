"""KV transfer on a real local cluster: the same N replicas (default 4) of a model, small batches
and KV caches so that load spills requests off the replica holding their prefix, as three
applications side by side that differ only in how a spilled prefix is handled:

  recompute   load_aware + KV-event routing, routing.kv_transfer off: the new replica
              recomputes the prefix (the behaviour before issue 49)
  transfer    the same with routing.kv_transfer on: the router's cost model has the new replica
              fetch the prefix from its holder when that beats recomputing (router/kv_transfer.py)
  pd          prefill/decode disaggregation (pd: --pd PREFILL:DECODE of the N replicas),
              transfer on: prompts run on prefill replicas, decode replicas continue them with
              the prompt's KV fetched from there

Workloads (bench/routing.py's runner, windows interleaved across the applications so the
host's noise lands on each alike): multi-turn chats, and long prompts (a few long shared
documents plus a question each: bench/routing.py's prefix-repetition phase with long
prefixes). Reports TTFT p50/p99, throughput, prefilled tokens (prefix-cache queries minus hits,
per replica) and the routers' decisions by reason (fetches), per application. Needs replicas
that honour EngineRequest.kv_fetch (the replica side of issue 49).

Migration resume time with and without transfer is not measured here yet (a drain of one
replica mid-stream; see docs/pd.md).

Run: flock /tmp/stepserve-ray.lock .venv/bin/python bench/kv_transfer.py [--quick]
     .venv/bin/python bench/kv_transfer.py --dry-run   (the three configs, no Ray)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.config import ClusterConfig, PDConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("recompute", "transfer", "pd")


def variant_config(variant: str, model, args: argparse.Namespace) -> ClusterConfig:
    """The application of `variant` (VARIANTS): bench/routing.py's load_aware+kv config with
    routing.kv_transfer, and with pd for "pd"."""
    from bench.routing import router_config

    transfer = "false" if variant == "recompute" else "true"
    base = router_config(f"load_aware+kv/kv_transfer={transfer}", model, args)
    if variant != "pd":
        return base
    pd = PDConfig.parse(args.pd)
    if pd.prefill_replicas + pd.decode_replicas != args.replicas:
        raise ValueError(
            f"--pd {args.pd}: the two counts must add up to --replicas {args.replicas}"
        )
    return ClusterConfig.model_validate(base.model_dump() | {"pd": pd.model_dump()})


def replica_ids(app: str, config: ClusterConfig) -> list[str]:
    """The LLM replicas of `app`, of both deployments with pd."""
    from ray import serve

    names = {"LLMServer": config.replicas}
    if config.pd is not None:
        names = {"LLMServer": config.pd.decode_replicas,
                 "LLMServer-prefill": config.pd.prefill_replicas}  # fmt: skip
    seen: set[str] = set()
    for name, expected in names.items():
        handle = serve.get_deployment_handle(name, app_name=app)
        found: set[str] = set()
        for _ in range(50):
            found |= {handle.stats.remote().result(timeout_s=60)["replica_id"] for _ in range(8)}
            if len(found) >= expected:
                break
        seen |= found
    return sorted(seen)


def decisions(url: str) -> dict[str, float]:
    """The ingress's routing decisions by reason (stepserve:router_decisions_total)."""
    import httpx

    out: dict[str, float] = {}
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except Exception:
        return out
    for line in text.splitlines():
        if line.startswith("stepserve:router_decisions_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny, default, or a local HF model dir")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {','.join(VARIANTS)}")
    p.add_argument("--workloads", default="multi-turn,prefix-repetition")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--pd", default="1:3", help="pd: PREFILL:DECODE replicas (sum: --replicas)")
    p.add_argument("--seconds", type=float, default=12.0, help="arrival window per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chat-rate", type=float, default=1.5, help="multi-turn: chats started/s")
    p.add_argument("--num-system-prompts", type=int, default=4)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--think-s", type=float, default=1.0)
    p.add_argument("--prefix-rate", type=float, default=4.0, help="long prompts: requests/s")
    p.add_argument("--num-prefixes", type=int, default=3)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--num-cpus-per-replica", type=float, default=0.1)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--num-kv-blocks", type=int, default=200)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--long-fraction", type=float, default=0.1)
    p.add_argument("--rates", default="6")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="kv_transfer")
    p.add_argument("--quick", action="store_true", help="1 round of 5 s windows, no files")
    p.add_argument("--dry-run", action="store_true", help="print the configs; start nothing")
    args = p.parse_args(argv)
    args.rates = [float(x) for x in args.rates.split(",")]
    args.workloads = args.workloads.split(",")
    args.variants = args.variants.split(",")
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    if args.quick:
        args.seconds, args.rounds = 5.0, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench._models import model_dir as resolve_model

    model = resolve_model(args.model) if not args.dry_run else Path(args.model)
    configs = {v: variant_config(v, model, args) for v in args.variants}
    if args.dry_run:
        for v, cfg in configs.items():
            pd = cfg.pd.model_dump() if cfg.pd is not None else None
            print(f"{v}: routing.kv_transfer={cfg.routing.kv_transfer} pd={pd}")
        return 0
    from bench._cluster import LocalCluster
    from bench.routing import app_name, phases, run_phase
    from bench.serving import LoadConfig, heterogeneous_dataset, run_load

    plan = phases(args)
    cluster = LocalCluster()
    results: dict = {v: {} for v in configs}
    try:
        urls, replicas = {}, {}
        for v, cfg in configs.items():
            urls[v] = cluster.deploy(cfg, app_name(v))
            replicas[v] = replica_ids(app_name(v), cfg)
            print(f"-- {v}: {urls[v]}, replicas {replicas[v]}", flush=True)
        warm = heterogeneous_dataset(8, 0.0, (32, 8), (32, 8), random.Random(10_000))
        for url in urls.values():
            asyncio.run(run_load(LoadConfig(url, request_rate=8.0), warm))
        before = {v: decisions(url) for v, url in urls.items()}
        for phase in plan:
            for v, run in run_phase(cluster, phase, urls, replicas, args).items():
                table = run["replicas"]
                run["prefilled_tokens"] = sum(
                    r["prefix_cache_queries"] - r["prefix_cache_hits"] for r in table.values()
                )
                results[v][phase.key] = run
        for v, url in urls.items():
            after = decisions(url)
            results[v]["decisions"] = {k: after[k] - before[v].get(k, 0.0) for k in after}
    finally:
        cluster.shutdown()
    print("\n| variant | workload | TTFT p50 (ms) | TTFT p99 (ms) | prefilled tokens |")
    print("|---|---|---|---|---|")
    for v, runs in results.items():
        for key, run in runs.items():
            if key == "decisions":
                continue
            ttft = run["ttft_ms"]
            print(f"| {v} | {key} | {ttft['median']} | {ttft['p99']} "
                  f"| {run['prefilled_tokens']} |")  # fmt: skip
        print(f"  {v} decisions: {runs.get('decisions')}")
    if args.quick:
        return 0
    RESULTS.mkdir(exist_ok=True)
    for runs in results.values():
        for run in runs.values():
            if isinstance(run, dict):
                run.pop("ttft_s", None)
    (RESULTS / f"{args.out}.json").write_text(
        json.dumps(
            {"args": {k: v for k, v in vars(args).items()}, "results": results},
            indent=1,
            default=str,
        )
        + "\n"  # fmt: skip
    )
    print(f"wrote bench/results/{args.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
