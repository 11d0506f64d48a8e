"""The ingress's request handling, framework-free: checks an OpenAI request (auth, admission,
its fields, the model's limits), applies the chat template, tokenizes, and hands the choices to
its answer (router/streaming.py); also the tokenizer endpoints. Auth, admission and body limits
are router/guard.py's; errors router/errors.py's; the FastAPI routes router/ingress.py's."""

import asyncio
import dataclasses
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from replica.api import (
    EngineLimits,
    GrammarRejected,
    LazyTokenizer,
    RequestRejected,
    SamplingParams,
    freeze_heap,
)
from router.admission import Admission
from router.dialects import ChatDialect, CompletionDialect, Dialect, Echo
from router.errors import HTTPError, bad_request, invalid_request, root_cause
from router.fanout import Job, ReplicaCalls
from router.guard import RequestGuard
from router.policy import Policy
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from router.settings import IngressSettings
from router.streaming import TIMEOUT_HEADER, Answers, Ticket
from router.tool_calls import render_messages, template_supports_tools

logger = logging.getLogger("ray.serve")


class IngressCore:
    """Framework-free request handling (router/ingress.py's FastAPI routes call into it)."""

    def __init__(self, handle, settings: IngressSettings, tokenizer=None) -> None:
        self.settings = settings
        self.handle = handle
        self.tokenizer = None
        self._loading = None
        if tokenizer is None:
            # the model path as the user gave it (None: the default model), resolved on this
            # machine in the loading thread (a GGUF file's metadata directory is made there on
            # first use: replica/quant/gguf_meta.py); loads in a thread (~1 s, most of it importing transformers): the ingress is ready
            # without it; a request that comes first waits for it (tokenizer_loaded). A
            # checkpoint without a usable tokenizer fails the LLM replicas' start, which reads
            # its files, so the application does not deploy.
            self._loading = LazyTokenizer(settings.model_dir, resolve=True).preload(
                then=freeze_heap
            )
        else:
            self._use_tokenizer(tokenizer)
        self.guard = RequestGuard(settings.http, settings.auth)
        self.admission = Admission()  # admission by expected wait (router/admission.py)
        self.calls = ReplicaCalls(handle, Policy(settings.routing), settings.engine.block_size)
        self.answers = Answers(self.calls, self.admission, settings.http.keepalive_s)
        self._info: dict | None = None
        self._limits: EngineLimits | None = None
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
        return bad_request(message, param=req.request_field("structured"))

    async def engine_limits(self) -> EngineLimits:
        """The replicas' limits (their model_info; the scheduling policy from the engine
        settings the replicas were given, when model_info does not say)."""
        if self._limits is None:
            info = await self.model_info()
            self._limits = EngineLimits.from_model_info(
                info, self.settings.engine.scheduling_policy
            )
        return self._limits

    async def sampling_for(self, req, prompt_ids: list[int]) -> SamplingParams:
        """The request's SamplingParams for this prompt, or a 400 naming the request field at
        fault. The engine's own check (EngineLimits) runs here before routing, around the
        HTTP API's policy: this server's max_tokens cap, and refusing a prompt + max_tokens
        past max_model_len (which the engine would cut short)."""
        limits = await self.engine_limits()
        max_len = limits.max_model_len
        n_prompt = len(prompt_ids)
        try:
            limits.check_prompt(prompt_ids)
            limits.check_length(n_prompt)
        except RequestRejected as exc:
            raise bad_request(str(exc), req.request_field(exc.param)) from None
        cap = self.settings.http.max_tokens_cap
        default = min(max_len - n_prompt, cap)
        try:
            params = req.to_sampling_params(default)
        except ValueError as exc:
            raise bad_request(str(exc), getattr(exc, "param", None)) from None
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
        try:
            limits.check_request(n_prompt, params, req.priority)
        except RequestRejected as exc:
            raise bad_request(str(exc), req.request_field(exc.param)) from None
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
                jobs.append((p_index * n + j, req.engine_request(ids, choice_params)))
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
                return await self.answers.answer(jobs, dialect, req, ticket, echo, expected_wait)
            except Exception as exc:
                cause = root_cause(exc)
                if isinstance(cause, GrammarRejected):  # a replica could not compile it
                    raise self.grammar_error(
                        jobs[0][1].sampling.structured, str(cause), req
                    ) from None
                raise
        finally:
            if owns_slot:
                if ticket is not None:
                    self.admission.leave(ticket.key)
                slot.release()
