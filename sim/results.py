"""What a simulation run produced (`SimResult`): per-request results, replica timelines and
counts, and the summary (percentiles, hit rates, SLO attainment)."""

from __future__ import annotations

import math

from replica.request import root_block_hash
from sim.replica import SimRequest
from sim.workloads import oracle_hit_tokens


def _oracle(requests: list[SimRequest], block_size: int) -> list[int]:
    rows = [
        (r.arrival, r.spec.prompt_ids, r.finished_at if r.answer else None, r.answer)
        for r in requests
    ]
    return oracle_hit_tokens(rows, block_size, [root_block_hash(r.lora) for r in requests])


class SimResult:
    """What a run produced: per-request results, replica timelines and counts."""

    def __init__(self, sim, end: float) -> None:
        net = sim.settings.net_latency_s
        self.end_s = end
        self.requests = [r.result(net) for r in sim.requests]
        if sim.oracle:
            for row, hit in zip(self.requests, _oracle(sim.requests, sim.config.engine.block_size)):
                row["oracle_hit_tokens"] = hit
        self.index_stats = [i.index.stats() for i in sim.ingresses if i.index is not None]
        self.replica_count = sim.replica_count
        self.timelines = sim.timelines
        self.replicas = [
            {
                "replica": r.rid,
                "created_s": r.created,
                "stopped_s": r.stopped_at,
                "busy_s": r.busy_s,
                "steps": r.num_steps,
                "preemptions": r.scheduler.num_preemptions_total,
                "prefix_cache_queries": r.scheduler.prefix_cache_queries,
                "prefix_cache_hits": r.scheduler.prefix_cache_hits,
                "lora_loads": r.lora_loads,
                "role": r.role,
                "fetches": r.fetches,
                "fetched_blocks": r.fetched_blocks,
                "lost": r.lost,
            }
            for r in sim.replicas
        ]
        self.replica_seconds = sum(
            (r.stopped_at if r.stopped_at == r.stopped_at else end) - r.created
            for r in sim.replicas
        )

    def summary(self, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> dict:
        ok = [r for r in self.requests if r["status"] == "ok"]
        out = {
            "requests": len(self.requests),
            "completed": len(ok),
            "rejected": sum(r["status"] == "rejected" for r in self.requests),
            "unfinished": sum(r["status"] == "unfinished" for r in self.requests),
            "duration_s": self.end_s,
            "replica_seconds": self.replica_seconds,
        }
        if not ok:
            return out
        first = min(r["arrival_s"] for r in ok)
        last = max(r["arrival_s"] + r["e2e_s"] for r in ok)
        out_tokens = sum(r["output_tokens"] for r in ok)
        out["output_tokens_per_s"] = out_tokens / (last - first) if last > first else math.nan
        out["requests_per_s"] = len(ok) / (last - first) if last > first else math.nan
        for key in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
            vals = sorted(r[key] for r in ok if r[key] == r[key])
            out[key] = percentiles(vals)
        prompt = sum(r["prompt_tokens"] for r in ok)
        hits = sum(r["hit_tokens"] for r in ok)
        out["hit_tokens"] = hits
        out["prompt_tokens"] = prompt
        # what the replicas computed by prefill (a PD request's decode phase included)
        out["prefilled_tokens"] = sum(r["prefilled_tokens"] for r in ok)
        fetched = [r for r in ok if r["fetched_tokens"]]
        out["fetched_tokens"] = sum(r["fetched_tokens"] for r in ok)
        out["fetches"] = len(fetched)
        if fetched:
            out["fetch_s_mean"] = sum(r["fetch_s"] for r in fetched) / len(fetched)
        out["hit_rate"] = hits / prompt if prompt else 0.0
        out["preemptions"] = sum(r["preemptions"] for r in ok)
        lost = sum(r["lost"] for r in self.replicas)
        if lost:
            out["lost_replicas"] = lost
            out["migrations"] = sum(r["migrations"] for r in self.requests)
        if ok and "oracle_hit_tokens" in ok[0]:
            out["oracle_hit_tokens"] = sum(r["oracle_hit_tokens"] for r in ok)
        predicted = [r for r in ok if r["predicted_hit_tokens"] >= 0]
        if predicted:
            out["hit_prediction_exact"] = sum(
                r["predicted_hit_tokens"] == r["hit_tokens"] for r in predicted
            ) / len(predicted)
            reasons: dict[str, int] = {}
            for r in predicted:
                reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
            out["decisions_by_reason"] = reasons
        adapted = [r for r in ok if r["lora"] is not None]
        if adapted:
            loads = sum(r["lora_loads"] for r in self.replicas)
            out["lora_requests"] = len(adapted)
            out["lora_loads"] = loads
            out["lora_loads_per_request"] = loads / len(adapted)
            # requests that waited for their adapter to load (one load may serve several)
            out["lora_waited"] = sum(r["lora_waited"] for r in adapted) / len(adapted)
        if slo_ttft_s is not None or slo_tpot_s is not None:
            met = sum(
                (slo_ttft_s is None or r["ttft_s"] <= slo_ttft_s)
                and (
                    slo_tpot_s is None
                    or not r["tpot_s"] == r["tpot_s"]
                    or r["tpot_s"] <= slo_tpot_s
                )
                for r in ok
            )
            out["slo_attainment"] = met / len(self.requests)
        return out


def percentiles(sorted_vals: list[float], qs=(50, 90, 99)) -> dict:
    if not sorted_vals:
        return {}
    out = {"mean": sum(sorted_vals) / len(sorted_vals)}
    n = len(sorted_vals)
    for q in qs:
        # linear interpolation between closest ranks (numpy's default)
        pos = (n - 1) * q / 100.0
        lo = int(math.floor(pos))
        hi = min(lo + 1, n - 1)
        out[f"p{q}"] = sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)
    return out
