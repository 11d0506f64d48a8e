"""One decoder for the Llama family (Llama, SmolLM2, Mistral, Qwen2 with its QKV bias), built
from tensor-parallel layers and run over a flat token stream with paged attention. Families that
differ in the MLP (mixture of experts) or normalise queries and keys (Qwen3, OLMoE) plug into it
through `build_mlp` and `qk_norm`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from replica.layers.attention import Attention, AttentionMetadata, KVCache
from replica.layers.cpu_kernels import fused_ops_available, silu_mul
from replica.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from replica.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TensorParallel,
)
from replica.layers.norm import RMSNorm
from replica.layers.qk_norm import make_qk_norms
from replica.layers.rotary import RotaryEmbedding, rope_parameters
from replica.models.windows import apply_layer_windows


def head_dim_of(hf_config: Any) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim or hf_config.hidden_size // hf_config.num_attention_heads)


def num_kv_heads_of(hf_config: Any) -> int:
    return int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)


def num_kv_heads_per_rank(hf_config: Any, tp_size: int) -> int:
    """KV heads each rank stores: a share of them, or one replica when there are fewer heads
    than ranks."""
    return max(1, num_kv_heads_of(hf_config) // tp_size)


class LlamaAttention(nn.Module):
    fused_cpu_ops = False  # set by the runner: rotary in place by the C kernel (CPU)

    def __init__(
        self,
        hf_config: Any,
        tp: TensorParallel,
        rotary: RotaryEmbedding,
        qkv_bias: bool,
        qk_norm: str | None = None,
    ) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        head_dim = head_dim_of(hf_config)
        self.qkv_proj = QKVParallelLinear(
            hidden,
            head_dim,
            hf_config.num_attention_heads,
            num_kv_heads_of(hf_config),
            qkv_bias,
            tp,
        )
        self.o_proj = RowParallelLinear(
            hf_config.num_attention_heads * head_dim,
            hidden,
            bool(getattr(hf_config, "attention_bias", False)),
            tp,
        )
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.head_dim = head_dim
        # shared by all layers; held in a tuple so it is not registered once per layer
        self._rotary = (rotary,)
        self.attn = Attention(
            self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim, head_dim**-0.5
        )
        # Qwen3, OLMoE: the query and key projections normalised in place before rotary
        self.q_norm = self.k_norm = None
        if qk_norm is not None:
            eps = hf_config.rms_norm_eps
            self.q_norm, self.k_norm = make_qk_norms(qk_norm, self.qkv_proj, eps, tp)
        clip = getattr(hf_config, "clip_qkv", None)  # OLMoE: q, k and v clamped after the norms
        self.clip_qkv = None if clip is None else float(clip)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention block's output; with `keep`, for those rows only (every row's K and V
        still reach the cache)."""
        qkv = self.qkv_proj(hidden)
        num_tokens = hidden.shape[0]
        qk_size = self.q_size + self.kv_size
        if self.q_norm is not None:
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : qk_size]
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        rotary = self._rotary[0]
        if self.fused_cpu_ops and fused_ops_available(qkv):
            # query and key heads rotated in place in the qkv rows
            rotary.rotate_(positions, qkv, qk_size // self.head_dim)
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : qk_size]
        else:
            # query and key heads rotated in one call, then split (views of one tensor)
            qk = rotary.rotate(positions, qkv[:, :qk_size].view(num_tokens, -1, self.head_dim))
            q, k = qk.view(num_tokens, qk_size).split([self.q_size, self.kv_size], dim=-1)
        out = self.attn(q, k, qkv[:, qk_size:], kv_cache, meta)
        if keep is not None:
            out = out.index_select(0, keep)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, hf_config: Any, tp: TensorParallel) -> None:
        super().__init__()
        hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
        bias = bool(getattr(hf_config, "mlp_bias", False))
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; supported: 'silu'")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias, tp)
        self.down_proj = RowParallelLinear(inter, hidden, bias, tp)

    fused_cpu_ops = False  # set by the runner: the C kernel for CPU activations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused_cpu_ops and fused_ops_available(gate_up):
            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


# (hf_config, tp, layer index) -> the layer's MLP: LlamaMLP, or a mixture of experts
MLPBuilder = Callable[[Any, TensorParallel, int], nn.Module]


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        tp: TensorParallel,
        rotary: RotaryEmbedding,
        qkv_bias: bool,
        mlp: nn.Module | None = None,
        qk_norm: str | None = None,
    ) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps)
        self.self_attn = LlamaAttention(hf_config, tp, rotary, qkv_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(hf_config, tp)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before adding it): each residual add
        is done by the norm that follows it, fused where the C kernels run. With `keep`, both
        for those rows only: past the attention, the rows nothing reads are not computed."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, keep)
        if keep is not None:
            residual = residual.index_select(0, keep)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


@dataclass
class StepJoin:
    """Requests joining a step under way at a layer boundary (the runner's step join): their
    own input ids, positions and attention metadata for the layers the step has passed, then
    the whole step's (the step's rows, then theirs) for the rest, and the rows the last
    layer computes (None: all)."""

    new_input_ids: torch.Tensor
    new_positions: torch.Tensor
    new_meta: AttentionMetadata
    positions: torch.Tensor
    meta: AttentionMetadata
    keep: torch.Tensor | None


class LlamaModel(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        tp: TensorParallel,
        qkv_bias: bool,
        build_mlp: MLPBuilder | None = None,
        qk_norm: str | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, tp)
        theta, scaling = rope_parameters(hf_config)
        self.rotary_emb = RotaryEmbedding(
            head_dim_of(hf_config), hf_config.max_position_embeddings, theta, scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                hf_config,
                tp,
                self.rotary_emb,
                qkv_bias,
                None if build_mlp is None else build_mlp(hf_config, tp, i),
                qk_norm,
            )
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
        join: Callable[[int], StepJoin | None] | None = None,
    ) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if join is not None and (joined := join(i)) is not None:
                hidden, residual = self._catch_up(joined, i, hidden, residual, kv_caches)
                positions, meta, keep, join = joined.positions, joined.meta, joined.keep, None
            rows = keep if i == last else None
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, rows)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]

    def _catch_up(self, joined: StepJoin, layer: int, hidden, residual, kv_caches):
        """The joining rows through layers 0..layer-1 on their own, appended to the step's
        rows: from `layer` on the two run as one batch."""
        new, new_residual = self.embed_tokens(joined.new_input_ids), None
        for own, kv_cache in zip(self.layers[:layer], kv_caches[:layer]):
            new, new_residual = own(
                joined.new_positions, new, new_residual, kv_cache, joined.new_meta
            )
        hidden = torch.cat([hidden, new])
        if residual is not None:
            residual = torch.cat([residual, new_residual])
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    """HF names map onto ours one to one, except the fused projections listed below."""

    supports_join = True  # forward takes `join`: requests may join a step under way

    qkv_bias = False
    qk_norm: str | None = None  # "head" (Qwen3) or "projection" (OLMoE): replica/layers/qk_norm.py
    # (our fused parameter, HF's name for one part, shard id)
    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, hf_config: Any, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.hf_config = hf_config
        self.tp = tp
        self.model = LlamaModel(hf_config, tp, self.qkv_bias, self.build_mlp, self.qk_norm)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        shared = self.model.embed_tokens.weight if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp, shared)
        apply_layer_windows(self, hf_config)  # Mistral's, Qwen2's sliding windows

    @staticmethod
    def build_mlp(hf_config: Any, tp: TensorParallel, layer_index: int) -> nn.Module:
        """The MLP of one decoder layer; mixture-of-experts families override this."""
        return LlamaMLP(hf_config, tp)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
        join: Callable[[int], StepJoin | None] | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of the flat token stream; with `keep` (row indices),
        those rows' only [len(keep), hidden], in its order: the last layer computes no other
        row past its attention (a prompt's other rows feed only the KV cache). `join(i)`,
        asked before each layer i until it answers: requests that join the step there
        (StepJoin; the hidden states returned are then the joined step's)."""
        if join is None:
            return self.model(input_ids, positions, kv_caches, meta, keep)
        return self.model(input_ids, positions, kv_caches, meta, keep, join)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the full vocabulary for the given rows (gathered across ranks)."""
        return self.lm_head(hidden)


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class MistralForCausalLM(LlamaForCausalLM):
    pass
