"""ModelRunner: turns a SchedulerOutput into one forward pass over a flat token stream against
the paged KV cache, then samples the requests whose computed tokens reach their end."""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from replica.config import EngineConfig
from replica.cuda_graphs import DecodeGraphs
from replica.kv_groups import allocate_caches, group_metadata, kv_groups, zero_pages
from replica.kv_prefault import KVPrefaulter
from replica.kv_tier import KVTierStore
from replica.layers import cpu_isa
from replica.layers.attention import (
    AttentionMetadata,
    AttentionSpec,
    FlashAttnBackend,
    KVCache,
    NativeDecodeBackend,
    attention_layers,
    select_attention_backend,
    set_attention_backend,
)
from replica.layers.cpu_kernels import (
    KERNEL_DTYPES,
    enable_fused_cpu_ops,
    native_library,
)
from replica.layers.linear import TensorParallel, pack_linear_weights
from replica.layers.sampler import Sampler, seeded_uniform
from replica.loader import load_hf_config, load_model
from replica.lora import LoRAModel, LoRATargets, PeftAdapter
from replica.models.llama import StepJoin, head_dim_of, num_kv_heads_per_rank
from replica.models.windows import all_layers_window
from replica.pooling import pool_rows
from replica.quant.crossover import calibrate as calibrate_crossover
from replica.quant.weights import set_activations, weight_bytes
from replica.runner_protocol import RunnerOutput
from replica.scheduler import ScheduledRequest, SchedulerOutput
from replica.spec_decode import verify_greedy_drafts
from replica.structured import fill_bitmask

__all__ = [
    "ModelRunner",
    "RunnerOutput",
    "StepBatch",
    "StepTimes",
    "model_max_len",
    "verify_greedy_drafts",
    "zero_pages",
]

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass
class StepBatch:
    """What every tensor-parallel rank needs to run one step: the flat token stream and where
    each request's tokens sit. Rank 0 builds it; the TP runner broadcasts it to the others."""

    input_ids: list[int]
    starts: list[int]  # per request: position of its first token this step
    query_lens: list[int]  # per request: tokens run this step
    block_ids: list[list[int]]  # per request: its block table
    sample_rows: list[int]  # rows of the flat stream whose logits are computed
    # a hybrid model's KV groups 1..: per group, per request, its block table (kv_groups.py)
    group_block_ids: list[list[list[int]]] = field(default_factory=list)
    # per request: its LoRA adapter's slot (0: the base model); empty when LoRA is off
    lora_slots: list[int] = field(default_factory=list)
    # per pooling request's rows this step (rank 0 only): (first row, rows) of the flat
    # stream whose final hidden states it sums (replica/pooling.py), and whose they are
    pool_spans: list[tuple[int, int]] = field(default_factory=list)
    pool_ids: list[str] = field(default_factory=list)
    # every row's final hidden state is read (a pooling request's step; every rank): the last
    # layer computes them all, not only the sampled rows
    all_rows: bool = False
    # KV tier moves made before the forward (kv_tier.py; SchedulerOutput.kv_ops)
    kv_ops: list[tuple[int, int, int]] = field(default_factory=list)

    def joined(self, other: StepBatch, num_sampled: int) -> StepBatch:
        """This batch with `other`'s requests after its own (a step join: plain requests, no
        adapter, pooling or prompt-logprob rows). Logits rows as prepare_batch lays them out
        for the joined step: this batch's `num_sampled` sampled rows, the other's, then this
        batch's draft rows."""
        offset = len(self.input_ids)
        theirs = [row + offset for row in other.sample_rows]
        rows = self.sample_rows[:num_sampled] + theirs + self.sample_rows[num_sampled:]
        return StepBatch(
            self.input_ids + other.input_ids,
            self.starts + other.starts,
            self.query_lens + other.query_lens,
            self.block_ids + other.block_ids,
            rows,
            [mine + theirs for mine, theirs in zip(self.group_block_ids, other.group_block_ids)],
        )


class StepJoiner:
    """The model's join callback for one step (`execute(join=...)`): before each layer asks
    the engine for requests that arrived meanwhile; their inputs are laid out after the
    step's rows, their attention metadata built for their own catch-up and for the rest of
    the step. Answers once at most."""

    def __init__(self, runner: ModelRunner, so: SchedulerOutput, batch: StepBatch, join) -> None:
        self.runner, self.so, self.batch, self.join = runner, so, batch, join
        self.joined = False
        self.rows: torch.Tensor | None = None
        self.keep: torch.Tensor | None = None

    def __call__(self, layer: int) -> StepJoin | None:
        new_so = self.join(layer)
        if new_so is None:
            return None
        runner = self.runner
        new = runner.prepare_batch(new_so)
        runner.apply_kv_ops(new_so.kv_ops)  # blocks evicted for them are saved first
        num_sampled = sum(1 for s in self.so.scheduled if s.sample and not s.draft)
        self.batch = self.batch.joined(new, num_sampled)
        self.so, self.joined = self.so.joined(new_so), True
        batch = self.batch
        ids, new_positions, new_meta = runner._batch_inputs(new)
        _, positions, meta = runner._batch_inputs(batch)
        self.rows = torch.tensor(batch.sample_rows, dtype=torch.long, device=runner.device)
        if len(batch.sample_rows) < len(batch.input_ids):
            self.keep = self.rows
        runner._prefault_for(new)
        return StepJoin(ids, new_positions, new_meta, positions, meta, self.keep)


@dataclass
class StepTimes:
    """Wall seconds of one `execute` call's phases on this rank."""

    prepare: float = 0.0  # the batch layout, attention metadata and input tensors
    forward: float = 0.0  # the model and the LM head over the sampled rows
    sample: float = 0.0  # sampling and the tokens back to Python, and the two below
    bitmask: float = 0.0  # of sample: filling the grammar masks of constrained rows
    prompt_logprobs: float = 0.0  # of sample: the prompt-logprob rows


def model_max_len(hf_config: Any) -> int:
    """The longest context the checkpoint supports: its positions (a sliding window limits what
    a layer attends to, not the context)."""
    return int(hf_config.max_position_embeddings)


class ModelRunner:
    """One tensor-parallel rank's model, KV cache and (on rank 0) sampler; a tp=1 engine's
    Runner (runner_protocol.py), and each rank's forward under TensorParallelRunner."""

    def __init__(
        self,
        config: EngineConfig,
        model_dir: str | Path,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
    ) -> None:
        self.config = config
        # wall seconds of each start-up phase (config, weights, kernels, kv_cache)
        self.startup_s: dict[str, float] = {}
        started = time.perf_counter()
        self.device = torch.device(config.resolved_device())
        if self.device.type == "cuda" and self.device.index is None:
            # a TP worker selects its GPU with torch.cuda.set_device before building the runner
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = config.resolved_dtype(self.device.type)
        if config.quantization != "none" and self.device.type != "cpu":
            raise ValueError(
                f"quantization={config.quantization!r} runs on CPU only (the quantized kernels "
                f"are CPU kernels), not on {self.device.type}; serve the float checkpoint there"
            )
        self.tp = TensorParallel(tp_rank, tp_size, tp_group)
        self.block_size = config.block_size
        self.hf_config = load_hf_config(model_dir)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.max_model_len = self._resolve_max_model_len()
        # the longest context this engine serves: LongRoPE picks its factors by it (rotary.py)
        self.hf_config.max_model_len = self.max_model_len
        started = self._phase("config", started)
        self.model = load_model(
            model_dir, self.hf_config, self.tp, self.device, self.dtype, config.quantization
        )
        # LoRA adapters (replica/lora/): a LoRALinear on every adaptable layer
        self.lora = (
            LoRAModel(self.model, self.tp, self.dtype, self.device) if config.lora_enabled else None
        )
        self.quant_activations = config.resolved_quant_activations()
        self.num_quantized_weights = set_activations(self.model, self.quant_activations)
        started = self._phase("weights", started)
        self.num_packed_layers = 0
        # the instruction-set level (the CPU's, capped by config.cpu_isa or STEPSERVE_CPU_ISA)
        # decides which weights oneDNN packs and which build of the native kernels runs; the
        # runner holds it while it builds and around every forward (cpu_isa.use_level)
        self.cpu_isa = cpu_isa.level_for(config.cpu_isa) if self.device.type == "cpu" else None
        self._isa_scope = (
            contextlib.nullcontext() if self.cpu_isa is None else cpu_isa.use_level(self.cpu_isa)
        )
        with self._isa_scope:
            self._choose_kernels(config)  # packs weights for oneDNN, builds native kernels
            # rows from which a quantized matmul de-quantizes + GEMMs: timed on this host
            # (cached on disk) for this model's weights
            self.quant_crossover = (
                calibrate_crossover(self.model, self.quant_activations)
                if self.num_quantized_weights and self.device.type == "cpu"
                else {}
            )
        started = self._phase("kernels", started)
        # resident bytes of the weights as they are served (quantized blocks, float parameters,
        # oneDNN's packed copies instead of the row-major ones they replaced)
        self.weight_bytes = weight_bytes(self.model)
        self.num_layers = int(self.hf_config.num_hidden_layers)
        self.step_times = StepTimes()  # of the latest execute()
        self.sampler = Sampler()
        self._bitmask_buffer: torch.Tensor | None = None  # grammar masks, reused each step
        # unseeded requests' draws; a seeded request's come from (seed, position) alone
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.decode_graphs = None  # DecodeGraphs once the KV cache is final (CUDA)
        self.num_kv_blocks = self._resolve_num_kv_blocks()
        self.kv_caches = self._allocate_kv_caches(self.num_kv_blocks)
        self.kv_prefault = self._start_kv_prefault()
        # this rank's share of the KV tiers' bytes (kv_tier.py); moved by the steps' kv_ops
        self.kv_tier = KVTierStore(self.kv_caches, config.kv_offload_dir, tp_rank)
        started = self._phase("kv_cache", started)
        self.decode_graphs = self._make_decode_graphs()
        if self.decode_graphs is not None:
            self.decode_graphs.capture_all()
            self._phase("cuda_graphs", started)
        logger.info(
            "model %s on %s (%s, weights %.1f MiB: %.1f MiB in %d quantized weights with %s "
            "activations, %.1f MiB float; %d linear layers packed for oneDNN, %s attention, "
            "%d modules on fused C ops), tp rank %d/%d: %d KV blocks of %d tokens, "
            "max_model_len %d",
            Path(model_dir).name,
            self.device,
            self.dtype,
            self.weight_bytes["total_bytes"] / 2**20,
            self.weight_bytes["quantized_bytes"] / 2**20,
            self.num_quantized_weights,
            self.quant_activations,
            self.weight_bytes["float_bytes"] / 2**20,
            self.num_packed_layers,
            self.attn_backend.name,
            self.num_fused_modules,
            tp_rank,
            tp_size,
            self.num_kv_blocks,
            self.block_size,
            self.max_model_len,
        )

    def _make_decode_graphs(self):
        """CUDA graphs of decode steps (cuda_graphs.py): CUDA, one rank, flex attention, no
        quantized weights (their kernels are not known to be capturable)."""
        config = self.config
        if self.lora is not None:  # the per-step adapter groups are not captured
            return None
        if self.device.type == "cuda" and config.cuda_graphs and self.num_quantized_weights:
            logger.info("quantized weights: decode steps run without CUDA graphs")
            return None
        if not (
            self.device.type == "cuda"
            and config.cuda_graphs
            and self.tp.size == 1
            and self.attn_backend.name == "flex"
            and not self.kv_groups.hybrid  # graphs are captured over one block table
        ):
            return None
        max_batch = min(config.cuda_graph_max_batch, config.max_num_seqs)
        return DecodeGraphs(self, max_batch, capture=True)

    def _phase(self, name: str, started: float) -> float:
        now = time.perf_counter()
        self.startup_s[name] = round(now - started, 3)
        return now

    def _choose_kernels(self, config: EngineConfig) -> None:
        """Weight packing, fused ops and the attention backend: what the device, dtype, config
        and instruction-set level decide."""
        if self.cpu_isa is not None:
            from replica.layers.cpu_gemm import fp32_packing

            cpu_isa.log_choice(self.cpu_isa, fp32_packing())
        if self.device.type == "cpu" and config.pack_cpu_weights:
            self.num_packed_layers = pack_linear_weights(self.model)
        # the native CPU kernels (fused ops here, decode attention as the backend below) take
        # this model: CPU, fp32/bf16
        native_cpu = (
            self.device.type == "cpu"
            and self.dtype in KERNEL_DTYPES
            and native_library() is not None
        )
        self.num_fused_modules = 0
        if native_cpu and config.cpu_fused_ops:
            self.num_fused_modules = enable_fused_cpu_ops(self.model)
        self.num_kv_heads = num_kv_heads_per_rank(self.hf_config, self.tp.size)
        self.head_dim = head_dim_of(self.hf_config)
        # the attention backend, chosen once: its builder makes each step's metadata, every
        # layer runs its impl (with its own sliding window and soft cap)
        layers = attention_layers(self.model)
        spec = AttentionSpec(
            self.device,
            self.dtype,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            config.cpu_decode_attention,
            config.cpu_prefill_attention,
            cuda_attention=config.cuda_attention,
            num_heads=int(self.hf_config.num_attention_heads) // self.tp.size,
            sliding_windows=tuple(sorted({a.sliding_window for a in layers} - {None})),
            soft_cap=any(a.logits_soft_cap is not None for a in layers),
        )
        self.attn_backend = select_attention_backend(spec)
        set_attention_backend(self.model, self.attn_backend)
        # a hybrid model's layers form KV groups, each reading its own block table
        self.kv_groups = kv_groups([a.sliding_window for a in layers])
        for layer, group in zip(layers, self.kv_groups.layer_group):
            layer.kv_group = group
        self.attn_builder = self.attn_backend.make_builder(spec)

    @property
    def kv_sliding_window(self) -> int | None:
        """The window all layers share, if they all have one (the scheduler frees KV blocks
        behind it); None when some layer attends to the whole context."""
        return all_layers_window(self.hf_config)

    @property
    def kv_group_windows(self) -> tuple[int | None, ...]:
        """A hybrid model's KV groups' windows (the scheduler keeps a table per group); empty
        when one table serves every layer."""
        return self.kv_groups.windows if self.kv_groups.hybrid else ()

    @property
    def use_paged_kernel(self) -> bool:
        """Attention runs flash-attn's paged varlen kernel (CUDA)."""
        return self.attn_backend is FlashAttnBackend

    @property
    def native_decode(self) -> bool:
        """Decode attention runs the native C kernel (CPU)."""
        return self.attn_backend is NativeDecodeBackend

    @property
    def native_prefill(self) -> bool:
        """Prefill attention runs the native tiled C kernel (CPU)."""
        return self.native_decode and getattr(self.attn_builder, "native_prefill", False)

    # -- sizing ---------------------------------------------------------------------------
    def _resolve_max_model_len(self) -> int:
        limit = model_max_len(self.hf_config)
        wanted = self.config.max_model_len
        if wanted is None:
            return limit
        if wanted > limit:
            raise ValueError(
                f"max_model_len={wanted} exceeds the model's maximum context of {limit} tokens "
                "(max_position_embeddings in config.json)"
            )
        return wanted

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block over all layers (a hybrid model: one KV group's), K and V, this
        rank's heads."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return (
            2
            * self.kv_groups.num_slots
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * element
        )

    @property
    def kv_layout(self) -> dict:
        """What must be equal for another replica's KV blocks to be this one's (kv_transfer.py)."""
        from replica.kv_transfer import weights_fingerprint

        if not hasattr(self, "_weights_fingerprint"):
            self._weights_fingerprint = weights_fingerprint(self.config.model_dir())
        return {
            "model_type": str(getattr(self.hf_config, "model_type", "")),
            "weights": self._weights_fingerprint,
            "quantization": self.config.quantization,
            "dtype": str(self.dtype).removeprefix("torch."),
            "block_size": self.block_size,
            "layers": self.kv_groups.num_slots,
            "kv_groups": len(self.kv_groups.windows),
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "tp_size": self.tp.size,
            "block_bytes": self.kv_block_bytes,
            # LongRoPE rotates keys by factors this engine picks from its max_model_len
            "rope_factors": self._rope_choice(),
        }

    def _rope_choice(self) -> str:
        scaling = getattr(self.hf_config, "rope_scaling", None) or {}
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
        if kind not in ("longrope", "su"):
            return ""
        original = int(scaling.get("original_max_position_embeddings", 0) or 0)
        return "long" if self.max_model_len > original else "short"

    def _resolve_num_kv_blocks(self) -> int:
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_bytes is not None or self.device.type != "cuda":
            budget = config.kv_cache_bytes or CPU_DEFAULT_KV_CACHE_BYTES
            source = f"kv_cache_bytes={budget}"
        else:
            budget = self._profile_free_cuda_bytes()
            source = (
                f"{budget} bytes of GPU memory left at "
                f"kv_cache_memory_fraction={config.kv_cache_memory_fraction}"
            )
        blocks = budget // self.kv_block_bytes
        if blocks < 1:
            raise ValueError(
                f"{source} holds no KV block: one block of {self.block_size} tokens needs "
                f"{self.kv_block_bytes} bytes"
            )
        return int(blocks)

    def _profile_free_cuda_bytes(self) -> int:
        """Device memory the KV cache may take: the configured fraction of the GPU, less the
        weights, a worst-case forward's activations and memory held outside torch."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = self.config.max_num_batched_tokens
        seq_len = min(tokens, self.max_model_len)
        num_seqs = -(-tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        scratch = self._allocate_kv_caches(num_seqs * blocks_per_seq)
        scratch_bytes = num_seqs * blocks_per_seq * self.kv_block_bytes
        lens = [min(seq_len, tokens - i * seq_len) for i in range(num_seqs)]
        tables = [
            list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)
        ]
        with torch.inference_mode():
            groups = [tables] * (len(self.kv_groups.windows) - 1)
            hidden = self._forward([0] * sum(lens), [0] * num_seqs, lens, tables, scratch, groups)
            rows = min(self.config.max_num_seqs, hidden.shape[0])
            self.model.compute_logits(hidden[:rows])
        torch.cuda.synchronize(self.device)
        del scratch, hidden
        peak = torch.cuda.max_memory_allocated(self.device) - scratch_bytes
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        return int(total * self.config.kv_cache_memory_fraction) - peak - max(outside_torch, 0)

    def _start_kv_prefault(self) -> KVPrefaulter | None:
        """CPU: map the KV pages ahead of use on an idle-priority thread (kv_prefault.py)."""
        mib = self.config.cpu_kv_prefault_mib
        if self.device.type != "cpu" or mib == 0:
            return None
        ahead = max(1, (mib << 20) // self.kv_block_bytes)
        tensors = {id(t): t for kv in self.kv_caches for t in kv}  # a hybrid's layers share
        prefaulter = KVPrefaulter(list(tensors.values()), ahead)
        # a runner dropped without shutdown() (tests, a failed start) stops the thread, which
        # would otherwise keep the cache's memory alive
        weakref.finalize(self, prefaulter.close, 0.0)
        return prefaulter

    def shrink_kv_cache(self, num_blocks: int) -> None:
        """Keep only KV blocks 0..num_blocks-1 (a tensor-parallel group uses the smallest
        rank's pool on every rank)."""
        if not 1 <= num_blocks <= self.num_kv_blocks:
            raise ValueError(
                f"cannot shrink a KV cache of {self.num_kv_blocks} blocks to {num_blocks}"
            )
        keep = num_blocks + int(self.attn_backend.needs_sink_block)  # the last block kept: sink
        self.kv_caches = [(k[:keep], v[:keep]) for k, v in self.kv_caches]
        self.kv_tier.kv_caches = self.kv_caches
        self.num_kv_blocks = num_blocks
        self.attn_builder.bind_cache(num_blocks, num_blocks, self.max_model_len)
        if self.decode_graphs is not None:  # captured over the old cache
            logger.info("KV cache shrunk: decode steps run without CUDA graphs")
            self.decode_graphs = None
        if self.kv_prefault is not None:
            self.kv_prefault.shrink(num_blocks)

    def _allocate_kv_caches(self, num_blocks: int) -> list[KVCache]:
        """`num_blocks` blocks a layer, plus the sink block after them for a backend that
        needs one (bound to its builder here); a hybrid model's layer j of every KV group
        shares tensor j (kv_groups.py)."""
        sink = self.attn_backend.needs_sink_block
        self.attn_builder.bind_cache(num_blocks, num_blocks, self.max_model_len)
        shape = (num_blocks + int(sink), self.block_size, self.num_kv_heads, self.head_dim)
        return allocate_caches(self.kv_groups, shape, self.dtype, self.device)

    # -- one step -------------------------------------------------------------------------
    def _forward(
        self,
        input_ids: list[int],
        starts: list[int],
        query_lens: list[int],
        block_ids: list[list[int]],
        kv_caches: list[KVCache],
        group_block_ids: list[list[list[int]]] = (),
    ) -> torch.Tensor:
        ids, positions, meta = self._prepare_inputs(
            input_ids, starts, query_lens, block_ids, group_block_ids
        )
        return self.model(ids, positions, kv_caches, meta)

    def _prepare_inputs(
        self,
        input_ids: list[int],
        starts: list[int],
        query_lens: list[int],
        block_ids: list[list[int]],
        group_block_ids: list[list[list[int]]] = (),
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        meta, positions = self.attn_builder.build(starts, query_lens, block_ids)
        if group_block_ids:  # a hybrid model: each KV group's layers read their own tables
            group_metadata(self.attn_builder, meta, starts, query_lens, group_block_ids)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        return ids, positions, meta

    def _batch_inputs(
        self, batch: StepBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """`_prepare_inputs` of a StepBatch."""
        return self._prepare_inputs(
            batch.input_ids, batch.starts, batch.query_lens, batch.block_ids,
            batch.group_block_ids,
        )  # fmt: skip

    def _prefault_for(self, batch: StepBatch) -> None:
        """Have the KV prefaulter map pages up to the batch's highest block (new blocks come
        from above the highest in use)."""
        if self.kv_prefault is not None:
            tables = [t for ts in (batch.block_ids, *batch.group_block_ids) for t in ts if t]
            self.kv_prefault.need(1 + max((t[-1] for t in tables), default=0))

    @property
    def can_join(self) -> bool:
        """Whether requests may join a step under way (`execute`'s `join`): one rank (the
        others could not learn of them mid-step), no adapters (their rows are grouped for
        the whole step), and a model whose forward takes a join point."""
        return (
            self.tp.size == 1 and self.lora is None and getattr(self.model, "supports_join", False)
        )

    @torch.inference_mode()
    def execute(
        self, so: SchedulerOutput, batch: StepBatch | None = None, join=None
    ) -> RunnerOutput:
        """Run every scheduled chunk in one forward pass; sample where `sample` is set.
        `batch` is `prepare_batch(so)` when the caller built it already (the TP runner does,
        to broadcast it before every rank runs the forward). `join` (with `can_join`): asked
        before each layer, it may return requests (a SchedulerOutput) that join the step
        there: they run the layers passed on their own, then the rest with the step, and are
        sampled with it (RunnerOutput.step is then the step as it ran)."""
        if not so.scheduled:
            self.apply_kv_ops(so.kv_ops)
            return RunnerOutput({}, None)
        start = time.perf_counter()
        if batch is None:
            batch = self.prepare_batch(so)
        layout_time = time.perf_counter() - start
        joiner = None if join is None else StepJoiner(self, so, batch, join)
        logits, pooled = self._forward_step(batch, joiner)
        if joiner is not None and joiner.joined:
            so = joiner.so
        self.step_times.prepare += layout_time
        if self.tp.rank != 0:  # every rank joins the logits gather
            return RunnerOutput({}, None)
        if logits is None:
            return RunnerOutput({}, None, pooled=pooled)
        sample_start = time.perf_counter()
        # prepare_batch's row layout: sampled requests' last rows, drafted requests' rows,
        # prompt-logprob rows
        to_sample = [s for s in so.scheduled if s.sample and not s.draft]
        if so.pooling:  # a pooling request's prompt end samples nothing
            to_sample = [s for s in to_sample if s.request.pooling is None]
        drafted = [s for s in so.scheduled if s.draft]
        num_sampled = len(to_sample)
        num_draft_rows = sum(len(s.draft) + 1 for s in drafted)
        prompt_rows = self._prompt_logprob_rows(so)
        prompt_logprobs = None
        if prompt_rows:
            first = num_sampled + num_draft_rows
            start = time.perf_counter()
            prompt_logprobs = self._prompt_logprobs(logits[first:], prompt_rows)
            self.step_times.prompt_logprobs = time.perf_counter() - start
        sampled: dict[str, int] = {}
        logprobs: dict[str, tuple[float, dict[int, float]]] = {}
        if to_sample:
            out = self._sample(logits[:num_sampled], to_sample)
            sampled = {s.request_id: t for s, t in zip(to_sample, out.token_ids)}
            logprobs = {
                s.request_id: lp for s, lp in zip(to_sample, out.logprobs) if lp is not None
            }
        spec_tokens = None
        if drafted:
            rows = logits[num_sampled : num_sampled + num_draft_rows]
            verified = verify_greedy_drafts(rows, [s.draft for s in drafted])
            spec_tokens = {s.request_id: tokens for s, tokens in zip(drafted, verified)}
            for s, tokens in zip(drafted, verified):
                sampled[s.request_id] = tokens[0]
        # on CUDA the forward's kernels finish here: the sampled tokens' .tolist() waits for them
        self.step_times.sample = time.perf_counter() - sample_start
        step = so if joiner is not None and joiner.joined else None
        return RunnerOutput(sampled, logprobs or None, prompt_logprobs, spec_tokens, pooled, step)

    def _sample(self, logits: torch.Tensor, to_sample: list[ScheduledRequest]):
        """The sampler over the sampled rows: each request's params and seeded draw, its tokens
        (for penalties) and, for constrained requests, its grammar's allowed-token mask."""
        params = [s.request.sampling_params for s in to_sample]
        draws = [_seeded_draw(s.request) for s in to_sample]
        requests = [s.request for s in to_sample]
        # a grammar still behind its gate (a reasoning model's thinking) allows every token
        constrained = [
            i for i, r in enumerate(requests) if r.grammar is not None and not r.grammar.gated
        ]
        bitmask = None
        if constrained:
            start = time.perf_counter()
            bitmask = (constrained, self._fill_bitmask(requests, constrained, len(to_sample)))
            self.step_times.bitmask = time.perf_counter() - start
        return self.sampler(
            logits,
            params,
            draws,
            self.default_generator,
            histories=requests,
            token_bitmask=bitmask,
            logits_writable=True,  # this step's own rows, read by nothing after the sampler
        )

    def _fill_bitmask(self, requests, constrained: list[int], num_rows: int) -> torch.Tensor:
        """The constrained rows' grammar masks, written at their logits rows into a buffer kept
        across steps (rows [num_rows, words]; rows not in `constrained` hold stale masks the
        sampler does not read); on a GPU, copied over from pinned host memory."""
        buffer = self._bitmask_buffer
        if buffer is None or buffer.shape[0] < num_rows:
            words = (self.vocab_size + 31) // 32
            rows = max(num_rows, self.config.max_num_seqs)
            buffer = torch.empty((rows, words), dtype=torch.int32)
            if self.device.type == "cuda":
                buffer = buffer.pin_memory()
            self._bitmask_buffer = buffer
        fill_bitmask([requests[i].grammar for i in constrained], self.vocab_size, buffer,
                     constrained)  # fmt: skip
        masks = buffer[:num_rows]
        return masks if self.device.type == "cpu" else masks.to(self.device, non_blocking=True)

    @staticmethod
    def _prompt_logprob_rows(so: SchedulerOutput) -> list[tuple[ScheduledRequest, int]]:
        """(request, number of rows) for each scheduled chunk whose positions predict prompt
        tokens of a request that wants prompt logprobs: positions start .. P-2 of the chunk
        (position P-1 predicts the first output token: that is the sampled row)."""
        rows = []
        for s in so.scheduled:
            request = s.request
            if request.prompt_logprobs is None:
                continue
            end = min(s.start + s.num_tokens, request.num_prompt_tokens - 1)
            if end > s.start:
                rows.append((s, end - s.start))
        return rows

    def _prompt_logprobs(
        self, logits: torch.Tensor, rows: list[tuple[ScheduledRequest, int]]
    ) -> dict[str, tuple[int, list[tuple[float, dict[int, float]]]]]:
        """Per request: (index of its first entry, [(logprob of the next prompt token, top-k)])
        from the model's raw distribution at each of its rows."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        out = {}
        offset = 0
        for s, n in rows:
            block = logprobs[offset : offset + n]
            offset += n
            prompt = s.request.prompt_token_ids
            targets = torch.tensor(prompt[s.start + 1 : s.start + 1 + n], device=block.device)
            chosen = block.gather(1, targets[:, None])[:, 0].tolist()
            k = s.request.sampling_params.prompt_logprobs or 0
            if k:
                values, ids = block.topk(k, dim=-1)
                tops = [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            else:
                tops = [{} for _ in range(n)]
            out[s.request_id] = (s.start, list(zip(chosen, tops)))
        return out

    def prepare_batch(self, so: SchedulerOutput) -> StepBatch:
        """The step's flat token stream and per-request layout (no tensors, no requests).
        Logits rows: each sampled request's last row, in order, then every row of each
        request that runs a draft (its last token's and the draft's: the positions verified),
        then the rows of prompt positions whose logprobs are wanted (`_prompt_logprob_rows`).
        With LoRA adapters in the step the requests' rows are laid out grouped by adapter."""
        scheduled = so.scheduled  # in the order the rows are laid out
        lora_slots = []
        if self.lora is not None:
            lora_slots = self.lora.slots_of(s.request for s in scheduled)
            if any(lora_slots):  # each adapter's rows side by side: one slice in every layer
                order = sorted(range(len(scheduled)), key=lora_slots.__getitem__)
                scheduled = [scheduled[i] for i in order]
                lora_slots = [lora_slots[i] for i in order]
        input_ids: list[int] = []
        starts, query_lens, block_ids, sample_rows = [], [], [], []
        first_row: dict[int, int] = {}
        for s in scheduled:
            first_row[id(s)] = len(input_ids)
            input_ids += s.token_ids()
            starts.append(s.start)
            query_lens.append(s.num_tokens)
            block_ids.append(s.block_ids)
        draft_rows: list[int] = []
        pooling = so.pooling
        for s in so.scheduled:  # logits rows in the scheduler's order, wherever the rows are
            end = first_row[id(s)] + s.num_tokens
            if s.draft:
                draft_rows.extend(range(end - len(s.draft) - 1, end))
            elif s.sample and not (pooling and s.request.pooling is not None):
                sample_rows.append(end - 1)
        sample_rows += draft_rows
        for s, n in self._prompt_logprob_rows(so):
            sample_rows.extend(range(first_row[id(s)], first_row[id(s)] + n))
        groups = []
        if self.kv_groups.hybrid:  # per group, each request's table
            groups = [list(tables) for tables in zip(*(s.group_block_ids for s in scheduled))]
        batch = StepBatch(input_ids, starts, query_lens, block_ids, sample_rows, groups, lora_slots)
        batch.kv_ops = so.kv_ops
        if pooling:
            self._pool_spans(so, first_row, batch)
            batch.all_rows = bool(batch.pool_spans)
        return batch

    @staticmethod
    def _pool_spans(so: SchedulerOutput, first_row: dict[int, int], batch: StepBatch) -> None:
        """Each pooling request's rows to sum this step: its chunk's rows ("mean"), or its
        prompt's last row once the chunk reaches it ("last")."""
        for s in so.scheduled:
            pooling = s.request.pooling
            if pooling is None:
                continue
            first = first_row[id(s)]
            if pooling.kind == "mean":
                batch.pool_spans.append((first, s.num_tokens))
            elif s.sample:
                batch.pool_spans.append((first + s.num_tokens - 1, 1))
            else:
                continue
            batch.pool_ids.append(s.request_id)

    def forward_batch(self, batch: StepBatch) -> torch.Tensor | None:
        """The forward pass of one step on this rank; the logits of the sampled rows (full
        vocabulary after the TP gather), or None when no row is sampled. Times its phases in
        `step_times` (prepare: the input tensors; forward: the model and the LM head)."""
        if not batch.starts:  # KV tier moves alone
            self.apply_kv_ops(batch.kv_ops)
            return None
        return self._forward_step(batch)[0]

    # -- KV tiers and transfer (kv_tier.py, kv_transfer.py) ---------------------------------
    @torch.inference_mode()
    def apply_kv_ops(self, ops) -> None:
        """The scheduler's KV tier moves, in order, before anything overwrites a block."""
        if ops:
            self.kv_tier.apply(ops)

    @torch.inference_mode()
    def export_kv(self, sources: list[tuple[int, int]]) -> torch.Tensor:
        """This rank's K and V of each (pool block id, or -1 and a tier-held hash), as one CPU
        tensor [blocks, layers, 2, block_size, kv_heads, head_dim]."""
        blocks = []
        for block_id, block_hash in sources:
            if block_id >= 0:
                blocks.append(self.kv_tier.read_block(block_id))
            else:
                blocks.append(self.kv_tier.get(block_hash))
        return torch.stack(blocks)

    def kv_block_shape(self, num_blocks: int) -> torch.Tensor:
        """An empty CPU tensor shaped as `num_blocks` exported blocks of this rank."""
        shape = (num_blocks, self.kv_groups.num_slots, 2, self.block_size, self.num_kv_heads,
                 self.head_dim)  # fmt: skip
        return torch.empty(shape, dtype=self.dtype)

    def import_kv(self, hashes: list[int], data: torch.Tensor) -> None:
        """Stage blocks from another replica in this rank's host tier under their hashes."""
        for block_hash, block in zip(hashes, data):
            self.kv_tier.put(block_hash, block.to(self.dtype).clone())

    @torch.inference_mode()
    def _forward_step(
        self, batch: StepBatch, joiner: StepJoiner | None = None
    ) -> tuple[torch.Tensor | None, dict | None]:
        """forward_batch's logits, and the pooled rows of the batch's pooling requests (by
        request id; None when it has none); with `joiner`, of the step as it ran."""
        if batch.kv_ops:  # blocks evicted this step are saved before the forward reuses them
            self.kv_tier.apply(batch.kv_ops)
        graphs = self.decode_graphs
        if graphs is not None and not batch.pool_spans and graphs.fits(batch):
            start = time.perf_counter()
            logits = graphs.run(batch)
            now = time.perf_counter()
            self.step_times = StepTimes(prepare=0.0, forward=now - start)
            return logits, None
        with self._isa_scope:  # this runner's instruction-set level (native kernels' build)
            start = time.perf_counter()
            ids, positions, meta = self._batch_inputs(batch)
            rows = None
            if batch.sample_rows:
                rows = torch.tensor(batch.sample_rows, dtype=torch.long, device=self.device)
            self._prefault_for(batch)
            lora = self.lora
            if lora is not None:  # the step's rows grouped by adapter, once for every layer
                lora.begin_step(batch.lora_slots, batch.query_lens)
            # the last layer computes only the rows read (the sampled ones) past its attention,
            # unless the step pools hidden rows or runs an adapter (its rows are grouped for
            # the whole stream)
            keep = None
            if (
                rows is not None
                and len(batch.sample_rows) < len(batch.input_ids)
                and not batch.all_rows
                and not any(batch.lora_slots)
            ):
                keep = rows
            forward_start = time.perf_counter()
            try:
                if joiner is None:
                    hidden = self.model(ids, positions, self.kv_caches, meta, keep)
                else:
                    hidden = self.model(ids, positions, self.kv_caches, meta, keep, joiner)
                    if joiner.joined:
                        rows, keep = joiner.rows, joiner.keep
            finally:
                if lora is not None:
                    lora.end_step()
            logits = None
            if rows is not None:  # with keep, the model's rows are the sampled ones already
                logits = self.model.compute_logits(
                    hidden if keep is not None else hidden.index_select(0, rows)
                )
            pooled = None
            if batch.pool_spans:  # the final norm's output: what an embedding pools
                pooled = dict(zip(batch.pool_ids, pool_rows(hidden, batch.pool_spans)))
        self.step_times = StepTimes(
            prepare=forward_start - start, forward=time.perf_counter() - forward_start
        )
        return logits, pooled

    # -- LoRA adapters (replica/lora/) -------------------------------------------------------
    @property
    def lora_targets(self) -> LoRATargets:
        """The model's adaptable layers (an adapter is checked against them)."""
        if self.lora is None:
            raise RuntimeError("LoRA is off on this runner (enable_lora=false)")
        return self.lora.targets

    def add_lora(self, slot: int, adapter: PeftAdapter, name: str | None = None) -> None:
        """Install an adapter read by replica.lora.read_adapter in `slot` (1..capacity)."""
        with torch.inference_mode():
            self.lora.add(slot, adapter, name)

    def remove_lora(self, slot: int) -> None:
        self.lora.remove(slot)

    def check_health(self) -> None:
        """Nothing to check: this runner has no peer to lose, its failures raise from execute."""

    def shutdown(self) -> None:
        """Release the KV cache and weights (the runner is unusable afterwards)."""
        if self.kv_prefault is not None:
            self.kv_prefault.close()
            self.kv_prefault = None
        self.kv_tier.close()
        self.kv_caches = []
        self.model = None


def _seeded_draw(request) -> float | None:
    """A seeded sampled request's uniform number for the token it samples now (at index
    num_tokens); None for an unseeded or greedy one (the batch's generator serves it)."""
    params = request.sampling_params
    if params.seed is None or params.temperature == 0.0:
        return None
    return seeded_uniform(params.seed, request.num_tokens)
