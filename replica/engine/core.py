"""The engine: scheduler + Runner (replica/runner_protocol.py) + detokenizer, stepped one batch at
a time. The offline LLM steps it directly; a replica steps it on a thread (engine/async_engine.py)
or in a process of its own (engine/core_process.py)."""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from replica.config import EngineConfig
from replica.engine.output_processor import OutputProcessor
from replica.engine.wire import StepReport
from replica.errors import LoRAError
from replica.first_text import FirstTextWatch
from replica.limits import EngineLimits
from replica.request import (
    EngineRequest,
    GrammarRejected,
    LoRARequest,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    StepOutput,
)
from replica.runner_protocol import Runner
from replica.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from replica.structured import StructuredOutputError, StructuredOutputs

logger = logging.getLogger(__name__)


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


def step_report(engine: Engine, scheduler_output, step_time: float) -> StepReport:
    """The report of the step that just ended; marks each request's first scheduling."""
    end = time.monotonic()
    started = end - step_time  # the step (and its schedule) began here
    first = []
    for sched in scheduler_output.scheduled:
        request = sched.request
        if request.first_scheduled_time is None:
            request.first_scheduled_time = started
            first.append((request.request_id, request.arrival_time))
    return StepReport(
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
        phases = dict(self.runner.startup_s)
        runner_s = time.perf_counter() - tokenized
        self.startup_s = {"tokenizer": round(tokenized - started, 3), **phases}
        self.startup_s["runner_other"] = round(max(0.0, runner_s - sum(phases.values())), 3)
        # resident bytes of the weights (rank 0's under tensor parallelism): total, quantized
        # blocks, float parameters; empty for a runner that does not count them
        self.weight_bytes: dict[str, int] = dict(getattr(self.runner, "weight_bytes", None) or {})
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = load_eos_token_ids(self.model_dir, eos_token_id)
        self.scheduler = Scheduler(
            config,
            self.runner.num_kv_blocks,
            self.max_model_len,
            getattr(self.runner, "kv_sliding_window", None),  # blocks behind it are freed
            getattr(self.runner, "kv_group_windows", ()),  # a hybrid model: a table per group
        )
        # KV tiers below the pool and imports from other replicas (kv_tier.py, kv_transfer.py)
        self.kv_layout: dict | None = self._setup_kv_tier()
        self._requests: dict[str, Request] = {}  # unfinished, by id
        # resumed requests that ended on their resumed output: delivered by the next step
        self._ended_at_add: list[StepOutput] = []
        # LoRA adapters (replica/lora/manager.py): an LRU of them, loaded on demand; the
        # scheduler skips a request until its adapter is in
        self.loras = None
        if config.lora_enabled:
            from replica.lora import LoRAManager

            self.loras = LoRAManager(config, self.runner)
            for module in config.lora_modules:
                self.loras.add(module.name, module.path)
            self.scheduler.lora_ready = self.loras.ready
            self.scheduler.lora_names = self.loras.names
        # requests that ended on an error after they were taken (an adapter that failed to
        # load): (request id, exception), collected by the caller (EngineDriver, LLM)
        self.request_errors: list[tuple[str, BaseException]] = []
        self.output_processor = OutputProcessor(tokenizer) if detokenize else None
        self.vocab_size = self.runner.vocab_size
        self.limits = EngineLimits(
            self.max_model_len,
            self.vocab_size,
            self.runner.num_kv_blocks,
            config.block_size,
            config.scheduling_policy,
        )
        # grammars of structured outputs, compiled for this tokenizer and vocabulary on first use
        self.structured = StructuredOutputs(tokenizer, self.vocab_size, self.eos_token_ids)
        self.step_listeners: list = []  # callables(engine, scheduler_output, outputs, step_time)
        # wall seconds the latest step spent in schedule(); the runner times its own phases
        # (runner.step_times), the rest of step_time is update_from_output and detokenizing
        self.last_schedule_time = 0.0
        # set by the core process: reads the commands that came during a step and queues the
        # requests among them; True when one was queued (a prompt may then join the step)
        self.poll_arrivals: Callable[[], bool] | None = None
        self.last_join: int | None = None  # the layer the latest step took prompts at
        self._can_join = config.step_join and getattr(self.runner, "can_join", False)
        # requests whose tokens have shown their client no text yet (first_text_priority)
        self.first_text = FirstTextWatch(tokenizer) if config.first_text_priority else None

    def _setup_kv_tier(self) -> dict | None:
        """The runner's KV layout when this engine can tier and move KV blocks (a runner that
        holds its KV as ModelRunner does, one KV group, prefix caching on); None otherwise."""
        config = self.config
        layout = getattr(self.runner, "kv_layout", None)
        if layout is None or not config.enable_prefix_caching:
            return None
        if self.scheduler.hybrid:
            if config.kv_offload_bytes or config.kv_transfer:
                logger.info(
                    "KV tiers and KV transfer are off: this model's layers form %d KV groups "
                    "(a hybrid model; docs/kv-transfer.md)",
                    layout["kv_groups"],
                )
            return None
        from replica.kv_tier import DEFAULT_STAGING_BLOCKS, KVTierIndex

        block_bytes = layout["block_bytes"]
        host = config.kv_offload_bytes // block_bytes
        if config.kv_offload_bytes and not host:
            logger.warning(
                "kv_offload_bytes=%d holds no KV block of %d bytes: the host tier is off",
                config.kv_offload_bytes,
                block_bytes,
            )
        disk = config.kv_offload_disk_bytes // block_bytes if config.kv_offload_dir else 0
        staging = DEFAULT_STAGING_BLOCKS if config.kv_transfer else 0
        if host or staging:
            self.scheduler.kv.pool.tier = KVTierIndex(host, disk, staging)
        return layout

    def _flush_kv_ops(self):
        """Apply the tier moves queued since the last step now (between steps), so the tier's
        bytes match its index; the tier index, or None."""
        tier = self.scheduler.kv.pool.tier
        if tier is not None:
            ops = tier.take_ops()
            if ops:
                self.runner.apply_kv_ops(ops)
        return tier

    def export_kv(self, hashes: list[int]):
        """The leading run of `hashes` this engine holds (pool, then tiers), copied out per
        tensor-parallel rank (kv_transfer.KVExport); an empty run when it cannot export."""
        from replica.kv_transfer import KVExport

        if self.kv_layout is None or not self.config.kv_transfer:
            return KVExport(self.kv_layout or {})
        tier = self._flush_kv_ops()
        pool = self.scheduler.kv.pool
        sources = []
        for block_hash in hashes:
            block = pool.get_cached_block(block_hash)
            if block is not None:
                sources.append((block.block_id, block_hash))
            elif tier is not None and block_hash in tier:
                sources.append((-1, block_hash))
            else:
                break  # the rest would not chain
        if not sources:
            return KVExport(self.kv_layout)
        data = self.runner.export_kv(sources)
        if not isinstance(data, list):
            data = [data]
        return KVExport(self.kv_layout, [h for _, h in sources], data)

    def import_kv(self, export, expected: list[int]):
        """Stage the blocks of another replica's export (kv_transfer.KVExport) that chain as
        `expected` (this engine's hashes of the prompt) in the host tier; the request's
        admission restores them. kv_transfer.KVImportResult says what came in, or why not."""
        from replica.kv_transfer import KVImportResult, check_import

        result = KVImportResult(offered=len(export.hashes))
        tier = self.scheduler.kv.pool.tier
        if self.kv_layout is None or tier is None or not self.config.kv_transfer:
            result.refused = "off"
            return result
        run, result.refused = check_import(self.kv_layout, export, expected)
        if not run:
            return result
        pool = self.scheduler.kv.pool
        fresh = [i for i, h in enumerate(export.hashes[:run]) if pool.get_cached_block(h) is None][
            : tier.host_capacity
        ]
        if not fresh:
            return result
        self._flush_kv_ops()
        hashes = [export.hashes[i] for i in fresh]
        parts = [t[fresh] for t in export.data]  # per rank
        self.runner.import_kv(hashes, parts if len(parts) > 1 else parts[0])
        for h in hashes:
            tier.staged(h)
        result.imported = len(hashes)
        result.nbytes = len(hashes) * self.kv_layout["block_bytes"] * len(export.data)
        return result

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

    def check_request(self, request: EngineRequest) -> None:
        """Raise RequestRejected (a user error) for a request that can never be served."""
        self.limits.check(
            request.prompt_token_ids,
            request.sampling,
            request.priority,
            request.resume,
            request.pooling,
        )

    def compile_grammar(self, params: SamplingParams):
        """The compiled grammar of a structured request (cached), or None for a free one;
        RequestRejected names the problem when it cannot compile."""
        if params.structured is None:
            return None
        try:
            return self.structured.compile(params.structured)
        except StructuredOutputError as exc:
            raise GrammarRejected(str(exc)) from None

    def add(self, request: EngineRequest, compiled_grammar=None) -> Request:
        """Queue a request its sender checked (`check_request`). A structured one's grammar is
        compiled here unless the caller compiled it already (`compile_grammar`, off the
        stepping thread: engine/driver.py). A resumed one (migration) whose resumed output
        already ends it is not queued: its final output comes with the next step."""
        rid = request.request_id
        state = Request(request, self.eos_token_ids)
        params = request.sampling
        if params.structured is not None:
            compiled = compiled_grammar or self.compile_grammar(params)
            state.grammar = self.structured.new_state(params.structured, compiled)
        processor = self.output_processor
        if processor is not None:  # primed with a resumed request's output (may reject it)
            processor.add(rid, state.prompt_token_ids, params, request.resume)
        try:
            if request.lora is not None:
                self._lora_manager(request.lora.name).acquire(rid, request.lora)
                try:
                    ended = self.scheduler.add_request(state)
                except BaseException:
                    self.loras.release(rid, request.lora)
                    raise
            else:
                ended = self.scheduler.add_request(state)
        except BaseException:
            if processor is not None:
                processor.drop(rid)
            raise
        self._requests[rid] = state
        if ended is not None:
            self._ended_at_add.append(ended)
        return state

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora: LoRARequest | None = None,
    ) -> Request:
        """Check and queue a request given by its parts (the offline API)."""
        request = EngineRequest(
            list(prompt_token_ids), params, request_id, priority, arrival_time, lora=lora
        )
        self.check_request(request)
        return self.add(request)

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
        request = self._requests.pop(request_id, None)
        if request is not None and request.lora is not None:
            self.loras.release(request_id, request.lora)
        if self.output_processor is not None:
            self.output_processor.drop(request_id)
        if self.first_text is not None:
            self.first_text.forget(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._ended_at_add)

    @property
    def num_request_states(self) -> int:
        """Requests this engine keeps per-request state for (0 when idle: nothing leaked)."""
        return len(self._requests)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, and turn sampled tokens into per-request outputs."""
        t0 = time.perf_counter()
        loras = self.loras
        if loras is not None and loras.loading:  # adapters read since the last step
            self._fail_requests(loras.poll())
        scheduler_output = self.scheduler.schedule()
        self.last_schedule_time = time.perf_counter() - t0
        self.last_join = None
        ended, self._ended_at_add = self._ended_at_add, []
        if scheduler_output.is_empty and scheduler_output.kv_ops:
            self.runner.apply_kv_ops(scheduler_output.kv_ops)  # tier moves alone
        if scheduler_output.is_empty:
            if not ended:
                if loras is not None and loras.loading:  # nothing runs until an adapter is in
                    loras.wait(0.01)
                return []
            step_outputs = []
        else:
            if self._can_join and self.poll_arrivals is not None and scheduler_output.decodes_only:
                join = functools.partial(self._join, scheduler_output)
                runner_output = self.runner.execute(scheduler_output, join=join)
                if runner_output.step is not None:  # prompts joined it under way
                    scheduler_output = runner_output.step
            else:
                runner_output = self.runner.execute(scheduler_output)
            step_outputs = self.scheduler.update_from_output(
                scheduler_output,
                runner_output.sampled,
                runner_output.logprobs,
                runner_output.prompt_logprobs,
                runner_output.spec_tokens,
                runner_output.pooled,
            )
            if self.first_text is not None:
                self._watch_first_text(step_outputs)
        outputs = self._outputs(ended + step_outputs)
        if self.step_listeners:
            elapsed = time.perf_counter() - t0
            for listener in self.step_listeners:
                listener(self, scheduler_output, outputs, elapsed)
        return outputs

    def _watch_first_text(self, step_outputs: list[StepOutput]) -> None:
        watch = self.first_text
        for step in step_outputs:
            request = self._requests.get(step.request_id)
            if request is not None and step.new_token_ids:
                watch.observe(request, step.new_token_ids)

    def _join(self, step: SchedulerOutput, layer: int) -> SchedulerOutput | None:
        """The runner's question before each layer of a step of decodes: requests that came
        since, admitted to join it there (Scheduler.schedule_join), or None."""
        if not self.poll_arrivals():
            return None
        joined = self.scheduler.schedule_join(step)
        if joined is not None:
            self.last_join = layer
        return joined

    def _outputs(self, step_outputs: list[StepOutput]) -> list[RequestOutput]:
        """The RequestOutputs of the scheduler's per-request results, text filled in (and
        stop strings applied) when this engine detokenizes."""
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
                embedding=step.embedding,
            )
            if processor is not None:
                out, stopped = processor.process(out)
                if stopped:
                    self.scheduler.finish_requests(
                        [step.request_id], RequestStatus.FINISHED_STOPPED
                    )
            if out.finished:
                self._forget(step.request_id)
            outputs.append(out)
        return outputs

    def _fail_requests(self, errors: list[tuple[str, BaseException]]) -> None:
        """End requests that cannot run (their adapter failed to load); their callers hear of
        the error through `request_errors`."""
        for rid, exc in errors:
            if rid not in self._requests:
                continue
            self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            self._forget(rid)
            self.request_errors.append((rid, exc))

    def take_request_errors(self) -> list[tuple[str, BaseException]]:
        errors, self.request_errors = self.request_errors, []
        return errors

    # -- LoRA adapters ---------------------------------------------------------------------
    def _lora_manager(self, name: str):
        if self.loras is None:
            raise LoRAError(
                f"LoRA adapter {name!r} requested, but LoRA is off on this replica "
                "(enable_lora=false and no lora_modules)"
            )
        return self.loras

    def add_lora(self, name: str, path: str) -> dict:
        """Read, check and load an adapter now; {name, rank, target_modules, load_s}."""
        return self._lora_manager(name).add(name, path)

    def remove_lora(self, name: str) -> bool:
        """Drop an adapter (when its last request ends, if requests use it); False when it
        is not loaded."""
        return self._lora_manager(name).remove(name)

    def list_loras(self) -> list[str]:
        """Adapters loaded, least recently used first (empty when LoRA is off)."""
        return [] if self.loras is None else self.loras.names()

    def shutdown(self) -> None:
        if self.loras is not None:
            self.loras.shutdown()
        self.runner.shutdown()
