"""The HTTP ingress: validates OpenAI requests, applies chat templates, tokenizes, checks
lengths against max_model_len, fans each choice out to a replica (router/fanout.py) and streams
SSE or aggregates the answer in its endpoint's shape (router/dialects.py). Auth, admission and
body limits are router/guard.py's; errors router/errors.py's."""

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from ray import serve

from replica.contracts import Accepted
from replica.hub import find_hub
from replica.metrics import merge_expositions
from replica.request import GrammarRejected, SamplingParams
from replica.startup import freeze_heap
from replica.structured import grammar_engine_loaded
from router.admission import Admission
from router.dialects import (
    ChatDialect,
    Choice,
    CompletionDialect,
    Dialect,
    Echo,
    token_logprobs,
    without_generated,
)
from router.errors import (
    HTTPError,
    bad_request,
    classify_error,
    guarded,
    invalid_request,
    root_cause,
)
from router.fanout import FULL_RETRY_S, Job, ReplicaCalls
from router.guard import RequestGuard
from router.inflight import inflight_state, replica_readiness
from router.kv_routing import exposition as kv_exposition
from router.kv_routing import kv_index_contents, kv_routing_state
from router.policy import Policy
from router.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    error_body,
    sse_event,
)
from router.settings import IngressSettings
from router.tool_calls import render_messages, template_supports_tools

logger = logging.getLogger("ray.serve")


class IngressCore:
    """Framework-free request handling (FastAPI routes below call into it)."""

    def __init__(self, handle, settings: IngressSettings, tokenizer=None) -> None:
        self.settings = settings
        self.handle = handle
        self.tokenizer = None
        self._loading = None
        if tokenizer is None:
            from replica.tokenizer import LazyTokenizer

            model_dir = settings.model_dir
            if model_dir is None:
                from replica.default_model import default_model_dir

                model_dir = str(default_model_dir())
            # loads in a thread (~1 s, most of it importing transformers): the ingress is ready
            # without it; a request that comes first waits for it (tokenizer_loaded). A
            # checkpoint without a usable tokenizer fails the LLM replicas' start, which reads
            # its files, so the application does not deploy.
            self._loading = LazyTokenizer(model_dir).preload(then=freeze_heap)
        else:
            self._use_tokenizer(tokenizer)
        self.guard = RequestGuard(settings.http, settings.auth)
        self.admission = Admission()  # admission by expected wait (router/admission.py)
        self.calls = ReplicaCalls(handle, Policy(settings.routing), settings.engine.block_size)
        self._info: dict | None = None
        self._info_lock = asyncio.Lock()
        self._warned_fields: set[str] = set()
        self._rejected_specs: dict = {}  # structured-output spec -> a replica's error for it

    def _use_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.dialects: dict[bool, Dialect] = {  # by `chat`
            False: CompletionDialect(tokenizer, self.settings.model_name),
            True: ChatDialect(tokenizer, self.settings.model_name),
        }
        self.template_tools = template_supports_tools(tokenizer)

    async def tokenizer_loaded(self) -> None:
        """Wait for the tokenizer, if it is still loading (the ingress's first second); a
        failed load raises its error here, for each request, until a load succeeds."""
        loading = self._loading
        if loading is None:
            return
        tokenizer = await loading.wait()
        if self._loading is not None:
            self._use_tokenizer(tokenizer)
            self._loading = None

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
        """Log, once per field name, the accepted-and-ignored request fields clients send."""
        new = [f for f in fields if f not in self._warned_fields]
        if new:
            self._warned_fields.update(new)
            logger.info("accepting and ignoring request fields %s (README: request fields)", new)

    @staticmethod
    def refuse_unknown(fields: list[str]) -> None:
        if fields:
            raise bad_request(
                f"unrecognized request field{'s' if len(fields) > 1 else ''} "
                f"{', '.join(repr(f) for f in fields)}: this server does not implement "
                f"{'them' if len(fields) > 1 else 'it'} (see the README's request fields)",
                param=fields[0],
            )

    def check_structured(self, params: SamplingParams, req) -> None:
        """400 now, before routing, for a constraint a replica already could not compile.
        The ingress does not import the grammar engine (xgrammar and torch: ~1.6 s of CPU
        that holds the GIL, a stall for every request passing through): replicas compile,
        and a spec's error is learnt from the first replica that rejects it."""
        spec = params.structured
        if spec is not None and spec in self._rejected_specs:
            raise self.grammar_error(spec, self._rejected_specs[spec], req)

    @property
    def num_rejected_specs(self) -> int:
        return len(self._rejected_specs)

    def grammar_error(self, spec, message: str, req) -> HTTPError:
        """The 400 for a constraint that cannot compile, naming the request's field; the spec
        is remembered (up to 1024 of them) so its next request is refused before routing."""
        if spec not in self._rejected_specs and len(self._rejected_specs) >= 1024:
            self._rejected_specs.clear()
        self._rejected_specs[spec] = message
        param = "tools" if spec.kind == "tool_calls" else _constraint_field(req)
        return bad_request(message, param=param)

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
        self.check_structured(params, req)
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

    def chat_prompt(
        self, messages: list[dict], tools: list | None, add_generation_prompt: bool = True
    ) -> list[int]:
        """The chat's prompt tokens: tools rendered by the model's chat template when it
        supports them, else described in the system message (router/tool_calls.py)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions")
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        rendered, template_tools = render_messages(messages, tool_dicts, self.template_tools)
        kwargs = {"tools": template_tools} if template_tools else {}
        try:
            text = self.tokenizer.apply_chat_template(
                rendered, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            )
        except Exception as exc:  # a template that raises on these messages (jinja errors)
            raise bad_request(
                f"the model's chat template failed on these messages: {exc}"
            ) from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def request_chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        tools = req.tools if req.tool_mode != "none" else None  # "none": not offered
        return self.chat_prompt(req.template_messages(), tools, req.add_generation_prompt)

    def echoes(self, req: CompletionRequest, prompts: list[list[int]]) -> dict[int, Echo] | None:
        """Per choice, the prompt to echo ahead of it (echo=true)."""
        if not req.echo:
            return None
        texts = [
            p if isinstance(p, str) else self.tokenizer.decode(ids)
            for p, ids in zip(req.prompts, prompts)
        ]
        return {
            p_index * req.n + j: Echo(texts[p_index], ids, only=req.echo_only)
            for p_index, ids in enumerate(prompts)
            for j in range(req.n)
        }

    # -- tokenizer endpoints --------------------------------------------------------------------
    async def read_request(self, request: Request, cls: type[BaseModel]):
        """The body as `cls`, for the model this server serves: 400 (invalid JSON, a field
        that fails validation, naming it) or 404 (another model) otherwise."""
        data = await self.guard.read_json(request)
        try:
            req = cls.model_validate(data)
        except ValidationError as exc:
            raise invalid_request(exc.errors()) from None
        self.check_model(req.model)
        return req

    async def tokenize(self, request: Request) -> Response:
        self.guard.check_auth(request)
        await self.tokenizer_loaded()
        req = await self.read_request(request, TokenizeRequest)
        if req.messages is not None:
            messages = [m.as_template_dict() for m in req.messages]
            ids = self.chat_prompt(messages, req.tools, req.add_generation_prompt)
            if req.add_special_tokens:
                ids = self.tokenizer.build_inputs_with_special_tokens(ids)
        else:
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        info = await self.model_info()
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        body = TokenizeResponse(
            count=len(ids), max_model_len=info["max_model_len"], tokens=ids, token_strs=strs
        )
        return JSONResponse(body.model_dump(exclude_none=True))

    async def detokenize(self, request: Request) -> Response:
        self.guard.check_auth(request)
        await self.tokenizer_loaded()
        req = await self.read_request(request, DetokenizeRequest)
        info = await self.model_info()
        vocab = info["vocab_size"]
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return JSONResponse(
            DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens)).model_dump()
        )

    # -- answers --------------------------------------------------------------------------------
    @staticmethod
    def _prompt_tokens(jobs: list[Job], n: int) -> int:
        """Prompt tokens of the request for usage: each prompt once, whatever n is."""
        per_prompt = {}
        for index, ids, _ in jobs:
            per_prompt.setdefault(index // n, len(ids))
        return sum(per_prompt.values())

    @staticmethod
    def answer_options(req, echo: dict[int, Echo] | None) -> dict:
        """The dialect's options for this request (tool parsing, echoed prompts)."""
        if isinstance(req, ChatCompletionRequest):
            return {"tool_mode": req.tool_mode}
        return {"echo": echo}

    async def aggregate(
        self, jobs: list[Job], dialect: Dialect, req, ticket: "Ticket", echo=None
    ) -> BaseModel:
        """The whole answer, within the request's deadline (408 past it: the calls are
        cancelled, which aborts them in their replicas and frees their blocks)."""
        choices = {index: Choice(index) for index, _, _ in jobs}
        echo_only = getattr(req, "echo_only", False)
        try:
            results = await asyncio.wait_for(
                self.calls.complete_all(jobs, req.priority), ticket.remaining_s()
            )
        except asyncio.TimeoutError:
            raise ticket.timeout_error() from None
        # and ends (serve_request's finally); its first token was not seen
        self.admission.started(ticket.key, streamed=False)
        for index, out in results:
            choices[index].add(without_generated(out) if echo_only else out)
        usage = UsageInfo.of(
            self._prompt_tokens(jobs, req.n), sum(len(c.token_ids) for c in choices.values())
        )
        ordered = [choices[i] for i in sorted(choices)]
        return dialect.response(
            usage,
            ordered,
            logprobs=jobs[0][2].logprobs is not None,
            token_ids=getattr(req, "return_token_ids", False),
            **self.answer_options(req, echo),
        )

    async def stream(
        self, jobs: list[Job], dialect: Dialect, req, ticket: "Ticket", echo=None
    ) -> AsyncIterator[str]:
        """SSE events of an admitted request, which owns its in-flight slot until it ends.
        The first item is the first event, or a keep-alive comment once a replica has accepted
        the request without output yet (Accepted, about half a second after it took it), or
        after STREAM_HOLD_S without either (the request waits in Serve's router for a replica
        with room). A failure before that, such as every replica refusing while the fan-out
        retries, raises to the caller and becomes a plain HTTP error. After that a comment
        follows every http.keepalive_s without an event, a failure is sent as an error event,
        and past the deadline the request ends with a timeout error event (its calls
        cancelled, so its replicas free its blocks)."""
        token_ids = getattr(req, "return_token_ids", False)
        shape = dialect.stream(token_ids, **self.answer_options(req, echo))
        echo_only = getattr(req, "echo_only", False)
        completion_tokens = 0
        wants_logprobs = jobs[0][2].logprobs is not None
        pending = shape.preamble([index for index, _, _ in jobs])  # held until the first text
        started = False
        first_token = False
        keepalive = self.settings.http.keepalive_s
        paced = _paced(self.calls.fan_out(jobs, req.priority), keepalive, STREAM_HOLD_S)
        try:
            async for item in _until(paced, ticket):
                if item is _KEEPALIVE or isinstance(item[1], Accepted):
                    started = True
                    yield KEEPALIVE_COMMENT
                    continue
                index, out = item
                if not first_token:
                    first_token = True
                    self.admission.started(ticket.key)
                if echo_only:
                    out = without_generated(out)
                completion_tokens += len(out.new_token_ids)
                if not out.new_text and not out.finished and not token_ids and not echo:
                    continue
                lps = token_logprobs(out) if wants_logprobs else None
                events = "".join(sse_event(c) for c in shape.chunks(index, out, lps))
                if not events:
                    continue  # a tool call still being buffered
                started = True
                yield pending + events
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
            self.admission.leave(ticket.key)
            ticket.slot.release()
        yield SSE_DONE

    def deadline_s(self, request: Request) -> float:
        """The request's deadline: http.request_timeout_s, or less when the client asks for
        less with X-Request-Timeout."""
        limit = self.settings.http.request_timeout_s
        header = request.headers.get(TIMEOUT_HEADER)
        if header is None:
            return limit
        try:
            value = float(header)
        except ValueError:
            raise bad_request(f"{TIMEOUT_HEADER} must be seconds, got {header!r}") from None
        if not 0 < value <= limit:
            raise bad_request(
                f"{TIMEOUT_HEADER} must be in (0, {limit:g}] seconds (http.request_timeout_s), "
                f"got {header!r}"
            )
        return value

    def admit_by_wait(self, req, deadline_s: float) -> float | None:
        """Refuse now (429, Retry-After) a request whose expected wait for its first token
        exceeds its deadline (router/admission.py); else the expected wait (None: unknown)."""
        verdict = self.admission.judge(deadline_s, req.priority)
        if verdict.admit:
            return verdict.expected_wait_s
        raise HTTPError(
            429,
            f"server overloaded: the first token is expected in {verdict.expected_wait_s:.1f}"
            f" s ({self.admission.num_queued} requests queued ahead at priority <= "
            f"{req.priority}), past this request's deadline of {deadline_s:g} s; retry "
            f"in {verdict.retry_after_s} s",
            "rate_limit_error",
            headers={"Retry-After": str(verdict.retry_after_s)},
        )

    async def serve_request(self, request: Request, chat: bool) -> Response:
        self.guard.check_auth(request)
        # before any parsing: an overloaded server spends nothing on it
        slot = self.guard.admit(self.guard.client_key(request))
        owns_slot = True
        ticket = None
        try:
            deadline_s = self.deadline_s(request)
            req = await self.read_request(
                request, ChatCompletionRequest if chat else CompletionRequest
            )
            self.refuse_unknown(req.unknown_fields)
            if req.ignored_fields:
                self.warn_ignored(req.ignored_fields)
            # before the chat template and tokenizer: a refusal under a burst costs little
            expected_wait = self.admit_by_wait(req, deadline_s)
            await self.tokenizer_loaded()
            if chat:
                prompts = [self.request_chat_prompt(req)]
            else:
                prompts = self.completion_prompts(req)
            if self.settings.log_prompts:
                logger.info("prompt token counts %s", [len(p) for p in prompts])
            jobs = await self.prepare(req, prompts)
            ticket = Ticket(slot, deadline_s)
            self.admission.enter(ticket.key, req.priority)
            echo = None if chat else self.echoes(req, prompts)
            dialect = self.dialects[chat]
            owns_slot = not req.stream  # a stream frees its slot, however it ends
            try:
                return await self.answer(jobs, dialect, req, ticket, echo, expected_wait)
            except Exception as exc:
                cause = root_cause(exc)
                if isinstance(cause, GrammarRejected):  # a replica could not compile it
                    raise self.grammar_error(jobs[0][2].structured, str(cause), req) from None
                raise
        finally:
            if owns_slot:
                if ticket is not None:
                    self.admission.leave(ticket.key)
                slot.release()

    async def answer(self, jobs, dialect, req, ticket, echo, expected_wait) -> Response:
        """The SSE stream or the aggregated answer of an admitted request. A stream owns the
        request's slot from its start, however it ends."""
        if req.stream:
            events = self.stream(jobs, dialect, req, ticket, echo)
            # The first item comes once a replica has the request (an event, or a keep-alive
            # while queued there) or after STREAM_HOLD_S, so a replica's refusal while the
            # fan-out retries is still a real 429 (or 503, or 400). Once started, the stream's cleanup runs even if
            # the response is never iterated (the event loop finalizes started async
            # generators).
            first = await anext(events)
            headers = {"Cache-Control": "no-cache"}
            if expected_wait is not None:  # what admission expected for the first token
                headers[EXPECTED_WAIT_HEADER] = f"{expected_wait:.2f}"
            return StreamingResponse(
                _prepend(first, events), media_type="text/event-stream", headers=headers
            )
        result = await self.aggregate(jobs, dialect, req, ticket, echo)
        return JSONResponse(result.model_dump(exclude_none=False))


class Ticket:
    """An admitted request: its slot, its key in the admission queue, its deadline."""

    __slots__ = ("slot", "key", "deadline_s", "deadline_at")

    def __init__(self, slot, deadline_s: float) -> None:
        self.slot = slot
        self.key = uuid.uuid4().hex
        self.deadline_s = deadline_s
        self.deadline_at = time.monotonic() + deadline_s

    def remaining_s(self) -> float:
        return max(0.0, self.deadline_at - time.monotonic())

    def timeout_error(self) -> HTTPError:
        return HTTPError(
            408,
            f"request timed out: no answer within its deadline of {self.deadline_s:g} s "
            f"(http.request_timeout_s, or the {TIMEOUT_HEADER} header); it was cancelled",
            "timeout_error",
        )


# A stream's headers wait this long for its first event or a replica's Accepted: past the
# fan-out's retries of full replicas (FULL_RETRY_S and its last pause), so their refusal is still
# a 429 status; then keep-alives start (a request waiting in Serve's router for a replica).
STREAM_HOLD_S = FULL_RETRY_S + 2.0
KEEPALIVE_COMMENT = ": keep-alive\n\n"
TIMEOUT_HEADER = "X-Request-Timeout"
EXPECTED_WAIT_HEADER = "X-Expected-Wait-S"
_KEEPALIVE = object()


async def _paced(events: AsyncIterator, every_s: float, first_wait_s: float) -> AsyncIterator:
    """The items of `events`, with _KEEPALIVE between them whenever one takes longer than
    `every_s` (`first_wait_s` for the first: a replica's Accepted, as an item, usually says
    sooner when the response may start). Closing this closes `events`."""
    pending = None
    wait = first_wait_s
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=wait)
            if not done:
                yield _KEEPALIVE
                wait = every_s
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield item
            wait = every_s
    finally:
        if pending is not None:
            pending.cancel()
            try:
                await pending
            except BaseException:
                pass
        await events.aclose()


async def _until(items: AsyncIterator, ticket: Ticket) -> AsyncIterator:
    """`items` until the ticket's deadline, then a timeout error (and `items` closed)."""
    try:
        while True:
            try:
                item = await asyncio.wait_for(anext(items), ticket.remaining_s())
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise ticket.timeout_error() from None
            yield item
    finally:
        await items.aclose()


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


def _constraint_field(req) -> str:
    """The request field that carried the output constraint (an error's `param`)."""
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex"):
        if getattr(req, name, None) is not None:
            return name
    return "guided_choice" if getattr(req, "guided_choice", None) else "guided_grammar"


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
