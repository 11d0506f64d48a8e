"""Engine and request metrics under vLLM's names with the prefix `stepserve:`, defined with
prometheus-client in a per-replica registry and updated after each engine step."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# `_created` series double the exposition and no dashboard uses them (vLLM drops them too).
disable_created_metrics()

PREFIX = "stepserve:"
LABELS = ("model_name", "replica")

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_STEP_BUCKETS = (
    0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5,
    1.0, 2.5,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_COUNT_BUCKETS = (0, 1, 2, 3, 5, 10, 20, 50)


class EngineMetrics:
    """Keeps every counter in `self.registry`, from each engine step: subscribed to an
    in-process Engine's steps, or fed `observe(report, outputs)` by an engine core's front
    (engine=None)."""

    def __init__(self, engine, model_name: str, replica: str, registry=None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        lv = {"model_name": model_name, "replica": replica}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, LABELS, registry=reg).labels(**lv)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, LABELS, registry=reg).labels(**lv)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=reg).labels(**lv)

        self.num_requests_running = gauge("num_requests_running", "Requests in the batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage (1 = full).")
        self.num_preemptions = counter("num_preemptions", "Preemptions by recompute.")
        self.kv_events_publishing = gauge(
            "kv_events_publishing",
            "1 while a router reads this replica's KV events and it publishes them.",
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found cached.")
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Steps in which a request ran a prompt-lookup draft."
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens proposed."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted by verification."
        )
        self.resumed_requests = counter(
            "resumed_requests", "Requests resumed here from another replica (migration)."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._request_success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            (*LABELS, "finished_reason"),
            registry=reg,
        )
        self._lv = lv
        self.request_num_preemptions = histogram(
            "request_num_preemptions", "Preemptions each finished request went through.",
            _COUNT_BUCKETS,
        )  # fmt: skip
        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between output tokens.", _LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "First scheduled to first token: the prompt's compute, queue time excluded.",
            _LATENCY_BUCKETS,
        )
        self.step_duration = histogram(
            "engine_step_duration_seconds",
            "One engine step: schedule, model, sample (where the engine runs).",
            _STEP_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "iteration_tokens", "Tokens scheduled per engine step.", _TOKEN_BUCKETS
        )
        # KV tiers and transfer between replicas (replica/kv_tier.py, kv_transfer.py)
        self.kv_tier_saves = counter(
            "kv_tier_saves", "KV blocks evicted from the pool saved to a tier."
        )
        self.kv_tier_restores = counter(
            "kv_tier_restores", "KV blocks copied back from a tier (or an import) into the pool."
        )
        self.kv_tier_hits = counter(
            "kv_tier_hit_tokens", "Prompt tokens whose KV came from a tier or an import."
        )
        self.kv_tier_blocks = gauge("kv_tier_blocks", "KV blocks held in the tiers below the pool.")
        self.kv_tier_bytes = gauge("kv_tier_bytes", "Bytes those blocks take (this rank's).")
        self.kv_blocks_imported = counter("kv_blocks_imported", "KV blocks fetched from replicas.")
        self.kv_bytes_imported = counter("kv_bytes_imported", "Bytes of those blocks.")
        self.kv_export_calls = counter("kv_export_calls", "KV exports other replicas asked for.")
        self.kv_blocks_exported = counter("kv_blocks_exported", "KV blocks sent to replicas.")
        self.kv_bytes_exported = counter("kv_bytes_exported", "Bytes of those blocks.")
        self.kv_fetch_seconds = histogram(
            "kv_fetch_seconds", "A KV fetch from another replica: call, transfer, import.",
            _LATENCY_BUCKETS,
        )  # fmt: skip
        self._kv_fetch_failures = Counter(
            PREFIX + "kv_fetch_failures",
            "KV fetches that brought less than asked, by reason (the rest is recomputed).",
            (*LABELS, "reason"),
            registry=reg,
        )
        self.kv_block_bytes = 0  # set by the replica once known (kv_tier_bytes)
        self._arrival: dict[str, float] = {}
        self._scheduled: dict[str, float] = {}  # first scheduled, until the first token
        self._last_token: dict[str, float] = {}
        # counters fed from the scheduler's running totals: (counter, SchedulerStats field)
        self._totals = (
            (self.num_preemptions, "num_preemptions_total"),
            (self.prefix_cache_queries, "prefix_cache_queries"),
            (self.prefix_cache_hits, "prefix_cache_hits"),
            (self.spec_decode_num_drafts, "spec_num_drafts"),
            (self.spec_decode_num_draft_tokens, "spec_num_draft_tokens"),
            (self.spec_decode_num_accepted_tokens, "spec_num_accepted_tokens"),
            (self.resumed_requests, "num_resumed_total"),
            (self.kv_tier_saves, "kv_tier_saves"),
            (self.kv_tier_restores, "kv_tier_restores"),
            (self.kv_tier_hits, "kv_tier_hit_tokens"),
        )
        self._seen = dict.fromkeys((field for _, field in self._totals), 0)
        if engine is not None:  # in-process: observe each step on the engine thread
            engine.step_listeners.append(self.on_step)

    def kv_fetch_failures(self, reason: str):
        """off, timeout, source_gone, error, partial, or the import's refusal (layout, chain,
        shape, ranks, empty)."""
        return self._kv_fetch_failures.labels(**self._lv, reason=reason)

    def request_success(self, finished_reason: str):
        return self._request_success.labels(**self._lv, finished_reason=finished_reason)

    def on_step(self, engine, scheduler_output, outputs, step_time: float) -> None:
        from replica.engine.core import step_report

        self.observe(step_report(engine, scheduler_output, step_time), outputs)

    def observe(self, report, outputs) -> None:
        """One step (a replica.engine.wire.StepReport) and its outputs, text and stop strings
        applied: where the engine runs, or in the front of an engine core process."""
        now = report.end
        for rid in report.finished_request_ids:  # aborted or ended last step
            self._forget(rid)
        self.iteration_tokens.observe(report.num_scheduled_tokens)
        if report.num_scheduled_tokens:
            self.step_duration.observe(report.step_time)
        started = now - report.step_time  # the step (and its schedule) began here
        for rid, arrival in report.first_scheduled:
            self._arrival[rid] = arrival
            self._scheduled[rid] = started
            self.queue_time.observe(max(0.0, started - arrival))
        for out in outputs:
            rid = out.request_id
            n = len(out.new_token_ids)
            last = self._last_token.get(rid)
            arrival = self._arrival.get(rid, now)
            if last is None:
                self.ttft.observe(now - arrival)
                scheduled = self._scheduled.pop(rid, None)
                if scheduled is not None:
                    self.prefill_time.observe(now - scheduled)
                self.prompt_tokens.inc(out.num_prompt_tokens)
            elif n:
                gap = (now - last) / n
                for _ in range(n):
                    self.itl.observe(gap)
            self.generation_tokens.inc(n)
            self._last_token[rid] = now
            if out.finished:
                self.e2e.observe(now - arrival)
                self.request_success(out.finish_reason).inc()
                self.request_num_preemptions.observe(out.num_preemptions)
                self._forget(rid)
        self.update_gauges(report.stats)

    def _forget(self, rid: str) -> None:
        """Drop what is kept of a request that ended (finished, aborted)."""
        for kept in (self._arrival, self._scheduled, self._last_token):
            kept.pop(rid, None)

    def update_gauges(self, stats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_usage)
        self.kv_tier_blocks.set(stats.kv_tier_blocks)
        self.kv_tier_bytes.set(stats.kv_tier_blocks * self.kv_block_bytes)
        for counter, field in self._totals:  # each counter advances by the step's delta
            total = getattr(stats, field)
            counter.inc(total - self._seen[field])
            self._seen[field] = total

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


# Replicas push their exposition to their application's hub (replica/hub.py); any ingress
# replica serves the merge, so one local URL shows every replica.
# The Ray resource only the head node has (a sliver of it pins an actor there): the hubs that
# every replica and ingress share live on the head, so losing a worker node loses none of them.
ON_HEAD_NODE = {"node:__internal_head__": 0.001}
# Ray options of such a shared hub (a named, detached actor, created by whichever process asks
# first): on the head, not on the worker of the replica that asked first, nor in its placement
# group (a tensor-parallel replica's), where it would die when Serve removes that replica
HUB_ACTOR_OPTIONS = {
    "get_if_exists": True,
    "lifetime": "detached",
    "num_cpus": 0,
    "resources": ON_HEAD_NODE,
    "scheduling_strategy": "DEFAULT",
}


def merge_expositions(texts: list[bytes | str]) -> bytes:
    """Merge several Prometheus text expositions into one, one HELP/TYPE block per family
    (concatenating them would repeat families, which scrapers reject)."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, object] = {}
    for text in texts:
        if isinstance(text, bytes):
            text = text.decode()
        for family in text_string_to_metric_families(text):
            seen = families.get(family.name)
            if seen is None:
                families[family.name] = family
            else:
                seen.samples.extend(family.samples)

    class _Merged:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)
