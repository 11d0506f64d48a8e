"""OpenTelemetry tracing, off unless `tracing.otlp_traces_endpoint` is set (ClusterConfig,
`stepserve serve --otlp-traces-endpoint`). Off, nothing here imports opentelemetry and each
hook costs one check of a module global.

On, every process that serves (the ingress replicas, the LLM replicas) sets up one tracer
provider lazily: spans go to the OTLP/HTTP (protobuf) endpoint through a BatchSpanProcessor,
flushed when the process ends. The ingress continues the W3C `traceparent` (and `tracestate`)
of the HTTP request, or starts a trace, with its request span (route, model, status), an
admission span and a routing span per send (the replica chosen and why); the request span's
context travels to the replica in `EngineRequest.traceparent`, where the engine's
`llm_request` span and its queue, prefill and decode spans are made when the request finishes,
from its recorded times (replica/metrics.py), with vLLM's `gen_ai.*` attribute names. A request
whose trace is not sampled carries no traceparent: the replica does nothing for it."""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
OTLP_TRACES_PATH = "/v1/traces"
# a batch of spans goes out at least this often (the SDK's default is 5 s)
EXPORT_DELAY_MS = 1000


class TracingConfig(BaseModel):
    """ClusterConfig's `tracing` section."""

    model_config = ConfigDict(extra="forbid")

    otlp_traces_endpoint: str | None = Field(
        default=None,
        description="OTLP/HTTP (protobuf) traces endpoint, e.g. http://otel-collector:4318 "
        "(/v1/traces is added when the URL has no path); null: tracing off (vLLM's "
        "--otlp-traces-endpoint)",
    )
    service_name: str = Field(
        default="stepserve", min_length=1, description="the spans' service.name resource"
    )
    sample_ratio: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="share of new traces sampled (a request's incoming traceparent decides "
        "for its own trace)",
    )

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value:
            traces_url(value)
        return value or None

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_traces_endpoint)


def traces_url(endpoint: str) -> str:
    """The URL spans are posted to: `endpoint`, with /v1/traces when it has no path."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"tracing.otlp_traces_endpoint must be an http(s) URL, got {endpoint!r}")
    if parts.path in ("", "/"):
        return endpoint.rstrip("/") + OTLP_TRACES_PATH
    return endpoint


# -- the process's tracer --------------------------------------------------------------------
_config: TracingConfig | None = None  # set when on; None: every hook returns at once
_tracer = None
_provider = None
_lock = threading.Lock()


def configure(config: TracingConfig | dict | None) -> None:
    """Turn tracing on in this process (or leave it off: None, no endpoint). The provider is
    built at the first span; a second call with another config is ignored (one per process)."""
    global _config
    if config is None:
        return
    if isinstance(config, dict):
        config = TracingConfig.model_validate(config)
    if not config.enabled or _config is not None:
        return
    traces_url(config.otlp_traces_endpoint)  # a bad URL fails here, not at the first span
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            "tracing.otlp_traces_endpoint is set but OpenTelemetry is not installed "
            f"({exc}): pip install 'stepserve[tracing]'"
        ) from exc
    _config = config


def enabled() -> bool:
    return _config is not None


def tracer():
    """This process's tracer (built once, on first use)."""
    global _tracer, _provider
    if _tracer is not None:
        return _tracer
    with _lock:
        if _tracer is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            _provider = make_provider(
                _config, OTLPSpanExporter(traces_url(_config.otlp_traces_endpoint))
            )
            atexit.register(shutdown)
            _tracer = _provider.get_tracer("stepserve")
    return _tracer


def make_provider(config: TracingConfig, exporter, batch: bool = True):
    """A tracer provider that samples `config.sample_ratio` of new traces (children follow their
    parent's decision) and hands finished spans to `exporter`."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        resource=Resource.create({"service.name": config.service_name}),
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
    )
    if batch:
        processor = BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS)
    else:
        processor = SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    return provider


def use_tracer(config: TracingConfig, provider) -> None:
    """Tests: trace to `provider` (e.g. over an in-memory exporter) in this process."""
    global _config, _tracer, _provider
    _config, _provider, _tracer = config, provider, provider.get_tracer("stepserve")


def reset() -> None:
    """Tests: tracing off again in this process."""
    global _config, _tracer, _provider
    _config = _tracer = _provider = None


def shutdown() -> None:
    """Flush the spans still batched (a replica or ingress going away)."""
    provider = _provider
    if provider is not None:
        try:
            provider.force_flush(timeout_millis=5000)
        except Exception as exc:  # tracing must not break a shutdown
            logger.debug("flushing spans failed: %s", exc)


# -- W3C trace context -------------------------------------------------------------------------
def parent_context(headers):
    """The OpenTelemetry context of the caller's `traceparent`/`tracestate` headers (a mapping,
    e.g. Starlette's case-insensitive Headers); an empty one (a new root) when absent or not
    valid W3C trace context."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(headers)


def traceparent_of(span) -> str | None:
    """`span`'s W3C traceparent, for a request sent on; None when it is not sampled (the
    replica then does nothing for it)."""
    ctx = span.get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _child_context(traceparent: str):
    return parent_context({TRACEPARENT: traceparent})


def _wall_ns(monotonic_s: float, offset_ns: int) -> int:
    return int(monotonic_s * 1e9) + offset_ns


def _monotonic_offset_ns() -> int:
    """Add to a time.monotonic() in ns to get the wall clock in ns (span timestamps)."""
    return time.time_ns() - time.monotonic_ns()


# -- the ingress's spans -----------------------------------------------------------------------
def traced_request(fn):
    """Decorates IngressCore.serve_request(self, request, ...): the request's SERVER span,
    continuing the caller's trace, current while it runs (the admission span and the jobs'
    traceparent hang under it); a stream's span ends with the stream (event `stream.end`)."""

    @functools.wraps(fn)
    async def wrapper(self, request, *args, **kwargs):
        if _config is None:
            return await fn(self, request, *args, **kwargs)
        return await _serve_traced(fn, self, request, args, kwargs)

    return wrapper


async def _serve_traced(fn, self, request, args, kwargs):
    from opentelemetry import context, trace

    route = request.url.path
    span = tracer().start_span(
        f"{request.method} {route}",
        context=parent_context(request.headers),
        kind=trace.SpanKind.SERVER,
        attributes={"http.request.method": request.method, "http.route": route},
    )
    if not span.is_recording():  # not sampled: nothing to record or pass on
        return await fn(self, request, *args, **kwargs)
    token = context.attach(trace.set_span_in_context(span))
    try:
        response = await fn(self, request, *args, **kwargs)
    except BaseException as exc:
        _end_request_span(span, getattr(exc, "status_code", 500), exc)
        raise
    finally:
        context.detach(token)
    body = getattr(response, "body_iterator", None)
    if body is None:
        _end_request_span(span, response.status_code)
        return response
    span.set_attribute("http.response.status_code", response.status_code)
    response.body_iterator = _ending_with(body, span, response.status_code)
    return response


async def _ending_with(body, span, status: int):
    """A stream's chunks, ending its request span when the stream ends (or is cut)."""
    chunks = 0
    error = None
    try:
        async for chunk in body:
            chunks += 1
            yield chunk
    except BaseException as exc:
        error = exc
        raise
    finally:
        span.add_event(
            "stream.end", {"stepserve.stream.chunks": chunks, "completed": error is None}
        )
        _end_request_span(span, status, error)


def _end_request_span(span, status: int, error: BaseException | None = None) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("http.response.status_code", int(status))
    if error is not None and int(status) >= 500:
        span.record_exception(error)
    if int(status) >= 500:
        span.set_status(Status(StatusCode.ERROR))
    span.end()


def traced_admission(fn):
    """Decorates IngressCore.admit_by_wait(self, req, deadline_s): an `admission` span under
    the request's span (its verdict, the expected wait)."""

    @functools.wraps(fn)
    def wrapper(self, req, deadline_s, *args, **kwargs):
        if _config is None:
            return fn(self, req, deadline_s, *args, **kwargs)
        from opentelemetry import trace

        if not trace.get_current_span().is_recording():
            return fn(self, req, deadline_s, *args, **kwargs)
        with tracer().start_as_current_span(
            "admission", record_exception=False, set_status_on_exception=False
        ) as span:
            span.set_attribute("stepserve.request.priority", int(getattr(req, "priority", 0)))
            span.set_attribute("stepserve.deadline_s", float(deadline_s))
            try:
                expected = fn(self, req, deadline_s, *args, **kwargs)
            except BaseException as exc:
                span.set_attribute("stepserve.admitted", False)
                span.set_attribute("http.response.status_code", getattr(exc, "status_code", 500))
                raise
            span.set_attribute("stepserve.admitted", True)
            if expected is not None:
                span.set_attribute("stepserve.expected_wait_s", float(expected))
            return expected

    return wrapper


def traced_jobs(jobs: list, model: str):
    """The ingress's jobs (choice index, EngineRequest) with the current request span's
    traceparent, so the replicas' spans continue its trace; unchanged when not traced."""
    if _config is None:
        return jobs
    import dataclasses

    from opentelemetry import trace

    span = trace.get_current_span()
    traceparent = traceparent_of(span) if span.is_recording() else None
    if traceparent is None:
        return jobs
    span.set_attribute("gen_ai.request.model", model)
    span.set_attribute("gen_ai.request.n", len(jobs))
    return [(i, dataclasses.replace(job, traceparent=traceparent)) for i, job in jobs]


def routing_span(request, started: float, replica_id: str, reason: str | None, candidates: int):
    """The `routing` span of one send of a traced request (its traceparent: the ingress span),
    from the decision (`started`, time.time()) to Ray's report of where it went."""
    if _config is None or request.traceparent is None:
        return
    from opentelemetry import trace

    span = tracer().start_span(
        "routing",
        context=_child_context(request.traceparent),
        kind=trace.SpanKind.INTERNAL,
        start_time=int(started * 1e9),
        attributes={
            "gen_ai.request.id": request.request_id,
            "stepserve.routing.replica": replica_id,
            "stepserve.routing.reason": reason or "ray",
            "stepserve.routing.candidates": candidates,
        },
    )
    span.end()


# -- the replica's spans -----------------------------------------------------------------------
class EngineTrace:
    """What a replica keeps of a traced request until it finishes: its trace context and the
    request parameters vLLM puts on its span."""

    __slots__ = ("traceparent", "attributes")

    def __init__(self, request, model_name: str) -> None:
        sampling = request.sampling
        self.traceparent = request.traceparent
        self.attributes: dict[str, Any] = {
            "gen_ai.request.id": request.request_id,
            "gen_ai.response.model": model_name,
            "gen_ai.request.max_tokens": sampling.max_tokens,
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.request.n": 1,  # one choice per engine request (the ingress fans n out)
        }


def engine_request_traced(request, model_name: str) -> EngineTrace | None:
    """An EngineTrace for `request` when tracing is on here and it carries a traceparent."""
    if _config is None or request.traceparent is None:
        return None
    return EngineTrace(request, model_name)


def engine_spans(
    trace_: EngineTrace,
    *,
    arrival: float,
    scheduled: float | None,
    first_token: float | None,
    finished: float,
    prompt_tokens: int,
    completion_tokens: int,
    finish_reason: str | None,
) -> None:
    """The engine's `llm_request` span (arrival to finish, under the ingress span) and its
    `queue`, `prefill` and `decode` children, from the request's recorded time.monotonic()
    times, with vLLM's `gen_ai.*` attributes."""
    from opentelemetry import trace

    offset = _monotonic_offset_ns()
    scheduled = arrival if scheduled is None else scheduled
    first_token = finished if first_token is None else first_token
    attributes = dict(trace_.attributes)
    attributes.update({
        "gen_ai.usage.prompt_tokens": prompt_tokens,
        "gen_ai.usage.completion_tokens": completion_tokens,
        "gen_ai.latency.time_in_queue": scheduled - arrival,
        "gen_ai.latency.time_to_first_token": first_token - arrival,
        "gen_ai.latency.e2e": finished - arrival,
        "gen_ai.latency.time_in_scheduler": scheduled - arrival,
        "gen_ai.latency.time_in_model_prefill": first_token - scheduled,
        "gen_ai.latency.time_in_model_decode": finished - first_token,
        "gen_ai.latency.time_in_model_inference": finished - scheduled,
        "gen_ai.response.finish_reasons": [finish_reason or "abort"],
    })  # fmt: skip
    t = tracer()
    parent = t.start_span(
        "llm_request",
        context=_child_context(trace_.traceparent),
        kind=trace.SpanKind.SERVER,
        start_time=_wall_ns(arrival, offset),
        attributes=attributes,
    )
    inner = trace.set_span_in_context(parent)
    rid = {"gen_ai.request.id": trace_.attributes["gen_ai.request.id"]}
    for name, start, end in (
        ("queue", arrival, scheduled),
        ("prefill", scheduled, first_token),
        ("decode", first_token, finished),
    ):
        child = t.start_span(
            name, context=inner, start_time=_wall_ns(start, offset), attributes=rid
        )
        child.end(end_time=_wall_ns(end, offset))
    parent.end(end_time=_wall_ns(finished, offset))
