"""The ingress's request handling, framework-free: checks an OpenAI request (auth, admission,
its fields, the model's limits), resolves its `model` (a served model, or a LoRA adapter on
one: router/lora_registry.py), applies that model's chat template, tokenizes, and hands the
choices to its answer (router/streaming.py); also the tokenizer endpoints and the model list. Auth, admission and body limits
are router/guard.py's; errors router/errors.py's; the FastAPI routes router/ingress.py's."""

import dataclasses
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from replica.api import (
    GrammarRejected,
    LoRARequest,
    RequestRejected,
    SamplingParams,
    configure_tracing,
    freeze_heap,
    traced_admission,
    traced_jobs,
    traced_request,
)
from router.admission import Admission
from router.dialects import Echo
from router.errors import HTTPError, bad_request, invalid_request, root_cause
from router.fanout import Job
from router.guard import RequestGuard
from router.lora_admin import LoRAAdmin
from router.lora_registry import Adapter, AdapterDirectory
from router.migration import Migrations
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    TokenizeRequest,
    TokenizeResponse,
)
from router.reasoning import request_reasoning
from router.served_model import ServedModel
from router.settings import PREFILL_HANDLE_SUFFIX, IngressSettings
from router.streaming import TIMEOUT_HEADER, Ticket
from router.tool_calls import render_messages

logger = logging.getLogger("ray.serve")


class IngressCore:
    """Framework-free request handling (router/ingress.py's FastAPI routes call into it).
    `handles`: the LLM deployment's handle (one model), or one per served model by name."""

    def __init__(self, handles, settings: IngressSettings, tokenizer=None, registry=None) -> None:
        self.settings = settings
        if not isinstance(handles, dict):
            handles = {settings.model_name: handles}
        self.guard = RequestGuard(settings.http, settings.auth)
        configure_tracing(settings.tracing)  # OpenTelemetry spans (off: no endpoint)
        self.admission = Admission()  # admission by expected wait (router/admission.py)
        # streams continued on another replica: one limit and one tally for every model
        self.migrations = Migrations(settings.http.migration_limit)
        self.models: dict[str, ServedModel] = {
            ms.name: ServedModel(
                ms,
                handles[ms.name],
                settings.routing,
                self.admission,
                settings.http.keepalive_s,
                tokenizer if ms.name == settings.model_name else None,
                then=freeze_heap,
                migrations=self.migrations,
                prefill=handles.get(ms.name + PREFILL_HANDLE_SUFFIX),
                direct_stream=settings.http.direct_stream,
            )
            for ms in settings.models
        }
        self.default = self.models[settings.model_name]
        self.handle = self.default.handle
        static = [
            Adapter(module.name, ms.name, module.path)
            for ms in settings.models
            for module in ms.engine.lora_modules
        ]
        self.adapters = AdapterDirectory(static, registry)
        self.lora_admin = LoRAAdmin(self)
        self._warned_fields: set[str] = set()
        self._rejected_specs: dict = {}  # structured-output spec -> a replica's error for it

    # the default (first) model's parts, under the names a one-model ingress had
    @property
    def tokenizer(self):
        return self.default.tokenizer

    @property
    def dialects(self) -> dict:
        return self.default.dialects

    @property
    def calls(self):
        return self.default.calls

    @property
    def retries(self) -> int:
        """Calls sent again after their replica was lost or full, over every model."""
        return sum(model.calls.retries for model in self.models.values())

    async def tokenizer_loaded(self, model: ServedModel | None = None) -> None:
        """Wait for the model's tokenizer (every model's when None)."""
        for m in [model] if model is not None else self.models.values():
            await m.tokenizer_loaded()

    @property
    def inflight(self) -> int:
        return self.guard.inflight

    async def model_info(self, model: ServedModel | None = None) -> dict:
        return await (model or self.default).model_info()

    # -- which model ----------------------------------------------------------------------------
    async def resolve(self, name: str | None) -> tuple[ServedModel, LoRARequest | None]:
        """The base model a request's `model` names and the adapter to run it with: a served
        model's name -> that model; an adapter's -> its base model and the adapter; None -> the
        first model; anything else -> 404 model_not_found naming what is served."""
        if name is None:
            return self.default, None
        model = self.models.get(name)
        if model is not None:
            return model, None
        adapter = await self.adapters.get(name)
        if adapter is not None and adapter.base in self.models:
            return self.models[adapter.base], LoRARequest(adapter.name, adapter.path)
        raise await self.model_not_found(name)

    async def model_not_found(self, name: str) -> HTTPError:
        adapters = [a.name for a in await self.adapters.all()]
        served = f"the models {list(self.models)}"
        if adapters:
            served += f" and the LoRA adapters {adapters}"
        return HTTPError(
            404,
            f"The model {name!r} does not exist: this server serves {served}",
            "not_found_error",
            param="model",
            code="model_not_found",
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

    async def sampling_for(
        self, req, prompt_ids: list[int], model: ServedModel | None = None
    ) -> SamplingParams:
        """The request's SamplingParams for this prompt, or a 400 naming the request field at
        fault. The engine's own check (EngineLimits) runs here before routing, around the
        HTTP API's policy: this server's max_tokens cap, and refusing a prompt + max_tokens
        past max_model_len (which the engine would cut short)."""
        limits = await (model or self.default).engine_limits()
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

    async def prepare(
        self,
        req,
        prompts: list[list[int]],
        model: ServedModel | None = None,
        lora: LoRARequest | None = None,
    ) -> list[Job]:
        """One job per choice: n per prompt, the seed advanced per choice when one is given,
        each with the request's adapter (None: the base model)."""
        jobs = []
        n = req.n
        for p_index, ids in enumerate(prompts):
            params = await self.sampling_for(req, ids, model)
            for j in range(n):
                choice_params = params
                if n > 1 and params.seed is not None:
                    choice_params = dataclasses.replace(params, seed=params.seed + j)
                choice = req.engine_request(ids, choice_params)
                if lora is not None:
                    choice = dataclasses.replace(choice, lora=lora)
                jobs.append((p_index * n + j, choice))
        return traced_jobs(jobs, req.model or (model.name if model is not None else ""))

    def completion_prompts(
        self, req: CompletionRequest, model: ServedModel | None = None
    ) -> list[list[int]]:
        tokenizer = (model or self.default).tokenizer
        return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in req.prompts]

    def chat_prompt(
        self,
        messages: list[dict],
        tools: list | None,
        add_generation_prompt: bool = True,
        model: ServedModel | None = None,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        """The chat's prompt tokens: tools rendered by the model's chat template when it
        supports them, else described in the system message (router/tool_calls.py)."""
        model = model or self.default
        text = self.chat_text(messages, tools, add_generation_prompt, model, template_kwargs)
        return model.tokenizer.encode(text, add_special_tokens=False)

    def chat_text(
        self,
        messages: list[dict],
        tools: list | None,
        add_generation_prompt: bool,
        model: ServedModel,
        template_kwargs: dict | None = None,
    ) -> str:
        """The chat template's text for these messages (`template_kwargs`: the request's
        chat_template_kwargs)."""
        tokenizer = model.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request(f"the model {model.name!r} has no chat template; use /v1/completions")
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        rendered, template_tools = render_messages(messages, tool_dicts, model.template_tools)
        kwargs = dict(template_kwargs or {})
        if template_tools:
            kwargs["tools"] = template_tools
        try:
            return tokenizer.apply_chat_template(
                rendered, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            )
        except Exception as exc:  # a template that raises on these messages (jinja errors)
            raise bad_request(
                f"the model's chat template failed on these messages: {exc}"
            ) from None

    def request_chat_prompt(
        self, req: ChatCompletionRequest, model: ServedModel | None = None
    ) -> list[int]:
        """The prompt tokens; the request learns the model's tool-call family and whether
        its answer starts thinking (router/reasoning.py), which its grammar waits out."""
        model = model or self.default
        tools = req.tools if req.tool_mode != "none" else None  # "none": not offered
        kwargs = req.chat_template_kwargs
        text = self.chat_text(
            req.template_messages(), tools, req.add_generation_prompt, model, kwargs
        )
        thinking = request_reasoning(model.reasoning_parser, text, kwargs)
        req.use_model_format(
            model.tool_parser.name, thinking, model.thinking_end, model.special_markers
        )
        return model.tokenizer.encode(text, add_special_tokens=False)

    def echoes(
        self, req: CompletionRequest, prompts: list[list[int]], model: ServedModel | None = None
    ) -> dict[int, Echo] | None:
        """Per choice, the prompt to echo ahead of it (echo=true)."""
        if not req.echo:
            return None
        tokenizer = (model or self.default).tokenizer
        texts = [
            p if isinstance(p, str) else tokenizer.decode(ids)
            for p, ids in zip(req.prompts, prompts)
        ]
        return {
            p_index * req.n + j: Echo(texts[p_index], ids, only=req.echo_only)
            for p_index, ids in enumerate(prompts)
            for j in range(req.n)
        }

    # -- tokenizer endpoints --------------------------------------------------------------------
    async def read_request(self, request: Request, cls: type[BaseModel]):
        """The body as `cls`: 400 otherwise (invalid JSON, a field that fails validation,
        naming it)."""
        data = await self.guard.read_json(request)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise invalid_request(exc.errors()) from None

    async def tokenize(self, request: Request) -> Response:
        self.guard.check_auth(request)
        req = await self.read_request(request, TokenizeRequest)
        model, _ = await self.resolve(req.model)  # an adapter: its base model's tokenizer
        await model.tokenizer_loaded()
        tokenizer = model.tokenizer
        if req.messages is not None:
            messages = [m.as_template_dict() for m in req.messages]
            ids = self.chat_prompt(
                messages, req.tools, req.add_generation_prompt, model, req.chat_template_kwargs
            )
            if req.add_special_tokens:
                ids = tokenizer.build_inputs_with_special_tokens(ids)
        else:
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        info = await model.model_info()
        strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        body = TokenizeResponse(
            count=len(ids), max_model_len=info["max_model_len"], tokens=ids, token_strs=strs
        )
        return JSONResponse(body.model_dump(exclude_none=True))

    async def detokenize(self, request: Request) -> Response:
        self.guard.check_auth(request)
        req = await self.read_request(request, DetokenizeRequest)
        model, _ = await self.resolve(req.model)
        await model.tokenizer_loaded()
        info = await model.model_info()
        vocab = info["vocab_size"]
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return JSONResponse(
            DetokenizeResponse(prompt=model.tokenizer.decode(req.tokens)).model_dump()
        )

    async def list_models(self) -> list[ModelCard]:
        """Every served model, then every adapter (`parent`: its base model, `root`: its
        path, as vLLM lists them)."""
        cards = []
        for model in self.models.values():
            info = await model.model_info()
            cards.append(
                ModelCard(id=model.name, root=model.name, max_model_len=info["max_model_len"])
            )
        for adapter in await self.adapters.all():
            base = self.models.get(adapter.base)
            if base is None:  # a run-time adapter of a model a redeploy removed
                continue
            info = await base.model_info()
            cards.append(
                ModelCard(
                    id=adapter.name,
                    root=adapter.path,
                    parent=adapter.base,
                    max_model_len=info["max_model_len"],
                )
            )
        return cards

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

    @traced_admission
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

    @traced_request
    async def serve_request(self, request: Request, chat: bool, endpoint=None) -> Response:
        """A generating request: /v1/completions, /v1/chat/completions, or another API run as
        a chat request (`endpoint`: reads the body as one and wraps the chat dialect that
        shapes the answer: router/responses_api.py)."""
        self.guard.check_auth(request)
        # before any parsing: an overloaded server spends nothing on it
        slot = self.guard.admit(self.guard.client_key(request))
        owns_slot = True
        ticket = None
        try:
            deadline_s = self.deadline_s(request)
            if endpoint is not None:
                req = await endpoint.read(self, request)
            else:
                req = await self.read_request(
                    request, ChatCompletionRequest if chat else CompletionRequest
                )
            self.refuse_unknown(req.unknown_fields)
            if req.ignored_fields:
                self.warn_ignored(req.ignored_fields)
            model, lora = await self.resolve(req.model)
            # before the chat template and tokenizer: a refusal under a burst costs little
            expected_wait = self.admit_by_wait(req, deadline_s)
            await model.tokenizer_loaded()
            if chat:
                prompts = [self.request_chat_prompt(req, model)]
            else:
                prompts = self.completion_prompts(req, model)
            if self.settings.log_prompts:
                logger.info("prompt token counts %s", [len(p) for p in prompts])
            jobs = await self.prepare(req, prompts, model, lora)
            ticket = Ticket(slot, deadline_s)
            self.admission.enter(ticket.key, req.priority)
            echo = None if chat else self.echoes(req, prompts, model)
            dialect = model.dialect(chat, req.model or model.name)
            if endpoint is not None:
                dialect = endpoint.dialect(dialect, req)
            owns_slot = not req.stream  # a stream frees its slot, however it ends
            try:
                return await model.answers.answer(jobs, dialect, req, ticket, echo, expected_wait)
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
