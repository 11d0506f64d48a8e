"""Tracing and vLLM-named metrics end to end, over real Ray Serve and HTTP with the official
`openai` client on the tiny model: tracing on toward a real OTLP/HTTP receiver run here (POST
/v1/traces, protobuf decoded with opentelemetry-proto), a request sent with a W3C traceparent
comes back as one trace holding the ingress's spans and the replica's queue, prefill and decode
spans with their attributes; GET /metrics shows the engine's metrics under vLLM's names."""

from __future__ import annotations

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from ray import serve  # noqa: E402

from cluster.app import build_app  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from tests.helpers import free_port  # noqa: E402

APP = "stepserve-tracing"
MODEL = "tiny"
SERVICE = "stepserve-test"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


class Receiver:
    """An OTLP/HTTP traces endpoint: every span posted to /v1/traces, with its resource's
    service.name, decoded from ExportTraceServiceRequest."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []  # (service.name, Span)
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == "/v1/traces"
                if ok:
                    request = trace_service.ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    receiver.add(request)
                reply = trace_service.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        self.spans.append((attrs.get("service.name"), span))

    def trace(self, trace_id: str) -> dict[str, list]:
        """Span name -> the spans of that trace with that name."""
        out: dict[str, list] = {}
        with self.lock:
            for service, span in self.spans:
                if span.trace_id.hex() == trace_id:
                    out.setdefault(span.name, []).append((service, span))
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def attributes(span) -> dict:
    out = {}
    for a in span.attributes:
        value = a.value
        kind = value.WhichOneof("value")
        out[a.key] = getattr(value, kind) if kind != "array_value" else None
    return out


@pytest.fixture(scope="module")
def receiver():
    rx = Receiver()
    yield rx
    rx.close()


@pytest.fixture(scope="module")
def url(tiny_llama_dir, receiver, shared_serve):
    port = shared_serve.port
    config = ClusterConfig.model_validate(
        {
            "name": APP,
            "engine": {
                "model": str(tiny_llama_dir),
                "served_model_name": MODEL,
                "max_model_len": 512,
                "num_kv_blocks": 128,
                "block_size": 16,
            },
            "replicas": 1,
            "num_cpus_per_replica": 0.5,
            "http": {"host": "127.0.0.1", "port": port},
            # no path: /v1/traces is added
            "tracing": {"otlp_traces_endpoint": receiver.url, "service_name": SERVICE},
        }
    )
    base = shared_serve.url
    serve.run(build_app(config), name=APP, route_prefix="/")
    yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def wait_for(receiver: Receiver, trace_id: str, names: set[str], timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        got = receiver.trace(trace_id)
        if names <= set(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.25)


def test_a_streamed_request_is_one_trace_from_ingress_to_engine(client, receiver):
    traceparent = f"00-{TRACE_ID}-{PARENT_ID}-01"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Trace me"}],
        max_tokens=6,
        temperature=0.7,
        top_p=0.9,
        stream=True,
        extra_headers={"traceparent": traceparent, "tracestate": "congo=t61rcWkgMzE"},
    )
    finish = [c.choices[0].finish_reason for c in stream if c.choices][-1]
    assert finish in ("stop", "length")
    wanted = {
        "POST /v1/chat/completions", "admission", "routing", "llm_request",
        "queue", "prefill", "decode",
    }  # fmt: skip
    got = wait_for(receiver, TRACE_ID, wanted)
    assert wanted <= set(got), sorted(got)
    spans = {name: items[0][1] for name, items in got.items()}
    assert {service for items in got.values() for service, _ in items} == {SERVICE}

    server = spans["POST /v1/chat/completions"]
    assert server.parent_span_id.hex() == PARENT_ID  # the caller's span
    assert server.trace_state == "congo=t61rcWkgMzE"
    sa = attributes(server)
    assert sa["http.route"] == "/v1/chat/completions"
    assert sa["http.response.status_code"] == 200
    assert sa["gen_ai.request.model"] == MODEL
    assert any(e.name == "stream.end" for e in server.events)
    for name in ("admission", "routing", "llm_request"):
        assert spans[name].parent_span_id == server.span_id, name
    assert attributes(spans["admission"])["stepserve.admitted"] is True
    routing = attributes(spans["routing"])
    assert routing["stepserve.routing.replica"]
    assert routing["stepserve.routing.reason"]

    llm = spans["llm_request"]
    la = attributes(llm)
    assert la["gen_ai.response.model"] == MODEL
    assert la["gen_ai.request.max_tokens"] == 6
    assert la["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert la["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert la["gen_ai.usage.prompt_tokens"] > 0
    assert 1 <= la["gen_ai.usage.completion_tokens"] <= 6
    assert la["gen_ai.latency.time_to_first_token"] >= la["gen_ai.latency.time_in_queue"] >= 0
    assert la["gen_ai.latency.e2e"] >= la["gen_ai.latency.time_to_first_token"]
    assert la["gen_ai.request.id"] == attributes(spans["routing"])["gen_ai.request.id"]
    queue, prefill, decode = spans["queue"], spans["prefill"], spans["decode"]
    for child in (queue, prefill, decode):
        assert child.parent_span_id == llm.span_id
    assert queue.start_time_unix_nano == llm.start_time_unix_nano
    assert queue.end_time_unix_nano == prefill.start_time_unix_nano
    assert prefill.end_time_unix_nano == decode.start_time_unix_nano
    assert decode.end_time_unix_nano == llm.end_time_unix_nano
    # the engine's spans sit inside the ingress's request span (one machine, one clock)
    slack = 50_000_000  # 50 ms: the two processes convert monotonic to wall time apart
    assert llm.start_time_unix_nano >= server.start_time_unix_nano - slack
    assert llm.end_time_unix_nano <= server.end_time_unix_nano + slack


def test_a_request_without_traceparent_starts_its_own_trace(client, receiver):
    before = {span.trace_id.hex() for _, span in receiver.spans}
    out = client.completions.create(model=MODEL, prompt="fresh root", max_tokens=3)
    assert out.choices[0].text is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        roots = [
            span for service, span in list(receiver.spans)
            if span.name == "POST /v1/completions" and span.trace_id.hex() not in before
        ]  # fmt: skip
        if roots:
            trace_id = roots[0].trace_id.hex()
            if "llm_request" in receiver.trace(trace_id):
                break
        time.sleep(0.25)
    assert roots and not roots[0].parent_span_id  # a root
    assert "llm_request" in receiver.trace(trace_id)


def test_metrics_under_vllm_names_with_model_name(client, url):
    client.completions.create(model=MODEL, prompt="count me", max_tokens=2)
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        success = families.get("vllm:request_success")
        if success is not None and sum(s.value for s in success.samples) >= 2:
            break
        assert time.monotonic() < deadline, "no vllm:request_success_total on /metrics"
        time.sleep(0.5)
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds", "vllm:request_decode_time_seconds",
        "vllm:request_params_max_tokens", "vllm:cache_config_info",
    ):  # fmt: skip
        assert name in families, name
        assert {s.labels["model_name"] for s in families[name].samples} == {MODEL}, name
    assert "stepserve:engine_step_duration_seconds" in families
    assert not [n for n in families if n.startswith("stepserve:num_requests")]
    assert "stepserve:ingress_replica_retries" in families  # the ingress's own, merged in
