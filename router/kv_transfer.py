"""Fetch or recompute: the router's cost model for a request whose prompt prefix is cached on a
replica other than the one the ranking chose (a spill, a new replica, a migrated stream).
Pure: the decision (router/decision.py) calls `plan_fetch` for the Ray router and the
simulator alike.

For a prompt of P tokens, the ranking's lead L holding h_L of them and the best holder H (most
leading tokens cached over every replica the router knows, not only the sampled candidates)
holding h_H, three options, in expected seconds to the first token:

    here   = wait_L + (P - h_L) / prefill_rate_L
    fetch  = wait_L + latency + (h_H - h_L) / block_size * bytes_per_block / transfer_rate
                    + (P - h_H) / prefill_rate_L
    holder = wait_H + (P - h_H) / prefill_rate_H

`wait_r` is the prefill already ahead of a newcomer there (the router's own estimate,
`ReplicaStats.prefill_tokens`) at the replica's rate: its scheduler runs those chunks before it
admits the request. Rates and sizes are the replica's own measurements (RoutingStats:
prefill_tokens_per_s, kv_transfer_bytes_per_s, kv_bytes_per_block), the RoutingConfig's
fallbacks while a replica reports 0. The transfer rate is the slower of the holder's and the
lead's (an export there, an import here).

The ranking stays in charge of where a request goes: it weighs load beyond the first token
(seats, KV pressure, the decode batch). The model only (a) attaches a fetch to the lead when
fetching beats prefilling there by `kv_transfer_margin` and moves at least
`kv_transfer_min_blocks` blocks, and (b) sends the request to the holder instead when the
holder has a free seat (so its wait is only the prefill ahead) and beats both by the margin.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from replica.api import RoutingStats
from router.policy import ReplicaStats, RoutingConfig, effective_queue

FETCH, HERE, HOLDER = "fetch", "here", "holder"


@dataclass(frozen=True)
class Rates:
    """One replica's measured costs, with the config's fallbacks for what it has not reported."""

    prefill_tokens_per_s: float
    transfer_bytes_per_s: float
    bytes_per_block: int

    @classmethod
    def of(cls, recorded: RoutingStats | None, cfg: RoutingConfig) -> Rates:
        def pick(value, fallback):
            return value if value and value > 0 else fallback

        if recorded is None:
            return cls(cfg.kv_prefill_tokens_per_s, cfg.kv_transfer_bytes_per_s,
                       cfg.kv_bytes_per_block)  # fmt: skip
        return cls(
            pick(recorded.prefill_tokens_per_s, cfg.kv_prefill_tokens_per_s),
            pick(recorded.kv_transfer_bytes_per_s, cfg.kv_transfer_bytes_per_s),
            pick(recorded.kv_bytes_per_block, cfg.kv_bytes_per_block),
        )


@dataclass(frozen=True)
class FetchPlan:
    """What the model chose (`choice`: "fetch", "here" or "holder") and its costs in seconds.
    With "fetch": bring `num_blocks` leading prompt blocks from `source` to `target`; with
    "holder": send the request to `source` instead of the ranking's lead."""

    choice: str
    target: str
    source: str | None = None
    num_blocks: int = 0
    costs: Mapping[str, float] | None = None


def transfer_s(num_blocks: int, src: Rates, dst: Rates, cfg: RoutingConfig) -> float:
    """Seconds to move `num_blocks` blocks from a replica with rates `src` to one with `dst`."""
    rate = min(src.transfer_bytes_per_s, dst.transfer_bytes_per_s)
    size = max(src.bytes_per_block, dst.bytes_per_block)
    return cfg.kv_fetch_latency_s + num_blocks * size / rate


def wait_s(stats: ReplicaStats, rates: Rates) -> float:
    """The prefill already ahead of a newcomer on the replica, in seconds."""
    return max(stats.prefill_tokens, 0.0) / rates.prefill_tokens_per_s


def has_free_seat(stats: ReplicaStats, cfg: RoutingConfig) -> bool:
    return stats.max_num_seqs > 0 and effective_queue(stats, cfg) < stats.max_num_seqs


def plan_fetch(
    lead: ReplicaStats,
    holder: ReplicaStats | None,
    prompt_tokens: int,
    block_size: int,
    cfg: RoutingConfig,
    recorded: Callable[[str], RoutingStats | None],
    holder_tokens: int | None = None,
) -> FetchPlan | None:
    """The model's choice for a request of `prompt_tokens` routed to `lead`, with `holder` the
    replica holding most of its prompt (its `cached_tokens`, or `holder_tokens` when the index
    does not know it: a draining replica that handed a stream back). None: nothing to weigh
    (transfer off, no holder, or the holder is the lead or holds no more than it)."""
    if not cfg.kv_transfer or holder is None or holder.replica_id == lead.replica_id:
        return None
    held = holder.cached_tokens if holder_tokens is None else holder_tokens
    # whole blocks only, and at least one prompt token left to compute (the first token's logits)
    max_blocks = max(prompt_tokens - 1, 0) // block_size
    have = lead.cached_tokens // block_size
    fetchable = min(held // block_size, max_blocks) - have
    if fetchable < max(cfg.kv_transfer_min_blocks, 1):
        return None
    rates_l = Rates.of(recorded(lead.replica_id), cfg)
    rates_h = Rates.of(recorded(holder.replica_id), cfg)
    held_tokens = (have + fetchable) * block_size
    wait_l = wait_s(lead, rates_l)
    costs = {
        HERE: wait_l + (prompt_tokens - lead.cached_tokens) / rates_l.prefill_tokens_per_s,
        FETCH: wait_l
        + transfer_s(fetchable, rates_h, rates_l, cfg)
        + (prompt_tokens - held_tokens) / rates_l.prefill_tokens_per_s,
    }
    if holder_tokens is None:  # a holder the index knows is routable: it may take the request
        costs[HOLDER] = (
            wait_s(holder, rates_h) + (prompt_tokens - held) / rates_h.prefill_tokens_per_s
            if has_free_seat(holder, cfg)
            else math.inf
        )
    keep = 1.0 - cfg.kv_transfer_margin
    best_other = min(costs[HERE], costs[FETCH])
    if costs.get(HOLDER, math.inf) < keep * best_other:
        return FetchPlan(HOLDER, holder.replica_id, holder.replica_id, 0, costs)
    if costs[FETCH] < keep * costs[HERE]:
        return FetchPlan(FETCH, lead.replica_id, holder.replica_id, have + fetchable, costs)
    return FetchPlan(HERE, lead.replica_id, None, 0, costs)


def best_holder(hits: Mapping[str, int]) -> str | None:
    """The replica holding most of the prompt (ties: the smallest id, for determinism); None
    when none holds any of it."""
    held = [(-tokens, rid) for rid, tokens in hits.items() if tokens > 0]
    return min(held)[1] if held else None
