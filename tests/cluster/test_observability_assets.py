"""The Grafana dashboard and Prometheus alert rules reference metrics the replicas really
export, and the /metrics merge keeps one family per name."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import yaml
from prometheus_client.parser import text_string_to_metric_families

from replica.metrics import EngineMetrics, merge_expositions

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
METRIC_RE = re.compile(r"stepserve:[a-z0-9_]+")


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
    rules = yaml.safe_load((DEPLOY / "prometheus-alerts.yaml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    for expr in exprs:
        assert expr.count("(") == expr.count(")"), expr
        for name in METRIC_RE.findall(expr):
            assert name in exported, f"{name} in {expr!r} is not exported"


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
        metrics = EngineMetrics(SimpleNamespace(step_listeners=[]), "m", replica)
        metrics.generation_tokens.inc(3 if replica == "a" else 4)
        texts.append(metrics.exposition())
    merged = merge_expositions(texts).decode()
    assert merged.count("# TYPE stepserve:generation_tokens_total counter") == 1
    assert "_created" not in merged
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    samples = [
        s for s in families["stepserve:generation_tokens"].samples if s.name.endswith("_total")
    ]
    assert {s.labels["replica"]: s.value for s in samples} == {"a": 3.0, "b": 4.0}


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
        return metrics.registry.get_sample_value(f"stepserve:{name}_sum", labels)

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
        return metrics.registry.get_sample_value(f"stepserve:{name}_{suffix}", labels)

    assert sample("request_prefill_time_seconds", "count") == 1
    prefill = sample("request_prefill_time_seconds", "sum")
    assert abs(prefill - steps[0]) < 0.005 and prefill < 0.3  # no queue time in it
    assert sample("engine_step_duration_seconds", "count") == len(steps) == 3
    assert abs(sample("engine_step_duration_seconds", "sum") - sum(steps)) < 1e-6
    assert metrics._scheduled == {}  # nothing kept after the request ended
