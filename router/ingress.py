"""The HTTP ingress: validates OpenAI requests, applies chat templates, tokenizes, checks
lengths against max_model_len, fans each choice out to a replica through the deployment handle
(routed by LoadAwareRouter) and streams SSE or aggregates the answer."""

import asyncio
import dataclasses
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, SecretStr, ValidationError
from ray import serve

from replica.config import EngineConfig
from replica.metrics import HUB_NAME, HUB_NAMESPACE, merge_expositions
from replica.request import (
    EngineDeadError,
    EngineOverloaded,
    RequestOutput,
    RequestRejected,
    SamplingParams,
)
from router.policy import (
    Policy,
    RoutingConfig,
    inflight_state,
    note_finished,
    note_first_token,
)
from router.protocol import (
    SSE_DONE,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamChunk,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChunk,
    DeltaMessage,
    ModelCard,
    ModelList,
    UsageInfo,
    chat_completion_id,
    completion_id,
    error_body,
    sse_event,
    validation_error_body,
)

logger = logging.getLogger("ray.serve")


class IngressSettings(BaseModel):
    """What the ingress needs of the cluster config (router/ does not import cluster/)."""

    model_name: str
    model_dir: str | None
    engine: EngineConfig
    routing: RoutingConfig
    max_body_bytes: int = 4 << 20
    max_tokens_cap: int = 4096
    max_pending_requests: int = 1024
    api_keys: list[SecretStr] = []  # SecretStr: a repr or log of the settings shows no key
    api_keys_env: str = "STEPSERVE_API_KEYS"
    log_prompts: bool = False

    def resolved_api_keys(self) -> set[str]:
        """Keys given in the config plus those in the env var, read in this process (so a
        Kubernetes Secret mounted as env on the pod works and keys never travel in configs)."""
        env = os.environ.get(self.api_keys_env, "")
        given = {k.get_secret_value() for k in self.api_keys}
        return given | {k.strip() for k in env.split(",") if k.strip()}


class HTTPError(Exception):
    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, headers=None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = error_body(self.message, self.type, self.status, self.param)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> HTTPError:
    return HTTPError(400, message, "invalid_request_error", param)


def _root_cause(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)  # RayTaskError keeps the replica's exception here
    return cause if isinstance(cause, BaseException) else exc


def classify_error(exc: BaseException) -> HTTPError:
    """Map what a replica (or Ray) raised to the HTTP error a client should see."""
    exc = _root_cause(exc)
    name = type(exc).__name__
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, RequestRejected):
        return bad_request(str(exc))
    if isinstance(exc, EngineOverloaded) or name == "BackPressureError":
        return HTTPError(
            429, f"server overloaded: {exc}", "rate_limit_error", headers={"Retry-After": "1"}
        )
    if isinstance(exc, EngineDeadError) or name in {
        "ActorDiedError",
        "RayActorError",
        "ActorUnavailableError",
        "ActorUnschedulableError",
    }:
        return HTTPError(503, f"replica failed: {exc}", "service_unavailable")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    return HTTPError(500, f"internal error: {name}: {exc}", "server_error")


def _token_str(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


class _Choice:
    """Accumulates one choice's deltas."""

    __slots__ = ("index", "text", "token_ids", "finish_reason", "logprobs", "prompt_tokens")

    def __init__(self, index: int, prompt_tokens: int) -> None:
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.logprobs: list[tuple[float, dict[int, float]]] = []
        self.prompt_tokens = prompt_tokens


class IngressCore:
    """Framework-free request handling (FastAPI routes below call into it)."""

    def __init__(self, handle, settings: IngressSettings, tokenizer=None) -> None:
        self.settings = settings
        self.handle = handle
        self.stream_handle = handle.options(stream=True)
        if tokenizer is None:
            from transformers import AutoTokenizer

            model_dir = settings.model_dir
            if model_dir is None:
                from replica.default_model import default_model_dir

                model_dir = str(default_model_dir())
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer = tokenizer
        self.policy = Policy(settings.routing)
        self.api_keys = settings.resolved_api_keys()
        self.inflight = 0
        self._info: dict | None = None
        self._info_lock = asyncio.Lock()

    # -- plumbing -------------------------------------------------------------------------------
    async def model_info(self) -> dict:
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    self._info = await self.handle.model_info.remote()
        return self._info

    def check_auth(self, request: Request) -> None:
        if not self.api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip().encode()
        # compare_digest against every key: the time taken does not tell how close a guess was
        known = [hmac.compare_digest(token, key.encode()) for key in self.api_keys]
        if scheme.lower() != "bearer" or not any(known):
            raise HTTPError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                "authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def read_json(self, request: Request) -> dict:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise HTTPError(
                413,
                f"request body is {declared} bytes; the limit is {limit}",
                "invalid_request_error",
            )
        body = bytearray()
        async for chunk in request.stream():  # a chunked upload has no content-length: count
            body += chunk
            if len(body) > limit:
                raise HTTPError(
                    413,
                    f"request body exceeds the limit of {limit} bytes",
                    "invalid_request_error",
                )
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise bad_request(f"request body must be a JSON object, got {type(data).__name__}")
        return data

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise HTTPError(
                404,
                f"model {model!r} does not exist; this server serves {self.settings.model_name!r}",
                "not_found_error",
                param="model",
            )

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
        cap = self.settings.max_tokens_cap
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

    def admit(self) -> None:
        limit = self.settings.max_pending_requests
        if self.inflight >= limit:
            raise HTTPError(
                429,
                f"server overloaded: {self.inflight} requests in flight (limit {limit})",
                "rate_limit_error",
                headers={"Retry-After": "1"},
            )

    # -- generation -----------------------------------------------------------------------------
    def _payload(self, prompt_ids: list[int], params: SamplingParams) -> dict:
        return {
            "prompt_token_ids": prompt_ids,
            "sampling": params.__dict__,
            "request_id": uuid.uuid4().hex,
            "prefix_key": self.policy.prefix_key(prompt_ids, self.settings.engine.block_size),
            # this ingress tells the router the request's first token and its end
            "reports_progress": True,
        }

    async def _one_stream(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        payload = self._payload(prompt_ids, params)
        first = True
        try:
            async for out in self.stream_handle.generate.remote(payload):
                if first:  # prefill is over: tell the router (it weighs prefill still ahead)
                    first = False
                    note_first_token(payload["request_id"])
                yield out
        finally:
            note_finished(payload["request_id"])

    async def complete_all(
        self, jobs: list[tuple[int, list[int], SamplingParams]]
    ) -> list[tuple[int, RequestOutput]]:
        """Every (choice index, prompt, params) run to completion concurrently, one unary call
        each (a non-streaming answer needs no per-token messages). Leaving early (client gone)
        cancels the calls, and so aborts each in its replica."""

        async def one(index: int, ids: list[int], params: SamplingParams):
            if len(jobs) > 1:
                _own_serve_request_id()  # this task's context only
            payload = self._payload(ids, params)
            try:
                out = await self.handle.generate_all.remote(payload)
            finally:
                note_finished(payload["request_id"])
            return index, out

        if len(jobs) == 1:
            return [await one(*jobs[0])]
        tasks = [asyncio.ensure_future(one(*job)) for job in jobs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def fan_out(
        self, jobs: list[tuple[int, list[int], SamplingParams]]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every (choice index, prompt, params) concurrently; yield deltas as they come.
        Leaving early cancels every choice (and so aborts it in its replica)."""
        if len(jobs) == 1:
            index, ids, params = jobs[0]
            async for out in self._one_stream(ids, params):
                yield index, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int, ids: list[int], params: SamplingParams) -> None:
            _own_serve_request_id()  # this task's context only
            try:
                async for out in self._one_stream(ids, params):
                    queue.put_nowait((index, out))
            except BaseException as exc:  # forwarded to the consumer, which raises it
                queue.put_nowait((index, exc))
                return
            queue.put_nowait((index, done))

        tasks = [asyncio.ensure_future(pump(*job)) for job in jobs]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()

    async def prepare(
        self, req, prompts: list[list[int]]
    ) -> list[tuple[int, list[int], SamplingParams]]:
        jobs = []
        n = req.n
        for p_index, ids in enumerate(prompts):
            params = await self.sampling_for(req, ids)
            for j in range(n):
                choice_params = params
                if n > 1 and params.seed is not None:
                    choice_params = SamplingParams(**{**params.__dict__, "seed": params.seed + j})
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

    def completion_logprobs(self, choice_lps, text_offset_start: int) -> CompletionLogprobs:
        tok = self.tokenizer
        out = CompletionLogprobs()
        offset = text_offset_start
        for token_id, (lp, top) in choice_lps:
            s = _token_str(tok, token_id)
            out.tokens.append(s)
            out.token_logprobs.append(lp)
            out.top_logprobs.append({_token_str(tok, t): v for t, v in top.items()} or None)
            out.text_offset.append(offset)
            offset += len(s)
        return out

    def chat_logprobs(self, choice_lps) -> ChatChoiceLogprobs:
        tok = self.tokenizer
        content = []
        for token_id, (lp, top) in choice_lps:
            s = _token_str(tok, token_id)
            content.append(
                ChatTokenLogprob(
                    token=s,
                    logprob=lp,
                    bytes=list(s.encode()),
                    top_logprobs=[
                        ChatTopLogprob(
                            token=_token_str(tok, t),
                            logprob=v,
                            bytes=list(_token_str(tok, t).encode()),
                        )
                        for t, v in top.items()
                    ],
                )
            )
        return ChatChoiceLogprobs(content=content)

    @staticmethod
    def _token_logprobs(out: RequestOutput):
        if not out.new_logprobs:
            return []
        return list(zip(out.new_token_ids, out.new_logprobs, strict=False))

    async def aggregate(self, jobs, chat: bool, req) -> BaseModel:
        choices = {index: _Choice(index, len(ids)) for index, ids, _ in jobs}
        prompt_tokens = {}
        for index, ids, _ in jobs:
            prompt_tokens.setdefault(index // req.n, len(ids))
        for index, out in await self.complete_all(jobs):
            choice = choices[index]
            choice.text += out.new_text
            choice.token_ids.extend(out.new_token_ids)
            choice.logprobs.extend(self._token_logprobs(out))
            if out.finished:
                choice.finish_reason = _finish(out.finish_reason)
        usage = UsageInfo.of(
            sum(prompt_tokens.values()), sum(len(c.token_ids) for c in choices.values())
        )
        ordered = [choices[i] for i in sorted(choices)]
        wants_logprobs = jobs[0][2].logprobs is not None
        if chat:
            return ChatCompletionResponse(
                model=self.settings.model_name,
                usage=usage,
                choices=[
                    ChatCompletionChoice(
                        index=c.index,
                        message=ChatResponseMessage(content=c.text),
                        finish_reason=c.finish_reason,
                        logprobs=self.chat_logprobs(c.logprobs) if wants_logprobs else None,
                    )
                    for c in ordered
                ],
            )
        return CompletionResponse(
            model=self.settings.model_name,
            usage=usage,
            choices=[
                CompletionChoice(
                    index=c.index,
                    text=c.text,
                    finish_reason=c.finish_reason,
                    logprobs=self.completion_logprobs(c.logprobs, 0) if wants_logprobs else None,
                )
                for c in ordered
            ],
        )

    async def stream(self, jobs, chat: bool, req) -> AsyncIterator[str]:
        """SSE events of an admitted request, which owns its in-flight slot until it ends.
        Nothing is yielded before the first text arrives, so a failure before it (replica
        queue full, replica lost) raises to the caller and becomes a plain HTTP error (429,
        503); a failure after it is sent as an error event."""
        model = self.settings.model_name
        stream_id = chat_completion_id() if chat else completion_id()
        created = int(time.time())
        prompt_tokens = {}
        for index, ids, _ in jobs:
            prompt_tokens.setdefault(index // req.n, len(ids))
        completion_tokens = 0
        wants_logprobs = jobs[0][2].logprobs is not None
        offsets = dict.fromkeys((j[0] for j in jobs), 0)
        pending = ""  # events held back until the first text arrives
        started = False
        try:
            if chat:
                for index, _, _ in jobs:  # the role comes first, as OpenAI sends it
                    pending += sse_event(
                        ChatCompletionStreamChunk(
                            id=stream_id,
                            created=created,
                            model=model,
                            choices=[
                                ChatCompletionStreamChoice(
                                    index=index, delta=DeltaMessage(role="assistant", content="")
                                )
                            ],
                        )
                    )
            async for index, out in self.fan_out(jobs):
                completion_tokens += len(out.new_token_ids)
                if not out.new_text and not out.finished:
                    continue
                finish = _finish(out.finish_reason) if out.finished else None
                lps = self._token_logprobs(out) if wants_logprobs else None
                if chat:
                    chunk = ChatCompletionStreamChunk(
                        id=stream_id,
                        created=created,
                        model=model,
                        choices=[
                            ChatCompletionStreamChoice(
                                index=index,
                                delta=DeltaMessage(content=out.new_text),
                                finish_reason=finish,
                                logprobs=self.chat_logprobs(lps) if lps is not None else None,
                            )
                        ],
                    )
                else:
                    chunk = CompletionStreamChunk(
                        id=stream_id,
                        created=created,
                        model=model,
                        choices=[
                            CompletionChoice(
                                index=index,
                                text=out.new_text,
                                finish_reason=finish,
                                logprobs=self.completion_logprobs(lps, offsets[index])
                                if lps is not None
                                else None,
                            )
                        ],
                    )
                    offsets[index] += len(out.new_text)
                started = True
                yield pending + sse_event(chunk)
                pending = ""
            if req.include_usage:
                usage = UsageInfo.of(sum(prompt_tokens.values()), completion_tokens)
                cls = ChatCompletionStreamChunk if chat else CompletionStreamChunk
                pending += sse_event(cls(id=stream_id, created=created, model=model, usage=usage))
            if pending:
                started = True
                yield pending
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not started:
                raise
            err = classify_error(exc)
            logger.warning("stream %s failed: %s", stream_id, err.message)
            yield f"data: {json.dumps(error_body(err.message, err.type, err.status))}\n\n"
        finally:
            self.inflight -= 1
        yield SSE_DONE

    async def serve_request(self, request: Request, chat: bool) -> Response:
        self.check_auth(request)
        self.admit()  # before any parsing: an overloaded server spends nothing on the refused
        self.inflight += 1
        owns_slot = True
        try:
            data = await self.read_json(request)
            cls = ChatCompletionRequest if chat else CompletionRequest
            try:
                req = cls.model_validate(data)
            except ValidationError as exc:
                return JSONResponse(validation_error_body(exc.errors()), status_code=400)
            self.check_model(req.model)
            if chat:
                prompts = [self.chat_prompt(req)]
            else:
                prompts = self.completion_prompts(req)
            if self.settings.log_prompts:
                logger.info("prompt token counts %s", [len(p) for p in prompts])
            jobs = await self.prepare(req, prompts)
            if req.stream:
                events = self.stream(jobs, chat, req)
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
            result = await self.aggregate(jobs, chat, req)
            return JSONResponse(result.model_dump(exclude_none=False))
        finally:
            if owns_slot:
                self.inflight -= 1


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


def _own_serve_request_id() -> None:
    """Give the handle calls of the current task a Serve request id of their own. A call made
    while serving a request inherits that request's internal id, and Ray Serve's router indexes
    the calls waiting for a replica by it: two concurrent calls of one request (n > 1, several
    prompts) collide and one of them is never routed, a hang. Cancelling the task still
    cancels its call, so a client that leaves still aborts every choice."""
    from ray.serve import context

    current = context._get_serve_request_context()
    fresh = dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex)
    context._serve_request_context.set(fresh)


def _finish(reason: str | None) -> str | None:
    # "abort" never reaches a client that is still listening; report it as a stop.
    return "stop" if reason == "abort" else reason


def model_dir_of(engine: EngineConfig) -> str | None:
    return str(Path(engine.model)) if engine.model else None


async def _guarded(coro_fn, *args) -> Response:
    """Run a handler; every failure becomes an OpenAI-style JSON error."""
    try:
        return await coro_fn(*args)
    except HTTPError as err:
        return err.response()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        err = classify_error(exc)
        if err.status >= 500:
            logger.exception("request failed")
        return err.response()


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

    def stats(self) -> dict:
        """Requests this ingress holds now and its routers' view of them (a handle call; used
        by tests and the soak)."""
        return {"inflight": self.core.inflight, "routers": inflight_state()}

    @fastapi_app.post("/v1/completions", openapi_extra=request_body_spec(CompletionRequest))
    async def completions(self, request: Request) -> Response:
        return await _guarded(self.core.serve_request, request, False)

    @fastapi_app.post(
        "/v1/chat/completions", openapi_extra=request_body_spec(ChatCompletionRequest)
    )
    async def chat_completions(self, request: Request) -> Response:
        return await _guarded(self.core.serve_request, request, True)

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        async def listing() -> Response:
            self.core.check_auth(request)
            info = await self.core.model_info()
            card = ModelCard(id=self.core.settings.model_name, max_model_len=info["max_model_len"])
            return JSONResponse(ModelList(data=[card]).model_dump())

        return await _guarded(listing)

    @fastapi_app.get("/metrics")
    async def metrics(self) -> Response:
        """Every replica's metrics, merged (replicas push them to the hub about once a second)."""
        try:
            hub = ray.get_actor(HUB_NAME, namespace=HUB_NAMESPACE)
            texts = await hub.snapshot.remote()
        except ValueError:  # no replica has pushed yet
            texts = []
        return Response(merge_expositions(texts), media_type=CONTENT_TYPE_LATEST)

    @fastapi_app.get("/health")
    async def health(self) -> Response:
        async def check() -> Response:
            info = await asyncio.wait_for(self.core.model_info(), timeout=10)
            return JSONResponse({"status": "ok", "max_model_len": info["max_model_len"]})

        return await _guarded(check)


def make_ingress_deployment():
    return serve.deployment(Ingress, name="Ingress")
