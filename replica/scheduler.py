"""Iteration-level scheduler (vLLM V1 semantics): each step hands out a token budget across
running requests first, then admits waiting ones; chunked prefill, prefix caching and
preemption by recompute all fall out of one rule: run min(tokens not yet computed, budget)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from replica.config import EngineConfig
from replica.kv_cache import KVCacheManager
from replica.kv_hybrid import HybridKVCacheManager
from replica.limits import EngineLimits, check_fits
from replica.pooling import finish_embedding
from replica.request import LoRARequest, Request, RequestRejected, RequestStatus, StepOutput
from replica.spec_decode import NgramProposer, speculation_allowed

logger = logging.getLogger(__name__)

__all__ = ["RequestRejected", "ScheduledRequest", "Scheduler", "SchedulerOutput", "SchedulerStats"]


@dataclass
class ScheduledRequest:
    """One request's share of a step: run tokens all_token_ids[start:start + num_tokens]."""

    request: Request
    start: int
    num_tokens: int  # the draft's tokens included
    block_ids: list[int]  # the request's whole block table (live list; read it during the step)
    # speculative tokens run after the request's last token (replica/spec_decode.py): the
    # runner verifies them and returns the accepted ones plus the model's next token
    draft: list[int] = field(default_factory=list)
    # a hybrid model's other KV groups' tables (kv_hybrid.py; live lists), empty otherwise
    group_block_ids: list[list[int]] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sample(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a new token is due."""
        return self.start + self.num_tokens - len(self.draft) >= self.request.num_tokens

    def token_ids(self) -> list[int]:
        if self.draft:
            end = self.start + self.num_tokens - len(self.draft)
            return self.request.all_token_ids[self.start : end] + self.draft
        return self.request.all_token_ids[self.start : self.start + self.num_tokens]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    # requests that ended since the previous step (runner drops their per-request state)
    finished_request_ids: list[str] = field(default_factory=list)
    # a pooling request (embeddings) may be in the step: the runner looks for them only then
    pooling: bool = False
    # KV tier moves (kv_tier.py: kind, block hash, block id) every rank makes before the
    # forward; they may come with no request scheduled
    kv_ops: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def decodes_only(self) -> bool:
        """Every request in the step computes its next token (and verifies its draft, if it
        has one): no prompt chunk."""
        return bool(self.scheduled) and all(
            s.num_tokens == 1 + len(s.draft) and s.request.num_output_tokens > 0
            for s in self.scheduled
        )

    def joined(self, other: SchedulerOutput) -> SchedulerOutput:
        """This step with `other`'s requests (prompts that joined it under way) after its own,
        in the runner's row order."""
        return replace(
            self,
            scheduled=self.scheduled + other.scheduled,
            total_num_scheduled_tokens=self.total_num_scheduled_tokens
            + other.total_num_scheduled_tokens,
            kv_ops=self.kv_ops + other.kv_ops,
        )


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    # speculative decoding (replica/spec_decode.py), totals since start; 0 when it is off
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    loras: tuple[str, ...] = ()  # LoRA adapters held loaded (replica/lora/manager.py)
    # requests resumed here from another replica (migration), and the resumed output tokens
    # queued for recompute by prefill (prefix-cache hits included), totals since start
    num_resumed_total: int = 0
    num_resumed_tokens_total: int = 0
    # KV tiers (kv_tier.py), totals since start, and the blocks they hold now
    kv_tier_saves: int = 0
    kv_tier_restores: int = 0
    kv_tier_hit_tokens: int = 0  # prefix-cache hit tokens that came from the tiers
    kv_tier_blocks: int = 0
    kv_imported_blocks: int = 0  # blocks staged from other replicas (kv transfer)
    num_joined_total: int = 0  # prompts that joined a step of decodes under way (step_join)
    # steps that ran decodes alone so a client's first text came sooner (first_text_priority)
    num_first_text_holds_total: int = 0


# first_text_priority holds a step for a client's first text only while at most this many
# prompts (waiting, or running a chunk) would wait for it
FIRST_TEXT_MAX_WAITING = 1


def _sort_key(request: Request) -> tuple[int, float, int]:
    return request.sort_key


def _always_ready(lora: LoRARequest) -> bool:
    return True


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_kv_blocks: int,
        max_model_len: int,
        kv_sliding_window: int | None = None,
        kv_group_windows: tuple[int | None, ...] = (),
    ) -> None:
        """kv_sliding_window: the window every layer of the model shares, if they all have one
        (the runner's kv_sliding_window): blocks behind it are freed as requests run.
        kv_group_windows: a hybrid model's KV groups' windows (the runner's; kv_groups.py),
        one block table per group; fewer than two: one table."""
        # EngineConfig checks this itself only when it is given max_model_len; here it is known
        config.check_prefill_budget(max_model_len)
        self.config = config
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        caching = config.enable_prefix_caching
        if len(kv_group_windows) > 1:
            self.kv = HybridKVCacheManager(
                num_kv_blocks, config.block_size, caching, tuple(kv_group_windows)
            )
        else:
            self.kv = KVCacheManager(num_kv_blocks, config.block_size, caching, kv_sliding_window)
        self.hybrid = len(kv_group_windows) > 1
        self.kv_tier_hit_tokens = 0
        # LoRA: at most max_loras distinct adapters among a step's requests; a request whose
        # adapter is not loaded yet waits (`lora_ready`, the engine's LoRAManager.ready)
        self.max_loras = config.max_loras if config.lora_enabled else None
        self.lora_ready: Callable[[LoRARequest], bool] = _always_ready
        self.lora_names: Callable[[], list[str]] = list
        self.requests: dict[str, Request] = {}
        # fcfs: arrival order, a preempted request back at the front; priority: ordered by
        # (priority, arrival time), so a preempted request keeps its place
        self.by_priority = config.scheduling_policy == "priority"
        self._num_added = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_step: list[str] = []
        self.num_preemptions_total = 0
        self.num_resumed_total = 0
        self.num_resumed_tokens_total = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_pooling = 0  # unfinished pooling requests (embeddings)
        self.num_joined_total = 0  # prompts that joined a decode step under way
        self.num_first_text_holds_total = 0  # steps that kept prompts out (first_text_priority)
        self._held_last_step = False
        # speculative decoding by prompt lookup for plain greedy requests (off at 0 tokens)
        self.proposer = (
            NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min
            )
            if config.num_speculative_tokens > 0
            else None
        )

    # -- requests in and out --------------------------------------------------------------
    def check_request(self, num_prompt_tokens: int, max_tokens: int, pooling: bool = False) -> None:
        """Raise RequestRejected when a request of this shape could never complete. A pooling
        request (max_tokens 0: nothing is generated) may fill max_model_len."""
        if pooling:
            limits = EngineLimits(self.max_model_len, 0, self.kv.num_blocks, self.block_size)
            limits.check_pooling_length(num_prompt_tokens)
            limits.check_blocks(num_prompt_tokens, 0)
        else:
            check_fits(
                num_prompt_tokens,
                max_tokens,
                self.max_model_len,
                self.block_size,
                self.kv.num_blocks,
            )
        if self.hybrid:  # blocks in every KV group
            total = min(num_prompt_tokens + max_tokens, self.max_model_len)
            need = self.kv.max_blocks(total, self.max_num_batched_tokens)
            if need > self.kv.num_blocks:
                raise RequestRejected(
                    f"request needs up to {total} tokens = {need} KV blocks of "
                    f"{self.block_size} over {self.kv.num_groups} KV groups, but the whole KV "
                    f"cache has {self.kv.num_blocks} blocks",
                    "max_tokens",
                )

    def add_request(self, request: Request) -> StepOutput | None:
        """Queue a request. A resumed one (migration) whose resumed output already ends it
        (EOS, a stop token, its grammar's end, max_tokens) is not queued: its final
        StepOutput, with no new tokens, is returned for the caller to deliver."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        pooling = request.pooling is not None
        max_tokens = 0 if pooling else request.sampling_params.max_tokens
        self.check_request(request.num_prompt_tokens, max_tokens, pooling)
        request.max_total_tokens = min(request.num_prompt_tokens + max_tokens, self.max_model_len)
        if request.engine_request.resume is not None:
            status = self._replay_resumed(request)
            self.num_resumed_total += 1
            if status is not None:
                request.status = status
                return StepOutput(request.request_id, [], status.finish_reason, request.stop_reason)
            self.num_resumed_tokens_total += request.num_resumed_tokens
        if self.kv.enable_caching:
            request.update_block_hashes(self.block_size)
        request.status = RequestStatus.WAITING
        request.speculate = (
            self.proposer is not None
            and not pooling
            and speculation_allowed(request.sampling_params)
        )
        self.num_pooling += pooling
        self._num_added += 1
        request.seq = self._num_added
        self.requests[request.request_id] = request
        self._enqueue(request)
        return None

    def _replay_resumed(self, request: Request) -> RequestStatus | None:
        """Walk a resumed request's output as if it had been sampled here: its grammar
        accepts each token, the stop conditions are checked after each. The finish status
        the last token causes, if any; RequestRejected for a token the grammar refuses or one
        that would have ended the request before the last."""
        output = request.output_token_ids
        grammar = request.grammar
        for i, token in enumerate(output):
            if grammar is not None and not grammar.accept(token):
                raise RequestRejected(
                    f"resumed output token {i} (id {token}) is not allowed by the request's "
                    "structured-output grammar",
                    "resume",
                )
            status = self._stop_status(request, token, request.num_prompt_tokens + i + 1)
            if status is not None and i < len(output) - 1:
                raise RequestRejected(
                    f"resumed output token {i} (id {token}) ends the request "
                    f"({status.finish_reason}), but {len(output) - 1 - i} more follow it",
                    "resume",
                )
            if status is not None:
                return status
        return None

    def _enqueue(self, request: Request, preempted: bool = False) -> None:
        """Into the waiting queue: at the back (fcfs), at the front when preempted (fcfs: it
        is older than any waiting request), or in (priority, arrival) order (priority)."""
        if not self.by_priority:
            if preempted:
                self.waiting.appendleft(request)
            else:
                self.waiting.append(request)
            return
        key = request.sort_key
        waiting = self.waiting
        i = len(waiting)
        while i > 0 and waiting[i - 1].sort_key > key:  # new arrivals: usually the back
            i -= 1
        waiting.insert(i, request)

    def abort_requests(self, request_ids) -> list[Request]:
        """End requests their caller gave up on; returns those that were still unfinished."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        """End requests for a reason decided outside (an abort, a stop string found by the
        detokenizer); returns those that were still unfinished."""
        ended = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            ended.append(request)
        return ended

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        if request.pooling is not None:
            self.num_pooling -= 1
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        self._finished_since_step.append(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
        out = SchedulerOutput()
        scheduled = out.scheduled
        kv = self.kv

        proposer = self.proposer
        cap = self.config.speculative_max_running
        if proposer is not None and cap and len(self.running) > cap:
            proposer = None  # compute-bound batch: no drafts this step
        if proposer is not None and any(
            r.num_output_tokens == 0 for queue in (self.running, self.waiting) for r in queue
        ):
            # a request waits for its first token (its prompt runs in this step, or waits to):
            # the others' drafts would lengthen the step that brings it, and take KV blocks it
            # may need
            proposer = None
        hold = self._first_text_hold()
        held = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = request.num_tokens - request.num_computed_tokens
            if hold and num_new > 1:
                held = True
                i += 1
                continue
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                i += 1
                continue
            draft = []
            # a decode (the last token alone left to compute), not a prefill chunk capped to 1
            if (
                proposer is not None
                and request.speculate
                and request.num_tokens - request.num_computed_tokens == 1
            ):
                # room: the budget, and the bonus token must still fit max_total_tokens
                room = min(budget - 1, request.max_total_tokens - request.num_tokens - 1)
                # and the KV pool: a draft's blocks must leave one block for each running
                # request after this one (a draft is never worth a preemption)
                later = len(self.running) - i - 1
                if kv.pool.num_free_blocks - later < 1 + proposer.k // self.block_size + 1:
                    room = 0
                draft = proposer.propose(request, room)
                if draft and kv.allocate_slots(request, 1 + len(draft)) is None:
                    draft = []  # no blocks for the draft: decode plainly (may preempt below)
                num_new += len(draft)
            while kv.allocate_slots(request, num_new) is None:
                # fcfs: the newest running request; priority: the lowest priority, newest
                victim = max(self.running, key=_sort_key) if self.by_priority else self.running[-1]
                position = self.running.index(victim) if self.by_priority else len(self.running) - 1
                budget += self._preempt_running(victim, out)
                if position < i:
                    i -= 1  # it had been scheduled in this step: now undone
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                # the request itself was the victim: it waits in the queue now, and running[i]
                # is the next one. Under fcfs the victim is the newest, so none follows; under
                # priority a request of higher priority may follow and is still scheduled in
                # this step (vLLM stops the loop here, which leaves a step with nothing run)
                continue
            scheduled.append(
                ScheduledRequest(
                    request,
                    request.num_computed_tokens,
                    num_new,
                    kv.block_ids(request.request_id),
                    draft,
                    kv.group_block_ids(request.request_id) if self.hybrid else [],
                )
            )
            request.num_computed_tokens += num_new
            budget -= num_new
            i += 1

        if hold:
            held = held or bool(self.waiting)
        elif not out.preempted_request_ids:
            self._admit_waiting(out, budget, threshold)
        self.num_first_text_holds_total += held
        self._held_last_step = held

        out.total_num_scheduled_tokens = sum(s.num_tokens for s in scheduled)
        out.finished_request_ids = self._finished_since_step
        self._finished_since_step = []
        out.pooling = self.num_pooling > 0
        if self.kv.pool.tier is not None:
            out.kv_ops = self.kv.pool.tier.take_ops()
        return out

    def _first_text_hold(self) -> bool:
        """Whether this step runs decodes alone (prompt chunks and admissions wait for the
        next one) because a running request's next token may bring its client's first text
        (first_text_priority): not two steps in a row, and only while at most
        FIRST_TEXT_MAX_WAITING prompts would wait. A held step adds a decode step's time to
        the engine's work; with more prompts queued the engine is behind its arrivals, where
        that time delays every one of them (bench/results/first_text_long_amd_s60.json)."""
        if not self.config.first_text_priority or self._held_last_step:
            return False
        due, chunks = False, 0
        for request in self.running:
            left = request.num_tokens - request.num_computed_tokens
            if left == 1:
                due = due or request.text_pending
            elif left > 1:
                chunks += 1
        return due and len(self.waiting) + chunks <= FIRST_TEXT_MAX_WAITING

    def schedule_join(self, step: SchedulerOutput) -> SchedulerOutput | None:
        """Prompts that arrived while `step` runs, admitted to join it at a layer boundary
        (the runner runs their chunks through the layers `step` has passed, then the rest of
        the layers as one batch): only into a step of decodes alone, within what is left of
        its token budget, in queue order, without preempting (the running requests' blocks
        are in use), and only plain requests (no prompt logprobs, pooling or adapter: their
        rows are laid out for the whole step). None when none joins."""
        if not self.waiting or step.pooling or not step.decodes_only:
            return None
        if (
            self.config.first_text_priority
            and len(self.waiting) <= FIRST_TEXT_MAX_WAITING
            and any(s.request.text_pending for s in step.scheduled)
        ):
            return None  # it brings a client its first text: a prompt would delay it
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens - step.total_num_scheduled_tokens
        self._admit_waiting(out, budget, self.config.long_prefill_token_threshold, join=True)
        if not out.scheduled:
            return None
        out.total_num_scheduled_tokens = sum(s.num_tokens for s in out.scheduled)
        if self.kv.pool.tier is not None:
            out.kv_ops = self.kv.pool.tier.take_ops()
        self.num_joined_total += len(out.scheduled)
        return out

    def _admit_waiting(
        self, out: SchedulerOutput, budget: int, threshold: int, join: bool = False
    ) -> None:
        """Move waiting requests to running, in queue order, while the step's token budget,
        max_num_seqs and the KV pool allow. `join`: into a step under way (schedule_join):
        the first request that cannot join, or would need a preemption, ends the admission."""
        kv = self.kv
        chunked = self.config.enable_chunked_prefill
        waiting = self.waiting
        # LoRA (vLLM's rule): a request whose adapter is not loaded, or would be one adapter
        # too many among the running requests and this step's admissions, is skipped this
        # step (it keeps its place); the requests behind it may still be admitted
        max_loras = self.max_loras
        active = None
        if max_loras is not None:
            active = {r.lora.name for r in self.running if r.lora is not None}
        index = 0
        while index < len(waiting) and budget > 0:
            request = waiting[index]
            lora = request.lora
            if join and (
                lora is not None or request.pooling is not None or request.needs_every_prompt_row
            ):
                break
            if lora is not None and active is not None:
                if not self.lora_ready(lora) or (
                    lora.name not in active and len(active) >= max_loras
                ):
                    index += 1
                    continue
            if len(self.running) >= self.max_num_seqs:
                if join:
                    break
                # priority: a seat is taken from a running request of lower priority
                restored = self._preempt_lower_priority(request, out)
                if restored is None:
                    break
                budget += restored
                continue
            tier_run: list[int] = []
            if request.needs_every_prompt_row:
                hits, num_hit_tokens = [], 0  # every prompt position's output is wanted
            else:
                hits, num_hit_tokens = kv.get_computed_blocks(request)
                if not self.hybrid:  # the pool's hits continued by the tiers below it
                    tier_run = kv.take_tier_hits(request, len(hits))
            num_tier_tokens = len(tier_run) * self.block_size
            num_hit_tokens += num_tier_tokens
            num_new = request.num_tokens - num_hit_tokens
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                if not chunked:
                    if tier_run:
                        kv.pool.tier.put_back(tier_run)
                    break
                num_new = budget
            # the tier's blocks are new blocks of the pool, filled by the runner's restore
            new_blocks = kv.allocate_slots(request, num_tier_tokens + num_new, hits)
            if tier_run:
                if new_blocks is None:
                    kv.pool.tier.put_back(tier_run)
                else:
                    ids = [b.block_id for b in new_blocks[: len(tier_run)]]
                    kv.pool.tier.restore(tier_run, ids)
                    self.kv_tier_hit_tokens += num_tier_tokens
            if new_blocks is None:
                if join:
                    break
                # priority: KV blocks are taken from a running request of lower priority
                restored = self._preempt_lower_priority(request, out)
                if restored is None:
                    break
                budget += restored
                continue
            del waiting[index]
            if lora is not None and active is not None:
                active.add(lora.name)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if kv.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_hit_tokens
            rid = request.request_id
            groups = kv.group_block_ids(rid) if self.hybrid else []
            out.scheduled.append(
                ScheduledRequest(request, num_hit_tokens, num_new, kv.block_ids(rid), [], groups)
            )
            request.num_computed_tokens += num_new
            budget -= num_new

    def _preempt_lower_priority(self, request: Request, out: SchedulerOutput) -> int | None:
        """Under the priority policy, preempt the running request of the lowest priority (the
        newest among equals) if its priority is strictly lower than `request`'s; returns the
        budget it gives back (its tokens scheduled in this step), or None when none qualifies."""
        if not self.by_priority or not self.running:
            return None
        victim = max(self.running, key=_sort_key)
        if victim.priority <= request.priority:
            return None
        share = next((s for s in out.scheduled if s.request is victim), None)
        if share is not None and self.kv.in_flight_shared(victim, share.start):
            # a request admitted in this step hit blocks the victim writes in this step:
            # preempting it now would leave them unwritten; the seat waits a step
            return None
        return self._preempt_running(victim, out)

    def _preempt_running(self, victim: Request, out: SchedulerOutput) -> int:
        """Preempt a running request, undoing its share of this step if it was scheduled in
        it; returns the tokens that gives back to the step's budget."""
        self.running.remove(victim)
        restored = 0
        for j, sched in enumerate(out.scheduled):
            if sched.request is victim:
                restored = sched.num_tokens
                del out.scheduled[j]
                # the blocks its allocation cached in this step will not be computed
                self.kv.uncache_in_flight(victim, sched.start)
                break
        self._preempt(victim)
        out.preempted_request_ids.append(victim.request_id)
        return restored

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.pooled = None  # its rows run again
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._enqueue(request, preempted=True)

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled: dict[str, int],
        logprobs: dict[str, tuple[float, dict[int, float]]] | None = None,
        prompt_logprobs: dict[str, tuple[int, list[tuple[float, dict[int, float]]]]] | None = None,
        spec_tokens: dict[str, list[int]] | None = None,
        pooled: dict | None = None,
    ) -> list[StepOutput]:
        """Append each sampled token, apply stop conditions, free finished requests.
        `prompt_logprobs`: per request, (index of the first entry, entries) computed this step
        for its prompt tokens (see Request.prompt_logprobs). `spec_tokens`: per request that
        ran a draft, its new tokens (the accepted draft tokens, then the model's own); they
        are taken one by one until one of them ends the request. `pooled`: per pooling
        request that ran rows this step, their summed hidden states (replica/pooling.py)."""
        if prompt_logprobs:
            self._record_prompt_logprobs(prompt_logprobs)
        outputs = []
        any_finished = False
        if pooled:
            any_finished = self._pool(scheduler_output, pooled, outputs)
        for sched in scheduler_output.scheduled:
            request = sched.request
            token = sampled.get(sched.request_id)
            if token is None or request.is_finished:
                continue  # a prefill chunk that did not reach the end, or aborted meanwhile
            tokens = (token,)
            if sched.draft:
                # a runner that verified the draft says which tokens hold; one that did not
                # (the simulator's) yields only its one token
                tokens = (spec_tokens or {}).get(sched.request_id) or tokens
                self.proposer.record(sched.request_id, len(sched.draft), len(tokens) - 1)
            new_tokens = []
            status = None
            for token in tokens:
                new_tokens.append(token)
                status = self._append_token(request, token)
                if status is not None:
                    break
            if sched.draft and status is None:
                # the rejected draft positions' KV is stale: recompute from the first new token
                request.num_computed_tokens = request.num_tokens - 1
            step = StepOutput(request.request_id, new_tokens)
            if logprobs is not None and sched.request_id in logprobs:
                step.new_logprobs = [logprobs[sched.request_id]]
            if request.prompt_logprobs is not None and request.num_output_tokens == len(new_tokens):
                step.prompt_logprobs = request.prompt_logprobs
            if status is not None:
                self._finish(request, status)
                step.finish_reason = status.finish_reason
                step.stop_reason = request.stop_reason
                any_finished = True
            outputs.append(step)
        if any_finished:  # one pass instead of a list.remove per finished request
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _pool(self, scheduler_output: SchedulerOutput, pooled: dict, outputs: list) -> bool:
        """Add each pooling request's rows of this step to its sum; one whose prompt has run
        to its end finishes ("stop") with its embedding. Whether any finished."""
        any_finished = False
        for sched in scheduler_output.scheduled:
            request = sched.request
            rows = pooled.get(sched.request_id)
            if rows is None or request.is_finished:
                continue
            request.pooled = rows if request.pooled is None else request.pooled + rows
            if not sched.sample:
                continue  # a prefill chunk that did not reach the prompt's end
            embedding = finish_embedding(request.pooled, request.pooling, request.num_tokens)
            request.pooled = None
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            outputs.append(StepOutput(request.request_id, [], "stop", embedding=embedding))
            any_finished = True
        return any_finished

    def _append_token(self, request: Request, token: int) -> RequestStatus | None:
        """Append one new token; the finished status it causes, if any."""
        request.all_token_ids.append(token)
        if self.kv.enable_caching:  # hashes matter only for prefix caching
            request.update_block_hashes(self.block_size)
        if request.grammar is not None and not request.grammar.accept(token):
            # the mask allows only tokens the grammar accepts; should this ever fail, the
            # output cannot match, so it must not end as a clean "stop"
            logger.error("request %s: sampled token %d outside its grammar", request, token)
            return RequestStatus.FINISHED_LENGTH
        return self._stop_status(request, token, request.num_tokens)

    @staticmethod
    def _stop_status(request: Request, token: int, num_tokens: int) -> RequestStatus | None:
        """The finish status `token` causes as the request's `num_tokens`-th token (its
        grammar already advanced over it), if any."""
        params = request.sampling_params
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and request.grammar.terminated:
            return RequestStatus.FINISHED_STOPPED
        if num_tokens >= request.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _record_prompt_logprobs(
        self, prompt_logprobs: dict[str, tuple[int, list[tuple[float, dict[int, float]]]]]
    ) -> None:
        for rid, (first, entries) in prompt_logprobs.items():
            request = self.requests.get(rid)
            if request is None or request.prompt_logprobs is None:
                continue
            have = request.prompt_logprobs
            # a recomputed chunk (after a preemption) brings entries already recorded
            skip = len(have) - first
            if skip >= 0:
                have.extend(entries[skip:])

    def stats(self) -> SchedulerStats:
        spec = self.proposer.stats if self.proposer is not None else None
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv.usage(),
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            spec_num_drafts=spec.num_drafts if spec else 0,
            spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            loras=tuple(self.lora_names()),
            num_resumed_total=self.num_resumed_total,
            num_resumed_tokens_total=self.num_resumed_tokens_total,
            num_joined_total=self.num_joined_total,
            num_first_text_holds_total=self.num_first_text_holds_total,
            **self._tier_stats(),
        )

    def _tier_stats(self) -> dict:
        tier = self.kv.pool.tier
        if tier is None:
            return {}
        return {
            "kv_tier_saves": tier.num_saves,
            "kv_tier_restores": tier.num_restores,
            "kv_tier_hit_tokens": self.kv_tier_hit_tokens,
            "kv_tier_blocks": len(tier),
            "kv_imported_blocks": tier.num_imported,
        }
