"""One served base model as the ingress holds it: its LLM deployment's handle and the calls
through it, its tokenizer (loaded in the background), its chat template's abilities, its
replicas' limits (model_info), its tool-call and reasoning parsers, and the answer shapes per name it is asked by (the model's own
name or one of its adapters')."""

from __future__ import annotations

import asyncio

from replica.api import EngineLimits, LazyTokenizer, freeze_heap
from router.admission import Admission
from router.dialects import ChatDialect, CompletionDialect, Dialect
from router.fanout import ReplicaCalls
from router.migration import Migrations
from router.policy import Policy, RoutingConfig
from router.reasoning import THINK_END, THINK_START
from router.settings import ModelSettings
from router.streaming import Answers
from router.tool_calls import template_supports_tools
from router.tool_parsers import ToolParser, get_tool_parser


def special_token_texts(tokenizer) -> set[str]:
    """The texts of a tokenizer's special tokens (named ones and added tokens marked
    special); empty for a tokenizer that has none."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            texts.add(str(getattr(added, "content", added)))
    return texts


def special_markers(tokenizer, tool_parser: ToolParser, reasoning_parser: str) -> tuple[bool, bool]:
    """Whether (the tool-call family's markers, the thinking tags) are special tokens of
    `tokenizer`: a request that needs them keeps special tokens in its text."""
    specials = special_token_texts(tokenizer)
    return (
        any(m in specials for m in tool_parser.markers),
        reasoning_parser != "none" and bool({THINK_START, THINK_END} & specials),
    )


class ServedModel:
    def __init__(
        self,
        settings: ModelSettings,
        handle,
        routing: RoutingConfig,
        admission: Admission,
        keepalive_s: float,
        tokenizer=None,
        then=freeze_heap,
        migrations: Migrations | None = None,
        prefill=None,
        direct_stream: bool = False,
    ) -> None:
        """`tokenizer`: one to use (tests); else the model's loads in the background, and
        `then` runs once it has loaded (the ingress freezes its heap). `migrations`: the
        ingress's migration limit and tallies (router/migration.py). `prefill`: PD's prefill
        deployment's handle (None: colocated). `direct_stream`: streams over the direct feed
        (http.direct_stream, router/feed.py)."""
        self.settings = settings
        self.name = settings.name
        self.engine = settings.engine
        self.handle = handle
        self.tokenizer = None
        self._loading = None
        if tokenizer is None:
            # the model path as the user gave it (None: the default model), resolved on this
            # machine in the loading thread (a GGUF file's metadata directory is made there on
            # first use: replica/quant/gguf_meta.py); loads in a thread (~1 s, most of it
            # importing transformers): the ingress is ready without it; a request that comes
            # first waits for it (tokenizer_loaded). A checkpoint without a usable tokenizer
            # fails the LLM replicas' start, which reads its files, so the application does
            # not deploy.
            self._loading = LazyTokenizer(settings.model_dir, resolve=True).preload(then=then)
        else:
            self._use_tokenizer(tokenizer)
        self.calls = ReplicaCalls(
            handle,
            Policy(routing),
            settings.engine.block_size,
            migrations,
            prefill=prefill,
            direct_stream=direct_stream,
        )
        self.answers = Answers(self.calls, admission, keepalive_s)
        self._info: dict | None = None
        self._limits: EngineLimits | None = None
        self._info_lock = asyncio.Lock()

    def _use_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # the tool-call family (auto: read from the chat template) and the reasoning parser,
        # once per model; the tokens of `</think>` gate a thinking answer's grammar
        self.tool_parser: ToolParser = get_tool_parser(
            self.engine.tool_call_parser, getattr(tokenizer, "chat_template", None)
        )
        self.reasoning_parser = self.engine.reasoning_parser
        # (tool-call markers, thinking tags) that are special tokens: requests that need them
        # keep special tokens in their text (ChatCompletionRequest.use_model_format)
        self.special_markers = special_markers(tokenizer, self.tool_parser, self.reasoning_parser)
        self.thinking_end: tuple[int, ...] = ()
        if self.reasoning_parser != "none":
            self.thinking_end = tuple(tokenizer.encode(THINK_END, add_special_tokens=False))
        self.dialects: dict[bool, Dialect] = {  # by `chat`, under the model's own name
            False: CompletionDialect(tokenizer, self.name),
            True: ChatDialect(tokenizer, self.name, self.tool_parser),
        }
        self._adapter_dialects: dict[tuple[bool, str], Dialect] = {}
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

    def dialect(self, chat: bool, served_name: str) -> Dialect:
        """The answer shapes of an endpoint, naming `served_name` (this model's name, or an
        adapter's) in each response's `model`."""
        if served_name == self.name:
            return self.dialects[chat]
        key = (chat, served_name)
        dialect = self._adapter_dialects.get(key)
        if dialect is None:
            if len(self._adapter_dialects) >= 1024:  # adapters come and go at run time
                self._adapter_dialects.clear()
            if chat:
                dialect = ChatDialect(self.tokenizer, served_name, self.tool_parser)
            else:
                dialect = CompletionDialect(self.tokenizer, served_name)
            self._adapter_dialects[key] = dialect
        return dialect

    async def model_info(self) -> dict:
        """A replica's model_info (asked once)."""
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    self._info = await self.handle.model_info.remote()
        return self._info

    async def engine_limits(self) -> EngineLimits:
        """The replicas' limits (their model_info; the scheduling policy from the engine
        settings the replicas were given, when model_info does not say)."""
        if self._limits is None:
            info = await self.model_info()
            self._limits = EngineLimits.from_model_info(info, self.engine.scheduling_policy)
        return self._limits
