"""The HTTP ingress as a Ray Serve deployment: FastAPI routes over one IngressCore
(router/ingress_core.py), which checks, tokenizes and hands each request to its answer
(router/streaming.py); also the ingress's /metrics, /health and /v1/models."""

import asyncio

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from ray import serve

from replica.api import find_hub, freeze_heap, grammar_engine_loaded, merge_expositions
from router.errors import guarded
from router.inflight import inflight_state, replica_readiness
from router.ingress_core import IngressCore
from router.kv_routing import exposition as kv_exposition
from router.kv_routing import kv_index_contents, kv_routing_state
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from router.settings import IngressSettings
from router.streaming import _KEEPALIVE, Ticket, _paced, _until  # noqa: F401  (tests)


def request_body_spec(model: type[BaseModel]) -> dict:
    """OpenAPI requestBody for a route that reads the raw body (to cap its size and word its
    errors) and so has no body schema from FastAPI: the model's JSON schema with its $defs
    inlined, so clients and schema-driven fuzzers see what the route accepts."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    content = {"application/json": {"schema": inline(schema)}}
    return {"requestBody": {"required": True, "content": content}}


# -- the Serve deployment ---------------------------------------------------------------------
fastapi_app = FastAPI(title="stepserve", version="0.1.0")


def retries_exposition(ingress_id: str, retries: int) -> bytes:
    return (
        "# HELP stepserve:ingress_replica_retries_total Calls sent again because their replica "
        "was lost (actor died, node gone) or full before their first output.\n"
        "# TYPE stepserve:ingress_replica_retries_total counter\n"
        f'stepserve:ingress_replica_retries_total{{ingress="{ingress_id}"}} {retries}\n'
    ).encode()


@serve.ingress(fastapi_app)
class Ingress:
    """The ingress replica: FastAPI routes over one IngressCore."""

    def __init__(self, llm_handle, settings: IngressSettings) -> None:
        self.core = IngressCore(llm_handle, settings)
        try:
            context = serve.get_replica_context()
            self.ingress_id, self.app_name = context.replica_id.unique_id, context.app_name
        except Exception:
            self.ingress_id, self.app_name = "ingress", "default"
        freeze_heap()  # started: Ray, Serve, FastAPI (again after the tokenizer's load)

    def stats(self) -> dict:
        """Requests this ingress holds now and its routers' view of them (a handle call; used
        by tests and the soak)."""
        return {
            "inflight": self.core.inflight,
            "node_id": ray.get_runtime_context().get_node_id(),
            "routers": inflight_state(),
            "kv_routing": kv_routing_state(),
            "replica_retries": self.core.calls.retries,
            "grammar_engine_loaded": grammar_engine_loaded(),
            "rejected_specs": self.core.num_rejected_specs,
        }

    def kv_index(self) -> list[dict]:
        """What this ingress's routers' KV indexes hold, per replica (a handle call: tests)."""
        return kv_index_contents()

    @fastapi_app.post("/v1/completions", openapi_extra=request_body_spec(CompletionRequest))
    async def completions(self, request: Request) -> Response:
        return await guarded(self.core.serve_request, request, False)

    @fastapi_app.post(
        "/v1/chat/completions", openapi_extra=request_body_spec(ChatCompletionRequest)
    )
    async def chat_completions(self, request: Request) -> Response:
        return await guarded(self.core.serve_request, request, True)

    @fastapi_app.post("/tokenize", openapi_extra=request_body_spec(TokenizeRequest))
    async def tokenize(self, request: Request) -> Response:
        return await guarded(self.core.tokenize, request)

    @fastapi_app.post("/detokenize", openapi_extra=request_body_spec(DetokenizeRequest))
    async def detokenize(self, request: Request) -> Response:
        return await guarded(self.core.detokenize, request)

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        async def listing() -> Response:
            self.core.guard.check_auth(request)
            info = await self.core.model_info()
            card = ModelCard(id=self.core.settings.model_name, max_model_len=info["max_model_len"])
            return JSONResponse(ModelList(data=[card]).model_dump())

        return await guarded(listing)

    @fastapi_app.get("/metrics")
    async def metrics(self) -> Response:
        """Every replica's metrics, merged (replicas push them to the hub about once a second)."""
        texts = []
        hub = find_hub(self.app_name)
        if hub is not None:  # None: no replica has started yet
            # this application's replicas that its routers know alive (all, before they know)
            live = [entry["replica_id"] for entry in replica_readiness()] or None
            texts = await hub.expositions.remote(replica_ids=live)
        # this ingress's own counters: calls resent after a lost replica, KV-event routing
        own = retries_exposition(self.ingress_id, self.core.calls.retries)
        own += kv_exposition(self.ingress_id)
        return Response(merge_expositions([*texts, own]), media_type=CONTENT_TYPE_LATEST)

    @fastapi_app.get("/health")
    async def health(self) -> Response:
        """Readiness: 200 when a replica can serve, with each replica's state as this
        ingress's routers see it (`replicas`: ready, or why not: a stalled engine); 503 when
        every known replica is unhealthy or the model cannot be reached."""

        async def check() -> Response:
            await self.core.tokenizer_loaded()  # a tokenizer that cannot load: not ready
            info = await asyncio.wait_for(self.core.model_info(), timeout=10)
            replicas = replica_readiness()
            ready = sum(1 for r in replicas if r["ready"])
            ok = ready > 0 or not replicas  # no router view (pow2): the call above answered
            body = {
                "status": "ok" if ok else "unavailable",
                "max_model_len": info["max_model_len"],
                "ready_replicas": ready,
                "replicas": replicas,
            }
            return JSONResponse(body, status_code=200 if ok else 503)

        return await guarded(check)


def make_ingress_deployment():
    return serve.deployment(Ingress, name="Ingress")
