"""OpenTelemetry tracing helpers (replica/tracing.py), without Ray: off imports nothing of
OpenTelemetry; the ingress continues a caller's W3C traceparent; its request, admission and
routing spans; the engine's llm_request span and its queue, prefill and decode children made
from a request's recorded times, all checked through an in-memory exporter."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from replica import tracing
from replica.engine.wire import StepReport
from replica.metrics import EngineMetrics
from replica.request import EngineRequest, RequestOutput, SamplingParams
from replica.scheduler import SchedulerStats

ROOT = Path(__file__).resolve().parents[2]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
SAMPLED = f"00-{TRACE_ID}-{PARENT_ID}-01"
NOT_SAMPLED = f"00-{TRACE_ID}-{PARENT_ID}-00"


@pytest.fixture
def spans():
    """Tracing on in this process, into an in-memory exporter; off again after."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    config = tracing.TracingConfig(otlp_traces_endpoint="http://127.0.0.1:9/v1/traces")
    tracing.use_tracer(config, tracing.make_provider(config, exporter, batch=False))
    yield exporter
    tracing.reset()


def by_name(exporter) -> dict:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_off_imports_nothing_of_opentelemetry():
    """With no endpoint, the modules and every hook run without importing opentelemetry (Ray
    Serve imports some of it itself: this process imports no Ray)."""
    code = textwrap.dedent(
        """
        import asyncio, sys
        from types import SimpleNamespace
        from replica import tracing
        from replica.metrics import EngineMetrics
        from replica.request import EngineRequest, SamplingParams
        tracing.configure(None)
        tracing.configure({"otlp_traces_endpoint": None})
        req = EngineRequest([1, 2], SamplingParams(), "q", traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
        m = EngineMetrics(SimpleNamespace(step_listeners=[]), "m", "r0")
        m.taken(req)
        assert tracing.traced_jobs([(0, req)], "m") == [(0, req)]
        tracing.routing_span(req, 0.0, "r1", "load", 2)

        class Core:
            @tracing.traced_request
            async def serve(self, request):
                return "ok"

            @tracing.traced_admission
            def admit(self, req, deadline_s):
                return 0.5

        assert asyncio.run(Core().serve(SimpleNamespace())) == "ok"
        assert Core().admit(req, 1.0) == 0.5
        loaded = [name for name in sys.modules if name.startswith("opentelemetry")]
        assert not loaded, loaded
        assert m._traced == {}
        """
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_config_checks_the_endpoint_and_adds_the_traces_path():
    assert tracing.traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert tracing.traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert tracing.traces_url("https://x/otlp/v1/traces") == "https://x/otlp/v1/traces"
    with pytest.raises(ValidationError, match="must be an http"):
        tracing.TracingConfig(otlp_traces_endpoint="collector:4318")
    with pytest.raises(ValidationError):
        tracing.TracingConfig(otlp_traces_endpoint="http://c:4318", sample_ratio=1.5)
    assert not tracing.TracingConfig().enabled
    assert not tracing.TracingConfig(otlp_traces_endpoint="").enabled


def test_traceparent_is_continued_and_a_bad_one_starts_a_root(spans):
    t = tracing.tracer()
    ctx = tracing.parent_context({"traceparent": SAMPLED, "tracestate": "vendor=1"})
    with t.start_as_current_span("child", context=ctx) as span:
        sent = tracing.traceparent_of(span)
    child = by_name(spans)["child"]
    assert f"{child.context.trace_id:032x}" == TRACE_ID
    assert f"{child.parent.span_id:016x}" == PARENT_ID
    assert child.context.trace_state.get("vendor") == "1"
    assert sent == f"00-{TRACE_ID}-{child.context.span_id:016x}-01"
    for bad in ("garbage", "00-" + "0" * 32 + "-" + PARENT_ID + "-01", None):
        headers = {} if bad is None else {"traceparent": bad}
        with t.start_as_current_span("root", context=tracing.parent_context(headers)) as span:
            assert f"{span.get_span_context().trace_id:032x}" != TRACE_ID
            assert span.parent is None


class FakeResponse:
    def __init__(self, status_code=200, body=None):
        self.status_code = status_code
        if body is not None:
            self.body_iterator = body


def http_request(traceparent: str | None = None, path="/v1/chat/completions"):
    headers = {} if traceparent is None else {"traceparent": traceparent}
    return SimpleNamespace(method="POST", url=SimpleNamespace(path=path), headers=headers)


class Core:
    """The shape of IngressCore's two decorated methods."""

    def __init__(self, response=None, error=None):
        self.response, self.error, self.jobs = response, error, None

    @tracing.traced_request
    async def serve_request(self, request, chat: bool):
        self.admit_by_wait(SimpleNamespace(priority=3), 30.0)
        job = EngineRequest([1, 2, 3], SamplingParams(max_tokens=5), "q")
        self.jobs = tracing.traced_jobs([(0, job), (1, job)], "tiny")
        if self.error is not None:
            raise self.error
        return self.response

    @tracing.traced_admission
    def admit_by_wait(self, req, deadline_s):
        return 0.25


def test_request_span_continues_the_callers_trace_with_admission_and_jobs(spans):
    core = Core(FakeResponse(200))
    asyncio.run(core.serve_request(http_request(SAMPLED), True))
    got = by_name(spans)
    server = got["POST /v1/chat/completions"]
    assert f"{server.context.trace_id:032x}" == TRACE_ID
    assert f"{server.parent.span_id:016x}" == PARENT_ID
    assert server.attributes["http.route"] == "/v1/chat/completions"
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["gen_ai.request.model"] == "tiny"
    assert server.attributes["gen_ai.request.n"] == 2
    admission = got["admission"]
    assert admission.parent.span_id == server.context.span_id
    assert admission.attributes["stepserve.admitted"] is True
    assert admission.attributes["stepserve.expected_wait_s"] == 0.25
    assert admission.attributes["stepserve.request.priority"] == 3
    expected = f"00-{TRACE_ID}-{server.context.span_id:016x}-01"
    assert [job.traceparent for _, job in core.jobs] == [expected, expected]


def test_a_refused_request_records_its_status(spans):
    class Refused(Exception):
        status_code = 429

    with pytest.raises(Refused):
        asyncio.run(Core(error=Refused("busy")).serve_request(http_request(), False))
    server = by_name(spans)["POST /v1/chat/completions"]
    assert server.parent is None  # no traceparent: a new root
    assert server.attributes["http.response.status_code"] == 429


def test_a_stream_span_ends_with_the_stream(spans):
    async def body():
        for chunk in (b"data: 1\n\n", b"data: [DONE]\n\n"):
            yield chunk

    async def run():
        response = await Core(FakeResponse(200, body())).serve_request(http_request(), True)
        assert "POST /v1/chat/completions" not in by_name(spans)  # still open
        return [chunk async for chunk in response.body_iterator]

    assert len(asyncio.run(run())) == 2
    server = by_name(spans)["POST /v1/chat/completions"]
    (event,) = [e for e in server.events if e.name == "stream.end"]
    assert event.attributes["stepserve.stream.chunks"] == 2
    assert event.attributes["completed"] is True


def test_a_trace_not_sampled_sends_no_traceparent(spans):
    core = Core(FakeResponse(200))
    asyncio.run(core.serve_request(http_request(NOT_SAMPLED), True))
    assert spans.get_finished_spans() == ()
    assert [job.traceparent for _, job in core.jobs] == [None, None]


def test_routing_span(spans):
    request = SimpleNamespace(request_id="abc", traceparent=SAMPLED)
    tracing.routing_span(request, 1000.0, "replica-1", "cache", 3)
    tracing.routing_span(SimpleNamespace(request_id="x", traceparent=None), 1.0, "r", None, 1)
    (span,) = spans.get_finished_spans()
    assert span.name == "routing" and f"{span.parent.span_id:016x}" == PARENT_ID
    assert span.start_time == 1000 * 10**9
    assert span.attributes["stepserve.routing.replica"] == "replica-1"
    assert span.attributes["stepserve.routing.reason"] == "cache"
    assert span.attributes["stepserve.routing.candidates"] == 3


def test_engine_spans_from_the_requests_recorded_times(spans):
    """The replica's llm_request span (under the ingress span the traceparent names) and its
    queue, prefill and decode children, made at the request's end with explicit times."""
    metrics = EngineMetrics(SimpleNamespace(step_listeners=[]), "tiny", "r0")
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9)
    metrics.taken(EngineRequest([1, 2, 3, 4], params, "q", traceparent=SAMPLED))
    metrics.taken(EngineRequest([1, 2], SamplingParams(), "untraced"))
    stats = SchedulerStats(0, 0, 0.0, 0, 0, 0)
    # arrival 99.5; first step 99.9-100.0 (first token); last token at 100.2
    metrics.observe(
        StepReport(100.0, 0.1, 4, [("q", 99.5), ("untraced", 99.5)], [], stats),
        [RequestOutput("q", [5], "a", 4, 1), RequestOutput("untraced", [9], "z", 2, 1)],
    )
    assert "q" in metrics._traced and "untraced" not in metrics._traced
    assert spans.get_finished_spans() == ()  # nothing before the end
    metrics.observe(
        StepReport(100.2, 0.1, 1, [], [], stats),
        [RequestOutput("q", [6, 7], "bc", 4, 3, finish_reason="length")],
    )
    got = by_name(spans)
    assert set(got) == {"llm_request", "queue", "prefill", "decode"}
    llm = got["llm_request"]
    assert f"{llm.context.trace_id:032x}" == TRACE_ID
    assert f"{llm.parent.span_id:016x}" == PARENT_ID
    a = llm.attributes
    assert a["gen_ai.request.id"] == "q" and a["gen_ai.response.model"] == "tiny"
    assert a["gen_ai.usage.prompt_tokens"] == 4 and a["gen_ai.usage.completion_tokens"] == 3
    assert a["gen_ai.request.max_tokens"] == 7
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == 0.9
    assert a["gen_ai.request.n"] == 1
    assert abs(a["gen_ai.latency.time_in_queue"] - 0.4) < 1e-9
    assert abs(a["gen_ai.latency.time_to_first_token"] - 0.5) < 1e-9
    assert abs(a["gen_ai.latency.e2e"] - 0.7) < 1e-9
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)

    def seconds(span):
        return (span.end_time - span.start_time) / 1e9

    for name, length in (("queue", 0.4), ("prefill", 0.1), ("decode", 0.2)):
        span = got[name]
        assert span.parent.span_id == llm.context.span_id
        assert abs(seconds(span) - length) < 1e-6, name
    assert got["queue"].start_time == llm.start_time
    assert got["queue"].end_time == got["prefill"].start_time
    assert got["prefill"].end_time == got["decode"].start_time
    assert got["decode"].end_time == llm.end_time
    assert metrics._traced == {}  # forgotten at its end


def test_cli_flag_sets_the_tracing_section():
    from cluster.app import ingress_settings
    from cluster.cli import build_config, make_parser

    args = make_parser().parse_args(["serve", "--otlp-traces-endpoint", "http://collector:4318"])
    config = build_config(args)
    assert config.tracing.otlp_traces_endpoint == "http://collector:4318"
    assert config.tracing.service_name == "stepserve" and config.tracing.sample_ratio == 1.0
    assert ingress_settings(config).tracing == config.tracing
    assert build_config(make_parser().parse_args(["serve"])).tracing.enabled is False
    with pytest.raises(ValidationError, match="otlp_traces_endpoint"):
        build_config(make_parser().parse_args(["serve", "--otlp-traces-endpoint", "nope"]))
