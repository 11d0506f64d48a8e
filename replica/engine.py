"""The engine: Engine runs one scheduler step at a time (offline `LLM` uses it directly);
AsyncEngine runs that loop on a background thread and gives each request an async stream."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from replica.config import EngineConfig
from replica.detokenizer import IncrementalDetokenizer
from replica.request import (
    EngineDeadError,
    EngineOverloaded,
    GrammarRejected,
    Request,
    RequestOutput,
    RequestRejected,
    RequestStatus,
    SamplingParams,
)
from replica.runner_protocol import Runner
from replica.scheduler import Scheduler, SchedulerStats, check_request_fits
from replica.structured import StructuredOutputError, StructuredOutputs

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncEngine",
    "CompletionOutput",
    "Engine",
    "EngineDeadError",
    "EngineOverloaded",
    "LLM",
    "RequestRejected",
    "StreamingEngine",
]


def load_eos_token_ids(model_dir: str | Path, tokenizer_eos_id: int | None) -> frozenset[int]:
    """EOS ids from generation_config.json (int or list) plus the tokenizer's own."""
    ids: set[int] = set()
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    if tokenizer_eos_id is not None:
        ids.add(int(tokenizer_eos_id))
    return frozenset(ids)


def make_runner(config: EngineConfig, model_dir: str | Path) -> Runner:
    """The model runner for this config: in-process for tp=1, an SPMD group otherwise."""
    if config.tensor_parallel_size > 1:
        from replica.parallel import TensorParallelRunner

        return TensorParallelRunner(config, model_dir)
    from replica.runner import ModelRunner

    return ModelRunner(config, model_dir)


def check_request(
    config: EngineConfig,
    vocab_size: int,
    max_model_len: int,
    num_kv_blocks: int,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    priority: int = 0,
) -> None:
    """Raise RequestRejected (a user error) for a request an engine of this shape can never
    serve: the engine's own check, and its front's (replica/engine_core.py) before sending."""
    if priority != 0 and config.scheduling_policy != "priority":
        raise RequestRejected(
            f"priority={priority} needs scheduling_policy='priority' (this replica runs "
            f"{config.scheduling_policy!r})"
        )
    if not prompt_token_ids:
        raise RequestRejected("prompt must contain at least one token")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestRejected(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    check_request_fits(
        len(prompt_token_ids), params.max_tokens, max_model_len, config.block_size, num_kv_blocks
    )
    if params.logit_bias:
        bad = next((t for t in params.logit_bias if t >= vocab_size), None)
        if bad is not None:
            raise RequestRejected(
                f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})"
            )


class OutputProcessor:
    """Detokenization and stop strings of an engine's requests: turns the engine's token deltas
    into text deltas. In-process (Engine with detokenize=True) it runs on the engine's thread;
    with the engine core in its own process (replica/engine_core.py) it runs in the front, and
    a stop string found there is sent to the core as a finish."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer  # or a LazyTokenizer, resolved at the first request
        self._detoks: dict[str, IncrementalDetokenizer] = {}

    def __len__(self) -> int:
        return len(self._detoks)

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        from replica.tokenizer import loaded

        self._detoks[request_id] = IncrementalDetokenizer(
            loaded(self.tokenizer),
            list(prompt_token_ids),
            params.stop,
            params.include_stop_str_in_output,
        )

    def drop(self, request_id: str) -> None:
        self._detoks.pop(request_id, None)

    def process(self, out: RequestOutput) -> tuple[RequestOutput | None, bool]:
        """`out` with its text delta filled in, and whether a stop string ended it here (the
        engine must then finish the request); None for a request this processor does not
        hold (finished or dropped: a delta the engine made before it heard of the end)."""
        detok = self._detoks.get(out.request_id)
        if detok is None:
            return None, False
        taken = detok.add_tokens(out.new_token_ids)
        # the engine must finish the request when the stop string ended it here
        stopped = out.finish_reason is None and detok.stop_string is not None
        dropped = len(out.new_token_ids) - taken
        if stopped or (dropped > 0 and detok.stop_string is not None):
            # a delta of several tokens (accepted draft tokens) may go past the token that
            # completed the stop string, even past one that ended the request (max_tokens,
            # EOS): the output ends at the stop string, as with one token a step
            out.finish_reason, out.stop_reason = "stop", detok.stop_string
            if dropped > 0:
                out.new_token_ids = out.new_token_ids[:taken]
                out.num_output_tokens -= dropped
                if out.new_logprobs is not None:
                    out.new_logprobs = out.new_logprobs[:taken]
        out.new_text = detok.take_delta(finished=out.finished)
        if out.finished:  # pop: the caller's thread may have dropped it meanwhile (an abort)
            self._detoks.pop(out.request_id, None)
        return out, stopped


@dataclass(slots=True)
class StepReport:
    """What one engine step did, for the replica's metrics and KV events: made where the
    engine runs, observed where the metrics live (the same process, or the front of an engine
    core in its own process). Times are time.monotonic(), one clock for every process of a
    machine."""

    end: float
    step_time: float
    num_scheduled_tokens: int
    first_scheduled: list[tuple[str, float]]  # (request id, arrival) first scheduled this step
    finished_request_ids: list[str]
    stats: SchedulerStats
    kv_batch: object = None  # a sealed KVEventBatch, when KV events are on and blocks changed

    @classmethod
    def of(cls, engine: Engine, scheduler_output, step_time: float) -> StepReport:
        """The report of the step that just ended; marks each request's first scheduling."""
        end = time.monotonic()
        started = end - step_time  # the step (and its schedule) began here
        first = []
        for sched in scheduler_output.scheduled:
            request = sched.request
            if request.first_scheduled_time is None:
                request.first_scheduled_time = started
                first.append((request.request_id, request.arrival_time))
        return cls(
            end=end,
            step_time=step_time,
            num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            first_scheduled=first,
            finished_request_ids=list(scheduler_output.finished_request_ids),
            stats=engine.stats(),
        )


class Engine:
    """One replica's engine: scheduler + Runner (runner_protocol.py) + detokenizer, stepped
    synchronously."""

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner | None = None,
        tokenizer=None,
        detokenize: bool = True,
    ) -> None:
        """`detokenize=False`: outputs carry token ids only (new_text empty) and stop strings
        are not looked for: the caller runs an OutputProcessor (an engine core in its own
        process, whose front detokenizes)."""
        self.config = config
        self.model_dir = config.model_dir()
        started = time.perf_counter()
        from replica.tokenizer import LazyTokenizer, declared_eos_token_id, load_tokenizer

        eos_token_id = None
        if tokenizer is None and not detokenize:
            # a core that does not detokenize needs its tokenizer only for grammars: loaded at
            # the first one, if its eos token can be read from the files
            try:
                eos_token_id = declared_eos_token_id(self.model_dir)
                tokenizer = LazyTokenizer(self.model_dir)
            except LookupError:
                pass
        if tokenizer is None:
            tokenizer = load_tokenizer(self.model_dir)
        if not isinstance(tokenizer, LazyTokenizer):
            eos_token_id = tokenizer.eos_token_id
        self._tokenizer = tokenizer
        tokenized = time.perf_counter()
        self.runner = runner if runner is not None else make_runner(config, self.model_dir)
        # wall seconds of the engine's start: the tokenizer, then the runner's own phases
        # (config, weights, kernels, kv_cache: ModelRunner.startup_s), the rest as "runner"
        phases = dict(getattr(self.runner, "startup_s", {}))
        runner_s = time.perf_counter() - tokenized
        self.startup_s = {"tokenizer": round(tokenized - started, 3), **phases}
        self.startup_s["runner_other"] = round(max(0.0, runner_s - sum(phases.values())), 3)
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = load_eos_token_ids(self.model_dir, eos_token_id)
        self.scheduler = Scheduler(config, self.runner.num_kv_blocks, self.max_model_len)
        self._requests: dict[str, Request] = {}  # unfinished, by id
        self.output_processor = OutputProcessor(tokenizer) if detokenize else None
        self.vocab_size = self.runner.vocab_size
        # grammars of structured outputs, compiled for this tokenizer and vocabulary on first use
        self.structured = StructuredOutputs(tokenizer, self.vocab_size, self.eos_token_ids)
        self.step_listeners: list = []  # callables(engine, scheduler_output, outputs, step_time)
        # wall seconds the latest step spent in schedule(); the runner times its own phases
        # (runner.step_times), the rest of step_time is update_from_output and detokenizing
        self.last_schedule_time = 0.0

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer (loaded now if it was left to its first use)."""
        from replica.tokenizer import loaded

        return loaded(self._tokenizer)

    @property
    def num_kv_blocks(self) -> int:
        return self.scheduler.kv.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.kv.pool.num_free_blocks

    def check_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, priority: int = 0
    ) -> None:
        """Raise RequestRejected (a user error) for a request that can never be served."""
        check_request(
            self.config, self.vocab_size, self.max_model_len, self.num_kv_blocks,
            prompt_token_ids, params, priority,
        )  # fmt: skip

    def compile_grammar(self, params: SamplingParams):
        """The compiled grammar of a structured request (cached), or None for a free one;
        RequestRejected names the problem when it cannot compile."""
        if params.structured is None:
            return None
        try:
            return self.structured.compile(params.structured)
        except StructuredOutputError as exc:
            raise GrammarRejected(str(exc)) from None

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        compiled_grammar=None,
        priority: int = 0,
    ) -> Request:
        """Queue a request. A structured one's grammar is compiled here unless the caller
        compiled it already (`compile_grammar`, off the engine thread). `priority`: lower is
        more urgent (scheduling_policy 'priority')."""
        self.check_request(prompt_token_ids, params, priority)
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            self.eos_token_ids,
            arrival_time,
            priority=priority,
        )
        if params.structured is not None:
            compiled = compiled_grammar or self.compile_grammar(params)
            request.grammar = self.structured.new_state(params.structured, compiled)
        self.scheduler.add_request(request)
        self._requests[request_id] = request
        if self.output_processor is not None:
            self.output_processor.add(request_id, request.prompt_token_ids, params)
        return request

    def abort(self, request_ids: Sequence[str]) -> None:
        self.scheduler.abort_requests(request_ids)
        for rid in request_ids:
            self._forget(rid)

    def finish_stopped(self, request_ids: Sequence[str]) -> None:
        """End requests whose stop string the caller's OutputProcessor found (their KV blocks
        are freed now, their finish is `stop`)."""
        live = [rid for rid in request_ids if rid in self._requests]
        self.scheduler.finish_requests(live, RequestStatus.FINISHED_STOPPED)
        for rid in live:
            self._forget(rid)

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        if self.output_processor is not None:
            self.output_processor.drop(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_request_states(self) -> int:
        """Requests this engine keeps per-request state for (0 when idle: nothing leaked)."""
        return len(self._requests)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, and turn sampled tokens into per-request outputs."""
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        self.last_schedule_time = time.perf_counter() - t0
        if scheduler_output.is_empty:
            return []
        runner_output = self.runner.execute(scheduler_output)
        step_outputs = self.scheduler.update_from_output(
            scheduler_output,
            runner_output.sampled,
            runner_output.logprobs,
            runner_output.prompt_logprobs,
            runner_output.spec_tokens,
        )
        outputs = []
        processor = self.output_processor
        for step in step_outputs:
            request = self._requests.get(step.request_id)
            if request is None:
                continue
            out = RequestOutput(
                request_id=step.request_id,
                new_token_ids=step.new_token_ids,
                new_text="",
                num_prompt_tokens=request.num_prompt_tokens,
                num_output_tokens=request.num_output_tokens,
                finish_reason=step.finish_reason,
                stop_reason=step.stop_reason,
                new_logprobs=step.new_logprobs,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                num_preemptions=request.num_preemptions,
                prompt_logprobs=step.prompt_logprobs,
            )
            if processor is not None:
                out, stopped = processor.process(out)
                if stopped:
                    self.scheduler.finish_requests(
                        [step.request_id], RequestStatus.FINISHED_STOPPED
                    )
            if out.finished:
                del self._requests[step.request_id]
            outputs.append(out)
        if self.step_listeners:
            elapsed = time.perf_counter() - t0
            for listener in self.step_listeners:
                listener(self, scheduler_output, outputs, elapsed)
        return outputs

    def shutdown(self) -> None:
        self.runner.shutdown()


@dataclass
class CompletionOutput:
    """One finished request: made by LLM.generate from its merged RequestOutputs, for the caller."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[tuple[float, dict[int, float]]] | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # with SamplingParams.prompt_logprobs: per prompt token after the first, its logprobs
    prompt_logprobs: list[tuple[float, dict[int, float]]] | None = None


class LLM:
    """Offline batch generation, as in vLLM: `LLM(model=DIR, **engine_fields).generate(...)`.

    Its resources (the tensor-parallel group and its worker processes, the weights, the KV
    cache) are released by `shutdown()`, at the end of a `with LLM(...) as llm:` block, or when
    the object is garbage-collected (`del llm`), whichever comes first; a second LLM, of any
    tensor-parallel size, can then be built in the same process."""

    def __init__(self, model: str | Path | None = None, **engine_fields) -> None:
        config = EngineConfig(model=str(model) if model is not None else None, **engine_fields)
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        # holds the engine, not self: runs once, on shutdown(), on collection or at exit
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling params for {len(prompts)} prompts"
            )
        if not self._finalizer.alive:
            raise RuntimeError("this LLM has been shut down; build a new one to generate")
        engine = self.engine
        prompt_ids: dict[str, list[int]] = {}  # in submission order
        merged: dict[str, RequestOutput] = {}
        for prompt, params in zip(prompts, sampling_params, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = str(next(self._ids))
            engine.add_request(rid, ids, params)
            prompt_ids[rid] = ids
        while engine.has_unfinished():
            for out in engine.step():
                seen = merged.get(out.request_id)
                merged[out.request_id] = out if seen is None else seen.merge(out)
        return [
            CompletionOutput(
                request_id=rid,
                prompt_token_ids=ids,
                output_token_ids=merged[rid].new_token_ids,
                text=merged[rid].new_text,
                finish_reason=merged[rid].finish_reason,
                stop_reason=merged[rid].stop_reason,
                logprobs=merged[rid].new_logprobs or None,
                num_cached_tokens=merged[rid].num_cached_tokens,
                num_preemptions=merged[rid].num_preemptions,
                prompt_logprobs=merged[rid].prompt_logprobs,
            )
            for rid, ids in prompt_ids.items()
        ]

    def shutdown(self) -> None:
        """Release the engine's resources now (idempotent)."""
        self._finalizer()


class StreamingEngine:
    """The caller's side of a serving engine, shared by AsyncEngine (the engine in a thread of
    this process) and ProcessEngine (replica/engine_core.py: an engine core in a process of its
    own): admission to the replica's queue, one async stream of deltas per request, abort when
    a caller leaves, draining, and stall detection. Subclasses say how requests reach the
    engine (`_check_request`, `_prepare`, `_submit`, `abort`) and whether it still runs
    (`_check_engine`); they call `_dispatch` with each step's outputs, on the event loop."""

    def __init__(self, config: EngineConfig, loop: asyncio.AbstractEventLoop | None) -> None:
        self.config = config
        self._loop = loop
        self._streams: dict[str, asyncio.Queue] = {}
        self._stopped = False
        self._draining = False
        self.error: BaseException | None = None
        self.num_threads = 0  # torch intra-op threads of the engine, once it runs
        # monotonic time the engine last finished a step or found nothing to do: with
        # requests held and this too old, the engine is stuck (check_health)
        self._progress_at = time.monotonic()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stalled_s(self) -> float:
        """Seconds the engine has held requests without finishing a step (0 when it is idle
        or making progress)."""
        if not self._streams:
            return 0.0
        return max(0.0, time.monotonic() - self._progress_at)

    def check_health(self) -> None:
        """Raise EngineDeadError when the engine cannot serve: its loop or process died, a
        tensor-parallel rank is gone, or it has held requests for stall_timeout_s without
        finishing a step (a stuck forward, a hung collective). A stalled engine's streams end
        with the error now, rather than when the replica is replaced."""
        if self.error is not None:
            raise EngineDeadError(f"engine loop died: {self.error!r}") from self.error
        self._check_engine()
        stalled = self.stalled_s()
        limit = self.config.stall_timeout_s
        if stalled > limit:
            error = EngineDeadError(
                f"engine stalled: no step finished for {stalled:.1f} s with "
                f"{len(self._streams)} requests in flight (stall_timeout_s={limit:g})"
            )
            if self.error is None:
                self.error = error
                for rid in list(self._streams):
                    self._deliver_error(rid, error)
            raise error

    def stats(self) -> SchedulerStats:
        """Counters as of the end of the last step (never blocks on the engine)."""
        return self._stats

    def num_unfinished(self) -> int:
        return len(self._streams)

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream of RequestOutput deltas; the last has finish_reason set. Leaving the stream
        early (client gone, task cancelled) aborts the request and frees its KV blocks."""
        self.check_health()
        if self._draining:
            raise EngineOverloaded("replica is draining and takes no new requests")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self._check_request(prompt_token_ids, params, priority)
        # Every request this replica holds has a stream (registered here at once, so a burst
        # that lands within one step is counted in full). Those beyond the seats that can run
        # are waiting: all max_num_seqs seats, unless the last step already left requests
        # waiting (KV cache or token budget full); then only as many as ran in it. A replica
        # never holds more than max_num_seqs + max_queue_len requests.
        stats = self._stats
        seats = stats.num_running if stats.num_waiting else self.config.max_num_seqs
        waiting = len(self._streams) - seats
        if waiting >= self.config.max_queue_len:
            raise EngineOverloaded(
                f"replica queue is full ({waiting} waiting >= max_queue_len="
                f"{self.config.max_queue_len})"
            )
        rid = request_id or uuid.uuid4().hex
        if rid in self._streams:
            raise ValueError(f"duplicate request id {rid!r}")
        compiled = await self._prepare(params)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        self._submit(rid, prompt_token_ids, params, arrival_time, compiled, priority)
        finished = False
        try:
            held: BaseException | None = None  # an error queued behind deltas, raised next
            while True:
                item = held or await queue.get()
                if isinstance(item, BaseException):
                    raise item
                # a consumer behind the engine gets every delta queued so far as one
                while not item.finished and not queue.empty():
                    later = queue.get_nowait()
                    if isinstance(later, BaseException):
                        held = later
                        break
                    item = item.merge(later)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def start_draining(self) -> None:
        """Refuse new requests; in-flight ones run to completion."""
        self._draining = True

    async def wait_drained(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self._streams

    def _deliver_error(self, rid: str, exc: BaseException) -> None:
        queue = self._streams.get(rid)
        if queue is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(queue.put_nowait, exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        streams = self._streams
        for out in outputs:
            queue = streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    # -- the subclass's side ---------------------------------------------------------------------
    def _check_request(self, prompt_token_ids, params: SamplingParams, priority: int) -> None:
        raise NotImplementedError

    async def _prepare(self, params: SamplingParams):
        """Work before the request is queued (AsyncEngine compiles a grammar here)."""
        raise NotImplementedError

    def _submit(self, rid, prompt_token_ids, params, arrival_time, compiled, priority) -> None:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _check_engine(self) -> None:
        raise NotImplementedError


class AsyncEngine(StreamingEngine):
    """Runs Engine.step in a background thread; each request gets an async stream of deltas.

    Only the engine thread touches the scheduler: adds and aborts are queued and applied at the
    top of the next step. Each step's outputs reach the event loop in one callback.
    """

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(engine.config, loop)
        self.engine = engine
        self._inbox: deque = deque()
        self._wake = threading.Event()
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="stepserve-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _check_engine(self) -> None:
        if not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")
        self.engine.runner.check_health()  # a tensor-parallel group fails here when a rank dies

    def set_num_threads(self, num_threads: int) -> None:
        """Torch intra-op threads for the engine's steps, applied before the next one. OpenMP
        keeps the count per thread, so only the engine thread itself can change its own."""
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self._inbox.append(("threads", num_threads))
        self._wake.set()

    def call_on_engine_thread(self, fn) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between two steps; its result in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.append(("call", fn, future))
        self._wake.set()
        return future

    def inject_stall(self, seconds: float) -> concurrent.futures.Future:
        """Block the engine thread for `seconds` (fault injection), as a stuck forward would."""
        return self.call_on_engine_thread(lambda engine: time.sleep(seconds))

    def _check_request(self, prompt_token_ids, params: SamplingParams, priority: int) -> None:
        self.engine.check_request(prompt_token_ids, params, priority)

    async def _prepare(self, params: SamplingParams):
        if params.structured is None:
            return None
        # compiled in a worker thread, not between steps
        return await self._loop.run_in_executor(None, self.engine.compile_grammar, params)

    def _submit(self, rid, prompt_token_ids, params, arrival_time, compiled, priority) -> None:
        self._inbox.append(
            ("add", rid, list(prompt_token_ids), params, arrival_time, compiled, priority)
        )
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()

    # -- engine thread -------------------------------------------------------------------------
    def _apply_inbox(self) -> None:
        engine = self.engine
        while self._inbox:
            command = self._inbox.popleft()
            if command[0] == "add":
                _, rid, ids, params, arrival, compiled, priority = command
                if rid not in self._streams:
                    continue  # caller left before the request reached the engine
                try:
                    engine.add_request(rid, ids, params, arrival, compiled, priority)
                except Exception as exc:  # surfaced to the caller, not fatal to the engine
                    self._deliver_error(rid, exc)
            elif command[0] == "call":
                _, fn, future = command
                try:
                    future.set_result(fn(engine))
                except Exception as exc:
                    future.set_exception(exc)
            elif command[0] == "threads":
                import torch

                torch.set_num_threads(command[1])
                self.num_threads = torch.get_num_threads()
            else:
                engine.abort([command[1]])

    def _run(self) -> None:
        import torch

        engine = self.engine
        self.num_threads = torch.get_num_threads()
        try:
            while not self._stopped:
                self._apply_inbox()
                if not engine.has_unfinished():
                    self._stats = engine.stats()
                    self._progress_at = time.monotonic()
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                outputs = engine.step()
                self._progress_at = time.monotonic()
                self._stats = engine.stats()
                if outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except BaseException as exc:  # the loop is dead: every waiting caller must hear of it
            logger.exception("engine loop died")
            self.error = exc
            dead = EngineDeadError(f"engine loop died: {exc!r}")
            for rid in list(self._streams):
                self._deliver_error(rid, dead)
