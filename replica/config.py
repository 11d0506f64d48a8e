"""EngineConfig: every knob of one replica's engine, validated once at the edge."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LoRAModule(BaseModel):
    """A LoRA adapter served by name: `path` is its PEFT directory (adapter_config.json and
    adapter_model.safetensors or .bin), on the replicas' nodes."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=256, pattern=r"^[^\s]+$")
    path: str = Field(min_length=1)


class EngineConfig(BaseModel):
    """Configuration of one replica's engine (scheduler, KV cache, model runner).

    Field names follow vLLM's so that users can carry their settings over.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str | None = Field(
        default=None,
        description="Local HF model directory, or a GGUF file (or a directory holding one) "
        "served as it is; None means the default model.",
    )
    served_model_name: str | None = Field(
        default=None,
        description="Name clients use in the `model` field; defaults to the dir name (a GGUF "
        "file's name without .gguf).",
    )
    max_num_seqs: int = Field(default=64, ge=1, le=4096)
    max_num_batched_tokens: int = Field(default=2048, ge=1, le=1 << 20)
    block_size: int = Field(default=16, ge=1, le=1024)
    num_kv_blocks: int | None = Field(
        default=None, ge=1, description="Explicit KV pool size; overrides bytes/fraction."
    )
    kv_cache_bytes: int | None = Field(
        default=None, ge=1, description="KV pool size in bytes (CPU default: 1 GiB)."
    )
    kv_offload_bytes: int = Field(
        default=0,
        ge=0,
        description="A second KV tier in host memory: blocks evicted from the pool are kept "
        "here (LRU, up to this many bytes) under the same hashes and copied back instead of "
        "recomputed. 0: off.",
    )
    kv_offload_dir: str | None = Field(
        default=None,
        description="A third KV tier on local disk under this directory (LRU, up to "
        "kv_offload_disk_bytes): blocks evicted from the host tier. None: off.",
    )
    kv_offload_disk_bytes: int = Field(
        default=4 << 30, ge=0, description="Byte limit of the disk tier (kv_offload_dir)."
    )
    kv_transfer: bool = Field(
        default=True,
        description="Let this replica fetch a prompt's cached prefix blocks from the replica "
        "that holds them (the router asks when that beats recomputing) and export its own.",
    )
    kv_cache_memory_fraction: float = Field(
        default=0.9, gt=0.0, le=1.0, description="GPU: fraction of device memory for the engine."
    )
    max_model_len: int | None = Field(
        default=None, ge=2, description="Context limit; None means the model's own."
    )
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = Field(
        default=0, ge=0, description="Cap on tokens one prefill takes per step (0 = no cap)."
    )
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    quantization: Literal["none", "int8"] = Field(
        default="none",
        description="'int8': quantize the float checkpoint's linear weights (the LM head too, "
        "and a tied embedding) to int8 per group of 32 (GGML's Q8_0) as they load; layers "
        "whose in-features are not whole groups of 32 stay float. A GGUF checkpoint's "
        "quantized tensors are served as they are either way; with 'int8' its float linear "
        "tensors become Q8_0 too.",
    )
    quant_activations: Literal["auto", "int8", "fp32"] = Field(
        default="auto",
        description="How quantized matmuls take their activations: 'int8' rounds them to int8 "
        "per group of 32 (integer dot products, faster), 'fp32' uses them as they are (closest "
        "to the float model). auto: int8.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    pack_cpu_weights: bool = Field(
        default=True,
        description="CPU: reorder linear weights once into oneDNN's blocked layout (faster "
        "matmuls); off keeps torch's row-major F.linear.",
    )
    cpu_kv_prefault_mib: int = Field(
        default=128,
        ge=0,
        description="CPU: MiB of KV cache (all layers) a background thread at idle priority "
        "keeps mapped ahead of the highest block in use, so a step's K/V writes take no "
        "first-touch page faults; 0 leaves the pages to fault in as steps first write them.",
    )
    cpu_pin_threads: bool = Field(
        default=True,
        description="CPU, engine_core='process': pin the core's torch threads one to a CPU when "
        "they are as many as the CPUs the process may use (a replica that owns the host's "
        "cores), as vLLM's CPU worker pins its OpenMP threads; otherwise they float.",
    )
    cpu_decode_attention: Literal["native", "torch"] = Field(
        default="native",
        description="CPU: 'native' runs decode attention in a C kernel (built on first use "
        "with the system compiler) that reads K/V in place; 'torch' gathers each request's "
        "blocks for SDPA. Without a C compiler 'native' falls back to 'torch'.",
    )
    cpu_prefill_attention: Literal["native", "torch"] = Field(
        default="native",
        description="CPU, with cpu_decode_attention='native': 'native' runs prefill attention "
        "(whole prompts, chunks after cached context) in a tiled C kernel over the paged cache; "
        "'torch' runs one causal SDPA call per request over its gathered keys.",
    )
    cuda_attention: Literal["flex", "torch"] = Field(
        default="torch",
        description="CUDA without flash-attn: 'flex' runs torch's flex_attention, compiled, "
        "over the paged cache in place (block tables as its block mask; block_size a multiple "
        "of 16), with decode CUDA graphs; 'torch' gathers each request's blocks for SDPA. "
        "'torch' stays the default until 'flex' has been verified on a GPU (tested so far on "
        "CPU only, through flex's eager path).",
    )
    cuda_graphs: bool = Field(
        default=True,
        description="CUDA, tensor_parallel_size 1, flex attention: decode-only steps replay "
        "CUDA graphs captured at start-up for batches of 1, 2, 4 .. cuda_graph_max_batch "
        "requests (a batch runs padded to the next size); other steps run eagerly.",
    )
    cuda_graph_max_batch: int = Field(
        default=256,
        ge=1,
        le=4096,
        description="The largest decode batch captured as a CUDA graph (capped at "
        "max_num_seqs); larger decode batches run eagerly.",
    )
    cpu_fused_ops: bool = Field(
        default=True,
        description="CPU (fp32, bf16): each RMSNorm with the residual add before it, rotary and "
        "SiLU * up run as single C kernels (built like the native decode kernel) instead of "
        "several torch ops each.",
    )
    cpu_isa: Literal["auto", "portable", "avx2", "avx512", "avx512_vnni", "avx512_bf16"] = Field(
        default="auto",
        description="CPU: cap of the x86-64 instruction-set level the native kernels and "
        "oneDNN's weight packing may use; auto: the CPU's own, capped by STEPSERVE_CPU_ISA. A "
        "cap above the CPU's level is the CPU's level.",
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="priority",
        description="priority: waiting requests in (priority, arrival) order, and a waiting "
        "request preempts running ones of lower priority when seats or KV blocks are short "
        "(lower value = more urgent, as vLLM's); with equal priorities it is fcfs. fcfs: "
        "arrival order, preemption only for KV blocks, newest first.",
    )
    engine_core: Literal["process", "thread"] = Field(
        default="process",
        description="Serving replicas: 'process' runs the engine core (scheduler, model, "
        "sampling) in a process of its own, stepping in a busy loop, while the replica's actor "
        "keeps intake, detokenization, metrics and streaming (vLLM V1's split: the GIL no "
        "longer makes them take turns); 'thread' runs the engine in a thread of the actor. "
        "Tensor-parallel replicas keep rank 0 in the actor; offline LLM runs in-process.",
    )
    step_join: bool = Field(
        default=True,
        description="engine_core='process': a prompt that arrives while a step of decodes "
        "runs joins it at the next layer boundary (it runs the layers passed on its own, "
        "then the rest with the decodes) instead of waiting for the step to end; its first "
        "token comes with that step's tokens. One rank, no LoRA, Llama-family decoders.",
    )
    first_text_priority: bool = Field(
        default=False,
        description="A request whose sampled tokens have shown its client no text yet (a "
        "byte-level token that is part of a character) gets its next token in a step of "
        "decodes: prompts wait that step, and none joins it (step_join). Only while at most "
        "one prompt would wait (with more queued the engine is behind its arrivals and a "
        "held step delays them all) and never two steps in a row; a request is watched for "
        "its first 4 tokens. Watched once the engine has its tokenizer (an engine core "
        "loads it after its first idle heartbeat). Off by default: its measured effect on "
        "TTFT was inside this project's 2-core hosts' noise (docs/perf-first-token.md).",
    )
    num_speculative_tokens: int = Field(
        default=4,
        ge=0,
        le=16,
        description="Speculative decoding by prompt lookup (vLLM's 'ngram' method): at most "
        "this many draft tokens per step for greedy requests without penalties, bias, "
        "min_tokens, logprobs or a grammar, copied from where the sequence's trailing n-gram "
        "occurred before and verified in the same forward pass (outputs are unchanged); the "
        "length adapts per request to what it gets accepted. 0: off.",
    )
    speculative_max_running: int = Field(
        default=16,
        ge=0,
        le=4096,
        description="Drafts are proposed only in steps that start with at most this many "
        "running requests (0: any number): a large batch makes the forward compute-bound, "
        "where every rejected draft token costs a full token's compute.",
    )
    prompt_lookup_max: int = Field(
        default=4, ge=1, le=16, description="Longest trailing n-gram looked up for a draft."
    )
    prompt_lookup_min: int = Field(
        default=2, ge=1, le=16, description="Shortest trailing n-gram looked up for a draft."
    )
    stall_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="seconds the engine may hold requests without finishing a step before "
        "its replica reports unhealthy (its streams end with an error and Serve replaces it); "
        "longer than the slowest single step",
    )
    enable_lora: bool = Field(
        default=False,
        description="Serve LoRA adapters (PEFT format) on top of the base model: requests name "
        "one in `model`; a step batches rows of several adapters and the base model. Implied "
        "by lora_modules.",
    )
    max_loras: int = Field(
        default=4, ge=1, le=256, description="Most distinct adapters in one step's batch."
    )
    max_lora_rank: int = Field(
        default=16, ge=1, le=512, description="Largest adapter rank accepted."
    )
    max_cpu_loras: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="Adapters a replica keeps loaded (LRU); others load on demand. None: "
        "max_loras. Must be >= max_loras.",
    )
    lora_modules: list[LoRAModule] = Field(
        default_factory=list,
        description="Adapters served from start (vLLM's --lora-modules name=path): each "
        "replica loads them when it starts.",
    )
    reasoning_parser: Literal["none", "deepseek_r1", "qwen3"] = Field(
        default="none",
        description="How the model marks its thinking (vLLM's --reasoning-parser names): the "
        "thinking text is returned as reasoning_content, content holds the answer, and "
        "structured outputs and tool calls apply after the thinking ends. none: no reasoning "
        "split (all text is content).",
    )
    tool_call_parser: Literal[
        "auto", "hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic"
    ] = Field(
        default="auto",
        description="The format the model writes tool calls in (vLLM's --tool-call-parser "
        "names); parsed into tool_calls and enforced by the grammar for tool_choice required "
        "or named. auto: chosen from the model's chat template (hermes when it says nothing).",
    )
    pooling_type: Literal["last", "mean"] = Field(
        default="last",
        description="How /v1/embeddings pools the prompt's final hidden states: the last "
        "token's (Qwen3-Embedding and most decoder embedders) or their mean.",
    )
    max_queue_len: int = Field(
        default=4096,
        ge=1,
        description="Waiting requests beyond which the replica refuses more (a memory bound: "
        "the ingress admits by expected wait, http.request_timeout_s).",
    )

    @model_validator(mode="after")
    def _check_budgets(self) -> EngineConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        if self.max_model_len is not None:
            self.check_prefill_budget(self.max_model_len)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names must be unique, got {names}")
        return self

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @property
    def lora_capacity(self) -> int:
        """Adapters a replica keeps loaded (max_cpu_loras, default max_loras)."""
        return self.max_cpu_loras or self.max_loras

    def check_prefill_budget(self, max_model_len: int) -> None:
        """Raise ValueError when a prompt of up to max_model_len tokens could not be scheduled:
        without chunked prefill it runs in one step. The scheduler calls this with the model's
        own limit when max_model_len is None here."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({max_model_len}) when chunked prefill is disabled, "
                "or a long prompt could never be scheduled"
            )

    def model_dir(self) -> Path:
        """The directory the engine reads, resolved on this machine: `model` as it is for a HF
        directory; for a GGUF file, its metadata directory in the stepserve cache (made on
        first use: replica/quant/gguf_meta.py); None: the default model's."""
        from replica.default_model import resolve_model

        return resolve_model(self.model)

    def served_name(self) -> str:
        """The name clients put in `model`: served_model_name, else the model's directory name
        (a GGUF file's name without .gguf), else the default model's name."""
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            path = Path(os.path.abspath(Path(self.model).expanduser()))
            return path.stem if path.suffix == ".gguf" else path.name
        from replica.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME

    def resolved_quant_activations(self) -> str:
        return "int8" if self.quant_activations == "auto" else self.quant_activations

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self, device: str):
        import torch

        if self.dtype == "auto":
            # fp32 on CPU keeps parity with transformers exact; bf16 is opt-in there.
            return torch.float32 if device == "cpu" else torch.bfloat16
        return getattr(torch, self.dtype)
