"""Engine and request metrics under vLLM V1's own names (prefix `vllm:`, label `model_name`,
vLLM's types, units and buckets), so vLLM's Grafana dashboards, alerts and autoscalers work
unchanged; stepserve's extras (step time, KV-event publishing, resumed requests) keep the
prefix `stepserve:`. Every series also carries our `replica` label. Defined with
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

from replica import tracing

# `_created` series double the exposition and no dashboard uses them (vLLM drops them too).
disable_created_metrics()

VLLM = "vllm:"  # the metrics vLLM V1 exposes, under its names
PREFIX = "stepserve:"  # ours alone
LABELS = ("model_name", "replica")

# vLLM's bucket boundaries, so quantiles read alike on both
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TOKEN_GAP_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_STEP_BUCKETS = (
    0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5,
    1.0, 2.5,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_COUNT_BUCKETS = (0, 1, 2, 3, 5, 10, 20, 50)
# requests kept for their max_tokens and trace until they finish (a request refused before it
# was scheduled never reports an end: the oldest go past this many)
_MAX_TAKEN = 65536


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class EngineMetrics:
    """Keeps every counter in `self.registry`, from each engine step: subscribed to an
    in-process Engine's steps, or fed `observe(report, outputs)` by an engine core's front
    (engine=None). `taken(request)` notes a request's max_tokens and trace context as the
    replica takes it. `cache_info`: the labels of vllm:cache_config_info."""

    def __init__(
        self,
        engine,
        model_name: str,
        replica: str,
        registry=None,
        max_model_len: int = 8192,
        cache_info: dict | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        reg = self.registry
        lv = {"model_name": model_name, "replica": replica}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=reg).labels(**lv)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=reg).labels(**lv)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=reg).labels(**lv)

        tokens = one_two_five(max(1, max_model_len))
        self.num_requests_running = gauge(
            VLLM + "num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = gauge(
            VLLM + "num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage_perc = gauge(
            VLLM + "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        # vLLM's deprecated name of the same gauge, which its example dashboard still reads
        self.gpu_cache_usage_perc = gauge(
            VLLM + "gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage. "
            "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
        )
        self.num_preemptions = counter(
            VLLM + "num_preemptions", "Cumulative number of preemptions (by recompute)."
        )
        self.prefix_cache_queries = counter(
            VLLM + "prefix_cache_queries", "Prefix cache queries, in queried prompt tokens."
        )
        self.prefix_cache_hits = counter(
            VLLM + "prefix_cache_hits", "Prefix cache hits, in cached prompt tokens."
        )
        self.spec_decode_num_drafts = counter(
            VLLM + "spec_decode_num_drafts", "Number of spec decoding drafts (prompt lookup)."
        )
        self.spec_decode_num_draft_tokens = counter(
            VLLM + "spec_decode_num_draft_tokens", "Number of draft tokens."
        )
        self.spec_decode_num_accepted_tokens = counter(
            VLLM + "spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self.prompt_tokens = counter(VLLM + "prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            VLLM + "generation_tokens", "Number of generation tokens processed."
        )
        self._request_success = Counter(
            VLLM + "request_success",
            "Count of successfully processed requests.",
            (*LABELS, "finished_reason"),
            registry=reg,
        )
        self._lv = lv
        self.ttft = histogram(
            VLLM + "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        )
        self.itl = histogram(
            VLLM + "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _TOKEN_GAP_BUCKETS,
        )
        # the same gaps under vLLM's older name, which vLLM's example dashboard still reads
        self.tpot = histogram(
            VLLM + "time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            _TOKEN_GAP_BUCKETS,
        )
        self.request_tpot = histogram(
            VLLM + "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _TOKEN_GAP_BUCKETS,
        )
        self.e2e = histogram(
            VLLM + "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _REQUEST_BUCKETS,
        )
        self.queue_time = histogram(
            VLLM + "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _REQUEST_BUCKETS,
        )
        self.inference_time = histogram(
            VLLM + "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            _REQUEST_BUCKETS,
        )
        self.prefill_time = histogram(
            VLLM + "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _REQUEST_BUCKETS,
        )
        self.decode_time = histogram(
            VLLM + "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            _REQUEST_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            VLLM + "request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self.request_generation_tokens = histogram(
            VLLM + "request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.request_max_generation_tokens = histogram(
            VLLM + "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        )  # one choice per engine request: its generated tokens
        self.request_max_tokens = histogram(
            VLLM + "request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            tokens,
        )
        self.iteration_tokens = histogram(
            VLLM + "iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            _TOKEN_BUCKETS,
        )
        if cache_info:  # per replica too: the merged /metrics must not repeat a series
            info = {k: str(v) for k, v in cache_info.items()} | lv
            Gauge(
                VLLM + "cache_config_info",
                "Information of the engine's KV cache config.",
                sorted(info),
                registry=reg,
            ).labels(**info).set(1)
        # ours alone
        self.kv_events_publishing = gauge(
            PREFIX + "kv_events_publishing",
            "1 while a router reads this replica's KV events and it publishes them.",
        )
        self.resumed_requests = counter(
            PREFIX + "resumed_requests", "Requests resumed here from another replica (migration)."
        )
        self.step_joined_requests = counter(
            PREFIX + "step_joined_requests",
            "Prompts that joined a step of decodes under way instead of waiting for its end "
            "(step_join).",
        )
        self.first_text_holds = counter(
            PREFIX + "first_text_holds",
            "Steps that ran decodes alone because a request's next token would bring its "
            "client's first text (first_text_priority); prompts waited for the next step.",
        )
        self.request_num_preemptions = histogram(
            PREFIX + "request_num_preemptions",
            "Preemptions each finished request went through.",
            _COUNT_BUCKETS,
        )
        self.step_duration = histogram(
            PREFIX + "engine_step_duration_seconds",
            "One engine step: schedule, model, sample (where the engine runs).",
            _STEP_BUCKETS,
        )
        # KV tiers and transfer between replicas (replica/kv_tier.py, kv_transfer.py)
        self.kv_tier_saves = counter(
            PREFIX + "kv_tier_saves", "KV blocks evicted from the pool saved to a tier."
        )
        self.kv_tier_restores = counter(
            PREFIX + "kv_tier_restores",
            "KV blocks copied back from a tier (or an import) into the pool.",
        )
        self.kv_tier_hits = counter(
            PREFIX + "kv_tier_hit_tokens", "Prompt tokens whose KV came from a tier or an import."
        )
        self.kv_tier_blocks = gauge(
            PREFIX + "kv_tier_blocks", "KV blocks held in the tiers below the pool."
        )
        self.kv_tier_bytes = gauge(
            PREFIX + "kv_tier_bytes", "Bytes those blocks take (this rank's)."
        )
        self.kv_blocks_imported = counter(
            PREFIX + "kv_blocks_imported", "KV blocks fetched from replicas."
        )
        self.kv_bytes_imported = counter(PREFIX + "kv_bytes_imported", "Bytes of those blocks.")
        self.kv_export_calls = counter(
            PREFIX + "kv_export_calls", "KV exports other replicas asked for."
        )
        self.kv_blocks_exported = counter(
            PREFIX + "kv_blocks_exported", "KV blocks sent to replicas."
        )
        self.kv_bytes_exported = counter(PREFIX + "kv_bytes_exported", "Bytes of those blocks.")
        self.kv_fetch_seconds = histogram(
            PREFIX + "kv_fetch_seconds", "A KV fetch from another replica: call, transfer, import.",
            _TTFT_BUCKETS,
        )  # fmt: skip
        self._kv_fetch_failures = Counter(
            PREFIX + "kv_fetch_failures",
            "KV fetches that brought less than asked, by reason (the rest is recomputed).",
            (*LABELS, "reason"),
            registry=reg,
        )
        self.kv_block_bytes = 0  # set by the replica once known (kv_tier_bytes)
        self._arrival: dict[str, float] = {}
        self._scheduled: dict[str, float] = {}  # first scheduled
        self._first_token: dict[str, float] = {}
        self._last_token: dict[str, float] = {}
        self._max_tokens: dict[str, int] = {}  # from taken(), until the end
        self._traced: dict[str, tracing.EngineTrace] = {}  # traced requests (tracing on)
        # counters fed from the scheduler's running totals: (counter, SchedulerStats field)
        self._totals = (
            (self.num_preemptions, "num_preemptions_total"),
            (self.prefix_cache_queries, "prefix_cache_queries"),
            (self.prefix_cache_hits, "prefix_cache_hits"),
            (self.spec_decode_num_drafts, "spec_num_drafts"),
            (self.spec_decode_num_draft_tokens, "spec_num_draft_tokens"),
            (self.spec_decode_num_accepted_tokens, "spec_num_accepted_tokens"),
            (self.resumed_requests, "num_resumed_total"),
            (self.step_joined_requests, "num_joined_total"),
            (self.first_text_holds, "num_first_text_holds_total"),
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

    def taken(self, request) -> None:
        """The replica took `request` (an EngineRequest): keep its max_tokens (and its trace
        context, when traced) for its end."""
        rid = request.request_id
        if len(self._max_tokens) >= _MAX_TAKEN:
            old = next(iter(self._max_tokens))
            self._max_tokens.pop(old, None)
            self._traced.pop(old, None)
        self._max_tokens[rid] = request.sampling.max_tokens
        traced = tracing.engine_request_traced(request, self.model_name)
        if traced is not None:
            self._traced[rid] = traced

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
                self._first_token[rid] = now
                scheduled = self._scheduled.get(rid)
                if scheduled is not None:
                    self.prefill_time.observe(now - scheduled)
                self.prompt_tokens.inc(out.num_prompt_tokens)
            elif n:
                gap = (now - last) / n
                for _ in range(n):
                    self.itl.observe(gap)
                    self.tpot.observe(gap)
            self.generation_tokens.inc(n)
            self._last_token[rid] = now
            if out.finished:
                self._finished(out, now, arrival)
        self.update_gauges(report.stats)

    def _finished(self, out, now: float, arrival: float) -> None:
        """A request's end: vLLM's per-request histograms (and its engine spans, traced)."""
        rid = out.request_id
        scheduled = self._scheduled.get(rid, arrival)
        first = self._first_token.get(rid, now)
        decode = now - first
        generated = out.num_output_tokens
        self.e2e.observe(now - arrival)
        self.inference_time.observe(now - scheduled)
        self.decode_time.observe(decode)
        self.request_tpot.observe(decode / (generated - 1) if generated > 1 else 0.0)
        self.request_prompt_tokens.observe(out.num_prompt_tokens)
        self.request_generation_tokens.observe(generated)
        self.request_max_generation_tokens.observe(generated)
        max_tokens = self._max_tokens.get(rid)
        if max_tokens:
            self.request_max_tokens.observe(max_tokens)
        self.request_success(out.finish_reason).inc()
        self.request_num_preemptions.observe(out.num_preemptions)
        traced = self._traced.get(rid)
        if traced is not None:
            try:
                tracing.engine_spans(
                    traced, arrival=arrival, scheduled=scheduled, first_token=first,
                    finished=now, prompt_tokens=out.num_prompt_tokens,
                    completion_tokens=generated, finish_reason=out.finish_reason,
                )  # fmt: skip
            except Exception:  # tracing must not break the metrics or the engine
                pass
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        """Drop what is kept of a request that ended (finished, aborted)."""
        for kept in (
            self._arrival, self._scheduled, self._first_token, self._last_token,
            self._max_tokens, self._traced,
        ):  # fmt: skip
            kept.pop(rid, None)

    def update_gauges(self, stats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_usage)
        self.gpu_cache_usage_perc.set(stats.kv_usage)
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
