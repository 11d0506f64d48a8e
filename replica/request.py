"""A request as an engine takes it (EngineRequest), the state the scheduler and runner keep for
it (Request), and what one step yields per request (StepOutput from the scheduler,
RequestOutput from the engine)."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import time
from dataclasses import dataclass

import msgspec

# moved to their own modules; imported here for the modules that import them from here
from replica.errors import (  # noqa: F401
    EngineDeadError,
    EngineOverloaded,
    GrammarRejected,
    RequestRejected,
)
from replica.sampling_params import STRUCTURED_KINDS, SamplingParams, StructuredOutput  # noqa: F401

# The parent of a prompt's first block in the hash chain. Hashes must be equal in every process
# (the router predicts a replica's prefix-cache hits from them, router/kv_index.py): Python's
# hash of a tuple of ints is (no per-process salt, unlike str; unlike None, whose hash is its
# address before Python 3.12).
ROOT_BLOCK_HASH = 0x5EED_B10C


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """The LoRA adapter (PEFT format) a request runs with: `name` is what clients put in
    `model`, `path` the adapter's directory as the replica's node sees it (vLLM's LoRARequest:
    the path travels with the request, so any replica, one started later by autoscaling too,
    can load the adapter on demand)."""

    name: str
    path: str

    @property
    def salt(self) -> int:
        """A stable 63-bit id of (name, path), the same in every process: it seeds the
        request's block-hash chain (`root_block_hash`), so no request ever reuses KV computed
        under another adapter, and the router's KV index predicts hits per adapter."""
        digest = hashlib.blake2b(f"{self.name}\0{self.path}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1


def root_block_hash(lora: LoRARequest | None = None) -> int:
    """The parent of a prompt's first block: ROOT_BLOCK_HASH for the base model, a root of
    its own per adapter (prefix-cache hits never cross adapters)."""
    return ROOT_BLOCK_HASH if lora is None else hash((ROOT_BLOCK_HASH, lora.salt))


def extend_block_hashes(
    hashes: list[int], tokens: list[int], block_size: int, root: int = ROOT_BLOCK_HASH
) -> list[int]:
    """Append to `hashes` the chained hash of every full block of `tokens` past those already
    hashed: block i's hash is hash((block i-1's hash, its tokens)), block 0's parent `root`
    (`root_block_hash` of the request's adapter). The one implementation the replica's prefix
    cache and the router's KV index share."""
    start = len(hashes) * block_size
    parent = hashes[-1] if hashes else root
    while start + block_size <= len(tokens):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        hashes.append(parent)
        start += block_size
    return hashes


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(frozen=True, slots=True)
class Resume:
    """What the client already has of a request whose replica was lost mid-stream (or drained):
    the ingress sends the request again with it, and the new replica continues as the lost one
    would have. The engine treats `output_token_ids` as output already generated (the request
    starts as if preempted after them: recomputed, then sampling goes on), so max_tokens,
    min_tokens, penalties, stop conditions, seeded sampling (drawn per position) and a grammar
    (replayed over them) continue where they were; `output_text` is the text the client has
    seen, so the replica's next delta starts right after it (no text repeated or lost, a stop
    string spanning the cut still found)."""

    output_token_ids: list[int]
    output_text: str
    num_migrations: int = 1  # how many times this request has moved (the ingress's limit)


@dataclass(frozen=True, slots=True)
class PoolingRequest:
    """An embeddings request (/v1/embeddings): its prompt is run as a prompt-only request in
    the same batches as generation (prefill, no token sampled) and the final hidden states
    (after the model's last norm) pooled into one vector: the last prompt token's ("last") or
    the mean over the prompt ("mean"); L2-normalized when `normalize`; truncated to its first
    `dimensions` values (Matryoshka models) when given, before normalizing."""

    kind: str = "last"  # "last" | "mean"
    normalize: bool = True
    dimensions: int | None = None


@dataclass(frozen=True, slots=True)
class KVFetch:
    """Prefix KV to bring from another replica before this request's prefill: the leading
    `num_blocks` full blocks of its prompt (hashed as the request's own chain), held by the
    Serve replica `source` (its replica id). Set by the router when fetching beats
    recomputing; the replica imports what it gets as cached blocks and recomputes the rest
    (a source that lost some blocks, or fails, only costs the recompute)."""

    source: str
    num_blocks: int


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request as an engine takes it: built once by whoever admits it (the ingress's
    fan-out, the offline LLM, a test) and carried whole to the scheduler, whose Request holds
    it (replica/request.py). A per-request feature adds its field here and reads it where it
    acts; the transports in between (Ray, the engine core's socket) carry it unchanged."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    request_id: str  # the sender's id (a replica aborts it by this id; the router keys on it)
    priority: int = 0  # lower is more urgent (the engine's priority scheduling policy)
    # time.monotonic() when the replica took it (the front stamps it when None)
    arrival_time: float | None = None
    lora: LoRARequest | None = None  # the adapter to run with; None: the base model
    resume: Resume | None = None  # a request continued on another replica (migration)
    pooling: PoolingRequest | None = None  # an embeddings request: pool, sample nothing
    kv_fetch: KVFetch | None = None  # prefix blocks to fetch from their holder first
    # the W3C traceparent of the ingress span this request's engine spans continue (tracing
    # on); None: not traced
    traceparent: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def footprint_tokens(self) -> int:
        """The KV footprint the request can reach: prompt + max_tokens."""
        return len(self.prompt_token_ids) + self.sampling.max_tokens

    def arrived(self, now: float | None = None) -> EngineRequest:
        """This request with its arrival stamped (itself when it has one)."""
        if self.arrival_time is not None:
            return self
        return dataclasses.replace(self, arrival_time=time.monotonic() if now is None else now)


class Request:
    """One sequence through the engine. Tokens = prompt + output so far.

    `num_computed_tokens` counts tokens whose K/V sit in the cache (or are being written
    this step: the scheduler advances it when it schedules them). `block_hashes` holds the
    chained hash of every *full* block of tokens, extended as blocks fill.
    """

    __slots__ = (
        "engine_request",
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_ids",
        "arrival_time",
        "all_token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "status",
        "num_preemptions",
        "num_cached_tokens",
        "block_hashes",
        "stop_reason",
        "first_scheduled_time",
        "max_total_tokens",
        "grammar",
        "prompt_logprobs",
        "priority",
        "seq",
        "speculate",
        "lora",
        "block_root",
        "num_resumed_tokens",
        "pooling",
        "pooled",
        "text_pending",
    )

    def __init__(
        self, engine_request: EngineRequest, eos_token_ids: frozenset[int] | set[int] = frozenset()
    ) -> None:
        prompt_token_ids = engine_request.prompt_token_ids
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        sampling_params = engine_request.sampling
        # the request as it was sent, whole: a per-request field is read from here
        self.engine_request = engine_request
        # its fields the scheduler reads every step, copied out once
        self.request_id = engine_request.request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        arrival_time = engine_request.arrival_time
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = engine_request.priority  # lower is more urgent (vLLM's convention)
        self.seq = 0  # the scheduler's arrival count: breaks ties between equal arrival times
        # set by the scheduler: drafts are proposed for it (replica/spec_decode.py)
        self.speculate = False
        self.lora = engine_request.lora  # the adapter it runs with (None: the base model)
        # an embeddings request: its prompt runs, nothing is sampled; `pooled` sums its rows'
        # final hidden states as its chunks run (replica/pooling.py)
        self.pooling = engine_request.pooling
        self.pooled = None
        # sampled tokens but no text for its client yet (replica/first_text.py)
        self.text_pending = False
        self.block_root = root_block_hash(engine_request.lora)  # its block-hash chain's root
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # a resumed request (migration) starts as if preempted after its resumed output: those
        # tokens count as output (max_tokens, min_tokens, penalties, stop checks) and are
        # recomputed by prefill like a preempted request's
        resume = engine_request.resume
        self.num_resumed_tokens = 0 if resume is None else len(resume.output_token_ids)
        if resume is not None:
            self.all_token_ids.extend(resume.output_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 = not yet
        self.block_hashes: list[int] = []
        self.stop_reason: int | str | None = None
        self.first_scheduled_time: float | None = None
        # set by the scheduler: min(prompt + max_tokens, max_model_len)
        self.max_total_tokens = self.num_prompt_tokens + sampling_params.max_tokens
        # the structured output's matcher (replica/structured.py), fed every sampled token
        self.grammar = None
        # with sampling_params.prompt_logprobs: entry i is prompt token i+1's (logprob, top-k),
        # filled as the prompt's chunks run; delivered with the first output
        # (not on a request resumed after a token: its client has them, they came with the
        # first token)
        self.prompt_logprobs: list[tuple[float, dict[int, float]]] | None = (
            []
            if sampling_params.prompt_logprobs is not None and not self.num_resumed_tokens
            else None
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """The priority policy's order: priority first (lower first), then arrival (the
        order requests reached the scheduler when their arrival times are equal)."""
        return (self.priority, self.arrival_time, self.seq)

    @property
    def needs_every_prompt_row(self) -> bool:
        """Whether every prompt position must be computed (prefix-cache hits would skip rows
        wanted): prompt logprobs still wanted, or a mean-pooled embedding."""
        return self.needs_prompt_logprobs or (
            self.pooling is not None and self.pooling.kind == "mean"
        )

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs are wanted and not all computed yet (the prompt then runs in
        full: prefix-cache hits would skip the positions whose logits are needed)."""
        wanted = self.prompt_logprobs
        return wanted is not None and len(wanted) < self.num_prompt_tokens - 1

    def update_block_hashes(self, block_size: int) -> None:
        """Hash every newly completed full block, chained on its parent's hash."""
        extend_block_hashes(self.block_hashes, self.all_token_ids, block_size, self.block_root)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )


@dataclass
class StepOutput:
    """A request's new tokens and finish state: made by Scheduler.update_from_output, for Engine."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    # per new token: (sampled logprob, {token_id: logprob} of the top-k), when requested
    new_logprobs: list[tuple[float, dict[int, float]]] | None = None
    # with the first token, when requested: per prompt token after the first, its logprobs
    prompt_logprobs: list[tuple[float, dict[int, float]]] | None = None
    embedding: list[float] | None = None  # a pooling request's vector, when it finishes

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(msgspec.Struct, array_like=True, gc=False):
    """A request's delta after a step, text included: made by Engine.step, streamed to callers.
    A msgspec struct: the engine core sends it to its front as a compact array (engine/wire.py),
    the text filled in there."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[tuple[float, dict[int, float]]] | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # on the first delta, when requested: per prompt token after the first, its logprobs
    prompt_logprobs: list[tuple[float, dict[int, float]]] | None = None
    # a pooling request's (EngineRequest.pooling) vector, on its one (finished) delta
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by a later one of the same request, as one delta (a consumer
        that fell behind the engine takes what queued up in one piece)."""
        if later.request_id != self.request_id:
            raise ValueError(f"cannot merge {later.request_id!r} into {self.request_id!r}")
        logprobs = None
        if self.new_logprobs is not None or later.new_logprobs is not None:
            logprobs = (self.new_logprobs or []) + (later.new_logprobs or [])
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            new_text=self.new_text + later.new_text,
            num_prompt_tokens=later.num_prompt_tokens,
            num_output_tokens=later.num_output_tokens,
            finish_reason=later.finish_reason,
            stop_reason=later.stop_reason,
            new_logprobs=logprobs,
            num_cached_tokens=later.num_cached_tokens,
            num_preemptions=later.num_preemptions,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
            embedding=later.embedding,
        )
