"""The Grafana dashboard and Prometheus alert rules reference metrics the replicas really
export (vLLM's `vllm:` names, ours `stepserve:`), vLLM's own dashboard queries resolve against
a replica's exposition, and the /metrics merge keeps one family per name."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import yaml
from prometheus_client.parser import text_string_to_metric_families

from replica.metrics import EngineMetrics, merge_expositions

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
METRIC_RE = re.compile(r"(?:vllm|stepserve):[a-z0-9_]+")


def exported_sample_names() -> set[str]:
    metrics = EngineMetrics(SimpleNamespace(step_listeners=[]), "m", "r0")
    metrics.request_success("stop").inc()
    names = set()
    for family in metrics.registry.collect():
        names.update(sample.name for sample in family.samples)
    return names


def test_dashboard_panels_cover_the_operator_questions():
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    titles = " | ".join(p["title"] for p in dash["panels"]).lower()
    for needed in (
        "queue depth",
        "running",
        "kv-cache usage",
        "preemption rate",
        "time to first token",
        "inter-token latency",
        "end-to-end latency",
        "tokens/s per replica",
    ):
        assert needed in titles, needed
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert any("histogram_quantile(0.99" in e for e in exprs)
    assert any("histogram_quantile(0.5" in e for e in exprs)


def test_dashboard_and_alerts_reference_only_exported_metrics():
    exported = exported_sample_names()
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dash["templating"]["list"] if "query" in v]
    rules = yaml.safe_load((DEPLOY / "prometheus-alerts.yaml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    names = set()
    for expr in exprs:
        assert expr.count("(") == expr.count(")"), expr
        for name in METRIC_RE.findall(expr):
            assert name in exported, f"{name} in {expr!r} is not exported"
            names.add(name)
    # the engine's metrics are read under vLLM's names, never under ours
    assert all(n.startswith("vllm:") for n in names), names


# Panel expressions of the kind vLLM's Grafana dashboard runs (written here as examples, in its
# style: a `$model_name` variable, `sum by(le)` over buckets, rates of the counters): each
# metric selector must find series in a replica's exposition.
VLLM_DASHBOARD_QUERIES = (
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.95, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.5, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'avg(vllm:kv_cache_usage_perc{model_name="$model_name"})',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_params_max_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'rate(vllm:prefix_cache_hits_total{model_name="$model_name"}[$__rate_interval]) / rate(vllm:prefix_cache_queries_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:num_preemptions_total{model_name="$model_name"}[$__rate_interval])',
    'vllm:gpu_cache_usage_perc{model_name="$model_name"}',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
    'vllm:cache_config_info',
)  # fmt: skip
SELECTOR_RE = re.compile(r"(vllm:[a-z0-9_]+)(?:\{([^}]*)\})?")
MATCHER_RE = re.compile(r'([a-z_]+)="([^"]*)"')


def served_exposition(model: str = "SmolLM2") -> str:
    """A replica's exposition after one finished request (every histogram has a sample)."""
    from replica.engine.wire import StepReport
    from replica.request import EngineRequest, RequestOutput, SamplingParams
    from replica.scheduler import SchedulerStats

    metrics = EngineMetrics(
        SimpleNamespace(step_listeners=[]), model, "r0", max_model_len=2048,
        cache_info={"block_size": 16, "num_gpu_blocks": 64, "enable_prefix_caching": True},
    )  # fmt: skip
    metrics.taken(EngineRequest([1, 2, 3], SamplingParams(max_tokens=4), "q"))
    stats = SchedulerStats(0, 0, 0.0, 0, 0, 0)

    def step(end, first, outs):
        report = StepReport(end, 0.01, 3, first, [], stats)
        metrics.observe(report, outs)

    step(10.0, [("q", 9.5)], [RequestOutput("q", [7], "a", 3, 1)])
    step(10.1, [], [RequestOutput("q", [8, 9], "bc", 3, 3, finish_reason="stop")])
    return metrics.exposition().decode()


def test_vllm_dashboard_queries_resolve_against_our_exposition():
    families = list(text_string_to_metric_families(served_exposition("SmolLM2")))
    samples = [s for f in families for s in f.samples]
    for query in VLLM_DASHBOARD_QUERIES:
        selectors = SELECTOR_RE.findall(query.replace("$model_name", "SmolLM2"))
        assert selectors, query
        for name, matchers in selectors:
            wanted = dict(MATCHER_RE.findall(matchers))
            found = [
                s for s in samples
                if s.name == name and all(s.labels.get(k) == v for k, v in wanted.items())
            ]  # fmt: skip
            assert found, f"{name}{{{matchers}}} of {query!r} finds no series"


def test_engine_metrics_are_vllms_names_types_and_labels():
    """vLLM V1's metric names with its types, label model_name (and our replica), and no
    engine metric left under `stepserve:` beside its `vllm:` twin."""
    families = {f.name: f for f in text_string_to_metric_families(served_exposition("m"))}
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:gpu_cache_usage_perc": "gauge",
        "vllm:num_preemptions": "counter",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:spec_decode_num_drafts": "counter",
        "vllm:spec_decode_num_draft_tokens": "counter",
        "vllm:spec_decode_num_accepted_tokens": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:time_per_output_token_seconds": "histogram",
        "vllm:request_time_per_output_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_inference_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram",
        "vllm:request_decode_time_seconds": "histogram",
        "vllm:request_prompt_tokens": "histogram",
        "vllm:request_generation_tokens": "histogram",
        "vllm:request_params_max_tokens": "histogram",
        "vllm:request_max_num_generation_tokens": "histogram",
        "vllm:iteration_tokens_total": "histogram",
        "vllm:cache_config_info": "gauge",
    }
    for name, kind in expected.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)
        for sample in families[name].samples:
            assert sample.labels["model_name"] == "m", sample
            assert sample.labels["replica"] == "r0", sample
    ours = {n for n in families if n.startswith("stepserve:")}
    assert ours == {
        "stepserve:kv_events_publishing", "stepserve:resumed_requests",
        "stepserve:request_num_preemptions", "stepserve:engine_step_duration_seconds",
        # KV tiers and transfer between replicas (vLLM has no such metrics)
        "stepserve:kv_tier_saves", "stepserve:kv_tier_restores", "stepserve:kv_tier_hit_tokens",
        "stepserve:kv_tier_blocks", "stepserve:kv_tier_bytes", "stepserve:kv_blocks_imported",
        "stepserve:kv_bytes_imported", "stepserve:kv_export_calls",
        "stepserve:kv_blocks_exported", "stepserve:kv_bytes_exported",
        "stepserve:kv_fetch_seconds", "stepserve:kv_fetch_failures",
        "stepserve:step_joined_requests",  # prompts that joined a step under way
        "stepserve:first_text_holds",  # steps kept to decodes for a first text
    }  # fmt: skip
    assert not {n.removeprefix("stepserve:") for n in ours} & {
        n.removeprefix("vllm:") for n in families
    }
    info = families["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == "64"
    # vLLM's buckets: the TTFT histogram's top bucket, 1-2-5 token counts up to max_model_len
    buckets = {s.labels["le"] for s in families["vllm:time_to_first_token_seconds"].samples
               if s.name.endswith("_bucket")}  # fmt: skip
    assert "2560.0" in buckets
    tokens = [s.labels["le"] for s in families["vllm:request_prompt_tokens"].samples
              if s.name.endswith("_bucket")]  # fmt: skip
    assert tokens[:4] == ["1.0", "2.0", "5.0", "10.0"] and "2000.0" in tokens


def test_per_request_histograms_split_the_request_like_vllm():
    """queue = scheduled - arrival, prefill = first token - scheduled, decode = finish - first
    token, inference = prefill + decode, e2e = finish - arrival; the token counts and
    max_tokens of the request."""
    families = {f.name: f for f in text_string_to_metric_families(served_exposition("m"))}

    def value(name, suffix="_sum"):
        (sample,) = [s for s in families[name].samples if s.name == name + suffix]
        return sample.value

    # arrival 9.5, scheduled at the first step's start 9.99, first token 10.0, finish 10.1
    assert abs(value("vllm:request_queue_time_seconds") - 0.49) < 1e-6
    assert abs(value("vllm:request_prefill_time_seconds") - 0.01) < 1e-6
    assert abs(value("vllm:request_decode_time_seconds") - 0.1) < 1e-6
    assert abs(value("vllm:request_inference_time_seconds") - 0.11) < 1e-6
    assert abs(value("vllm:e2e_request_latency_seconds") - 0.6) < 1e-6
    assert abs(value("vllm:request_time_per_output_token_seconds") - 0.05) < 1e-6
    assert value("vllm:request_prompt_tokens") == 3
    assert value("vllm:request_generation_tokens") == 3
    assert value("vllm:request_params_max_tokens") == 4
    assert value("vllm:inter_token_latency_seconds", "_count") == 2
    assert value("vllm:time_per_output_token_seconds", "_count") == 2


def test_alert_rules_cover_preemptions_queue_and_ttft_slo():
    rules = yaml.safe_load((DEPLOY / "prometheus-alerts.yaml").read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    assert "num_preemptions_total" in alerts["StepservePreemptionRateHigh"]["expr"]
    assert "num_requests_waiting" in alerts["StepserveQueueGrowing"]["expr"]
    assert "time_to_first_token_seconds_bucket" in alerts["StepserveTTFTSLOViolated"]["expr"]
    for rule in alerts.values():
        assert rule["for"] and rule["labels"]["severity"] in {"warning", "critical"}


def test_merge_keeps_one_family_and_every_replica():
    texts = []
    for replica in ("a", "b"):
        metrics = EngineMetrics(
            SimpleNamespace(step_listeners=[]), "m", replica, cache_info={"block_size": 16}
        )
        metrics.generation_tokens.inc(3 if replica == "a" else 4)
        texts.append(metrics.exposition())
    merged = merge_expositions(texts).decode()
    assert merged.count("# TYPE vllm:generation_tokens_total counter") == 1
    assert "_created" not in merged
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    samples = [s for s in families["vllm:generation_tokens"].samples if s.name.endswith("_total")]
    assert {s.labels["replica"]: s.value for s in samples} == {"a": 3.0, "b": 4.0}
    # no series twice in the merge (a scraper rejects that): each replica's own label set
    series = [
        (s.name, tuple(sorted(s.labels.items()))) for f in families.values() for s in f.samples
    ]
    assert len(series) == len(set(series))
    assert {s.labels["replica"] for s in families["vllm:cache_config_info"].samples} == {"a", "b"}


def test_queue_time_ends_when_the_first_step_starts_and_ttft_when_it_ends(tiny_llama_dir):
    """vLLM's request_queue_time: arrival to the start of the first step that schedules the
    request; the first token comes at that step's end (TTFT), one step later."""
    import time

    from replica.config import EngineConfig
    from replica.engine import Engine
    from replica.request import SamplingParams

    engine = Engine(
        EngineConfig(model=str(tiny_llama_dir), device="cpu", block_size=4, num_kv_blocks=32)
    )
    metrics = EngineMetrics(engine, "m", "r0")
    steps: list[float] = []
    engine.step_listeners.append(lambda _e, _s, _o, elapsed: steps.append(elapsed))
    waited = 0.25
    engine.add_request(
        "q", [5, 6, 7, 8], SamplingParams(max_tokens=2), arrival_time=time.monotonic() - waited
    )
    while engine.has_unfinished():
        engine.step()
    engine.shutdown()
    labels = {"model_name": "m", "replica": "r0"}

    def total(name: str) -> float:
        return metrics.registry.get_sample_value(f"vllm:{name}_sum", labels)

    queue, ttft = total("request_queue_time_seconds"), total("time_to_first_token_seconds")
    assert waited <= queue < ttft
    assert abs((ttft - queue) - steps[0]) < 0.005  # the first step's own duration


def test_prefill_time_is_the_first_step_and_step_duration_counts_every_step(tiny_llama_dir):
    """request_prefill_time (vLLM's name): first scheduled to first token, the queue left out;
    engine_step_duration: one sample per step that scheduled tokens, summing their times. A
    served engine's step times beside the client's TTFT say how much of it is the engine."""
    import time

    from replica.config import EngineConfig
    from replica.engine import Engine
    from replica.request import SamplingParams

    engine = Engine(
        EngineConfig(
            model=str(tiny_llama_dir), device="cpu", block_size=4, num_kv_blocks=32,
            num_speculative_tokens=0,
        )
    )  # fmt: skip
    metrics = EngineMetrics(engine, "m", "r0")
    steps: list[float] = []
    engine.step_listeners.append(lambda _e, _s, _o, elapsed: steps.append(elapsed))
    engine.add_request(
        "q", [5, 6, 7, 8], SamplingParams(max_tokens=3), arrival_time=time.monotonic() - 0.3
    )
    while engine.has_unfinished():
        engine.step()
    engine.shutdown()
    labels = {"model_name": "m", "replica": "r0"}

    def sample(name: str, suffix: str) -> float:
        prefix = "stepserve:" if name.startswith("engine_step") else "vllm:"
        return metrics.registry.get_sample_value(f"{prefix}{name}_{suffix}", labels)

    assert sample("request_prefill_time_seconds", "count") == 1
    prefill = sample("request_prefill_time_seconds", "sum")
    assert abs(prefill - steps[0]) < 0.005 and prefill < 0.3  # no queue time in it
    assert sample("engine_step_duration_seconds", "count") == len(steps) == 3
    assert abs(sample("engine_step_duration_seconds", "sum") - sum(steps)) < 1e-6
    assert metrics._scheduled == {}  # nothing kept after the request ended
