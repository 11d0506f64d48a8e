"""Routers side by side. One local Ray cluster holds one application per router, all at once:
the same N replicas of the tiny model each (small batches and KV caches, so queues and
preemptions form), differing only in routing. The same workloads then go to each application
in short windows, interleaved (round r starts with router r), so that the shared host's noise
lands on every router alike:

- heterogeneous: Poisson arrivals of mostly short requests plus a few very long
  prompts/outputs (each round its own requests; the same ones for every router);
- prefix-repetition: a handful of long shared prefixes (the same in every round) with unique
  suffixes.

Routers: round_robin, pow2 (Ray Serve's default PowerOfTwoChoicesRequestRouter), load_aware
(router/policy.py) and load_aware+prefix (prefix affinity on). Reports p50/p99 TTFT,
throughput, and per replica the prefix-cache hit rate, preemptions and requests served;
ratios against pow2. Writes bench/results/<out>.json and <out>_ttft.png (TTFT CDFs); with
several --rates also <out>_latency_vs_rate.png.

Run: flock /tmp/stepserve-ray.lock .venv/bin/python bench/routing.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._cluster import LocalCluster, counter_deltas  # noqa: E402
from bench._models import model_dir as resolve_model  # noqa: E402
from bench.serving import (  # noqa: E402
    LoadConfig,
    RequestResult,
    heterogeneous_dataset,
    machine_info,
    percentile,
    prefix_repetition_dataset,
    print_summary,
    run_conversations,
    run_load,
    summarize,
)
from cluster.config import ClusterConfig  # noqa: E402
from sim.workloads import multi_turn_conversations, oracle_hit_tokens  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROUTERS = ("round_robin", "pow2", "load_aware", "load_aware+prefix")
MULTI_TURN_ROUTERS = ("pow2", "load_aware", "load_aware+prefix", "load_aware+kv")
BASELINE = "pow2"
HET = "heterogeneous"
PREFIX = "prefix-repetition"
MULTI = "multi-turn"
BLOCK_SIZE = 16
SHORT, LONG = (32, 16), (1024, 256)  # (input, output) token means, +-25%


def router_config(router: str, model: Path, args: argparse.Namespace) -> ClusterConfig:
    """`policy[+prefix|+kv][/field=value[;field=value]]`: a RoutingConfig, e.g.
    `load_aware/weight_prefill=0` (load_aware without the prefill term); +prefix turns on
    prefix affinity, +kv KV-event routing (routing.kv_events)."""
    router, _, fields = router.partition("/")
    policy, _, extra = router.partition("+")
    overrides = dict(item.split("=", 1) for item in fields.split(";") if item)
    overrides.setdefault("kv_events", extra == "kv")  # on by default in RoutingConfig
    return ClusterConfig.model_validate(
        {
            "engine": {
                "model": str(model),
                "max_model_len": 2048,
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "num_kv_blocks": args.num_kv_blocks,
                "block_size": BLOCK_SIZE,
            },
            "replicas": args.replicas,
            "num_cpus_per_replica": args.num_cpus_per_replica,
            "routing": {"policy": policy, "prefix_affinity": extra == "prefix"} | overrides,
        }
    )


def app_name(router: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", router.lower()).strip("-")


@dataclass
class Phase:
    workload: str
    rate: float
    # one request list (multi-turn: one list of conversations) per round, the same for every
    # router
    windows: list[list]

    @property
    def key(self) -> str:
        return f"{self.workload}@{self.rate:g}"


def phases(args: argparse.Namespace) -> list[Phase]:
    out = []
    if HET in args.workloads:
        for rate in args.rates:
            n = max(4, round(rate * args.seconds))
            windows = [
                heterogeneous_dataset(
                    n, args.long_fraction, SHORT, LONG, random.Random(args.seed * 1000 + rnd)
                )
                for rnd in range(args.rounds)
            ]
            out.append(Phase(HET, rate, windows))
    if PREFIX in args.workloads:
        n = max(4, round(args.prefix_rate * args.seconds))
        windows = [
            prefix_repetition_dataset(
                n, args.num_prefixes, args.prefix_len, 32, 16,
                random.Random(args.seed * 1000 + 500 + rnd),
                prefix_rng=random.Random(args.seed + 7),
            )
            for rnd in range(args.rounds)
        ]  # fmt: skip
        out.append(Phase(PREFIX, args.prefix_rate, windows))
    if MULTI in args.workloads:
        n = max(2, round(args.chat_rate * args.seconds))
        windows = [
            multi_turn_conversations(
                n, args.chat_rate, random.Random(args.seed * 1000 + 900 + rnd),
                num_system_prompts=args.num_system_prompts, system_len=args.system_len,
                user_len=32, output_len=32, turns=(3, 6), think_s=args.think_s,
                system_rng=random.Random(args.seed + 11),
            )
            for rnd in range(args.rounds)
        ]  # fmt: skip
        out.append(Phase(MULTI, args.chat_rate, windows))
    return out


def oracle_tokens(turns_by_round: list[list]) -> tuple[int, int]:
    """(prompt tokens, oracle hit tokens) of a router's multi-turn rounds: the hits one cache
    holding every block ever computed would have had (sim.workloads.oracle_hit_tokens), the
    rounds in the order they ran (caches carry over from one round to the next)."""
    rows = []
    for rnd, turns in enumerate(turns_by_round):
        base = rnd * 1e6
        for t in turns:
            if t.result.success:
                rows.append((base + t.sent_s, t.prompt_ids, base + t.done_s, t.answer_ids))
    hits = oracle_hit_tokens(rows, BLOCK_SIZE)
    return sum(len(r[1]) for r in rows), sum(hits)


def replica_table(deltas: dict[str, dict[str, float]]) -> dict[str, dict]:
    table = {}
    for rid, d in sorted(deltas.items()):
        queries = d["vllm:prefix_cache_queries_total"]
        hits = d["vllm:prefix_cache_hits_total"]
        table[rid] = {
            "requests": int(d["vllm:request_success_total"]),
            "preemptions": int(d["vllm:num_preemptions_total"]),
            "prefix_cache_queries": int(queries),
            "prefix_cache_hits": int(hits),
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
            "generation_tokens": int(d["vllm:generation_tokens_total"]),
        }
    return table


def window_line(router: str, phase: Phase, rnd: int, results: list[RequestResult]) -> dict:
    ok = [r.ttft for r in results if r.success]
    row = {
        "round": rnd,
        "completed": len(ok),
        "ttft_p50_ms": round(1000 * percentile(ok, 50), 1),
        "ttft_p99_ms": round(1000 * percentile(ok, 99), 1),
    }
    print(
        f"   round {rnd} {phase.key:<24} {router:<18} {len(ok):>4}/{len(results)} ok, "
        f"TTFT p50 {row['ttft_p50_ms']:7.0f} ms  p99 {row['ttft_p99_ms']:7.0f} ms",
        flush=True,
    )
    return row


def run_phase(cluster: LocalCluster, phase: Phase, urls: dict, replicas: dict, args) -> dict:
    """Every round: each router's window in turn (round r starts with router r)."""
    routers = list(urls)
    collected: dict[str, list[RequestResult]] = {r: [] for r in routers}
    durations = dict.fromkeys(routers, 0.0)
    windows: dict[str, list[dict]] = {r: [] for r in routers}
    turns: dict[str, list[list]] = {r: [] for r in routers}
    before = cluster.settled_counters()
    for rnd, specs in enumerate(phase.windows):
        shift = rnd % len(routers)
        for router in routers[shift:] + routers[:shift]:
            if phase.workload == MULTI:
                sent, duration = asyncio.run(run_conversations(urls[router], specs))
                turns[router].append(sent)
                results = [t.result for t in sent]
            else:
                cfg = LoadConfig(
                    urls[router], request_rate=phase.rate, burstiness=args.burstiness, seed=rnd
                )
                results, duration = asyncio.run(run_load(cfg, specs))
            collected[router] += results
            durations[router] += duration
            windows[router].append(window_line(router, phase, rnd, results))
    after = cluster.settled_counters()
    out = {}
    for router in routers:
        summary = summarize(collected[router], durations[router])
        table = replica_table(counter_deltas(before, after, replicas[router]))
        queries = sum(r["prefix_cache_queries"] for r in table.values())
        hits = sum(r["prefix_cache_hits"] for r in table.values())
        extra = {}
        if phase.workload == MULTI:
            prompt, oracle = oracle_tokens(turns[router])
            extra = {
                "prompt_tokens_sent": prompt,
                "oracle_hit_tokens": oracle,
                "hit_tokens": int(hits),
                "prefilled_tokens": int(queries - hits),
                "hits_vs_oracle": round(hits / oracle, 4) if oracle else None,
                "turns": len(collected[router]),
            }
        out[router] = {
            **extra,
            "workload": phase.workload,
            "request_rate": phase.rate,
            "rounds": len(phase.windows),
            **summary,
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
            "preemptions": sum(r["preemptions"] for r in table.values()),
            "replicas": table,
            "windows": windows[router],
            "ttft_s": [round(r.ttft, 5) for r in collected[router] if r.success],
        }
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def compare(results: dict) -> dict:
    """Per run key, each router against the baseline (pow2), pooled over rounds; `rounds_won`
    counts the rounds whose window p99 TTFT was lower than pow2's in the same round."""
    out: dict = {}
    for router, runs in results.items():
        for key, run in runs.items():
            base = results.get(BASELINE, {}).get(key)
            if base is None:
                continue
            wins = sum(
                w["ttft_p99_ms"] < b["ttft_p99_ms"]
                for w, b in zip(run["windows"], base["windows"], strict=True)
            )
            out.setdefault(key, {})[router] = {
                "ttft_p50_ms": run["ttft_ms"]["median"],
                "ttft_p99_ms": run["ttft_ms"]["p99"],
                "throughput_req_s": run["request_throughput"],
                "output_tok_s": run["output_throughput"],
                "prefix_cache_hit_rate": run["prefix_cache_hit_rate"],
                "preemptions": run["preemptions"],
                "ttft_p99_vs_pow2": ratio(run["ttft_ms"]["p99"], base["ttft_ms"]["p99"]),
                "ttft_p50_vs_pow2": ratio(run["ttft_ms"]["median"], base["ttft_ms"]["median"]),
                "throughput_vs_pow2": ratio(run["request_throughput"], base["request_throughput"]),
                "prefix_hit_rate_vs_pow2": ratio(
                    run["prefix_cache_hit_rate"], base["prefix_cache_hit_rate"]
                ),
                "rounds_with_lower_p99_than_pow2": f"{wins}/{len(run['windows'])}",
                "round_ttft_p50_ms": [w["ttft_p50_ms"] for w in run["windows"]],
                "round_ttft_p99_ms": [w["ttft_p99_ms"] for w in run["windows"]],
                **{k: run[k] for k in ("hit_tokens", "prefilled_tokens", "oracle_hit_tokens",
                                       "hits_vs_oracle", "prompt_tokens_sent") if k in run},
            }  # fmt: skip
    return out


def evaluate_targets(comparison: dict) -> dict:
    targets = {}
    for key, by_router in comparison.items():
        kv, aff = by_router.get("load_aware+kv"), by_router.get("load_aware+prefix")
        if key.startswith(MULTI) and kv:
            others = {r: c for r, c in by_router.items() if r != "load_aware+kv"}
            targets[f"load_aware+kv hits >= 0.9x the oracle's ({key})"] = {
                "hits_vs_oracle": kv["hits_vs_oracle"],
                "met": (kv["hits_vs_oracle"] or 0) >= 0.9,
            }
            if aff:
                r = ratio(kv["prefilled_tokens"], aff["prefilled_tokens"])
                targets[f"load_aware+kv prefilled tokens <= 0.7x prefix affinity's ({key})"] = {
                    "prefilled_ratio": r,
                    "met": r is not None and r <= 0.7,
                }
            for q in ("p50", "p99"):
                ratios = {
                    r: ratio(kv[f"ttft_{q}_ms"], c[f"ttft_{q}_ms"]) for r, c in others.items()
                }
                targets[f"load_aware+kv TTFT {q} lower than every other router ({key})"] = {
                    "ratios": ratios,
                    "met": all(x is not None and x < 1.0 for x in ratios.values()),
                }
            tput = {r: ratio(kv["output_tok_s"], c["output_tok_s"]) for r, c in others.items()}
            targets[f"load_aware+kv throughput not lower (>= 0.98x each) ({key})"] = {
                "ratios": tput,
                "met": all(x is not None and x >= 0.98 for x in tput.values()),
            }
        la, la_p = by_router.get("load_aware"), by_router.get("load_aware+prefix")
        if key.startswith(HET) and la:
            r = la["ttft_p99_vs_pow2"]
            targets[f"load_aware p99 TTFT <= 0.7x pow2 at equal throughput ({key})"] = {
                "ttft_p99_ratio": r,
                "throughput_ratio": la["throughput_vs_pow2"],
                "met": r is not None and r <= 0.7,
            }
        if key.startswith(PREFIX) and la_p:
            hr, tr = la_p["prefix_hit_rate_vs_pow2"], la_p["ttft_p99_vs_pow2"]
            targets[f"load_aware+prefix hit rate >= 2x pow2, p99 TTFT not higher ({key})"] = {
                "hit_rate_ratio": hr,
                "ttft_p99_ratio": tr,
                "met": hr is not None and hr >= 2.0 and tr is not None and tr <= 1.0,
            }
    return targets


def print_tables(comparison: dict) -> None:
    for key, by_router in comparison.items():
        print(f"\n{key}")
        print(
            f"{'router':<18} {'TTFT p50':>9} {'TTFT p99':>9} {'p99/pow2':>9} {'rounds':>7} "
            f"{'req/s':>6} {'tput/pow2':>9} {'prefix hit':>10} {'hit/pow2':>9} {'preempt':>8}"
        )
        if key.startswith(MULTI):
            print(f"{'router':<18} {'hit tok':>9} {'prefilled':>9} {'oracle':>9} {'hit/orc':>8} "
                  f"{'round p50s':>30} {'round p99s':>30}")  # fmt: skip
            for router, c in by_router.items():
                print(f"{router:<18} {c['hit_tokens']:>9} {c['prefilled_tokens']:>9} "
                      f"{c['oracle_hit_tokens']:>9} {c['hits_vs_oracle'] or 0:>8.3f} "
                      f"{str(c['round_ttft_p50_ms']):>30} {str(c['round_ttft_p99_ms']):>30}")  # fmt: skip
        for router, c in by_router.items():
            hit = c["prefix_cache_hit_rate"]
            print(
                f"{router:<18} {c['ttft_p50_ms']:>9.1f} {c['ttft_p99_ms']:>9.1f} "
                f"{c['ttft_p99_vs_pow2'] or 0:>9.3f} {c['rounds_with_lower_p99_than_pow2']:>7} "
                f"{c['throughput_req_s']:>6.2f} {c['throughput_vs_pow2'] or 0:>9.3f} "
                f"{hit if hit is not None else 0:>10.3f} "
                f"{c['prefix_hit_rate_vs_pow2'] or 0:>9.2f} {c['preemptions']:>8}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny, default, or a local HF model dir")
    p.add_argument(
        "--routers",
        default=",".join(ROUTERS),
        help="comma list; each policy[+prefix][/field=value;...] (RoutingConfig fields)",
    )
    p.add_argument("--workloads", default=f"{HET},{PREFIX}", help=f"of {HET},{PREFIX},{MULTI}")
    p.add_argument("--rates", default="6", help="heterogeneous request rates (comma list)")
    p.add_argument("--prefix-rate", type=float, default=8.0)
    p.add_argument("--seconds", type=float, default=12.0, help="arrival window per round")
    p.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="windows per router and workload (4: each router once in each slot)",
    )
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--long-fraction", type=float, default=0.1)
    p.add_argument("--num-prefixes", type=int, default=20)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--chat-rate", type=float, default=1.0, help="multi-turn: chats started/s")
    p.add_argument("--num-system-prompts", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--think-s", type=float, default=2.0)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--num-cpus-per-replica", type=float, default=0.1)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument(
        "--num-kv-blocks", type=int, default=120, help="per replica: room for one long request"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="routing", help="result name: bench/results/<out>.json")
    p.add_argument("--quick", action="store_true", help="1 round of 5 s windows, no files")
    args = p.parse_args()
    args.rates = [float(x) for x in args.rates.split(",")]
    args.workloads = args.workloads.split(",")
    routers = args.routers.split(",")
    if args.quick:
        args.seconds, args.rounds = 5.0, 1
    model = resolve_model(args.model)
    plan = phases(args)
    started = time.time()
    host = machine_info()
    cluster = LocalCluster()
    results: dict = {router: {} for router in routers}
    try:
        urls, replicas = {}, {}
        for router in routers:
            t0 = time.time()
            urls[router] = cluster.deploy(router_config(router, model, args), app_name(router))
            replicas[router] = cluster.replica_ids(app_name(router), args.replicas)
            print(
                f"-- {router}: deployed at {urls[router]} in {time.time() - t0:.0f} s", flush=True
            )
        # warm-up with prompts no workload uses: first-step allocations, router caches, stats
        warm = heterogeneous_dataset(
            2 * args.replicas, 0.0, (32, 8), (32, 8), random.Random(10_000 + args.seed)
        )
        for url in urls.values():
            asyncio.run(run_load(LoadConfig(url, request_rate=8.0), warm))
        deployed = time.time()
        for phase in plan:
            for router, run in run_phase(cluster, phase, urls, replicas, args).items():
                results[router][phase.key] = run
    finally:
        cluster.shutdown()
    for router, runs in results.items():
        for key, run in runs.items():
            print_summary(f"{router} / {key} req/s, {run['rounds']} round(s)", run)
            print(f"  prefix-cache hit rate {run['prefix_cache_hit_rate']}, "
                  f"preemptions {run['preemptions']}; per replica (requests, preemptions, hit "
                  f"rate): {[(r['requests'], r['preemptions'], r['prefix_cache_hit_rate']) for r in run['replicas'].values()]}")  # fmt: skip
    comparison = compare(results)
    targets = evaluate_targets(comparison)
    print_tables(comparison)
    for name, t in targets.items():
        print(f"target {name}: {'met' if t['met'] else 'MISSED'} {t}")
    print(f"deploy {deployed - started:.0f} s, windows {time.time() - deployed:.0f} s")
    if args.quick:
        return
    engine = router_config(BASELINE, model, args).engine
    out = {
        "benchmark": "routing",
        "model": args.model,
        "replicas": args.replicas,
        "rounds": args.rounds,
        "num_cpus_per_replica": args.num_cpus_per_replica,
        "engine": engine.model_dump(
            include={"max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size",
                     "max_model_len"}
        ),
        "workloads": {
            HET: {"rates": args.rates, "seconds_per_round": args.seconds,
                  "long_fraction": args.long_fraction, "short": f"{SHORT[0]} in / {SHORT[1]} "
                  "out (+-25%)", "long": f"{LONG[0]} in / {LONG[1]} out (+-25%)",
                  "burstiness": args.burstiness},
            PREFIX: {"rate": args.prefix_rate, "seconds_per_round": args.seconds,
                     "num_prefixes": args.num_prefixes, "prefix_len": args.prefix_len,
                     "suffix_len": 32, "output_len": 16},
            MULTI: {"chats_per_s": args.chat_rate, "seconds_per_round": args.seconds,
                    "num_system_prompts": args.num_system_prompts,
                    "system_len": args.system_len, "user_len": "32 (+-50%)",
                    "output_len": "32 (+-50%)", "turns": "3-6", "think_s": args.think_s},
        },
        "host_before": host,
        "host_after": machine_info(),
        "wall_s": round(time.time() - started, 1),
        "comparison": comparison,
        "targets": targets,
        "results": results,
    }  # fmt: skip
    out["ttft_cdf"] = {
        key: {router: results[router][key]["ttft_s"] for router in routers}
        for key in results[routers[0]]
    }
    out["plot_title"] = (
        f"TTFT per router ({args.rounds} interleaved rounds): {args.replicas} replicas x "
        f"(max_num_seqs {args.max_num_seqs}, {args.num_kv_blocks} KV blocks), {args.model} "
        f"model, {host['cpu_count']}-core host"
    )
    if len(args.rates) > 1:
        out["sweep"] = {
            "title": f"Heterogeneous workload: latency vs request rate per router "
            f"({args.replicas} replicas, {args.model} model)",
            "systems": {
                router: [
                    {k: v for k, v in run.items() if k not in ("ttft_s", "replicas", "windows")}
                    for run in results[router].values()
                    if run["workload"] == HET
                ]
                for router in routers
            },
        }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.out}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    from bench.plots import plot_routing

    pngs = plot_routing(out, args.out)
    print(f"wrote {path} and {', '.join(str(p) for p in pngs)}")


if __name__ == "__main__":
    main()
