"""Queue-depth autoscaling: a Ray Serve AutoscalingPolicy fed by each replica's
record_autoscaling_stats (replica/contracts.py's AutoscalingStats). Desired replicas = total queue depth (waiting + running) over a target
per replica; one more when KV pressure or preemptions show the replicas are saturated; scale
down only when the smaller count would still sit clearly under target (hysteresis). Ray applies
min/max bounds and the upscale/downscale delays around this policy."""

from __future__ import annotations

import math
from collections.abc import Iterable

from cluster.config import AutoscalingConfig
from replica.contracts import AutoscalingStats

# Scale down only if the remaining replicas would run at most this fraction of the target.
DOWNSCALE_HEADROOM = 0.7


def desired_replicas(
    current: int,
    queue_depth: float,
    kv_usages: Iterable[float],
    preemption_rates: Iterable[float],
    cfg: AutoscalingConfig,
) -> int:
    """The replica count this load calls for (pure; unit-tested on synthetic inputs)."""
    target = cfg.target_queue_depth
    desired = math.ceil(queue_depth / target) if queue_depth > 0 else 0
    saturated = any(u >= cfg.kv_pressure_threshold for u in kv_usages) or any(
        r > 0 for r in preemption_rates
    )
    if saturated and queue_depth > 0:
        desired = max(desired, current + 1)
    if desired < current:
        # hysteresis: shrink only to a count that would stay comfortably below target
        floor = math.ceil(queue_depth / (target * DOWNSCALE_HEADROOM)) if queue_depth > 0 else 0
        desired = max(desired, min(current, floor))
    return max(cfg.min_replicas, min(cfg.max_replicas, desired))


class QueueDepthPolicy:
    """Class-callable policy: Ray instantiates it once with `policy_kwargs`."""

    def __init__(self, config: dict) -> None:
        self.cfg = AutoscalingConfig.model_validate(config)

    def __call__(self, ctx) -> tuple[int, dict]:
        metrics = ctx.aggregated_metrics or {}
        depth = metrics.get(AutoscalingStats.QUEUE_DEPTH)
        if depth:
            queue = float(sum(depth.values()))
        else:  # replicas not reporting yet: Ray's own ongoing-request count
            queue = float(ctx.total_num_requests or 0)
        desired = desired_replicas(
            ctx.current_num_replicas,
            queue,
            (metrics.get(AutoscalingStats.KV_USAGE) or {}).values(),
            (metrics.get(AutoscalingStats.PREEMPTIONS_PER_S) or {}).values(),
            self.cfg,
        )
        state = dict(ctx.policy_state or {})
        state["last_queue_depth"] = queue
        return desired, state
