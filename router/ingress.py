"""The HTTP ingress as a Ray Serve deployment: FastAPI routes over one IngressCore
(router/ingress_core.py), which checks, tokenizes and hands each request to its answer
(router/streaming.py) on the model it names; also the ingress's /metrics, /health, /v1/models,
the LoRA adapter endpoints (router/lora_admin.py), /v1/responses (router/responses_api.py) and
/v1/embeddings (router/embeddings.py)."""

import asyncio

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from ray import serve

from replica.api import find_hub, freeze_heap, grammar_engine_loaded, merge_expositions
from router.embeddings import serve_embeddings
from router.errors import guarded
from router.feed import current_server
from router.inflight import inflight_state, replica_readiness
from router.ingress_core import IngressCore
from router.kv_routing import exposition as kv_exposition
from router.kv_routing import kv_index_contents, kv_routing_state
from router.lora_registry import get_registry
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    ModelList,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from router.protocol.responses_api import ResponsesRequest
from router.responses_api import retrieve_response, serve_responses
from router.settings import IngressSettings
from router.streaming import _KEEPALIVE, Ticket, _batches  # noqa: F401  (tests)


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
    """The ingress replica: FastAPI routes over one IngressCore. `llm_handles`: the LLM
    deployment's handle per served model name (or the one model's handle)."""

    def __init__(self, llm_handles, settings: IngressSettings) -> None:
        try:
            context = serve.get_replica_context()
            self.ingress_id, self.app_name = context.replica_id.unique_id, context.app_name
        except Exception:
            self.ingress_id, self.app_name = "ingress", "default"
        # the adapters loaded at run time, shared by every ingress replica of the application
        # (no registry actor for an application whose models have LoRA off: nothing to load)
        lora = any(model.engine.lora_enabled for model in settings.models)
        registry = get_registry(self.app_name) if lora and ray.is_initialized() else None
        self.core = IngressCore(llm_handles, settings, registry=registry)
        freeze_heap()  # started: Ray, Serve, FastAPI (again after the tokenizer's load)

    def stats(self) -> dict:
        """Requests this ingress holds now and its routers' view of them (a handle call; used
        by tests and the soak)."""
        return {
            "inflight": self.core.inflight,
            "node_id": ray.get_runtime_context().get_node_id(),
            "routers": inflight_state(),
            "kv_routing": kv_routing_state(),
            "replica_retries": self.core.retries,
            "migrations": dict(self.core.migrations.counts),
            "migration_gaps": self.core.migrations.gap_summary(),
            "grammar_engine_loaded": grammar_engine_loaded(),
            "rejected_specs": self.core.num_rejected_specs,
            "feed": feed.stats() if (feed := current_server()) is not None else None,
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

    @fastapi_app.post("/v1/responses", openapi_extra=request_body_spec(ResponsesRequest))
    async def responses(self, request: Request) -> Response:
        return await guarded(serve_responses, self.core, request)

    @fastapi_app.get("/v1/responses/{response_id}")
    async def get_response(self, request: Request, response_id: str) -> Response:
        return await guarded(retrieve_response, self.core, request, response_id)

    @fastapi_app.post("/v1/embeddings", openapi_extra=request_body_spec(EmbeddingRequest))
    async def embeddings(self, request: Request) -> Response:
        return await guarded(serve_embeddings, self.core, request)

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
            cards = await self.core.list_models()
            return JSONResponse(ModelList(data=cards).model_dump())

        return await guarded(listing)

    @fastapi_app.post(
        "/v1/load_lora_adapter", openapi_extra=request_body_spec(LoadLoRAAdapterRequest)
    )
    async def load_lora_adapter(self, request: Request) -> Response:
        return await guarded(self.core.lora_admin.load, request)

    @fastapi_app.post(
        "/v1/unload_lora_adapter", openapi_extra=request_body_spec(UnloadLoRAAdapterRequest)
    )
    async def unload_lora_adapter(self, request: Request) -> Response:
        return await guarded(self.core.lora_admin.unload, request)

    @fastapi_app.get("/metrics")
    async def metrics(self) -> Response:
        """Every replica's metrics, merged (replicas push them to the hub about once a second)."""
        texts = []
        hub = find_hub(self.app_name)
        if hub is not None:  # None: no replica has started yet
            # this application's replicas that its routers know alive (all, before they know)
            live = [entry["replica_id"] for entry in replica_readiness()] or None
            texts = await hub.expositions.remote(replica_ids=live)
        # this ingress's own counters: calls resent after a lost replica, streams migrated,
        # KV-event routing
        own = retries_exposition(self.ingress_id, self.core.retries)
        own += self.core.migrations.exposition(self.ingress_id)
        own += kv_exposition(self.ingress_id)
        return Response(merge_expositions([*texts, own]), media_type=CONTENT_TYPE_LATEST)

    @fastapi_app.get("/health")
    async def health(self) -> Response:
        """Readiness: 200 when a replica can serve, with each replica's state as this
        ingress's routers see it (`replicas`: ready, or why not: a stalled engine); 503 when
        every known replica is unhealthy or a model cannot be reached. With several models,
        `max_model_len` is the first model's; each router's replicas are listed together."""

        async def check() -> Response:
            await self.core.tokenizer_loaded()  # a tokenizer that cannot load: not ready
            infos = [
                await asyncio.wait_for(model.model_info(), timeout=10)
                for model in self.core.models.values()
            ]
            replicas = replica_readiness()
            ready = sum(1 for r in replicas if r["ready"])
            ok = ready > 0 or not replicas  # no router view (pow2): the call above answered
            body = {
                "status": "ok" if ok else "unavailable",
                "max_model_len": infos[0]["max_model_len"],
                "ready_replicas": ready,
                "replicas": replicas,
            }
            return JSONResponse(body, status_code=200 if ok else 503)

        return await guarded(check)


def make_ingress_deployment():
    return serve.deployment(Ingress, name="Ingress")
