"""The HTTP ingress: validates OpenAI requests, applies chat templates, tokenizes, checks
lengths against max_model_len, fans each choice out to a replica (router/fanout.py) and streams
SSE or aggregates the answer in its endpoint's shape (router/dialects.py). Auth, admission and
body limits are router/guard.py's; errors router/errors.py's."""

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from ray import serve

from replica.metrics import HUB_NAME, HUB_NAMESPACE, merge_expositions
from replica.request import SamplingParams
from router.dialects import ChatDialect, Choice, CompletionDialect, Dialect, token_logprobs
from router.errors import HTTPError, bad_request, classify_error, guarded
from router.fanout import Job, ReplicaCalls
from router.guard import RequestGuard
from router.inflight import inflight_state
from router.kv_routing import exposition as kv_exposition
from router.kv_routing import kv_index_contents, kv_routing_state
from router.policy import Policy
from router.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    UsageInfo,
    error_body,
    sse_event,
    validation_error_body,
)
from router.settings import IngressSettings

logger = logging.getLogger("ray.serve")


class IngressCore:
    """Framework-free request handling (FastAPI routes below call into it)."""

    def __init__(self, handle, settings: IngressSettings, tokenizer=None) -> None:
        self.settings = settings
        self.handle = handle
        if tokenizer is None:
            from transformers import AutoTokenizer

            model_dir = settings.model_dir
            if model_dir is None:
                from replica.default_model import default_model_dir

                model_dir = str(default_model_dir())
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer = tokenizer
        self.guard = RequestGuard(settings.http, settings.auth)
        self.calls = ReplicaCalls(handle, Policy(settings.routing), settings.engine.block_size)
        self.dialects: dict[bool, Dialect] = {  # by `chat`
            False: CompletionDialect(tokenizer, settings.model_name),
            True: ChatDialect(tokenizer, settings.model_name),
        }
        self._info: dict | None = None
        self._info_lock = asyncio.Lock()
        self._warned_fields: set[str] = set()

    @property
    def inflight(self) -> int:
        return self.guard.inflight

    async def model_info(self) -> dict:
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    self._info = await self.handle.model_info.remote()
        return self._info

    # -- validation -----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise HTTPError(
                404,
                f"model {model!r} does not exist; this server serves {self.settings.model_name!r}",
                "not_found_error",
                param="model",
            )

    def warn_ignored(self, fields: list[str]) -> None:
        """Log, once per field name, request fields this server does not know and ignores."""
        new = [f for f in fields if f not in self._warned_fields]
        if new:
            self._warned_fields.update(new)
            logger.warning("ignoring request fields this server does not implement: %s", new)

    async def sampling_for(self, req, prompt_ids: list[int]) -> SamplingParams:
        info = await self.model_info()
        max_len, vocab = info["max_model_len"], info["vocab_size"]
        bad = next((t for t in prompt_ids if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        n_prompt = len(prompt_ids)
        if n_prompt + 1 > max_len:
            raise bad_request(
                f"prompt has {n_prompt} tokens, which leaves no room to generate within "
                f"max_model_len={max_len}"
            )
        cap = self.settings.http.max_tokens_cap
        default = min(max_len - n_prompt, cap)
        try:
            params = req.to_sampling_params(default)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        if params.max_tokens > cap:
            raise bad_request(
                f"max_tokens={params.max_tokens} exceeds this server's cap of {cap}",
                param="max_tokens",
            )
        if n_prompt + params.max_tokens > max_len:
            raise bad_request(
                f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) = "
                f"{n_prompt + params.max_tokens} exceeds max_model_len={max_len}",
                param="max_tokens",
            )
        return params

    async def prepare(self, req, prompts: list[list[int]]) -> list[Job]:
        """One job per choice: n per prompt, the seed advanced per choice when one is given."""
        jobs = []
        n = req.n
        for p_index, ids in enumerate(prompts):
            params = await self.sampling_for(req, ids)
            for j in range(n):
                choice_params = params
                if n > 1 and params.seed is not None:
                    choice_params = dataclasses.replace(params, seed=params.seed + j)
                jobs.append((p_index * n + j, ids, choice_params))
        return jobs

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        return [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in req.prompts]

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions")
        text = self.tokenizer.apply_chat_template(
            req.template_messages(),
            add_generation_prompt=req.add_generation_prompt,
            tokenize=False,
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- answers --------------------------------------------------------------------------------
    @staticmethod
    def _prompt_tokens(jobs: list[Job], n: int) -> int:
        """Prompt tokens of the request for usage: each prompt once, whatever n is."""
        per_prompt = {}
        for index, ids, _ in jobs:
            per_prompt.setdefault(index // n, len(ids))
        return sum(per_prompt.values())

    async def aggregate(self, jobs: list[Job], dialect: Dialect, req) -> BaseModel:
        choices = {index: Choice(index) for index, _, _ in jobs}
        for index, out in await self.calls.complete_all(jobs):
            choices[index].add(out)
        usage = UsageInfo.of(
            self._prompt_tokens(jobs, req.n), sum(len(c.token_ids) for c in choices.values())
        )
        ordered = [choices[i] for i in sorted(choices)]
        return dialect.response(
            usage,
            ordered,
            logprobs=jobs[0][2].logprobs is not None,
            token_ids=getattr(req, "return_token_ids", False),
        )

    async def stream(self, jobs: list[Job], dialect: Dialect, req) -> AsyncIterator[str]:
        """SSE events of an admitted request, which owns its in-flight slot until it ends.
        Nothing is yielded before the first text arrives, so a failure before it (replica
        queue full, replica lost) raises to the caller and becomes a plain HTTP error (429,
        503); a failure after it is sent as an error event."""
        token_ids = getattr(req, "return_token_ids", False)
        shape = dialect.stream(token_ids)
        completion_tokens = 0
        wants_logprobs = jobs[0][2].logprobs is not None
        pending = shape.preamble([index for index, _, _ in jobs])  # held until the first text
        started = False
        try:
            async for index, out in self.calls.fan_out(jobs):
                completion_tokens += len(out.new_token_ids)
                if not out.new_text and not out.finished and not token_ids:
                    continue
                lps = token_logprobs(out) if wants_logprobs else None
                chunk = shape.chunk(index, out, lps)
                started = True
                yield pending + sse_event(chunk)
                pending = ""
            if req.include_usage:
                usage = UsageInfo.of(self._prompt_tokens(jobs, req.n), completion_tokens)
                pending += sse_event(shape.usage(usage))
            if pending:
                started = True
                yield pending
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not started:
                raise
            err = classify_error(exc)
            logger.warning("stream %s failed: %s", shape.id, err.message)
            yield f"data: {json.dumps(error_body(err.message, err.type, err.status))}\n\n"
        finally:
            self.guard.release()
        yield SSE_DONE

    async def serve_request(self, request: Request, chat: bool) -> Response:
        self.guard.check_auth(request)
        self.guard.admit()  # before any parsing: an overloaded server spends nothing on it
        owns_slot = True
        try:
            data = await self.guard.read_json(request)
            cls = ChatCompletionRequest if chat else CompletionRequest
            try:
                req = cls.model_validate(data)
            except ValidationError as exc:
                return JSONResponse(validation_error_body(exc.errors()), status_code=400)
            self.check_model(req.model)
            if req.ignored_fields:
                self.warn_ignored(req.ignored_fields)
            if chat:
                prompts = [self.chat_prompt(req)]
            else:
                prompts = self.completion_prompts(req)
            if self.settings.log_prompts:
                logger.info("prompt token counts %s", [len(p) for p in prompts])
            jobs = await self.prepare(req, prompts)
            dialect = self.dialects[chat]
            if req.stream:
                events = self.stream(jobs, dialect, req)
                owns_slot = False  # the stream frees it, however it ends
                # Wait for the first event before answering, so that a refusal is a real 429
                # (or 503) status. Once started, the stream's cleanup runs even if the response
                # is never iterated (the event loop finalizes started async generators).
                first = await anext(events)
                return StreamingResponse(
                    _prepend(first, events),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            result = await self.aggregate(jobs, dialect, req)
            return JSONResponse(result.model_dump(exclude_none=False))
        finally:
            if owns_slot:
                self.guard.release()


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


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


@serve.ingress(fastapi_app)
class Ingress:
    """The ingress replica: FastAPI routes over one IngressCore."""

    def __init__(self, llm_handle, settings: IngressSettings) -> None:
        self.core = IngressCore(llm_handle, settings)
        try:
            self.ingress_id = serve.get_replica_context().replica_id.unique_id
        except Exception:
            self.ingress_id = "ingress"

    def stats(self) -> dict:
        """Requests this ingress holds now and its routers' view of them (a handle call; used
        by tests and the soak)."""
        return {
            "inflight": self.core.inflight,
            "routers": inflight_state(),
            "kv_routing": kv_routing_state(),
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
        try:
            hub = ray.get_actor(HUB_NAME, namespace=HUB_NAMESPACE)
            texts = await hub.snapshot.remote()
        except ValueError:  # no replica has pushed yet
            texts = []
        own = kv_exposition(self.ingress_id)  # this ingress's routers (KV-event routing)
        return Response(
            merge_expositions([*texts, own] if own else texts), media_type=CONTENT_TYPE_LATEST
        )

    @fastapi_app.get("/health")
    async def health(self) -> Response:
        async def check() -> Response:
            info = await asyncio.wait_for(self.core.model_info(), timeout=10)
            return JSONResponse({"status": "ok", "max_model_len": info["max_model_len"]})

        return await guarded(check)


def make_ingress_deployment():
    return serve.deployment(Ingress, name="Ingress")
