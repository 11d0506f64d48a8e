"""Offline batch generation, as in vLLM: `LLM(model=DIR, **engine_fields).generate(...)`, and
embeddings: `.embed(...)`."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from replica.config import EngineConfig
from replica.engine.core import Engine
from replica.request import (
    EngineRequest,
    LoRARequest,
    PoolingRequest,
    RequestOutput,
    SamplingParams,
)


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
        lora: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[CompletionOutput]:
        """`lora`: the adapter every prompt runs with, or one per prompt (None: the base
        model). An adapter that fails to load raises its LoRAError."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if lora is None or isinstance(lora, LoRARequest):
            lora = [lora] * len(prompts)
        if len(lora) != len(prompts):
            raise ValueError(f"got {len(lora)} LoRA requests for {len(prompts)} prompts")
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
        for prompt, params, adapter in zip(prompts, sampling_params, lora, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = str(next(self._ids))
            engine.add_request(rid, ids, params, lora=adapter)
            prompt_ids[rid] = ids
        while engine.has_unfinished():
            outputs = engine.step()
            errors = engine.take_request_errors()
            if errors:
                engine.abort(list(prompt_ids))
                raise errors[0][1]
            for out in outputs:
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

    def embed(
        self,
        prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
        normalize: bool = True,
        dimensions: int | None = None,
    ) -> list[list[float]]:
        """One embedding per prompt, as /v1/embeddings gives them: the final hidden states
        pooled by the engine's pooling_type, cut to `dimensions`, L2-normalized unless told
        not to."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not self._finalizer.alive:
            raise RuntimeError("this LLM has been shut down; build a new one to embed")
        engine = self.engine
        pooling = PoolingRequest(engine.config.pooling_type, normalize, dimensions)
        params = SamplingParams(temperature=0.0, max_tokens=1)
        order = []
        for prompt in prompts:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request = EngineRequest(ids, params, str(next(self._ids)), pooling=pooling)
            engine.check_request(request)
            engine.add(request)
            order.append(request.request_id)
        vectors: dict[str, list[float]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.embedding is not None:
                    vectors[out.request_id] = out.embedding
        return [vectors[rid] for rid in order]

    def add_lora(self, name: str, path: str) -> dict:
        """Load an adapter now: {name, rank, target_modules, load_s} (Engine.add_lora)."""
        return self.engine.add_lora(name, path)

    def remove_lora(self, name: str) -> bool:
        return self.engine.remove_lora(name)

    def list_loras(self) -> list[str]:
        return self.engine.list_loras()

    def shutdown(self) -> None:
        """Release the engine's resources now (idempotent)."""
        self._finalizer()
